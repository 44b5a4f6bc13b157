"""DiffusionGemma's K/V pool, measured on a CPU: a request's bytes with its own tensors and in the pool, and a
pool's split of a memory budget, for tiny-dg and the 26B-A4B's config, and the decoder step of a round of 8
canvases over the pool against the padded copy.

    OMP_NUM_THREADS=1 python scripts/dg_pool_measure.py [--repeats 30]

Bytes (no weights needed): own tensors, a request holds ``cache_bytes`` of what it has encoded (at most its prompt
and ``max_tokens``; each encoder pass's ``torch.cat`` holds the old and the new tensors for a moment); pooled, it
holds for its whole life the pages of its prompt plus ``max_tokens`` (``slots_for(...)`` x ``bytes_per_slot``: the
full layers) and one ring (``bytes_per_ring``: the sliding layers' window), plus its share of the canvas rows;
"a ring per slot" is the layout before the rings were kept apart (each slot carried a ring, a request over
several slots left all but its first slot's ring unused). A budget: the pages and rings ``CanvasServeEngine``
buys with it (``split_kv_budget``: a ring with each page up to as many as residents, ``kv_residents_max``: k x B
= 8 x 32 by default, or 64; the rest in pages), against slots that each carry a ring. Timing: tiny-dg's
architecture with random weights (float32, one thread), 8 requests of different lengths (some past the sliding
window), one denoising step each: the pooled step, the padded copy's first step of a canvas (``PaddedCaches``
built, then the step) and its later steps (the copy reused); the median of ``--repeats``, interleaved.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from engine.canvas_serving import split_kv_budget  # noqa: E402
from engine.engine import POOL_PROMPT_TOKENS  # noqa: E402
from engine.models import diffusion_gemma as dg  # noqa: E402
from engine.profile_model import DG_26B_A4B_TEXT, DG_CANVAS  # noqa: E402
from engine.tokenizer import CharTokenizer  # noqa: E402
from tools import training as T  # noqa: E402

MIB, GIB = 2 ** 20, 2 ** 30


def _slot(cfg: dg.DiffusionGemmaConfig, gen: int) -> int:
    """CanvasServeEngine's default page: a window's prompt (at least 512) and the default generation length."""
    return min(cfg.max_position_embeddings, max(POOL_PROMPT_TOKENS, cfg.sliding_window - 1) + gen)


def _bytes(cfg: dg.DiffusionGemmaConfig, dtype_bytes: int, prompt: int, max_tokens: int, gen: int) -> dict:
    slot = _slot(cfg, gen)
    page, ring, row = dg.DGPool.sizes(cfg, slot, 1, dtype_bytes)
    pages = max(-(-(prompt + max_tokens) // slot), 1)
    return {"own_at_prompt": cfg.cache_bytes(prompt, dtype_bytes),
            "own_at_most": cfg.cache_bytes(prompt + max_tokens, dtype_bytes), "slot_tokens": slot, "pages": pages,
            "page": page, "ring": ring, "pooled": pages * page + ring, "ring_per_slot": pages * (page + ring),
            "canvas_row": row}


def _budget(cfg: dg.DiffusionGemmaConfig, dtype_bytes: int, gen: int, budget: int, rows: int, residents: int) -> str:
    slot = _slot(cfg, gen)
    page, ring, row_bytes = dg.DGPool.sizes(cfg, slot, rows, dtype_bytes)
    most = residents * -(-cfg.max_position_embeddings // slot)
    pages, rings = split_kv_budget(budget, page, ring, row_bytes, residents, most)
    before = max(budget - row_bytes, 0) // (page + ring)
    return (f"{_size(budget)}, {rows} canvas rows ({_size(row_bytes)}), residents <= {residents}: {pages} pages "
            f"({_size(pages * page)}, {pages * slot} positions) + {rings} rings ({_size(rings * ring)}); a ring per "
            f"slot: {before} slots ({_size(before * (page + ring))}, {before * slot} positions, at most {before} "
            "residents)")


def _size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.2f} MiB"


def _times(fns: dict, repeats: int) -> dict:
    """The median seconds of each of ``fns``, run in turn ``repeats`` times (interleaved: a busy machine's noise
    falls on all of them alike), after one warm-up each."""
    for fn in fns.values():
        fn()
    times: dict = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = CharTokenizer.default()
    tiny = T.dg_config(tok)
    big = dg.config_from_hf({"text_config": {**DG_26B_A4B_TEXT, "layer_types": list(DG_26B_A4B_TEXT["layer_types"])},
                             "canvas_length": DG_CANVAS})
    for name, cfg, item, cases, gen, budgets in (
            ("tiny-dg float32", tiny, 4, [(64, 96), (200, 96), (1000, 96)], 96, [(64 * MIB, 256)]),
            ("26B-A4B bf16", big, 2, [(512, 256), (2000, 256), (8000, 1024)], 256,
             [(40 * GIB, 256), (40 * GIB, 64), (80 * GIB, 256)])):
        for prompt, max_tokens in cases:
            b = _bytes(cfg, item, prompt, max_tokens, gen)
            print(f"{name}: prompt {prompt} + max_tokens {max_tokens}: own tensors {b['own_at_prompt'] / MIB:.3f} MiB "
                  f"after the prompt, at most {b['own_at_most'] / MIB:.3f} MiB; pooled {b['pages']} page(s) of "
                  f"{b['slot_tokens']} ({b['page'] / MIB:.3f} MiB each) + 1 ring ({b['ring'] / MIB:.3f} MiB) = "
                  f"{b['pooled'] / MIB:.3f} MiB (a ring per slot: {b['ring_per_slot'] / MIB:.3f} MiB), plus the "
                  f"shared canvas rows ({b['canvas_row'] / MIB:.3f} MiB per row)")
        for budget, residents in budgets:
            print(f"{name}: a budget of {_budget(cfg, item, gen, budget, 32, residents)}")
    torch.manual_seed(0)
    model = dg.DiffusionGemma(tiny)
    T.dg_init(model)
    model.eval()
    lengths = [20, 45, 70, 95, 120, 150, 180, 230]  # window 64: most past it
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, tiny.vocab_size, (n,), generator=g).tolist() for n in lengths]
    own = [dg.DGCache(tiny) for _ in lengths]
    pool = dg.DGPool(tiny, 8, 512, 8, torch.float32, "cpu")
    pooled = [dg.DGCache(tiny) for _ in lengths]
    for c in pooled:
        assert c.place(pool, 300)
    model.encode_many(prompts, own)
    model.encode_many(prompts, pooled)
    canvas = torch.randint(0, tiny.vocab_size, (8, tiny.canvas_length), generator=g)
    soft = torch.randn(8, tiny.canvas_length, tiny.hidden_size, generator=g)
    counted = torch.ones(8, dtype=torch.bool)
    padded = dg.PaddedCaches(own, tiny.canvas_length, "cpu")
    step = dg.PoolStep(pool, pooled, tiny.canvas_length, "cpu")
    diff = (model.decode(canvas, step, soft, counted) - model.decode(canvas, padded, soft, counted)).abs().max()
    t = _times({"pool": lambda: model.decode(canvas, step, soft, counted),
                "pool_build": lambda: model.decode(canvas, dg.PoolStep(pool, pooled, tiny.canvas_length, "cpu"),
                                                   soft, counted),
                "first": lambda: model.decode(canvas, dg.PaddedCaches(own, tiny.canvas_length, "cpu"), soft, counted),
                "later": lambda: model.decode(canvas, padded, soft, counted)}, args.repeats)
    t_pool, t_pool_build, t_first, t_later = t["pool"], t["pool_build"], t["first"], t["later"]
    print(f"tiny-dg decoder step, 8 canvases of {tiny.canvas_length} over caches of {lengths} positions, "
          f"float32, 1 thread, median of {args.repeats}: pooled {t_pool * 1e3:.2f} ms "
          f"({t_pool_build * 1e3:.2f} ms with its index built), padded copy {t_first * 1e3:.2f} ms on a canvas's "
          f"first step (copy built) and {t_later * 1e3:.2f} ms on its later steps; max |logit difference| {diff:.1e}")


if __name__ == "__main__":
    main()
