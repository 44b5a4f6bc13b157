"""Following a reconfiguration (pure Python): the planner's ordered actions, carried out under the rules
both the cluster simulator and the live autoscaling policy use.

A ``planner.TransitionPlan`` lists ``start`` and ``stop`` actions in order. ``TransitionFollower`` says
which of them may be issued now:

- a start is issued as soon as its node has the GPUs free (it reserves them then); the instance serves
  once it has loaded (``ready``);
- a stop waits until every earlier start serves (capacity comes before it goes); its GPUs are free once
  the instance has stopped (``stopped``), which may let a later start on its node go.

Make-before-break (``make_before_break``): a GPU's memory holds a second instance while one replaces the
other (an 8B model's weights take 16 GB of an H200's 141), so every start goes first, on GPUs whose old
instances keep serving when the transition's stops will free them, and every stop waits until all the
starts serve: no GPU goes dark while a new instance loads. A start still waits when even the stops on its
node would leave it no room.

The executor carries an issued action out its own way: the simulator starts an instance after a
load delay and drains one (``sim/reconfig.py``); the live policy turns the issued actions into replica
counts per TP degree (``targets``) for Ray Serve and reports ``ready``/``stopped`` as replicas join and
leave (``app/planner_service.py``).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable

from planner.transition import Action, Instance


class TransitionFollower:
    def __init__(self, gpus_per_node: Iterable[int], running: Iterable[Instance],
                 make_before_break: bool = False) -> None:
        """``running``: the instances serving now (their GPUs are taken)."""
        self.make_before_break = make_before_break
        self.free = list(gpus_per_node)  # below 0 while new and old instances share a node's GPUs
        self.leaving = [0] * len(self.free)  # GPUs per node that queued or issued stops will free
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
        """Queue a transition's actions (after any still queued; make-before-break: its starts first)."""
        actions = list(actions)
        if self.make_before_break:
            actions = [a for a in actions if a.kind == "start"] + [a for a in actions if a.kind != "start"]
        for a in actions:
            if a.kind == "stop":
                self.leaving[a.node] += a.tp
        self.queue.extend(actions)

    def issue(self) -> list[Action]:
        """The actions that may start now, in order (a start reserves its GPUs)."""
        out = []
        while self.queue:
            a = self.queue[0]
            if a.kind == "start":
                room = self.free[a.node] + (self.leaving[a.node] if self.make_before_break else 0)
                if room < a.tp:
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
        self.leaving[action.node] -= action.tp

    def targets(self, degrees: Iterable[int]) -> dict[int, int]:
        """Instances per TP degree once every issued action took effect (what a count-based executor asks for)."""
        return {d: self.counts.get(d, 0) for d in degrees}

    def shared(self, node: int) -> bool:
        """New and old instances share ``node``'s GPUs now (make-before-break)."""
        return self.free[node] < 0
