"""Cluster planner: workload monitor and DiLaServe's two-stage ILP (§3.3, §3.4). No ray, no torch.

Pieces (each usable alone):

- ``workload.WorkloadMonitor``: requests classified by input and output size, per-class arrival
  rates over a sliding window times a safety buffer (optionally at the window's busiest slice)
  -> ``list[WorkloadClass]``.
- ``stage1.plan_capacity``: instances per TP degree and a threshold per class (a MILP built as arrays
  and solved by HiGHS directly, ``planner.milp``; ``stage1_reference`` keeps the first, cvxpy formulation).
- ``stage2.plan_transition``: the least disruptive way from the running instances to those counts,
  as an ordered ``transition.TransitionPlan``.
- ``inputs.MeasuredInputs``: the model-dependent inputs (steps per token per threshold, SLO scale, latency
  profile per TP degree) measured from finished requests and replicas' profiles, each with its source.
- ``planner.Planner``: the periodic, hysteretic loop over the three.

API for an autoscaling policy (Ray Serve ``autoscaling_policy`` or the simulator)::

    planner = Planner(Cluster.uniform(nodes, gpus_per_node), load_tp_profiles("h200-llada8b-measured"),
                      PlannerConfig(period_s=300), clock=time.monotonic)
    planner.observe(input_tokens, output_tokens)      # per arrival (O(1)), or
    planner.observe_rates([WorkloadClass(...), ...])  # rates measured elsewhere (replica metrics)
    planner.observe_finished(FinishedRequest(prompt_tokens, output_tokens, steps, threshold, slo_s, e2e_s, tp))
    planner.set_profile(tp, measured_profile)         # a replica's own LatencyProfile
    planner.describe_inputs()                         # {name: {"value", "source", "requests"}}
    plan = planner.maybe_replan()                     # cheap unless a period has passed
    if plan is not None:                              # a proposal improved an objective by >= 10%
        for counts in plan.count_steps(old_instances): ...   # replica counts per TP degree, in order
        # or plan.actions: Action(kind="start"|"stop", node, tp, instance)
    planner.set_current(instances_actually_running)   # reconcile after (part of) a transition

``maybe_replan`` solves two small MILPs (the proposal and the running configuration on the same
workload) and, when acting, the Stage 2 ILP; call it off any latency-critical loop (a background
thread) and cache its answer. ``planner.last_decision`` says why it did or did not act.
Solvers: HiGHS by default, Gurobi when installed and licensed (``planner.solver``).
"""

from __future__ import annotations

import importlib

# Names are imported on first use (PEP 562): ``import planner.cli`` (every ``remask`` command builds its
# parser from it) must not pull in cvxpy and the MILP stack, which cost over a second and are not installed
# where only the engine runs (the GPU image).
_HOMES = {
    "StepModel": "costs",
    "FinishedRequest": "inputs", "InputsConfig": "inputs", "MeasuredInputs": "inputs",
    "Decision": "planner", "Planner": "planner", "PlannerConfig": "planner",
    "CapacityPlan": "stage1", "Stage1Config": "stage1", "plan_capacity": "stage1",
    "Cluster": "stage2", "Stage2Config": "stage2", "plan_transition": "stage2",
    "Action": "transition", "Instance": "transition", "TransitionPlan": "transition",
    "ClassGrid": "workload", "WorkloadClass": "workload", "WorkloadMonitor": "workload",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'planner' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"planner.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
