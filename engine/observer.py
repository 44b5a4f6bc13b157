"""What an instance watches of its rounds beside decoding: the work predictors' hooks.

``Engine.step`` runs schedule -> run -> postprocess and calls its observer through one small interface
(``RoundObserver``): ``step_input`` may extend a step's input before the forward (the lookahead), and
``round_done`` sees every step of the round once the sequences applied their results. The engine holds
one observer per instance (``Engine.observer``); ``PredictorObserver`` is the one it starts with.

``PredictorObserver`` records what the refinement predictor (predictors/) reads of a request's first
denoising round, on the sequence: ``first_hidden`` (the block's pooled final hidden rows),
``first_confidences`` and ``first_eos`` (P(EOS) at the output positions that round's logits predict), then
calls ``refine_hook`` with the requests that reached their refinement point, which sets
``seq.refined_rounds``. A hook that raises is switched off (the admission estimates stand).

Lookahead (block-causal models): a block-causal first round computes only the first block, so its P(EOS)
says nothing about where a longer answer ends. With ``lookahead`` = k > 0, a request whose first block does
not end runs its next round with the next k still-masked blocks of its budget appended (block-causal
attention keeps the real rows blind to them: logits, K/V and hidden rows unchanged; their K/V are dropped),
and is refined after that round with P(EOS) over those blocks too, as a full-sequence model's first round
gives it. Which requests defer is rank 0's choice; a tensor-parallel follower hears it as a ``Lookahead``
command (engine/commands.py) and extends the same inputs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from engine.scheduler.types import StepKind
from engine.sequence import Sequence, StepInput, StepReport

if TYPE_CHECKING:
    from engine.runner import StepOutput

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ObservedStep:
    """One step of a round as the observer sees it, after its sequence applied it."""

    seq: Sequence
    step: StepInput  # what the sequence built
    ran: StepInput  # what the runner ran (``step`` extended by ``step_input``)
    out: StepOutput
    report: StepReport


class RoundObserver(Protocol):
    def step_input(self, seq: Sequence, step: StepInput) -> StepInput:
        """The input the runner runs for ``seq``'s ``step`` (``step`` itself, or extended)."""
        ...

    def round_done(self, steps: list[ObservedStep]) -> None:
        """Every step of the round just applied (prefill steps included)."""
        ...


class PredictorObserver:
    """The work predictors' view of the rounds (module docstring)."""

    def __init__(self, cfg, refine_hook: Callable[[list[Sequence]], None] | None = None,
                 lookahead: int = 0) -> None:
        self.cfg = cfg
        # called once per round with the sequences that just reached their refinement point (their first
        # denoising round, or the lookahead round after it); it sets ``seq.refined_rounds`` (predictors/)
        self.refine_hook = refine_hook
        self.lookahead = lookahead  # masked blocks a deferred request's lookahead round appends (0: off)

    def step_input(self, seq: Sequence, step: StepInput) -> StepInput:
        """``step``, extended by ``seq.lookahead_blocks`` masked blocks after it (within the output) when
        this is the lookahead round of a request (``seq.refine_at`` moved to this round)."""
        if seq.refine_at != seq.rounds + 1 or seq.rounds == 0 or step.kind is StepKind.PREFILL:
            return step
        end = int(step.pos[-1]) + 1
        stop = min(seq.out_end, end + seq.lookahead_blocks * self.cfg.block_size)
        if end >= stop:
            return step
        extra = torch.arange(end, stop, dtype=step.pos.dtype)
        ids = torch.cat([step.ids, torch.full_like(extra, self.cfg.mask_token_id, dtype=step.ids.dtype)])
        return StepInput(step.kind, ids, torch.cat([step.pos, extra]), step.ctx_kv, step.ctx_pos, step.mode,
                         step.slot)

    def round_done(self, steps: list[ObservedStep]) -> None:
        first = []
        for s in steps:
            seq, inp, big, out = s.seq, s.step, s.ran, s.out
            if inp.kind is StepKind.PREFILL:
                continue
            if seq.rounds == 1:  # its first denoising round
                bs, be = seq.blocks[0]
                p0 = int(inp.pos[0])  # step positions are consecutive: the block's rows are a slice
                seq.first_hidden = out.hidden[max(bs - p0, 0) : be - p0].mean(0)
                seq.first_confidences = s.report.confidences
                seq.first_eos = self._eos_probs(seq, big, out)
                first.append(seq)
            elif seq.rounds == seq.refine_at:  # the lookahead round: P(EOS) past what the first round saw
                if big is not inp:
                    seen = seq.out_start + len(seq.first_eos)
                    ahead = self._eos_probs(seq, big, out)
                    skip = seen - max(seq.out_start, int(big.pos[0]) + self.cfg.logits_shift)
                    seq.first_eos = torch.cat([seq.first_eos, ahead[max(skip, 0):]])
                first.append(seq)
        if self.lookahead:
            first = self._defer_for_lookahead(first)
        if first and self.refine_hook is not None:
            try:
                self.refine_hook(first)
            except Exception:  # a broken predictor must not fail the round: fall back to admission estimates
                log.exception("refine hook failed; refinement is off for this engine")
                self.refine_hook = None

    def _defer_for_lookahead(self, first: list[Sequence]) -> list[Sequence]:
        """Of the requests that just ran their first round, those of a block-causal model whose
        first block probably does not end the answer wait one round for the lookahead."""
        fresh = [s for s in first if s.rounds == 1 and s.cfg.attention == "block_causal"]
        if not fresh:
            return first
        ends = torch.stack([s.first_eos[-1] for s in fresh]).tolist()  # one host sync for the round
        later = {id(s) for s, p in zip(fresh, ends)
                 if p < 0.5 and not s.finished and s.out_start + len(s.first_eos) < s.out_end}
        for s in fresh:
            if id(s) in later:
                s.refine_at, s.lookahead_blocks = 2, self.lookahead
        return [s for s in first if id(s) not in later]

    def _eos_probs(self, seq: Sequence, inp: StepInput, out: StepOutput) -> torch.Tensor:
        """P(EOS) at the output positions this step's logits predict (on their device, no sync):
        the first block for a block-causal model (plus the appended blocks in a lookahead round),
        the whole canvas for a full-sequence one."""
        first = int(inp.pos[0]) + self.cfg.logits_shift  # the position row 0 predicts; rows are consecutive
        lo, hi = max(seq.out_start - first, 0), max(min(seq.out_end - first, len(inp.pos)), 0)
        rows = out.logits_rows(lo, hi).float()  # exp(l_eos - logsumexp(l)): no second vocabulary-wide tensor
        return torch.exp(rows[:, self.cfg.eos_token_id] - torch.logsumexp(rows, dim=-1))
