"""Where a round's device time goes, by kernel category: `python -m tools.kernel_profile --model M`.

The round is `remask bench round`'s (tools/bench_round.py): ``slots`` requests decoding a block of
``tokens`` over ``context`` tokens held in the KV pool, run through the runner as the engine calls it
(fused projections, attention to the pool in place; no CUDA graphs, so every kernel is seen). Under
torch.profiler, each kernel's own device time (on a CPU: each aten operator's own CPU time) is filed
under one category, tested in this order:

* attention: the fused attention kernels (cuDNN's and FlashAttention's flash kernels, memory-efficient
  attention, ``scaled_dot_product_attention``'s CPU kernels). Tested first: cuDNN's flash kernel is named
  ``cudnn_generated_fort_native_sdpa_sm90_flash_...``, and a matmul pattern such as ``sm90`` would claim it;
* matmul: the matrix products (cuBLAS/cuBLASLt ``nvjet``/``gemm``/``xmma`` kernels, CUTLASS grouped
  products of the experts, split-K reductions, ``aten::mm``/``addmm``/``bmm``/``_grouped_mm`` on a CPU);
* copy/index: copies, concatenation, gathers and scatters, indexing, memcpy and memset;
* elementwise/other: everything else (norms, rotary embedding, activations, residual adds, softmax,
  sampling).

Prints (or writes, ``--out``) the device ms per round in each category and the heaviest kernels.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict

import torch

CATEGORIES = ("matmul", "attention", "elementwise/other", "copy/index")
_ATTENTION = ("fmha", "flash", "sdpa", "attention", "scaled_dot_product", "attn")
_MATMUL = ("gemm", "nvjet", "cutlass", "xmma", "wgmma", "cublas", "splitkreduce", "matmul", "aten::mm",
           "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm", "grouped_mm", "aten::linear")
_COPY = ("copy", "cat", "index", "scatter", "gather", "memcpy", "memset", "aten::to", "aten::_to_copy",
         "aten::clone", "aten::contiguous", "aten::fill_", "aten::zero_", "take_along", "masked_select",
         "nonzero", "aten::stack", "aten::where")


def categorize(name: str) -> str:
    """The category of a kernel (or, on a CPU, an aten operator) by its name: attention first."""
    low = name.lower()
    for category, keys in (("attention", _ATTENTION), ("matmul", _MATMUL), ("copy/index", _COPY)):
        if any(k in low for k in keys):
            return category
    return "elementwise/other"


def _self_device_us(evt) -> float:
    for attr in ("self_device_time_total", "self_cuda_time_total"):  # the name changed in torch 2.4
        if hasattr(evt, attr):
            return float(getattr(evt, attr))
    return 0.0


def breakdown(events, rounds: int, cuda: bool, top: int = 12) -> dict:
    """Device ms per round by category, from ``torch.profiler``'s ``key_averages()``. On CUDA the kernels'
    own device time; on a CPU the aten operators' own CPU time (what runs there)."""
    from torch.autograd import DeviceType

    by_cat: dict[str, float] = defaultdict(float)
    kernels = []
    events = list(events)
    # the kernels are the CUDA-typed entries; a torch that files them otherwise: any entry with device time
    by_type = cuda and any(getattr(e, "device_type", None) == DeviceType.CUDA for e in events)
    for evt in events:
        if cuda:
            if by_type and evt.device_type != DeviceType.CUDA:
                continue
            us = _self_device_us(evt)
        else:
            if not evt.key.startswith("aten::"):
                continue
            us = float(evt.self_cpu_time_total)
        if us <= 0:
            continue
        ms = us / 1000 / rounds
        by_cat[categorize(evt.key)] += ms
        kernels.append((evt.key[:90], round(ms, 3), evt.count // rounds, categorize(evt.key)))
    total = sum(by_cat.values())
    kernels.sort(key=lambda k: -k[1])
    return {"device_ms_per_round": round(total, 3),
            "by_category_ms": {c: round(by_cat.get(c, 0.0), 3) for c in CATEGORIES},
            "share": {c: round(by_cat.get(c, 0.0) / total, 4) if total else 0.0 for c in CATEGORIES},
            "top": [list(k) for k in kernels[:top]]}


def profile_round(model: str = "llada-8b-shape", device: str = "cpu", dtype: str | None = None, slots: int = 128,
                  tokens: int = 32, context: int = 300, rounds: int = 5, warmup: int = 2) -> dict:
    """``rounds`` rounds of ``bench round``'s shape under torch.profiler, after ``warmup`` unprofiled ones."""
    from torch.profiler import ProfilerActivity, profile

    from engine.device import device_name, parse_dtype, sync
    from engine.kv_cache import KVPool
    from engine.models.presets import build_preset, preset_config
    from engine.runner import TorchRunner
    from tools.bench_round import round_inputs

    if min(slots, tokens, rounds) <= 0 or context < 0 or warmup < 0:
        raise ValueError("slots, tokens and rounds must be positive, context and warmup non-negative")
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine")
    dt = parse_dtype(dtype or ("bfloat16" if cuda else "float32"))
    cfg = preset_config(model)
    if context + tokens > cfg.max_position_embeddings:
        raise ValueError(f"context + tokens ({context + tokens}) exceeds the model's {cfg.max_position_embeddings}")
    net = build_preset(model, device=dev, dtype=dt)
    pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, slots, context + tokens, dt, dev)
    inputs = round_inputs(cfg, slots, tokens, context, dev, dt, pool=pool)
    rows = [torch.arange(tokens)] * slots
    runner = TorchRunner(net, dev, fuse=True)
    runner.pool = pool
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.inference_mode():
        for _ in range(warmup):
            runner.run(inputs, rows)
        sync(dev)
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            for _ in range(rounds):
                runner.run(inputs, rows)
            sync(dev)
            wall = (time.perf_counter() - t0) * 1000 / rounds
    res = breakdown(prof.key_averages(), rounds, cuda)
    return {"model": model, "device": device_name(dev), "dtype": str(dt).removeprefix("torch."), "slots": slots,
            "tokens": tokens, "context": context, "rounds": rounds, "wall_ms_per_round": round(wall, 3),
            "time": "kernels' own device time" if cuda else "aten operators' own CPU time", **res}


def format_breakdown(res: dict) -> str:
    lines = [f"{res['model']} on {res['device']} ({res['dtype']}), {res['slots']} x {res['tokens']} over "
             f"{res['context']}: {res['device_ms_per_round']:.2f} ms a round ({res['time']}; wall "
             f"{res['wall_ms_per_round']:.2f} ms under the profiler)"]
    lines += [f"  {c:<18} {res['by_category_ms'][c]:>9.2f} ms  {res['share'][c]:>6.1%}" for c in CATEGORIES]
    lines += [f"    {ms:>8.3f} ms x{calls:<4} {cat:<18} {name}" for name, ms, calls, cat in res["top"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="a round's device time by kernel category (torch.profiler)")
    ap.add_argument("--model", default="llada-8b-shape", help="a shape preset, with :overrides")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", help="default bfloat16 on CUDA, float32 on a CPU")
    ap.add_argument("--slots", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", help="also write the JSON result here")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        res = profile_round(args.model, args.device, args.dtype, args.slots, args.tokens, args.context, args.rounds,
                            args.warmup)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps(res) if args.json else format_breakdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
