"""The device run's figures against issue 10's targets: `python scripts/h200_summary.py OUT_DIR`.

Reads what scripts/h200_check.sh wrote under OUT_DIR (steps.txt, round*.json, and the JSON lines of
bench-engine.log and profile-check.log) and prints one line per figure, each with its target where the
issue sets one, so a session with a device spends its minutes measuring, not reading logs. Missing or
failed steps are named, not skipped silently.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROUND_TARGET_MS = 110.0  # LLaDA-8B shape, 128 slots x 32 tokens over ~300 cached
THROUGHPUT_TARGET = 10.0  # batched engine / best reference loop
LATENCY_TARGET = 1.0  # single-request engine / Fast-dLLM loop
PROFILE_TARGET = 0.10  # the simulator's predicted run time against the recorded one


def _json(path: Path) -> dict | None:
    """A JSON file, or the last line of a log that parses as a JSON object; None if there is none."""
    if not path.exists():
        return None
    text = path.read_text()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def _variants(res: dict) -> dict[str, dict]:
    return {v["variant"]: v for v in res.get("variants", [])}


def _mark(ok: bool) -> str:
    return "met" if ok else "NOT met"


def summarize(out: str | Path) -> list[str]:
    out = Path(out)
    lines = []
    steps = out / "steps.txt"
    if steps.exists():
        failed = [line.split()[0] for line in steps.read_text().splitlines() if " rc=0 " not in f"{line} "]
        lines.append("steps: " + (f"failed or stopped: {', '.join(failed)}" if failed else "all exited 0"))
    else:
        lines.append("steps: no steps.txt (the run did not start)")

    if (r := _json(out / "round.json")) is not None:
        v = _variants(r)
        ms, mfu = v["round"]["median_ms"], v["round"]["mfu"]
        lines.append(f"round ({r['model']} on {r['device']}, {r['dtype']}) {r['slots']}x{r['tokens']} over "
                     f"{r['context']}: {ms:.1f} ms, MFU {mfu:.1%} of {r['peak_tflops']} TFLOP/s "
                     f"(target <= {ROUND_TARGET_MS:g} ms: {_mark(ms <= ROUND_TARGET_MS)})")
        lines += [f"  {name}: {x['median_ms']:.1f} ms" for name, x in v.items() if name != "round"]
        lines += [f"  {name}: failed: {err}" for name, err in r.get("errors", {}).items()]
    else:
        lines.append("round: no result")
    for name, label in (("round-single", "one request"), ("round-gaps", "with gaps"), ("round-moe", "LLaDA2-mini")):
        if (r := _json(out / f"{name}.json")) is not None:
            parts = ", ".join(f"{k} {x['median_ms']:.2f} ms" for k, x in _variants(r).items())
            extra = f" (in place: {r['in_place']})" if r.get("gaps") else ""
            lines.append(f"{name} ({label}){extra}: {parts}")
        else:
            lines.append(f"{name}: no result")

    if (b := _json(out / "bench-engine.log")) is not None:
        t, lat = b["batched_vs_best_loop_throughput"], b["single_vs_fastdllm_latency"]
        lines.append(f"bench engine: batched / best loop {t:.2f}x (target >= {THROUGHPUT_TARGET:g}x: "
                     f"{_mark(t >= THROUGHPUT_TARGET)}); single-request latency / Fast-dLLM loop {lat:.2f} "
                     f"(target <= {LATENCY_TARGET:g}: {_mark(lat <= LATENCY_TARGET)})")
        for name, c in b["contenders"].items():
            lines.append(f"  {name}: {c['tokens_per_s']:.1f} tok/s, mean latency {c['mean_latency_s']:.3f} s, "
                         f"MFU {c['mfu']:.1%}")
        if g := b.get("cuda_graphs"):
            lines.append(f"  engine CUDA graphs: {g['captures']} captured, {g['replays']} replays"
                         + (f", capture failed: {g['failed']}" if g.get("failed") else ""))
    else:
        lines.append("bench engine: no result")

    if (c := _json(out / "profile-check.log")) is not None:
        err = c["total_error"]
        lines.append(f"profile check: {c['rounds']} rounds, error {err:.1%} (target <= {PROFILE_TARGET:.0%}: "
                     f"{_mark(err <= PROFILE_TARGET)}), per round median {c['median_round_error']:.1%}")
        if s := c.get("steady"):
            err = s["total_error"]
            lines.append(f"  without the {c['warming_rounds']} warming rounds: error {err:.1%} "
                         f"({_mark(err <= PROFILE_TARGET)}), per round median {s['median_round_error']:.1%}")
    else:
        lines.append("profile check: no result")
    for name in ("h200-llada8b-measured.json", "h200-llada2mini-measured.json"):
        lines.append(f"{name}: " + ("written; copy it into profiles/" if (out / name).exists() else "missing"))
    return lines


if __name__ == "__main__":
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        sys.exit("usage: python scripts/h200_summary.py OUT_DIR (the folder scripts/h200_check.sh wrote)")
    print("\n".join(summarize(sys.argv[1])))
