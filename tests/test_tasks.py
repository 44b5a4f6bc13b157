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


def test_json_category_answers_are_small_objects_checked_as_json():
    rng = random.Random(4)
    forms = set()
    for _ in range(300):
        ex = tasks.sample(rng, tasks.JSON)
        assert ex.check(ex.answer) and tasks.json_valid(ex.prompt, ex.answer), ex
        forms.add(tuple(tasks.json_schema_for(ex.prompt)["required"]))
    assert forms == {("pick", "value"), ("items",)}
    prompt = "json: max a3 b7 c1 d5"
    assert tasks.check("json", prompt, '{"pick":"b","value":7}')
    assert tasks.check("json", prompt, '{ "value": 7, "pick": "b" }')  # whitespace and key order are free
    for wrong in ('{"pick":"b","value":3}', '{"pick":"a","value":7}', '{"pick":"b"}', '{"pick":"b","value":7',
                  '{"pick":"b","value":7.5}', "b"):
        assert not tasks.check("json", prompt, wrong), wrong
    assert tasks.check("json", "json: sort 7 2 9", '{"items":[2,7,9]}')
    assert not tasks.check("json", "json: sort 7 2 9", '{"items":[7,2,9]}')
    assert not tasks.check("json", "json: sort 1 0 2", '{"items":[false,true,2]}')  # JSON booleans are not 0/1
    # the hand validator is the schema: valid answers of the other form, bad enums, bounds and extra keys
    assert tasks.json_valid(prompt, '{"pick":"d","value":0}') and not tasks.json_valid(prompt, '{"items":[1,2,3]}')
    assert not tasks.json_valid(prompt, '{"pick":"e","value":1}')
    assert not tasks.json_valid(prompt, '{"pick":"a","value":10}')
    assert not tasks.json_valid("json: sort 7 2 9", '{"items":[1,2]}')
    assert not tasks.json_valid("json: sort 7 2 9", '{"items":[1,2,3],"x":1}')


def test_json_is_outside_the_core_suite_unless_asked_for():
    assert tasks.JSON not in tasks.CATEGORIES and tasks.ALL_CATEGORIES == (*tasks.CATEGORIES, tasks.JSON)
    assert {e.category for e in tasks.heldout_set(60)} == set(tasks.CATEGORIES)
    mixed = tasks.heldout_set(60, categories=tasks.ALL_CATEGORIES)
    assert [e.category for e in mixed[:6]] == list(tasks.ALL_CATEGORIES) and all(tasks.is_heldout(e.prompt)
                                                                              for e in mixed)
    with pytest.raises(ValueError, match="unknown category 'jsn'"):
        tasks.sample(random.Random(0), "jsn")


def test_the_tokenizer_writes_json():
    tok = CharTokenizer.default()
    text = '{"name":"get_weather","arguments":{"city":"paris","days":[1,2]}} \\\\'
    assert tok.vocab_size == 64 and tok.unk_token_id not in tok.encode(text)
    assert tok.decode(tok.encode(text)) == text
