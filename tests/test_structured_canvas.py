"""The grammar on the canvas (issue 42 item 2), without a model: the frontier's mask, provisional tokens
checked as the frontier reaches them, the first rejected one remasked with the provisional tokens after it in
its block, edits rolled back and checked, end of text only where the grammar can end, a resumed guard rebuilt
from the committed prefix; and a random "model" under random parallel decisions always ends with text the
grammar accepts. Both grammar backends behind engine/constraints' interface are exercised."""

from __future__ import annotations

import re

import numpy as np
import pytest

from engine.constraints import BACKENDS, ConstraintSpec, Grammar, GrammarCache, GrammarError, Vocab
from engine.constraints.canvas import CanvasGuard, guard_decision
from engine.tokenizer import EOS, MASK, CharTokenizer

TOK = CharTokenizer.default()
VOCAB = Vocab.of(TOK, 64, [EOS])
REGEX = r"(yes|no), [0-9]{1,3}\."


def ids(text: str) -> list[int]:
    return TOK.encode(text)


def text(tokens) -> str:
    return TOK.decode([int(t) for t in tokens])


def canvas(s: str) -> np.ndarray:
    """An output canvas from a string: '_' is a masked position, '$' the end of text."""
    return np.array([MASK if c == "_" else EOS if c == "$" else TOK.vocab[c] for c in s], dtype=np.int64)


@pytest.fixture(params=BACKENDS)
def grammar(request) -> Grammar:
    return Grammar.compile(ConstraintSpec("regex", REGEX), VOCAB, request.param)


def allowed_text(guard: CanvasGuard) -> set[str]:
    return {"$" if t == EOS else TOK.inverse[int(t)] for t in np.flatnonzero(guard.allowed())}


def test_the_frontier_mask_and_the_end_of_text(grammar):
    g = CanvasGuard(grammar, MASK)
    assert allowed_text(g) == {"y", "n"}
    assert g.check(canvas("yes, 4__"), 8).size == 0 and g.checked == 6
    assert allowed_text(g) == {*"0123456789", "."}  # no end of text yet
    assert g.check(canvas("yes, 42.$"), 9).size == 0 and g.ended and g.checked == 9


def test_provisional_tokens_are_accepted_when_the_frontier_reaches_them(grammar):
    g = CanvasGuard(grammar, MASK)
    assert g.check(canvas("y_s, 1__"), 8).size == 0 and g.checked == 1  # 's, 1' waits beyond the frontier
    assert g.check(canvas("yes, 1__"), 8).size == 0 and g.checked == 6  # the frontier reached them: accepted


def test_the_first_rejected_token_goes_back_with_the_provisional_tokens_after_it(grammar):
    g = CanvasGuard(grammar, MASK)
    g.check(canvas("y_______"), 8)
    bad = g.check(canvas("yes; 1_2"), 8)  # ';' is wrong: it and ' ', '1', '2' after it are remasked
    assert bad.tolist() == [3, 4, 5, 7] and g.checked == 3 and g.remasked == 4
    assert allowed_text(g) == {","}


def test_remasking_stops_at_the_end_of_the_block(grammar):
    g = CanvasGuard(grammar, MASK)
    assert g.check(canvas("yes,x1__" + "2.______"), 8).tolist() == [4, 5]  # the next block keeps its tokens


def test_an_early_end_of_text_is_remasked(grammar):
    g = CanvasGuard(grammar, MASK)
    assert g.check(canvas("yes$____"), 8).tolist() == [3]
    assert not g.ended and "$" not in allowed_text(g)


def test_guard_decision_drops_fresh_commits_and_remasks_earlier_ones(grammar):
    g = CanvasGuard(grammar, MASK)
    before = canvas("y__;_1__")  # ';' at 3 and '1' at 5 were committed by earlier steps (provisional)
    g.check(before, 8)
    masked = before == MASK
    tokens = canvas("yes,xxxx")
    commit = masked & np.isin(np.arange(8), [1, 2, 4])  # e, s and an 'x' at 4
    d = guard_decision(g, before, 0, 8, masked, tokens, commit, np.zeros(8, bool), done=False)
    # 'y', 'e', 's' accepted; ';' at 3 is rejected: it and '1' at 5 were earlier commits (remasked), the 'x'
    # at 4 this step's own commit (dropped)
    assert np.flatnonzero(d.commit).tolist() == [1, 2] and np.flatnonzero(d.remask).tolist() == [3, 5]
    assert not d.done and g.checked == 3


def test_a_decision_that_finishes_the_block_stays_done_when_valid(grammar):
    g = CanvasGuard(grammar, MASK)
    before = canvas("no, 7.__")
    g.check(before, 8)
    masked = before == MASK
    d = guard_decision(g, before, 0, 8, masked, canvas("no, 7.$$"), masked.copy(), np.zeros(8, bool), done=True)
    assert d.done and d.commit[6:].all() and not d.remask.any() and g.ended


def test_edits_roll_the_grammar_back_and_are_checked(grammar):
    g = CanvasGuard(grammar, MASK)
    before = canvas("yes, 12_")
    g.check(before, 8)
    assert g.checked == 7
    masked = before == MASK
    edit = np.zeros(8, bool)
    edit[5] = True
    ok = guard_decision(g, before, 0, 8, masked, canvas("yes, 92_"), np.zeros(8, bool), edit, done=False)
    assert ok.edit[5] and not ok.remask.any() and g.checked == 7  # '9' in place of '1': accepted again
    after = canvas("yes, 92_")
    edit[:] = False
    edit[1] = True  # 'yxs': refused; the 'e' it would replace still fits, so the edit is dropped
    bad = guard_decision(g, after, 0, 8, after == MASK, canvas("yxs, 92_"), np.zeros(8, bool), edit, done=False)
    assert not bad.edit.any() and not bad.remask.any() and g.checked == 7
    edit[:] = False
    edit[0] = True  # 'nes': 'n' is accepted, then the unedited 'e' no longer fits: it and what follows go back
    moved = guard_decision(g, after, 0, 8, after == MASK, canvas("nes, 92_"), np.zeros(8, bool), edit, done=False)
    assert moved.edit[0] and np.flatnonzero(moved.remask).tolist() == [1, 2, 3, 4, 5, 6] and g.checked == 1


def test_a_resumed_guard_is_rebuilt_from_the_committed_prefix(grammar):
    g = CanvasGuard(grammar, MASK, ids("yes, 4"))
    assert g.checked == 6 and allowed_text(g) == {*"0123456789", "."}
    with pytest.raises(ValueError, match="position 1"):
        CanvasGuard(grammar, MASK, ids("yx"))


def test_choice_and_grammar_kinds(grammar):
    for spec, good in [(ConstraintSpec.choice(["positive", "negative"]), "negative"),
                       (ConstraintSpec("grammar", 'root ::= [a-z]+ (" " [a-z]+)*'), "the cat sat")]:
        g = CanvasGuard(Grammar.compile(spec, VOCAB, grammar.backend), MASK)
        assert g.check(canvas(good + "$"), 20).size == 0 and g.ended


def test_what_the_vocabulary_cannot_write_is_refused_at_compile():
    from engine.tokenizer import CHARS, SPECIALS

    core = Vocab.of(CharTokenizer({t: i for i, t in enumerate(SPECIALS + CHARS[:51])}), 64, [EOS])  # no braces
    with pytest.raises(GrammarError, match="vocabulary") as info:
        Grammar.compile(ConstraintSpec.json_schema({"type": "object"}, "response_format"), core)
    assert info.value.param == "response_format"
    Grammar.compile(ConstraintSpec.json_schema({"type": "object"}, "response_format"), VOCAB)  # the full one can
    with pytest.raises(GrammarError) as info:
        Grammar.compile(ConstraintSpec("regex", "(", "guided_regex"), VOCAB)
    assert info.value.param == "guided_regex" and "unclosed" in str(info.value)


def test_the_cache_compiles_each_distinct_spec_once():
    cache = GrammarCache(size=2)
    a, b = ConstraintSpec("regex", "a+", "x"), ConstraintSpec("regex", "a+", "y")
    assert cache.get(a, VOCAB) is cache.get(b, VOCAB) and cache.compiles == 1  # the field aside, the same
    bad = ConstraintSpec("regex", "(", "guided_regex")
    for param in ("guided_regex", "regex"):
        with pytest.raises(GrammarError) as info:
            cache.get(ConstraintSpec("regex", "(", param), VOCAB)
        assert info.value.param == param
    assert cache.compiles == 2 and bad.key == ConstraintSpec("regex", "(", "regex").key


@pytest.mark.parametrize("jump", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_random_parallel_decisions_always_end_in_valid_text(grammar, seed, jump):
    """A 'model' proposing random characters everywhere (the frontier's drawn from the grammar's mask), a
    'rule' committing a random subset of the masked positions each step: the guard keeps the text valid and
    the blocks still commit several tokens in some steps."""
    rng = np.random.default_rng(seed)
    block, n = 4, 16
    out = np.full(n, MASK, dtype=np.int64)
    g = CanvasGuard(grammar, MASK)
    alphabet = np.array(ids("yesno, 0123456789.") + [EOS])
    steps = multi = 0
    for bs in range(0, n, block):
        be = bs + block
        while (out[bs:be] == MASK).any() and not g.ended and steps < 400:
            steps += 1
            masked = out[bs:be] == MASK
            tokens = rng.choice(alphabet, size=block)
            front = g.checked - bs
            if 0 <= front < block and masked[front]:
                tokens[front] = rng.choice(np.flatnonzero(g.allowed()))
            commit = masked & (rng.random(block) < 0.6)
            if not commit.any():
                commit[np.flatnonzero(masked)[0]] = True
            d = guard_decision(g, out, bs, be, masked, tokens, commit, np.zeros(block, bool), done=False,
                               jump=jump)
            blk = out[bs:be]
            blk[d.commit] = d.tokens[d.commit]
            blk[d.remask] = MASK
            multi += int(d.commit.sum()) > 1
        if g.ended:
            break
    assert g.ended, (text(out), steps)
    end = int(np.flatnonzero(out == EOS)[0])
    assert re.fullmatch(REGEX, text(out[:end])), text(out)
    assert (out[:end] != MASK).all()
    assert multi > 0


def test_jump_forward_commits_what_the_grammar_forces(grammar):
    g = CanvasGuard(grammar, MASK)
    before = canvas("________")
    masked = before == MASK
    commit = np.zeros(8, bool)
    commit[0] = True
    d = guard_decision(g, before, 0, 8, masked, canvas("y_______"), commit, np.zeros(8, bool), done=False)
    # after 'y' the grammar forces 'es, ': committed in the same step, no forward asked
    assert text(d.tokens[d.commit]) == "yes, " and d.forced == 4 and g.checked == 5
    off = CanvasGuard(grammar, MASK)
    d = guard_decision(off, before, 0, 8, masked, canvas("y_______"), commit, np.zeros(8, bool), done=False,
                       jump=False)
    assert text(d.tokens[d.commit]) == "y" and d.forced == 0


@pytest.mark.parametrize("regex,text", [("yes", "yes"), ("a+", "aaa")])
def test_rollback_across_the_end_of_text(regex, text, grammar):
    """Rolling back over an accepted end of text (an edit that reaches back) restores the state before it,
    whether the grammar had stopped by itself ("yes") or could have gone on ("a+")."""
    g = Grammar.compile(ConstraintSpec("regex", regex), VOCAB, grammar.backend)
    m = g.matcher()
    assert m.accept_prefix([*ids(text), EOS]) == len(text) + 1 and m.ended()
    m.rollback(2)
    assert m.accepted == len(text) - 1 and not m.ended()
    fresh = g.matcher()
    fresh.accept_prefix(ids(text[:-1]))
    assert (m.fill_mask() == fresh.fill_mask()).all() and m.accept(TOK.vocab[text[-1]]) and m.accept(EOS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_json_whitespace_is_bounded_per_gap_by_the_vocabularys_own_whitespace(backend):
    """A character vocabulary spends a token (a denoising position) per space: its gaps take 2 characters, so a
    model that never learned JSON still closes its document within its budget; a BPE vocabulary whose tokens
    hold 8 or more spaces keeps 16 characters per gap (pretty-printing)."""
    from engine.constraints.grammar import WHITESPACE_CHARS_MAX, whitespace_cap

    assert whitespace_cap(VOCAB) == 2
    wide = Vocab.of(CharTokenizer({**TOK.vocab, " " * 8: 64}), 65, [EOS])
    assert whitespace_cap(wide) == WHITESPACE_CHARS_MAX
    g = Grammar.compile(ConstraintSpec.json_schema({"type": "object"}, "response_format"), VOCAB, backend)
    for gap, fits in (("  ", True), ("   ", False)):
        m = g.matcher()
        ids = TOK.encode("{" + gap + "}")
        assert (m.accept_prefix(ids) == len(ids)) == fits, (gap, backend)
