"""Cluster-level experiments (DiLaServe, and DWISE inside its instances).

The cluster simulator (``sim.cluster``) takes the instance scheduling policy (``ClusterConfig.
instance_policy``) and the router policy independently, so the combined policy and each part alone
run on the same requests:

- ``infaas/fcfs``, ``llumnix/fcfs``: DiLaServe's baselines (fixed threshold 0.9, FCFS instances, as
  the vLLM instances they were adapted to);
- ``remask/fcfs``: DiLaServe alone (Alg. 1-3 across instances, FCFS inside);
- ``infaas/dwise``, ``llumnix/dwise``: DWISE alone (SRPT inside each instance, fixed 0.9, the
  baselines' dispatch: DWISE has no cluster level);
- ``remask/dwise``: Remask, the combination.

Migration ablation router variants (objects, not registered): ``remask-no-migration`` and
``remask-any-step`` (moves at any step, as Llumnix does, so a move at a cached step costs a recompute).
A diagnostic variant, ``remask-plan-walk``, is the router before its migration walk followed load
control's order: it walks a round's requests in the order the instance handed them back.

Accuracy is the embedded model's (``sim.cluster_scenarios.accuracy_of``): requests that kept one
threshold take the table's answer; mixed-threshold requests are decoded again. ``max_replays`` caps
those replays per run (quick mode): the mixed-threshold requests' accuracy is then estimated from a
seeded random sample, and the report says so.
"""

from __future__ import annotations

import functools
import math
import random
import statistics
import time
from dataclasses import dataclass, field, replace

from cluster import RouterConfig
from cluster.placement import best_instance, migration_gain_ms
from cluster.policies import RemaskPolicy, walk_order
from engine.latency_profile import load_tp_profiles
from sim.cluster import ClusterConfig, ClusterRequestSpec, ClusterResult, ClusterSimulator, summarize
from sim.cluster_scenarios import (
    ClusterScenario,
    accuracy_of,
    candidate_thresholds,
    get_cluster_scenario,
    make_specs,
    offered_rate,
    scenario_capacity,
)
from sim.report.checks import trace_hash
from sim.threshold_table import ThresholdTable, load_table, step_thresholds

ROLES = {
    "infaas/fcfs": "INFaaS (baseline)",
    "llumnix/fcfs": "Llumnix (baseline)",
    "remask/fcfs": "DiLaServe alone",
    "infaas/dwise": "DWISE alone",
    "llumnix/dwise": "DWISE alone (Llumnix dispatch)",
    "remask/dwise": "Remask (combined)",
    "remask-plan-walk/dwise": "Remask, old migration walk in the instance's plan order (diagnostic)",
}
INSTANCE = {"fcfs": "fcfs-mixed", "dwise": "dwise"}


class NoMigration(RemaskPolicy):
    name = "remask-no-migration"

    def migrations(self, router, src, stepped):
        return []


class AnyStepMigration(RemaskPolicy):
    """Remask's gain test, but at any step boundary: a move at a cached step makes the next step a
    recompute (``Router.move``), a cost this variant does not price in."""

    name = "remask-any-step"

    def migrations(self, router, src, stepped):
        out, dst, lat = [], None, 0.0
        for req in sorted(stepped, key=walk_order):
            if dst is None:
                dst, lat = best_instance(router.latency, router.instances, req.next_heavy, exclude=src.inst_id)
                if dst is None:
                    break
            steps_ahead = req.est[req.cap] / max(req.blocks_left, 1) if req.est else 1.0
            gain = migration_gain_ms(router.latency, req, src, lat * (1.0 + router.cfg.migration_margin), steps_ahead)
            if gain > router.migration_cost_ms(req) + 0.5 * lat:
                out.append((req, dst))
                router.move(req, src, dst)
                dst = None
        return out


class PlanWalk(RemaskPolicy):
    """Remask's router as it was: after a round it considers the round's requests for migration in the
    order the instance scheduler handed them back (its plan order: oldest first under FCFS, shortest
    remaining first under SRPT); the shipped router walks them in load control's order (priority, then
    arrival)."""

    name = "remask-plan-walk"

    def migrations(self, router, src, stepped):
        return self.walk(router, src, stepped)


ROUTER_VARIANTS = {"remask-no-migration": NoMigration, "remask-any-step": AnyStepMigration,
                   "remask-plan-walk": PlanWalk}


@dataclass
class ClusterSetup:
    sc: ClusterScenario
    table: ThresholdTable
    rcfg: RouterConfig
    profiles: dict
    specs: list[ClusterRequestSpec]
    cfg: ClusterConfig
    rate: float
    seed: int
    capacity_rps: float | None = None  # the setup's cluster at the top candidate threshold (scenario_capacity)

    @property
    def load(self) -> float | None:
        return self.rate / self.capacity_rps if self.capacity_rps else None

    @property
    def offered_hash(self) -> str:
        return trace_hash((s.req_id, s.arrival) for s in self.specs)


@functools.lru_cache(maxsize=4)
def _table(model: str, prompts: int) -> ThresholdTable:
    return load_table(model, prompts, thresholds=RouterConfig().thresholds)


def _scenario(all_thresholds: bool = False, **overrides) -> tuple[ClusterScenario, ThresholdTable, RouterConfig, dict]:
    sc = replace(get_cluster_scenario("dilaserve-bench"), **overrides)
    if all_thresholds:
        sc = replace(sc, quality_tolerance=None)
    table = _table(sc.model, sc.table_prompts)
    rcfg = RouterConfig(thresholds=candidate_thresholds(table, sc.quality_tolerance))
    profiles = load_tp_profiles(sc.profile, sorted(set(sc.tp_degrees) | {1}))
    return sc, table, rcfg, profiles


def capacity_rps(all_thresholds: bool = False, **overrides) -> float:
    """The cluster's capacity (req/s) for the ``dilaserve-bench`` requests with ``overrides``
    (``scenario_capacity``: its instances at the top candidate threshold, each at its SLO occupancy)."""
    sc, table, rcfg, profiles = _scenario(all_thresholds, **overrides)
    return scenario_capacity(sc, table, profiles, rcfg.thresholds).rps


def setup(n: int, load: float | None = None, seed: int = 0, *, rate: float | None = None,
          all_thresholds: bool = False, arrivals=None, **overrides) -> ClusterSetup:
    """The ``dilaserve-bench`` requests (``overrides``: any ``ClusterScenario`` field, e.g. ``slo_factor``,
    ``tp_degrees``, ``output_tokens``, ``prompt_scale``, ``profile``), Poisson at ``load`` x the cluster's
    capacity (``scenario_capacity``) or at ``rate`` req/s, or at the times ``arrivals`` (``rate`` then
    their mean rate, for the record)."""
    sc, table, rcfg, profiles = _scenario(all_thresholds, **overrides)
    cap = scenario_capacity(sc, table, profiles, rcfg.thresholds).rps
    rate = offered_rate(rate, load, cap, sc.load * cap)
    specs = make_specs(sc, table, n, rate, seed, profiles, rcfg.thresholds, arrivals=arrivals)
    seq = sum(s.prompt_tokens + s.output_tokens for s in specs) // max(len(specs), 1)
    cfg = ClusterConfig(sc.tp_degrees, sc.slots, sc.block_tokens, seq, router=rcfg)
    return ClusterSetup(sc, table, rcfg, profiles, specs, cfg, rate, seed, cap)


@dataclass
class ClusterRun:
    combo: str  # "router/instance"
    summary: dict
    latencies: list[float]
    little: dict
    finished_hash: str
    wall_s: float
    per_request: list[tuple[float, float, float, float]] = field(default_factory=list)  # arrival, lat, slo, thr

    def attainment(self, slo_scale: float = 1.0) -> float:
        """SLO attainment with every SLO scaled by ``slo_scale`` (for policies that never read SLOs)."""
        pr = self.per_request
        return sum(lat <= slo * slo_scale + 1e-9 for _, lat, slo, _ in pr) / max(len(pr), 1)


def mean_threshold(schedule: list[tuple[float, float]]) -> float:
    """Progress-weighted threshold of one request's schedule [(progress where it changed, threshold)]."""
    if not schedule:
        return float("nan")
    out = 0.0
    for (p, t), nxt in zip(schedule, [*schedule[1:], (1.0, 0.0)]):
        out += (min(nxt[0], 1.0) - p) * t
    return out / max(1.0 - schedule[0][0], 1e-9)


def estimate_accuracy(table: ThresholdTable, res: ClusterResult, model: str, max_replays: int | None,
                      seed: int) -> tuple[float, float, str]:
    """(accuracy, 95% half-width, scope) over finished requests.

    Requests whose model steps kept one threshold take the table's answer. Without ``max_replays`` every
    mixed-threshold request is decoded again (exact). With it, mixed requests split into those whose
    thresholds all give the same answer in the table (A: that answer, corrected by the mean difference
    replay - table answer over a random sample of replays: a control variate) and the rest (B: replayed, a
    random sample if more than ``max_replays``)."""
    fin = res.finished
    if not fin:
        return 0.0, 0.0, "no requests"
    col = {t: i for i, t in enumerate(table.thresholds)}
    exact: list[bool] = []
    agree, disagree = [], []
    for f in fin:
        spec, _, sched = f
        used = set(step_thresholds(table, spec.prompt_idx, sched))
        answers = {table.correct[spec.prompt_idx][col[t]] for t in used}
        if len(used) == 1:
            exact.append(next(iter(answers)))
        elif len(answers) == 1:
            agree.append((f, next(iter(answers))))
        else:
            disagree.append(f)
    mixed = len(agree) + len(disagree)
    if max_replays is None or mixed <= max_replays:
        ok = accuracy_of(table, [f for f, _ in agree] + disagree, model)
        return (sum(exact) + sum(ok)) / len(fin), 0.0, f"all {len(fin)} answers ({mixed} mixed-threshold replays)"
    rng = random.Random(seed)
    n_b = min(len(disagree), max_replays)
    sample_b = rng.sample(disagree, n_b) if n_b < len(disagree) else disagree
    ok_b = accuracy_of(table, sample_b, model)
    k_a = min(len(agree), max(10, max_replays - n_b))
    sample_a = rng.sample(agree, k_a)
    ok_a = accuracy_of(table, [f for f, _ in sample_a], model)
    diffs = [int(o) - int(proxy) for o, (_, proxy) in zip(ok_a, sample_a)]
    p_b = sum(ok_b) / max(n_b, 1)
    d_a = sum(diffs) / max(k_a, 1)
    total = sum(exact) + len(disagree) * p_b + sum(proxy for _, proxy in agree) + len(agree) * d_a
    var = 0.0
    if n_b < len(disagree) and n_b > 1:
        var += len(disagree) ** 2 * p_b * (1 - p_b) / n_b * (1 - n_b / len(disagree))
    if k_a:  # the differences' variance, with the mismatch rate smoothed ((k + 1) / (n + 2)) so 0 of n is not certainty
        q = (sum(d != 0 for d in diffs) + 1) / (k_a + 2)
        var += len(agree) ** 2 * q * (1 - q) / k_a * (1 - k_a / len(agree))
    half = 1.96 * math.sqrt(var) / len(fin)
    scope = (f"{len(exact)} one-threshold answers from the table; {len(disagree)} mixed whose thresholds disagree "
             f"in the table, {n_b} replayed; {len(agree)} mixed whose thresholds agree, table answer corrected by "
             f"{k_a} replays ({sum(d != 0 for d in diffs)} differed)")
    return total / len(fin), half, scope


def _count_full_rounds(sim: ClusterSimulator) -> dict[str, int]:
    """Counts, over every instance's rounds, those planned while the instance held more requests than its
    B slots (only then does the order inside an instance decide who runs)."""
    cnt = {"rounds": 0, "over": 0}
    for inst in sim.insts:
        sched, plan = inst.sched, inst.sched.schedule

        def counted(sched=sched, plan=plan):
            cnt["rounds"] += 1
            cnt["over"] += len(sched.requests) > sched.cfg.slots
            return plan()

        sched.schedule = counted
    return cnt


def run_combo(st: ClusterSetup, combo: str, max_replays: int | None = None, accuracy: bool = True) -> ClusterRun:
    router, inst = combo.split("/")
    policy = ROUTER_VARIANTS[router]() if router in ROUTER_VARIANTS else router
    cfg = replace(st.cfg, instance_policy=INSTANCE.get(inst, inst))
    t0 = time.perf_counter()
    sim = ClusterSimulator(cfg, st.profiles, policy, st.seed)
    over = _count_full_rounds(sim)
    res = sim.run(st.specs)
    summary = summarize(res, st.specs, [])
    summary["over_b_rounds_frac"] = round(over["over"] / max(over["rounds"], 1), 4)
    summary["instances"] = len(cfg.tp_degrees)
    summary["in_system_per_instance"] = round(res.mean_in_system / max(len(cfg.tp_degrees), 1), 2)
    if accuracy:
        acc, half, scope = estimate_accuracy(st.table, res, st.sc.model, max_replays, st.seed)
        summary["accuracy"], summary["accuracy_ci95"], summary["accuracy_scope"] = round(acc, 4), round(half, 4), scope
    else:
        summary["accuracy"], summary["accuracy_ci95"], summary["accuracy_scope"] = None, None, "not computed"
    lat = [f[1] for f in res.finished]
    x = len(lat) / res.makespan_s if res.makespan_s else 0.0
    little = {"L": res.mean_in_system, "X": x, "W": statistics.fmean(lat) if lat else 0.0}
    per = [(s.arrival, lat_s, s.slo_s, mean_threshold(sched)) for s, lat_s, sched in res.finished]
    fh = trace_hash((s.req_id, s.arrival) for s, _, _ in res.finished)
    return ClusterRun(combo, summary, lat, little, fh, time.perf_counter() - t0, per)
