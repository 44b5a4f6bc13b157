"""Prints the CPU figures that two engine tests bound (the session notes and docs/engine.md quote them):

- MoE in bf16 (tests/test_runner.py): over three seeds, the share of (token, expert) choices bf16 makes
  differently from float32, and the logits' relative error with the choices free and held equal;
- a round's transient memory (tests/test_round_memory.py): the peak of a full-sequence round over the KV
  pool against the same round with its own K/V buffer, the round's K/V, the memory model's bound, and the
  round cut to a quarter of that bound.

    .venv/bin/python scripts/engine_cpu_figures.py
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.memory import forward_bytes, kv_bytes_per_token  # noqa: E402
from engine.models.presets import build_preset  # noqa: E402
from engine.sequence import StepInput  # noqa: E402
from tests.engine_probes import GEN, MOE, PROMPT, ROWS  # noqa: E402
from tests.engine_probes import first_round as _first_round  # noqa: E402
from tests.engine_probes import run_choosing as _run_choosing  # noqa: E402
from tests.engine_probes import step_inputs as _inputs  # noqa: E402


def moe() -> None:
    for seed in range(3):
        torch.manual_seed(seed)
        ref = build_preset(MOE, device="cpu", dtype=torch.float32)
        low = copy.deepcopy(ref).to("cpu", torch.bfloat16)
        inputs = _inputs(ref, n_ctx=(64, 0, 33), t=(32, 32, 20), seed=seed)
        rows = [torch.arange(len(s.ids)) for s in inputs]
        low_inputs = [StepInput(s.kind, s.ids, s.pos, None if s.ctx_kv is None else s.ctx_kv.to(torch.bfloat16),
                                s.ctx_pos, s.mode) for s in inputs]
        low_logits, low_choice = _run_choosing(low, "cpu", low_inputs, rows)
        free_logits, free_choice = _run_choosing(ref, "cpu", inputs, rows)
        held_logits, _ = _run_choosing(ref, "cpu", inputs, rows, hold=low_choice)
        pairs = sum(c.numel() for c in low_choice)
        flipped = sum(int((~(a[:, :, None] == b[:, None, :]).any(-1)).sum()) for a, b in zip(low_choice, free_choice))
        free = max(float((b - a).norm() / a.norm()) for a, b in zip(free_logits, low_logits))
        held = max(float((b - a).norm() / a.norm()) for a, b in zip(held_logits, low_logits))
        print(f"MoE bf16, seed {seed}: {flipped}/{pairs} choices differ ({flipped / pairs:.2%}); logits off "
              f"{free:.2%} with the choices free, {held:.2%} held equal")


def memory() -> None:
    pooled, in_place, _ = _first_round()
    _, own, _ = _first_round(kv_slots=0)
    kv = ROWS * (PROMPT + GEN) * kv_bytes_per_token(pooled.cfg, 4)
    bound = forward_bytes(pooled.cfg, 4, ROWS, PROMPT + GEN, 0, ROWS * GEN, copied=False, scores=True)
    cut, cut_peak, _ = _first_round(round_memory_bytes=bound // 4)
    print(f"round of {ROWS} x {PROMPT + GEN} tokens: peak {in_place / 1e6:.1f} MB over the pool, {own / 1e6:.1f} MB "
          f"with its own K/V buffer; the round's K/V {kv / 1e6:.1f} MB; the model's bound {bound / 1e6:.1f} MB; cut "
          f"to a quarter of it: {cut.runner.split_forwards} more forwards, peak {cut_peak / 1e6:.1f} MB")


if __name__ == "__main__":
    moe()
    memory()
