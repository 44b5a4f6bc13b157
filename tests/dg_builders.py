"""Small random DiffusionGemma models of tiny-dg's architecture, and an all-reduce among rank threads, for the
tests (a support module: test files import this, never each other)."""

from __future__ import annotations

import threading

import torch

from engine.models import diffusion_gemma as dg
from engine.tokenizer import CharTokenizer
from tools import training as T

STEPS = 6  # denoising steps per canvas of the shrunk model


def shrunk_config(tok: CharTokenizer) -> dg.DiffusionGemmaConfig:
    """tiny-dg's architecture (tools/training.py ``dg_config``: sliding and full layers with their own head sizes
    and K/V heads, proportional RoPE, experts, the character tokenizer), shrunk, with few denoising steps."""
    cfg = T.dg_config(tok)
    return cfg.replace(hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                       head_dims=tuple(8 if t == dg.SLIDING else 16 for t in cfg.layer_types), sliding_window=8,
                       generation={**cfg.generation, "max_denoising_steps": STEPS, "max_new_tokens": 2 * T.DG_CANVAS})


def random_dg(tok: CharTokenizer, seed: int = 0) -> dg.DiffusionGemma:
    """A random shrunk model, norms and scalars randomised too (so that a mix-up of any of them shows)."""
    torch.manual_seed(seed)
    model = dg.DiffusionGemma(shrunk_config(tok))
    T.dg_init(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "scale" in name:
                p.uniform_(0.5, 1.5)
            elif p.dim() > 1:
                p.normal_(0.0, 0.3)
    return model.eval()


def run_ranks(world: int, fn) -> list:
    """``fn(rank)`` for each rank in a thread of its own (tensor-parallel ranks over ``ThreadAllReduce``); their
    results in rank order. An exception in a rank fails the caller, no rank waits past 60 s."""
    out, errors = [None] * world, []

    def run(rank):
        try:
            out[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(exc)
            raise

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    return out


class ThreadAllReduce:
    """An all-reduce among ``world`` rank threads (tensor parallelism in one process): each rank's partial
    deposited, summed in rank order."""

    def __init__(self, world: int) -> None:
        self.world, self.parts = world, [None] * world
        self.barrier = threading.Barrier(world, timeout=60)

    def for_rank(self, rank: int):
        def reduce(x: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = x
            self.barrier.wait()
            total = self.parts[0]
            for p in self.parts[1:]:
                total = total + p
            self.barrier.wait()
            return total

        return reduce


def same_draws(monkeypatch, seed: int) -> dict:
    """transformers' global-generator draws taken from Remask's (seed, canvas, step) generators, in the order
    its generate makes them: each canvas's initial noise (randint), then per step the sample (multinomial) and
    the renoising noise (randint). Returns where the draws are: ``where["canvas"]`` is the last canvas's index."""
    from engine.decoding import renoise

    real_randint, real_multinomial = torch.randint, torch.multinomial
    where = {"canvas": -1, "step": -1, "last": None, "gen": None}

    def randint(low, high, size, **kw):
        if where["last"] != "multinomial":  # a new canvas's initial noise
            where["canvas"] += 1
            where["step"] = -1
            where["gen"] = renoise.canvas_generator(seed, where["canvas"], -1)
        where["last"] = "randint"
        return real_randint(low, high, (int(torch.Size(size).numel()),), generator=where["gen"]).reshape(size)

    def multinomial(probs, num_samples, **kw):
        where["step"] += 1
        where["gen"] = renoise.canvas_generator(seed, where["canvas"], where["step"])
        where["last"] = "multinomial"
        return real_multinomial(probs, num_samples, generator=where["gen"])

    monkeypatch.setattr(torch, "randint", randint)
    monkeypatch.setattr(torch, "multinomial", multinomial)
    return where
