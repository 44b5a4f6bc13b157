"""Following a reconfiguration (pure Python): the planner's ordered actions, carried out under the rules
both the cluster simulator and the live autoscaling policy use.

A ``planner.TransitionPlan`` lists ``start`` and ``stop`` actions in order. ``TransitionFollower`` says
which of them may be issued now:

- a start is issued as soon as its node has the GPUs free (it reserves them then); the instance serves
  once it has loaded (``ready``);
- a stop waits until every earlier start serves (capacity comes before it goes); its GPUs are free once
  the instance has stopped (``stopped``), which may let a later start on its node go.

The executor carries an issued action out its own way: the simulator starts an instance after a
load delay and drains one (``sim/reconfig.py``); the live policy turns the issued actions into replica
counts per TP degree (``targets``) for Ray Serve and reports ``ready``/``stopped`` as replicas join and
leave (``app/autoscaling.py``).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable

from planner.transition import Action, Instance


class TransitionFollower:
    def __init__(self, gpus_per_node: Iterable[int], running: Iterable[Instance]) -> None:
        """``running``: the instances serving now (their GPUs are taken)."""
        self.free = list(gpus_per_node)
        self.queue: deque[Action] = deque()
        self.starting: list[Action] = []  # issued, not yet serving
        self.stopping: list[Action] = []  # issued, not yet stopped
        self.counts: Counter = Counter()  # instances per TP degree once every issued action took effect
        for inst in running:
            self.free[inst.node] -= inst.tp
            if self.free[inst.node] < 0:
                raise ValueError(f"the running instances overfill node {inst.node}")
            self.counts[inst.tp] += 1

    @property
    def busy(self) -> bool:
        """A transition is under way: actions queued or issued and not yet done."""
        return bool(self.queue or self.starting or self.stopping)

    def follow(self, actions: Iterable[Action]) -> None:
        """Queue a transition's actions (after any still queued)."""
        self.queue.extend(actions)

    def issue(self) -> list[Action]:
        """The actions that may start now, in order (a start reserves its GPUs)."""
        out = []
        while self.queue:
            a = self.queue[0]
            if a.kind == "start":
                if self.free[a.node] < a.tp:
                    break  # waits for a stop on its node to finish
                self.free[a.node] -= a.tp
                self.starting.append(a)
                self.counts[a.tp] += 1
            elif a.kind == "stop":
                if self.starting:
                    break  # capacity first: earlier starts serve before this instance goes
                self.stopping.append(a)
                self.counts[a.tp] -= 1
            else:
                raise ValueError(f"unknown action kind {a.kind!r}")
            out.append(self.queue.popleft())
        return out

    def ready(self, action: Action) -> None:
        """A started instance serves."""
        self.starting.remove(action)

    def stopped(self, action: Action) -> None:
        """A stopped instance is gone: its GPUs are free."""
        self.stopping.remove(action)
        self.free[action.node] += action.tp

    def targets(self, degrees: Iterable[int]) -> dict[int, int]:
        """Instances per TP degree once every issued action took effect (what a count-based executor asks for)."""
        return {d: self.counts.get(d, 0) for d in degrees}
