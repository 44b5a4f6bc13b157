"""Named cluster scenarios (DiLaServe's evaluation), run by ``remask simulate``.

Requests are LLaDA-8B-shaped: a 256-token output canvas in 8 blocks of 32
with the approximate KV cache, prompts of ``prompt_scale`` tokens per
character of a held-out task-suite prompt (~40-280 tokens), and time from
the ``h200-llada8b-measured`` profile. Their denoising behaviour is real but scaled:
the embedded ``tiny-bd`` model decodes each held-out prompt at every
candidate threshold (``sim/threshold_table.py``); a prompt it finishes in R_t
rounds at threshold t needs ``blocks + steps_scale * (R_t - 1)`` steps here
(at least one step per block, as a fixed-length LLaDA canvas needs even for
a short answer padded with EOS; capped at one token per step), and its
answer is the tiny model's (accuracy is the tiny model's, on its task
suite, not LLaDA's). This is a stand-in: real LLaDA step counts and answers
need the GPU issue's model runs.

- ``dilaserve-bench``: 16 TP-1 instances, B = 32 slots, Poisson arrivals at a
  fixed rate (``--rate``, or ``--load``: a multiple of the cluster's capacity,
  ``scenario_capacity``; default load 1.0), SLO per request = 5x its isolated
  TP-1 latency at threshold 0.9; policies infaas, llumnix, remask.
- ``dilaserve-ablation``: the same cluster; fixed 0.9, dynamic thresholds
  without load control, and dynamic + load control.
- ``*-all-thresholds``: the same with every threshold of 0.5..0.9 a candidate.
- ``dilaserve-trace``: these requests on a 2-hour BurstGPT-like diurnal trace, the 16 GPUs
  reconfigured by the planner and compared with static instance mixes (``sim/cluster_trace.py``;
  ``--requests`` sets the time compression, ``--rate`` the mean rate, one router policy).

Load (``scenario_capacity``): the rates of a profile are not another's, so runs are written as a load, a
multiple of the cluster's capacity at the highest candidate threshold for the scenario's mix, from the
planner's mixed-rounds model (``planner.slo_capacity.slo_capacity``): each instance at the most requests per
round at which the scenario's mean request still meets its SLO. A new profile moves the rates with it.

Candidate thresholds (DiLaServe 4.1: the administrator's set) are read off
the model's measured accuracy: those whose held-out accuracy, used for every
step, is within ``quality_tolerance`` (2) points of threshold 0.9's. For
tiny-bd that keeps 0.9, 0.8 and 0.7 and drops 0.6 and 0.5, which lose most
long answers (prose accuracy 0.16 and 0.00).

The prompt mix (``mix``) weights the task categories. The default,
``long``, mirrors the paper's benchmarks (GSM8K, MMLU-Pro, MBPP with 256-token
outputs, where every request's step count depends on the threshold): mostly
long free-form prose; ``uniform`` is the held-out set's own mix, where 60% of
requests answer in one round whatever the threshold.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from sim.cluster import ClusterRequestSpec
from sim.threshold_table import ThresholdTable, replay, step_thresholds

MIXES = {
    "long": {"prose": 0.7, "lookup": 0.1, "arith": 0.1, "choice": 0.05, "reverse": 0.05},
    "uniform": {"prose": 0.2, "lookup": 0.2, "arith": 0.2, "choice": 0.2, "reverse": 0.2},
}


@dataclass(frozen=True)
class ClusterScenario:
    name: str
    policies: tuple[str, ...]
    tp_degrees: tuple[int, ...] = (1,) * 16
    profile: str = "h200-llada8b-measured"
    slots: int = 32
    load: float = 1.0  # offered rate / capacity (``scenario_capacity``) without --rate or --load
    slo_factor: float = 5.0
    output_tokens: int = 256
    block_tokens: int = 32
    prompt_scale: int = 4
    steps_scale: float = 5.0
    mix: str = "long"
    model: str = "tiny-bd"
    table_prompts: int = 400
    quality_tolerance: float | None = 2.0  # candidates: thresholds within this many accuracy points of 0.9's


TRACE_SLO_FACTOR = 2.0  # dilaserve-trace: tight enough that instance latency, not only capacity, decides SLOs

CLUSTER_SCENARIOS = {
    "dilaserve-bench": ClusterScenario("dilaserve-bench", ("infaas", "llumnix", "remask")),
    "dilaserve-ablation": ClusterScenario("dilaserve-ablation",
                                          ("fixed-threshold", "dynamic-no-load-control", "remask")),
}
for _name in list(CLUSTER_SCENARIOS):  # every threshold of 0.5..0.9 a candidate, however much accuracy it costs
    CLUSTER_SCENARIOS[f"{_name}-all-thresholds"] = replace(CLUSTER_SCENARIOS[_name], name=f"{_name}-all-thresholds",
                                                           quality_tolerance=None)
# the requests of the reconfiguration trace (instances and rates come from sim/cluster_trace.py)
CLUSTER_SCENARIOS["dilaserve-trace"] = ClusterScenario("dilaserve-trace", ("remask-fit",), slo_factor=TRACE_SLO_FACTOR)


def candidate_thresholds(table: ThresholdTable, tolerance: float | None) -> tuple[float, ...]:
    """The admin's candidate set (DiLaServe 4.1), read off the model's measured accuracy: every table
    threshold whose held-out accuracy, used for every step, is within ``tolerance`` points of the
    highest threshold's (all of them when ``tolerance`` is None)."""
    if tolerance is None:
        return table.thresholds
    top = table.accuracy(0)
    return tuple(t for i, t in enumerate(table.thresholds) if table.accuracy(i) >= top - tolerance / 100.0 - 1e-12)


def make_specs(sc: ClusterScenario, table: ThresholdTable, n: int, rate: float, seed: int, profiles,
               thresholds: tuple[float, ...] | None = None, arrivals=None) -> list[ClusterRequestSpec]:
    """n requests drawn from the table by the scenario's mix, Poisson arrivals at ``rate`` (or at the
    sorted times ``arrivals``, seconds); their steps and answers are listed for ``thresholds``
    (default: the table's), highest first."""
    cols = [table.thresholds.index(t) for t in (thresholds or table.thresholds)]
    rng = random.Random(seed)
    mix = MIXES[sc.mix]
    by_cat: dict[str, list[int]] = {}
    for i, c in enumerate(table.categories):
        by_cat.setdefault(c, []).append(i)
    cats = [c for c in mix if c in by_cat]
    blocks = -(-sc.output_tokens // sc.block_tokens)
    base = profiles[1]
    specs, t = [], 0.0
    for k in range(n):
        t = t + rng.expovariate(rate) if arrivals is None else float(arrivals[k])
        p = rng.choice(by_cat[rng.choices(cats, weights=[mix[c] for c in cats])[0]])
        steps = tuple(float(min(blocks + sc.steps_scale * (table.rounds[p][c] - 1), sc.output_tokens)) for c in cols)
        prompt_tokens = max(sc.block_tokens // 2, sc.prompt_scale * len(table.prompts[p]))
        seq = prompt_tokens + sc.output_tokens
        isolated_ms = (blocks * base.round_ms([("recompute", seq, 0)])
                       + (steps[0] - blocks) * base.round_ms([("cached", sc.block_tokens, seq)]))
        text = table.prompts[p]
        specs.append(ClusterRequestSpec(f"r{k}", p, table.categories[p], t, prompt_tokens, sc.output_tokens, steps,
                                        tuple(table.correct[p][c] for c in cols), sc.slo_factor * isolated_ms / 1000.0,
                                        prompt_features=(float(len(text.split())), float(text.count("\n")),
                                                         float(prompt_tokens))))
    return specs


def mean_request(sc: ClusterScenario, table: ThresholdTable, thresholds: tuple[float, ...]) -> tuple[float, float]:
    """(prompt tokens, steps at the highest of ``thresholds``) of the scenario's mean request: the expectation
    over its mix (``make_specs`` draws a category by the mix's weight, then a prompt of it uniformly), exact,
    so it does not depend on a sample's size or seed."""
    col = table.thresholds.index(max(thresholds))
    mix = MIXES[sc.mix]
    by_cat: dict[str, list[int]] = {}
    for i, c in enumerate(table.categories):
        by_cat.setdefault(c, []).append(i)
    cats = [c for c in mix if c in by_cat]
    if not cats:
        raise ValueError(f"mix {sc.mix!r} names no category of the table ({', '.join(sorted(by_cat))})")
    total = sum(mix[c] for c in cats)
    blocks = -(-sc.output_tokens // sc.block_tokens)
    prompt = steps = 0.0
    for c in cats:
        ps = by_cat[c]
        w = mix[c] / total / len(ps)
        for p in ps:
            prompt += w * max(sc.block_tokens // 2, sc.prompt_scale * len(table.prompts[p]))
            steps += w * min(blocks + sc.steps_scale * (table.rounds[p][col] - 1), sc.output_tokens)
    return prompt, steps


def mix_accuracy(sc: ClusterScenario, table: ThresholdTable, threshold: float) -> float:
    """The expected accuracy of the scenario's requests with every step at ``threshold`` (the mix's weights,
    as ``mean_request``); the table's own ``accuracy`` weighs its categories as the held-out set does."""
    col = table.thresholds.index(threshold)
    mix = MIXES[sc.mix]
    by_cat: dict[str, list[int]] = {}
    for i, c in enumerate(table.categories):
        by_cat.setdefault(c, []).append(i)
    cats = [c for c in mix if c in by_cat]
    total = sum(mix[c] for c in cats)
    return sum(mix[c] / total * sum(table.correct[p][col] for p in by_cat[c]) / len(by_cat[c]) for c in cats)


def scenario_capacity(sc: ClusterScenario, table: ThresholdTable, profiles, thresholds: tuple[float, ...],
                      tp_degrees: tuple[int, ...] | None = None):
    """The cluster's capacity at the highest candidate threshold for this scenario's mix
    (``planner.slo_capacity.slo_capacity``: each instance at the most requests per round at which the mean
    request meets its SLO of ``slo_factor`` x its isolated TP-1 latency), as a ``SloCapacity`` (``rps``).
    ``--load X`` offers X times its ``rps``."""
    from planner.costs import StepModel
    from planner.slo_capacity import slo_capacity
    from planner.workload import WorkloadClass

    prompt, steps = mean_request(sc, table, thresholds)
    top = max(thresholds)
    model = StepModel(steps_per_token={top: steps / sc.output_tokens}, block_tokens=sc.block_tokens)
    degrees = sc.tp_degrees if tp_degrees is None else tp_degrees
    counts = {d: degrees.count(d) for d in sorted(set(degrees))}
    return slo_capacity(WorkloadClass("mean", 1.0, prompt, float(sc.output_tokens)), profiles, model, counts,
                        sc.slots, sc.slo_factor, top)


def offered_rate(rate: float | None, load: float | None, capacity_rps: float, default: float) -> float:
    """The arrival rate of a run: ``rate`` (req/s), or ``load`` x ``capacity_rps``; ``default`` without
    either. Both given, or a non-positive one, is an error naming the option."""
    if rate is not None and load is not None:
        raise ValueError("give --rate (requests per second) or --load (a multiple of the capacity), not both")
    if load is not None:
        if not load > 0:
            raise ValueError(f"--load must be positive, got {load}")
        return load * capacity_rps
    if rate is not None and not rate > 0:
        raise ValueError(f"--rate must be positive, got {rate}")
    return default if rate is None else rate


_REPLAYED: dict[tuple, bool] = {}  # (model, prompt, step thresholds) -> answer right


def accuracy_of(table: ThresholdTable, finished, model: str) -> list[bool]:
    """Per finished request: the table's answer if every model step kept one threshold, else a real
    replay of the prompt with the router's schedule."""
    index = {t: i for i, t in enumerate(table.thresholds)}
    out: list[bool | None] = []
    jobs: dict[tuple, list[int]] = {}
    for spec, _lat, schedule in finished:
        steps = step_thresholds(table, spec.prompt_idx, schedule)
        key = (model, spec.prompt_idx, steps)
        if len(set(steps)) == 1:
            out.append(table.correct[spec.prompt_idx][index[steps[0]]])
        elif key in _REPLAYED:
            out.append(_REPLAYED[key])
        else:
            jobs.setdefault(key, []).append(len(out))
            out.append(None)
    keys = list(jobs)
    for key, ok in zip(keys, replay(table, [(k[1], k[2]) for k in keys], model)):
        _REPLAYED[key] = ok
        for j in jobs[key]:
            out[j] = ok
    return [bool(x) for x in out]


def get_cluster_scenario(name: str) -> ClusterScenario:
    try:
        return CLUSTER_SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown cluster scenario {name!r}; known: {', '.join(sorted(CLUSTER_SCENARIOS))}") from None
