"""Named simulation scenarios: workload x arrival pattern x latency profile.

- ``dwise-burst`` / ``dwise-burst-poisson``: the distribution-driven DWISE
  workload on the LLaDA2.1-mini/GH200 profile, B = 128, lambda = 16 req/s.
- ``tiny-bd-*`` / ``tiny-mdm-*``: model in the loop: the embedded model
  decodes held-out task-suite prompts for real (rounds and accuracy are its
  own), its shipped predictors estimate and refine the work (admission from
  the prompt, refinement from the first round's hidden rows inside the
  engine), and time is charged from the LLaDA-8B/H200 profile (8B-class
  round times for each round's real composition).
- ``dg-*``: DiffusionGemma-26B-A4B canvases (``sim.workload.dg_workload``: 256-token canvases, each taking
  the steps its entropy bound gives, the bound the router's level maps to) on its modelled H200 profile
  (profiles/h200-diffusiongemma-26b-a4b-modelled.json), 32 slots; ``dg-poisson`` at a fixed rate
  (``--rate``, default 4 req/s), ``dg-burst`` all at once. ``--threshold`` sets the level (0.9: the
  checkpoint's bound 0.1; 0.8: 0.2; 0.7: 0.4), ``--profile`` another profile.

Every policy of one run sees the identical trace (fixed seeds).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from engine.latency_profile import load_profile
from sim.simulator import run_policy, simulate
from sim.workload import SimRequestSpec, dg_workload, dwise_workload, noisy_estimates, set_arrivals


@dataclass(frozen=True)
class Scenario:
    name: str
    workload: str  # 'dwise', 'dg' (DiffusionGemma canvases) or an embedded model name
    arrivals: str
    profile: str
    slots: int
    kv_capacity_tokens: int
    rate: float | None = None  # Poisson rate; None: 1.25x the fcfs-prefill-first service rate
    block: int = 32
    threshold: float = 0.9
    predictors: bool = False  # model in the loop: the shipped predictors instead of calibrated stand-ins


SCENARIOS = {
    "dwise-burst": Scenario("dwise-burst", "dwise", "burst", "gh200-llada2-mini", 128, 666_000),
    "dwise-burst-poisson": Scenario("dwise-burst-poisson", "dwise", "burst-poisson", "gh200-llada2-mini", 128,
                                    666_000, rate=16.0),
}
for _a, _r in (("burst", None), ("poisson", 4.0)):
    SCENARIOS[f"dg-{_a}"] = Scenario(f"dg-{_a}", "dg", _a, "h200-diffusiongemma-26b-a4b-modelled", 32, 1 << 22,
                                     rate=_r, block=256)
for _m in ("tiny-bd", "tiny-mdm"):
    for _a in ("burst", "burst-poisson"):
        SCENARIOS[f"{_m}-{_a}"] = Scenario(f"{_m}-{_a}", _m, _a, "h200-llada8b-measured", 32, 1 << 20, block=8,
                                           predictors=True)


def get_scenario(name: str) -> Scenario:
    try:
        return SCENARIOS[name]
    except KeyError:
        from sim.cluster_scenarios import CLUSTER_SCENARIOS

        known = ", ".join(sorted([*SCENARIOS, *CLUSTER_SCENARIOS]))
        raise ValueError(f"unknown scenario {name!r}; known: {known}") from None


def _model_specs(sc: Scenario, n: int, seed: int, progress: bool):
    """Held-out prompts; true rounds from one batched pre-pass (decoding is deterministic)."""
    import tasksuite as tasks
    from engine.loading import load_engine
    from engine.sequence import SamplingParams

    engine = load_engine(sc.workload, max_slots=64)
    rng = random.Random(seed)
    examples = [tasks.sample(rng, split="heldout") for _ in range(n)]
    outs = engine.generate([e.prompt for e in examples], SamplingParams(threshold=sc.threshold), progress=progress)
    specs = []
    for i, (ex, out) in enumerate(zip(examples, outs)):
        specs.append(SimRequestSpec(f"r{i}", ex.category, 0.0, len(ex.prompt), [out.rounds], 0.0, 0.0,
                                    float(len(ex.answer)), len(out.token_ids),
                                    extra={"prompt": ex.prompt, "check": ex.check}))
    if sc.predictors:  # the shipped predictors: admission from the prompt, refinement in the engine
        from predictors.bundle import load_predictors
        from predictors.features import admission_row

        pred = load_predictors(sc.workload)
        rows = [admission_row(e.prompt, len(engine.tokenizer.prompt_ids(e.prompt, engine.cfg.block_size)),
                              sc.threshold) for e in examples]
        for s, a in zip(specs, pred.admission.predict(rows)):
            s.admission_est, s.refined_est = float(a), float("nan")
        return specs
    true = [s.true_rounds for s in specs]
    for s, a, r in zip(specs, noisy_estimates(true, 0.74, rng), noisy_estimates(true, 0.87, rng)):
        s.admission_est, s.refined_est = a, r
    return specs


def run_scenario(name: str, policies: list[str], n: int, seed: int = 0, progress: bool = False,
                 rate: float | None = None, profile: str | None = None, threshold: float | None = None) -> dict:
    """``rate``: the Poisson rate (the scenario's otherwise); ``profile``: another latency profile (a name in
    profiles/ or a JSON file); ``threshold``: the router's level (DiffusionGemma scenarios)."""
    from sim.cluster_run import run_cluster_scenario
    from sim.cluster_scenarios import CLUSTER_SCENARIOS

    if name in CLUSTER_SCENARIOS:  # N instances behind the cluster router (sim/cluster.py)
        return run_cluster_scenario(name, policies, n, seed, rate, progress)
    sc = get_scenario(name)
    if threshold is not None and sc.workload != "dg":
        raise ValueError(f"--threshold sets a DiffusionGemma scenario's level (dg-*), not {name}'s")
    if threshold is not None and not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must be in [0, 1], got {threshold}")
    level = sc.threshold if threshold is None else threshold
    profile_name = profile or sc.profile
    profile = load_profile(profile_name)
    if sc.workload == "dwise":
        specs = dwise_workload(n, seed)
    elif sc.workload == "dg":
        specs = dg_workload(n, seed, level, sc.block)
    else:
        specs = _model_specs(sc, n, seed, progress)
    rate = rate if rate is not None else sc.rate
    if sc.arrivals == "burst-poisson" and rate is None:
        set_arrivals(specs, "burst", seed=seed)
        base = run_policy(specs, "fcfs-prefill-first", profile, sc.slots, sc.kv_capacity_tokens, sc.block,
                          sc.workload == "dg")
        rate = 1.25 * len(specs) / base.makespan_s
    set_arrivals(specs, sc.arrivals, rate or 1.0, seed)
    results = {}
    for policy in policies:
        if sc.workload in ("dwise", "dg"):
            stats = run_policy(specs, policy, profile, sc.slots, sc.kv_capacity_tokens, sc.block, sc.workload == "dg")
        else:
            stats = _run_model_policy(sc, specs, policy, profile)
        results[policy] = stats.summary(sc.slots)
    out = {"scenario": name, "requests": n, "seed": seed, "profile": profile_name, "slots": sc.slots,
           "arrival_rate_rps": None if sc.arrivals == "burst" else round(rate, 3), "policies": results}
    if sc.workload == "dg":
        from planner.costs import dg_bound

        canvases = [len(s.block_rounds) for s in specs]
        out |= {"level": level, "entropy_bound": round(dg_bound(level), 6),
                "steps_per_canvas": round(sum(map(sum, (s.block_rounds for s in specs))) / sum(canvases), 2),
                "canvases_per_request": round(sum(canvases) / len(specs), 2),
                "modelled_profile": bool(profile.meta.get("modelled"))}
    return out


def _run_model_policy(sc: Scenario, specs, policy: str, profile):
    from engine.clock import VirtualClock
    from engine.loading import load_engine
    from engine.scheduler import Scheduler, SchedulerConfig
    from engine.scheduler.policies import make_policy
    from sim.model_runner import ModelInTheLoopRunner

    clock = VirtualClock()
    engine = load_engine(sc.workload, max_slots=sc.slots)
    sched = Scheduler(make_policy(policy), SchedulerConfig(slots=sc.slots, kv_capacity_tokens=sc.kv_capacity_tokens,
                                                           block_size=engine.cfg.block_size), clock)
    if sc.predictors:
        from predictors.bundle import load_predictors

        load_predictors(sc.workload).hook_into(engine)
    fresh = [SimRequestSpec(**{**vars(s), "extra": dict(s.extra)}) for s in specs]
    return simulate(fresh, sched, ModelInTheLoopRunner(engine, profile, sc.threshold), clock)


def speedups(report: dict, baseline: str) -> dict[str, float]:
    base = report["policies"].get(baseline)
    if not base:
        return {}
    return {p: round(base["mean_latency_s"] / max(v["mean_latency_s"], 1e-9), 2)
            for p, v in report["policies"].items() if not math.isclose(v["mean_latency_s"], 0)}
