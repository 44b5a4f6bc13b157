"""Instances, transition actions and their order.

A ``TransitionPlan`` is what an autoscaling policy follows: ``actions`` in order, or, for a
controller that only sets replica counts per TP deployment, ``count_steps()`` (the counts after
each action).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

from planner.solver import SolveInfo


@dataclass(frozen=True)
class Instance:
    id: str
    node: int
    tp: int


@dataclass(frozen=True)
class Action:
    kind: str  # "start" or "stop"
    node: int
    tp: int
    instance: str

    def to_dict(self) -> dict:
        return {"kind": self.kind, "node": self.node, "tp": self.tp, "instance": self.instance}


@dataclass(frozen=True)
class TransitionPlan:
    actions: list[Action]
    kept: list[str]  # ids of running instances left alone
    final: list[Instance]
    target: dict[int, int]
    unplaced: dict[int, int] = field(default_factory=dict)  # target instances that did not fit the nodes
    solve: SolveInfo | None = None

    def counts(self) -> dict[int, int]:
        c = Counter(i.tp for i in self.final)
        return {d: c.get(d, 0) for d in sorted(set(self.target) | set(c))}

    def count_steps(self, current: list[Instance]) -> list[dict[int, int]]:
        """Instance counts per TP degree after each action, starting from ``current``."""
        c = Counter(i.tp for i in current)
        degrees = sorted(set(self.target) | set(c))
        steps = []
        for a in self.actions:
            c[a.tp] += 1 if a.kind == "start" else -1
            steps.append({d: c.get(d, 0) for d in degrees})
        return steps

    def to_dict(self) -> dict:
        return {"target": self.target, "kept": len(self.kept), "starts": sum(a.kind == "start" for a in self.actions),
                "stops": sum(a.kind == "stop" for a in self.actions), "unplaced": self.unplaced,
                "actions": [a.to_dict() for a in self.actions]}


def order_actions(gpus_per_node, current: list[Instance], stops: list[Action], starts: list[Action]) -> list[Action]:
    """Order stops and starts so serving capacity drops only where a start needs a node's GPUs.

    1. starts that fit in the GPUs already free on their node;
    2. node by node, for each remaining start (largest first), the fewest stops on that node
       (smallest first) that make it fit, then the start;
    3. the remaining stops.
    """
    free = list(gpus_per_node)
    for inst in current:
        free[inst.node] -= inst.tp
    pending_stops: dict[int, list[Action]] = defaultdict(list)
    for a in sorted(stops, key=lambda a: a.tp):
        pending_stops[a.node].append(a)
    out, later = [], []
    for a in sorted(starts, key=lambda a: (a.node, -a.tp)):
        if a.tp <= free[a.node]:
            free[a.node] -= a.tp
            out.append(a)
        else:
            later.append(a)
    for a in later:
        queue = pending_stops[a.node]
        while free[a.node] < a.tp:
            if not queue:
                raise ValueError(f"start of TP-{a.tp} on node {a.node} cannot fit: the plan overfills the node")
            stop = _pick_stop(queue, a.tp - free[a.node])
            queue.remove(stop)
            free[a.node] += stop.tp
            out.append(stop)
        free[a.node] -= a.tp
        out.append(a)
    out += [a for node in sorted(pending_stops) for a in pending_stops[node]]
    return out


def _pick_stop(queue: list[Action], need: int) -> Action:
    """The smallest stop that frees ``need`` GPUs on its own, else the largest (more follow)."""
    for a in queue:  # ascending by tp
        if a.tp >= need:
            return a
    return queue[-1]
