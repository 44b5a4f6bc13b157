"""The planner beside the ingress: how many Denoiser replicas of each TP degree should run.

``PlannerService`` runs beside the ingress, which sees every arrival. It
feeds the planner's workload monitor, and a background thread calls
``Planner.maybe_replan`` (Stage 1 every period, the 10% hysteresis, Stage 2's
minimum-disruption transition). A transition is followed under the rules
the cluster simulator follows too (``cluster.transition.TransitionFollower``):
a start goes as soon as its node's GPUs are free, a stop only once every
earlier start serves. The service publishes the replica counts of the
actions issued so far; an issued start is done once the instances of its
degree that joined the ingress's router reach the count, a stop once they
fall to it (or after ``step_timeout_s`` without progress). So capacity only
drops where Stage 2 said it must, e.g. stop two TP-1 replicas before the
TP-2 one that needs their GPUs, and new replicas serve before old ones go.
With ``make_before_break`` (``planner.make_before_break``; on by default
when replicas hold half a GPU or less per rank, so a new one fits beside an
old one) every start goes first, the TP-2 replica loading on the GPUs the
two TP-1 ones keep serving on, and the stops follow once it serves: Serve
stops the old replicas, which drain into the new one (the dispatcher moves
their requests at once), and no request waits for an instance. The last
transitions are kept (``history``: the targets and joined instances at each
step) for ``/debug/planner``.
The Ingress reports these targets as custom autoscaling metrics
(``record_autoscaling_stats``: ``target_tp<d>``).

Serve applies the targets through the autoscaling policies of ``app.autoscaling``.

The planner's model-dependent inputs are measured from the traffic (``planner.inputs``): the ingress
hands the service every arrival (``observe``), every finished request (``observe_finished``: steps
per output token at each threshold, the SLO scale) and each replica's measured latency profile
(``set_profile``); ``describe()`` (``/debug/planner``) lists every input with its source. Arrivals and
finished requests are queued without a lock (the ingress never waits for a solve in progress) and
reach the planner at the thread's next look.

Requests on a replica that Serve stops are resumed on the others from their
committed tokens (``app.dispatch``); while no instance is up they wait.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from app.autoscaling import initial_counts
from app.config import AppConfig, PlannerArgs
from cluster.transition import TransitionFollower

log = logging.getLogger(__name__)


def pack(counts: dict[int, int], gpus_per_node: tuple[int, ...]):
    """Planner ``Instance`` objects for replica counts, largest degree first, first node that fits."""
    from planner.transition import Instance

    free = list(gpus_per_node)
    out = []
    for d in sorted(counts, reverse=True):
        for k in range(counts[d]):
            node = next((n for n, f in enumerate(free) if f >= d), None)
            if node is None:
                raise ValueError(f"{counts} does not fit nodes of {list(gpus_per_node)} GPUs")
            free[node] -= d
            out.append(Instance(f"tp{d}-{k}", node, d))
    return out


class PlannerService:
    """The planner beside the ingress: arrivals in, replica-count targets out (thread-safe)."""

    def __init__(self, planner, degrees: list[int], initial: dict[int, int], check_s: float = 1.0,
                 step_timeout_s: float = 180.0, clock: Callable[[], float] = time.monotonic,
                 make_before_break: bool = False) -> None:
        """``make_before_break``: a transition's starts go first, its stops once they serve (replicas must fit
        beside the ones they replace: ``cluster.transition.TransitionFollower``)."""
        self.planner, self.degrees, self.clock = planner, sorted(degrees), clock
        self.check_s, self.step_timeout_s = check_s, step_timeout_s
        self.make_before_break = make_before_break
        self.targets = {d: initial.get(d, 0) for d in self.degrees}
        self.live = {d: 0 for d in self.degrees}
        self.follower: TransitionFollower | None = None  # the transition under way
        self.step_started = clock()  # when the transition last made progress
        self.transitions = 0
        self.history: deque[dict] = deque(maxlen=self.HISTORY)  # the last transitions, their steps as followed
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # the ingress's events, queued without the lock (deque appends are atomic); drained under it
        self._arrivals: deque[tuple[float, int, int]] = deque(maxlen=self.QUEUE_LIMIT)
        self._finished: deque[tuple] = deque(maxlen=self.QUEUE_LIMIT)

    QUEUE_LIMIT = 200_000  # events queued between two looks of the thread (beyond: the oldest are dropped)
    HISTORY = 8  # transitions kept for describe()

    # ---- inputs (ingress thread) -------------------------------------------------------------
    def observe(self, input_tokens: int, output_tokens: int) -> None:
        """A request arrived (its prompt tokens and output budget, max_tokens). O(1), never waits."""
        self._arrivals.append((self.clock(), input_tokens, output_tokens))

    def observe_finished(self, prompt_tokens: int, output_tokens: int, steps: int, threshold: float | None,
                         slo_s: float | None, e2e_s: float, tp: int) -> None:
        """A request finished: ``output_tokens`` the output size its arrival was observed with (max_tokens),
        ``steps`` its denoising steps (prompt prefill steps excluded), ``threshold`` the mean threshold of its
        steps, ``slo_s`` its SLO, ``e2e_s`` its latency, ``tp`` the TP degree of the instance that finished
        it. O(1), never waits."""
        self._finished.append((prompt_tokens, output_tokens, steps, threshold, slo_s, e2e_s, tp))

    def set_profile(self, tp: int, profile) -> None:
        """A replica's measured latency profile (``engine.latency_profile.LatencyProfile``) for its TP degree."""
        with self._lock:
            self.planner.set_profile(tp, profile)

    def _drain(self) -> None:
        """Hand the queued events to the planner (under the lock)."""
        from planner.inputs import FinishedRequest

        arrivals, finished = self._arrivals, self._finished
        while arrivals:
            t, i, o = arrivals.popleft()
            self.planner.observe(i, o, now=t)
        while finished:
            self.planner.observe_finished(FinishedRequest(*finished.popleft()))

    def set_live(self, counts: dict[int, int]) -> None:
        """Instances per TP degree that have joined the router."""
        with self._lock:
            self.live = {d: counts.get(d, 0) for d in self.degrees}

    # ---- the background thread -------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="remask-planner", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.check_s):
            try:
                self.tick()
            except Exception:  # a failed plan must not stop the service; the next period tries again
                log.exception("planner tick failed")

    def tick(self, now: float | None = None) -> None:
        now = self.clock() if now is None else now
        with self._lock:
            self._drain()
            if self.follower is not None and self.follower.busy:  # a transition is under way
                self._follow(now)
                return
            before = list(self.planner.current)
            plan = self.planner.maybe_replan(now)
            if plan is None:
                return
            log.info("planner: transition %s -> %s in %d actions", self.targets, plan.counts(), len(plan.actions))
            self.transitions += 1
            self.follower = TransitionFollower(self.planner.cluster.gpus_per_node, before, self.make_before_break)
            self.follower.follow(plan.actions)
            self.history.append({"started_at": now, "from": dict(self.targets), "to": plan.counts(),
                                 "make_before_break": self.make_before_break, "steps": [], "done_at": None})
            self.step_started = now
            self._follow(now)

    @property
    def pending(self) -> list[dict]:
        """The transition's actions not yet done: issued (``issued``: True) or queued."""
        f = self.follower
        if f is None:
            return []
        return ([{**a.to_dict(), "issued": True} for a in [*f.starting, *f.stopping]]
                + [{**a.to_dict(), "issued": False} for a in f.queue])

    def _follow(self, now: float) -> None:
        """Mark the issued actions whose effect the joined instances show as done (all of them after
        ``step_timeout_s`` without progress), issue what may go next, and publish the counts."""
        f = self.follower
        timed_out = now - self.step_started > self.step_timeout_s
        progressed = False
        for a in list(f.starting):
            if self.live.get(a.tp, 0) >= self.targets.get(a.tp, 0) or timed_out:
                f.ready(a)
                progressed = True
        for a in list(f.stopping):
            if self.live.get(a.tp, 0) <= self.targets.get(a.tp, 0) or timed_out:
                f.stopped(a)
                progressed = True
        if timed_out and progressed:
            log.warning("planner: replicas %s did not reach %s within %.0f s; moving on",
                        self.live, self.targets, self.step_timeout_s)
        issued = f.issue()
        if progressed or issued:
            self.step_started = now
        self.targets = f.targets(self.degrees)
        if (progressed or issued) and self.history:
            record = self.history[-1]
            record["steps"].append({"at": now, "targets": dict(self.targets), "live": dict(self.live),
                                    "issued": [a.to_dict() for a in issued]})
            if not f.busy:
                record["done_at"] = now

    # ---- outputs -----------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """Custom autoscaling metrics of the Ingress replica."""
        with self._lock:
            return {f"target_tp{d}": float(n) for d, n in self.targets.items()}

    def describe(self) -> dict:
        """``/debug/planner``: targets, transition, last decision, and ``inputs``: every model-dependent input
        of the next plan as {name: {"value", "source" ("default" | "configured" | "measured" | "scaled"),
        "requests"}} for steps_per_token, slo_scale, classes and profiles (per TP degree)."""
        with self._lock:
            self._drain()
            now = self.clock()
            dec = self.planner.last_decision
            return {"targets": self.targets, "live": self.live, "pending": self.pending,
                    "transitions": self.transitions, "make_before_break": self.make_before_break,
                    "history": [_rounded(h) for h in self.history],
                    "offered_rps": round(self.planner.monitor.total_rate(now), 3),
                    "last_decision": None if dec is None else {
                        "act": dec.act, "reason": dec.reason, "proposal": dec.proposal.counts,
                        "current": dec.current.counts, "thresholds": dec.proposal.thresholds},
                    "inputs": self.planner.describe_inputs(now)}


def build_service(cfg: AppConfig, model_cfg=None, clock: Callable[[], float] = time.monotonic) -> PlannerService:
    """The service of an app (``AppConfig`` with ``planner`` set)."""
    from engine.latency_profile import PROFILES_DIR, load_tp_profiles
    from planner.costs import StepModel, default_steps_per_token
    from planner.inputs import InputsConfig
    from planner.planner import Planner, PlannerConfig
    from planner.stage2 import Cluster
    from planner.workload import WorkloadMonitor

    args: PlannerArgs = cfg.planner
    cluster = Cluster.uniform(args.nodes, args.gpus_per_node)
    initial = initial_counts(cfg)
    name = args.profile or cfg.profile_name()
    degrees = cfg.resources.tp_degrees
    profiles = load_tp_profiles(name, degrees)
    # a degree without its own profile file is TP-1's scaled (engine.latency_profile.load_tp_profiles)
    sources = {d: "configured" if d == 1 or (PROFILES_DIR / f"{name}-tp{d}.json").exists() else "scaled"
               for d in degrees}
    # the router's candidate thresholds; their default steps per token until finished requests measure them
    steps = StepModel(steps_per_token=default_steps_per_token(cfg.router.thresholds),
                      block_tokens=getattr(model_cfg, "block_size", None) or StepModel.block_tokens)
    pcfg = PlannerConfig(period_s=args.period_s, min_gain=args.min_gain, steps=steps,
                         inputs=InputsConfig(args.min_requests, args.min_bucket, args.finished_window))
    planner = Planner(cluster, profiles, pcfg, monitor=WorkloadMonitor(window_s=args.window_s),
                      current=pack(initial, cluster.gpus_per_node), clock=clock, profile_sources=sources)
    return PlannerService(planner, degrees, initial, args.check_s, args.step_timeout_s, clock=clock,
                          make_before_break=bool(args.make_before_break))


def _rounded(record: dict) -> dict:
    """A history record with its times in ms precision (a copy: the thread goes on appending steps)."""
    def r(t):
        return None if t is None else round(t, 3)

    return {**record, "started_at": r(record["started_at"]), "done_at": r(record["done_at"]),
            "steps": [{**s, "at": r(s["at"])} for s in record["steps"]]}
