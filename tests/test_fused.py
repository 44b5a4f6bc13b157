"""The layers' elementwise groups fused (engine/models/fused.py): compiled by inductor on the CPU here, each
group equals its eager code within float rounding, a whole round through the fused path equals the round
through the modules' own code, the path is chosen per device and recorded, and a compiler that fails
leaves the eager code running."""

from __future__ import annotations

import copy

import pytest
import torch

from engine.models import fused
from engine.models.fused import apply_rope
from engine.models.presets import build_preset
from engine.models.transformer import rope_cos_sin
from engine.runner import TorchRunner
from engine.sequence import StepInput, StepKind

SHAPES = {  # one per path the groups meet: full multi-head attention; grouped-query with q/k norms and partial
    # rotary embedding (the SDAR/Qwen3 side); a mixture of experts with shared experts (LLaDA2)
    "llada": "llada-8b-shape:layers=2,vocab=512,hidden=128,heads=4,kv_heads=4,intermediate=256",
    "llada2": "llada2-mini-shape:layers=2,vocab=512,hidden=128,heads=4,kv_heads=2,head_dim=32,intermediate=256,"
              "experts=16,moe_intermediate=32",
}


@pytest.fixture(scope="module")
def inductor():
    impl = fused.compiled()
    yield impl
    assert impl.failed is None, impl.failed  # inductor compiled every group on this CPU


@pytest.mark.slow
def test_each_fused_group_equals_its_eager_code(inductor):
    """In float32 (each dtype is a compilation of its own: about 30 s on two cores; one is enough here)."""
    gen = torch.Generator().manual_seed(0)
    dtype, tol = torch.float32, dict(atol=1e-5, rtol=1e-5)
    x, h = (torch.randn(3, 5, 64, generator=gen).to(dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(64, generator=gen)).to(dtype)
    s, normed = inductor.add_rms_norm(x, h, w, 1e-6)
    ref = x + h
    f = ref.float()
    ref_normed = w * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    torch.testing.assert_close(s, ref, **tol)
    torch.testing.assert_close(normed, ref_normed, **tol)
    q, k = torch.randn(3, 4, 5, 32, generator=gen).to(dtype), torch.randn(3, 2, 5, 32, generator=gen).to(dtype)
    pos = torch.arange(5).expand(3, 5) + torch.tensor([[0], [7], [30]])
    for rotary in (32, 16):  # all of each head, or its first half (partial rotary embedding)
        cos, sin = rope_cos_sin(pos, rotary, 10000.0, dtype)
        fq, fk = inductor.rope(q, k, cos, sin)
        torch.testing.assert_close(fq, apply_rope(q, cos, sin), **tol)
        torch.testing.assert_close(fk, apply_rope(k, cos, sin), **tol)
    gate_up = torch.randn(2, 6, 2 * 48, generator=gen).to(dtype)
    gate, up = gate_up.chunk(2, -1)
    torch.testing.assert_close(inductor.swiglu(gate_up), torch.nn.functional.silu(gate) * up, **tol)


def _inputs(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for c, t in ((9, 8), (0, 8), (21, 5)):
        kv = torch.randn(cfg.num_layers, 2, cfg.num_kv_heads, c, cfg.head_dim, generator=g) if c else None
        out.append(StepInput(StepKind.DENOISE, torch.randint(2, cfg.vocab_size, (t,), generator=g),
                             torch.arange(c, c + t), kv, torch.arange(c) if c else None, cfg.attention))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family", list(SHAPES))
def test_a_fused_round_equals_the_eager_round(inductor, family):
    model = build_preset(SHAPES[family], dtype=torch.float32)
    eager = TorchRunner(copy.deepcopy(model), fuse=True)
    fast = TorchRunner(copy.deepcopy(model), fuse=True)
    fast.model.use_elementwise(inductor)
    assert eager.model.elementwise == "eager" and fast.model.elementwise == "inductor"
    inputs = _inputs(model.config)
    rows = [torch.arange(len(s.ids)) for s in inputs]
    for a, b in zip(eager.run(inputs, rows), fast.run(inputs, rows)):
        torch.testing.assert_close(b.logits, a.logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(b.fresh, a.fresh, atol=1e-4, rtol=1e-4)
        assert torch.equal(a.top1[1], b.top1[1])  # the same tokens chosen


def test_the_path_is_chosen_per_device_and_recorded(monkeypatch):
    monkeypatch.delenv("REMASK_FUSE", raising=False)
    assert fused.choose("cpu") is None  # a CPU runs the modules' own code
    monkeypatch.setattr(fused.importlib.util, "find_spec", lambda name: object() if name == "triton" else None)
    assert fused.choose("cuda") is fused.compiled()  # CUDA with Triton: fused
    monkeypatch.setattr(fused.importlib.util, "find_spec", lambda name: None)
    assert fused.choose("cuda") is None  # no Triton, no inductor kernels for CUDA
    monkeypatch.setenv("REMASK_FUSE", "1")
    assert fused.choose("cpu") is fused.compiled()
    monkeypatch.setenv("REMASK_FUSE", "0")
    assert fused.choose("cuda") is None
    runner = TorchRunner(build_preset(SHAPES["llada"]), fuse=True)  # REMASK_FUSE=0: eager
    assert runner.model.elementwise == "eager"


def test_a_compiler_that_fails_leaves_the_eager_code_running(monkeypatch, caplog):
    def broken(fn, **kw):
        def call(*args):
            raise RuntimeError("no C++ compiler found")
        return call

    monkeypatch.setattr(fused.torch, "compile", broken)
    fused.compiled.cache_clear()
    try:
        impl = fused.compiled()
        x, h, w = torch.randn(2, 3, 8), torch.randn(2, 3, 8), torch.ones(8)
        s, normed = impl.add_rms_norm(x, h, w, 1e-6)
        torch.testing.assert_close(s, x + h)
        assert impl.failed == "RuntimeError: no C++ compiler found" and impl.name.startswith("eager (inductor failed")
        assert "running them eagerly" in caplog.text
        gate_up = torch.randn(4, 6)
        torch.testing.assert_close(impl.swiglu(gate_up), fused.swiglu(gate_up))  # the others fall back too
    finally:
        fused.compiled.cache_clear()
