"""Stage 2: minimum-disruption transition to Stage 1's instance counts (DiLaServe §3.3).

Slot abstraction: node n with G_n GPUs holds at most floor(G_n / d) TP-d instances, and the
instances on a node share its GPUs (sum_d d * k[n, d] <= G_n). One ILP over integer
``keep[n, d]`` (running TP-d instances left alone on node n, at most the current ones) and
``new[n, d]`` (instances to start there): place every target instance (or, when the target does not
fit the nodes, as many as fit), then keep as many running instances as possible (ties: larger
instances, which cost most to restart). Nodes with the same GPU count are interchangeable, so
only counts per node matter; which of a node's TP-d instances stay is the oldest first.

``order_actions`` turns the result into an ordered plan that never drops serving capacity more
than necessary: starts that fit in free GPUs first, then node by node only the stops the next
start needs, and stops of instances that are simply no longer wanted last.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import cvxpy as cp
import numpy as np

from planner.solver import SolveInfo, solve
from planner.transition import Action, Instance, TransitionPlan, order_actions


@dataclass(frozen=True)
class Cluster:
    gpus_per_node: tuple[int, ...]

    @classmethod
    def uniform(cls, nodes: int, gpus_per_node: int) -> Cluster:
        return cls((gpus_per_node,) * nodes)

    @property
    def gpus(self) -> int:
        return sum(self.gpus_per_node)

    def slots(self, degrees) -> dict[int, int]:
        return {d: sum(g // d for g in self.gpus_per_node) for d in degrees}


@dataclass(frozen=True)
class Stage2Config:
    solver: str = "auto"
    new_id_prefix: str = "inst"


def plan_transition(cluster: Cluster, current: list[Instance], target: dict[int, int],
                    config: Stage2Config | None = None) -> TransitionPlan:
    config = config or Stage2Config()
    degrees = sorted(set(target) | {i.tp for i in current})
    N, D = len(cluster.gpus_per_node), len(degrees)
    col = {d: j for j, d in enumerate(degrees)}
    cur = np.zeros((N, D), dtype=int)
    for inst in current:
        if not 0 <= inst.node < N:
            raise ValueError(f"instance {inst.id} is on node {inst.node}, the cluster has {N} nodes")
        cur[inst.node, col[inst.tp]] += 1
    deg = np.array(degrees)
    G = np.array(cluster.gpus_per_node)
    want = np.array([target.get(d, 0) for d in degrees])

    keep = cp.Variable((N, D), integer=True)
    new = cp.Variable((N, D), integer=True)
    placed = cp.sum(keep + new, axis=0)
    cons = [keep >= 0, keep <= cur, new >= 0, (keep + new) @ deg <= G, placed <= want]
    # lexicographic by weights: every placed instance outweighs all keeps; a keep outweighs all size tie-breaks
    total = int(want.sum() + cur.sum()) + 1
    keep_w = 1.0 + deg / (deg.max() * total)
    problem = cp.Problem(cp.Maximize(3 * total * cp.sum(placed) + cp.sum(keep @ keep_w)), cons)
    info = solve(problem, config.solver)
    if problem.status not in (cp.OPTIMAL, cp.OPTIMAL_INACCURATE) or keep.value is None:
        raise RuntimeError(f"stage 2 ILP failed: {problem.status}")
    k = np.rint(keep.value).astype(int)
    s = np.rint(new.value).astype(int)
    return _plan(cluster, current, degrees, k, s, want, info, config.new_id_prefix)


def _plan(cluster: Cluster, current: list[Instance], degrees: list[int], keep: np.ndarray, new: np.ndarray,
          want: np.ndarray, info: SolveInfo, prefix: str) -> TransitionPlan:
    kept, stops = [], []
    quota = {(n, d): int(keep[n, j]) for n in range(keep.shape[0]) for j, d in enumerate(degrees)}
    for inst in current:  # the first listed (oldest) instances of each (node, degree) stay
        if quota[(inst.node, inst.tp)] > 0:
            quota[(inst.node, inst.tp)] -= 1
            kept.append(inst)
        else:
            stops.append(Action("stop", inst.node, inst.tp, inst.id))
    taken = {i.id for i in current}
    starts, seq = [], 0
    for n in range(new.shape[0]):
        for j, d in enumerate(degrees):
            for _ in range(int(new[n, j])):
                while f"{prefix}-{seq}" in taken:
                    seq += 1
                taken.add(f"{prefix}-{seq}")
                starts.append(Action("start", n, d, f"{prefix}-{seq}"))
    actions = order_actions(cluster.gpus_per_node, current, stops, starts)
    placed = Counter(i.tp for i in kept) + Counter(a.tp for a in starts)
    unplaced = {d: int(w) - placed[d] for d, w in zip(degrees, want) if int(w) > placed[d]}
    final = kept + [Instance(a.instance, a.node, a.tp) for a in starts]
    target = {d: int(w) for d, w in zip(degrees, want)}
    return TransitionPlan(actions=actions, kept=[i.id for i in kept], final=final, target=target,
                          unplaced=unplaced, solve=info)
