"""The device run's figures against issue 34's targets: `python scripts/h200_summary.py DIR`.

Reads what scripts/h200_check.sh wrote in DIR (the folder it packs into h200-check.tar.gz: steps.txt,
fixtures.json, gpu-tests.log, round*.json, recompute.json, kernels-*.json, the JSON lines of bench-engine.log,
profile-check.log and profile-dg-check.log, the measured profiles) and prints one line per figure, each with its
target where the issue sets one, so a session with a device spends its minutes measuring, not reading logs. Missing,
failed and skipped steps are named, not passed over.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROUND_TARGET_MS = 100.0  # LLaDA-8B shape, 128 slots x 32 tokens over 300 cached
SINGLE_TARGET_MS = 5.0  # the same shape, one request (CUDA graphs)
MOE_TARGET_MS = 16.0  # LLaDA2-mini shape, 32 x 32 (CUDA graphs)
THROUGHPUT_TARGET = 10.0  # batched engine / best reference loop
LATENCY_TARGET = 1.0  # single-request engine / Fast-dLLM loop
PROFILE_TARGET = 0.10  # the profile's predicted run time against the recorded one, over the whole run
FITS = (128, 512)  # the largest prefill case of the 8B profile: batch x prompt tokens
GRAPHS = "round, CUDA graphs"  # the variant the engine runs for small rounds, where graphs are on
RECOMPUTE_TARGET = 1.2  # a recompute round of N tokens against a cached round of N tokens (issue 39)
DG_MEASURED = "h200-diffusiongemma-26b-a4b-measured"  # DiffusionGemma-26B-A4B's shape, random weights
DG_MODELLED = "h200-diffusiongemma-26b-a4b-modelled"  # the profile it replaces (engine/profile_model.py)


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


def _steps(out: Path) -> list[str]:
    path = out / "steps.txt"
    if not path.exists():
        return ["steps: no steps.txt (the run did not start)"]
    failed, skipped = [], []
    for line in path.read_text().splitlines():
        if m := re.match(r"(\S+) rc=(\d+) ", line + " "):
            if m[2] != "0":
                failed.append(f"{m[1]} (rc {m[2]}{', stopped at its limit' if m[2] == '124' else ''})")
        elif m := re.match(r"(\S+) skipped: (.*)", line):
            skipped.append(f"{m[1]} ({m[2]})")
    lines = ["steps: " + (f"failed or stopped: {', '.join(failed)}" if failed else "every step that ran exited 0")]
    if skipped:
        lines.append("  skipped: " + ", ".join(skipped))
    return lines


def _fixtures(out: Path) -> list[str]:
    f = _json(out / "fixtures.json")
    if f is None:
        return ["fixtures: no result"]
    fams = f["families"]
    ok = [a for a, r in fams.items() if r["ok"]]
    lines = [f"fixtures on {f['device']}: {len(ok)} of {len(fams)} families decode ("
             + ", ".join(f"{a} {'ok' if r['ok'] else 'FAILED'}" for a, r in fams.items()) + ")"]
    for arch, r in fams.items():
        inst, gen = r["instance"], r["generate"]
        part = (f"instance error: {inst['error']}" if "error" in inst else
                f"batched round of {inst['largest_batch']}, {inst['rounds']} rounds, "
                f"{inst['same_as_alone']}/{len(inst['answer_tokens'])} answers as decoded alone")
        gen_part = "generate ok" if gen["rc"] == 0 else f"generate rc={gen['rc']}: {gen.get('error', '')[-160:]}"
        lines.append(f"  {arch}: {gen_part}; {part}")
    return lines


def _gpu_tests(out: Path) -> list[str]:
    log = out / "gpu-tests.log"
    if not log.exists():
        return ["gpu tests: not run (no CUDA, or the run stopped before them)"]
    counts = dict((k, int(n)) for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped)", log.read_text()))
    passed, failed = counts.get("passed", 0), counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)
    names = re.findall(r"^FAILED (\S+)", log.read_text(), re.M)
    return [f"gpu tests: {passed} of {passed + failed} pass" + (f"; failed: {', '.join(names)}" if names else "")]


def _round_ms(res: dict) -> tuple[str, float]:
    """The round as the engine runs it: with CUDA graphs where that variant ran, else the plain round."""
    v = _variants(res)
    name = GRAPHS if GRAPHS in v else "round"
    return name, v[name]["median_ms"]


def _rounds(out: Path) -> list[str]:
    lines = []
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
    for name, label, target in (("round-single", "one request", SINGLE_TARGET_MS),
                                ("round-moe", "LLaDA2-mini", MOE_TARGET_MS)):
        if (r := _json(out / f"{name}.json")) is not None:
            variant, ms = _round_ms(r)
            lines.append(f"{name} ({label}, {r['slots']}x{r['tokens']}): {variant} {ms:.2f} ms "
                         f"(target <= {target:g} ms: {_mark(ms <= target)})")
            lines.append("  " + ", ".join(f"{k} {x['median_ms']:.2f} ms" for k, x in _variants(r).items())
                         + (f"; {GRAPHS}: skipped: no CUDA" if r["device"] == "cpu" else ""))
        else:
            lines.append(f"{name}: no result")
    if (r := _json(out / "round-gaps.json")) is not None:
        parts = ", ".join(f"{k} {x['median_ms']:.2f} ms" for k, x in _variants(r).items())
        lines.append(f"round-gaps (4 held slots, in place: {r['in_place']}): {parts}")
    else:
        lines.append("round-gaps: no result")
    return lines


def _recompute(out: Path) -> list[str]:
    """Per attention kernel order and size: the recompute round against the cached round of as many tokens (steady
    rounds), the ratio against the target, the first round of each shape (cuDNN builds its plan then), and the
    recompute with its slots apart (written into them in place, and through its own buffer as before) and with
    canvases of different lengths (packed, and padded as before)."""
    if (r := _json(out / "recompute.json")) is None:
        return ["recompute: no result"]
    lines = [f"recompute vs cached ({r['model'].split(':')[0]} on {r['device']}, {r['dtype']}, {r['canvas']}-token "
             f"canvases; target: recompute <= {RECOMPUTE_TARGET:g}x cached of as many tokens)"]
    for order in dict.fromkeys(row["order"] for row in r["rows"]):
        rows = [row for row in r["rows"] if row["order"] == order]
        met = sum(row["recompute"]["ratio"] <= RECOMPUTE_TARGET for row in rows)
        lines.append(f"  attention {order} first: {met} of {len(rows)} sizes within {RECOMPUTE_TARGET:g}x")
        for row in rows:
            re_, ca, apart = row["recompute"], row["cached"], row["recompute, slots apart"]
            copied = row.get("recompute, slots apart, copied")
            ratio = re_["ratio"]
            lines.append(f"    {row['tokens']:>5} tokens: recompute {re_['median_ms']:.2f} ms, cached "
                         f"{ca['median_ms']:.2f} ms, ratio {ratio:.2f} ({_mark(ratio <= RECOMPUTE_TARGET)}); "
                         f"first round of the shape {re_['first_ms']:.1f} / {ca['first_ms']:.1f} ms; "
                         f"slots apart {apart['median_ms']:.2f} ms in place"
                         + (f", {copied['median_ms']:.2f} ms copied" if copied else "")
                         + (f"; lengths varied {varied['median_ms']:.2f} ms packed, {padded['median_ms']:.2f} ms "
                            f"padded" if (varied := row.get("recompute, lengths varied")) and
                            (padded := row.get("recompute, lengths varied, padded")) else ""))
    return lines


def _kernels(out: Path) -> list[str]:
    lines = []
    for name in ("kernels-8b", "kernels-moe"):
        if (k := _json(out / f"{name}.json")) is None:
            lines.append(f"{name}: no result")
            continue
        cats = ", ".join(f"{c} {ms:.2f}" for c, ms in k["by_category_ms"].items())
        lines.append(f"{name} ({k['model'].split(':')[0]}, {k['slots']}x{k['tokens']} over {k['context']}): "
                     f"{k['device_ms_per_round']:.2f} ms a round on the device: {cats}")
    return lines


def _engine(out: Path) -> list[str]:
    if (b := _json(out / "bench-engine.log")) is None:
        return ["bench engine: no result"]
    t, lat = b["batched_vs_best_loop_throughput"], b["single_vs_fastdllm_latency"]
    lines = [f"bench engine: batched / best loop {t:.2f}x (target >= {THROUGHPUT_TARGET:g}x: "
             f"{_mark(t >= THROUGHPUT_TARGET)}); single-request latency / Fast-dLLM loop {lat:.2f} "
             f"(target <= {LATENCY_TARGET:g}: {_mark(lat <= LATENCY_TARGET)})"]
    for name, c in b["contenders"].items():
        lines.append(f"  {name}: {c['tokens_per_s']:.1f} tok/s, mean latency {c['mean_latency_s']:.3f} s, "
                     f"MFU {c['mfu']:.1%}")
    if g := b.get("cuda_graphs"):
        lines.append(f"  engine CUDA graphs: {g['captures']} captured, {g['replays']} replays"
                     + (f", capture failed: {g['failed']}" if g.get("failed") else ""))
    return lines


def _check(out: Path) -> list[str]:
    if (c := _json(out / "profile-check.log")) is None:
        return ["profile check: no result"]
    err = c["total_error"]
    lines = [f"profile check: {c['rounds']} rounds, error {err:.1%} over the whole run (target <= "
             f"{PROFILE_TARGET:.0%}: {_mark(err <= PROFILE_TARGET)}), per round median {c['median_round_error']:.1%}; "
             f"{c.get('warming_rounds', 0)} of its rounds met a shape first or captured a graph"]
    if w := c.get("warmup"):
        lines.append(f"  warm-up pass (the same run once before, kept out by design): {w['rounds']} rounds, "
                     f"measured {w['measured_s']} s against {w['predicted_s']} s predicted (error "
                     f"{w['total_error']:.1%}), {w['warming_rounds']} warming rounds")
    elif (s := c.get("steady")) and c.get("warming_rounds"):  # a run without the warm-up pass
        lines.append(f"  without the {c['warming_rounds']} warming rounds: error {s['total_error']:.1%} "
                     f"({_mark(s['total_error'] <= PROFILE_TARGET)}), per round median {s['median_round_error']:.1%}")
    return lines


def _profiles(out: Path) -> list[str]:
    lines = []
    for name in ("h200-llada8b-measured", "h200-llada2mini-measured"):
        p = _json(out / f"{name}.json")
        if p is None:
            lines.append(f"{name}.json: missing")
            continue
        meta = p.get("meta", {})
        skipped = meta.get("skipped", [])
        line = (f"{name}.json: written (" + ", ".join(f"{k} {len(v)} points" for k, v in p.get("curves", {}).items())
                + "); copy it into profiles/ with its provenance (docs/engine.md)")
        if skipped:
            line += f"; skipped: {'; '.join(skipped)}"
        lines.append(line)
        if name == "h200-llada8b-measured":
            batch, prompt = FITS
            asked = batch in meta.get("batch_sizes", []) and prompt in meta.get("prompt_lens", [])
            oom = any(s.startswith(f"batch {batch} x prompt {prompt}:") for s in skipped)
            lines.append(f"  the {batch} x {prompt} prefill case: " + ("not in this profile's grid" if not asked else
                         f"{'out of memory' if oom else 'fits'} (target: fits: {_mark(not oom)})"))
    return lines


def _diffusion_gemma(out: Path) -> list[str]:
    """DiffusionGemma-26B-A4B's shape measured (random weights): its points, what did not fit, its model's fit,
    the modelled profile's round time against each measured round, and the check of the measured profile."""
    path = out / f"{DG_MEASURED}.json"
    if (p := _json(path)) is None:
        return [f"{DG_MEASURED}.json: missing"]
    meta, shape = p.get("meta", {}), p.get("meta", {}).get("shape", {})
    layers = len(shape.get("layer_types", []))
    lines = [f"{DG_MEASURED}.json: written (" + ", ".join(f"{k} {len(v)} points" for k, v in p["curves"].items())
             + f"; {meta.get('preset', '?')} on {meta.get('device')}, {layers} layers, {shape.get('num_experts')} "
             f"experts, hidden {shape.get('hidden_size')}; weights {str(meta.get('weights', '?')).split(' (')[0]})"
             + (f"; skipped: {'; '.join(meta['skipped'])}" if meta.get("skipped") else "")]
    try:  # the profiles' own model (numpy/scipy: what the profile step itself needs)
        from engine.latency_profile import load_profile

        measured = load_profile(str(path))
        fit = measured.fit_report()
        lines.append(f"  its round-time model: largest error {fit['max_error']:.1%} over {len(fit['points'])} rounds")
        modelled = load_profile(DG_MODELLED)
        rows = [(q, modelled.forward_ms(q.kind, q.steps, q.query, q.context) / q.ms) for q in measured.points]
        if rows and layers == 30:  # the full shape: the modelled profile prices the same architecture
            ratios = sorted(r for _, r in rows)
            lines.append(f"  {DG_MODELLED} / measured per round: median {ratios[len(ratios) // 2]:.2f}x, "
                         f"{ratios[0]:.2f}x to {ratios[-1]:.2f}x over {len(rows)} rounds")
            lines += [f"    {q.kind} {q.steps:g} x {q.query:g} over {q.context:g}: measured {q.ms:.1f} ms, modelled "
                      f"{q.ms * r:.1f} ms ({r:.2f}x)" for q, r in rows]
        elif rows:
            lines.append(f"  not against {DG_MODELLED}: a shrunk shape ({layers} layers)")
    except Exception as exc:  # noqa: BLE001 - a summary line, not a failure
        lines.append(f"  its model: not computed ({type(exc).__name__}: {exc})")
    if (c := _json(out / "profile-dg-check.log")) is not None:
        err = c["total_error"]
        lines.append(f"  profile check: {c['rounds']} rounds, error {err:.1%} over the whole run (target <= "
                     f"{PROFILE_TARGET:.0%}: {_mark(err <= PROFILE_TARGET)}), per round median "
                     f"{c['median_round_error']:.1%}")
    else:
        lines.append("  profile check: no result")
    return lines


def summarize(out: str | Path) -> list[str]:
    out = Path(out)
    return (_steps(out) + _fixtures(out) + _gpu_tests(out) + _rounds(out) + _recompute(out) + _kernels(out)
            + _engine(out) + _check(out) + _profiles(out) + _diffusion_gemma(out))


if __name__ == "__main__":
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        sys.exit("usage: python scripts/h200_summary.py DIR (the folder scripts/h200_check.sh packs)")
    print("\n".join(summarize(sys.argv[1])))
