"""The decoding-rule seam (engine/decoding/base.py): the registry, config validation, the BlockStep ->
Decision contract, apply_decision, and the ``threshold`` rule through it deciding as the old select did."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from engine.decoding import (
    RULES,
    BlockStep,
    Decision,
    DecodingRule,
    ThresholdRule,
    apply_decision,
    make_rule,
)


def _step(conf, masked=None, knob=None, **kw) -> BlockStep:
    conf = np.asarray(conf, dtype=np.float32)
    n = conf.shape[0]
    masked = np.ones(n, dtype=bool) if masked is None else np.asarray(masked, dtype=bool)
    return BlockStep(masked, np.zeros(n, dtype=bool), np.arange(100, 100 + n, dtype=np.int64), conf,
                     knob=knob, **kw)


def test_registry_names_and_errors():
    assert {"threshold", "dynamic", "low_confidence"} <= set(RULES)
    with pytest.raises(ValueError, match="unknown unmasking rule 'nope'.*threshold"):
        make_rule("nope")
    with pytest.raises(ValueError, match="unknown field 'thresh'.*threshold"):
        make_rule("threshold", thresh=0.5)
    with pytest.raises(ValueError, match=r"threshold must be a number in \[0, 1\]"):
        make_rule("threshold", threshold=1.5)
    with pytest.raises(ValueError, match="threshold"):
        make_rule("threshold", threshold="high")
    with pytest.raises(ValueError, match="k must be an integer"):
        make_rule("low_confidence", k=0)


def test_every_rule_speaks_the_protocol_and_round_trips_its_config():
    for name in RULES:
        rule = make_rule(name)
        assert isinstance(rule, DecodingRule) and rule.name == name
        assert rule.speed_sign in (-1, 1) and rule.knob_range[0] <= rule.default_knob() <= rule.knob_range[1]
        again = make_rule(name, **json.loads(json.dumps(rule.config())))
        assert again == rule
        with pytest.raises(ValueError, match=rule.knob):
            rule.check_knob(rule.knob_range[1] + 1 if rule.knob_range[1] < float("inf") else -1)
        # the router's level moves the knob monotonically, slower as the level rises
        knobs = [rule.knob_at(t) for t in (0.5, 0.6, 0.7, 0.8, 0.9)]
        assert all(rule.knob_range[0] <= k <= rule.knob_range[1] for k in knobs)
        assert all(rule.speed_sign * (a - b) >= 0 for a, b in zip(knobs, knobs[1:])), (name, knobs)


def _old_threshold_select(conf: torch.Tensor, t: float) -> torch.Tensor:
    """Remask's threshold rule as it was before the seam: conf > t, at least the top one."""
    chosen = conf > t
    if int(chosen.sum()) >= 1:
        return chosen
    chosen = chosen.clone()
    chosen[torch.topk(conf, 1).indices] = True
    return chosen


def test_threshold_decides_as_before_on_random_confidences():
    gen = torch.Generator().manual_seed(0)
    rule = ThresholdRule(0.9)
    for trial in range(200):
        n = 1 + trial % 32
        conf = torch.rand(n, generator=gen) ** 0.3
        t = float(torch.rand(1, generator=gen))
        assert rule.select(conf, 0, n, threshold=t).tolist() == _old_threshold_select(conf, t).tolist()
        d = rule.decide(_step(conf.numpy(), knob=t))
        assert d.commit.tolist() == _old_threshold_select(conf, t).tolist()
        assert d.done == bool(d.commit.all()) and not d.edit.any()


def test_threshold_block_step_semantics():
    rule = ThresholdRule(0.9)
    # only masked positions commit; an unmasked position's high confidence is ignored
    d = rule.decide(_step([0.99, 0.95, 0.2, 0.5], masked=[False, True, True, True]))
    assert d.commit.tolist() == [False, True, False, False] and not d.done
    # nothing over the threshold: the most confident masked position commits
    d = rule.decide(_step([0.99, 0.3, 0.2, 0.5], masked=[False, True, True, True]))
    assert d.commit.tolist() == [False, False, False, True]
    # the last masked position: done
    d = rule.decide(_step([0.1, 0.3], masked=[False, True]))
    assert d.commit.tolist() == [False, True] and d.done
    # knob ends: 1 commits one at a time, 0 commits all with any confidence
    assert rule.decide(_step([1.0, 1.0, 1.0], knob=1.0)).commit.sum() == 1
    assert rule.decide(_step([0.01, 0.02, 0.5], knob=0.0)).commit.all()
    with pytest.raises(ValueError, match="threshold"):
        rule.decide(_step([0.5], knob=1.01))


def test_apply_decision_reference():
    step = _step([0.95, 0.1, 0.97], masked=[True, True, False])
    step.editable[2] = True
    block = np.array([7, 7, 55])
    d = Decision(np.array([True, False, False]), np.array([False, False, True]), False)
    assert apply_decision(block, step, d).tolist() == [100, 7, 102]
    assert block.tolist() == [7, 7, 55]  # a copy
    with pytest.raises(ValueError, match="not masked"):
        apply_decision(block, step, Decision(np.array([False, False, True]), np.zeros(3, bool), False))
    with pytest.raises(ValueError, match="not editable"):
        apply_decision(block, step, Decision(np.zeros(3, bool), np.array([True, False, False]), False))


def test_rules_import_without_torch():
    """The router, the simulator and the predictors read rule metadata: the rules must not need torch."""
    code = ("import sys; import engine.decoding as d; r = d.make_rule('threshold'); "
            "print('torch' in sys.modules, r.knob_at(0.8))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "0.8"]


def test_per_position_statistics_the_rules_need():
    from engine.decoding import confidence, entropy, penalise_previous, token_prob

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 11, generator=gen) * 3
    mask = 10
    p = torch.softmax(logits[:, :mask].double(), dim=-1)  # the mask token's column excluded
    assert torch.allclose(entropy(logits, mask).double(), -(p * p.log()).sum(-1), atol=1e-5)
    conf, tok = confidence(logits, mask)
    assert torch.allclose(token_prob(logits, tok, mask), conf)
    assert token_prob(logits, torch.full((5,), mask), mask).eq(0).all()  # a masked position: 0
    prev = torch.tensor([tok[0].item(), -1, 3, 3, 0])
    out = penalise_previous(logits, prev, 2.5)
    diff = logits - out
    assert diff[0, tok[0]] == 2.5 and diff[1].eq(0).all() and diff[2, 3] == 2.5 and diff.abs().sum() == 2.5 * 4
    assert torch.equal(penalise_previous(logits, prev, 0.0), logits)
