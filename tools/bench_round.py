"""Time one engine round of a given shape on a shape preset: `remask bench round`.

The round is what the instance runs at steady state: ``slots`` requests, each decoding a block of
``tokens`` query tokens over ``context`` cached tokens held in consecutive slots of the KV pool,
through the runner exactly as the engine calls it (one forward attending to the pool in place, fresh
K/V scattered into it, every row's (confidence, token) copied back once). Counted FLOPs over the
median time, against the measured matmul peak, is the round's model FLOP utilisation. Variants time
the same round with each context copied into a buffer of the round's own (the path of requests
without consecutive pool slots), with the projections unfused (for a mixture of experts, a loop over
the experts), with a mixture's stacked experts in a padded grid instead of grouped products, with
grouped-query heads folded into query rows or not (whichever the device does not do by default), the
forward alone (no LM head, row gather or copy back; its FLOPs counted without the head) and, on CUDA,
that forward captured once in a CUDA graph and replayed, and the round as the engine runs it with
CUDA graphs on (engine/graphs.py), to show where time goes and whether graphs pay at this shape.
"""

from __future__ import annotations

import statistics
import time

import torch

from engine.device import device_name, parse_dtype
from engine.device import sync as _sync
from engine.graphs import ForwardGraphs, capture_forward
from engine.kv_cache import KVPool
from engine.models.flops import forward_flops
from engine.models.presets import build_preset, preset_config
from engine.models.transformer import SparseMoE
from engine.runner import TorchRunner
from engine.scheduler.types import StepKind
from engine.sequence import StepInput
from tools.bench_engine import measure_peak


def round_inputs(cfg, slots: int, tokens: int, context: int, device, dtype, seed: int = 0,
                 pool: KVPool | None = None, gaps: int = 0) -> list[StepInput]:
    """``slots`` block steps of ``tokens`` queries over ``context`` cached positions (random K/V). With
    ``pool``, each step's context is in a slot of its own (as the engine's caches hold it), ``gaps``
    slots spread among theirs being held by requests not in the round; otherwise one tensor is shared by
    the steps (the runner copies each step's context into the round's buffer anyway)."""
    gen = torch.Generator().manual_seed(seed)
    ctx = torch.randn(cfg.num_layers, 2, cfg.num_kv_heads, context, cfg.head_dim, generator=gen).to(device, dtype)
    pos = torch.arange(context, context + tokens)
    skip = {(k + 1) * (slots + gaps) // (gaps + 1) for k in range(gaps)}
    steps = []
    for slot in (i for i in range(slots + gaps) if i not in skip):
        kv = ctx
        if pool is not None:
            kv = pool.kv[:, :, slot, :, :context]
            kv.copy_(ctx)
        steps.append(StepInput(StepKind.DENOISE, torch.randint(0, cfg.mask_token_id, (tokens,), generator=gen), pos,
                               kv if context else None, torch.arange(context) if context else None, cfg.attention,
                               None if pool is None else slot))
    return steps


def graphed_forward(runner: TorchRunner, inputs: list[StepInput]):
    """The runner's forward over ``inputs`` captured once in a CUDA graph: (replay, the hidden rows each
    replay writes). The batch's device tensors are the graph's static inputs."""
    return capture_forward(runner.forward, runner.prepare(inputs))


def _time(fn, device, warmup: int, repeats: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append((time.perf_counter() - t0) * 1000)
    return out


def bench_round(model: str = "llada-8b-shape", device: str = "cpu", dtype: str | torch.dtype | None = None,
                slots: int = 128, tokens: int = 32, context: int = 300, warmup: int = 3, repeats: int = 10,
                variants: bool = True, peak: float | None = None, gaps: int = 0) -> dict:
    """``gaps``: pool slots among the round's held by requests not in it (paused, or in another forward);
    the round then computes them as filler rows where that costs less than copying every context
    (``TorchRunner.fill_pays``), and ``in_place`` says whether it did."""
    dev = torch.device(device)
    dt = parse_dtype(dtype or ("bfloat16" if dev.type == "cuda" else "float32"))
    cfg = preset_config(model)
    if min(slots, tokens) <= 0 or min(context, gaps) < 0:
        raise ValueError("slots and tokens must be positive, context and gaps non-negative")
    if context + tokens > cfg.max_position_embeddings:
        raise ValueError(f"context + tokens ({context + tokens}) exceeds the model's {cfg.max_position_embeddings}")
    net = build_preset(model, device=dev, dtype=dt)
    pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, slots + gaps, context + tokens, dt, dev)
    inputs = round_inputs(cfg, slots, tokens, context, dev, dt, pool=pool, gaps=gaps)
    rows = [torch.arange(tokens)] * slots
    flops = forward_flops(cfg, slots, tokens, context)
    peak = peak or measure_peak(dev, dt)
    runs: dict[str, list[float]] = {}
    fused = TorchRunner(net, dev, fuse=True)
    fused.pool = pool
    notes: dict[str, str] = {}
    with torch.inference_mode():
        runs["round"] = _time(lambda: fused.run(inputs, rows), dev, warmup, repeats)
        in_place = fused.pooled > 0
        if not in_place and not gaps:
            raise RuntimeError("the round did not attend to the KV pool in place")
        if variants:
            fused.pool = None  # the same steps, their contexts copied into the round's buffer
            runs["round, contexts copied"] = _time(lambda: fused.run(inputs, rows), dev, warmup, repeats)
            fused.pool = pool
            moes = [m for m in net.modules() if isinstance(m, SparseMoE) and m.kernel == "grouped"]
            if moes:  # a mixture of experts: the stacked experts in a padded grid instead of grouped products
                for m in moes:
                    m.grouped = False
                runs["round, experts in a grid"] = _time(lambda: fused.run(inputs, rows), dev, warmup, repeats)
                for m in moes:
                    m.grouped = True
            del moes  # no reference left to the fused model once it is dropped below
            if cfg.num_heads != cfg.num_kv_heads:  # grouped-query attention: the other side of DLMTransformer.fold_gqa
                folded = net.folds_gqa(dev)  # the device's default
                net.fold_gqa = not folded
                runs["round, GQA " + ("unfolded" if folded else "folded")] = _time(
                    lambda: fused.run(inputs, rows), dev, warmup, repeats)
                net.fold_gqa = None
            runs["forward only"] = _time(lambda: fused.launch(inputs), dev, warmup, repeats)
            if dev.type == "cuda":  # whether CUDA graphs pay at this shape: the same forward, replayed
                try:
                    runs["forward, CUDA graph"] = _time(graphed_forward(fused, inputs)[0], dev, warmup, repeats)
                    if in_place:  # the round as the engine runs it with graphs on (engine/graphs.py)
                        fused.graphs = ForwardGraphs(fused.forward, dev, max_tokens=slots * tokens)
                        runs["round, CUDA graphs"] = _time(lambda: fused.run(inputs, rows), dev, max(warmup, 2),
                                                           repeats)
                        fused.graphs = None
                except Exception as exc:  # a measurement variant: report it, keep the others
                    notes["CUDA graphs"] = f"{type(exc).__name__}: {exc}"
            del fused
            plain = TorchRunner(build_preset(model, device=dev, dtype=dt), dev, fuse=False)
            plain.pool = pool
            del net
            runs["round, unfused"] = _time(lambda: plain.run(inputs, rows), dev, warmup, repeats)
    rows_out = []
    for name, times in runs.items():
        ms = statistics.median(times)
        f = forward_flops(cfg, slots, tokens, context, lm_rows=0) if name.startswith("forward") else flops
        rows_out.append({"variant": name, "median_ms": round(ms, 3), "min_ms": round(min(times), 3),
                         "tflops": round(f / ms / 1e9, 2), "mfu": round(f / (ms / 1000) / peak, 4)})
    return {"model": model, "device": device_name(dev),
            "dtype": str(dt).removeprefix("torch."), "slots": slots, "tokens": tokens, "context": context,
            "gaps": gaps, "in_place": in_place,
            "tflop_per_round": round(flops / 1e12, 3), "peak_tflops": round(peak / 1e12, 2),
            "repeats": repeats, "variants": rows_out, "errors": notes}


def format_round(res: dict) -> str:
    head = (f"{res['model']} on {res['device']} ({res['dtype']}): {res['slots']} slots x {res['tokens']} tokens over "
            f"{res['context']} cached, {res['tflop_per_round']} TFLOP per round; measured peak "
            f"{res['peak_tflops']} TFLOP/s")
    if res.get("gaps"):
        head += (f"\n{res['gaps']} pool slots among the round's held by other requests: the round "
                 + ("computes them as filler rows" if res["in_place"] else "copies every context"))
    lines = [head, f"{'variant':<24} {'median ms':>10} {'min ms':>9} {'TFLOP/s':>9} {'MFU':>7}"]
    for r in res["variants"]:
        lines.append(f"{r['variant']:<24} {r['median_ms']:>10.2f} {r['min_ms']:>9.2f} {r['tflops']:>9.2f} "
                     f"{r['mfu']:>7.1%}")
    lines += [f"{name}: failed: {err}" for name, err in res.get("errors", {}).items()]
    return "\n".join(lines)
