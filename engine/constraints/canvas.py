"""A grammar enforced on a diffusion canvas, with the parallelism kept.

The grammar engines are left to right; a diffusion model commits tokens anywhere in its block. The
``CanvasGuard`` of a request reconciles the two:

- the committed output tokens left of the first masked position are the grammar's prefix (accepted by its
  matcher); that first masked position is the *frontier*;
- before the model's step, the frontier's logits are masked to what the grammar allows there
  (``allowed``): its token, whenever the rule commits it, is valid, and a stop id (end of text) is allowed
  only where the grammar can end;
- tokens the rule commits beyond the frontier are *provisional*; after every step the guard walks from the
  frontier over the committed run (``check``), accepting token by token; the first token the grammar
  rejects is remasked together with every provisional token after it in its block, to be decoded again;
- an edit (a rule that rewrites committed tokens) at or before the frontier rolls the grammar back to it and
  is checked the same way.

So the text always parses, while a step may still commit many tokens. A resumed or migrated request
rebuilds its guard from the committed prefix (``CanvasGuard(grammar, mask_id, committed)``): its state is a
function of the tokens, so nothing else needs to travel.

``guard_decision`` applies one rule ``Decision`` through the guard (the seam of engine/decoding): it returns
the commit and edit masks that survive and the earlier positions to remask. Pure NumPy, no model: the tests
drive it on hand-built canvases.

DiffusionGemma's uniform-state canvases (engine/canvas.py) have no mask and no frontier: the same guard (its
state the committed text: the finished canvases) checks a canvas's argmax when it would stop (``check_canvas``:
the first rejected token and every token after it are renoised, and the canvas denoises on), and finishes a
canvas still rejected at the step cap under the grammar's mask (``finish_canvas``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from engine.constraints.grammar import Grammar, Matcher


class CanvasGuard:
    """One request's grammar state on its output canvas (positions count from the answer's first token).

    ``checked``: output positions ``[0, checked)`` the grammar has accepted (the frontier is ``checked``
    while the text has not ended); ``ended``: a stop id was accepted at ``checked - 1`` (the text ends
    there). Counters for the measurements: ``remasked`` (tokens sent back to the mask), ``dead_ends``
    (frontiers where the vocabulary could write nothing the grammar allows)."""

    def __init__(self, grammar: Grammar, mask_id: int, committed=()) -> None:
        self.grammar = grammar
        self.mask_id = int(mask_id)
        self.matcher: Matcher = grammar.matcher()
        self.stop_ids = np.asarray(grammar.vocab.stop_ids, dtype=np.int64)
        committed = [int(t) for t in committed]
        n = self.matcher.accept_prefix(committed)
        if n < len(committed):
            raise ValueError(f"the committed prefix breaks the constraint at output position {n}")
        self.checked = n
        self.remasked = 0
        self.dead_ends = 0
        self.seconds = 0.0  # spent in allowed() and check(): the grammar's cost to the request's steps

    @property
    def ended(self) -> bool:
        return self.matcher.ended()

    def allowed(self) -> np.ndarray:
        """bool [vocab]: what the frontier may hold (never the mask token). At a dead end (the grammar allows
        tokens this vocabulary does not have) the stop ids, so the text ends rather than loops."""
        t0 = time.perf_counter()
        mask = self.matcher.fill_mask()
        if 0 <= self.mask_id < mask.shape[0]:
            mask[self.mask_id] = False
        if not mask.any():
            self.dead_ends += 1
            mask[self.stop_ids[self.stop_ids < mask.shape[0]]] = True
        self.seconds += time.perf_counter() - t0
        return mask

    def forced(self) -> int | None:
        """The token the frontier must hold when the grammar allows exactly one (a stop id when only the end
        of text is allowed), else None: written without asking the model (jump-forward)."""
        if self.ended:
            return None
        mask = self.allowed()
        ids = np.flatnonzero(mask)
        if ids.size == 1:
            return int(ids[0])
        if ids.size and np.isin(ids, self.stop_ids).all():
            return int(self.stop_ids[0])
        return None

    def rollback_to(self, pos: int) -> None:
        """Forget the grammar's acceptance of positions ``[pos, checked)`` (an edit at ``pos``)."""
        if pos < self.checked:
            self.matcher.rollback(self.checked - pos)
            self.checked = pos

    def check(self, out: np.ndarray, block_end: int) -> np.ndarray:
        """Walk the grammar from the frontier over ``out``'s committed run (``out``: the output canvas, the
        mask id where masked). Returns the positions to remask: the first token the grammar rejects and every
        committed position after it up to ``block_end`` (the end of its block); empty when all is accepted.
        Stops after an accepted stop id (the text ends there: what follows is not output)."""
        t0 = time.perf_counter()
        try:
            return self._check(out, block_end)
        finally:
            self.seconds += time.perf_counter() - t0

    def _check(self, out: np.ndarray, block_end: int) -> np.ndarray:
        p = self.checked
        n = len(out)
        run_end = p
        while run_end < n and out[run_end] != self.mask_id:
            run_end += 1
        if run_end == p or self.ended:
            return np.zeros(0, dtype=np.int64)
        took = self.matcher.accept_prefix(out[p:run_end].tolist())
        self.checked = p + took
        if self.ended or self.checked == run_end:
            return np.zeros(0, dtype=np.int64)
        bad = self.checked
        tail = np.arange(bad, min(block_end, n))
        tail = tail[out[tail] != self.mask_id]
        self.remasked += len(tail)
        return tail


def _replay_edits(guard: CanvasGuard, out: np.ndarray, after: np.ndarray, block_start: int, block_end: int,
                  edit: np.ndarray) -> None:
    """Walk the grammar over the edited run: an edit the grammar refuses is dropped when the token it would
    have replaced is still accepted there (the edit is undone in ``after`` and ``edit``); anything else it
    refuses is left for ``check`` to remask. Dropping rather than remasking a refused edit keeps an editing
    rule from rewriting the same valid token into the same invalid one block after block."""
    m, mask = guard.matcher, guard.mask_id
    p = guard.checked
    while p < block_end and after[p] != mask and not guard.ended:
        if m.accept(int(after[p])):
            p += 1
        elif block_start <= p and edit[p - block_start] and out[p] != mask and m.accept(int(out[p])):
            edit[p - block_start] = False
            after[p] = out[p]
            p += 1
        else:
            break
        guard.checked = p


@dataclass
class GuardedDecision:
    """A rule's decision after the grammar's check: ``commit`` and ``edit`` (bool [L], block-relative: the
    ones that stand), ``tokens`` (the step's tokens, with those the grammar forced written in), ``remask``
    (bool [L]: positions committed in earlier steps that go back to the mask), ``done`` (nothing masked
    after it, no edit pending: the rule's own flag, cleared by any remask) and ``forced`` (positions
    committed because the grammar allowed one token only)."""

    commit: np.ndarray
    edit: np.ndarray
    tokens: np.ndarray
    remask: np.ndarray
    done: bool
    forced: int = 0


def guard_decision(guard: CanvasGuard, out: np.ndarray, block_start: int, block_end: int, masked: np.ndarray,
                   tokens: np.ndarray, commit: np.ndarray, edit: np.ndarray, done: bool,
                   jump: bool = True) -> GuardedDecision:
    """Apply one step's decision (block-relative ``commit`` / ``edit`` of ``tokens``; ``masked``: the
    block's masked positions before the step) through ``guard``. ``out`` is the output canvas before the
    step (output-relative; the block is ``out[block_start:block_end]``); it is not modified. ``jump``: a
    masked frontier whose token the grammar forces is committed too, and so on while it forces one
    (jump-forward: the fixed parts of a format cost no forward)."""
    size = block_end - block_start
    after = np.array(out, copy=True)
    tokens = np.array(tokens[:size], copy=True)
    write = commit | edit
    block = after[block_start:block_end]
    block[write] = tokens[write]
    commit, edit = commit.copy(), edit.copy()
    edited = np.flatnonzero(edit)
    if edited.size:  # the grammar rolls back to the first edit and takes the edited run again
        guard.rollback_to(block_start + int(edited[0]))
        _replay_edits(guard, out, after, block_start, block_end, edit)
    remask = np.zeros(size, dtype=bool)
    forced = 0
    while True:
        bad = guard.check(after, block_end) - block_start
        if bad.size:
            drop = np.zeros(size, dtype=bool)
            drop[bad] = True
            fresh = drop & commit  # this step's own provisional tokens: simply not committed
            commit &= ~drop
            edit &= ~drop
            remask = drop & ~fresh  # committed before (or edited now): back to the mask
            done = False
            break
        p = guard.checked - block_start
        if not jump or not 0 <= p < size or block[p] != guard.mask_id:
            break
        t = guard.forced()
        if t is None:
            break
        block[p] = tokens[p] = t
        commit[p] = True
        forced += 1
    return GuardedDecision(commit, edit, tokens, remask, bool(done and not (masked & ~commit).any()), forced)


# ---------------------------------------------------------------- the sequence's side (engine/sequence.py)

_VOCABS: dict[tuple, object] = {}
JUMP = True  # jump-forward in the engine's guards (scripts/structured_bench.py --no-jump measures without)


def compile_for(constraint: dict, tokenizer, vocab_size: int, stop_ids) -> Grammar:
    """A ``SamplingParams.constraint`` compiled for a model's vocabulary, once per distinct spec and vocabulary
    (``compile_cached``): a replica calls it as an add arrives, so its round loop finds it compiled."""
    from engine.constraints.grammar import Vocab, compile_cached
    from engine.constraints.spec import ConstraintSpec

    stops = tuple(dict.fromkeys(int(t) for t in stop_ids))
    key = (id(tokenizer), vocab_size, stops)
    vocab = _VOCABS.get(key)
    if vocab is None:
        vocab = _VOCABS[key] = Vocab.of(tokenizer, vocab_size, stops)
    return compile_cached(ConstraintSpec.from_dict(constraint), vocab)


def engine_grammar(engine, constraint: dict) -> Grammar:
    """``compile_for`` with an ``engine.engine.Engine``'s tokenizer, vocabulary width and stop ids."""
    return compile_for(constraint, engine.tokenizer, engine.cfg.vocab_size, (engine.cfg.eos_token_id,
                                                                             *engine.stop_ids))


def make_guard(constraint: dict, tokenizer, vocab_size: int, stop_ids, mask_id: int, committed=()) -> CanvasGuard:
    """A request's guard from its ``SamplingParams.constraint`` (``compile_for``), its state rebuilt from the
    ``committed`` output tokens (a resume)."""
    return CanvasGuard(compile_for(constraint, tokenizer, vocab_size, stop_ids), mask_id, committed)


def frontier_row(guard: CanvasGuard, positions: np.ndarray, out_start: int) -> int | None:
    """The index, among a step's decoded ``positions`` (absolute, ascending), of the guard's frontier; None
    when the step does not decode it (or the text has ended)."""
    if guard.ended:
        return None
    at = out_start + guard.checked
    i = int(np.searchsorted(positions, at))
    return i if i < len(positions) and int(positions[i]) == at else None


def guard_block(guard: CanvasGuard, canvas: np.ndarray, out_start: int, span: tuple[int, int], masked: np.ndarray,
                tokens: np.ndarray, decision, conf: np.ndarray | None = None):
    """A rule's ``Decision`` for the block ``span`` (absolute) of the sequence's ``canvas`` (the whole token
    array: prompt, then output; modified in place: remasked positions get the mask id) checked by the guard:
    the ``Decision`` that stands, and the block positions remasked (bool, block-relative). Tokens the grammar
    forced are written into ``tokens`` (and a probability of 1 into ``conf``: the constrained distribution's,
    as the frontier's own confidence is)."""
    from engine.decoding.base import Decision

    bs, be = span
    out = canvas[out_start:]
    g = guard_decision(guard, out, bs - out_start, be - out_start, masked, tokens, decision.commit, decision.edit,
                       decision.done, jump=JUMP)
    if g.remask.any():
        canvas[bs:be][g.remask] = guard.mask_id
    if g.forced:
        forced = g.commit & (g.tokens != tokens[: be - bs])
        tokens[: be - bs][g.commit] = g.tokens[g.commit]  # the forced tokens, written with the rule's commits
        if conf is not None:
            conf[: be - bs][forced | (g.commit & ~decision.commit)] = 1.0
    return Decision(g.commit, g.edit, g.done), g.remask


# ---------------------------------------------------------------- whole canvases (DiffusionGemma: engine/canvas.py)
#
# A uniform-state canvas has no masked positions and no frontier: every step rewrites it whole, and its text is
# the argmax of the step it stops at. So the grammar checks it once, when it would stop: ``check_canvas`` walks
# the grammar from the committed text (the finished canvases) over its argmax (a refused token where the grammar
# allows one only is replaced by that one: jump-forward); the first rejected token and every token after it are
# renoised and the canvas keeps denoising. At the rule's step cap a still-rejected canvas is
# finished by ``finish_canvas``: from that token on, position by position, the model's best token among those
# the grammar allows there (always valid, always done in one pass: no further forward).


def check_canvas(guard: CanvasGuard, tokens, jump: bool = True) -> tuple[np.ndarray, int | None]:
    """Walk the grammar from the committed text over a stopping canvas's ``tokens`` (its argmax, cut to what the
    request may still output). Returns the tokens (with ``jump``, a token the grammar refuses where it allows a
    single one is replaced by that one, and the walk goes on: jump-forward, the format's fixed parts need no
    denoising; a forced stop id ends the text there) and None when the grammar accepts them all or accepts a
    stop id among them (the text ends there): the guard has then taken them (its state is now the committed
    text with this canvas). Else the index of the first rejected token (a stop id where the grammar cannot end
    is rejected), the guard left at the committed text."""
    t0, spent = time.perf_counter(), guard.seconds  # (``forced`` counts its own time too: counted once here)
    out = np.array([int(t) for t in tokens], dtype=np.int64)
    try:
        if guard.ended:  # the text has ended (the engine ends the request there): nothing more to check
            return out, None
        m, pos = guard.matcher, 0
        while True:
            pos += m.accept_prefix(out[pos:].tolist())
            if guard.ended or pos == len(out):
                guard.checked += pos
                return out, None
            forced = guard.forced() if jump else None
            if forced is None or not m.accept(forced):
                break
            out[pos] = forced
            pos += 1
            if guard.ended:
                guard.checked += pos
                return out, None
        m.rollback(pos)
        guard.remasked += len(out) - pos
        return out, pos
    finally:
        guard.seconds = spent + time.perf_counter() - t0


def finish_canvas(guard: CanvasGuard, tokens, start: int, best) -> np.ndarray:
    """A canvas the grammar still rejects at the step cap, made valid: ``tokens[:start]`` (accepted by
    ``check_canvas``) taken again, then from ``start`` on, position by position, ``best(p, allowed)``: the
    model's highest-scoring token at canvas position ``p`` among ``allowed`` (bool [vocab]: ``guard.allowed()``,
    a stop id only where the grammar can end; at a dead end the stop ids, so the text ends rather than loops).
    Stops after the end of text (what follows a stop id is not output). Returns the canvas's new tokens; the
    guard has taken them."""
    t0 = time.perf_counter()
    out = np.array([int(t) for t in tokens], dtype=np.int64)
    if guard.matcher.accept_prefix(out[:start].tolist()) != start:
        raise ValueError("finish_canvas: the canvas's tokens before start are not the grammar's")
    guard.checked += start
    guard.seconds += time.perf_counter() - t0
    for p in range(start, len(out)):
        if guard.ended:
            break
        allowed = guard.allowed()
        t = int(best(p, allowed))
        if not allowed[t]:
            raise ValueError(f"finish_canvas: best() chose token {t}, which the grammar does not allow")
        out[p] = t
        t0 = time.perf_counter()
        if guard.matcher.accept(t):
            guard.checked += 1
        elif t in guard.stop_ids:  # a dead end's stop: the text ends here (the grammar could not go on)
            guard.seconds += time.perf_counter() - t0
            break
        else:
            raise RuntimeError(f"the grammar refused token {t} its own mask allowed")
        guard.seconds += time.perf_counter() - t0
    return out
