"""PNG plots of a replay's results JSON (matplotlib, Agg backend).

- ``latency_cdf.png``: CDFs of TTFT and end-to-end latency (successful requests);
- ``slo_over_time.png``: SLO attainment of requests by arrival time, in windows (failures count as misses);
- ``ttft_vs_prompt.png``: TTFT against prompt length (prompt tokens when the server reported usage,
  else characters), coloured by category.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def latency_cdf(reqs: list[dict], path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("ttft_ms", "TTFT"), ("e2el_ms", "end-to-end")):
        v = np.sort([r[key] for r in reqs if r["ok"] and r[key] is not None])
        if len(v):
            ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=label)
    ax.set_xlabel("latency (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_xscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def slo_over_time(reqs: list[dict], path: Path, window_s: float | None = None) -> None:
    plt = _plt()
    rows = [(r["arrival_s"], bool(r["ok"] and r["slo_met"])) for r in reqs if r["slo_ms"] is not None
            and not r["cancelled"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    if rows:
        t = np.array([a for a, _ in rows])
        met = np.array([m for _, m in rows], dtype=float)
        span = max(float(t.max()), 1e-9)
        window = window_s or max(span / 20, 1.0)
        edges = np.arange(0.0, span + window, window)
        idx = np.clip(np.digitize(t, edges) - 1, 0, len(edges) - 1)
        xs, ys = [], []
        for b in range(len(edges)):
            sel = idx == b
            if sel.any():
                xs.append(edges[b] + window / 2)
                ys.append(met[sel].mean())
        ax.plot(xs, ys, marker="o")
        ax.set_title(f"overall {met.mean():.3f} ({len(rows)} requests with an SLO, {window:.1f} s windows)")
    else:
        ax.set_title("no request had an SLO")
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("arrival time (s)")
    ax.set_ylabel("SLO attainment")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def ttft_vs_prompt(reqs: list[dict], path: Path) -> None:
    plt = _plt()
    ok = [r for r in reqs if r["ok"] and r["ttft_ms"] is not None]
    tokens = all(r.get("prompt_tokens") for r in ok)
    fig, ax = plt.subplots(figsize=(6, 4))
    for cat in sorted({r["category"] for r in ok}):
        sel = [r for r in ok if r["category"] == cat]
        ax.scatter([r["prompt_tokens"] if tokens else r["prompt_chars"] for r in sel], [r["ttft_ms"] for r in sel],
                   s=10, label=cat, alpha=0.7)
    ax.set_xlabel("prompt tokens" if tokens else "prompt characters")
    ax.set_ylabel("TTFT (ms)")
    ax.grid(True, alpha=0.3)
    if ok:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_results(results_path: str | Path, out_dir: str | Path) -> list[Path]:
    """Write the three PNGs for a results JSON into ``out_dir``; their paths."""
    doc = json.loads(Path(results_path).read_text())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    reqs = doc["requests"]
    paths = [out / "latency_cdf.png", out / "slo_over_time.png", out / "ttft_vs_prompt.png"]
    latency_cdf(reqs, paths[0])
    slo_over_time(reqs, paths[1])
    ttft_vs_prompt(reqs, paths[2])
    return paths
