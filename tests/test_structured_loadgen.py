"""``remask loadgen bench``'s structured-output datasets (issue 42 item 4): vLLM's ``json`` user-profile prompt
and Remask's ``regex`` / ``choice`` task prompts, the fraction of requests constrained, the constraint in each
request's body, and the validity check of the answers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from loadgen.bench import USER_PROFILE, build_trace, load_tokenizer, structured_prompts, valid_structured


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny-bd")


def test_json_dataset_is_vllms_prompt_with_the_schema(tok, tmp_path):
    ps = structured_prompts(tok, "json", 6, output_len=128)
    assert len(ps) == 6 and all(p.output_len == 128 for p in ps)
    assert ps[0].prompt.startswith("Generate an example of a user profile given the following schema: {")
    assert ps[0].constraint == {"structured_outputs": {"json": USER_PROFILE}}
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    assert structured_prompts(tok, "json", 1, schema_path=str(tmp_path / "s.json"))[0].constraint == \
        {"structured_outputs": {"json": schema}}
    with pytest.raises(ValueError, match="--json-schema-path"):
        structured_prompts(tok, "json", 1, schema_path=str(tmp_path / "missing.json"))


def test_regex_and_choice_datasets_and_the_ratio(tok):
    regex = structured_prompts(tok, "regex", 20, seed=1)
    assert len(regex) == 20 and all("guided_regex" in p.constraint for p in regex)
    assert all(valid_structured(p.constraint, p.answer) for p in regex)  # every reference answer is valid
    choice = structured_prompts(tok, "choice", 5)
    assert {p.category for p in choice} == {"choice"}
    assert all(p.constraint == {"guided_choice": ["a", "b", "c", "d"]} for p in choice)
    half = structured_prompts(tok, "regex", 20, seed=1, ratio=0.5)
    assert sum(p.constraint is not None for p in half) == 10 and all(p.language for p in half)
    trace = build_trace(half, np.zeros(20), "completion", {"temperature": 0}, "s-")
    assert all(t.extra.get("temperature") == 0 for t in trace)
    assert [("guided_regex" in t.extra) for t in trace] == [p.constraint is not None for p in half]
    with pytest.raises(ValueError, match="structured-output-ratio"):
        structured_prompts(tok, "regex", 2, ratio=1.5)


def test_validity_of_answers():
    assert valid_structured({"guided_regex": "[0-9]{2}"}, "42") and not valid_structured({"guided_regex": "[0-9]{2}"},
                                                                                           "4")
    assert valid_structured({"guided_choice": ["a", "b"]}, "b") and not valid_structured({"guided_choice": ["a"]}, "c")
    schema = {"structured_outputs": {"json": USER_PROFILE}}
    good = {"name": "Ada", "age": 36, "email": "ada@lovelace.com", "active": True}
    assert valid_structured(schema, json.dumps(good))
    assert not valid_structured(schema, json.dumps({**good, "age": 200}))
    assert not valid_structured(schema, json.dumps({**good, "extra": 1}))
    assert not valid_structured(schema, '{"name": ')
