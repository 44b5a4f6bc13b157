"""Runs every experiment of the report (fixed seeds) and collects results and fidelity checks.

Each section is a function of an ``ExperimentRunner``; it stores JSON-able results in ``runner.data[section]``,
objects the plots need in ``runner.runs[section]``, and its checks in ``runner.checks``. Every run's
Little's-law check goes to ``runner.little``, every experiment's trace-identity check to
``runner.traces``.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import replace

import numpy as np

from sim.report import checks as ck
from sim.report import paper as P
from sim.report.cluster_runs import ClusterRun, ClusterSetup, capacity_rps, run_combo, setup
from sim.report.instance import (
    PROFILE,
    InstanceRun,
    calibrate_extra,
    extend_budget,
    poisson_arrivals,
    rescale_blocks,
    run_instance,
)
from sim.report.sizes import Plan
from sim.workload import dwise_workload, set_arrivals

DWISE_RATE = 16.0  # burst+Poisson rate of the DWISE scenarios (the paper's lambda for LLaDA)
BASE, SYSTEM = "fcfs-prefill-first", "dwise"
COMBINED, DILA_ALONE, DWISE_ALONE = "remask/dwise", "remask/fcfs", "infaas/dwise"
PLAN_WALK = "remask-plan-walk/dwise"  # diagnostic: the router's old migration walk (cluster_runs.PlanWalk)


def _copy(specs):
    return [replace(s, extra=dict(s.extra)) for s in specs]


class ExperimentRunner:
    def __init__(self, plan: Plan, seed: int = 0, progress: bool = True, profile: str | None = None) -> None:
        self.plan, self.seed = plan, seed
        # the cluster sections' latency profile (None: the scenarios' default); ``cl`` passes it to every setup
        self.cluster_profile = profile
        self.cl: dict = {"profile": profile} if profile else {}
        self.checks: list[ck.Check] = []
        self.little: list[ck.Check] = []
        self.traces: list[ck.Check] = []
        self.data: dict = {}
        self.runs: dict = {}
        self.timing: dict[str, tuple[float, float]] = {}
        self.pending: list[str] = []
        self.errors: dict[str, str] = {}  # section -> the exception it raised
        self._bar = None
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=1, desc="remask report", unit="run", dynamic_ncols=True)
        self._profile = None

    @property
    def profile(self):
        if self._profile is None:
            from engine.latency_profile import load_profile

            self._profile = load_profile(PROFILE)
        return self._profile

    def tick(self, label: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(label[:60])
            self._bar.update()

    def expect(self, units: int) -> None:
        if self._bar is not None:
            self._bar.total += units
            self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.update(self._bar.total - self._bar.n)
            self._bar.close()

    def section(self, name: str, fn) -> None:
        """Run one section; an exception is recorded (the report says so) and the next section runs."""
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            fn(self)
        except Exception as e:  # noqa: BLE001 - reported in REPORT.md and by the exit status
            import traceback

            self.errors[name] = "".join(traceback.format_exception_only(e)).strip()
            if self._bar is not None:
                self._bar.write(f"section {name} failed:\n{traceback.format_exc()}")
        self.timing[name] = (time.perf_counter() - t0, time.process_time() - c0)

    # ---- bookkeeping of checks -----------------------------------------------------------------
    def _little(self, label: str, little: dict) -> None:
        self.little.append(ck.littles_law(label, little["L"], little["X"], little["W"]))

    def inst(self, label: str, specs, policy: str, **kw) -> InstanceRun:
        run = run_instance(specs, policy, self.profile, **kw)
        self._little(f"instance {label} / {policy}", run.little)
        self.tick(f"{label} {policy}")
        return run

    def combo(self, label: str, st: ClusterSetup, combo: str, accuracy: bool = True) -> ClusterRun:
        run = run_combo(st, combo, self.plan.max_replays, accuracy)
        self._little(f"cluster {label} / {combo}", run.little)
        self.tick(f"{label} {combo}")
        return run

    def same_trace(self, label: str, offered: dict[str, str], finished: dict[str, str]) -> None:
        self.traces.append(ck.same_traces(label, offered, finished))

    def inst_group(self, label: str, specs, policies, **kw) -> dict[str, InstanceRun]:
        runs = {p: self.inst(label, specs, p, **kw) for p in policies}
        self.same_trace(f"instance {label}", {p: r.offered_hash for p, r in runs.items()},
                        {p: r.finished_hash for p, r in runs.items()})
        return runs

    def cl_group(self, label: str, st: ClusterSetup, combos, accuracy: bool = True) -> dict[str, ClusterRun]:
        runs = {c: self.combo(label, st, c, accuracy) for c in combos}
        self.same_trace(f"cluster {label}", {c: st.offered_hash for c in runs},
                        {c: r.finished_hash for c, r in runs.items()})
        return runs


# ---- instance level --------------------------------------------------------------------------------------
def instance_main(r: ExperimentRunner) -> None:
    p = r.plan
    base = dwise_workload(p.inst_n, r.seed)
    out = {}
    for arr in ("burst", "burst-poisson"):
        specs = _copy(base)
        set_arrivals(specs, arr, DWISE_RATE, r.seed)
        out[arr] = r.inst_group(f"{arr} n={p.inst_n}", specs, p.inst_policies)
        if BASE in out[arr] and SYSTEM in out[arr]:
            r.checks.append(ck.fcfs_fingerprint(f"FCFS prefill-first fingerprint (DWISE Table 3), {arr}",
                                                out[arr][BASE].rounds, out[arr][SYSTEM].rounds, 128))
    r.runs["instance"] = out
    r.data["instance"] = {arr: {pol: {**run.summary, "composition": run.rounds} for pol, run in runs.items()}
                          for arr, runs in out.items()}


def instance_sweeps(r: ExperimentRunner) -> None:
    p = r.plan
    pols = (BASE, SYSTEM)
    base = dwise_workload(p.sweep_n, r.seed)
    burst = r.runs.get("instance", {}).get("burst", {}).get(BASE)
    sglang_rps = burst.summary["throughput_rps"] if burst else None
    if sglang_rps is None:
        specs = _copy(base)
        set_arrivals(specs, "burst", DWISE_RATE, r.seed)
        sglang_rps = r.inst("sglang throughput", specs, BASE).summary["throughput_rps"]
    load = {}
    for m in p.load_mults:
        rate = m * sglang_rps
        load[m] = {"rate": rate, "runs": r.inst_group(f"poisson {rate:.2f}/s", poisson_arrivals(base, rate, r.seed),
                                                       pols)}
    blocks = {}
    for b in p.blocks:
        specs = rescale_blocks(base, b)
        set_arrivals(specs, "burst-poisson", DWISE_RATE, r.seed)
        blocks[b] = {"mean_rounds": statistics.fmean(s.true_rounds for s in specs),
                     "runs": r.inst_group(f"block {b}", specs, pols, block=b)}
    budgets = {}
    top = max(p.budgets)
    target = P.DWISE_T14["B"].get(top, (None,))[0]  # the paper's mean output at the largest budget
    mu = calibrate_extra(base, target, top, r.seed) if target and top > 256 else 680.0
    for arr in ("burst", "burst-poisson"):
        for bud in p.budgets:
            specs = extend_budget(base, bud, r.seed, mu)
            set_arrivals(specs, arr, DWISE_RATE, r.seed)
            budgets[(arr, bud)] = {"mean_tokens": statistics.fmean(s.output_tokens for s in specs),
                                   "mean_rounds": statistics.fmean(s.true_rounds for s in specs),
                                   "runs": r.inst_group(f"{arr} budget {bud}", specs, pols)}
    r.runs["sweeps"] = {"sglang_rps": sglang_rps, "load": load, "blocks": blocks, "budgets": budgets}

    def summ(d):
        return {k: v for k, v in d.items() if k != "runs"} | {pol: run.summary for pol, run in d["runs"].items()}

    r.runs["sweeps"]["mean_extra"] = mu
    r.runs["sweeps"]["calibration"] = (target, top) if target and top > 256 else None
    r.data["sweeps"] = {"sglang_burst_rps": sglang_rps, "mean_extra_tokens": mu,
                        "load": {str(m): summ(v) for m, v in load.items()},
                        "blocks": {str(b): summ(v) for b, v in blocks.items()},
                        "budgets": {f"{a}/{b}": summ(v) for (a, b), v in budgets.items()}}


def instance_seeds(r: ExperimentRunner) -> None:
    p = r.plan
    pols = (BASE, SYSTEM)
    per = {pol: [] for pol in pols}
    first = None
    for s in p.seeds:
        specs = dwise_workload(p.seed_n, s)
        set_arrivals(specs, "burst-poisson", DWISE_RATE, s)
        runs = r.inst_group(f"seed {s} burst-poisson n={p.seed_n}", specs, pols)
        for pol in pols:
            per[pol].append(runs[pol].summary["mean_latency_s"])
        if first is None:
            first = (specs, runs[SYSTEM].summary)
    speedups = [a / b for a, b in zip(per[BASE], per[SYSTEM])]
    r.checks.append(ck.seed_spread(f"instance seeds: mean latency, burst+Poisson, {len(p.seeds)} seeds", per))
    again = r.inst("determinism rerun", first[0], SYSTEM).summary
    r.checks.append(ck.deterministic("instance determinism: DWISE rerun of the first seed", first[1], again))
    r.data["instance_seeds"] = {"seeds": list(p.seeds), "requests": p.seed_n, "mean_latency_s": per,
                                "speedup": speedups}


# ---- cluster level ---------------------------------------------------------------------------------------
def _summ(runs: dict[str, ClusterRun]) -> dict:
    return {c: {**run.summary, "wall_s": round(run.wall_s, 1)} for c, run in runs.items()}


def _load_info(st: ClusterSetup) -> dict:
    return {"load": round(st.load, 4), "rate": round(st.rate, 3), "capacity_rps": round(st.capacity_rps, 3)}


def cluster_rates(r: ExperimentRunner) -> None:
    """The load sweep (DiLaServe Figure 9): each load a multiple of the 16 x TP-1 capacity."""
    p = r.plan
    out, info = {}, {}
    for load in p.cl_loads:
        st = setup(p.cl_n, load, r.seed, **r.cl)
        r.data["cluster_candidates"] = list(st.rcfg.thresholds)
        r.data["cluster_profile"] = st.sc.profile
        r.data["cluster_capacity_rps"] = round(st.capacity_rps, 3)
        out[load] = r.cl_group(f"load {load:g} ({st.rate:.1f} req/s)", st, p.cl_combos)
        info[str(load)] = _load_info(st)
    r.runs["rates"] = out
    r.data["cluster_rates"] = {str(load): _summ(runs) for load, runs in out.items()}
    r.data["cluster_rates_info"] = info


FIXED_COMBOS = ("infaas/fcfs", "llumnix/fcfs", "infaas/dwise")  # never read SLOs: one run serves every factor
DYNAMIC_COMBOS = ("remask/fcfs", "remask/dwise")


def cluster_slo(r: ExperimentRunner) -> None:
    p = r.plan
    f0 = p.slo_factors[0]
    rate = p.slo_load * capacity_rps(**r.cl)  # at the default SLO's capacity: the same requests for every factor
    fixed = r.cl_group(f"SLO {f0:g}x (fixed-threshold policies)",
                       setup(p.cl_n, rate=rate, seed=r.seed, slo_factor=f0, **r.cl), FIXED_COMBOS)
    out = {}
    for f in p.slo_factors:
        st = setup(p.cl_n, rate=rate, seed=r.seed, slo_factor=f, **r.cl)
        runs = r.cl_group(f"SLO {f:g}x", st, DYNAMIC_COMBOS)
        rows = {c: {**run.summary} for c, run in runs.items()}
        for c, run in fixed.items():
            rows[c] = {**run.summary, "slo_attainment": round(run.attainment(f / f0), 4),
                       "slo_note": f"run once at {f0:g}x; attainment re-scored at {f:g}x"}
        out[f] = rows
    r.runs["slo"] = {"fixed": fixed}
    r.data["cluster_slo"] = {"rate": round(rate, 3), "load": p.slo_load, "factors": {str(f): v for f, v in out.items()}}


ABLATION = ("fixed-threshold/dwise", "dynamic-no-load-control/dwise", "remask/dwise")
MIGRATION = ("remask-no-migration/dwise", "remask-any-step/dwise", "remask/dwise")


def cluster_ablations(r: ExperimentRunner) -> None:
    abl, mig = ABLATION, MIGRATION
    p = r.plan
    st = setup(p.cl_n, p.ablation_load, r.seed, **r.cl)
    data = {"ablation": _summ(r.cl_group(f"ablation load {p.ablation_load:g}", st, abl)),
            "ablation_info": _load_info(st)}
    if p.ablation_all_thresholds:  # the same requests and rate: the candidates differ, not the offered load
        st = setup(p.cl_n, rate=st.rate, seed=r.seed, all_thresholds=True, **r.cl)
        data["ablation_all_thresholds"] = _summ(r.cl_group(f"ablation all thresholds load {p.ablation_load:g}", st,
                                                           abl))
    st = setup(p.cl_n, p.migration_load, r.seed, tp_degrees=p.migration_tps, **r.cl)
    data["migration"] = _summ(r.cl_group(f"migration load {p.migration_load:g}", st, mig))
    data["migration_tps"] = list(p.migration_tps)
    data["migration_info"] = _load_info(st)
    r.data["cluster_ablations"] = data


GRID4 = ("infaas/fcfs", "remask/fcfs", "infaas/dwise", "remask/dwise")


def cluster_lengths(r: ExperimentRunner) -> None:
    """Each length at the same load of its own capacity (its requests' steps and SLOs at that length)."""
    p = r.plan
    out = {}
    for tokens, scale in p.lengths:
        st = setup(p.cl_n, p.length_load, r.seed, output_tokens=tokens, prompt_scale=scale, **r.cl)
        runs = r.cl_group(f"output {tokens} prompt x{scale}", st, GRID4)
        out[f"{tokens}/{scale}"] = {**_load_info(st), "output_tokens": tokens, "prompt_scale": scale,
                                    "mean_prompt_tokens": statistics.fmean(s.prompt_tokens for s in st.specs),
                                    "policies": _summ(runs)}
    r.data["cluster_lengths"] = {"load": p.length_load, "points": out}


def cluster_burst(r: ExperimentRunner) -> None:
    p = r.plan
    combos = (*GRID4, PLAN_WALK)
    rate = p.burst_load * capacity_rps(tp_degrees=p.burst_tps, **r.cl)
    rng = random.Random(r.seed + 31)
    k = int(p.burst_n * p.burst_frac)
    t, arr = 0.0, []
    for i in range(p.burst_n):
        if i >= k:
            t += rng.expovariate(rate)
        arr.append(0.0 if i < k else t)
    st = setup(p.burst_n, rate=rate, seed=r.seed, arrivals=arr, tp_degrees=p.burst_tps, **r.cl)
    runs = r.cl_group("burst+Poisson", st, combos)
    r.runs["burst"] = runs
    r.data["cluster_burst"] = {"requests": p.burst_n, "at_t0": k, **_load_info(st),
                               "tp_degrees": list(p.burst_tps), "policies": _summ(runs)}


DIURNAL = ("infaas/fcfs", "llumnix/fcfs", "remask/fcfs", "infaas/dwise", "remask/dwise", PLAN_WALK)


def cluster_diurnal(r: ExperimentRunner) -> None:
    from loadgen.arrivals import ArrivalParams, arrivals

    p = r.plan
    rate = p.diurnal_load * capacity_rps(**r.cl)
    period = p.diurnal_n / rate
    params = ArrivalParams(rate=rate, period_s=period, amplitude=0.6, bursts_per_period=4.0,
                           burst_s=period / 60.0, burst_factor=1.5)
    times = arrivals("diurnal", p.diurnal_n, params, np.random.default_rng(r.seed))
    st = setup(p.diurnal_n, rate=rate, seed=r.seed, arrivals=times, **r.cl)
    runs = r.cl_group("diurnal", st, DIURNAL)
    r.runs["diurnal"] = {"runs": runs, "period": period, "arrivals": [s.arrival for s in st.specs]}
    r.data["cluster_diurnal"] = {"requests": p.diurnal_n, "mean_rate": round(rate, 3), **_load_info(st),
                                 "amplitude": 0.6, "seconds": round(period, 1), "policies": _summ(runs)}


SEED_COMBOS = ("infaas/fcfs", DILA_ALONE, COMBINED, PLAN_WALK)


def cluster_seeds(r: ExperimentRunner) -> None:
    p = r.plan
    pols = SEED_COMBOS
    slo = {c: [] for c in pols}
    lat = {c: [] for c in pols}
    first = None
    info = None
    for s in p.cl_seeds:
        st = setup(p.cl_n, p.cl_seed_load, s, **r.cl)
        info = info or _load_info(st)
        runs = r.cl_group(f"seed {s} load {p.cl_seed_load:g}", st, pols, accuracy=False)
        for c in pols:
            slo[c].append(runs[c].summary["slo_attainment"])
            lat[c].append(runs[c].summary["mean_latency_s"])
        if first is None:
            first = (st, runs[COMBINED].summary)
    r.checks.append(ck.seed_spread(f"cluster seeds: SLO attainment at load {p.cl_seed_load:g} ({info['rate']:.1f} "
                                   "req/s), "
                                   f"{len(p.cl_seeds)} seeds", {c: slo[c] for c in ("infaas/fcfs", COMBINED)},
                                   higher_is_better=True))
    again = r.combo("determinism rerun", first[0], COMBINED, accuracy=False).summary
    r.checks.append(ck.deterministic("cluster determinism: Remask rerun of the first seed", first[1], again))
    r.data["cluster_seeds"] = {**info, "seeds": list(p.cl_seeds), "slo_attainment": slo,
                               "mean_latency_s": lat}


HEADLINE_POLICIES = ("infaas", "llumnix", "remask")


def _profile_arg(name: str) -> str:
    """A profile name, or a JSON path relative to the working directory or else to the repository's root."""
    from pathlib import Path

    path = Path(name)
    if not path.suffix or path.is_absolute() or path.exists():
        return name
    return str(Path(__file__).resolve().parents[2] / path)


def cluster_headline(r: ExperimentRunner) -> None:
    """``remask simulate --scenario dilaserve-bench --policies infaas,llumnix,remask --load X`` (DWISE instances,
    remask shedding, every mixed-threshold answer replayed) at each headline load, on the cluster profile and on
    each comparison profile beside it: Remask's lead over each baseline and its accuracy loss."""
    from sim.cli import leads
    from sim.cluster_run import run_cluster_scenario
    from sim.cluster_scenarios import get_cluster_scenario

    p = r.plan
    profiles = [r.cluster_profile or get_cluster_scenario("dilaserve-bench").profile]
    profiles += [x for x in p.headline_profiles if x not in profiles]
    out = {}
    for prof in profiles:
        for load in p.headline_loads:
            rep = run_cluster_scenario("dilaserve-bench", list(HEADLINE_POLICIES), p.headline_n, r.seed, load=load,
                                       profile=_profile_arg(prof))
            rep["profile"] = prof
            for name, s in rep["policies"].items():
                r.little.append(ck.littles_law(f"cluster headline {prof} load {load:g} / {name}", s["mean_in_system"],
                                               s["throughput_rps"], s["mean_latency_s"]))
                r.tick(f"headline {prof} {load:g} {name}")
            rep["remask_lead"] = leads(rep)
            out.setdefault(prof, {})[str(load)] = rep
    r.data["cluster_headline"] = {"requests": p.headline_n, "seed": r.seed, "profiles": out}


# ---- the planner-driven trace and the predictors -------------------------------------------------------
def trace_available() -> bool:
    import importlib.util

    from sim.cluster_scenarios import CLUSTER_SCENARIOS

    return "dilaserve-trace" in CLUSTER_SCENARIOS and importlib.util.find_spec("sim.cluster_trace") is not None


def cluster_trace(r: ExperimentRunner) -> None:
    p = r.plan
    if not trace_available():
        r.pending.append("dilaserve-trace (reconfiguration over the 2-hour trace): not in this checkout yet")
        return
    from sim.cluster_scenarios import CLUSTER_SCENARIOS
    from sim.cluster_trace import TraceScenario, run_trace

    trace = TraceScenario()
    if r.cluster_profile:
        trace = replace(trace, requests=replace(CLUSTER_SCENARIOS["dilaserve-trace"], profile=r.cluster_profile))
    rep = run_trace(trace, p.trace_n, r.seed, statics=p.trace_statics)
    rep["profile"] = trace.requests.profile
    r.tick("dilaserve-trace")
    for name, s in rep["policies"].items():
        r.little.append(ck.littles_law(f"cluster trace / {name}", s["mean_in_system"], s["throughput_rps"],
                                       s["mean_latency_s"]))
    arrived = {name: s.get("arrived") for name, s in rep["policies"].items()}
    lost = {name: s.get("lost") for name, s in rep["policies"].items()}
    ok = len(set(arrived.values())) == 1 and not any(lost.values())
    r.traces.append(ck.Check("cluster dilaserve-trace", ok, f"arrived {arrived}; lost {lost}"))
    r.data["cluster_trace"] = rep


def predictors(r: ExperimentRunner) -> None:
    if not r.plan.predictors:
        return
    from sim.report.predictor_cal import calibration

    r.data["predictors"] = calibration("tiny-bd")
    r.tick("predictor calibration")


SECTIONS = {
    "instance": instance_main, "sweeps": instance_sweeps, "instance_seeds": instance_seeds,
    "cluster_headline": cluster_headline,
    "cluster_rates": cluster_rates, "cluster_slo": cluster_slo, "cluster_ablations": cluster_ablations,
    "cluster_lengths": cluster_lengths, "cluster_burst": cluster_burst, "cluster_diurnal": cluster_diurnal,
    "cluster_seeds": cluster_seeds, "cluster_trace": cluster_trace, "predictors": predictors,
}


def units(p: Plan) -> dict[str, int]:
    """Simulation runs per section (the progress bar's total)."""
    two = 2  # SGLang's former and DWISE
    return {
        "instance": 2 * len(p.inst_policies),
        "sweeps": two * (len(p.load_mults) + len(p.blocks) + 2 * len(p.budgets)),
        "instance_seeds": two * len(p.seeds) + 1,
        "cluster_rates": len(p.cl_loads) * len(p.cl_combos),
        "cluster_headline": 3 * len(p.headline_loads) * (1 + len(p.headline_profiles)),
        "cluster_slo": len(FIXED_COMBOS) + len(DYNAMIC_COMBOS) * len(p.slo_factors),
        "cluster_ablations": len(ABLATION) * (1 + p.ablation_all_thresholds) + len(MIGRATION),
        "cluster_lengths": len(GRID4) * len(p.lengths),
        "cluster_burst": len(GRID4) + 1,
        "cluster_diurnal": len(DIURNAL),
        "cluster_seeds": len(SEED_COMBOS) * len(p.cl_seeds) + 1,
        "cluster_trace": 1,
        "predictors": int(p.predictors),
    }


def run_all(plan: Plan, seed: int = 0, progress: bool = True, only: set[str] | None = None,
            profile: str | None = None) -> ExperimentRunner:
    r = ExperimentRunner(plan, seed, progress, profile)
    r.expect(sum(n for k, n in units(plan).items() if only is None or k in only) - 1)
    try:
        for name, fn in SECTIONS.items():
            if only is None or name in only:
                r.section(name, fn)
    finally:
        r.close()
    return r
