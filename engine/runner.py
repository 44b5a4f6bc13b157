"""The torch runner: executes one round's steps as padded batched forwards.

Steps of very different lengths (a full-sequence recompute beside 8-token
blocks) are grouped by length so that little of each forward is padding.

On a GPU a round waits on the device once, at its end: inputs are built on the
host and copied asynchronously; each request's context (one cache view, or two
for a dual cache) is copied once into the forward's [context | query] buffer,
left uninitialised but for the context padding, and the forward writes its
fresh K/V straight into it (no concatenation per layer, and the step outputs
are views of it); the mask is turned into an additive bias in the
model's dtype once per forward, or dropped when nothing is masked (so SDPA may
use its flash kernel); the LM head runs only on the rows whose logits are used
(prompt rows, committed rows and padding never need them); and the
(confidence, token) of the rows each request decodes are gathered for the
whole round and copied back in one transfer (greedy rows: the argmax, batched
over the forward; the rows of requests that sample are drawn apart, only in
forwards that have some: ``decoding.sample``).
On CUDA the q/k/v and gate/up projections are fused into single products, and
the engine has small forwards over the KV pool replayed from CUDA graphs
(``graphs``, engine/graphs.py, handed to the runner by the engine).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.batch import Batch, Replayer, run_model
from engine.decoding import confidence, entropy, noise_seeds, penalise_previous, sample, token_prob
from engine.kv_cache import KVPool
from engine.memory import forward_bytes, kv_bytes_per_token
from engine.models.flops import forward_flops, linear_weights
from engine.models.fused import choose as choose_elementwise
from engine.models.layouts import emulating
from engine.models.masks import allowed, attends_all
from engine.models.transformer import DLMTransformer, Slots
from engine.sequence import RowStats, SamplingParams, StepInput

BALANCE = {"cuda": 150.0, "cpu": 10.0}  # FLOPs per byte of memory traffic (see TorchRunner.fill_pays)


@dataclass
class StepOutput:
    """One step's results. Logits are computed on demand from the final hidden rows (``logits`` for
    all rows, ``logits_rows`` for a slice): a round needs them only for the rows it decodes (``top1``)
    and, in a request's first round, the rows whose P(EOS) the predictors read."""

    hidden: torch.Tensor  # [T, hidden]: final-layer hidden rows (after the final norm)
    fresh: torch.Tensor  # [layers, 2, kv_heads, T, head_dim]
    head: Callable[[torch.Tensor], torch.Tensor]  # the LM head (counts its FLOPs)
    top1: tuple[torch.Tensor, torch.Tensor] | None = None  # host (confidence, token) of the requested rows
    # host statistics of the requested rows its decoding rule asked for (``RowStats``): "entropy", "current_prob"
    stats: dict[str, torch.Tensor] | None = None
    _logits: torch.Tensor | None = None

    @property
    def logits(self) -> torch.Tensor:  # [T, V]
        if self._logits is None:
            self._logits = self.head(self.hidden)
        return self._logits

    def logits_rows(self, lo: int, hi: int) -> torch.Tensor:
        return self._logits[lo:hi] if self._logits is not None else self.head(self.hidden[lo:hi])


def _context_free(step: StepInput) -> bool:
    """Whether ``step`` attends to no context: its keys are its own queries."""
    return step.ctx_pos is None or step.ctx_pos.shape[0] == 0


def group_by_length(inputs: list[StepInput]) -> list[list[int]]:
    """Indices of ``inputs`` grouped so each group's lengths are within 2x."""
    order = sorted(range(len(inputs)), key=lambda i: len(inputs[i].ids))
    groups: list[list[int]] = []
    for i in order:
        if groups and len(inputs[i].ids) <= 2 * len(inputs[groups[-1][0]].ids):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


class TorchRunner:
    def __init__(self, model: DLMTransformer, device: str | torch.device = "cpu", fuse: bool | None = None) -> None:
        self.model = model
        self.cfg = model.config
        self.device = torch.device(device)
        if fuse if fuse is not None else self.device.type == "cuda" or emulating():  # CUDA's paths where emulated
            model.fuse_projections()
            model.use_elementwise(choose_elementwise(self.device))  # fused kernels where they pay (CUDA)
        self.pool: KVPool | None = None  # set by the engine: caches take slots of it, forwards attend in place
        # replays the small forwards over the pool it takes: on CUDA the engine's ForwardGraphs over this runner's
        # model (engine/graphs.py), set with the pool; None: every forward runs eagerly
        self.graphs: Replayer | None = None
        # device bytes a forward may hold beyond the weights and the pool; a larger one is cut into several
        # (``_fit``): set by the engine (engine/memory.py); None: no bound
        self.transient_budget: int | None = None
        self.split_forwards = 0  # forwards added by cutting a forward to its transient budget
        # steps with no context whose slots are not consecutive write their K/V into their slots in place
        # (``_prepare_in_slots``); off: such a forward has a K/V buffer of its own, which their caches copy (the
        # path before; `remask bench round --recompute` times both)
        self.in_slots = True
        # FLOPs per byte of memory traffic at which filler rows are worth computing instead of copying
        # contexts (fill_pays): about the H200's bf16 peak over its bandwidth; a CPU core's is far lower
        self.balance = BALANCE.get(self.device.type, BALANCE["cpu"])
        self.forwards = 0
        self.pooled = 0  # forwards that attended to the KV pool in place (no context copied)
        self.flops = 0  # counted FLOPs of every forward so far, padding included (engine/models/flops.py)

    @property
    def dtype(self) -> torch.dtype:
        # the embedding's: the first parameter, read directly (next(parameters()) walks the module tree: ~7 us)
        return self.model.embed_tokens.weight.dtype

    @torch.inference_mode()
    def run(self, inputs: list[StepInput], rows: list[torch.Tensor | None] | None = None,
            sampling: list[tuple[SamplingParams, torch.Tensor] | None] | None = None,
            stats: list[RowStats | None] | None = None,
            allowed: list[tuple[int, torch.Tensor] | None] | None = None) -> list[StepOutput]:
        """Forward every step. ``rows``: per step, the host indices of the logits rows whose
        (confidence, token) the caller needs (None: none); they come back in ``StepOutput.top1``.
        ``sampling``: per step, None (greedy: the argmax) or (params, positions): its tokens are sampled
        with ``params`` (temperature > 0), row i's noise seeded by (params.seed, positions[i]), the
        absolute position it predicts (``Sequence.decode_sampling``); None: every step is greedy.
        ``stats``: per step, what its decoding rule needs of its rows beyond (confidence, token)
        (``Sequence.decode_stats``: entropy, the canvas token's probability, a repetition penalty applied
        first); they come back in ``StepOutput.stats``, fetched with the rest in the round's one transfer.
        ``allowed``: per step, None or (row, bool [vocab]): that row (an index into the step's ``rows``) may
        only hold the allowed tokens (a structured output's grammar frontier, ``Sequence.decode_allowed``):
        its other logits are -inf before its (confidence, token) and statistics are taken."""
        outputs: list[StepOutput | None] = [None] * len(inputs)
        picked: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (step, conf, token) on the device
        for whole in self._groups(inputs):
            whole.sort(key=lambda i: -1 if inputs[i].slot is None else inputs[i].slot)  # pool slots in order
            for group in self._fit(inputs, whole, rows):
                hidden, outs, row_of = self._launch([inputs[i] for i in group])
                for i, out in zip(group, outs):
                    outputs[i] = out
                if rows is not None:
                    picked += self._top1(hidden, [rows[i] for i in group], group, row_of,
                                         None if sampling is None else [sampling[i] for i in group],
                                         None if stats is None else [stats[i] for i in group],
                                         None if allowed is None else [allowed[i] for i in group])
        if picked:
            self._fetch(outputs, picked)
        return outputs  # type: ignore[return-value]

    def _packable(self, s: StepInput) -> bool:
        """Whether ``s`` may be packed with other steps into one row (``_prepare_packed``): no context, its own
        pool slot, consecutive positions within it, and every one of its queries sees every one of its keys."""
        if self.pool is None or not self.in_slots or s.slot is None or not _context_free(s):
            return False
        p = s.pos.numpy()
        q_lo, t = int(p[0]), len(p)
        return int(p[-1]) == q_lo + t - 1 and q_lo + t <= self.pool.capacity and attends_all(
            s.mode, q_lo, q_lo + t, self.cfg.block_size)

    def _groups(self, inputs: list[StepInput]) -> list[list[int]]:
        """The round's forwards before ``_fit``: steps grouped by length (``group_by_length``), except that the
        steps that can be packed (``_packable``: a full-sequence recompute over the pool) all go in one forward
        whatever their lengths, when they differ: packed, no row is padded."""
        packed = [i for i, s in enumerate(inputs) if self._packable(s)]
        if len(packed) < 2 or len({len(inputs[i].ids) for i in packed}) == 1:
            return group_by_length(inputs)
        rest = [i for i in range(len(inputs)) if i not in set(packed)]
        return [packed] + [[rest[j] for j in g] for g in group_by_length([inputs[i] for i in rest])]

    def _fit(self, inputs: list[StepInput], group: list[int], rows) -> list[list[int]]:
        """``group`` (one forward's steps, in slot order) cut into consecutive forwards whose transient memory
        (engine/memory.py: the rows it computes, the slots between the steps' own when it attends to the pool,
        in place or with its own K/V buffer) stays within ``transient_budget``; a forward takes one step at
        least. Each row attends only to its own keys, so the cut changes no result. One pass over the steps."""
        budget = self.transient_budget
        if budget is None or len(group) == 1:
            return [group]
        pooled = self.pool is not None and all(inputs[i].slot is not None for i in group)
        # steps with no context need no filler rows between their slots (``_prepare_in_slots``)
        spans_slots = pooled and not all(_context_free(inputs[i]) for i in group)
        if len({len(inputs[i].ids) for i in group}) > 1 and all(self._packable(inputs[i]) for i in group):
            return self._fit_packed(inputs, group, rows, budget)
        itemsize, scores = self.dtype.itemsize, self.device.type != "cuda"
        out: list[list[int]] = []
        chunk: list[int] = []
        t = c = decoded = 0
        for i in group:
            s = inputs[i]
            t2, c2 = max(t, len(s.ids)), max(c, 0 if s.ctx_pos is None else len(s.ctx_pos))
            d2 = decoded + (0 if rows is None or rows[i] is None else len(rows[i]))
            n = s.slot - inputs[chunk[0]].slot + 1 if spans_slots and chunk else len(chunk) + 1
            if chunk and forward_bytes(self.cfg, itemsize, n, t2, c2, d2, copied=not pooled, scores=scores) > budget:
                out.append(chunk)
                chunk, t2, c2 = [], len(s.ids), 0 if s.ctx_pos is None else len(s.ctx_pos)
                d2 = 0 if rows is None or rows[i] is None else len(rows[i])
            chunk.append(i)
            t, c, decoded = t2, c2, d2
        out.append(chunk)
        self.split_forwards += len(out) - 1
        return out

    def _fit_packed(self, inputs: list[StepInput], group: list[int], rows, budget: int) -> list[list[int]]:
        """``_fit`` for packed steps: their tokens one after another in one row (no padding), each attending to
        its own (a CPU's kernel materialising each step's scores apart)."""
        itemsize, scores = self.dtype.itemsize, self.device.type != "cuda"
        out: list[list[int]] = []
        chunk: list[int] = []
        tokens = pairs = decoded = 0
        for i in group:
            t = len(inputs[i].ids)
            d = 0 if rows is None or rows[i] is None else len(rows[i])
            size = forward_bytes(self.cfg, itemsize, 1, tokens + t, 0, decoded + d, copied=False)
            size += 2 * self.cfg.num_heads * (pairs + t * t) * max(itemsize, 4) if scores else 0
            if chunk and size > budget:
                out.append(chunk)
                chunk, tokens, pairs, decoded = [], 0, 0, 0
            chunk.append(i)
            tokens, pairs, decoded = tokens + t, pairs + t * t, decoded + d
        out.append(chunk)
        self.split_forwards += len(out) - 1
        return out

    def _top1(self, hidden: torch.Tensor, rows: list[torch.Tensor | None], ids: list[int],
              row_of: list[int], sampling: list[tuple[SamplingParams, torch.Tensor] | None] | None = None,
              stats: list[RowStats | None] | None = None,
              allowed: list[tuple[int, torch.Tensor] | None] | None = None) -> list[tuple]:
        """(confidence, token) of the requested rows of one forward (``hidden`` [R, T, H]; ``rows[k]``: step
        k's rows, or None), computed together: one index copy to the device, one LM head. Tagged ``ids``.
        ``row_of[k]``: where step k's first row lies in ``hidden``'s rows
        flattened to [R x T, H] (``_launch``). ``sampling[k]``: step k's (params, positions) when it samples
        (see ``run``); its rows' argmax is replaced by a sample (``_sample``). ``stats[k]``: what step k's
        rule needs besides (``_row_stats``). Each entry: (id, conf, token, stats dict or None)."""
        want = [(k, r) for k, r in enumerate(rows) if r is not None]
        if not want:
            return []
        flat = torch.cat([r + row_of[k] for k, r in want])  # rows of hidden flattened to [R * T, H]
        sel = hidden.reshape(-1, hidden.shape[-1])[self._to_device(flat)]
        logits = self.head(sel)
        counts = [len(r) for _, r in want]
        asked = None if stats is None else [stats[k] for k, _ in want]
        if asked is not None and any(a is not None and a.penalty > 0 for a in asked):
            logits = self._penalise(logits, asked, counts)
        if allowed is not None:  # grammar frontiers: the rows' disallowed tokens out
            at = 0
            for (k, _), n in zip(want, counts):
                if allowed[k] is not None:
                    row, mask = allowed[k]
                    logits[at + row].masked_fill_(~self._to_device(mask), float("-inf"))
                at += n
        conf, tok = confidence(logits, self.cfg.mask_token_id, overwrite=True)
        out = [(ids[k], c, t, None) for (k, _), c, t in zip(want, conf.split(counts), tok.split(counts))]
        if sampling is not None:
            samp = [s if (s := sampling[k]) is not None and s[0].samples else None for k, _ in want]
            if any(s is not None for s in samp):
                self._sample(logits, out, samp, counts)
        if asked is not None and any(a is not None for a in asked):
            self._row_stats(logits, out, asked, counts)
        return out

    def _penalise(self, logits: torch.Tensor, asked: list[RowStats | None], counts: list[int]) -> torch.Tensor:
        """``logits`` with each asking step's repetition penalty applied to its rows (``penalise_previous``:
        the canvas token just before each row's position loses ``penalty``), before any proposal is made."""
        parts = list(logits.split(counts))
        for j, a in enumerate(asked):
            if a is not None and a.penalty > 0 and a.prev is not None:
                parts[j] = penalise_previous(parts[j], self._to_device(a.prev), a.penalty)
        return torch.cat(parts)

    def _row_stats(self, logits: torch.Tensor, out: list[tuple], asked: list[RowStats | None],
                   counts: list[int]) -> None:
        """Add, in ``out``, each asking step's statistics of its rows of ``logits`` (the mask column already
        -inf: the distribution ``confidence`` reads): "entropy" (nats) and "current_prob" (the probability of
        the token now on the canvas at each row's position)."""
        for j, (a, part) in enumerate(zip(asked, logits.split(counts))):
            if a is None:
                continue
            got = {}
            if a.entropy:
                got["entropy"] = entropy(part)
            if a.current is not None:
                got["current_prob"] = token_prob(part, self._to_device(a.current))
            out[j] = (*out[j][:3], got or None)

    def _sample(self, logits: torch.Tensor, out: list[tuple[int, torch.Tensor, torch.Tensor]],
                sampling: list[tuple[SamplingParams, torch.Tensor] | None], counts: list[int]) -> None:
        """Replace, in ``out``, the (confidence, token) of each step that samples by a sample from its rows
        of ``logits`` (the mask column already -inf), all of the forward's sampled rows drawn together."""
        offsets = np.cumsum([0, *counts])
        which = [j for j, s in enumerate(sampling) if s is not None]
        sizes = [counts[j] for j in which]
        if len(which) == len(sampling):
            picked = logits
        else:  # the sampled steps' rows, gathered
            idx = np.concatenate([np.arange(offsets[j], offsets[j + 1]) for j in which])
            picked = logits[self._to_device(torch.from_numpy(idx))]
        temperature, top_k, top_p, seeds = [], [], [], []
        for j, n in zip(which, sizes):
            params, positions = sampling[j]
            temperature += [params.temperature] * n
            top_k += [params.top_k] * n
            top_p += [params.top_p] * n
            seeds += noise_seeds(params.seed, positions)
        conf, tok = sample(picked, torch.tensor(temperature), torch.tensor(top_k), torch.tensor(top_p), seeds)
        for j, c, t in zip(which, conf.split(sizes), tok.split(sizes)):
            out[j] = (out[j][0], c, t, out[j][3])

    def _fetch(self, outputs: list[StepOutput], picked) -> None:
        """One device-to-host copy for every step's (confidence, token) and the statistics its rule asked for
        (floats together, tokens apart): the round's only wait."""
        floats = [c for _, c, _, _ in picked]
        for _, _, _, got in picked:
            if got is not None:
                floats += [v.float() for v in got.values()]
        values = torch.cat(floats).cpu()
        tok = torch.cat([t for _, _, t, _ in picked]).cpu()
        n = len(picked)
        parts = values.split([len(f) for f in floats])
        conf, extra = parts[:n], iter(parts[n:])
        for (i, _, _, got), c, t in zip(picked, conf, tok.split([len(c) for c in conf])):
            outputs[i].top1 = (c, t)
            if got is not None:
                outputs[i].stats = {name: next(extra) for name in got}

    @torch.inference_mode()
    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head over some final hidden rows [..., H] -> logits [..., V]."""
        self.flops += 2 * (hidden.numel() // self.cfg.hidden_size) * self.cfg.hidden_size * self.cfg.vocab_size
        return self.model.lm_head(hidden)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _mask(self, mode: str, pos, lengths, ctx_pos, ctx_lengths) -> torch.Tensor:
        """Bool [N, 1, T, C + T] over the padded batch, built for every step at once: a query may attend a
        key its attention mode allows, among the step's real context and query tokens; padding rows
        attend only to themselves, so no row is empty."""
        n, t_max = pos.shape
        c_max = ctx_pos.shape[1]
        q_valid = torch.arange(t_max)[None] < lengths[:, None]
        k_valid = torch.cat((torch.arange(c_max)[None] < ctx_lengths[:, None], q_valid), 1)
        mask = allowed(mode, pos, torch.cat((ctx_pos, pos), 1), self.cfg.block_size)
        mask = mask & q_valid[:, :, None] & k_valid[:, None, :]
        mask[:, :, c_max:] |= torch.eye(t_max, dtype=torch.bool)[None] & ~q_valid[:, :, None]
        return mask[:, None]

    def launch(self, inputs: list[StepInput]) -> list[StepOutput]:
        """One padded forward over ``inputs`` (queued on the device; nothing here waits for it)."""
        return self._launch(inputs)[1]

    @torch.inference_mode()
    def _launch(self, inputs: list[StepInput]) -> tuple[torch.Tensor, list[StepOutput], list[int]]:
        """(hidden [R, T, H], the steps' outputs, each step's row of the batch)."""
        batch = self.prepare(inputs)
        hidden = self.graphs.forward(batch) if self.graphs is not None and self.graphs.takes(batch) else None
        if hidden is None:
            hidden = self.forward(batch)
        self.forwards += 1
        self.pooled += batch.write is not None or batch.in_slots is not None
        rows = batch.ids.shape[0]  # filler rows included: they are computed too
        segments = None if batch.in_slots is None else batch.in_slots.segments
        if segments is None:
            self.flops += forward_flops(self.cfg, rows, batch.t_max, batch.c_max, lm_rows=0)  # head: where it runs
        else:  # packed: each step attends to its own tokens
            self.flops += sum(forward_flops(self.cfg, 1, m, 0, lm_rows=0) for _, m in segments)
        buf = batch.buf
        kv_rows = batch.row_of if batch.kv_rows is None else batch.kv_rows
        h_off = [0] * len(inputs) if batch.h_off is None else batch.h_off
        t = hidden.shape[1]
        return hidden, [StepOutput(hidden[r, h : h + len(s.ids)], buf[:, :, b, :, o : o + len(s.ids)], self.head)
                        for s, r, b, o, h in zip(inputs, batch.row_of, kv_rows, batch.q_off, h_off)], \
            [r * t + h for r, h in zip(batch.row_of, h_off)]

    def forward(self, batch: Batch) -> torch.Tensor:
        """The model over a prepared batch, eagerly (``engine.batch.run_model``)."""
        return run_model(self.model, batch)

    def prepare(self, inputs: list[StepInput]) -> Batch:
        """Host-side batching of ``inputs`` and its asynchronous copies to the device."""
        lens = [s.ids.shape[0] for s in inputs]
        t_max = max(lens)
        modes = {s.mode for s in inputs}
        if len(modes) != 1:
            raise ValueError(f"one forward takes one attention mode, got {sorted(modes)}")
        mode = modes.pop()
        if len(set(lens)) > 1 and all(self._packable(s) for s in inputs):
            return self._prepare_packed(inputs, lens)
        plan = self._pool_plan(inputs, lens, t_max)
        if plan is not None:
            return self._prepare_pooled(inputs, lens, t_max, mode, *plan)
        starts = self._in_slots_plan(inputs, lens) if self.in_slots else None
        if starts is not None:
            return self._prepare_in_slots(inputs, lens, t_max, mode, starts)
        ids, pos, q_valid = self._query_rows(inputs, lens, t_max, list(range(len(inputs))), len(inputs))
        return self._prepare_copied(inputs, ids, pos, lens, mode, q_valid is not None)

    def _query_rows(self, inputs, lens, t_max, rows, n):
        """(ids, positions [n, t_max], valid [n, t_max] or None): step k's query in row ``rows[k]``, padding
        (pad token at position 0) elsewhere; valid is None when every row is a whole step, in order."""
        if n == len(inputs) and min(lens) == t_max and rows == list(range(n)):  # stacked, no per-row copies
            return torch.stack([s.ids for s in inputs]), torch.stack([s.pos for s in inputs]), None
        # filled through NumPy views of the host tensors: a slice assignment costs well under a microsecond
        # there, several through torch's indexing (16 steps: about 60-130 us against 250-430 us)
        ids = np.full((n, t_max), self.cfg.pad_token_id, dtype=np.int64)
        pos = np.zeros((n, t_max), dtype=np.int64)
        valid = np.zeros((n, t_max), dtype=bool)
        for s, t, r in zip(inputs, lens, rows):
            ids[r, :t], pos[r, :t] = s.ids.numpy(), s.pos.numpy()
            valid[r, :t] = True
        return torch.from_numpy(ids), torch.from_numpy(pos), torch.from_numpy(valid)

    def _pool_plan(self, inputs: list[StepInput], lens: list[int],
                   t_max: int) -> tuple[int, int, list[int], list[int]] | None:
        """(first slot, last slot + 1, each step's query start and key end) when the forward can attend to
        the KV pool in place: every step holds a slot and its keys are exactly its slot's positions
        [0, end) (its context, then or around its query, which sits at its own positions); the slots
        between the steps' that no step holds become filler rows, when computing them costs less than
        copying the contexts would (``fill_pays``). Otherwise None."""
        pool = self.pool
        if pool is None or any(s.slot is None for s in inputs):
            return None
        starts, ends, ctx = [], [], 0
        for s, t in zip(inputs, lens):  # host positions read through NumPy (torch's scalar reads cost more)
            p = s.pos.numpy()
            q_lo = int(p[0])
            if int(p[-1]) != q_lo + t - 1:  # the query's positions are not consecutive
                return None
            c = 0 if s.ctx_pos is None else s.ctx_pos.shape[0]
            end = max(q_lo + t, int(s.ctx_pos.numpy()[-1]) + 1 if c else 0)
            if c + t != end or end > pool.capacity:  # context and query do not tile [0, end)
                return None
            starts.append(q_lo)
            ends.append(end)
            ctx += c
        slots = [s.slot for s in inputs]
        lo, hi = min(slots), max(slots) + 1
        if len(set(slots)) != len(slots):
            return None
        holes = hi - lo - len(slots)
        if holes and not self.fill_pays(holes * t_max, ctx):
            return None
        if self.graphs is not None:  # rows padded to the replayer's bucket (filler slots): fewer shapes to capture
            rows = min(self.graphs.rows_bucket(hi - lo, t_max), pool.slots)
            hi = min(lo + rows, pool.slots)
            lo = hi - max(rows, hi - lo)
        return lo, hi, starts, ends

    def _in_slots_plan(self, inputs: list[StepInput], lens: list[int]) -> list[int] | None:
        """Each step's first query position when the forward can write every step's fresh K/V into its own
        pool slot in place without attending to the pool: no step has context (its keys are its own queries:
        a full-sequence recompute, a first prefill block), each holds one slot of its own and its query sits
        at consecutive positions within the slot. Otherwise None."""
        pool = self.pool
        if pool is None or not all(s.slot is not None and _context_free(s) for s in inputs):
            return None
        if len({s.slot for s in inputs}) != len(inputs):
            return None
        starts = []
        for s, t in zip(inputs, lens):
            p = s.pos.numpy()
            q_lo = int(p[0])
            if int(p[-1]) != q_lo + t - 1 or q_lo + t > pool.capacity:
                return None
            starts.append(q_lo)
        return starts

    def _prepare_in_slots(self, inputs, lens, t_max, mode, starts) -> Batch:
        """Steps with no context whose slots are not consecutive (others' slots between them: a recompute
        beside cached steps, which run in a forward of their own): the batch holds the steps' rows only, each
        writes its fresh K/V straight into its own slot (padding rows into the slot's scratch position) and
        attends to them as they are. No K/V buffer of the forward's own, nothing copied into the cache
        afterwards (the step's fresh K/V are views of its slot), no filler rows; a mask only where rows are
        padded or the mode hides some of a step's own keys."""
        n = len(inputs)
        ids, pos, q_valid = self._query_rows(inputs, lens, t_max, list(range(n)), n)
        write = pos if q_valid is None else pos.masked_fill(~q_valid, self.pool.capacity)
        bias = None
        if q_valid is not None or not all(attends_all(mode, q, q + t, self.cfg.block_size)
                                          for q, t in zip(starts, lens)):
            none = torch.zeros((n, 0), dtype=torch.long)
            bias = self._bias(self._mask(mode, pos, torch.tensor(lens), none, torch.zeros(n, dtype=torch.long)))
        slots = [s.slot for s in inputs]
        rows = self._to_device(torch.tensor(slots)[:, None])
        return Batch(self._to_device(ids), self._to_device(pos), bias, self.pool.kv, t_max, 0, list(range(n)), starts,
                     in_slots=Slots(rows, self._to_device(write)), kv_rows=slots)

    def _prepare_packed(self, inputs: list[StepInput], lens: list[int]) -> Batch:
        """Steps with no context of different lengths (a round's full-sequence recomputes) packed one after
        another in a single row: the products run over their tokens only (no padding to the longest), each
        step attends to its own tokens (one unmasked attention call each: no mask, so CUDA may use a flash
        kernel) and writes its fresh K/V into its own pool slot in place, as ``_prepare_in_slots``."""
        offsets = np.cumsum([0, *lens[:-1]]).tolist()
        ids = torch.cat([s.ids for s in inputs])[None]
        pos = torch.cat([s.pos for s in inputs])[None]
        slots = [s.slot for s in inputs]
        rows = torch.from_numpy(np.repeat(np.array(slots, dtype=np.int64), lens))[None]
        segments = tuple(zip(offsets, lens))
        return Batch(self._to_device(ids), self._to_device(pos), None, self.pool.kv, sum(lens), 0, [0] * len(inputs),
                     [int(s.pos[0]) for s in inputs],
                     in_slots=Slots(self._to_device(rows), self._to_device(pos), segments), kv_rows=slots,
                     h_off=offsets)

    def fill_pays(self, filler_tokens: int, context_tokens: int) -> bool:
        """Whether computing ``filler_tokens`` query tokens of filler rows (the layers' matrix products)
        costs less than copying ``context_tokens`` of K/V (read and written), at ``balance`` FLOPs per
        byte of memory traffic (the device's roofline ridge)."""
        flops = 2 * filler_tokens * linear_weights(self.cfg)
        traffic = 2 * kv_bytes_per_token(self.cfg, self.dtype.itemsize)  # each position read and written
        return flops < self.balance * context_tokens * traffic

    def _prepare_pooled(self, inputs, lens, t_max, mode, lo, hi, starts, ends) -> Batch:
        """The forward's K/V buffer is the pool's slots lo..hi-1 themselves: contexts are already in
        place and each step's fresh K/V are scattered to its own positions, so nothing is copied. Padding
        query rows and filler rows (slots no step holds: another request's, or free) write to the slot's
        scratch position, past every position any cache uses; filler rows attend to position 0 only."""
        n, span = hi - lo, max(ends)
        row_of = [s.slot - lo for s in inputs]
        ids, pos, q_valid = self._query_rows(inputs, lens, t_max, row_of, n)
        write = pos if q_valid is None else pos.masked_fill(~q_valid, self.pool.capacity)
        bias = None
        unmasked = q_valid is None and min(ends) == span and all(  # no padding, every query sees all [0, span)
            attends_all(mode, q, span, self.cfg.block_size) for q in starts)
        if not unmasked:
            if q_valid is None:
                q_valid = torch.ones((n, t_max), dtype=torch.bool)
            row_end = torch.zeros(n, dtype=torch.long)
            row_end[row_of] = torch.tensor(ends)
            keys = torch.arange(span)
            mask = allowed(mode, pos, keys[None], self.cfg.block_size)
            mask &= (keys[None] < row_end[:, None])[:, None, :] & q_valid[:, :, None]
            mask[:, :, 0] |= ~q_valid  # padding and filler rows attend to position 0 only, so no row is empty
            bias = self._bias(mask[:, None])
        buf = self.pool.kv[:, :, lo:hi]  # every position, the scratch one included: the forward attends to [0, span)
        return Batch(self._to_device(ids), self._to_device(pos), bias, buf, t_max, span - t_max, row_of, starts,
                     self._to_device(write))

    def _prepare_copied(self, inputs, ids, pos, lens, mode, padded) -> Batch:
        """Each step's context is copied into a fresh [context padded to c_max | query] buffer."""
        cfg, n, t_max = self.cfg, len(inputs), ids.shape[1]
        ctx_lens = [0 if s.ctx_pos is None else len(s.ctx_pos) for s in inputs]
        c_max = max(ctx_lens)
        unpadded = not padded and min(ctx_lens) == c_max
        # the model writes every query position, so only context padding is zeroed (masked, but it must be
        # finite)
        shape = (cfg.num_layers, 2, n, cfg.num_kv_heads, c_max + t_max, cfg.head_dim)
        buf = torch.empty(shape, dtype=self.dtype, device=self.device)
        for i, s in enumerate(inputs):
            segments = s.ctx_kv if isinstance(s.ctx_kv, tuple) else (s.ctx_kv,) if ctx_lens[i] else ()
            off = 0
            for seg in segments:
                buf[:, :, i, :, off : off + seg.shape[3]] = seg
                off += seg.shape[3]
            if ctx_lens[i] < c_max:
                buf[:, :, i, :, ctx_lens[i] : c_max].zero_()
        bias = None
        if not (mode == "bidirectional" and unpadded):  # otherwise nothing is masked: no mask is built
            ctx_pos = torch.zeros((n, c_max), dtype=torch.long)
            for i, s in enumerate(inputs):
                if ctx_lens[i]:
                    ctx_pos[i, : ctx_lens[i]] = s.ctx_pos
            bias = self._bias(self._mask(mode, pos, torch.tensor(lens), ctx_pos, torch.tensor(ctx_lens)))
        return Batch(self._to_device(ids), self._to_device(pos), bias, buf, t_max, c_max, list(range(n)), [c_max] * n)

    def _bias(self, mask: torch.Tensor) -> torch.Tensor | None:
        """A host bool mask as an additive bias in the model's dtype on the device; None if all True."""
        if bool(mask.all()):  # host tensors: no wait
            return None
        mask = self._to_device(mask)
        return torch.zeros(mask.shape, dtype=self.dtype, device=self.device).masked_fill_(~mask, float("-inf"))
