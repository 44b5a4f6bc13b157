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

import math
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


# ---- a recompute round against a cached round of as many tokens ------------------------------------------------
RECOMPUTE_SIZES = (128, 256, 512, 1024, 2048)  # tokens per round: where the profiles' workloads live
RECOMPUTE_TARGET = 1.2  # a recompute of N tokens within this multiple of a cached round of N tokens (issue 39)
# the operators that copy K/V or activations, and which argument holds what they write (copy_: its destination,
# as large as its source; cat: its list of tensors)
COPY_OPS = {"aten::copy_": 0, "aten::index_put_": 2, "aten::scatter_": 3, "aten::index_copy_": 3, "aten::cat": 0}


VARIANTS = ("recompute", "recompute, slots apart", "recompute, slots apart, copied", "recompute, lengths varied",
            "recompute, lengths varied, padded", "cached")


def _varied(cfg, requests: int, canvas: int, device, dtype, pool: KVPool) -> list[StepInput]:
    """``requests`` recompute steps of canvases 3/4 and 5/4 of ``canvas`` in turn (the last of an odd number
    ``canvas``): as many tokens as ``requests`` x ``canvas``, in consecutive pool slots."""
    lens = [canvas * 3 // 4 if i % 2 == 0 else canvas * 5 // 4 for i in range(requests)]
    if requests % 2:
        lens[-1] = canvas
    gen = torch.Generator().manual_seed(1)
    return [StepInput(StepKind.RECOMPUTE, torch.randint(0, cfg.mask_token_id, (t,), generator=gen), torch.arange(t),
                      None, None, cfg.attention, slot) for slot, t in enumerate(lens)]


def _held_copy(fresh: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """What a cache does with a step's fresh K/V after the forward (``ApproxCache.refresh``): copy them into its
    slot unless the forward wrote them there already."""
    for dst, src in fresh:
        if dst.data_ptr() != src.data_ptr() or dst.stride() != src.stride():
            dst.copy_(src)


def _op_counts(fn, device: torch.device, itemsize: int) -> dict:
    """One call of ``fn`` under the profiler: aten operators run, copy-like operators and the bytes they write
    (at ``itemsize`` bytes an element), bytes allocated in all and at the peak, and the attention kernels chosen
    (scaled_dot_product_attention's backend operators, with whether a mask reached them)."""
    from torch.profiler import ProfilerActivity, profile

    from engine.memory import peak_bytes

    # the host's operators only: they name the attention backend chosen on CUDA too, and a device trace of a
    # few thousand kernels would cost the device script seconds per call
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=True) as prof:
        fn()
    ops = copies = copy_bytes = masked = 0
    attention: dict[str, int] = {}
    for e in prof.events():
        if e.name.startswith("aten::"):
            ops += 1
        if e.name in COPY_OPS and len(e.input_shapes) > COPY_OPS[e.name]:
            copies += 1
            shapes = e.input_shapes[COPY_OPS[e.name]]
            for shape in shapes if shapes and isinstance(shapes[0], list) else [shapes]:
                copy_bytes += math.prod(shape) * itemsize
        if e.name == "aten::scaled_dot_product_attention":
            masked += len(e.input_shapes) > 3 and bool(e.input_shapes[3])  # an attn_mask passed
        elif e.name.startswith("aten::_scaled_dot_product_"):  # the backend it chose
            name = e.name.removeprefix("aten::_scaled_dot_product_")
            attention[name] = attention.get(name, 0) + 1
    allocated = sum(max(e.nbytes(), 0) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    return {"ops": ops, "copies": copies, "copy_mb": round(copy_bytes / 1e6, 3),
            "allocated_mb": round(allocated / 1e6, 3), "peak_mb": round(peak_bytes(fn, device) / 1e6, 3),
            "attention": attention, "masked": masked}


def bench_recompute(model: str = "llada-8b-shape", device: str = "cpu", dtype: str | torch.dtype | None = None,
                    sizes: tuple[int, ...] = RECOMPUTE_SIZES, canvas: int = 128, warmup: int = 2, repeats: int = 5,
                    counts: bool = True, orders: tuple[str, ...] | None = None) -> dict:
    """A recompute round of N tokens (N / ``canvas`` requests, each its whole canvas: no context, fresh K/V
    written into its KV pool slot) against a cached round of N tokens (N / block requests, each its canvas's
    last block over the ``canvas`` - block positions before it, cached in its slot): each request's keys are
    ``canvas`` in both, so the two do the same products and attention pairs but for the LM head's rows (a
    block a request in both). Through the runner as the engine calls it, the cache's refresh after it included.
    Variants: the recompute with its requests' slots apart (every other slot held by a request not in the
    forward, as when cached steps of the same round run in another forward), written into them in place and,
    as before that path (``TorchRunner.in_slots`` off), through a K/V buffer of its own copied into the slots
    afterwards; the recompute of canvases of 3/4 and 5/4 of ``canvas`` in turn (as many tokens), packed into one
    row and, as before, padded to the longest under a mask; the attention kernel orders
    ``orders`` (DLMTransformer.attention_order; default: "flash" and, on CUDA, "cudnn"). Per size and variant:
    the median ms of ``repeats`` rounds after ``warmup``, the first round's ms (its shape met for the first
    time: on CUDA a cuDNN plan is built then), the recompute/cached ratio against ``RECOMPUTE_TARGET``, and
    with ``counts`` (for the first order) one more round under the profiler (``_op_counts``)."""
    dev = torch.device(device)
    dt = parse_dtype(dtype or ("bfloat16" if dev.type == "cuda" else "float32"))
    cfg = preset_config(model)
    block = cfg.block_size
    if canvas <= block or canvas % block:
        raise ValueError(f"canvas must be a multiple of the block ({block}) above it, got {canvas}")
    bad = [n for n in sizes if n < canvas or n % canvas]
    if bad:
        raise ValueError(f"sizes must be multiples of the canvas ({canvas}), got {bad}")
    if orders is None:
        orders = ("flash", "cudnn") if dev.type == "cuda" else ("flash",)
    net = build_preset(model, device=dev, dtype=dt)
    runner = TorchRunner(net, dev, fuse=True)
    most = max(sizes) // block  # the cached round's requests at the largest size: the most slots any round takes
    pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, max(most, 2 * max(sizes) // canvas),
                  canvas + canvas // 4, dt, dev)  # room for the varied lengths' longest
    runner.pool = pool
    rows_re = torch.arange(canvas - block, canvas)  # the block a recompute decodes: its canvas's last
    rows_ca = torch.arange(block)

    def case(steps: list[StepInput], rows: torch.Tensor):
        wanted = [rows] * len(steps)

        def run() -> None:
            outs = runner.run(steps, wanted)
            _held_copy([(pool.kv[:, :, s.slot, :, int(s.pos[0]) : int(s.pos[0]) + len(s.ids)], o.fresh)
                        for s, o in zip(steps, outs)])
        return run

    results = []
    with torch.inference_mode():
        for order in orders:
            net.attention_order = order
            for n in sizes:
                requests = n // canvas
                apart = round_inputs(cfg, requests, canvas, 0, dev, dt, pool=pool, gaps=requests)
                cases = {
                    "recompute": case(round_inputs(cfg, requests, canvas, 0, dev, dt, pool=pool), rows_re),
                    "recompute, slots apart": case(apart, rows_re),
                    "recompute, slots apart, copied": case(apart, rows_re),
                }
                if requests > 1:  # canvases of 3/4 and 5/4 of the size, as many tokens: packed, and padded as before
                    varied = _varied(cfg, requests, canvas, dev, dt, pool)
                    cases["recompute, lengths varied"] = case(varied, torch.arange(canvas // 2 - block, canvas // 2))
                    cases["recompute, lengths varied, padded"] = cases["recompute, lengths varied"]
                cached = round_inputs(cfg, n // block, block, canvas - block, dev, dt, pool=pool)
                cases["cached"] = case(cached, rows_ca)
                row = {"order": order, "tokens": n, "canvas": canvas}
                for name, run in cases.items():
                    runner.in_slots = not name.endswith(("copied", "padded"))  # the path before (in_slots)
                    pooled, forwards = runner.pooled, runner.forwards
                    first = _time(run, dev, 0, 1)[0]
                    in_place = runner.pooled - pooled == runner.forwards - forwards
                    times = _time(run, dev, warmup, repeats)
                    row[name] = {"median_ms": round(statistics.median(times), 3), "first_ms": round(first, 3),
                                 "in_place": in_place,
                                 **(_op_counts(run, dev, dt.itemsize) if counts and order == orders[0] else {})}
                runner.in_slots = True
                for name in VARIANTS[:-1]:
                    if name not in row:
                        continue
                    row[name]["ratio"] = round(row[name]["median_ms"] / row["cached"]["median_ms"], 3)
                results.append(row)
    return {"model": model, "device": device_name(dev), "dtype": str(dt).removeprefix("torch."), "canvas": canvas,
            "block": block, "sizes": list(sizes), "target_ratio": RECOMPUTE_TARGET, "repeats": repeats, "rows": results}


def format_recompute(res: dict) -> str:
    lines = [f"{res['model']} on {res['device']} ({res['dtype']}): a recompute round of N tokens "
             f"({res['canvas']}-token canvases, no context) against a cached round of N tokens "
             f"({res['block']}-token blocks over {res['canvas'] - res['block']} cached), "
             f"target ratio <= {res['target_ratio']}",
             f"{'order':<6} {'N':>5} {'variant':<33} {'median ms':>9} {'first ms':>9} {'ratio':>6} {'ops':>6} "
             f"{'copies':>6} {'copy MB':>8} {'alloc MB':>9} {'peak MB':>8}  attention"]
    for row in res["rows"]:
        for name in (v for v in VARIANTS if v in row):
            r = row[name]
            ratio = f"{r['ratio']:.2f}" if "ratio" in r else ""
            att = ", ".join(f"{k} x{v}" for k, v in r.get("attention", {}).items())
            if r.get("masked"):
                att += f" ({r['masked']} with a mask)"
            lines.append(f"{row['order']:<6} {row['tokens']:>5} {name:<33} {r['median_ms']:>9.2f} "
                         f"{r['first_ms']:>9.2f} {ratio:>6} {r.get('ops', ''):>6} {r.get('copies', ''):>6} "
                         f"{r.get('copy_mb', ''):>8} {r.get('allocated_mb', ''):>9} {r.get('peak_mb', ''):>8}  {att}"
                         + ("" if r["in_place"] else "  (not in the pool in place)"))
    return "\n".join(lines)
