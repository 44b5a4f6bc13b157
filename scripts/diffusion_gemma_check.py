"""DiffusionGemma on a device: `python scripts/diffusion_gemma_check.py OUT_DIR [--device cuda]`.

Builds the tiny DiffusionGemma fixture of tests/checkpoints.py (made by transformers itself) under OUT_DIR/ckpt,
then on DEVICE, in float32 and bf16:

* parity with transformers' ``DiffusionGemmaForBlockDiffusion`` on the same device and dtype: the encoder's
  K/V of a prompt longer than the sliding window, a decoder step without and with self-conditioning (max
  absolute logit difference);
* ``CanvasEngine``: three prompts of different lengths generated together (encoder passes and canvases of
  different requests batched) and each alone, with the same seeds (the same tokens expected in float32;
  bf16 batches may round differently: reported, not failed);
* ``remask generate --model DIR --device DEVICE`` in its own process.

Writes OUT_DIR/diffusion_gemma.json and prints one line per check; exits 1 when a check fails (parity above
1e-4 in float32 or 0.1 in bf16, a generate that fails, float32 texts that differ batched and alone).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = ("Hi", "Write one short sentence about the sea.",
           "Count from one to twenty in words, separated by commas, and then say what comes next.")
LIMITS = {"float32": 1e-4, "bfloat16": 0.1}


def _parity(directory: Path, device: str, dtype_name: str) -> dict:
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.cache_utils import DynamicCache

    from engine.models import diffusion_gemma as dg

    dtype = getattr(torch, dtype_name)
    hf = DiffusionGemmaForBlockDiffusion.from_pretrained(str(directory), dtype=dtype).to(device).eval()
    ours = dg.load(directory, dtype=dtype, device=device)
    g = torch.Generator().manual_seed(0)
    vocab = ours.config.vocab_size
    prompt = torch.randint(0, vocab, (2, 3 * ours.config.sliding_window), generator=g).to(device)
    canvas = torch.randint(0, vocab, (2, ours.config.canvas_length), generator=g).to(device)
    sc = (torch.randn(2, ours.config.canvas_length, vocab, generator=g) * 3).to(device)
    with torch.no_grad():
        theirs, mine = DynamicCache(config=hf.config.get_text_config(decoder=True)), dg.DGCache(ours.config)
        hf.model.encoder(input_ids=prompt, cache=theirs)
        ours.encode(prompt, mine)
        kv = max(float((mine.layers[i][0].float() - theirs.layers[i].keys.float()).abs().max())
                 for i in range(ours.config.num_layers))
        first = float((ours.decode(canvas, mine) - hf(decoder_input_ids=canvas, cache=theirs).logits).abs().max())
        cond = float((ours.decode(canvas, mine, sc.to(dtype))
                      - hf(decoder_input_ids=canvas, cache=theirs, self_conditioning_logits=sc.to(dtype)).logits
                      ).abs().max())
    worst = max(kv, first, cond)
    return {"kv": kv, "decode": first, "decode_sc": cond, "ok": worst <= LIMITS[dtype_name]}


def _canvas_engine(directory: Path, device: str, dtype_name: str) -> dict:
    import torch

    from engine.canvas import CanvasEngine, CanvasParams

    engine = CanvasEngine.from_pretrained(directory, device=device, dtype=getattr(torch, dtype_name))
    tok = engine.tokenizer
    ids = [tok.chat_ids([{"role": "user", "content": p}]) for p in PROMPTS]
    t0 = time.perf_counter()
    together = [o.token_ids for o in engine.generate(ids, CanvasParams(max_tokens=24, seed=3))]
    seconds = time.perf_counter() - t0
    alone = [engine.generate([p], CanvasParams(max_tokens=24, seed=3))[0].token_ids for p in ids]
    same = together == alone
    return {"s": round(seconds, 3), "same_batched_and_alone": same,
            "ok": same or dtype_name == "bfloat16"}


def _generate(directory: Path, device: str) -> dict:
    argv = [sys.executable, "-m", "tools.cli", "generate", "--model", str(directory), "--device", device,
            "--prompt", PROMPTS[1], "--max-tokens", "16", "--seed", "1"]
    t0 = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    res = {"rc": done.returncode, "s": round(time.perf_counter() - t0, 2), "ok": done.returncode == 0}
    res["answer" if done.returncode == 0 else "error"] = (done.stdout if done.returncode == 0 else done.stderr
                                                          ).strip()[-300:]
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    from tests.checkpoints import build_diffusion_gemma

    directory = build_diffusion_gemma(args.out / "ckpt")
    results: dict = {"device": args.device}
    for dtype in ("float32", "bfloat16"):
        for name, fn in (("parity", _parity), ("canvas_engine", _canvas_engine)):
            try:
                results[f"{name}_{dtype}"] = fn(directory, args.device, dtype)
            except Exception as exc:  # noqa: BLE001 - reported per check
                results[f"{name}_{dtype}"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    results["generate"] = _generate(directory, args.device)
    (args.out / "diffusion_gemma.json").write_text(json.dumps(results, indent=2) + "\n")
    for key, value in results.items():
        if isinstance(value, dict):
            print(f"{key:24s} {'ok  ' if value['ok'] else 'FAIL'} "
                  + json.dumps({k: v for k, v in value.items() if k != 'ok'})[:200])
    return 0 if all(v["ok"] for v in results.values() if isinstance(v, dict)) else 1


if __name__ == "__main__":
    sys.exit(main())
