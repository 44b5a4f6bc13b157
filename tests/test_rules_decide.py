"""Each decoding rule's step decisions against a plain reference written here, on recorded logits (fixed,
seeded arrays: a few steps of a 12-position block over a 40-token vocabulary, peaked so that some positions
are confident and some are not), with the edge cases: no position over the threshold, a block all
committed but still editing, the post-edit bound, the knob at its range ends, and state carried across
steps and through a JSON round trip (a resumed request)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from engine.decoding import BlockStep, apply_decision, make_rule

MASK = 39  # the mask token's id (never proposed)
L, V, STEPS = 12, 40, 24


def recorded_logits(seed: int = 7) -> np.ndarray:
    """[STEPS, L, V] logits: each position has a favourite token whose lead grows over the steps (as a
    denoiser's does once its neighbours are filled in), with noise that sometimes flips the favourite."""
    rng = np.random.default_rng(seed)
    base = rng.normal(0.0, 1.0, (L, V))
    fav = rng.integers(0, V - 1, L)
    lead = rng.uniform(0.5, 4.0, L)
    out = np.empty((STEPS, L, V))
    for s in range(STEPS):
        x = base + rng.normal(0.0, 0.7, (L, V))
        x[np.arange(L), fav] += lead * (1.0 + 0.15 * s)
        out[s] = x
    return out


LOGITS = recorded_logits()


def stats(logits: np.ndarray, canvas: np.ndarray):
    """Plain per-position statistics: argmax token (never the mask), its probability, the entropy and the
    probability of the canvas token (float32, as the runner hands them over)."""
    x = logits.astype(np.float64).copy()
    x[:, MASK] = -np.inf
    p = np.exp(x - x.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    tokens = p.argmax(axis=1)
    conf = p[np.arange(len(p)), tokens]
    with np.errstate(divide="ignore", invalid="ignore"):
        ent = -np.where(p > 0, p * np.log(p), 0.0).sum(axis=1)
    cur = np.where(canvas == MASK, 0.0, p[np.arange(len(p)), np.minimum(canvas, V - 1)])
    return tokens.astype(np.int64), conf.astype(np.float32), ent.astype(np.float32), cur.astype(np.float32)


def step_of(canvas, s, state, knob=None, editable_from=None, step_in_block=0, masked_at_start=L,
            logits=LOGITS) -> BlockStep:
    tokens, conf, ent, cur = stats(logits[s % STEPS], canvas)
    masked = canvas == MASK
    editable = ~masked
    if editable_from is not None:  # positions before it are prompt: never editable
        editable[:editable_from] = False
    return BlockStep(masked, editable, tokens, conf, cur, ent, step_in_block, masked_at_start, knob, state,
                     canvas=canvas.copy())


def run_block(rule, canvas=None, knob=None, steps=STEPS, state=None, start=0, resume_at=None, prompt=0,
              logits=LOGITS):
    """Decode one block with ``rule`` over the recorded logits; returns (canvas per step, decisions, state).
    ``resume_at``: the state goes through JSON before that step (as a resumed request's does)."""
    canvas = np.full(L, MASK, dtype=np.int64) if canvas is None else canvas.copy()
    state = {} if state is None else state
    masked_at_start = int((canvas == MASK).sum())
    history, decisions = [canvas.copy()], []
    for s in range(start, start + steps):
        if resume_at is not None and s == resume_at:
            state = json.loads(json.dumps(state))
        step = step_of(canvas, s, state, knob, prompt, s - start, masked_at_start, logits)
        d = rule.decide(step)
        canvas = apply_decision(canvas, step, d)
        history.append(canvas.copy())
        decisions.append(d)
        if d.done:
            break
    return history, decisions, state


# ---------------------------------------------------------------- threshold and low_confidence

def ref_threshold(conf, masked, t):
    chosen = [bool(m and c > t) for c, m in zip(conf, masked)]
    if not any(chosen):
        best = max((i for i in range(len(conf)) if masked[i]), key=lambda i: (conf[i], -i))
        chosen[best] = True
    return chosen


@pytest.mark.parametrize("t", [0.0, 0.3, 0.6, 0.9, 0.999, 1.0])
def test_threshold_against_reference(t):
    history, decisions, _ = run_block(make_rule("threshold"), knob=t)
    for before, d, s in zip(history, decisions, range(STEPS)):
        _, conf, _, _ = stats(LOGITS[s], before)
        assert d.commit.tolist() == ref_threshold(conf, before == MASK, t)
    assert decisions[-1].done and (history[-1] != MASK).all()
    assert len(decisions) == (1 if t == 0.0 else len(decisions))
    if t == 1.0:
        assert len(decisions) == L  # nothing passes 1: one per step


def ref_top_k(conf, masked, k):
    order = sorted((i for i in range(len(conf)) if masked[i]), key=lambda i: (-conf[i], i))
    return [i in order[:k] for i in range(len(conf))]


@pytest.mark.parametrize("k", [1, 3, 5, 12, 4096])
def test_low_confidence_commits_the_top_k(k):
    history, decisions, _ = run_block(make_rule("low_confidence", k=k))
    for s, (before, d) in enumerate(zip(history, decisions)):
        _, conf, _, _ = stats(LOGITS[s], before)
        assert d.commit.tolist() == ref_top_k(conf, before == MASK, k)
    assert len(decisions) == math.ceil(L / min(k, L))


def test_low_confidence_schedule_and_router_knob():
    rule = make_rule("low_confidence", steps_per_block=4)
    history, decisions, _ = run_block(rule)
    assert [int(d.commit.sum()) for d in decisions] == [3, 3, 3, 3]
    # a step knob (the router's) overrides the schedule: top-k with that k
    _, decisions, _ = run_block(rule, knob=6)
    assert [int(d.commit.sum()) for d in decisions] == [6, 6]
    assert [rule.knob_at(t) for t in (0.9, 0.8, 0.7, 0.6, 0.5)] == [1, 2, 2, 3, 4]


# ---------------------------------------------------------------- entropy_bound

def ref_eb(ent, masked, gamma):
    """The EB sampler: grow U along increasing entropy while sum(H(U)) - max(H(U)) <= gamma, at least one."""
    order = sorted((i for i in range(len(ent)) if masked[i]), key=lambda i: (float(ent[i]), i))
    chosen = [order[0]]
    for i in order[1:]:
        hs = [float(ent[j]) for j in chosen + [i]]
        if sum(hs) - max(hs) <= gamma:
            chosen.append(i)
        else:
            break
    return [i in chosen for i in range(len(ent))]


@pytest.mark.parametrize("gamma", [0.0, 0.05, 0.15, 0.5, 2.0, 1000.0])
def test_entropy_bound_against_reference(gamma):
    history, decisions, _ = run_block(make_rule("entropy_bound"), knob=gamma)
    for s, (before, d) in enumerate(zip(history, decisions)):
        _, _, ent, _ = stats(LOGITS[s], before)
        assert d.commit.tolist() == ref_eb(ent, before == MASK, gamma)
    if gamma == 0.0:
        assert all(d.commit.sum() == 1 for d in decisions)  # no entropy is exactly 0 here: one at a time
    if gamma == 1000.0:
        assert len(decisions) == 1
    assert decisions[-1].done


def test_entropy_bound_knob_from_the_router_level():
    rule = make_rule("entropy_bound")
    assert rule.knob_at(0.9) == pytest.approx(-math.log(0.9)) and rule.knob_at(1.0) == 0.0
    assert rule.knob_at(0.0) == 1000.0
    with pytest.raises(ValueError, match="gamma"):
        rule.check_knob(-0.1)
    with pytest.raises(ValueError, match="gamma"):
        make_rule("entropy_bound", gamma=1e9)


# ---------------------------------------------------------------- hierarchical

def ref_hierarchical(conf, masked, t, sub):
    first = next(i for i in range(len(masked)) if masked[i])
    lo = first // sub * sub
    inside = [masked[i] and lo <= i < lo + sub for i in range(len(masked))]
    return ref_threshold(conf, inside, t)


@pytest.mark.parametrize("t,sub", [(0.9, 4), (0.5, 4), (0.0, 5), (1.0, 3), (0.7, 64)])
def test_hierarchical_against_reference(t, sub):
    rule = make_rule("hierarchical", sub_block_size=sub)
    history, decisions, _ = run_block(rule, knob=t)
    for s, (before, d) in enumerate(zip(history, decisions)):
        _, conf, _, _ = stats(LOGITS[s], before)
        assert d.commit.tolist() == ref_hierarchical(conf, before == MASK, t, sub)
    if sub >= L:  # one sub-block: the threshold rule
        assert [d.commit.tolist() for d in decisions] == \
            [d.commit.tolist() for d in run_block(make_rule("threshold"), knob=t)[1]]


# ---------------------------------------------------------------- credit

def ref_credit_block(logits_steps, t, alpha=0.7, decay=0.8, boost=0.2):
    """dInfer's credit decoding with its full [L, V] credit matrix (no approximation): decay, add top-1
    probability ** boost at the top-1 token of masked positions, fuse logits + alpha * log(1 + credit),
    threshold the fused top-1 probability (at least the most confident)."""
    canvas = [MASK] * L
    mat = np.zeros((L, V))
    commits = []
    for s, logits in enumerate(logits_steps):
        x = logits.astype(np.float64).copy()
        x[:, MASK] = -np.inf
        p = np.exp(x - x.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        if s:
            mat *= decay
        top = p.argmax(axis=1)
        for i in range(L):
            if canvas[i] == MASK:
                mat[i, top[i]] += p[i, top[i]] ** boost
        f = x + alpha * np.log(mat + 1.0)
        q = np.exp(f - f.max(axis=1, keepdims=True))
        q /= q.sum(axis=1, keepdims=True)
        ftok, fconf = q.argmax(axis=1), q.max(axis=1)
        masked = [c == MASK for c in canvas]
        chosen = ref_threshold(fconf, masked, t)
        for i in range(L):
            if chosen[i]:
                canvas[i] = int(ftok[i])
        commits.append(chosen)
        if MASK not in canvas:
            break
    return commits, canvas


def stable_logits() -> np.ndarray:
    """Recorded logits whose favourite token never changes (where credit matters: a steady prediction)."""
    x = LOGITS.copy()
    fav = x[0].argmax(axis=1)
    x[:, np.arange(L), fav] += 6.0
    return x * 0.5


@pytest.mark.parametrize("t", [0.0, 0.5, 0.8, 0.9, 0.95, 1.0])
def test_credit_matches_dinfer_on_steady_predictions(t):
    logits = stable_logits()
    ref_commits, ref_canvas = ref_credit_block(logits, t)
    history, decisions, state = run_block(make_rule("credit"), knob=t, logits=logits)
    assert [d.commit.tolist() for d in decisions] == ref_commits
    assert history[-1].tolist() == ref_canvas
    assert len(state["credit"]) == L


def test_credit_is_faster_than_threshold_and_resumes():
    rule = make_rule("credit", threshold=0.7)
    steady = stable_logits()
    _, plain, _ = run_block(make_rule("threshold"), knob=0.7, logits=steady)
    hist, credit, _ = run_block(rule, logits=steady)
    assert len(credit) < len(plain)  # credit earned over the steps lets a steady prediction through sooner
    # zero alpha: no fusion, the threshold rule exactly (on logits whose favourites flip, too)
    for logits in (LOGITS, steady):
        zero = [d.commit.tolist() for d in run_block(make_rule("credit", alpha=0.0), knob=0.7, logits=logits)[1]]
        assert zero == [d.commit.tolist() for d in run_block(make_rule("threshold"), knob=0.7, logits=logits)[1]]
    # the credit state through JSON mid-block (a resumed request) changes nothing
    hist, _, _ = run_block(rule)
    again, _, _ = run_block(rule, resume_at=2)
    assert [h.tolist() for h in again] == [h.tolist() for h in hist]


# ---------------------------------------------------------------- joint_threshold

def ref_joint(logits_steps, canvas, t, edit_t, max_post, prompt=0):
    """SGLang's JointThreshold per step (M2T over t, at least one; T2T over edit_t on committed non-prompt
    positions whose argmax differs; post-edit steps counted once nothing is masked, finished past the bound
    or when nothing changes), with its trailing forward that only notices the end left out."""
    canvas = list(canvas)
    post = 0
    trace = []
    for logits in logits_steps:
        tokens, conf, _, _ = stats(logits, np.array(canvas))
        masked = [c == MASK for c in canvas]
        if any(masked):
            m2t = ref_threshold(conf, masked, t)
        else:
            m2t = [False] * L
            post += 1
            if post > max_post:
                break
        t2t = [i >= prompt and not masked[i] and conf[i] > edit_t and tokens[i] != canvas[i] for i in range(L)]
        if not any(m2t) and not any(t2t):
            trace.append((canvas.copy(), True))
            break
        for i in range(L):
            if m2t[i] or t2t[i]:
                canvas[i] = int(tokens[i])
        trace.append((canvas.copy(), False))
    return trace, post


@pytest.mark.parametrize("t,edit_t,max_post", [(0.5, 0.0, 16), (0.9, 0.5, 3), (0.7, 0.3, 0), (1.0, 0.0, 2),
                                               (0.0, 0.9, 5)])
def test_joint_threshold_against_reference(t, edit_t, max_post):
    rule = make_rule("joint_threshold", edit_threshold=edit_t, max_post_edit_steps=max_post)
    history, decisions, state = run_block(rule, knob=t)
    trace, _ = ref_joint(LOGITS, [MASK] * L, t, edit_t, max_post)
    canvases = [c for c, _ in trace]
    # the rule's canvases are the reference's, except that it stops one forward earlier at the bound
    assert [h.tolist() for h in history[1:]] == canvases[: len(history) - 1]
    assert history[-1].tolist() == canvases[-1]
    assert decisions[-1].done and not any(d.done for d in decisions[:-1])
    assert state.get("post_edit_steps", 0) <= max_post


def test_joint_threshold_edits_an_all_committed_block_up_to_the_bound():
    # a block all committed with tokens the recorded logits disagree with: post-edit steps only
    canvas = (stats(LOGITS[0], np.full(L, MASK))[0] + 1) % (V - 1)
    rule = make_rule("joint_threshold", edit_threshold=0.0, max_post_edit_steps=2)
    history, decisions, state = run_block(rule, canvas=canvas)
    assert not any(d.commit.any() for d in decisions)
    assert decisions[0].edit.all() and not decisions[0].done  # every position disagreed: all rewritten
    assert len(decisions) <= 2 and decisions[-1].done and state["post_edit_steps"] == len(decisions)
    # a bound of 0: the block is final as it stands, nothing rewritten
    d = make_rule("joint_threshold", max_post_edit_steps=0).decide(step_of(canvas, 0, {}))
    assert d.done and not d.edit.any() and not d.commit.any()
    # prompt positions are never edited (they are not editable)
    _, decisions, _ = run_block(rule, canvas=canvas, prompt=5)
    assert not any(d.edit[:5].any() for d in decisions)


def test_joint_threshold_state_survives_a_json_round_trip():
    rule = make_rule("joint_threshold", threshold=0.8, edit_threshold=0.2, max_post_edit_steps=4)
    hist, _, state = run_block(rule)
    again, _, state2 = run_block(rule, resume_at=len(hist) - 2)
    assert [h.tolist() for h in again] == [h.tolist() for h in hist] and state2 == state


def test_joint_threshold_config_is_validated():
    for field, bad in [("edit_threshold", 1.5), ("max_post_edit_steps", -1), ("penalty_lambda", -0.5),
                       ("threshold", float("nan")), ("max_post_edit_steps", 2.5)]:
        with pytest.raises(ValueError, match=field):
            make_rule("joint_threshold", **{field: bad})
    rule = make_rule("joint_threshold")
    assert rule.edits and "all_rows" in rule.needs and "canvas" in rule.needs
