"""The four checkpoint fixtures on a device: `python scripts/fixtures_check.py OUT_DIR [--device cuda]`.

A step of scripts/h200_check.sh. Builds the tiny real-format checkpoints of tests/checkpoints.py (LLaDA,
Dream, SDAR, LLaDA2: the families' own config keys, tensor names and tokenizers) under OUT_DIR/ckpt, then
for each family

* decodes one prompt with ``remask generate --model DIR --device DEVICE`` (its own process, as a user
  runs it), and
* runs one instance (the scheduler and the engine's batched rounds, engine/instance.py) over three
  prompts of different lengths, which the first round batches, and compares each answer with the same
  prompt decoded alone on that engine.

Writes OUT_DIR/fixtures.json (one record per family) and prints one line per family. Exits 1 when a
family fails to decode either way or its round was not batched; answers that differ from the
one-at-a-time ones are reported (bf16 batches may round differently), not failed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = ("Hi", "Write one short sentence about the sea.",
           "Count from one to twenty in words, separated by commas, and then say what comes next.")
MAX_TOKENS = 32


def _generate(directory: Path, device: str, timeout: float) -> dict:
    """``remask generate`` in its own process: exit status, wall time, the answer or the error's last lines."""
    argv = [sys.executable, "-m", "tools.cli", "generate", "--model", str(directory), "--device", device,
            "--prompt", PROMPTS[1], "--max-tokens", str(MAX_TOKENS)]
    t0 = time.perf_counter()
    try:
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"rc": 124, "s": round(time.perf_counter() - t0, 2), "error": f"timed out after {timeout:g} s"}
    res = {"rc": done.returncode, "s": round(time.perf_counter() - t0, 2)}
    if done.returncode == 0:
        res["answer"] = done.stdout.strip()[-200:]
    else:
        res["error"] = "\n".join(done.stderr.strip().splitlines()[-4:])
    return res


def _instance_round(directory: Path, device: str) -> dict:
    """Three prompts of different lengths through one instance: batched rounds, each answer compared with
    the prompt decoded alone on the same engine."""
    import torch

    from engine.instance import Instance
    from engine.loading import load_engine
    from engine.sequence import SamplingParams

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    engine = load_engine(str(directory), device=device, dtype=dtype, max_slots=4)
    tok, block = engine.tokenizer, engine.cfg.block_size
    ids = [tok.chat_ids([{"role": "user", "content": p}], block) for p in PROMPTS]
    params = SamplingParams(max_tokens=MAX_TOKENS, threshold=0.9)
    inst = Instance(engine, slots=4)
    for i, prompt in enumerate(ids):
        inst.add_request(f"r{i}", prompt, params)
    batches, rounds = [], 0
    while inst.has_work() and rounds < 20 * MAX_TOKENS:
        plan, _, _ = inst.step()
        batches.append(len(plan.slots))
        rounds += 1
    if inst.has_work():
        raise RuntimeError(f"unfinished after {rounds} rounds")
    alone = []
    for prompt in ids:  # the same engine, one request at a time
        seq = engine.add_request(prompt, params)
        while not seq.finished:
            engine.step([seq])
        alone.append(engine.output(seq).token_ids)
        engine.sequences.pop(seq.seq_id, None)
    batched = [inst.outputs[f"r{i}"].token_ids for i in range(len(ids))]
    graphs = engine.runner.graphs
    return {"prompt_tokens": [len(p) for p in ids], "rounds": rounds, "largest_batch": max(batches),
            "answer_tokens": [len(t) for t in batched], "same_as_alone": sum(a == b for a, b in zip(batched, alone)),
            "dtype": str(dtype).removeprefix("torch."),
            "cuda_graphs": None if graphs is None else {"captures": graphs.captures}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--archs", default="llada,dream,sdar,llada2")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds for each `remask generate`")
    args = ap.parse_args(argv)
    from tests.checkpoints import ARCHS, build_checkpoint

    archs = args.archs.split(",")
    if unknown := sorted(set(archs) - set(ARCHS)):
        ap.error(f"unknown families {unknown}; known: {', '.join(ARCHS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    records, ok = {}, True
    for arch in archs:
        directory = build_checkpoint(arch, args.out / "ckpt" / arch)
        rec = {"generate": _generate(directory, args.device, args.timeout)}
        try:
            rec["instance"] = _instance_round(directory, args.device)
        except Exception as exc:  # a family that fails is recorded; the others still run
            rec["instance"] = {"error": f"{type(exc).__name__}: {exc}",
                               "where": "".join(traceback.format_exc().splitlines(True)[-6:])}
        inst, gen = rec["instance"], rec["generate"]
        rec["ok"] = gen["rc"] == 0 and "error" not in inst and inst["largest_batch"] >= 2
        ok &= rec["ok"]
        records[arch] = rec
        line = f"{arch}: generate rc={gen['rc']} ({gen['s']} s)"
        line += (f"; instance {inst['rounds']} rounds, largest batch {inst['largest_batch']}, "
                 f"{inst['same_as_alone']}/{len(PROMPTS)} answers as decoded alone" if "error" not in inst
                 else f"; instance failed: {inst['error']}")
        if gen["rc"]:
            line += f"; generate failed: {gen.get('error', '').splitlines()[-1:]}"
        print(("ok   " if rec["ok"] else "FAIL ") + line, flush=True)
    (args.out / "fixtures.json").write_text(json.dumps({"device": args.device, "families": records}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
