from __future__ import annotations

import json
import random
import re

import pytest
import torch

import tasksuite as tasks
from engine.models.checkpoint import load_remask
from engine.tokenizer import CharTokenizer
from tools import training


@pytest.mark.parametrize("name", ["tiny-bd", "tiny-mdm"])
def test_batches_match_the_decoding_conditions(name):
    tok = CharTokenizer.default()
    rng = random.Random(0)
    batch = training.make_batch(name, [tasks.sample(rng) for _ in range(16)], tok, rng)
    on = batch.targets != -100
    assert on.any()
    assert (batch.input_ids[on] == tok.mask_token_id).all()  # loss only where the input is masked
    if name == "tiny-bd":
        # one noisy block per row, ending the row: nothing after it
        for row, tgt in zip(batch.input_ids, batch.targets):
            idx = torch.nonzero(tgt != -100).flatten()
            real = int((row != tok.pad_token_id).nonzero().max()) + 1
            assert idx.max() < real and real - idx.min() <= training.BLOCK


@pytest.mark.slow
def test_short_training_lowers_the_loss_and_saves_a_loadable_checkpoint(tmp_path):
    log = tmp_path / "log.jsonl"
    out = training.train("tiny-bd", tmp_path / "m", steps=80, batch_size=8, progress=False, log_path=log,
                         seed=1, log_every=10)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(rows) == 8 and rows[-1]["loss"] < rows[0]["loss"] - 0.3
    model = load_remask(out)
    assert model.config.attention == "block_causal" and (out / "tokenizer.json").exists()
    with pytest.raises(ValueError, match="unknown default model"):
        training.default_config("nope", CharTokenizer.default())


def test_average_checkpoints_is_the_mean_of_the_weights(tmp_path):
    a = training.train("tiny-bd", tmp_path / "a", steps=2, batch_size=4, progress=False, seed=1)
    b = training.train("tiny-bd", tmp_path / "b", steps=2, batch_size=4, progress=False, seed=2)
    out = training.average_checkpoints([a, b], tmp_path / "avg")
    ma, mb, mo = (load_remask(d).state_dict() for d in (a, b, out))
    for k in mo:
        torch.testing.assert_close(mo[k], (ma[k] + mb[k]) / 2)
    assert not torch.equal(ma["lm_head.weight"], mb["lm_head.weight"])
    assert (out / "tokenizer.json").read_text() == (a / "tokenizer.json").read_text()
    with pytest.raises(ValueError, match="at least two"):
        training.average_checkpoints([a], tmp_path / "x")


@pytest.mark.parametrize("name", ["tiny-bd", "tiny-mdm"])
def test_recall_examples_mask_exactly_the_repeated_needles(name):
    tok = CharTokenizer.default()
    rng = random.Random(3)
    for _ in range(20):
        ex = training.recall_example(rng)
        assert not tasks.is_heldout(ex.prompt) and ex.category == training.RECALL
        (ids, tgt, _, _), = training.build_rows(name, [ex], tok, rng, lookup_canvas=24)
        first = len(tok.prompt_ids(ex.prompt, training.BLOCK)) - 1 - len(ex.prompt)
        masked = [i - first for i, t in enumerate(tgt) if t != -100 and 0 <= i - first < len(ex.prompt)]
        assert all(ids[first + c] == tok.mask_token_id for c in masked)
        # the masked characters are the digits of the needles whose key came earlier, and only those
        needles = [(m.start(2), m.group(1), m.group(2)) for m in re.finditer(r"(?:^| )([a-z])=(\d\d)\.", ex.prompt)]
        seen, want = {}, []
        for start, key, value in needles:
            if key in seen:
                assert seen[key] == value  # a repeat states the same value
                want += [start, start + 1]
            seen[key] = value
        assert masked == want and len(want) >= 4
        assert "".join(tok.decode([tgt[first + c]]) for c in masked) == "".join(
            ex.prompt[c] for c in masked)


def test_mix_accepts_recall_and_rejects_unknown_names(tmp_path):
    out = training.train("tiny-mdm", tmp_path / "m", steps=2, batch_size=4, progress=False,
                         mix={"recall": 1.0}, lookup_canvas=16)
    assert (out / "model.safetensors").exists()
    with pytest.raises(ValueError, match="unknown categories in mix.*known: choice"):
        training.train("tiny-mdm", tmp_path / "x", steps=1, batch_size=4, progress=False, mix={"nope": 1.0})
    with pytest.raises(ValueError, match="multiple of 8"):
        training.train("tiny-mdm", tmp_path / "x", steps=1, batch_size=4, progress=False, lookup_canvas=12)
    assert not (tmp_path / "x").exists()  # refused before any work


def test_new_ids_only_trains_the_new_rows_and_leaves_every_other_weight(tmp_path):
    from engine.tokenizer import CHARS, SPECIALS

    base = training.train("tiny-bd", tmp_path / "base", steps=1, batch_size=2, progress=False, seed=1)
    narrow = CharTokenizer({t: i for i, t in enumerate(SPECIALS + CHARS[:51])})  # before the JSON characters
    narrow.save(base)
    fresh = training.new_ids(narrow, CharTokenizer.default())
    assert fresh == list(range(57, 64))
    out = training.train("tiny-bd", tmp_path / "json", steps=3, batch_size=4, progress=False, seed=2, init=base,
                         new_ids_only=True, mix={"json": 1.0}, lr=1e-2)
    before, after = load_remask(base).state_dict(), load_remask(out).state_dict()
    for k in before:
        if k in ("embed_tokens.weight", "lm_head.weight"):
            assert torch.equal(before[k][:57], after[k][:57]), k  # AdamW's decay undone too
            assert not torch.equal(before[k][57:], after[k][57:]), k
        else:
            assert torch.equal(before[k], after[k]), k
    assert CharTokenizer.load(out).vocab == CharTokenizer.default().vocab
    with pytest.raises(ValueError, match="no new rows"):
        training.train("tiny-bd", tmp_path / "x", steps=1, batch_size=2, progress=False, init=out, new_ids_only=True)
    with pytest.raises(ValueError, match="give init"):
        training.train("tiny-bd", tmp_path / "x", steps=1, batch_size=2, progress=False, new_ids_only=True)
