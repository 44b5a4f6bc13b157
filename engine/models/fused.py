"""The layers' elementwise work, eager or fused.

Between its matrix products a layer does elementwise work: the residual add and the RMSNorm after it,
the rotary embedding of q and k, SwiGLU's activation and product. Eagerly each is several kernels, and
each kernel reads and writes whole activations: on the first H200 run a fifth of the LLaDA-8B round
(21 of 124 ms) was such kernels. Fused, each group is one kernel that reads its inputs once.

The functions below are the groups' eager code, which the model's modules also run (the reference, and a
CPU's path). ``compiled()`` runs the same functions compiled by torch.compile (inductor: one generated
kernel per group, shapes dynamic so a round's changing batch does not recompile); ``choose(device)`` picks
it where it pays, on CUDA with Triton present, unless ``REMASK_FUSE=0`` (or ``=1`` to force it, e.g. to
test the compiled path on a CPU). A model
records which ran (``DLMTransformer.elementwise``) and the profile stores it, as it does fusion and graphs.
Both paths compute the same function: the compiled one equals the eager one within float rounding.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x``'s last dimension: float32 inside, rounded to ``x``'s dtype before the weight multiplies
    it (the model's RMSNorm off CUDA)."""
    f = x.float()
    return weight * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rms_norm(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + h, RMSNorm(x + h)): the residual add and the norm after it."""
    s = x + h
    return s, rms_norm(s, weight, eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` dimensions of each head (all of them unless the model uses
    partial rotary embeddings); the rest pass through. With halves (x1, x2) that is x * cos + (-x2, x1) *
    sin, computed as x * cos + (x2, x1) * signed sin (``transformer.rope_cos_sin``): three passes over x,
    not five."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return torch.addcmul(x * cos, _swap_halves(x), sin)
    rot, rest = x[..., :r], x[..., r:]
    return torch.cat((torch.addcmul(rot * cos, _swap_halves(rot), sin), rest), dim=-1)


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], x[..., :half]), dim=-1)  # one pass, whatever x's strides (roll copies first)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary embedding of q and k (``apply_rope``), as one group."""
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of a fused gate/up product's output [..., 2 x I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class Elementwise:
    """One implementation of the layers' elementwise groups (``EAGER``, or ``compiled()``)."""

    def __init__(self, name: str, add_rms_norm_, rope_, swiglu_) -> None:
        self._name = name
        self.add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]] = add_rms_norm_
        self.rope: Callable[..., tuple[torch.Tensor, torch.Tensor]] = rope_
        self.swiglu: Callable[[torch.Tensor], torch.Tensor] = swiglu_
        self.failed: str | None = None  # why compiling failed: the eager functions run from then on

    @property
    def name(self) -> str:
        """What runs: "eager", "inductor", or "eager (inductor failed: ...)"."""
        return self._name if self.failed is None else f"eager ({self._name} failed: {self.failed})"


EAGER = Elementwise("eager", add_rms_norm, rope, swiglu)


@functools.cache
def compiled() -> Elementwise:
    """The same groups compiled by torch.compile, compiled at their first call (per device and dtype). A
    compilation that fails (no compiler for this device, an unsupported torch) makes every group run eagerly
    from then on, with one warning, and the implementation's ``name`` says so."""
    impl = Elementwise("inductor", None, None, None)

    def guarded(fn):
        fast = torch.compile(fn, dynamic=True, fullgraph=True)

        def call(*args):
            if impl.failed is None:
                try:
                    return fast(*args)
                except Exception as exc:  # noqa: BLE001 - any compiler failure: fall back, never fail the round
                    impl.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                    log.warning("compiling the fused elementwise kernels failed, running them eagerly: %s",
                                impl.failed)
            return fn(*args)

        return call

    impl.add_rms_norm, impl.rope, impl.swiglu = guarded(add_rms_norm), guarded(rope), guarded(swiglu)
    return impl


def choose(device: torch.device | str) -> Elementwise | None:
    """The fused implementation for ``device``, or None (the model's own eager path): the compiled one on
    CUDA with Triton; ``REMASK_FUSE`` (``0``/``1``) overrides."""
    forced = os.environ.get("REMASK_FUSE", "").strip()
    if forced in ("0", "1"):
        return compiled() if forced == "1" else None
    if torch.device(device).type == "cuda" and importlib.util.find_spec("triton") is not None:
        return compiled()
    return None
