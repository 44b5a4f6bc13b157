from __future__ import annotations

import random

import pytest

import tasksuite as tasks
from engine.tokenizer import CharTokenizer


def test_every_generated_answer_checks_and_splits_are_disjoint():
    rng = random.Random(1)
    for split in ("train", "heldout"):
        for _ in range(500):
            ex = tasks.sample(rng, split=split)
            assert ex.check(ex.answer), ex
            assert tasks.is_heldout(ex.prompt) == (split == "heldout")


def test_checks_reject_wrong_answers():
    assert tasks.check("arith", "57+8=", "65") and not tasks.check("arith", "57+8=", "64")
    assert tasks.check("choice", "max: a7 b2 c9 d4", "c") and not tasks.check("choice", "min: a7 b2 c9 d4", "c")
    assert tasks.check("reverse", "rev: abc", "cba") and not tasks.check("reverse", "rev: abc", "abc")
    prompt = "owl=36. rain fell. elk=75. owl?"
    assert tasks.check("lookup", prompt, "36") and not tasks.check("lookup", prompt, "75")


def test_prose_accepts_every_valid_choice_and_rejects_parallel_decoding_errors():
    ok = "the fox was calm. it sat by the river. code 101. the end."
    assert tasks.check("prose", "story: fox 2", ok)
    assert tasks.check("prose", "story: fox 2", ok.replace("calm", "happy").replace("101", "011"))
    assert not tasks.check("prose", "story: fox 2", ok.replace("101", "111"))  # all-ones code
    assert not tasks.check("prose", "story: fox 2", ok.replace("fox was", "cat was"))  # wrong topic
    assert not tasks.check("prose", "story: fox 3", ok)  # wrong sentence count
    with pytest.raises(ValueError):
        tasks.check("nope", "", "")


def test_heldout_set_is_fixed_and_balanced():
    a, b = tasks.heldout_set(50), tasks.heldout_set(50)
    assert a == b
    assert {e.category for e in a} == set(tasks.CATEGORIES)


def test_tokenizer_round_trip_and_hf_compatibility(tmp_path):
    tok = CharTokenizer.default()
    text = "story: fox 3\nthe end."
    assert tok.decode(tok.encode(text)) == text
    ids = tok.prompt_ids("57+8=", 8)
    assert len(ids) % 8 == 0 and ids[-1] == tok.sep_token_id
    tok.save(tmp_path)
    assert CharTokenizer.load(tmp_path).vocab == tok.vocab
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    assert hf.encode(text, add_special_tokens=False) == tok.encode(text)
    assert hf.decode(tok.encode(text)) == text
