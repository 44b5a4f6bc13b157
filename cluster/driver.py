"""The cluster driver: what happens to requests and instances, decided once for the live ingress and the
cluster simulator (pure Python: no asyncio, no torch, no ray).

The router (``cluster.router.Router``) answers questions: where does a request go, which threshold does
its next step take, which requests move. The driver owns everything around those answers that both
the live ``app.dispatch.Dispatcher`` and ``sim.cluster.ClusterSimulator`` need, so that neither
writes it again:

- **admission** (``arrive``): the executor hands what it knows of a new request (an ``Arrival``: its
  tokens, SLO, priority, a client's fixed threshold, the admission predictor's prompt features); the
  driver builds the request's cluster state (``RequestState``) from it and the router places it; with
  shedding on, an arrival that cannot meet its SLO even at the lowest thresholds (``Router.admissible``
  at the governor's ``util``) is refused; with no instance serving it waits (``held``) for the next one;
- **membership** (``join``, ``drain``, ``evacuate``, ``lost``): an instance joins the router; a draining
  one takes nothing new, and its requests move to the serving ones when the executor evacuates it
  (live: at once; the simulator: at its next round boundary); when none serves they wait for the next
  to join (``held``), or stay where they are when the instance can keep serving (a live replica that
  shuts down gracefully); a lost instance's requests are returned for the executor to resume;
- **progress** (``on_round``): an instance's round of steps, answered whole in one ``RoundOutcome``: the
  router's step event (with the latency profile calibrated by the round's measured time, live), the
  admission governor's early feedback (a request past its deadline is a miss now, not at its finish),
  the requests that finished (out of the router; the governor learns whether each met its SLO), the
  migrations the policy decides, and the new ``Plan`` of the instance: the thresholds of its requests'
  next steps (requests with a client-fixed threshold keep it) with the router's estimates of their
  remaining rounds at them (the instance scheduler's r_i);
- **leaving** otherwise (``finished``: a request that ended outside a round, e.g. it had committed all its
  tokens when its instance went; ``cancelled``): the request leaves the router.

The driver is the executors' one door into the cluster core: what else they and their debug views need of
the router comes from the driver's views (``serving``, ``instance``, ``request``, ``active``, ``full``,
``chooses_thresholds``, ``estimate``, ``migration_cost_ms``, ``candidate_thresholds``, ``degrees``,
``counters``, ``estimator_state``) and ``use_profile`` (a measured latency profile); neither executor calls
the router itself.

Every decision comes back as ``Move`` objects (send this request to that instance: a placement, a
migration, an evacuation or a resume), each with the threshold of the request's first step there and the
router's estimate of its remaining rounds at it; executing one (a wire message, or a migration event in
virtual time) is the caller's. Each move raises the request's ``attempt``: an executor drops progress or
arrivals of an older attempt (a request that moved on since). With ``log=True`` the driver records its
decisions (``decisions``), so the two executors can be compared on one scenario.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cluster.admission import AdmissionGovernor
from cluster.router import Router
from cluster.state import InstanceState, RequestState
from engine.latency_profile import LatencyProfile


@dataclass(frozen=True)
class Arrival:
    """A new request as an executor hands it over: ``output_tokens`` (the canvas it fills), ``slo_s`` (its
    deadline from now), ``fixed_threshold`` (the client's own: the router never changes it), ``counted`` (its
    SLO counts in the admission governor's attainment: the client set it), ``admission`` (the admission
    predictor's prompt features, ``predictors.features.ADMISSION_FEATURES`` less the threshold; None:
    none)."""

    req_id: str
    prompt_tokens: int
    output_tokens: int
    slo_s: float
    priority: int = 0
    fixed_threshold: float | None = None
    counted: bool = True
    admission: tuple[float, ...] | None = None
    decoding: str = "threshold"  # its decoding rule (engine.decoding.RULES): whose knob the router's level moves
    constrained: float = 0.0  # its text held to a grammar: 1 (predictors.features.constraint_value), free: 0
    step_cap: int | None = None  # a canvas request's own max_denoising_steps (cluster.estimator.request_step_cap)


@dataclass(frozen=True)
class Move:
    """Send ``state`` to instance ``dst`` (its ``attempt``-th placement); ``src``: the instance it leaves
    (None: none, e.g. an arrival or a request that waited); ``why``: place | migrate | evacuate | resume;
    ``threshold``: its first step's there (the client's own when it fixed one); ``est_rounds``: the
    router's estimate of its remaining rounds at that threshold (None before it has one)."""

    state: RequestState
    dst: int
    src: int | None
    why: str
    attempt: int
    threshold: float
    est_rounds: float | None


@dataclass(frozen=True)
class Plan:
    """The next steps' thresholds of an instance's requests, by request id (those whose threshold the router
    chooses), and the router's estimates of their remaining rounds at those thresholds (the requests that
    have an estimate)."""

    thresholds: dict[str, float]
    estimates: dict[str, float]


@dataclass(frozen=True)
class Admission:
    """A new request's cluster state and its placement (``move``); None when it was refused (``shed``: the
    executor answers 429) or waits for an instance (``held``)."""

    state: RequestState
    move: Move | None

    @property
    def shed(self) -> bool:
        return self.state.shed

    @property
    def held(self) -> bool:
        return self.move is None and not self.state.shed


@dataclass(frozen=True)
class RoundOutcome:
    """What an instance's round decided, whole: ``moves`` (the migrations the policy decided, already
    accounted in the router, each with its threshold), ``finished`` (the requests whose last step it was: out
    of the router, the governor told), ``plan`` (the next steps of the requests the instance still holds)."""

    moves: list[Move]
    finished: list[RequestState]
    plan: Plan


class ClusterDriver:
    def __init__(self, router: Router, *, block_tokens: int = 32, full_sequence: bool = True, shed: bool = False,
                 calibrate: bool = False, per_instance_limit: int | None = None, log: bool = False) -> None:
        """``block_tokens``, ``full_sequence``: the served model's block size and attention (a full-sequence
        model's cache is approximate: each block starts with a recompute step), for the requests' states;
        ``shed``: refuse arrivals that cannot meet their SLO; ``calibrate``: scale the latency profiles by
        the rounds' measured times (live); ``per_instance_limit``: requests an instance may hold (a placement
        on a fuller one goes to the least full instead); ``log``: keep the decisions in ``decisions``."""
        self.router = router  # the executors never reach it: they ask the driver (its views below)
        self.block_tokens, self.full_sequence = block_tokens, full_sequence
        self.governor = AdmissionGovernor()
        self.shed, self.calibrate, self.per_instance_limit = shed, calibrate, per_instance_limit
        self.draining: set[int] = set()  # take nothing new (in the router while they hold requests)
        self.stranded: set[int] = set()  # draining, evacuated when no other served: they keep theirs until a join
        self.held: list[RequestState] = []  # requests waiting for an instance (arrivals and orphans)
        self.stats = {"shed": 0, "held": 0, "evacuated": 0, "migrated": 0}
        self.decisions: list[tuple] | None = [] if log else None

    # ---- views ---------------------------------------------------------------------------------
    def serving(self) -> list[int]:
        """Instances that take new requests."""
        return [i.inst_id for i in self.router.instances]

    def instance(self, inst_id: int | None) -> InstanceState | None:
        """The router's view of an instance, serving or draining (its requests, their next steps' kinds, its
        TP degree); None when it is not (or no longer) in the router."""
        return self.router.by_id.get(inst_id) if inst_id is not None else None

    def request(self, req_id: str) -> RequestState | None:
        """The router's state of an active request (placed, moving or waiting); None once it left."""
        return self.router.requests.get(req_id)

    def active(self) -> list[str]:
        """The ids of the requests the cluster holds: placed, moving, or waiting for an instance."""
        return list(self.router.requests) + [s.req_id for s in self.held if s.req_id not in self.router.requests]

    def degrees(self) -> list[int]:
        """The TP degrees the latency model has a profile for (an instance may join with any of them)."""
        return sorted(self.router.latency.profiles)

    def full(self) -> bool:
        """Every serving instance holds ``per_instance_limit`` requests (True when none serves; False with
        no limit)."""
        limit = self.per_instance_limit
        return limit is not None and all(i.n >= limit for i in self.router.instances)

    @property
    def chooses_thresholds(self) -> bool:
        """The policy chooses each step's threshold (Alg. 1); else every step takes the fixed one."""
        return self.router.policy.dynamic

    def migration_cost_ms(self, state: RequestState) -> float:
        """What moving ``state`` to another instance costs: its prompt and committed tokens over the link, and
        the fixed cost (the simulator delays a move's arrival by it)."""
        return self.router.migration_cost_ms(state)

    def candidate_thresholds(self) -> tuple[float, ...]:
        """The thresholds the policy chooses among (the router's configuration)."""
        return tuple(self.router.cfg.thresholds)

    def counters(self) -> dict:
        """The router's policy and step estimator, its counts (migrations, load-control runs) and the latency
        model's calibration scale (measured over profiled round time, to 3 decimals)."""
        policy = self.router.policy
        return {"policy": getattr(policy, "name", type(policy).__name__),
                "estimator": type(self.router.estimator).__name__, **self.router.stats,
                "latency_scale": round(self.router.latency.scale, 3)}

    def estimator_state(self) -> dict | None:
        """What the router's step estimator says of itself (its ``describe()``: e.g. the steps per canvas per
        level ``CanvasStepEstimator`` learnt); None for one that keeps no account."""
        describe = getattr(self.router.estimator, "describe", None)
        return describe() if describe is not None else None

    def use_profile(self, tp: int, prof: LatencyProfile) -> bool:
        """A latency profile measured for TP degree ``tp`` (a replica's own, at its start): the router's from
        now on, unless it is the measurement already in use (the same ``measured_at``: False). Without an
        attention term of its own (it measured one prompt length) it keeps the profile's it replaces."""
        old = self.router.latency.profiles.get(tp)
        stamp = prof.meta.get("measured_at")
        if old is not None and stamp is not None and old.meta.get("measured_at") == stamp:
            return False
        if old is not None and not prof.attn_ms_per_pair:
            prof.attn_ms_per_pair, prof.ref_context = old.attn_ms_per_pair, old.ref_context
        self.router.latency.set_profile(tp, prof)
        return True

    def _log(self, *entry) -> None:
        if self.decisions is not None:
            self.decisions.append(entry)

    def _move(self, state: RequestState, dst: int, src: int | None, why: str, now: float) -> tuple:
        """A decision to move ``state``: its threshold comes once every move of the event is decided
        (``_answer``: a threshold weighs the instance's requests at their next steps' kinds)."""
        attempt = state.attempt = state.attempt + 1
        self._log(round(now, 9), why, state.req_id, src, dst)
        return state, dst, src, why, attempt

    def _answer(self, decided: list[tuple], now: float) -> list[Move]:
        """The moves of one event, each with its first step's threshold on its new instance (chosen now) and
        the estimate of its remaining rounds at it."""
        out = []
        for state, dst, src, why, attempt in decided:
            t = self._threshold_for(state, now)
            out.append(Move(state, dst, src, why, attempt, t, self.estimate(state)))
        return out

    # ---- admission -------------------------------------------------------------------------------
    def arrive(self, req: Arrival, now: float) -> Admission:
        """A new request, arrived ``now``: its cluster state, placed (``Admission.move``), refused
        (``Admission.shed``: the caller answers 429) or waiting for an instance (``Admission.held``)."""
        state = RequestState(req.req_id, now, now + req.slo_s, req.prompt_tokens, req.output_tokens,
                             self.block_tokens, req.priority, self.full_sequence,
                             fixed_threshold=req.fixed_threshold, counted=req.counted)
        state.decoding, state.constrained, state.step_cap = req.decoding, float(req.constrained), req.step_cap
        if req.fixed_threshold is not None:
            state.threshold = req.fixed_threshold
        if req.admission is not None:
            state.extra["admission"] = tuple(req.admission)
        return Admission(state, self._admit(state, now))

    def _admit(self, state: RequestState, now: float) -> Move | None:
        if not self.router.instances:
            self._hold(state, now)
            return None
        self.router.add_request(state, now)
        # no shedding on a prior's guess (OnlineStepEstimator.ready): the learners never see what it refuses
        if (self.shed and getattr(self.router.estimator, "ready", True)
                and not self.router.admissible(state, now, self.governor.util)):
            self.router.reject(state)
            state.shed = True
            self.stats["shed"] += 1
            self._log(round(now, 9), "shed", state.req_id, None, None)
            return None
        state.epoch = self.governor.epoch if self.shed and state.counted else -1
        return self._answer([self._placed(state, state.instance, None, "place", now)], now)[0]

    def _placed(self, state: RequestState, inst_id: int, src: int | None, why: str, now: float) -> tuple:
        """``state`` was just placed on ``inst_id`` by the router: past the per-instance limit it goes to the
        least full instance instead."""
        limit = self.per_instance_limit
        if limit is not None and self.router.by_id[inst_id].n > limit:
            here = self.router.by_id[inst_id]
            dst = min(self.router.instances, key=lambda i: (i.n, i.inst_id))
            if dst is not here:
                here.remove(state)
                dst.add(state)
                inst_id = dst.inst_id
        return self._move(state, inst_id, src, why, now)

    def _hold(self, state: RequestState, now: float) -> None:
        self.held.append(state)
        self.stats["held"] += 1
        self._log(round(now, 9), "hold", state.req_id, state.instance, None)

    def unhold(self, state: RequestState) -> bool:
        """``state`` no longer waits (cancelled, or it waited too long: the caller fails it)."""
        try:
            self.held.remove(state)
        except ValueError:
            return False
        self.router.finish(state)
        return True

    # ---- membership ------------------------------------------------------------------------------
    def join(self, inst_id: int, tp: int, now: float) -> list[Move]:
        """A new instance serves from now: the requests of draining instances move to the serving ones,
        and the held ones are placed (arrivals as arrivals, without a second admission test: they waited)."""
        self.router.add_instance(inst_id, tp)
        moves = []
        for src in sorted(self.stranded):
            moves += self._evacuate(src, now)
        held, self.held = self.held, []
        for state in held:
            if state.req_id in self.router.requests:  # an active request whose instance went away
                moves.append(self._placed(state, self.router.place(state, now=now), None, "resume", now))
            else:
                self.router.add_request(state, now)
                state.epoch = self.governor.epoch if self.shed and state.counted else -1
                moves.append(self._placed(state, state.instance, None, "place", now))
        return self._answer(moves, now)

    def drain(self, inst_id: int, now: float) -> None:
        """``inst_id`` takes nothing new from now; its requests move when the executor calls ``evacuate``."""
        inst = self.router.by_id.get(inst_id)
        if inst is None or inst_id in self.draining:
            return
        self.draining.add(inst_id)
        self.router.instances = [i for i in self.router.instances if i is not inst]
        self._log(round(now, 9), "drain", None, inst_id, None)

    def evacuate(self, inst_id: int, now: float, keep_if_alone: bool = True) -> list[Move]:
        """Move a draining instance's requests to the serving instances (as the router places them; no KV
        travels: a full-sequence request recomputes on arrival) and forget the instance. With none serving:
        with ``keep_if_alone`` nothing happens (it goes on serving them; ``join`` moves them later), else
        the instance goes and its requests wait for the next one to join (``held``)."""
        return self._answer(self._evacuate(inst_id, now, keep_if_alone), now)

    def _evacuate(self, inst_id: int, now: float, keep_if_alone: bool = True) -> list[tuple]:
        if inst_id not in self.router.by_id:
            return []
        if not self.router.instances and keep_if_alone:
            self.stranded.add(inst_id)
            return []
        self.draining.discard(inst_id)
        self.stranded.discard(inst_id)
        moves = []
        for state in self._remove(inst_id):
            self.stats["evacuated"] += 1
            dst = self.router.place(state, now=now)
            if dst is None:
                self._hold(state, now)
            else:
                moves.append(self._placed(state, dst, inst_id, "evacuate", now))
        return moves

    def lost(self, inst_id: int, now: float) -> list[RequestState]:
        """``inst_id`` is gone (died, disconnected): it leaves the router; its requests (unplaced) are
        returned for the caller to ``resume`` (or fail)."""
        if inst_id not in self.router.by_id:
            return []
        self.draining.discard(inst_id)
        self.stranded.discard(inst_id)
        self._log(round(now, 9), "lost", None, inst_id, None)
        return self._remove(inst_id)

    def _remove(self, inst_id: int) -> list[RequestState]:
        inst = self.router.by_id[inst_id]
        if inst not in self.router.instances:  # drained: out of placement already
            self.router.instances.append(inst)
        return self.router.remove_instance(inst_id)

    def resume(self, state: RequestState, now: float, exclude: int | None = None) -> Move | None:
        """Place an active request again (its instance went away or refused it), not on ``exclude``; None:
        no instance can take it (when none serves it waits in ``held``)."""
        dst = self.router.place(state, exclude, now)
        if dst is None:
            if not self.router.instances:
                self._hold(state, now)
            return None
        return self._answer([self._placed(state, dst, None, "resume", now)], now)[0]

    # ---- progress ----------------------------------------------------------------------------------
    def on_round(self, inst_id: int, stepped: Sequence[tuple[RequestState, bool, bool]], now: float,
                 round_ms: float | None = None, kinds: dict | None = None) -> RoundOutcome:
        """An instance's round: ``stepped`` is (request, its next step is heavy, finished) per request that
        stepped (progress fields already written); ``round_ms``: what the round took (live: measured;
        calibrates the profile when ``calibrate``); ``kinds``: the round's steps per kind when the instance
        counts them. Answers whole (``RoundOutcome``): the finished requests (out of the router, the
        governor told whether each met its SLO), the migrations the policy decided (already accounted in
        the router; with the thresholds of their first steps on their new instances) and the instance's new
        plan."""
        router = self.router
        if self.calibrate and round_ms:
            inst = router.by_id[inst_id]
            if kinds:
                heavy = kinds.get("prefill", 0) + kinds.get("recompute", 0)
                light = kinds.get("denoise", 0) + kinds.get("cached", 0)
            else:
                heavy = round(len(stepped) * inst.n_heavy / max(inst.n, 1))
                light = len(stepped) - heavy
            router.latency.calibrate(inst.tp, heavy, light, round_ms)
        migrations = router.on_step(inst_id, stepped, now)
        if self.shed:
            g = self.governor
            for state, _, done in stepped:
                if not done and state.epoch == g.epoch and now > state.deadline:
                    state.epoch = -1  # counted now, not again when it finishes
                    g.finished(False, now, self.stats["shed"])
        finished = [state for state, _, done in stepped if done]
        for state in finished:
            self.finished(state, now)
        decided = []
        for state, dst in migrations:
            self.stats["migrated"] += 1
            decided.append(self._move(state, dst, inst_id, "migrate", now))
        moves = self._answer(decided, now)
        return RoundOutcome(moves, finished, self._plan(inst_id, now))

    def _plan(self, inst_id: int, now: float, states: Sequence[RequestState] | None = None) -> Plan:
        """The thresholds of the next steps of ``states`` (default: every request on ``inst_id`` whose
        threshold the router chooses) with the estimates of their remaining rounds at them. Fixed
        thresholds are not the router's: left out."""
        inst = self.router.by_id.get(inst_id)
        if inst is None:
            return Plan({}, {})
        if states is None:
            states = [self.router.requests[r] for r in inst.requests if r in self.router.requests]
        states = [s for s in states if s.fixed_threshold is None]
        if not states:
            return Plan({}, {})
        before = [s.threshold for s in states]
        thresholds = {}
        for s, t, old in zip(states, self.router.plan_thresholds(inst_id, states, now), before):
            thresholds[s.req_id] = t
            if t != old:
                self._log(round(now, 9), "threshold", s.req_id, inst_id, t)
        return Plan(thresholds, {s.req_id: self.router.remaining_steps(s) for s in states if s.est})

    def _threshold_for(self, state: RequestState, now: float) -> float:
        """The threshold of a request's next step on the instance it was just placed on."""
        if state.fixed_threshold is not None:
            return state.fixed_threshold
        return self._plan(state.instance, now, [state]).thresholds[state.req_id]

    def estimate(self, state: RequestState) -> float | None:
        """The router's estimate of ``state``'s remaining rounds at its threshold (None before any)."""
        return self.router.remaining_steps(state) if state.est else None

    # ---- leaving ----------------------------------------------------------------------------------
    def finished(self, state: RequestState, now: float) -> None:
        """``state`` finished (all its tokens, a stop, its budget): it leaves the router, and the governor
        learns whether it met its SLO when it was admitted in the current epoch. A round's finished requests
        go through here in ``on_round``; an executor calls it for a request that ended outside a round."""
        self.router.finish(state)
        if state.epoch >= 0 and state.epoch == self.governor.epoch:
            self.governor.finished(now <= state.deadline + 1e-9, now, self.stats["shed"])
        state.epoch = -1

    def cancelled(self, state: RequestState) -> None:
        """``state`` left without finishing (the client went away, or it failed)."""
        if state in self.held:
            self.held.remove(state)
        self.router.finish(state)
