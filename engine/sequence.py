"""One request's decoding state: its canvas, blocks, cache and step history.

The sequence decides *what* its next step is (prefill a prompt block, denoise
its current block, recompute the full sequence or take a cached step); the
scheduler decides *whether* it runs this round. Its decoding rule (engine/decoding/)
sees one ``BlockStep`` of the current block per step (the proposals, the statistics
it needs, its per-block state) and answers a ``Decision`` (commits, edits, done),
which the sequence writes to the canvas; the sequence reports whether a block or
the request is done, publishes only final tokens (``output_ids``) and can hand its
block's state to another engine (``resume_state``).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.commands import MASKED, SAMPLING_EPS, Resume, SamplingParams  # noqa: F401 (SamplingParams: its old home)
from engine.decoding import (
    NEEDS_ALL_ROWS,
    NEEDS_CANVAS,
    NEEDS_CURRENT_PROB,
    NEEDS_ENTROPY,
    BlockStep,
    DecodingRule,
    confidence,
    noise_seeds,
    sample,
)
from engine.kv_cache import ApproxCache, ExactCache
from engine.models.config import ModelConfig
from engine.scheduler.types import StepKind

LOGPROB_FLOOR = 1e-45  # the least probability a logprob reports (about -103.3: never -inf)

class Status(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


@dataclass
class StepInput:
    kind: StepKind
    ids: torch.Tensor  # [T] query tokens (host tensors, as pos and ctx_pos: the runner reads them through NumPy)
    pos: torch.Tensor  # [T] their positions
    ctx_kv: torch.Tensor | tuple[torch.Tensor, ...] | None  # [layers, 2, kv_heads, C, head_dim], or segments of it
    # along C in position order (a dual cache's prefix and suffix)
    ctx_pos: torch.Tensor | None  # [C], ascending, distinct and apart from the query's positions
    mode: str  # attention mode
    slot: int | None = None  # the runner's KV pool slot holding the context, when the cache has one


@dataclass(frozen=True)
class RowStats:
    """What a step's decoding rule needs of its decode rows beyond (confidence, token) (``rule.needs``), asked
    of the runner (``Sequence.decode_stats``), which returns them in ``StepOutput.stats``."""

    entropy: bool = False  # "entropy": each row's entropy (nats)
    current: torch.Tensor | None = None  # host [rows]: the canvas token at each row's position ("current_prob")
    prev: torch.Tensor | None = None  # host [rows]: the canvas token just before each row's position (penalty)
    penalty: float = 0.0  # subtracted from each row's logit of ``prev`` before the proposals (joint_threshold)


@dataclass
class StepReport:
    seq_id: int
    kind: StepKind
    tokens: int  # query tokens computed
    committed: int  # positions unmasked by this step
    block_done: bool
    finished: bool
    threshold: float | None = None
    confidences: torch.Tensor | None = None  # of the masked positions before the step


@dataclass
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    cfg: ModelConfig
    rule: DecodingRule
    gen_len: int
    cache_mode: str  # 'exact' | 'none' | 'prefix' | 'dual'
    max_tokens: int
    threshold: float | None = None
    status: Status = Status.WAITING
    finish_reason: str | None = None
    history: list[StepKind] = field(default_factory=list)
    arrival: float = 0.0
    prompt_text: str = ""  # the prompt as the client sent it (admission features)
    committed: list[int] = field(default_factory=list)  # output tokens committed before (a resumed request)
    # the request's sampling as added (a sampling request's seed drawn if it had none); None or a
    # temperature of 0: greedy. Its max_tokens and threshold are the fields above (the threshold may change).
    params: SamplingParams | None = None
    stop_ids: tuple[int, ...] = ()  # ids besides the model's EOS that end the output (finish_reason 'stop')
    resume: Resume | None = None  # the state of the block after ``committed`` (a request resumed exactly)

    def __post_init__(self) -> None:
        b = self.cfg.block_size
        self.out_start = len(self.prompt_ids)
        if self.cfg.attention == "block_causal":  # blocks are absolute: the canvas ends on a boundary
            self.gen_len = -(-(self.out_start + self.max_tokens) // b) * b - self.out_start
        self.out_end = self.out_start + self.gen_len
        n = len(self.committed)
        if n >= self.max_tokens:
            raise ValueError(f"{n} committed tokens leave nothing to generate within max_tokens={self.max_tokens}")
        if self.cfg.mask_token_id in self.committed:
            raise ValueError("committed tokens must not contain the mask token")
        if self.cfg.mask_token_id in self.stop_ids:
            raise ValueError("stop token ids must not contain the mask token")
        self.sampling = self.params if self.params is not None and self.params.samples else None
        if self.sampling is not None and self.sampling.seed is None:
            raise ValueError("a sampling sequence needs a seed (Engine.add_request draws one)")
        self._stop_extra = tuple(dict.fromkeys(t for t in self.stop_ids if t != self.cfg.eos_token_id))
        self.ignore_eos = self.params is not None and self.params.ignore_eos  # only stop_ids end it then
        self._stops = frozenset((*(() if self.ignore_eos else (self.cfg.eos_token_id,)), *self._stop_extra))
        mask = self.cfg.mask_token_id
        tail = [] if self.resume is None else [mask if t == MASKED else t for t in self.resume.tail]
        if mask in (self.resume.tail if self.resume is not None else ()):
            raise ValueError("resume.tail marks masked positions with -1, not the mask token")
        if n + len(tail) > self.gen_len:
            raise ValueError(f"resume.tail ({len(tail)} tokens) runs past the output ({self.gen_len - n} left)")
        self.tokens = torch.tensor(self.prompt_ids + list(self.committed) + tail
                                   + [mask] * (self.gen_len - n - len(tail)), dtype=torch.long)
        # the same memory as a NumPy array: a step's bookkeeping over a few dozen positions costs a
        # microsecond or two per operation there, against several for a torch operator call
        self._np = self.tokens.numpy()
        # with params.logprobs: each output position's log-probability in the round that committed it (NaN:
        # not committed here, e.g. before a resume)
        self.logprobs = np.full(self.gen_len, np.nan, dtype=np.float32) \
            if self.params is not None and self.params.logprobs else None
        if self.logprobs is not None and self.resume is not None and self.resume.logprobs:
            lp = np.asarray(self.resume.logprobs[: len(tail)], dtype=np.float32)
            self.logprobs[n : n + len(lp)] = np.where(np.asarray(tail[: len(lp)]) == mask, np.nan, lp)
        if self.cfg.attention == "block_causal":
            if self.cfg.logits_shift:
                raise ValueError("block-causal models with shifted logits are not supported")
            first = self.out_start // b
            self.blocks = [(max(k * b, self.out_start), (k + 1) * b) for k in range(first, -(-self.out_end // b))]
            # full blocks of prompt (and of committed output, when resumed) are prefilled;
            # a partial tail joins the first block that still has masks
            self.prefill_blocks = (self.out_start + n) // b
            self.block_idx = self.prefill_blocks - first
        else:
            self.blocks = [(s, min(s + b, self.out_end)) for s in range(self.out_start, self.out_end, b)]
            self.prefill_blocks = 0
            self.block_idx = n // b
        self.prefilled = 0
        self.step_in_block = 0
        self.masked_at_start = self._masked(self.blocks[self.block_idx]).numel()
        if self.resume is not None:
            if self.out_start + n + len(tail) > self.blocks[self.block_idx][1]:
                raise ValueError("resume.tail runs past the current block")
            self.step_in_block, self.masked_at_start = self.resume.step_in_block, self.resume.masked_at_start
        self.pending: tuple[int, int] | None = None  # finished block whose KV is written next step
        self.needs_recompute = True
        self.cache: ExactCache | ApproxCache | None = None
        self.rounds = 0  # decoding steps (everything but prefill)
        self.first_hidden: torch.Tensor | None = None  # pooled rows of the first denoising round's block
        self.first_confidences: torch.Tensor | None = None  # that round's confidences of the masked positions
        self.first_eos: torch.Tensor | None = None  # P(EOS) at the output positions it saw, in order (+ lookahead)
        self.refined_rounds: float | None = None  # set once by the engine's refine hook
        self.refine_at = 1  # the round after which it is refined (2: the engine's lookahead runs first)
        self.lookahead_blocks = 0  # masked blocks that lookahead round appends
        self.last_confidences: torch.Tensor | None = None  # the last step's confidences of masked positions
        self._decode_pos: torch.Tensor | None = None  # the block positions decode_rows named (absolute)
        # the decoding rule (the request's: Engine.rule_for) and what it needs of each step
        self._all_rows = NEEDS_ALL_ROWS in self.rule.needs
        self._wants_canvas = NEEDS_CANVAS in self.rule.needs
        penalty = float(getattr(self.rule, "penalty_lambda", 0.0))
        wants_entropy, wants_current = NEEDS_ENTROPY in self.rule.needs, NEEDS_CURRENT_PROB in self.rule.needs
        self._row_stats = (wants_entropy, wants_current, penalty) if wants_entropy or wants_current or penalty > 0 \
            else None
        self._knob_of: tuple[float | None, float | None] = (None, None)  # (threshold, the rule's knob for it)
        # the rule's state for the current block (JSON values: carried by a resume); edits made so far
        self.rule_state: dict = {} if self.resume is None else dict(self.resume.state)
        self.edits = 0
        self.guard = None  # structured outputs: the grammar's CanvasGuard (engine/constraints; Engine.add_request)
        # the last denoising step's (round, block span, positions committed, their tokens): the canvas view
        self.last_commit: tuple | None = None  # (round, span, committed positions, tokens, edited positions, tokens)

    # ---- what the scheduler needs -------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def remaining_prefill(self) -> int:
        return self.prefill_blocks - self.prefilled

    def next_kind(self) -> StepKind:
        if self.remaining_prefill > 0:
            return StepKind.PREFILL
        if self.cache_mode == "exact":
            return StepKind.DENOISE
        if self.cache_mode == "none" or self.needs_recompute:
            return StepKind.RECOMPUTE
        return StepKind.CACHED

    def kv_capacity(self) -> int:
        return self.out_end

    # ---- building a step ----------------------------------------------------------
    def _masked(self, span: tuple[int, int]) -> torch.Tensor:
        s, e = span
        return torch.from_numpy(np.flatnonzero(self._np[s:e] == self.cfg.mask_token_id) + s)

    def _query(self, start: int, end: int, kind: StepKind, ctx) -> StepInput:
        kv, pos = ctx if ctx is not None else (None, None)
        slot = None if self.cache is None else self.cache.slot
        return StepInput(kind, self.tokens[start:end], torch.arange(start, end), kv, pos, self.cfg.attention, slot)

    def build_step(self) -> StepInput:
        b = self.cfg.block_size
        kind = self.next_kind()
        if kind is StepKind.PREFILL:
            s = self.prefilled * b
            return self._query(s, s + b, kind, self.cache.context())
        bs, be = self.blocks[self.block_idx]
        if kind is StepKind.DENOISE:
            start = self.pending[0] if self.pending else (bs // b) * b
            return self._query(start, be, kind, self.cache.context())
        if kind is StepKind.RECOMPUTE:
            return self._query(0, self.out_end, kind, None)
        start = bs - self.cfg.logits_shift
        return self._query(start, be, kind, self.cache.context(start, be))

    def decode_rows(self, step: StepInput) -> torch.Tensor | None:
        """Rows of ``step``'s logits that predict the current block's positions its rule decides on, in order
        (host tensor): the masked ones, or every output position of the block when the rule needs "all_rows"
        (an editing rule); None for a prefill step. The runner turns these rows into (confidence, token), and
        the statistics ``decode_stats`` asks for, for the whole round at once, so the round waits on the device
        once, not once per request."""
        if step.kind is StepKind.PREFILL:
            return None
        bs, be = self.blocks[self.block_idx]
        self._decode_pos = torch.arange(bs, be) if self._all_rows else self._masked((bs, be))  # apply() reuses it
        return self._decode_pos - (self.cfg.logits_shift + int(step.pos[0]))

    def decode_sampling(self) -> tuple[SamplingParams, torch.Tensor] | None:
        """After ``decode_rows`` named rows: (sampling params, the absolute positions those rows predict,
        host) when this request samples its tokens, else None (greedy). The runner seeds each row's noise
        with (params.seed, position)."""
        if self.sampling is None or self._decode_pos is None:
            return None
        return self.sampling, self._decode_pos

    def decode_stats(self) -> RowStats | None:
        """After ``decode_rows``: what this request's rule needs of those rows beyond (confidence, token)
        (``rule.needs``: "entropy", "current_prob"; joint_threshold's repetition penalty), else None."""
        if self._row_stats is None or self._decode_pos is None:
            return None
        entropy, current, penalty = self._row_stats
        pos = self._decode_pos.numpy()
        return RowStats(entropy, torch.from_numpy(self._np[pos].copy()) if current else None,
                        torch.from_numpy(self._np[pos - 1].copy()) if penalty > 0 else None, penalty)

    def decode_allowed(self) -> tuple[int, torch.Tensor] | None:
        """After ``decode_rows``: with a constraint, (the index among those rows of the grammar's frontier,
        the bool [vocab] mask of the tokens it may hold) for the runner to mask that row's logits with, else
        None (engine/constraints/canvas.py)."""
        if self.guard is None or self._decode_pos is None:
            return None
        from engine.constraints.canvas import frontier_row

        i = frontier_row(self.guard, self._decode_pos.numpy(), self.out_start)
        return None if i is None else (i, torch.from_numpy(self.guard.allowed()))

    def _guarded(self, span: tuple[int, int], masked: np.ndarray, tokens: np.ndarray, dec, conf: np.ndarray):
        """The rule's decision checked by the grammar (engine/constraints/canvas.py ``guard_block``): the
        decision that stands (tokens the grammar forces written into ``tokens`` and committed) and the block
        positions remasked (bool, block-relative; already masked on the canvas)."""
        from engine.constraints.canvas import guard_block

        dec, remask = guard_block(self.guard, self._np, self.out_start, span, masked, tokens, dec, conf)
        if remask.any() and self.logprobs is not None:
            self.logprobs[np.flatnonzero(remask) + span[0] - self.out_start] = np.nan
        return dec, remask

    # ---- applying its result --------------------------------------------------------
    def apply(self, step: StepInput, logits: torch.Tensor | None, fresh: torch.Tensor,
              top1: tuple[torch.Tensor, torch.Tensor] | None = None,
              stats: dict[str, torch.Tensor] | None = None) -> StepReport:
        """logits [T, V] and fresh K/V [layers, 2, kv_heads, T, head_dim] of ``step``. ``top1``: the
        (confidence, token) of the rows ``decode_rows(step)`` named, already on the host, with ``stats`` the
        statistics ``decode_stats`` asked for; without it they are computed here from ``logits`` (which may be
        None when ``top1`` is given). The rule decides on a ``BlockStep`` of the current block; its
        ``Decision``'s commits and edits are written to the canvas."""
        self.history.append(step.kind)
        q_start = int(step.pos[0])
        if step.kind is StepKind.PREFILL:
            self.cache.append(fresh, q_start)
            self.prefilled += 1
            return StepReport(self.seq_id, step.kind, len(step.ids), 0, False, False)
        self.rounds += 1
        if step.kind is StepKind.DENOISE and self.pending:
            ps, pe = self.pending
            self.cache.append(fresh[:, :, :, : pe - ps], ps)
            self.pending = None
        if step.kind is StepKind.RECOMPUTE and self.cache_mode in ("prefix", "dual"):
            self.cache.refresh(fresh)
            self.needs_recompute = False
        span = self.blocks[self.block_idx]
        if top1 is None:
            self.decode_rows(step)
            top1, stats = self._top1_from(logits, q_start)
        return self._decide(span, top1, stats, len(step.ids), step.kind)

    def _top1_from(self, logits: torch.Tensor, q_start: int) -> tuple[tuple[torch.Tensor, torch.Tensor], dict]:
        """(confidence, token) and the rule's statistics of the decoded rows, from a step's logits (what the
        runner computes for a round, here for one step)."""
        from engine.decoding import entropy, penalise_previous, token_prob

        rows = logits[self._decode_pos - self.cfg.logits_shift - q_start]
        asked = self.decode_stats()
        if asked is not None and asked.penalty > 0:
            rows = penalise_previous(rows, asked.prev, asked.penalty)
        front = self.decode_allowed()  # structured outputs: the grammar's frontier row
        if front is not None:
            rows = rows.clone()
            rows[front[0]] = rows[front[0]].masked_fill(~front[1].to(rows.device), float("-inf"))
        sp = self.sampling
        top1 = (confidence(rows, self.cfg.mask_token_id) if sp is None else
                sample(rows, sp.temperature, sp.top_k, sp.top_p, noise_seeds(sp.seed, self._decode_pos),
                       self.cfg.mask_token_id))
        stats = {}
        if asked is not None and asked.entropy:
            stats["entropy"] = entropy(rows, self.cfg.mask_token_id)
        if asked is not None and asked.current is not None:
            stats["current_prob"] = token_prob(rows, asked.current, self.cfg.mask_token_id)
        return top1, stats

    def _knob(self) -> float | None:
        """The rule's knob for this step: the request's threshold (the router's level) through ``knob_at``."""
        if self.threshold is None:
            return None
        if self._knob_of[0] != self.threshold:
            self._knob_of = (self.threshold, self.rule.knob_at(self.threshold))
        return self._knob_of[1]

    def _decide(self, span: tuple[int, int], top1, stats: dict | None, n_query: int, kind: StepKind) -> StepReport:
        bs, be = span
        conf_t, tok_t = top1
        canvas = self._np[bs:be]
        masked = canvas == self.cfg.mask_token_id
        idx = self._decode_pos.numpy() - bs
        n = be - bs
        tokens = np.full(n, -1, dtype=np.int64)
        conf = np.zeros(n, dtype=np.float32)
        tokens[idx] = tok_t.numpy()
        conf[idx] = conf_t.float().numpy()
        extra = {}
        for name, v in (stats or {}).items():
            full = np.zeros(n, dtype=np.float32)
            full[idx] = v.float().numpy()
            extra[name] = full
        rule = self.rule
        bstep = BlockStep(masked, ~masked, tokens, conf, extra.get("current_prob"), extra.get("entropy"),
                          self.step_in_block, self.masked_at_start, self._knob(), self.rule_state,
                          canvas.copy() if self._wants_canvas else None)
        dec = rule.decide(bstep)
        if self.guard is not None:  # structured outputs: the grammar checks the decision (engine/constraints)
            dec, remask = self._guarded(span, masked, tokens, dec, conf)
            masked = masked | remask
        commit, edit = dec.commit, dec.edit
        if (commit & ~masked).any() or (edit & (masked | commit)).any() or (edit.any() and not rule.edits):
            raise ValueError(f"decoding rule {rule.name!r} committed a position that was not masked or edited one "
                             "it may not")
        left = masked & ~commit
        if rule.edits:
            block_done = bool(dec.done)
            if block_done and left.any():
                raise ValueError(f"decoding rule {rule.name!r} ended a block with positions still masked")
        else:
            block_done = not left.any()
        write = np.flatnonzero(commit | edit)
        positions, written = write + bs, tokens[write]
        self._np[positions] = written
        if self.logprobs is not None:  # the written tokens' probabilities in this round's distribution
            self.logprobs[positions - self.out_start] = np.log(np.maximum(conf[write], LOGPROB_FLOOR))
        self.last_confidences = conf_t if not self._all_rows else conf_t[torch.from_numpy(masked[idx])]
        chosen = np.flatnonzero(commit)
        edited = np.flatnonzero(edit)
        self.edits += len(edited)
        self.last_commit = (self.rounds, span, chosen + bs, tokens[chosen], edited + bs, tokens[edited])
        self.step_in_block += 1
        committed = len(chosen)
        finished = self._check_finished() if block_done or not rule.edits else False
        if block_done and not finished:
            self._next_block(span)
        return StepReport(self.seq_id, kind, n_query, committed, block_done, finished, self.threshold,
                          self.last_confidences)

    def _next_block(self, span: tuple[int, int]) -> None:
        b = self.cfg.block_size
        if self.cache_mode == "exact":
            self.pending = ((span[0] // b) * b, span[1])
        else:
            self.needs_recompute = True
        self.block_idx += 1
        self.step_in_block = 0
        self.rule_state = {}  # the rule's state is per block
        if self.block_idx < len(self.blocks):
            self.masked_at_start = self._masked(self.blocks[self.block_idx]).numel()

    def _check_finished(self) -> bool:
        out = self._np[self.out_start : self.out_end]
        is_mask = out == self.cfg.mask_token_id
        stop = out == self.cfg.eos_token_id if not self.ignore_eos else np.zeros(out.shape, dtype=bool)
        for t in self._stop_extra:  # a few ids at most: a comparison each (np.isin sorts)
            stop |= out == t
        eos = np.flatnonzero(stop)
        if eos.size and not is_mask[: eos[0]].any():
            self._finish("stop", int(eos[0]))
        elif not is_mask[: self.max_tokens].any():
            self._finish("length", self.max_tokens)
        return self.finished

    def _finish(self, reason: str, n_out: int) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.n_out = min(n_out, self.max_tokens)
        self.cache = None  # release KV

    # ---- results --------------------------------------------------------------------
    def output_logprobs(self, n: int) -> list[float] | None:
        """The log-probabilities of the first ``n`` output tokens (None unless asked for: ``params.logprobs``)."""
        return None if self.logprobs is None else [float(v) for v in self.logprobs[:n]]

    def final_end(self) -> int:
        """The output positions (from 0) that no later step may change: all of them once finished; with an
        editing rule, those before the current block (whose edits are not over); else all (a committed token
        never changes)."""
        if self.finished or not self.rule.edits or self.block_idx >= len(self.blocks):
            return self.max_tokens
        return min(self.blocks[self.block_idx][0] - self.out_start, self.max_tokens)

    def output_ids(self) -> list[int]:
        """Committed output tokens so far that are final (up to the first mask, EOS or other stop id; with an
        editing rule, not into a block still editing: ``final_end``)."""
        out = self.tokens[self.out_start : self.out_start + self.final_end()].tolist()
        if self.finished:
            return out[: self.n_out]
        keep = []
        stops = self._stops
        for t in out:
            if t == self.cfg.mask_token_id or t in stops:
                break
            keep.append(t)
        return keep

    def canvas(self) -> list[int]:
        return self.tokens[self.out_start : self.out_end].tolist()

    def resume_state(self, sent: int) -> Resume | None:
        """Where the current block stands after the first ``sent`` output tokens (those its receiver has: at
        most ``output_ids()``), for a resume elsewhere to continue exactly (engine/commands.py); None once
        finished."""
        if self.finished or self.block_idx >= len(self.blocks):
            return None
        start, end = self.out_start + sent, self.blocks[self.block_idx][1]
        if not self.blocks[self.block_idx][0] <= start <= end:
            raise ValueError(f"{sent} output tokens do not end in the current block")
        tail = self._np[start:end]
        mask = tail == self.cfg.mask_token_id
        lp = [] if self.logprobs is None else np.where(mask, 0.0, np.nan_to_num(
            self.logprobs[start - self.out_start : end - self.out_start])).tolist()
        return Resume(np.where(mask, MASKED, tail).tolist(), self.step_in_block, self.masked_at_start,
                      json.loads(json.dumps(self.rule_state)), lp)

    def canvas_step(self) -> dict | None:
        """The last denoising step on the canvas (output-relative positions): its round, the block it
        worked on, the positions it committed with their token ids, the block's positions still masked,
        the threshold it used and the canvas length; with an editing rule, the positions it rewrote
        (``edited``) and the rule's name. None before the first denoising step."""
        if self.last_commit is None:
            return None
        rounds, (bs, be), positions, tokens, edited, edit_tokens = self.last_commit
        s = self.out_start
        masked = np.flatnonzero(self._np[bs:be] == self.cfg.mask_token_id) + (bs - s)
        view = {"step": rounds, "block": [bs - s, be - s],
                "committed": [[int(p) - s, int(t)] for p, t in zip(positions, tokens)],
                "masked": masked.tolist(), "threshold": self.threshold, "length": self.gen_len}
        if self.rule.edits:  # an editing rule's rewrites of committed positions, and the rule
            view["edited"] = [[int(p) - s, int(t)] for p, t in zip(edited, edit_tokens)]
            view["decoding"] = self.rule.name
        return view
