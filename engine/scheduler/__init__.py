"""The instance scheduler (pure Python: no torch, no ray; time comes from an ``engine.clock.Clock``).

- ``scheduler``: ``Scheduler`` and ``SchedulerConfig``: residency, ranking and round plans (DWISE Alg. 1);
- ``policies``: the ranking policies, chosen by name (``make_policy``, ``POLICIES``);
- ``types``: the data it plans with and hands out (``StepKind``, ``SchedRequest``, ``RoundPlan``, ...).

The same objects run in the serving engine (engine/instance.py) and in the simulator (sim/).
"""

from engine.scheduler.scheduler import Scheduler, SchedulerConfig

__all__ = ["Scheduler", "SchedulerConfig"]
