"""Scenario ``dilaserve-trace``: a BurstGPT-like diurnal trace on 16 GPUs, reconfigured by the planner.

DiLaServe §5.2 / Fig. 8: a 2-hour trace whose rate rises and falls (and bursts), served by a
16-GPU cluster that the two-stage ILP reconfigures every 5 minutes; compared here with static
instance mixes of the same GPUs.

- Requests: those of the other cluster scenarios (``cluster_scenarios``: LLaDA-8B-shaped, 256-token
  canvas, steps and answers from the embedded model's threshold table, ``h200-llada8b-measured`` TP-1/2/4
  profiles), arriving by ``loadgen.arrivals``' diurnal process: one sinusoidal "day" over the
  trace, started at its night trough (night -> peak -> night), peak-to-mean ``amplitude``, short
  bursts.
- Scale: rates are fractions of the cluster's capacity, the highest rate at which Stage 1 finds 16
  TP-1 instances stable and within SLO for this workload (``capacity_rps``): mean ``mean_load``.
- Time compression: simulating 2 hours of a 16-GPU cluster request by request takes too long on two
  cores, so the trace's *slow* time scale is compressed: ``requests`` arrivals over the 2-hour shape
  at the real rates make a trace ``compression`` times shorter, and the planner's period and
  window, the instances' start-up delay and the reporting windows shrink by the same factor.
  Request-level time (step latencies, SLOs, migrations) is real. The report states the factor.
- Reconfiguration: ``planner.Planner`` (Stage 1 in the mixed-rounds model over the single-degree
  configurations, would-be-late requests refused in the model, a change priced against its overlap and,
  when it gains less than 5%, made only once a second period proposes it, Stage 2) on the cluster's
  nodes, its workload monitor fed by the arrivals (sized for the window's busiest minute), its step
  model measured on this workload (``step_model``: steps per token and five step groups), its SLO scale
  the scenario's;
  ``sim.reconfig.PlannerController`` carries the transitions out (start-up delay, drain and migrate,
  nothing dropped). ``stage1_rounds="separate"`` with ``buffer=0.2`` and ``monitor_lookahead_s=300``
  is the planner of the first measurements.
- Load calibration (``capacity_rps``) is frozen (``CALIBRATION``): it does not follow the planner's Stage 1.
- Static configurations: every mix in ``statics`` (TP-1, TP-2, TP-4 counts) for the whole trace.
- Admission: off by default (``shed``); with it, a refused request is a miss in the window it arrived in.

``run_trace`` returns a JSON-able report (per configuration: ``cluster.summarize``; per reporting
window: offered rate, instances per TP degree, SLO attainment); ``plot_trace`` draws it.
``python -m sim.cluster_trace --plot out.png --json`` runs it; ``remask simulate --scenario
dilaserve-trace`` prints the same report.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from cluster import RouterConfig
from engine.latency_profile import load_tp_profiles
from loadgen.arrivals import ArrivalParams, arrivals
from planner import Cluster, Planner, PlannerConfig, Stage1Config, StepModel, WorkloadMonitor, plan_capacity
from sim.cluster import ClusterConfig, ClusterRequestSpec, ClusterResult, ClusterSimulator, sheds, summarize
from sim.cluster_scenarios import CLUSTER_SCENARIOS, ClusterScenario, candidate_thresholds, make_specs
from sim.reconfig import PlannerController
from sim.threshold_table import ThresholdTable, load_table


@dataclass(frozen=True)
class TraceScenario:
    name: str = "dilaserve-trace"
    requests: ClusterScenario = CLUSTER_SCENARIOS["dilaserve-trace"]  # request shape, SLO factor, model table
    # the router: SLO-fit placement (a request goes to the lowest TP degree where it finishes in time) lifts
    # every static mix of two TP degrees here by 1.7-15 points over Alg. 3 (reports/planner.md,
    # "SLO-fit placement")
    policy: str = "remask-fit"
    # refuse arrivals that cannot meet their SLO (None: as the policy does by default). Off: on this trace the
    # admission governor sheds more than it saves (reports/planner.md, "Shedding on the trace")
    shed: bool | None = False
    nodes: tuple[int, ...] = (4, 4, 4, 4)  # 16 GPUs, 4 per node (DiLaServe's GH200 cluster)
    degrees: tuple[int, ...] = (1, 2, 4)
    trace_s: float = 7200.0  # the trace's real length
    mean_load: float = 0.4  # mean rate / capacity
    amplitude: float = 0.65  # sinusoid peak-to-mean
    start_phase: float = 0.75  # where in the "day" the trace starts (0.75: the trough, so night -> peak -> night)
    bursts: float = 8.0  # over the whole trace
    burst_s: float = 60.0  # real seconds
    burst_factor: float = 1.3
    period_s: float = 300.0  # planner period, real seconds
    window_s: float = 300.0  # workload monitor window, real seconds
    # the monitor sizes for the busiest minute of its window (slices: 1 for the window's mean), with no buffer
    # and no trend: the mixed-rounds Stage 1 estimates the share within SLO itself, and a margin on the rates
    # on top made it leave TP-4 early (the separate-rounds planner was measured with buffer 0.2, lookahead 300)
    buffer: float = 0.0  # monitor's safety buffer on rates
    monitor_slices: int = 5
    monitor_lookahead_s: float = 0.0  # ... or for where the window's trend is a period ahead, if higher (0: off)
    min_gain: float = 0.10  # hysteresis
    min_met_gain: float = 0.02  # the mixed model: a change pays this share of a period's requests within SLO, net
    confirm_below: float = 0.05  # PlannerConfig.confirm_below
    confirm: str = "change"  # PlannerConfig.confirm: with 25 configurations, near-equal ones take turns as proposal
    single_batch: bool = False  # Stage 1 with one recompute and one cached batch per TP degree (the paper's z, z')
    stage1_rounds: str = "mixed"  # the planner's Stage 1 model (Stage1Config.rounds); "separate": the first one
    mixed_search: str = "every"  # Stage1Config.mixed_search: each of the 25 ways to fill the 16 GPUs
    # Stage1Config.occupancy: with mixed configurations the queue model tells them apart where the fluid
    # model finds every one of them within SLO (reports/planner.md, "SLO-fit placement")
    occupancy: str = "queue"
    placement: str | None = None  # Stage1Config.placement; None: as the router places (group for remask-fit)
    # the planner's model refuses would-be-late requests (Stage1Config.shed) though the cluster admits everything:
    # compressed, an overload lasts a period of a few seconds of request time, and what it costs is about what
    # refusing the excess would (without: the model sees a collapse, and the planner left 4 x TP-4 too early at
    # 1.75x; mean -0.57 points against +0.43 with)
    planner_refusals: bool = True
    forecast: bool = False  # PlannerConfig.forecast: weigh the loads past period-to-period changes foretell
    step_groups: int = 5  # the planner's step model: a class's requests in this many groups by steps (spread)
    start_delay_s: float = 30.0  # a new instance serves this long after its start (model load; real seconds)
    make_before_break: bool = True  # new instances load beside the old ones, which serve until they are ready
    overlap_slowdown: float = 1.1  # round time factor on a node's GPUs while a new instance shares them
    report_windows: int = 48  # reporting windows over the trace (2.5 minutes each)
    statics: tuple[tuple[int, int, int], ...] = ((16, 0, 0), (12, 0, 1), (8, 0, 2), (4, 0, 3), (0, 0, 4),
                                                 (0, 8, 0), (8, 4, 0))


def step_model(specs: list[ClusterRequestSpec], thresholds: tuple[float, ...], block: int,
               groups: int = 1) -> StepModel:
    """Steps per output token at each candidate threshold, measured on the workload's requests; with
    ``groups`` > 1 also their spread: the requests in ``groups`` equal parts by their steps at the highest
    threshold relative to the mean, each part's mean ratio its factor."""
    spt = {t: statistics.fmean(s.steps[i] / s.output_tokens for s in specs) for i, t in enumerate(thresholds)}
    if groups < 1 or groups > len(specs):
        raise ValueError(f"groups must be in 1..{len(specs)}, got {groups}")
    top = thresholds.index(max(thresholds))
    mean = spt[max(thresholds)]
    ratios = sorted(s.steps[top] / s.output_tokens / mean for s in specs)
    parts = np.array_split(np.asarray(ratios), groups)
    spread = tuple((len(p) / len(ratios), float(p.mean())) for p in parts)
    return StepModel(steps_per_token=spt, block_tokens=block, kv_cache="approx", spread=spread)


def _batches(sc: TraceScenario) -> tuple[int, ...]:
    return tuple(b for b in (1, 2, 4, 8, 16, 32, 64) if b <= sc.requests.slots)


def _placement(sc: TraceScenario) -> str:
    """Stage 1's placement: as given, else as the router places (by step group where it places by SLO fit)."""
    if sc.placement is not None:
        return sc.placement
    return "group" if sc.policy == "remask-fit" else "class"


def _stage1(sc: TraceScenario, steps: StepModel) -> Stage1Config:
    levels = tuple(b for b in Stage1Config().levels if b <= sc.requests.slots)
    # no wall-clock cap on the search: the simulator plans in virtual time, and a cap made a run's plans
    # depend on how busy the machine was (the same command gave 0.9445 and 0.9495)
    return Stage1Config(slo_scale=sc.requests.slo_factor, batches=_batches(sc), solver="auto",
                        single_batch=sc.single_batch, rounds=sc.stage1_rounds, levels=levels,
                        mixed_search=sc.mixed_search, time_limit_s=None,
                        shed=sc.planner_refusals,
                        occupancy=sc.occupancy, placement=_placement(sc))


# The trace's load calibration: Stage 1 in the separate-rounds model with a class's mean request, its
# parameters pinned here, as it was when the scenario was calibrated. The planner under test may change
# its own Stage 1 (``_stage1``); the trace it is tested on (its rates) must not move with it.
CALIBRATION = {"utilisation": 0.9, "secondary_weight": 1e-3, "time_limit_s": 1.5, "single_batch": False,
               "rounds": "separate"}


def capacity_rps(sc: TraceScenario, specs: list[ClusterRequestSpec], profiles, steps: StepModel) -> float:
    """Highest rate at which all-TP-1 on the cluster is feasible for the calibration model (``CALIBRATION``:
    stable, a class's mean request within SLO), by bisection."""
    monitor = WorkloadMonitor(window_s=1.0, buffer=0.0)
    for s in specs:
        monitor.record(0.0, s.prompt_tokens, s.output_tokens)
    shape = monitor.classes(0.0)
    total = sum(c.rate for c in shape)
    gpus = sum(sc.nodes)
    cfg = Stage1Config(slo_scale=sc.requests.slo_factor, batches=_batches(sc), solver="auto", **CALIBRATION)
    steps = replace(steps, spread=((1.0, 1.0),))
    fixed = {d: (gpus if d == 1 else 0) for d in sc.degrees}

    def ok(rate: float) -> bool:
        classes = [replace(c, rate=c.rate * rate / total) for c in shape]
        return plan_capacity(classes, gpus, profiles, steps, cfg, fixed_counts=fixed).feasible

    lo, hi = 0.0, 8.0 * gpus
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
        if hi - lo < 0.05:
            break
    return lo


@dataclass
class _Run:
    res: ClusterResult
    wall_s: float
    controller: PlannerController | None = None


def _simulate(sc: TraceScenario, specs, profiles, rcfg: RouterConfig, seq_tokens: int, tps: tuple[int, ...],
              seed: int, planner: Callable[[Callable[[], float]], Planner] | None = None, start_delay_s: float = 0.0,
              tick_s: float = 1.0) -> _Run:
    """One run: the static instances ``tps``, or (``planner``: a factory given the virtual clock) the
    planner's starting placement, reconfigured as it decides."""
    q = sc.requests
    cfg = ClusterConfig(tps, q.slots, q.block_tokens, seq_tokens, router=rcfg, shed=sheds(sc.policy, sc.shed))
    t0 = time.perf_counter()
    sim = ClusterSimulator(cfg, profiles, sc.policy, seed)
    ctl = None
    if planner is not None:
        ctl = PlannerController(sim, planner(sim.clock.now), start_delay_s, tick_s, sc.make_before_break,
                                sc.overlap_slowdown)
        ctl.begin(specs[0].arrival)
    res = sim.run(specs)
    return _Run(res, time.perf_counter() - t0, ctl)


def mix_name(mix: tuple[int, ...], degrees) -> str:
    """'12xTP1+1xTP4' for the counts ``mix`` of ``degrees``."""
    return "+".join(f"{n}xTP{d}" for n, d in zip(mix, degrees) if n)


def _static_name(mix: tuple[int, int, int], degrees) -> str:
    return "static-" + mix_name(mix, degrees)


def parse_mixes(text: str) -> tuple[tuple[int, ...], ...]:
    """'16,0,0;4,0,3' -> ((16, 0, 0), (4, 0, 3)): instance counts per TP degree, one mix per ';'."""
    return tuple(tuple(int(v) for v in part.split(",")) for part in text.split(";") if part.strip())


def run_trace(sc: TraceScenario | None = None, n: int = 6000, seed: int = 0, mean_rate: float | None = None,
              statics: tuple[tuple[int, int, int], ...] | None = None, progress: bool = False,
              workers: int = 1, table: ThresholdTable | None = None) -> dict:
    """Simulate the trace with planner-driven reconfiguration and with each static mix (``workers`` > 1:
    the static mixes run in ``workers - 1`` other processes while this one runs the reconfiguration).
    ``table``: the requests' per-threshold truth (default: the scenario model's cached table)."""
    sc = sc or TraceScenario()
    q = sc.requests
    statics = sc.statics if statics is None else statics
    gpus = sum(sc.nodes)
    for mix in statics:
        if sum(k * d for k, d in zip(mix, sc.degrees)) > gpus:
            raise ValueError(f"static mix {mix} needs more than {gpus} GPUs")
    if table is None:
        table = load_table(q.model, q.table_prompts, thresholds=RouterConfig().thresholds, progress=progress)
    rcfg = RouterConfig(thresholds=candidate_thresholds(table, q.quality_tolerance))
    profiles = load_tp_profiles(q.profile, sc.degrees)
    probe = make_specs(q, table, 4000, 1.0, seed + 1, profiles, rcfg.thresholds)
    steps = step_model(probe, rcfg.thresholds, q.block_tokens, sc.step_groups)
    cap = capacity_rps(sc, probe, profiles, steps)
    rate = mean_rate if mean_rate is not None else sc.mean_load * cap
    duration = n / rate  # compressed trace length
    compression = sc.trace_s / duration
    params = ArrivalParams(rate=rate, period_s=duration, amplitude=sc.amplitude, bursts_per_period=sc.bursts,
                           burst_s=sc.burst_s / compression, burst_factor=sc.burst_factor)
    times = arrivals("diurnal", int(n * (1.5 + sc.start_phase)) + 100, params, np.random.default_rng(seed))
    times = times[times >= sc.start_phase * duration][:n]  # the generator's day starts at its mean, rising
    if len(times) < n:
        raise ValueError("the diurnal generator gave too few arrivals; lower start_phase")
    times = times - sc.start_phase * duration
    specs = make_specs(q, table, n, rate, seed, profiles, rcfg.thresholds, arrivals=times)
    seq_tokens = sum(s.prompt_tokens + s.output_tokens for s in specs) // len(specs)

    cluster = Cluster(tuple(sc.nodes))
    change_s = (sc.start_delay_s if sc.make_before_break else 0.0) / compression  # priced by the mixed model
    pcfg = PlannerConfig(period_s=sc.period_s / compression, min_gain=sc.min_gain, stage1=_stage1(sc, steps),
                         steps=steps, min_met_gain=sc.min_met_gain, change_s=change_s,
                         overlap_slowdown=sc.overlap_slowdown, forecast=sc.forecast,
                         confirm_below=sc.confirm_below, confirm=sc.confirm)

    def planner(clock: Callable[[], float]) -> Planner:  # first re-plan a period after the trace starts (t = 0)
        monitor = WorkloadMonitor(window_s=sc.window_s / compression, buffer=sc.buffer, slices=sc.monitor_slices,
                                  lookahead_s=sc.monitor_lookahead_s / compression)
        return Planner(cluster, profiles, pcfg, monitor, clock=clock)

    runs: dict[str, _Run] = {}
    if progress:
        print(f"dilaserve-trace: {n} requests, mean {rate:.1f} req/s (capacity {cap:.1f}), "
              f"compression {compression:.1f}x", file=sys.stderr)
    jobs = {_static_name(mix, sc.degrees): tuple(d for k, d in zip(mix, sc.degrees) for _ in range(k))
            for mix in statics}
    pool = futures = None
    if workers > 1 and jobs:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        pool = ProcessPoolExecutor(workers - 1, mp_context=multiprocessing.get_context("fork"))
        futures = {name: pool.submit(_simulate, sc, specs, profiles, rcfg, seq_tokens, tps, seed)
                   for name, tps in jobs.items()}
    runs["reconfig"] = _simulate(sc, specs, profiles, rcfg, seq_tokens, (), seed, planner,
                                 sc.start_delay_s / compression, tick_s=min(1.0, sc.period_s / compression / 10))
    for name, tps in jobs.items():
        runs[name] = futures[name].result() if futures else _simulate(sc, specs, profiles, rcfg, seq_tokens, tps, seed)
        if progress:
            print(f"  {name}: {runs[name].wall_s:.1f}s", file=sys.stderr)
    if pool is not None:
        pool.shutdown()
    return _report(sc, n, seed, rate, cap, compression, duration, steps, rcfg, table, specs, runs)


def _accuracy(table: ThresholdTable, res: ClusterResult, thresholds) -> tuple[list[bool], int]:
    """The table's answers of finished requests that kept one threshold (no model replays here)."""
    col = {t: table.thresholds.index(t) for t in thresholds}
    out = [table.correct[spec.prompt_idx][col[sched[0][1]]] for spec, _, sched in res.finished if len(sched) == 1]
    return out, len(out)


def _report(sc, n, seed, rate, cap, compression, duration, steps, rcfg, table, specs, runs) -> dict:
    W = sc.report_windows
    t0 = specs[0].arrival
    width = duration / W
    edges = t0 + width * np.arange(W + 1)
    arr = np.array([s.arrival for s in specs])
    offered = np.histogram(arr, edges)[0] / width
    configs, per_window, met_by = {}, {}, {}
    tot = np.bincount(np.minimum(((arr - t0) / width).astype(int), W - 1), minlength=W)  # refused ones too
    for name, run in runs.items():
        correct, kept = _accuracy(table, run.res, rcfg.thresholds)
        summary = summarize(run.res, specs, correct)
        summary.update({"accuracy_scope": f"{kept} requests that kept one threshold (table answers)",
                        "arrived": run.res.arrived, "lost": run.res.lost, "evacuated": run.res.evacuated,
                        "held": run.res.held, "wall_s": round(run.wall_s, 1)})
        configs[name] = summary
        met = np.zeros(W)
        for spec, lat, _ in run.res.finished:
            met[min(int((spec.arrival - t0) / width), W - 1)] += lat <= spec.slo_s + 1e-9
        met_by[name] = met
        per_window[name] = [round(float(m / t), 4) if t else None for m, t in zip(met, tot)]
    statics = [k for k in configs if k.startswith("static-")]
    # a bound for any schedule over the static mixes: in every window the one that did best there, changed
    # to for free (optimistic: a per-window best also picks up each window's luck)
    hindsight = float(np.max([met_by[k] for k in statics], axis=0).sum() / len(specs)) if statics else None
    best = max(statics, key=lambda k: (configs[k]["slo_attainment"], configs[k]["mean_threshold"])) if statics else None
    ctl = runs["reconfig"].controller
    counts = _window_counts(ctl.log.timeline, edges, sc.degrees)
    lo_w, hi_w = _terciles(offered)
    mix = {"low_load": _mean_counts(counts, lo_w, sc.degrees), "peak_load": _mean_counts(counts, hi_w, sc.degrees)}
    scale = compression / 60.0  # compressed seconds -> trace minutes
    return {
        "scenario": sc.name, "requests": n, "seed": seed, "profile": sc.requests.profile,
        "gpus": sum(sc.nodes), "nodes": list(sc.nodes), "slots": sc.requests.slots,
        "arrival_rate_rps": round(rate, 3), "capacity_rps_all_tp1": round(cap, 2),
        "peak_window_rps": round(float(offered.max()), 2), "low_window_rps": round(float(offered.min()), 2),
        "slo_factor": sc.requests.slo_factor, "mix": sc.requests.mix, "shedding": sheds(sc.policy, sc.shed),
        "router_policy": sc.policy,
        "candidate_thresholds": list(rcfg.thresholds),
        "steps_per_token": {f"{t:g}": round(v, 4) for t, v in steps.steps_per_token.items()},
        "time_compression": round(compression, 2), "trace_minutes": round(sc.trace_s / 60, 1),
        "simulated_seconds": round(duration, 1),
        "planner": {"period_s_trace": sc.period_s, "period_s_simulated": round(sc.period_s / compression, 3),
                    "window_s_trace": sc.window_s, "buffer": sc.buffer, "monitor_slices": sc.monitor_slices,
                    "monitor_lookahead_s_trace": sc.monitor_lookahead_s,
                    "single_batch": sc.single_batch, "stage1_rounds": sc.stage1_rounds,
                    "mixed_search": sc.mixed_search, "occupancy": sc.occupancy, "placement": _placement(sc),
                    "refusals": sc.planner_refusals,
                    "forecast": sc.forecast, "confirm_below": sc.confirm_below, "confirm": sc.confirm,
                    "step_groups": [list(g) for g in steps.spread],
                    "min_gain": sc.min_gain, "min_met_gain": sc.min_met_gain,
                    "start_delay_s_trace": sc.start_delay_s, "plans": ctl.log.plans, "starts": ctl.log.starts,
                    "stops": ctl.log.stops, "make_before_break": sc.make_before_break,
                    "overlap_slowdown": sc.overlap_slowdown, "decisions": ctl.log.decisions},
        # each reconfiguration: when it began and ended (trace minutes), its actions, and the GPU-seconds (trace
        # seconds) of GPUs that served nothing meanwhile
        "transitions": [{"minute": round((tr["t"] - t0) * scale, 3),
                         "done_minute": None if tr["done_t"] is None else round((tr["done_t"] - t0) * scale, 3),
                         "starts": tr["starts"], "stops": tr["stops"],
                         "dark_gpu_s": round(tr["dark_gpu_s"] * compression, 1)} for tr in ctl.log.transitions],
        "reconfig_beats_best_static": None if best is None else
        configs["reconfig"]["slo_attainment"] > configs[best]["slo_attainment"],
        "best_static": best,
        "hindsight_static": None if hindsight is None else round(hindsight, 4),
        "instances_by_load": mix,
        "policies": configs,
        "windows": {"minutes": [round(float((e - t0) * scale), 2) for e in edges[:-1]],
                    "offered_rps": [round(float(x), 3) for x in offered],
                    "instances": {str(d): [round(c[d], 3) for c in counts] for d in sc.degrees},
                    "slo_attainment": per_window},
        "timeline": [{"minute": round((t - t0) * scale, 3), **{str(d): c[d] for d in sc.degrees}}
                     for t, c in ctl.log.timeline],
    }


def _window_counts(timeline, edges, degrees) -> list[dict[int, float]]:
    """Time-average serving instances per TP degree in each window (the timeline is a step function)."""
    out = []
    pts = [(t, c) for t, c in timeline]
    for a, b in zip(edges[:-1], edges[1:]):
        acc = {d: 0.0 for d in degrees}
        for i, (t, c) in enumerate(pts):
            nxt = pts[i + 1][0] if i + 1 < len(pts) else math.inf
            lo, hi = max(a, t), min(b, nxt)
            if hi > lo:
                for d in degrees:
                    acc[d] += c[d] * (hi - lo)
        out.append({d: acc[d] / (b - a) for d in degrees})
    return out


def _terciles(offered: np.ndarray) -> tuple[list[int], list[int]]:
    order = np.argsort(offered)
    k = max(len(order) // 3, 1)
    return [int(i) for i in order[:k]], [int(i) for i in order[-k:]]


def _mean_counts(counts, idx, degrees) -> dict[str, float]:
    m = {str(d): round(statistics.fmean(counts[i][d] for i in idx), 2) for d in degrees}
    m["instances"] = round(sum(m[str(d)] for d in degrees), 2)
    m["gpus"] = round(sum(d * m[str(d)] for d in degrees), 2)
    return m


def plot_trace(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = report["windows"]
    x = w["minutes"]
    width = x[1] - x[0] if len(x) > 1 else 1.0
    fig, ax = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    ax[0].step(x, w["offered_rps"], where="post", color="k", label="offered (per window)")
    ax[0].axhline(report["capacity_rps_all_tp1"], ls="--", color="grey", lw=0.8,
                  label="Stage 1's capacity of all TP-1")
    ax[0].set_ylabel("offered rate (req/s)")
    ax[0].legend(loc="upper right")
    ax[0].set_title(f"{report['scenario']}: {report['gpus']} GPUs, {report['requests']} requests, "
                    f"time compressed {report['time_compression']}x (SLO {report['slo_factor']}x isolated TP-1)")
    tl = report["timeline"]
    tx = [p["minute"] for p in tl] + [x[-1] + width]
    for d, color in zip(sorted(w["instances"], key=int), ("tab:blue", "tab:orange", "tab:green", "tab:red")):
        ax[1].step(tx, [p[d] for p in tl] + [tl[-1][d]], where="post", label=f"TP-{d}", color=color)
    ax[1].set_ylabel("instances (reconfig)")
    ax[1].legend(loc="upper right")
    att = w["slo_attainment"]
    best = report["best_static"]
    for name, series in att.items():
        if name in ("reconfig", best):
            continue
        ax[2].plot(x, [np.nan if v is None else v for v in series], color="lightgrey", lw=0.8)
    if best:
        ax[2].plot(x, [np.nan if v is None else v for v in att[best]], color="tab:purple",
                   label=f"best static ({best[7:]}): {report['policies'][best]['slo_attainment']:.3f}")
    ax[2].plot(x, [np.nan if v is None else v for v in att["reconfig"]], color="tab:red",
               label=f"reconfig: {report['policies']['reconfig']['slo_attainment']:.3f}")
    ax[2].set_ylabel("SLO attainment per window")
    ax[2].set_xlabel("trace time (minutes)")
    ax[2].set_ylim(-0.02, 1.02)
    ax[2].legend(loc="lower left", title="grey: other static mixes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_report(r: dict) -> str:
    lines = [f"{r['scenario']}: {r['requests']} requests, mean {r['arrival_rate_rps']} req/s "
             f"(windows {r['low_window_rps']}-{r['peak_window_rps']}; all-TP-1 capacity {r['capacity_rps_all_tp1']}), "
             f"{r['gpus']} GPUs, SLO {r['slo_factor']}x, time compressed {r['time_compression']}x "
             f"({r['trace_minutes']} trace minutes in {r['simulated_seconds']} s)"]
    for name, s in sorted(r["policies"].items(), key=lambda kv: -kv[1]["slo_attainment"]):
        lines.append(f"  {name:28s} SLO {s['slo_attainment']:.4f}  mean {s['mean_latency_s']:6.2f}s  "
                     f"p99 {s['p99_latency_s']:6.2f}s  mean threshold {s['mean_threshold']:.3f}  "
                     f"lost {s['lost']}  evacuated {s['evacuated']}  ({s['wall_s']}s)")
    p = r["planner"]
    lines.append(f"  planner: {p['plans']} transitions ({p['starts']} starts, {p['stops']} stops); "
                 f"low load {r['instances_by_load']['low_load']}, peak {r['instances_by_load']['peak_load']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sim.cluster_trace", description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=6000, help="arrivals over the trace (sets the compression)")
    ap.add_argument("--rate", type=float, help="mean rate, req/s (default: mean_load x capacity)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slo-factor", type=float, help="SLO = k x isolated TP-1 latency")
    ap.add_argument("--lookahead", type=float, help="monitor: trend look-ahead, trace seconds (0: off)")
    ap.add_argument("--single-batch", action="store_true", help="Stage 1 with one batch per TP degree")
    ap.add_argument("--stage1-rounds", choices=("mixed", "separate"), help="the planner's Stage 1 model")
    ap.add_argument("--placement", choices=("class", "group"), help="Stage 1 (mixed): the router places by class "
                    "or by step group")
    ap.add_argument("--mixed-search", choices=("milp", "single-degree", "every"),
                    help="Stage 1 (mixed): how counts are chosen")
    ap.add_argument("--planner-refusals", choices=("on", "off"), help="the planner's model refuses would-be-late "
                    "requests (default: on)")
    ap.add_argument("--forecast", choices=("on", "off"), help="the planner weighs the loads past changes foretell")
    ap.add_argument("--occupancy", choices=("queue", "level"), help="Stage 1 (mixed): the occupancy a request meets")
    ap.add_argument("--step-groups", type=int, help="the planner's step model: groups of a class's requests by steps")
    ap.add_argument("--min-met-gain", type=float, help="a change pays this share of a period's requests within SLO")
    ap.add_argument("--confirm", choices=("same", "change"), help="a second period agrees by proposing the same "
                    "counts, or any change that pays")
    ap.add_argument("--confirm-below", type=float, help="a change that gains less (net) waits for a second period")
    ap.add_argument("--buffer", type=float, help="monitor: safety buffer on rates (0.2: 20%%)")
    ap.add_argument("--slices", type=int, help="monitor: size for the busiest of this many slices (1: the mean)")
    ap.add_argument("--shed", choices=("auto", "on", "off"), default="off",
                    help="refuse arrivals that cannot meet their SLO (auto: as the policy does by default)")
    ap.add_argument("--policy", help="the router policy (default: remask)")
    ap.add_argument("--statics", help="static mixes to compare, e.g. '16,0,0;4,0,3' (TP-1,TP-2,TP-4 counts)")
    ap.add_argument("--plot", help="write the figure here (PNG)")
    ap.add_argument("--out", help="write the JSON report here")
    ap.add_argument("--json", action="store_true", help="print the JSON report")
    ap.add_argument("--workers", type=int, default=1, help="processes (2: the static mixes beside the reconfig run)")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    sc = TraceScenario()
    if args.slo_factor is not None:
        sc = replace(sc, requests=replace(sc.requests, slo_factor=args.slo_factor))
    fields = {"slices": "monitor_slices", "buffer": "buffer", "min_met_gain": "min_met_gain",
              "lookahead": "monitor_lookahead_s", "stage1_rounds": "stage1_rounds", "mixed_search": "mixed_search",
              "step_groups": "step_groups", "occupancy": "occupancy",
              "confirm_below": "confirm_below", "confirm": "confirm", "policy": "policy",
              "placement": "placement"}  # flag -> TraceScenario field, where given
    sc = replace(sc, **{f: getattr(args, a) for a, f in fields.items() if getattr(args, a) is not None})
    if args.single_batch:
        sc = replace(sc, single_batch=True)
    sc = replace(sc, shed={"auto": None, "on": True, "off": False}[args.shed])
    if args.planner_refusals:
        sc = replace(sc, planner_refusals=args.planner_refusals == "on")
    if args.forecast:
        sc = replace(sc, forecast=args.forecast == "on")
    statics = None
    if args.statics:
        statics = parse_mixes(args.statics)
    report = run_trace(sc, args.requests, args.seed, args.rate, statics, progress=not args.quiet, workers=args.workers)
    if args.plot:
        plot_trace(report, args.plot)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f)
    print(json.dumps(report) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
