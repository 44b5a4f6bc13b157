"""Cluster simulator: N instances (any TP degrees) behind the router, in virtual time.

Each instance runs the real instance ``Scheduler`` (DWISE by default), so the
router and the instance scheduler compose exactly as in the live system: the
router places requests, sets each step's threshold and migrates requests at
step boundaries; each instance orders its own requests into rounds. A
round's time comes from the instance's TP profile over the round's
composition (recompute steps over the whole sequence, cached steps over one
block).

Request truth (see ``sim/cluster_scenarios.py``): a request has a true total
step count per candidate threshold and a real answer per threshold, both
from decoding it with an embedded model. Progress is the fraction of the
output committed; a step at threshold t advances it by 1 / steps(t), so a
request whose threshold changes mid-way needs an in-between number of steps.
The output has K blocks at equal progress fractions; the first step of each
block is a recompute step, the others cached steps (the approximate cache).
A migration costs a fixed control delay plus the transfer of the prompt and
committed tokens (never KV); a request moved at a cached step must recompute
on arrival. Accuracy: requests that kept one threshold take the model's
answer at that threshold; requests whose threshold changed are decoded again
by the model with the same schedule over progress (``threshold_table.replay``),
so their answers are the model's own.

Instances can come and go while the simulation runs (``add_instance``, ``drain_instance``; the
planner-driven reconfiguration of ``sim/reconfig.py`` uses them). A drained instance takes no new
requests at once and, at its next round boundary (now, if idle), hands every request it holds to
the best remaining instance through the router, as a migration: prompt and committed tokens, a
recompute on arrival. Nothing is dropped: ``ClusterResult`` counts arrivals, evacuated requests and
requests held while no instance served, and ``lost`` (arrived but never finished) must stay 0.
``call_at(t, fn)`` runs ``fn(now)`` in virtual time; ``on_arrival(spec, now)`` sees every arrival.

Step estimates (``ClusterConfig.estimator``): ``table``, the oracle totals with a synthetic error
(``TableStepEstimator``), or ``online``, the step predictor learnt from the simulated traffic
(``predictors.online.OnlineStepLearner`` behind ``OnlineStepEstimator``), started cold: every finished
request's step rows (``predictors.features.step_row``'s fields, after each step, as a live replica
sends them; the simulator has no per-step confidences, and ``sim/threshold_table.py`` records none,
so the five confidence statistics are zeros; then the request's rule and its knob and its constraint
column, ``cluster.thresholds.request_row``, the row the router asks with) are recorded, and the learner
refits synchronously whenever it is due, at that virtual instant (its wall time takes no virtual time). Either way the
result's ``estimator`` reports the error of the estimates the router served with (MAPE of remaining
steps and Spearman, over every step row of the finished requests), and for ``online`` the learning
curve: one point per refit.

Admission (``ClusterConfig.shed``): as the live ingress does, an arrival is refused when
``Router.admissible(state, now, governor.util)`` says it cannot meet its SLO even at the lowest
thresholds, with the ``AdmissionGovernor`` adjusting ``util`` from the attainment of the admitted
requests (told of a miss as soon as a request is past its deadline, not when it finishes). Refused requests are
counted in ``shed`` and as SLO misses.
"""

from __future__ import annotations

import heapq
import itertools
import math
import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from cluster import (
    OnlineStepEstimator,
    Router,
    RouterConfig,
    StepShape,
    TableStepEstimator,
    TpLatencyModel,
)
from cluster.driver import Arrival, ClusterDriver, Move
from cluster.estimator import feature_row
from cluster.state import RequestState
from cluster.thresholds import request_row
from engine.clock import VirtualClock
from engine.latency_profile import LatencyProfile
from engine.scheduler import Scheduler, SchedulerConfig
from engine.scheduler.policies import make_policy
from engine.scheduler.types import RoundPlan, RoundResult, SchedRequest, StepKind, StepOutcome

ESTIMATORS = ("table", "online")


@dataclass
class ClusterRequestSpec:
    req_id: str
    prompt_idx: int  # row of the threshold table
    category: str
    arrival: float
    prompt_tokens: int
    output_tokens: int
    steps: tuple[float, ...]  # true total steps per candidate threshold (router order)
    correct: tuple[bool, ...]  # the model's answer right at each threshold
    slo_s: float
    priority: int = 0
    prompt_features: tuple[float, ...] = ()  # words, newlines, prompt tokens (the admission predictor's inputs)


# Policies that shed at arrival unless told (`--shed off`): Remask's own, as the live ingress does
# (router.shed_over_capacity, on by default); the papers' baselines admit everything. On dilaserve-bench
# (seed 0) shedding raises remask's attainment over every arrival from 0.857 to 0.896 at 85 req/s and from
# 0.207 to 0.629 at 120 req/s; `remask simulate --scenario dilaserve-bench --policies remask --rate R
# --shed on|off --json` prints them.
SHED_DEFAULT: tuple[str, ...] = ("remask", "remask-fit")


def sheds(policy: str, shed: bool | None) -> bool:
    """Whether ``policy`` refuses arrivals that cannot meet their SLO: ``shed``, or by default the policies
    in ``SHED_DEFAULT`` (the papers' baselines admit everything)."""
    return policy in SHED_DEFAULT if shed is None else shed


@dataclass(frozen=True)
class ClusterConfig:
    tp_degrees: tuple[int, ...]  # one entry per instance
    slots: int = 32  # B per instance
    block_tokens: int = 32
    sequence_tokens: int = 396  # typical prompt + output, for the router's tables
    instance_policy: str = "dwise"
    kv_capacity_tokens: int = 250_000
    estimator_sigma: float = 0.3
    router: RouterConfig = field(default_factory=RouterConfig)
    estimator: str = "table"  # table (oracle totals, synthetic error) | online (learnt from the run's traffic)
    # online: refits at 25 and 50 finished requests, then after every 100 more (early models matter most: the
    # first few seconds of a cold start are served by the priors)
    online_refit_every: int = 100
    online_min_requests: int = 25
    online_early: tuple[int, ...] = (25, 50)
    online_admission: bool = True  # online: also learn DWISE's admission predictor (prompt features -> steps)
    shed: bool = False  # refuse arrivals that cannot meet their SLO (the live ingress's admission)

    def __post_init__(self) -> None:
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"unknown estimator {self.estimator!r}; known: {', '.join(ESTIMATORS)}")


@dataclass
class _Truth:
    spec: ClusterRequestSpec
    blocks: int
    progress: float = 0.0
    block: int = 0
    next_heavy: bool = True
    schedule: list[tuple[float, float]] = field(default_factory=list)  # (progress, threshold) where it changed
    steps: int = 0
    rows: list[list[float]] = field(default_factory=list)  # step rows after each step (online estimator)
    row_steps: list[int] = field(default_factory=list)  # steps done at each row
    served: list[float] = field(default_factory=list)  # the router's estimate at each row, at that step's threshold


class SimInstance:
    """One simulated model instance: its real scheduler, its TP profile and its state."""

    def __init__(self, inst_id: int, tp: int, profile: LatencyProfile, sched: Scheduler) -> None:
        self.inst_id, self.tp, self.profile, self.sched = inst_id, tp, profile, sched
        self.state = "serving"  # serving -> draining (no new requests; evacuates at a round boundary) -> stopped
        self.on_stopped: Callable[[float], None] | None = None
        self.busy = False
        self.slowdown = 1.0  # round time factor (another instance loading or serving on its GPUs)
        self.rounds = 0
        self.slots_filled = 0
        self.busy_s = 0.0


@dataclass
class ClusterResult:
    finished: list[tuple[ClusterRequestSpec, float, list[tuple[float, float]]]] = field(default_factory=list)
    rounds: int = 0
    slots_filled: int = 0
    busy_s: float = 0.0
    makespan_s: float = 0.0
    migrations: int = 0
    load_control_runs: int = 0
    threshold_steps: Counter = field(default_factory=Counter)
    mean_in_system: float = 0.0  # time-average number of requests in the cluster (Little's law)
    arrived: int = 0
    evacuated: int = 0  # requests moved off drained instances
    held: int = 0  # requests that waited because no instance was serving
    redirected: int = 0  # migrations whose target started draining while they travelled
    instances_started: int = 0  # after the initial ones
    instances_stopped: int = 0
    shed: int = 0  # refused on arrival (admission): SLO misses
    admission: dict = field(default_factory=dict)  # the governor's final share and cuts (shedding on)
    estimator: dict = field(default_factory=dict)  # kind, served error, learning curve (online)

    @property
    def lost(self) -> int:
        """Requests that arrived and were neither refused nor finished (0 unless something dropped them)."""
        return self.arrived - self.shed - len(self.finished)


class ClusterSimulator:
    def __init__(self, cfg: ClusterConfig, profiles: dict[int, LatencyProfile], policy: str, seed: int = 0,
                 log: bool = False) -> None:
        """``log``: keep the cluster driver's decisions (``driver.decisions``) and the world's events
        (``world``: arrivals and rounds, as a live instance reports them) for comparing with the live
        dispatcher on the same scenario."""
        self.cfg = cfg
        self.profiles = profiles
        self.clock = VirtualClock()
        shape = StepShape(cfg.block_tokens, cfg.sequence_tokens, full_sequence=True)
        self.latency = TpLatencyModel(dict(profiles), cfg.slots, shape)  # every degree an instance may have
        self.truth: dict[str, _Truth] = {}
        self.learner = self.admission_learner = None
        if cfg.estimator == "online":
            from predictors.online import OnlineAdmissionLearner, OnlineStepLearner

            every = {"refit_every": cfg.online_refit_every, "min_requests": cfg.online_min_requests,
                     "early": cfg.online_early, "seed": seed}
            self.learner = OnlineStepLearner(cfg.router.thresholds, **every)
            if cfg.online_admission:
                self.admission_learner = OnlineAdmissionLearner(**every)
            # the step learner's rows, recorded and asked, are ``request_row``'s: the step features, the
            # request's rule and knob (``RequestState.decoding``) and its constraint column (free here: 0)
            estimator = OnlineStepEstimator(self.learner, cfg.router.thresholds, row=request_row,
                                            admission=self.admission_learner)
        else:
            estimator = TableStepEstimator(cfg.router.thresholds, lambda s: self.truth[s.req_id].spec.steps,
                                           sigma=cfg.estimator_sigma, seed=seed)
        self._served = _ServedError()  # the error of the estimates the router served with
        self.curve: list[dict] = []  # online: one point per refit
        router = Router(policy, self.latency, estimator, list(enumerate(cfg.tp_degrees)), cfg.router)
        # the cluster control the live ingress runs too: admission, membership, progress, thresholds; the
        # simulator's one door into the cluster core (it never calls the router)
        self.driver = ClusterDriver(router, block_tokens=cfg.block_tokens, full_sequence=True, shed=cfg.shed, log=log)
        self.governor = self.driver.governor
        base = profiles[min(profiles)]
        self._costs = base.step_costs(cfg.block_tokens, cfg.sequence_tokens, batch=cfg.slots)
        self.insts: list[SimInstance] = []
        for tp in cfg.tp_degrees:
            self._new_inst(tp)
        self._events: list = []
        self._seq = itertools.count()
        self.states: dict[str, RequestState] = {}
        self.res = ClusterResult()
        self._th_index = {t: i for i, t in enumerate(cfg.router.thresholds)}
        self.on_arrival: Callable[[ClusterRequestSpec, float], None] | None = None
        self.world: list[tuple] | None = [] if log else None
        self._pending_arrivals = 0
        self._in_system = 0

    def _new_inst(self, tp: int) -> SimInstance:
        scfg = SchedulerConfig(slots=self.cfg.slots, kv_capacity_tokens=self.cfg.kv_capacity_tokens,
                               block_size=self.cfg.block_tokens)
        sched = Scheduler(make_policy(self.cfg.instance_policy, costs=self._costs), scfg, self.clock)
        inst = SimInstance(len(self.insts), tp, self.profiles[tp], sched)
        self.insts.append(inst)
        return inst

    # ---- reconfiguration -------------------------------------------------------------------
    def serving(self) -> list[SimInstance]:
        return [i for i in self.insts if i.state == "serving"]

    def active(self) -> bool:
        """Arrivals still to come or requests still in the cluster."""
        return self._pending_arrivals > 0 or self._in_system > 0

    def call_at(self, t: float, fn: Callable[[float], None]) -> None:
        self._push(max(t, self.clock.now()), "call", fn)

    def add_instance(self, tp: int) -> int:
        """A TP-``tp`` instance that serves from now (start-up delays are the caller's); returns its id."""
        if tp not in self.profiles:
            raise ValueError(f"no latency profile for TP-{tp}")
        inst = self._new_inst(tp)
        self.res.instances_started += 1
        if self.world is not None:
            self.world.append(("join", self.clock.now(), inst.inst_id, tp))
        self._execute(self.driver.join(inst.inst_id, tp, self.clock.now()))
        return inst.inst_id

    def drain_instance(self, inst_id: int, on_stopped: Callable[[float], None] | None = None) -> None:
        """Stop placing requests on ``inst_id``; at its next round boundary (now, if idle) its requests
        move to the serving instances (or wait for the next one) and it stops (then ``on_stopped(now)``)."""
        inst = self.insts[inst_id]
        if inst.state != "serving":
            raise ValueError(f"instance {inst_id} is {inst.state}")
        inst.state = "draining"
        inst.on_stopped = on_stopped
        self.driver.drain(inst_id, self.clock.now())
        if not inst.busy:
            self._evacuate(inst)

    def _evacuate(self, inst: SimInstance) -> None:
        """A draining instance's round boundary: its requests leave its scheduler and move (its GPUs are
        wanted: with nothing serving they wait for the next instance), and it stops."""
        for req_id in list(inst.sched.requests):
            inst.sched.abort(req_id)
            self.res.evacuated += 1
        self._execute(self.driver.evacuate(inst.inst_id, self.clock.now(), keep_if_alone=False))
        inst.state = "stopped"
        self.res.instances_stopped += 1
        if inst.on_stopped is not None:
            inst.on_stopped(self.clock.now())

    def _execute(self, moves: list[Move]) -> None:
        """Carry out the driver's moves: an arrival (or one that waited for an instance) enters its
        instance now; a request that leaves an instance travels first (a migration: prompt and committed
        tokens, never KV)."""
        now = self.clock.now()
        for m in moves:  # each with its first step's threshold on its new instance, chosen now (as live)
            if m.why == "place":
                self._enter(m.state, m.dst, m.est_rounds)
            else:
                delay = self.driver.migration_cost_ms(m.state) / 1000.0
                self._push(now + delay, "migrate", (m.state, m.dst, m.attempt))

    # ---- events --------------------------------------------------------------------------
    def _push(self, t: float, kind: str, data) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, data))

    def run(self, specs: list[ClusterRequestSpec]) -> ClusterResult:
        res = self.res
        for s in specs:
            self._push(s.arrival, "arrive", s)
        self._pending_arrivals = len(specs)
        area, last_t = 0.0, specs[0].arrival if specs else 0.0
        first = last_t
        while self._events:
            t, _, kind, data = heapq.heappop(self._events)
            area += self._in_system * (t - last_t)
            last_t = t
            self.clock.set(t)
            if kind == "arrive":
                self._in_system += 1
                self._pending_arrivals -= 1
                res.arrived += 1
                if self.on_arrival is not None:
                    self.on_arrival(data, t)
                self._arrive(data)
            elif kind == "kick":
                self._start(self.insts[data])
            elif kind == "done":
                self._in_system -= self._done(*data, res)
            elif kind == "migrate":
                st, dst, attempt = data
                if st.attempt != attempt or self.insts[dst].state != "serving":
                    res.redirected += 1  # it moved on while it travelled (its target started draining): stale
                else:  # the estimate as of its arrival there (the plans of its new instance went on meanwhile)
                    self._enter(st, dst, self.driver.estimate(st))
            elif kind == "call":
                data(t)
        res.makespan_s = last_t - first
        res.mean_in_system = area / res.makespan_s if res.makespan_s else 0.0
        res.estimator = self._estimator_report()
        res.held = self.driver.stats["held"]
        if self.cfg.shed:
            res.admission = {"util": round(self.governor.util, 4), "cuts": self.governor.cuts}
        counters = self.driver.counters()
        res.migrations, res.load_control_runs = counters["migrations"], counters["load_control_runs"]
        for inst in self.insts:
            res.rounds += inst.rounds
            res.slots_filled += inst.slots_filled
            res.busy_s += inst.busy_s
        return res

    def _arrive(self, spec: ClusterRequestSpec) -> None:
        blocks = max(1, math.ceil(spec.output_tokens / self.cfg.block_tokens))
        self.truth[spec.req_id] = _Truth(spec, blocks)
        if self.world is not None:
            self.world.append(("arrive", self.clock.now(), spec))
        features = tuple(spec.prompt_features) if self.admission_learner is not None and spec.prompt_features else None
        # at its arrival time (the clock's now): its deadline is its SLO from now
        admission = self.driver.arrive(Arrival(spec.req_id, spec.prompt_tokens, spec.output_tokens, spec.slo_s,
                                               spec.priority, admission=features), self.clock.now())
        self.states[spec.req_id] = admission.state
        if admission.move is not None:
            self._execute([admission.move])
        elif admission.shed:
            del self.truth[spec.req_id], self.states[spec.req_id]
            self.res.shed += 1
            self._in_system -= 1
        # else it waits for an instance (the driver holds it)

    def _enter(self, st: RequestState, inst_id: int, est_rounds: float | None) -> None:
        """``st`` joins instance ``inst_id``'s scheduler (arrival or the end of a migration) with the router's
        estimate of its remaining rounds."""
        tr = self.truth[st.req_id]
        tr.next_heavy = st.next_heavy  # a move at a cached step made it a recompute step
        req = SchedRequest(st.req_id, math.ceil(st.prompt_tokens / self.cfg.block_tokens), tr.blocks,
                           est_rounds, arrival=st.arrival, deadline=st.deadline,
                           priority=st.priority, full_sequence=True)
        req.blocks_done = tr.block
        req.rounds_done = tr.steps
        req.next_kind = StepKind.RECOMPUTE if tr.next_heavy else StepKind.CACHED
        inst = self.insts[inst_id]
        inst.sched.add_request(req)
        if not inst.busy:
            self._push(self.clock.now(), "kick", inst_id)

    def _start(self, inst: SimInstance) -> None:
        if inst.busy or inst.state != "serving" or not inst.sched.has_work():
            return
        plan = inst.sched.schedule()
        states = [self.states[s.req_id] for s in plan.slots]
        # chosen when the instance's previous round ended, or when the request was placed (as live)
        ths = [st.threshold for st in states]
        comp = []
        for st in states:
            seq = st.prompt_tokens + st.output_tokens
            if self.truth[st.req_id].next_heavy:
                comp.append(("recompute", seq, 0))
            else:
                comp.append(("cached", self.cfg.block_tokens, seq))
        dt = inst.profile.round_ms(comp) / 1000.0 * inst.slowdown
        inst.busy = True
        inst.rounds += 1
        inst.slots_filled += len(plan.slots)
        inst.busy_s += dt
        self._push(self.clock.now() + dt, "done", (inst, plan, states, ths, dt))

    def _done(self, inst: SimInstance, plan: RoundPlan, states: list[RequestState], ths: list[float], dt: float,
              res: ClusterResult) -> int:
        index = self._th_index
        outcomes, stepped = [], []
        finished = 0
        now = self.clock.now()
        for slot, st, t in zip(plan.slots, states, ths):
            tr = self.truth[st.req_id]
            if not tr.schedule or tr.schedule[-1][1] != t:
                tr.schedule.append((tr.progress, t))
            res.threshold_steps[t] += 1
            tr.steps += 1
            tr.progress = min(1.0, tr.progress + 1.0 / tr.spec.steps[index[t]])
            done = tr.progress >= 1.0 - 1e-9
            block = min(int(tr.progress * tr.blocks + 1e-9), tr.blocks)
            block_done = block > tr.block
            tr.block = block
            tr.next_heavy = block_done
            st.progress = tr.progress
            st.blocks_left = tr.blocks - block
            st.block_progress = tr.progress * tr.blocks - block
            st.step_in_block = 0 if block_done else st.step_in_block + 1
            nxt = StepKind.RECOMPUTE if block_done else StepKind.CACHED
            outcomes.append(StepOutcome(slot.req_id, slot.kind, self.cfg.block_tokens if block_done else 0,
                                        block_done, done, nxt))
            stepped.append((st, block_done, done))
            if done:
                finished += 1
                res.finished.append((tr.spec, now - tr.spec.arrival, tr.schedule))
            else:
                tr.row_steps.append(tr.steps)
                if self.learner is not None:  # what a replica sends after the step (no confidences here: zeros)
                    tr.rows.append(request_row(st, t))
        inst.sched.update(plan, RoundResult(outcomes))
        if self.world is not None:
            self.world.append(("round", now, inst.inst_id, dt, [(st.req_id, feature_row(st, t), heavy, done)
                                                                for (st, heavy, done), t in zip(stepped, ths)]))
        # one call into the cluster per round, answered whole (as live): the finished requests let go, the
        # migrations, and the plan of the next steps of the requests the instance holds
        outcome = self.driver.on_round(inst.inst_id, stepped, now, round_ms=dt * 1000.0)
        self._after_step(stepped, ths, now)
        for m in outcome.moves:
            inst.sched.abort(m.state.req_id)
        self._execute(outcome.moves)
        for st in outcome.finished:
            del self.truth[st.req_id], self.states[st.req_id]
        for st, _, done in stepped:
            req = None if done else inst.sched.requests.get(st.req_id)
            if req is not None:
                req.est_rounds = outcome.plan.estimates.get(st.req_id, 0.0)
                req.key = inst.sched.policy.key(req)
        inst.busy = False
        if self.learner is not None and self.learner.due():  # at this virtual instant: the fit takes no virtual time
            self._refit(now)
        if self.admission_learner is not None and self.admission_learner.due():
            self.admission_learner.refit()
        if inst.state == "draining":
            self._evacuate(inst)
        else:
            self._start(inst)
        return finished

    def _after_step(self, stepped: list[tuple[RequestState, bool, bool]], ths: list[float], now: float) -> None:
        """After the router's step event: the estimate it now serves for each request (for the error
        report), and finished requests to the learners."""
        index = self._th_index
        for (st, _, done), t in zip(stepped, ths):
            tr = self.truth[st.req_id]
            if done:
                true = [tr.steps - k for k in tr.row_steps]
                self._served.add(tr.served, true)
                if self.learner is not None:
                    self.learner.record(tr.rows, tr.row_steps, tr.steps, last_threshold=t)
                if self.admission_learner is not None and tr.spec.prompt_features:
                    mean_t = sum(st.thresholds_used) / len(st.thresholds_used) if st.thresholds_used else t
                    self.admission_learner.record([*tr.spec.prompt_features, mean_t], tr.steps, tr.blocks)
                continue
            tr.served.append(st.est[index[t]] if st.est else math.nan)

    def _refit(self, now: float) -> None:
        rec = self.learner.refit()
        if rec is None:
            return
        served = self._served.segment()  # the requests finished since the last refit, served by the model before it
        self.curve.append({"requests_seen": rec["requests_seen"], "virtual_s": round(now, 3),
                           "holdout_mape": rec["mape"], "holdout_spearman": rec["spearman"],
                           "served_mape": served["mape"], "served_spearman": served["spearman"],
                           "served_requests": served["requests"], "swapped": rec["swapped"],
                           "source": rec["source"], "version": rec["version"], "trained_on": rec["trained_on"],
                           "new": rec["new"], "replaced": rec["in_service"], "fit_s": rec["fit_s"]})

    def _estimator_report(self) -> dict:
        out = {"kind": self.cfg.estimator, **{f"served_{k}": v for k, v in self._served.total().items()}}
        if self.learner is not None:
            out.update(self.learner.describe())
            if self.admission_learner is not None:
                adm = self.admission_learner
                out["admission"] = {**adm.describe(), "learning_curve": [
                    {k: p[k] for k in ("requests_seen", "mape", "spearman", "swapped", "version", "fit_s")}
                    for p in adm.history]}
            out["after_last_refit"] = self._served.segment()
            out["learning_curve"] = self.curve
            out["fit_s_total"] = round(sum(p["fit_s"] for p in self.curve), 3)
        return out


class _ServedError:
    """MAPE and Spearman of the remaining-step estimates the router served with, against the truth: over
    the whole run and over segments (the requests finished between two refits). Compact: one float32 and
    one int32 per step row."""

    def __init__(self) -> None:
        self.pred: list[np.ndarray] = []
        self.true: list[np.ndarray] = []
        self._start = 0

    def add(self, pred: list[float], true: list[int]) -> None:
        self.pred.append(np.asarray(pred, dtype=np.float32))
        self.true.append(np.asarray(true, dtype=np.int32))

    def segment(self) -> dict:
        out = self._score(self._start)
        self._start = len(self.pred)
        return out

    def total(self) -> dict:
        return self._score(0)

    def _score(self, start: int) -> dict:
        from predictors.online import mape, spearman

        n = len(self.pred) - start
        if not n:
            return {"mape": None, "spearman": None, "requests": 0, "rows": 0}
        pred = np.concatenate(self.pred[start:]).astype(np.float64)
        true = np.concatenate(self.true[start:]).astype(np.float64)
        ok = ~np.isnan(pred)
        if not ok.any():
            return {"mape": None, "spearman": None, "requests": n, "rows": 0}
        pred, true = np.maximum(pred[ok], 1e-9), true[ok]
        sp = spearman(pred, true)
        return {"mape": round(mape(pred, true), 4), "spearman": None if math.isnan(sp) else round(sp, 4),
                "requests": n, "rows": int(ok.sum())}


def summarize(res: ClusterResult, specs: list[ClusterRequestSpec], correct: list[bool]) -> dict:
    """Figures of a run. SLO attainment counts every arrival: a request refused at arrival (``shed``)
    missed its SLO; latencies and accuracy are of the finished requests."""
    lat = sorted(r[1] for r in res.finished)
    met = sum(lat_s <= spec.slo_s + 1e-9 for spec, lat_s, _ in res.finished)

    def pct(q: float) -> float:
        return round(lat[min(len(lat) - 1, int(q * len(lat)))], 3) if lat else 0.0

    steps = sum(res.threshold_steps.values())
    return {
        "requests": len(res.finished) + res.shed,
        "slo_attainment": round(met / max(len(res.finished) + res.shed, 1), 4),
        "shed": res.shed,
        "served_slo_attainment": round(met / max(len(res.finished), 1), 4),
        "accuracy": round(sum(correct) / max(len(correct), 1), 4),
        "mean_latency_s": round(statistics.mean(lat), 3) if lat else 0.0,
        "p50_latency_s": pct(0.5),
        "p99_latency_s": pct(0.99),
        "throughput_rps": round(len(lat) / res.makespan_s, 3) if res.makespan_s else 0.0,
        "mean_threshold": round(sum(t * n for t, n in res.threshold_steps.items()) / max(steps, 1), 4),
        "step_share_by_threshold": {f"{t:g}": round(n / max(steps, 1), 4)
                                    for t, n in sorted(res.threshold_steps.items(), reverse=True)},
        "rounds": res.rounds,
        "filled_slots_per_round": round(res.slots_filled / max(res.rounds, 1), 2),
        "migrations": res.migrations,
        "load_control_runs": res.load_control_runs,
        "mean_in_system": round(res.mean_in_system, 2),
        **({"admission": res.admission} if res.admission else {}),
        **({"estimator": res.estimator} if res.estimator else {}),
    }
