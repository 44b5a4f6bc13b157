"""PNG plots of a report run (matplotlib, Agg). Each function returns the file name it wrote, or None."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

DPI = 90


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out: Path, name: str) -> str:
    """Lay out, write ``out/name`` and free the figure; the file's name, for the report's links."""
    fig.tight_layout()
    fig.savefig(out / name, dpi=DPI)
    _plt().close(fig)
    return name


def _cdf(ax, values, label, **kw) -> None:
    v = np.sort(np.asarray(values, float))
    if len(v):
        ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=label, **kw)


def _cdf_panels(groups: dict[str, dict], out: Path, name: str, *, highlight: str, width: float, fmt: str,
                xlabel: str, log: bool = False, title=lambda key: key) -> str | None:
    """One panel of latency CDFs per group ({title key: {policy: run}}); ``highlight`` drawn thicker."""
    groups = {k: v for k, v in groups.items() if v}
    if not groups:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4.2), squeeze=False)
    for ax, (key, runs) in zip(axes[0], groups.items()):
        for pol, run in runs.items():
            _cdf(ax, run.latencies, f"{pol} ({run.summary['mean_latency_s']:{fmt}} s)",
                 lw=width if pol == highlight else 1.1)
        if log:
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("fraction of requests")
        ax.set_title(title(key))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    return _save(fig, out, name)


def instance_cdfs(runs: dict, out: Path) -> str | None:
    """Latency CDFs of every instance policy, burst and burst+Poisson."""
    return _cdf_panels(runs, out, "instance_latency_cdf.png", highlight="dwise", width=2.2, fmt=".0f",
                       xlabel="end-to-end latency (s, log)", log=True,
                       title=lambda arr: f"one instance, B = 128, {arr}")


def round_composition(runs: dict, out: Path, slots: int = 128) -> str | None:
    """Filled slots per round over time (FCFS prefill-first vs DWISE) and DWISE Table 3's shares."""
    pol_runs = runs.get("burst-poisson") or next(iter(runs.values()), None)
    if not pol_runs or "fcfs-prefill-first" not in pol_runs or "dwise" not in pol_runs:
        return None
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [2, 1]})
    for pol, color in (("fcfs-prefill-first", "tab:red"), ("dwise", "tab:blue")):
        tl = pol_runs[pol].timeline
        t, f = np.asarray(tl["t"]), np.asarray(tl["filled"], float)
        k = max(1, len(f) // 200)
        smooth = np.convolve(f, np.ones(k) / k, mode="same")
        a.plot(t, smooth, color=color, label=f"{pol} (mean {pol_runs[pol].rounds['filled_slots_per_round']:.1f})")
    a.axhline(slots, ls="--", color="grey", lw=0.8)
    a.set_xlabel("virtual time (s)")
    a.set_ylabel(f"filled slots per round (of {slots})")
    a.set_title("round composition, burst+Poisson (running mean)")
    a.legend(fontsize=8)
    cols = ("prefill_only_rounds_frac", "prefill_only_time_frac", "idle_slots_frac")
    names = ("prefill-only\nrounds", "prefill-only\ntime", "idle\nslots")
    x = np.arange(len(cols))
    for i, (pol, color) in enumerate((("fcfs-prefill-first", "tab:red"), ("dwise", "tab:blue"))):
        b.bar(x + (i - 0.5) * 0.38, [100 * pol_runs[pol].rounds[c] for c in cols], 0.38, color=color, label=pol)
    b.set_xticks(x, names)
    b.set_ylabel("%")
    b.set_title("DWISE Table 3's columns")
    b.legend(fontsize=8)
    return _save(fig, out, "round_composition.png")


def load_sweep(sweeps: dict, out: Path) -> str | None:
    load = sweeps.get("load") if sweeps else None
    if not load:
        return None
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    rates = [v["rate"] for v in load.values()]
    for pol in next(iter(load.values()))["runs"]:
        a.plot(rates, [v["runs"][pol].summary["mean_latency_s"] for v in load.values()], "o-", label=f"{pol} mean")
        a.plot(rates, [v["runs"][pol].summary["p99_latency_s"] for v in load.values()], "x--", label=f"{pol} p99")
    a.axvline(sweeps["sglang_rps"], color="grey", ls=":", label="SGLang's burst throughput")
    a.set_yscale("log")
    a.set_xlabel("Poisson rate (req/s)")
    a.set_ylabel("latency (s, log)")
    a.set_title("load sweep (DWISE Figure 9's setting)")
    a.legend(fontsize=7)
    budgets = sweeps.get("budgets", {})
    for arr, marker in (("burst", "o-"), ("burst-poisson", "s-")):
        pts = sorted((bud, v) for (ar, bud), v in budgets.items() if ar == arr)
        if pts:
            b.plot([bud for bud, _ in pts], [v["runs"]["fcfs-prefill-first"].summary["mean_latency_s"]
                                             / v["runs"]["dwise"].summary["mean_latency_s"] for _, v in pts],
                   marker, label=f"Remask sim, {arr}")
    from sim.report.paper import DWISE_T14

    for arr, key, marker in (("burst", "B", "o:"), ("burst-poisson", "P", "s:")):
        b.plot(list(DWISE_T14[key]), [row[4] for row in DWISE_T14[key].values()], marker, color="grey",
               label=f"paper Table 14, {arr}")
    b.set_xscale("log", base=2)
    b.set_xlabel("output budget (tokens)")
    b.set_ylabel("mean-latency speed-up of DWISE over SGLang")
    b.set_title("output-budget sweep")
    b.legend(fontsize=7)
    return _save(fig, out, "instance_sweeps.png")


def slo_vs_rate(data: dict, slo: dict | None, out: Path) -> str | None:
    """SLO attainment and accuracy vs load (a multiple of the capacity) per router/instance pair; attainment vs
    SLO tightness."""
    if not data:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    rates = sorted(float(k) for k in data)
    combos = list(data[str(rates[0])] if str(rates[0]) in data else next(iter(data.values())))
    by_rate = {float(k): v for k, v in data.items()}
    for c in combos:
        style = dict(lw=2.4) if c == "remask/dwise" else dict(lw=1.2, ls="--" if c.endswith("fcfs") else "-")
        axes[0].plot(rates, [by_rate[x][c]["slo_attainment"] for x in rates], marker="o", label=c, **style)
        acc = [by_rate[x][c]["accuracy"] if by_rate[x][c]["accuracy"] is not None else np.nan for x in rates]
        ci = [by_rate[x][c].get("accuracy_ci95") or 0.0 for x in rates]
        axes[1].errorbar(rates, acc, yerr=ci, marker="o", capsize=3, label=c, **style)
    axes[0].set_xlabel("load (x the capacity at threshold 0.9)")
    axes[0].set_ylabel("SLO attainment")
    axes[0].set_title("16 x TP-1, SLO 5x isolated")
    axes[1].set_xlabel("load (x the capacity at threshold 0.9)")
    axes[1].set_ylabel("accuracy (task suite)")
    axes[1].set_title("accuracy (bars: 95% interval of sampled replays)")
    for ax in axes[:2]:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if slo:
        facs = sorted(float(f) for f in slo["factors"])
        rows = {float(f): v for f, v in slo["factors"].items()}
        for c in rows[facs[0]]:
            axes[2].plot(facs, [rows[f][c]["slo_attainment"] for f in facs], marker="o", label=c,
                         lw=2.4 if c == "remask/dwise" else 1.2)
        axes[2].set_xlabel("SLO (x isolated TP-1 latency)")
        axes[2].set_ylabel("SLO attainment")
        axes[2].set_title(f"SLO tightness at load {slo.get('load', '?')} ({slo['rate']:.1f} req/s)")
        axes[2].grid(alpha=0.3)
        axes[2].legend(fontsize=7)
    return _save(fig, out, "cluster_slo_vs_rate.png")


def cluster_cdfs(groups: dict[str, dict], out: Path) -> str | None:
    return _cdf_panels(groups, out, "cluster_latency_cdf.png", highlight="remask/dwise", width=2.4, fmt=".2f",
                       xlabel="latency (s)")


def _windows(per_request, edges, fn):
    out = []
    for a, b in zip(edges[:-1], edges[1:]):
        sel = [x for x in per_request if a <= x[0] < b]
        out.append(fn(sel) if sel else math.nan)
    return out


def thresholds_over_time(diurnal: dict | None, out: Path, windows: int = 30) -> str | None:
    """Offered rate, mean threshold and SLO attainment per window of the diurnal run (by arrival time)."""
    if not diurnal:
        return None
    plt = _plt()
    arr = np.asarray(diurnal["arrivals"])
    edges = np.linspace(arr.min(), arr.max() + 1e-9, windows + 1)
    mid = (edges[:-1] + edges[1:]) / 2
    fig, ax = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    ax[0].step(mid, np.histogram(arr, edges)[0] / np.diff(edges), where="mid", color="k")
    ax[0].set_ylabel("offered (req/s)")
    ax[0].set_title("diurnal trace on 16 x TP-1 (static): thresholds and SLO attainment over time")
    for c, run in diurnal["runs"].items():
        pr = run.per_request
        lw = 2.2 if c == "remask/dwise" else 1.0
        ax[1].plot(mid, _windows(pr, edges, lambda s: float(np.nanmean([x[3] for x in s]))), label=c, lw=lw)
        ax[2].plot(mid, _windows(pr, edges, lambda s: sum(x[1] <= x[2] + 1e-9 for x in s) / len(s)), label=c, lw=lw)
    ax[1].set_ylabel("mean threshold")
    ax[2].set_ylabel("SLO attainment")
    ax[2].set_xlabel("arrival time (s)")
    for a in ax[1:]:
        a.legend(fontsize=7)
        a.grid(alpha=0.3)
    return _save(fig, out, "thresholds_over_time.png")


def tp_over_time(trace: dict | None, out: Path) -> str | None:
    if not trace:
        return None
    from sim.cluster_trace import plot_trace

    name = "tp_configuration_over_time.png"
    plot_trace(trace, str(out / name))
    return name


def predictor_calibration(pred: dict | None, out: Path) -> str | None:
    if not pred or "points" not in pred:
        return None
    plt = _plt()
    pts = pred["points"]
    rounds = np.asarray(pts["rounds"], float)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    hi = max(rounds.max(), 1.0) * 1.3
    for ax, key, color in ((axes[0], "admission", "tab:orange"), (axes[1], "refined", "tab:blue")):
        est = np.asarray(pts[key], float)
        ax.scatter(rounds, est, s=8, alpha=0.4, color=color)
        levels = np.unique(rounds)
        ax.plot(levels, [np.median(est[rounds == v]) for v in levels], "k.-", lw=1, label="median per true count")
        ax.plot([0.8, hi], [0.8, hi], ls="--", color="grey", lw=0.8, label="y = x")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("true rounds (held-out, threshold 0.9)")
        ax.set_ylabel(f"{key} estimate")
        sp = pred[key]["spearman"]
        ax.set_title(f"{key}: Spearman {sp:.3f}, median ratio {pred[key].get('median_ratio', float('nan')):.2f}")
        ax.legend(fontsize=7)
    fig.suptitle(f"predictor calibration ({pred.get('model')}, {pred.get('requests')} held-out requests)")
    return _save(fig, out, "predictor_calibration.png")


def learning_curve(report: dict, path: str | Path) -> str | None:
    """The online step predictor's learning curve of a cluster run (``remask simulate --estimator online``):
    MAPE of remaining steps and Spearman against finished requests seen, per refit, on the refit's holdout
    (the model in service after it) and over the requests served before it. Writes ``path``; None when no
    policy of the report learnt online."""
    curves = {name: r["estimator"]["learning_curve"] for name, r in report.get("policies", {}).items()
              if r.get("estimator", {}).get("learning_curve")}
    if not curves:
        return None
    plt = _plt()
    path = Path(path)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, pts in curves.items():
        x = [p["requests_seen"] for p in pts]
        for ax, key in ((axes[0], "mape"), (axes[1], "spearman")):
            ax.plot(x, [_nan(p[f"holdout_{key}"]) for p in pts], ".-", label=f"{name}: holdout (in service after)")
            ax.plot(x, [_nan(p[f"served_{key}"]) for p in pts], "x--", label=f"{name}: served (before the refit)")
        table = report["policies"][name]["estimator"]
        for ax, key in ((axes[0], "mape"), (axes[1], "spearman")):
            ax.axhline(_nan(table.get(f"served_{key}")), color="grey", lw=0.8, ls=":", label=f"{name}: whole run")
    for ax, label in ((axes[0], "MAPE of remaining steps"), (axes[1], "Spearman (remaining steps)")):
        ax.set_xlabel("finished requests seen")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_yscale("log")
    fig.suptitle(f"online step predictor: {report.get('scenario')}, {report.get('arrival_rate_rps')} req/s, "
                 f"seed {report.get('seed')}")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path.name


def _nan(v) -> float:
    return math.nan if v is None else float(v)
