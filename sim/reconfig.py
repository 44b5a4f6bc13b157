"""Planner-driven reconfiguration of a simulated cluster (DiLaServe §3.3 in the loop).

``PlannerController`` connects a ``planner.Planner`` to a ``ClusterSimulator``: every arrival is
observed by the planner's workload monitor; every ``tick_s`` the controller asks
``maybe_replan`` (which acts at most once a period, and only for a >= 10% gain) and queues the
Stage 2 transition's ordered actions. Actions are carried out in order under the rules of
``cluster.transition.TransitionFollower``, the ones the live autoscaling policy follows too:

- a start reserves its GPUs on its node as soon as they are free, and the instance serves
  ``start_delay_s`` later (model load);
- a stop waits until every earlier start serves (capacity comes before it goes), then drains the
  instance: no new requests, and at its next round boundary its requests migrate to the best
  remaining instances (``ClusterSimulator.drain_instance``); its GPUs are free once it stopped.

With ``make_before_break`` every start goes first, loading on GPUs whose old instances keep serving
(their memory holds both), and the stops follow once the new instances serve. While a node's GPUs
are shared, the instances serving on it run ``overlap_slowdown`` times slower (the load's copies and
the second instance compete for the GPU). ``transitions`` records each transition's start, end and
dark GPU-seconds (GPUs that serve nothing: freed and not yet serving again).

``timeline`` records the serving instances per TP degree after every change, ``decisions`` each
re-plan's outcome.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from cluster.transition import TransitionFollower
from planner import Action, Planner
from sim.cluster import ClusterRequestSpec, ClusterSimulator


@dataclass
class ReconfigLog:
    timeline: list[tuple[float, dict[int, int]]] = field(default_factory=list)  # (t, serving per TP)
    decisions: list[dict] = field(default_factory=list)
    plans: int = 0
    starts: int = 0
    stops: int = 0
    transitions: list[dict] = field(default_factory=list)  # per plan: t, done_t, actions, dark GPU-seconds


class PlannerController:
    def __init__(self, sim: ClusterSimulator, planner: Planner, start_delay_s: float = 30.0,
                 tick_s: float = 1.0, make_before_break: bool = False, overlap_slowdown: float = 1.1) -> None:
        if start_delay_s < 0 or tick_s <= 0:
            raise ValueError("start_delay_s must be >= 0 and tick_s > 0")
        self.sim, self.planner = sim, planner
        self.start_delay_s, self.tick_s = start_delay_s, tick_s
        self.degrees = sorted(planner.profiles)
        self.ids: dict[str, int] = {}  # planner instance id -> simulator instance id
        if sim.serving():
            raise ValueError("the simulator must start without instances: the planner's placement is the start")
        self.follower = TransitionFollower(planner.cluster.gpus_per_node, planner.current, make_before_break)
        self.overlap_slowdown = overlap_slowdown
        self.gpus = sum(planner.cluster.gpus_per_node)
        self.node_of: dict[int, int] = {}  # simulator instance id -> node
        self._dark_t = 0.0  # dark GPU-seconds are integrated from here
        for inst in planner.current:  # the starting placement serves from t = 0
            self.ids[inst.id] = sim.add_instance(inst.tp)
            self.node_of[self.ids[inst.id]] = inst.node
        sim.res.instances_started = 0
        self.log = ReconfigLog()
        self._seen = None  # the planner's last decision already logged
        self._record(0.0)
        sim.on_arrival = self._observe

    def begin(self, t0: float) -> None:
        """Schedule the first tick (call before ``sim.run``)."""
        self.sim.call_at(t0, self._tick)

    # ---- events ----------------------------------------------------------------------------
    def _observe(self, spec: ClusterRequestSpec, now: float) -> None:
        self.planner.observe(spec.prompt_tokens, spec.output_tokens, now)

    def _tick(self, now: float) -> None:
        plan = self.planner.maybe_replan(now)
        d = self.planner.last_decision
        if d is not None and d is not self._seen:
            self._seen = d
            self.log.decisions.append({
                "t": round(now, 3), "act": plan is not None, "reason": d.reason,
                "proposal": {str(k): v for k, v in d.proposal.counts.items()},
                "running": {str(k): v for k, v in d.current.counts.items()},
                "proposal_primary": round(d.proposal.primary, 4), "running_primary": round(d.current.primary, 4),
                "proposal_slo_met": None if d.proposal.slo_met is None else round(d.proposal.slo_met, 4),
                "running_slo_met": None if d.current.slo_met is None else round(d.current.slo_met, 4),
                "solve_ms": round((d.proposal.solve_seconds + d.current.solve_seconds) * 1e3, 1)})
        if plan is not None:
            self.log.plans += 1
            self._account(now)
            self.log.transitions.append({"t": round(now, 3), "done_t": None, "starts": 0, "stops": 0,
                                         "dark_gpu_s": 0.0})
            for a in plan.actions:
                self.log.transitions[-1]["starts" if a.kind == "start" else "stops"] += 1
            self.follower.follow(plan.actions)
            self._advance(now)
        if self.sim.active():
            self.sim.call_at(now + self.tick_s, self._tick)

    def _advance(self, now: float) -> None:
        for a in self.follower.issue():
            if a.kind == "start":
                self.sim.call_at(now + self.start_delay_s, lambda t, a=a: self._ready(a, t))
            else:
                self.log.stops += 1
                self.sim.drain_instance(self.ids.pop(a.instance), lambda t, a=a: self._stopped(a, t))
                self._record(now)
        self._contend()
        self._account(now)

    def _ready(self, a: Action, now: float) -> None:
        self._account(now)
        self.ids[a.instance] = self.sim.add_instance(a.tp)
        self.node_of[self.ids[a.instance]] = a.node
        self.follower.ready(a)
        self.log.starts += 1
        self._record(now)
        self._advance(now)

    def _stopped(self, a: Action, now: float) -> None:
        self._account(now)
        self.follower.stopped(a)
        self._contend()
        self.sim.call_at(now, self._advance)  # as an event: this may run inside _advance's drain call

    def _contend(self) -> None:
        """Instances on a node whose GPUs a new instance shares (loading or serving) run slower."""
        for inst in self.sim.insts:
            node = self.node_of.get(inst.inst_id)
            shared = node is not None and self.follower.shared(node) and inst.state != "stopped"
            inst.slowdown = self.overlap_slowdown if shared else 1.0

    def _account(self, now: float) -> None:
        """Add the dark GPU-seconds since the last event to the transition under way."""
        if self.log.transitions and self.log.transitions[-1]["done_t"] is None:
            serving = sum(i.tp for i in self.sim.serving())
            cur = self.log.transitions[-1]
            cur["dark_gpu_s"] = round(cur["dark_gpu_s"] + max(self.gpus - serving, 0) * (now - self._dark_t), 6)
            if not self.follower.busy:
                cur["done_t"] = round(now, 3)
        self._dark_t = now

    def _record(self, now: float) -> None:
        c = Counter(i.tp for i in self.sim.serving())
        counts = {d: c.get(d, 0) for d in self.degrees}
        if self.log.timeline and self.log.timeline[-1][0] == now:
            self.log.timeline[-1] = (now, counts)
        else:
            self.log.timeline.append((now, counts))
