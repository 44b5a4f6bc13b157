"""The layouts that kernels hand their outputs back in, and CUDA's emulated on a CPU.

A kernel's output has the shape its operation promises, not always the memory order: CUDA's fused
attention kernels (flash, cuDNN, memory-efficient) write ``scaled_dot_product_attention``'s
[N, H, T, D] output into a [N, T, H, D] buffer and hand back its transpose, where a CPU's math kernel
hands back a contiguous tensor. Code that reshapes such an output with ``.view`` runs on the CPU and
stops on the GPU ("view size is not compatible with input tensor's size and stride").

The model calls attention through ``attention`` below. With the emulation on (``REMASK_CUDA_LAYOUTS=1``
in the environment when this module is imported, or inside ``cuda_layouts()``), it re-lays the CPU's
result in CUDA's strides (same values, CUDA's memory order), so a layout assumption fails on a CPU in
the test suite, not on a user's GPU. Off (the default), it is the kernel's output unchanged.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.nn.functional as F

_emulate = os.environ.get("REMASK_CUDA_LAYOUTS", "").strip().lower() in ("1", "true", "yes", "on")


def emulating() -> bool:
    """Whether kernel outputs are handed back in CUDA's layouts (see the module's docstring)."""
    return _emulate


@contextlib.contextmanager
def cuda_layouts(on: bool = True) -> Iterator[None]:
    """Emulate CUDA's output layouts (or not, with ``on=False``) inside the block."""
    global _emulate
    before, _emulate = _emulate, on
    try:
        yield
    finally:
        _emulate = before


def as_cuda_attention_output(out: torch.Tensor) -> torch.Tensor:
    """``out`` [N, H, T, D] with the values unchanged, in the strides of CUDA's fused attention kernels:
    a [N, T, H, D] buffer, transposed (non-contiguous whenever H > 1 and T > 1)."""
    return out.transpose(1, 2).contiguous().transpose(1, 2)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
              enable_gqa: bool = False, scale: float | None = None) -> torch.Tensor:
    """``scaled_dot_product_attention`` (looked up at each call, so a test may wrap it), its output in CUDA's
    layout when emulating. Callers must not assume the output is contiguous. ``scale``: the scores' factor
    (None: 1/sqrt(head dim); DiffusionGemma's q/k norms make it 1)."""
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=enable_gqa, scale=scale)
    return as_cuda_attention_output(out) if _emulate and not out.is_cuda else out
