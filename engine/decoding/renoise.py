"""renoise: DiffusionGemma's entropy-bound sampler (uniform-state diffusion), one decoding rule on the seam.

A canvas (DiffusionGemma's block, ``canvas_length`` tokens) starts as uniform random tokens and is rewritten
whole at every denoising step:

1. the step's logits are divided by a temperature that falls linearly over the steps (``temperature``:
   ``t_max`` at the first step, ``t_min + (t_max - t_min) / max_denoising_steps`` at the last);
2. every position is sampled from those processed logits, and its entropy (nats) and argmax are taken;
3. the **EB rule**: the positions sorted by entropy, ascending, are kept while the sum of the kept entropies
   minus the largest of them stays within ``entropy_bound`` (the knob: higher keeps more per step, so fewer
   steps: faster, lower quality); kept positions take their sampled token, the others fresh uniform noise;
4. the canvas stops when its argmax has equalled the previous ``stability_threshold`` steps' argmaxes and the
   mean entropy is below ``confidence_threshold``, or after ``max_denoising_steps``; its argmax is the output.

The processed logits feed the next step's self-conditioning (the engine's part). All of it is transformers'
``EntropyBoundSampler`` + ``LinearTemperatureScheduleLogitsProcessor`` + ``StableAndConfidentStoppingCriteria``
(tests/test_diffusion_gemma.py checks it step by step on the same draws).

How it extends the seam (engine/decoding/base.py), for whole-canvas rules:

- ``needs`` holds ``"canvas"`` (``NEEDS_CANVAS``): the rule sees a ``CanvasStep``, a ``BlockStep`` whose
  ``tokens`` are sampled at every position (``all_rows``), with ``entropy`` and the ``canvas`` now (before the
  step), and two more arrays: the step's ``argmax`` and the step's ``noise`` (uniform tokens). ``masked``
  is all False and ``editable`` all True (no position is ever "masked" in uniform-state diffusion).
- it answers a ``CanvasDecision``: ``edit`` marks the renoised positions, and two more arrays carry the
  whole next ``canvas`` and the ``output`` (the argmax: the canvas's text once ``done``). The engine replaces
  the canvas by ``decision.canvas`` (``apply_decision`` does not apply to it).
- ``canvas_rule`` (class attribute) is True: an engine refuses it for masked-diffusion models, and a masked
  rule for a canvas model.
- the randomness is the engine's, drawn on the device from a generator seeded by (request seed, canvas index,
  step) (``canvas_generator``), never from a process-wide generator: the same seed gives the same text, also
  after a resume or a migration (the rule's ``state`` carries the argmax history, JSON).

The rule itself (this module's import) needs no torch; the device-side helpers import it when called.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from engine.decoding.base import (
    NEEDS_ALL_ROWS,
    NEEDS_CANVAS,
    NEEDS_ENTROPY,
    BlockStep,
    Decision,
    RuleBase,
    integer,
    real,
    register,
)

MAX_BOUND = 1000.0


@dataclass
class CanvasStep(BlockStep):
    """A ``BlockStep`` over a whole canvas (see the module's docstring); ``canvas`` (the base's field) holds the
    tokens on the canvas before this step."""

    argmax: np.ndarray | None = None  # int64 [L]: the argmax of this step's processed logits
    noise: np.ndarray | None = None  # int64 [L]: this step's uniform random tokens (for renoised positions)


@dataclass
class CanvasDecision(Decision):
    canvas: np.ndarray  # int64 [L]: the next canvas
    output: np.ndarray  # int64 [L]: the argmax canvas (the output when ``done``)


def eb_accept(entropy: np.ndarray, bound: float) -> np.ndarray:
    """The EB rule: bool [L], the lowest-entropy positions whose summed entropy minus the largest of them stays
    within ``bound`` (float32 sums, as transformers'); at least the lowest one."""
    e = np.asarray(entropy, dtype=np.float32)
    order = np.argsort(e, kind="stable")
    ranked = e[order]
    keep_sorted = (np.cumsum(ranked, dtype=np.float32) - ranked) <= np.float32(bound)
    keep = np.zeros(e.shape, dtype=bool)
    keep[order] = keep_sorted
    return keep


@register
@dataclass(frozen=True)
class RenoiseRule(RuleBase):
    """DiffusionGemma's entropy-bound renoising (module docstring). Defaults: transformers' generation
    defaults (a checkpoint's generation_config.json overrides them through ``engine.canvas``)."""

    name: ClassVar[str] = "renoise"
    knob: ClassVar[str] = "entropy_bound"
    knob_range: ClassVar[tuple[float, float]] = (1e-4, MAX_BOUND)
    speed_sign: ClassVar[int] = 1  # a higher bound keeps more tokens per step: fewer steps
    needs: ClassVar[frozenset[str]] = frozenset({NEEDS_ENTROPY, NEEDS_ALL_ROWS, NEEDS_CANVAS})
    edits: ClassVar[bool] = True  # the whole canvas changes until it stops: streaming holds it until done
    canvas_rule: ClassVar[bool] = True

    entropy_bound: float = 0.1
    max_denoising_steps: int = 48
    t_min: float = 0.4
    t_max: float = 0.8
    stability_threshold: int = 1
    confidence_threshold: float = 0.005

    def __post_init__(self) -> None:
        self.check_knob(self.entropy_bound)
        integer("max_denoising_steps", self.max_denoising_steps, 1)
        real("t_min", self.t_min, 0.0, 1e6)
        real("t_max", self.t_max, 0.0, 1e6)
        if self.t_max <= self.t_min:
            raise ValueError(f"t_max must be greater than t_min, got t_max {self.t_max} <= t_min {self.t_min}")
        integer("stability_threshold", self.stability_threshold, 0)
        real("confidence_threshold", self.confidence_threshold, 0.0, 1e6, lo_open=True)

    def knob_at(self, level: float) -> float:
        """The router's level (0.5 ... 0.9, higher: slower) as a bound: the configured bound (the checkpoint's
        quality) at 0.9, the router's top candidate and its level when it has no step estimates, doubling for
        every 0.1 below it (faster) and halving above (clipped to the range)."""
        level = real("threshold", level, 0.0, 1.0)
        lo, hi = self.knob_range
        return float(min(hi, max(lo, self.entropy_bound * 2.0 ** ((0.9 - level) * 10.0))))

    def temperature(self, step_in_block: int) -> float:
        """The temperature of step ``step_in_block`` (0 first): transformers counts the remaining steps
        N .. 1, and step n of them divides by t_min + (t_max - t_min) * n / N, computed in float32 as its
        logits processor does (n an int32 tensor): the same value to the last bit."""
        import torch

        remaining = torch.tensor(self.max_denoising_steps - step_in_block, dtype=torch.int32)
        return float(self.t_min + (self.t_max - self.t_min) * (remaining / self.max_denoising_steps))

    def decide(self, step: BlockStep) -> CanvasDecision:
        if not isinstance(step, CanvasStep) or step.canvas is None or step.argmax is None or step.noise is None \
                or step.entropy is None:
            raise ValueError("the renoise rule decides whole canvases: it needs a CanvasStep with canvas, argmax, "
                             "noise and entropy (a DiffusionGemma model; masked-diffusion models use the other "
                             "rules)")
        bound = self.knob_value(step)
        keep = eb_accept(step.entropy, bound)
        nxt = np.where(keep, step.tokens, step.noise).astype(np.int64)
        argmax = np.asarray(step.argmax, dtype=np.int64)
        history = step.state.setdefault("history", [])  # the last stability_threshold argmax canvases
        if self.stability_threshold == 0:
            stable = True
        else:
            stable = len(history) == self.stability_threshold and all(h == argmax.tolist() for h in history)
            history.append(argmax.tolist())
            del history[: max(0, len(history) - self.stability_threshold)]
        confident = float(np.mean(np.asarray(step.entropy, dtype=np.float32))) < self.confidence_threshold
        done = (stable and confident) or step.step_in_block + 1 >= self.max_denoising_steps
        n = step.size
        return CanvasDecision(np.zeros(n, dtype=bool), ~keep, bool(done), nxt, argmax)

    @classmethod
    def from_generation(cls, generation: dict, **overrides: Any) -> RenoiseRule:
        """The rule from a DiffusionGemma config's ``generation`` dict (engine.models.diffusion_gemma)."""
        fields = {k: generation[k] for k in ("entropy_bound", "max_denoising_steps", "t_min", "t_max",
                                             "stability_threshold", "confidence_threshold") if k in generation}
        return cls(**{**fields, **overrides})


# ---------------------------------------------------------------- the device side (torch, imported when called)

_MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit value."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def draw_seed(seed: int, canvas: int, step: int) -> int:
    """The seed of one denoising step's draws: a function of (request seed, canvas index, step) only."""
    return _mix(_mix(_mix(int(seed) & _MASK64) ^ int(canvas)) ^ int(step)) & ((1 << 63) - 1)


def canvas_generator(seed: int, canvas: int, step: int, device="cpu"):
    """A torch generator on ``device`` for (seed, canvas index, step); step -1 is the canvas's initial noise."""
    import torch

    return torch.Generator(device=device).manual_seed(draw_seed(seed, canvas, step + 1))


def entropy(processed):
    """Per-position entropy (nats) of logits [..., V], computed as torch.distributions.Categorical does."""
    import torch

    norm = processed - processed.logsumexp(dim=-1, keepdim=True)
    probs = torch.softmax(norm, dim=-1)
    return -(norm.clamp(min=torch.finfo(norm.dtype).min) * probs).sum(-1)


def propose(raw, temperature: float, generator=None) -> dict:
    """One canvas's step on the device: ``raw`` logits [L, V] -> processed logits (divided by ``temperature``),
    ``tokens`` sampled from them with ``generator`` (multinomial, as transformers), ``argmax`` and ``entropy``."""
    import torch

    processed = raw / temperature
    probs = torch.softmax(processed, dim=-1, dtype=torch.float32)
    tokens = torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
    return {"processed": processed, "tokens": tokens, "argmax": processed.argmax(-1), "entropy": entropy(processed)}


def noise(length: int, vocab_size: int, generator=None, device="cpu"):
    """``length`` uniform random token ids (the initial canvas, or a step's renoising draws)."""
    import torch

    return torch.randint(0, vocab_size, (length,), generator=generator, device=device)
