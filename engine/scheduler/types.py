"""Data types of the instance scheduler (pure Python: no torch, no ray)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class StepKind(enum.StrEnum):
    PREFILL = "prefill"  # one prompt block into the exact cache (block-causal models)
    DENOISE = "denoise"  # one round on the current block over the exact cache
    RECOMPUTE = "recompute"  # full sequence; refreshes the approximate cache
    CACHED = "cached"  # current block only, over the approximate cache


class Residency(enum.IntEnum):
    WAITING = 0  # no KV held
    RUNNING = 1  # resident and in this round's batch
    PAUSED = 2  # resident (KV and partial block kept) but not in this round's batch
    FINISHED = 3


@dataclass(frozen=True)
class StepCosts:
    """Relative cost of each step kind, in units of one denoise block step.

    Remaining work of a request is P_i * prefill + the expected cost of its
    remaining rounds: for full-sequence models with the approximate cache each
    remaining block starts with one recompute step and the rest are cached
    steps, so r_i rounds over b_i remaining blocks cost
    b_i * recompute + (r_i - b_i) * cached.
    """

    prefill: float = 1.0
    denoise: float = 1.0
    recompute: float = 1.0
    cached: float = 1.0


@dataclass(eq=False)
class SchedRequest:
    """What the scheduler knows of one request."""

    req_id: str
    prompt_blocks: int  # P at arrival
    output_blocks: int  # output budget in blocks
    est_rounds: float  # r_i: estimated remaining denoising rounds
    arrival: float = 0.0
    deadline: float | None = None
    threshold: float | None = None
    priority: int = 0
    predicted_output_tokens: float = 0.0  # for ssjf
    true_rounds: int | None = None  # for the oracle policy (simulation and tests)
    full_sequence: bool = False  # recompute/cached steps instead of prefill/denoise
    kv_positions: int | None = None  # positions its KV cache holds (the engine's); None: estimated from blocks
    kv_tokens: int = 0  # worst-case KV footprint, set by the scheduler
    # progress
    prefill_done: int = 0
    rounds_done: int = 0
    blocks_done: int = 0
    committed_tokens: int = 0
    refined: bool = False
    next_kind: StepKind = StepKind.PREFILL
    residency: Residency = Residency.WAITING
    history: list[StepKind] = field(default_factory=list)
    first_block_time: float | None = None
    finish_time: float | None = None
    admitted_time: float | None = None
    # policy scratch (mlfq level, attained service ...)
    level: int = 0
    attained: int = 0
    key: tuple = ()

    def __post_init__(self) -> None:
        if self.prompt_blocks < 0 or self.output_blocks < 1:
            raise ValueError("prompt_blocks must be >= 0 and output_blocks >= 1")
        if self.prompt_blocks == 0 or self.full_sequence:
            self.next_kind = StepKind.RECOMPUTE if self.full_sequence else StepKind.DENOISE

    @property
    def remaining_prefill(self) -> int:
        return 0 if self.full_sequence else self.prompt_blocks - self.prefill_done

    @property
    def remaining_blocks(self) -> int:
        return max(self.output_blocks - self.blocks_done, 0)

    def remaining_work(self, costs: StepCosts, rounds: float | None = None) -> float:
        r = max(self.est_rounds if rounds is None else rounds, 0.0)
        if self.full_sequence:
            b = min(self.remaining_blocks, r)
            return b * costs.recompute + (r - b) * costs.cached
        return self.remaining_prefill * costs.prefill + r * costs.denoise

    @property
    def true_remaining(self) -> float:
        return float(self.true_rounds - self.rounds_done) if self.true_rounds is not None else self.est_rounds


@dataclass(frozen=True)
class SlotAssignment:
    req_id: str
    kind: StepKind


@dataclass
class RoundPlan:
    round_id: int
    slots: list[SlotAssignment]
    admitted: list[str] = field(default_factory=list)
    paused: list[str] = field(default_factory=list)

    @property
    def prefill_only(self) -> bool:
        return bool(self.slots) and all(s.kind is StepKind.PREFILL for s in self.slots)


@dataclass
class StepOutcome:
    req_id: str
    kind: StepKind
    committed: int = 0  # tokens unmasked
    block_done: bool = False
    finished: bool = False
    next_kind: StepKind | None = None  # what the request's next step will be
    refined_rounds: float | None = None  # refined estimate of total rounds (after the first round)


@dataclass
class RoundResult:
    outcomes: list[StepOutcome]
    latency_s: float = 0.0
