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


class PlannerController:
    def __init__(self, sim: ClusterSimulator, planner: Planner, start_delay_s: float = 30.0,
                 tick_s: float = 1.0) -> None:
        if start_delay_s < 0 or tick_s <= 0:
            raise ValueError("start_delay_s must be >= 0 and tick_s > 0")
        self.sim, self.planner = sim, planner
        self.start_delay_s, self.tick_s = start_delay_s, tick_s
        self.degrees = sorted(planner.profiles)
        self.ids: dict[str, int] = {}  # planner instance id -> simulator instance id
        if sim.serving():
            raise ValueError("the simulator must start without instances: the planner's placement is the start")
        self.follower = TransitionFollower(planner.cluster.gpus_per_node, planner.current)
        for inst in planner.current:  # the starting placement serves from t = 0
            self.ids[inst.id] = sim.add_instance(inst.tp)
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
                "solve_ms": round((d.proposal.solve_seconds + d.current.solve_seconds) * 1e3, 1)})
        if plan is not None:
            self.log.plans += 1
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

    def _ready(self, a: Action, now: float) -> None:
        self.ids[a.instance] = self.sim.add_instance(a.tp)
        self.follower.ready(a)
        self.log.starts += 1
        self._record(now)
        self._advance(now)

    def _stopped(self, a: Action, now: float) -> None:
        self.follower.stopped(a)
        self.sim.call_at(now, self._advance)  # as an event: this may run inside _advance's drain call

    def _record(self, now: float) -> None:
        c = Counter(i.tp for i in self.sim.serving())
        counts = {d: c.get(d, 0) for d in self.degrees}
        if self.log.timeline and self.log.timeline[-1][0] == now:
            self.log.timeline[-1] = (now, counts)
        else:
            self.log.timeline.append((now, counts))
