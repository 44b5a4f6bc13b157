"""Engine probes shared by the engine tests and scripts/engine_cpu_figures.py (which prints the figures the
tests bound): a round's transient memory at a small width (tests/test_round_memory.py), and the runner's
inputs and expert choices of a small mixture of experts (tests/test_runner.py)."""

from __future__ import annotations

import torch

from engine.loading import load_engine
from engine.memory import peak_bytes
from engine.models.presets import random_prompt
from engine.models.transformer import SparseMoE
from engine.runner import TorchRunner
from engine.sequence import SamplingParams, StepInput, StepKind

# ---- a round's transient memory ------------------------------------------------------------------------

# many layers for a small width, so that K/V weigh as they do in a real model against the activations
NAME = "llada-8b-shape:layers=16,vocab=512,hidden=128,heads=4,kv_heads=4,intermediate=256"
ROWS, PROMPT, GEN = 12, 200, 32


def first_round(**engine_kwargs):
    """An engine and the peak bytes of its first full-sequence round of ROWS requests (each PROMPT + GEN
    tokens), measured after a one-request round has warmed it; and the requests."""
    engine = load_engine(NAME, max_slots=ROWS + 1, kv_slot_tokens=256, **engine_kwargs)
    seqs = [engine.add_request(random_prompt(engine.cfg, PROMPT, seed=s), SamplingParams(max_tokens=GEN))
            for s in range(ROWS + 1)]
    engine.step(seqs[:1])
    got = {}
    peak = peak_bytes(lambda: got.setdefault("round", engine.step(seqs[1:])))
    return engine, peak, seqs


# ---- the runner's inputs and a mixture of experts' choices -----------------------------------------------


def step_inputs(model, n_ctx=(5, 0, 11), t=(8, 8, 5), seed=0) -> list[StepInput]:
    """Denoising steps of ``model`` with random tokens, over random context K/V of ``n_ctx`` tokens each, ``t``
    query tokens each."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    out = []
    for c, q in zip(n_ctx, t):
        kv = torch.randn(cfg.num_layers, 2, cfg.num_kv_heads, c, cfg.head_dim, generator=g) if c else None
        out.append(StepInput(StepKind.DENOISE, torch.randint(2, cfg.vocab_size, (q,), generator=g),
                             torch.arange(c, c + q), kv, torch.arange(c) if c else None, cfg.attention))
    return out


MOE = "llada2-mini-shape:layers=3,vocab=4096,hidden=512,heads=8,kv_heads=2,head_dim=64,intermediate=1024,experts=32"


def routers(model):
    """The routers (gates) of a mixture of experts' layers."""
    return [m.gate for m in model.modules() if isinstance(m, SparseMoE)]


def run_choosing(model, device, inputs, rows, hold=None):
    """The runner's logits of ``inputs`` and every expert choice its routers made, call by call ([N, k] ids on
    the CPU); ``hold``: such a list from another run, whose choices this run's routers take instead of theirs."""
    seen: list[torch.Tensor] = []

    def hook(ids):
        seen.append(ids.cpu())
        return ids if hold is None else hold[len(seen) - 1].to(ids.device)

    for r in routers(model):
        r.choice_hook = hook
    try:
        out = TorchRunner(model, device).run(inputs, rows)
    finally:
        for r in routers(model):
            r.choice_hook = None
    return [o.logits.float().cpu() for o in out], seen

