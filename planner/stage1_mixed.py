"""Stage 1 with mixed rounds (``Stage1Config(rounds="mixed")``): what an instance's requests see when
every round holds all of them, recompute and cached steps together.

The separate-rounds model of ``planner.stage1`` costs a step at a batch of b steps of its own kind and
lets a class spread its recompute and its cached steps over different batch sizes. On an instance
every active request takes one step per round, and a round's forwards of the two kinds add up. So:

- **Occupancy per TP degree.** Each TP group runs at one occupancy level ``l`` (requests per round,
  binary ``z[d, l]``, one level per degree): every request routed there sees its rounds at that level.
  The group's throughput is ``l / M(l)`` steps per ms, M the expected round time; stability asks the
  group's steps per second to stay within ``utilisation x R[d]`` of it. The smallest level that
  carries the load is the one the group's queue settles at (Little's law), and the objective picks it.
- **Mixed round times.** With a share rho_t of the workload's steps recompute steps at threshold t (all
  classes at t; rate-weighted over classes and their step groups), the other ``l - 1`` requests of a
  round are J ~ Binomial(l - 1, rho_t) recompute steps (at the workload's mean sequence length) and the
  rest cached steps; a step's latency is the expected round time with it in it, by its kind. A
  request's latency is its recompute steps times the first plus its cached steps times the second.
- **A class's step distribution.** ``StepModel.spread`` splits a class into step groups (share of its
  requests, steps relative to the mean), each with its own SLO (the SLO scale times its own isolated
  latency, or the class's explicit SLO scaled to its steps). The router does not know a request's steps
  when it places it, so a class's groups share its placement ``y[c, t, d, l]`` (the share of its
  requests at threshold t on degree d at level l); each group's latency is checked on its own. The
  short requests that unmask a block per step (all recompute steps, each in a round that also carries
  the others' cached forward) then need a TP degree whose rounds at its occupancy stay within their
  per-step budget.
- **Soft SLOs.** A group's requests placed at (threshold, degree, level) count at the share of them
  within SLO there (``MixedTables.within_slo``; linear in the placement): all or none at the level's
  occupancy (``Stage1Config.occupancy="level"``), or the share of a birth-death queue's occupancies
  whose latency is within it (``"queue"``). The objective is lexicographic: the share of requests
  within their SLOs first (``slo_met``), then the average threshold per output token (primary), then
  the average SLO slack (secondary).
- **Attention.** A recompute step's attention over its sequence is in its curve (profiled on whole
  sequences), as the router and the simulator count it; cached steps add theirs beyond the profile's
  reference context.
- **Refusals** (``Stage1Config.shed``, the router's admission control): a share of a class may be
  refused at arrival (``r[c, t]``), and the share of a group's requests placed where they would miss
  may be refused (``e[q, t, d, l]``); refused requests are outside their SLO and cost no capacity, so past a
  configuration's capacity the share within SLO falls gradually. Without refusals only an unstable load
  is infeasible (then: all TP-1 at the lowest thresholds, as in the separate-rounds model).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import numpy as np

from engine.latency_profile import LatencyProfile
from planner.capacity import CapacityPlan, _fill, _infeasible_mixed
from planner.costs import StepModel
from planner.milp import SOLVED, Milp, Rows, solve_milp
from planner.workload import WorkloadClass

DEFAULT_LEVELS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 32)
SLO_WEIGHT = 100.0  # objective weight of the share of requests within SLO: above any threshold difference
# HiGHS's relative gap here: the SLO share and the thresholds are resolved (to 1e-3 of SLO_WEIGHT), the slack,
# a tie-breaker, is not searched to the end (it made solves hit the time limit)
REL_GAP = 1e-4


@dataclass(frozen=True)
class MixedTables:
    """Step groups q (class ``group_class[q]``), thresholds t, degrees d, occupancy levels l."""

    degrees: tuple[int, ...]
    levels: tuple[int, ...]
    thresholds: tuple[float, ...]
    group_class: np.ndarray  # (Q,) class index
    group_share: np.ndarray  # (Q,) share of its class's requests
    s_rec: np.ndarray  # (Q, T) recompute steps per request
    s_cac: np.ndarray  # (Q, T) cached steps per request
    latency: np.ndarray  # (Q, T, D, L) ms per request, all its steps at that level
    step_ms: np.ndarray  # (T, D, L) instance ms per step (round time / occupancy)
    isolated: np.ndarray  # (Q,) alone on TP-1 at the highest threshold (the SLO base), ms
    rho: np.ndarray  # (T,) the workload's recompute share of steps
    # the queue model (``_queue``): ms per request when its rounds hold n = 1..N requests (N the largest
    # level), the wait for a place of an arrival that meets k - 1 >= N others (k = 1..K), the share of
    # arrivals that meet occupancy k at each level, and the workload's mean steps per request
    latency_n: np.ndarray  # (Q, T, D, N)
    wait_ms: np.ndarray  # (T, D, K)
    occupancy: np.ndarray  # (T, D, L, K)
    mean_steps: np.ndarray  # (T,)

    def within_slo(self, slo: np.ndarray, model: str = "queue") -> np.ndarray:
        """(Q, T, D, L) the share of group q's requests within ``slo[q]`` (ms) at each threshold, degree and
        level. "level": 1 or 0, every request at the level itself (the fluid model). "queue": the share of
        the occupancy distribution an arrival meets whose latency is within it. A request's rounds do not
        all hold what it met on arrival: the occupancy drifts back toward the level's mean as requests come
        and go, at about the pace the population turns over (a mean request's life), so over a life of x
        such times it averages m + (k - m)(1 - e^-x)/x (the mean of an exponential decay): a short request
        lives with what it met, a long one with about the mean."""
        if model == "level":
            return (self.latency <= slo[:, None, None, None] * (1 + 1e-9)).astype(float)
        Q, T, D, N = self.latency_n.shape
        K = self.occupancy.shape[-1]
        k = np.arange(1, K + 1, dtype=float)
        mean = self.occupancy @ k  # (T, D, L)
        x = np.maximum((self.s_rec + self.s_cac) / self.mean_steps[None, :], 1e-9)  # (Q, T) lives
        keep = (1.0 - np.exp(-x)) / x  # (Q, T) share of the deviation kept over the life
        served = np.minimum(k, N)  # beyond N the request waits, then runs at N
        avg = mean[None, :, :, :, None] + keep[:, :, None, None, None] * (served - mean[None, :, :, :, None])
        avg = np.clip(avg, 1.0, N)  # (Q, T, D, L, K) the occupancy its rounds average
        lo = np.minimum(np.floor(avg).astype(int), N) - 1  # linear interpolation in latency_n (0-based)
        hi = np.minimum(lo + 1, N - 1)
        frac = avg - (lo + 1)
        qi, ti, di = (np.arange(n).reshape(shape) for n, shape in
                      ((Q, (Q, 1, 1, 1, 1)), (T, (1, T, 1, 1, 1)), (D, (1, 1, D, 1, 1))))
        lat, nxt = self.latency_n[qi, ti, di, lo], self.latency_n[qi, ti, di, hi]
        lat = lat + frac * (nxt - lat) + self.wait_ms[None, :, :, None, :]
        ok = lat <= slo[:, None, None, None, None] * (1 + 1e-9)
        return (self.occupancy[None] * ok).sum(axis=-1)

    @property
    def class_steps(self) -> np.ndarray:
        """(C, T) mean steps per request of each class (its groups weighted by share)."""
        C = int(self.group_class.max()) + 1
        out = np.zeros((C, len(self.thresholds)))
        np.add.at(out, self.group_class, self.group_share[:, None] * (self.s_rec + self.s_cac))
        return out


def _binom(n: int, p: float) -> np.ndarray:
    """P(J = j), j = 0..n, J ~ Binomial(n, p)."""
    j = np.arange(n + 1)
    logc = np.array([math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) for k in j])
    if p <= 0.0:
        return (j == 0).astype(float)
    if p >= 1.0:
        return (j == n).astype(float)
    return np.exp(logc + j * math.log(p) + (n - j) * math.log1p(-p))


def _curve(prof: LatencyProfile, kind: str, tokens, steps) -> np.ndarray:
    """``prof.curve_ms`` over arrays of token and step counts (0 for no tokens): one forward of ``steps``
    steps sharing ``tokens``, at the profile's reference context."""
    return prof.curve_ms_array(kind, tokens, steps)


def _queue(round_all: np.ndarray, mean_steps: np.ndarray, levels: tuple[int, ...],
           utilisation: float, factor: int, sub: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """The queue model of an instance at each level: requests arrive (Poisson) at a rate the level carries
    (up to ``utilisation`` x the rate its rounds complete them; a request takes ``mean_steps`` rounds,
    and above the level below's), and leave at the rate
    of the occupancy they are at (k requests in rounds of ``round_all[k]`` ms: k / (steps x round) per
    second; beyond the largest level, that level's rate, the rest waiting for a place). Its stationary
    distribution (a birth-death chain) is what an arrival meets (Poisson arrivals see time averages).

    Returns the wait for a place of an arrival that meets k - 1 others (k = 1..K; beyond the largest level
    N, k - N departures) and, per threshold, degree and level, the share of arrivals whose rounds hold k
    requests (themselves included)."""
    T, D, N = round_all.shape
    K = factor * N
    k = np.arange(1, K + 1)
    kk = np.minimum(k, N) - 1
    mu = np.minimum(k, N)[None, None, :] / (mean_steps[:, None, None] * round_all[:, :, kk] / 1e3)  # (T, D, K) /s
    wait_ms = np.maximum(k - N, 0)[None, None, :] * 1e3 / mu[:, :, N - 1:N]  # (T, D, K)
    occupancy = np.zeros((T, D, len(levels), K))
    below = np.zeros((T, D))
    for m, lv in enumerate(levels):
        top = utilisation * mu[:, :, lv - 1]  # (T, D) arrivals per second the level carries
        # the level is the smallest that carries the load: the load lies between the level below's and its own;
        # the distribution is averaged over ``sub`` rates spread across that interval
        for i in range(sub):
            lam = below + (i + 0.5) / sub * (top - below)
            logp = np.concatenate([np.zeros((T, D, 1)), np.cumsum(np.log(lam[..., None] / mu), axis=2)], axis=2)
            p = np.exp(logp - logp.max(axis=2, keepdims=True))[..., :K]  # an arrival meets j = 0..K-1 others
            occupancy[:, :, m] += p / p.sum(axis=2, keepdims=True) / sub
        below = top
    return wait_ms, occupancy


def mixed_tables(classes: list[WorkloadClass], profiles: dict[int, LatencyProfile], model: StepModel,
                 levels: tuple[int, ...] = DEFAULT_LEVELS, utilisation: float = 0.9,
                 queue_factor: int = 3) -> MixedTables:
    """The tables of a Stage 1 solve; ``utilisation``: the share of a level's throughput that arrivals
    fill (the stability bound: the queue model's arrival rate at each level); ``queue_factor``: the
    queue model follows occupancies up to this many times the largest level."""
    degrees, thresholds = tuple(sorted(profiles)), tuple(model.thresholds)
    if not levels or any(level < 1 for level in levels) or list(levels) != sorted(set(levels)):
        raise ValueError(f"levels must be increasing positive occupancies, got {levels}")
    blk = float(model.block_tokens)
    gc, gs, gf = [], [], []
    for c in range(len(classes)):
        for share, factor in model.spread:
            gc.append(c)
            gs.append(share)
            gf.append(factor)
    Q, T, D = len(gc), len(thresholds), len(degrees)
    group_class, group_share = np.array(gc), np.array(gs)
    s_rec, s_cac = np.zeros((Q, T)), np.zeros((Q, T))
    for q in range(Q):
        out = classes[gc[q]].output_tokens
        for t, th in enumerate(thresholds):
            s_rec[q, t], s_cac[q, t] = model.steps(out, th, gf[q])
    seq_q = np.array([classes[c].input_tokens + classes[c].output_tokens for c in gc], dtype=float)
    rate = np.array([classes[c].rate for c in gc]) * group_share
    weight = rate if rate.sum() > 0 else group_share
    rho = (weight[:, None] * s_rec).sum(axis=0) / (weight[:, None] * (s_rec + s_cac)).sum(axis=0)  # (T,)
    seq = float((weight * seq_q).sum() / weight.sum())  # the other requests' sequence length
    top_level = levels[-1]
    occ = np.arange(1, top_level + 1)  # every occupancy up to the largest level
    lat_all, round_all = np.zeros((Q, T, D, top_level)), np.zeros((T, D, top_level))
    for k, d in enumerate(degrees):
        prof = profiles[d]
        # attention beyond the profile's reference context, per query token of a cached step (a recompute step's
        # attention over its whole sequence is in its curve, measured on whole sequences, as the router counts it)
        far = max(seq - prof.ref_context, 0.0) * prof.attn_ms_per_pair  # the others'
        own_far = np.maximum(seq_q - prof.ref_context, 0.0) * prof.attn_ms_per_pair  # ... group q's own
        for t in range(T):
            r = float(rho[t])
            attn_other = (1 - r) * blk * far  # expected attention extra of one other step
            for m, lv in enumerate(occ):
                # a round at occupancy lv: J ~ Bin(lv, rho) recompute steps, lv - J cached
                j = np.arange(lv + 1)
                full = _binom(lv, r) @ (_curve(prof, "recompute", j * seq, j)
                                        + _curve(prof, "cached", (lv - j) * blk, lv - j))
                round_all[t, k, m] = full + lv * attn_other + prof.overhead_ms
                # a step's round: it and lv - 1 others, J ~ Bin(lv - 1, rho) of them recompute steps
                j = np.arange(lv)
                pj = _binom(lv - 1, r)
                others = (lv - 1) * attn_other + prof.overhead_ms
                rec = (_curve(prof, "recompute", seq_q[:, None] + j[None, :] * seq, j[None, :] + 1)
                       + _curve(prof, "cached", (lv - 1 - j) * blk, lv - 1 - j)[None, :]) @ pj
                cac = pj @ (_curve(prof, "recompute", j * seq, j) + _curve(prof, "cached", (lv - j) * blk, lv - j))
                lat_all[:, t, k, m] = (s_rec[:, t] * (rec + others)
                                       + s_cac[:, t] * (cac + blk * own_far + others))
    at = np.asarray(levels) - 1
    latency, step_ms = lat_all[..., at], round_all[..., at] / np.asarray(levels, dtype=float)
    mean_steps = (weight[:, None] * (s_rec + s_cac)).sum(axis=0) / weight.sum()  # (T,)
    wait_ms, occupancy = _queue(round_all, mean_steps, levels, utilisation, queue_factor)
    base = profiles[degrees[0]]
    top = T - 1
    iso_rec = _curve(base, "recompute", seq_q, np.ones(Q))
    iso_cac = _curve(base, "cached", np.full(Q, blk), np.ones(Q)) + blk * np.maximum(seq_q - base.ref_context, 0) * \
        base.attn_ms_per_pair
    isolated = s_rec[:, top] * (iso_rec + base.overhead_ms) + s_cac[:, top] * (iso_cac + base.overhead_ms)
    return MixedTables(degrees, tuple(levels), thresholds, group_class, group_share, s_rec, s_cac, latency,
                       step_ms, isolated, rho, lat_all, wait_ms, occupancy, mean_steps)


def rank(plan) -> tuple:
    """Order of plans in this model: the share within SLO, then the primary, then the secondary objective."""
    if not plan.feasible:
        return (-1.0, 0.0, 0.0)
    return (round(plan.slo_met, 4), round(plan.primary, 4), plan.secondary)


def single_degree_counts(degrees, gpus: int, slots: dict[int, int] | None = None) -> list[dict[int, int]]:
    """The configurations with every GPU in instances of one TP degree (as many as its slots allow), one per
    degree that has a slot for an instance."""
    out = []
    for d in degrees:
        counts = {k: (min(gpus // d, (slots or {}).get(d, gpus // d)) if k == d else 0) for k in degrees}
        if counts[d]:
            out.append(counts)
    return out


def full_counts(degrees, gpus: int, slots: dict[int, int] | None = None) -> list[dict[int, int]]:
    """Every configuration whose instances use all ``gpus`` (within each degree's slots), as counts per degree."""
    degrees = sorted(degrees)
    out: list[dict[int, int]] = []

    def walk(i: int, left: int, counts: dict[int, int]) -> None:
        if i == len(degrees):
            if left == 0:
                out.append(dict(counts))
            return
        d = degrees[i]
        for k in range(min(left // d, (slots or {}).get(d, gpus // d)) + 1):
            counts[d] = k
            walk(i + 1, left - k * d, counts)
        counts.pop(d, None)

    walk(0, gpus, {})
    return out


def plan_capacity_mixed(classes: list[WorkloadClass], gpus: int, profiles: dict[int, LatencyProfile],
                        model: StepModel, config, slots: dict[int, int] | None = None,
                        fixed_counts: dict[int, int] | None = None):
    """Stage 1 in the mixed-rounds model (arguments as ``stage1.plan_capacity``, which calls it).

    Choosing the counts, the MILP's answer (its search capped at ``config.time_limit_s``) is compared
    with each single-degree configuration (every GPU in TP-d instances, evaluated with the counts fixed,
    one small solve each): the best by ``rank`` is the plan. On loads where the occupancy levels and the
    split of classes over degrees leave the search far from done at the cap, this keeps the plan at
    least as good as the best single-degree one."""
    tab = mixed_tables(classes, profiles, model, config.levels, config.utilisation)
    if fixed_counts is not None:
        return _solve_mixed(classes, gpus, tab, config, slots, fixed_counts)
    best, solves = None, []
    if config.mixed_search == "milp":
        best = _solve_mixed(classes, gpus, tab, config, slots, None)
        solves = list(best.solves)
    menu = full_counts(tab.degrees, gpus, slots) if config.mixed_search == "every" else \
        single_degree_counts(tab.degrees, gpus, slots)
    for counts in menu:
        alt = _solve_mixed(classes, gpus, tab, config, slots, counts)
        solves += list(alt.solves)
        if best is None or rank(alt) > rank(best):
            best = alt
    if best is None:
        raise ValueError("no TP degree has a slot for an instance")
    return replace(best, solves=tuple(solves))


def _solve_mixed(classes: list[WorkloadClass], gpus: int, tab: MixedTables, config, slots, fixed_counts):
    start = time.perf_counter()
    C, T, D, L, Q = len(classes), len(tab.thresholds), len(tab.degrees), len(tab.levels), len(tab.group_class)
    rate = np.array([c.rate for c in classes], dtype=float)
    out = np.array([c.output_tokens for c in classes], dtype=float)
    gc = tab.group_class
    # SLO per group: the class's explicit SLO scaled to the group's isolated latency, else slo_scale x it
    class_iso = np.zeros(C)
    np.add.at(class_iso, gc, tab.group_share * tab.isolated)
    slo = np.array([classes[c].slo_ms * tab.isolated[q] / class_iso[c] if classes[c].slo_ms is not None
                    else config.slo_scale * tab.isolated[q] for q, c in enumerate(gc)])
    w = rate * out if rate.sum() > 0 else out
    w = w / w.sum()
    cv = rate / rate.sum() if rate.sum() > 0 else np.full(C, 1.0 / C)
    v = cv[gc] * tab.group_share  # (Q,) share of all requests
    cap = np.array([(slots or {}).get(d, gpus // d) for d in tab.degrees], dtype=float)

    # where requests are placed: by class (the router knows a request's class, not its steps), or by step group
    # (``config.placement == "group"``: an SLO-fit router places each request where its predicted steps meet
    # its SLO, so a class's short and long requests may go to different degrees); a unit's requests share
    # their class's threshold
    by_group = config.placement == "group"
    unit_of = np.arange(Q) if by_group else gc  # (Q,) each group's placement unit
    unit_class = gc if by_group else np.arange(C)  # (U,)
    U = len(unit_class)
    # columns: x[c, t] | R[d] | z[d, l] | y[u, t, d, l] | e[q, t, d, l] (with ``shed``) | r[u, t] (with ``shed``)
    ox, oR, oz = 0, C * T, C * T + D
    oy = oz + D * L
    oe = oy + U * T * D * L
    yu, yt, yd, yl = (a.ravel() for a in np.meshgrid(np.arange(U), np.arange(T), np.arange(D), np.arange(L),
                                                      indexing="ij"))
    yc = unit_class[yu]
    ycol = oy + np.arange(len(yu))
    sq, sy = np.nonzero(unit_of[:, None] == yu[None, :])  # group q, a y column of its unit
    # (Q, T, D, L) share of a group's requests within SLO there, to 1e-4 (tinier coefficients trouble the solver)
    met = np.round(tab.within_slo(slo, config.occupancy), 4)
    met_p = met[sq, yt[sy], yd[sy], yl[sy]]  # ... per pair (group, y column)
    # what admission control refuses: requests that would miss their SLO there (e[p] for these pairs p)
    es = np.nonzero(met_p < 1.0 - 1e-9)[0] if config.shed else np.zeros(0, dtype=int)
    ne = len(es)
    ecol = oe + np.arange(ne)
    orr = oe + ne  # r[u, t] (with ``shed``): the share of unit u refused at arrival, placed nowhere
    nr_ = U * T if config.shed else 0
    n = orr + nr_
    rows = Rows()
    block = rows.add

    xc, xt = np.repeat(np.arange(C), T), np.tile(np.arange(T), C)
    block(xc, ox + np.arange(C * T), np.ones(C * T), np.ones(C), np.ones(C))  # one threshold per class
    # a unit's requests at its class's threshold are all placed: sum_{d,l} y[u, t, d, l] = x[c(u), t]
    # (less what is refused at arrival: sum_{d,l} y[u, t, d, l] + r[u, t] = x[c(u), t])
    ut_u, ut_t = np.repeat(np.arange(U), T), np.tile(np.arange(T), U)
    block(np.r_[yu * T + yt, ut_u * T + ut_t, (ut_u * T + ut_t)[:nr_]],
          np.r_[ycol, ox + unit_class[ut_u] * T + ut_t, orr + np.arange(nr_)],
          np.r_[np.ones(len(yu)), -np.ones(U * T), np.ones(nr_)], np.zeros(U * T), np.zeros(U * T))
    # refused requests (admission control): at most the group's share placed there that would miss,
    # e[q, t, d, l] <= (1 - met) y[u, t, d, l]
    block(np.r_[np.arange(ne), np.arange(ne)], np.r_[ecol, ycol[sy[es]]], np.r_[np.ones(ne), -(1.0 - met_p[es])],
          np.full(ne, -np.inf), np.zeros(ne))
    # stability per degree: steps per second x instance ms per step <= utilisation x R[d] (x 1000); refused
    # requests cost nothing
    group_steps = tab.s_rec + tab.s_cac
    if by_group:  # steps per second of a unit's requests, all at (t, d, l)
        unit_load = rate[gc][yu] * tab.group_share[yu] * group_steps[yu, yt]
    else:
        unit_load = rate[yc] * tab.class_steps[yc, yt]
    load_y = unit_load * tab.step_ms[yt, yd, yl] / 1e3
    load_e = (rate[gc[sq]] * tab.group_share[sq] * group_steps[sq, yt[sy]] * tab.step_ms[yt[sy], yd[sy], yl[sy]]
              / 1e3)[es]
    block(np.r_[yd, yd[sy[es]], np.arange(D)], np.r_[ycol, ecol, oR + np.arange(D)],
          np.r_[load_y, -load_e, np.full(D, -config.utilisation)], np.full(D, -np.inf), np.zeros(D))
    block(np.zeros(D, dtype=int), oR + np.arange(D), np.asarray(tab.degrees, dtype=float), [-np.inf], [gpus])
    zd = np.repeat(np.arange(D), L)
    block(zd, oz + np.arange(D * L), np.ones(D * L), np.full(D, -np.inf), np.ones(D))  # one level per degree
    # requests only at a degree's level: y[c, t, d, l] <= z[d, l]
    ny = len(yu)
    block(np.r_[np.arange(ny), np.arange(ny)], np.r_[ycol, oz + yd * L + yl], np.r_[np.ones(ny), -np.ones(ny)],
          np.full(ny, -np.inf), np.zeros(ny))
    A = rows.matrix(n)
    col_lo, col_hi = np.zeros(n), np.ones(n)
    col_hi[oR:oR + D] = cap
    if fixed_counts is not None:
        fixed = np.array([fixed_counts.get(d, 0) for d in tab.degrees], dtype=float)
        col_lo[oR:oR + D] = col_hi[oR:oR + D] = fixed
        for k in np.nonzero(fixed == 0)[0]:  # no instances of that degree: no level, nothing placed there
            col_hi[oz + k * L:oz + (k + 1) * L] = 0.0
            col_hi[ycol[yd == k]] = 0.0
    integer = np.zeros(n, dtype=bool)
    integer[:oy] = True  # x, R, z
    cost = np.zeros(n)  # minimise -SLO_WEIGHT x (share within SLO) - primary + w x (mean latency / SLO)
    cost[ox:ox + C * T] = -(w[xc] * np.asarray(tab.thresholds)[xt])
    lat_y = tab.latency[:, yt, yd, yl]  # (Q, Y)
    # the share within SLO: a group's requests placed at (t, d, l) count at the share of them within SLO there
    np.add.at(cost, ycol[sy], v[sq] * (config.secondary_weight * lat_y[sq, sy] / slo[sq] - SLO_WEIGHT * met_p))
    res = solve_milp(Milp(cost, A, *rows.bounds(), col_lo, col_hi, integer),
                     config.solver, config.time_limit_s, REL_GAP)
    names = [c.name for c in classes]
    class_slo = np.bincount(gc, tab.group_share * slo, minlength=C)
    if res.status not in SOLVED or res.z is None:
        info = replace(res.info, seconds=time.perf_counter() - start)
        return _infeasible_mixed(classes, tab.thresholds, tab.degrees, w, gpus, cap, class_slo, fixed_counts, (info,))
    z = res.z
    x = z[:C * T].reshape(C, T)
    R = z[oR:oR + D]
    level = z[oz:oz + D * L].reshape(D, L)
    y = np.maximum(z[oy:oe], 0.0)
    credit = np.bincount(sq, met_p * y[sy], minlength=Q)  # share of each group within SLO
    e = np.maximum(z[oe:orr], 0.0)
    refused = np.bincount(sq[es], e, minlength=Q)
    if nr_:
        refused += np.maximum(z[orr:], 0.0).reshape(U, T).sum(axis=1)[unit_of]
    group_lat = np.bincount(sq, lat_y[sq, sy] * y[sy], minlength=Q)
    load = np.bincount(yd, y * load_y, minlength=D) - np.bincount(yd[sy[es]], e * load_e, minlength=D)
    chosen = x.argmax(axis=1)
    th = np.asarray(tab.thresholds)
    counts = {d: int(round(k)) for d, k in zip(tab.degrees, R)}
    if fixed_counts is None:
        counts = _fill(counts, load, tab.degrees, gpus, cap)
    lv = {d: tab.levels[int(level[i].argmax())] for i, d in enumerate(tab.degrees) if load[i] > 1e-9}
    info = replace(res.info, seconds=time.perf_counter() - start)
    return CapacityPlan(
        counts=counts, thresholds={nm: tab.thresholds[t] for nm, t in zip(names, chosen)},
        primary=float((w * th[chosen]).sum()), secondary=float(1.0 - v @ (group_lat / slo)), feasible=True,
        gpus=gpus, batch_recompute=dict(lv), batch_cached=dict(lv),
        utilisation={d: float(load[i] / counts[d]) for i, d in enumerate(tab.degrees) if counts[d]},
        latency_ms=dict(zip(names, np.bincount(gc, tab.group_share * group_lat, minlength=C).round(3).tolist())),
        slo_ms=dict(zip(names, class_slo.round(3).tolist())), solves=(info,),
        secondary_weight=config.secondary_weight, slo_met=float(v @ np.minimum(credit, 1.0)),
        groups=[{"class": names[c], "share": round(float(tab.group_share[q]), 4),
                 "steps": round(float(tab.s_rec[q, chosen[c]] + tab.s_cac[q, chosen[c]]), 1),
                 "latency_ms": round(float(group_lat[q]), 3), "slo_ms": round(float(slo[q]), 3),
                 "within_slo": round(float(min(credit[q], 1.0)), 4), "refused": round(float(refused[q]), 4)}
                for q, c in enumerate(gc)])
