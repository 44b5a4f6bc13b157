"""Tests for the OpenAI-compatible request/response layer (app.api) and the ingress metrics (app.metrics)."""

from __future__ import annotations

import importlib.metadata
import json

import pytest

from app.api import (
    CHAT_NOOPS,
    COMPLETION_NOOPS,
    INT64_MAX,
    INT64_MIN,
    MAX_PROMPTS,
    MESSAGE_NOOPS,
    STREAM_OPTIONS,
    TOKEN_ID_MAX,
    APIError,
    GenRequest,
    TokenizeRequest,
    canvas_chunk,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    detokenize_response,
    model_response,
    models_response,
    parse_detokenize,
    parse_request,
    parse_tokenize,
    rate_limit_error,
    request_schema,
    sse,
    tokenize_response,
    usage_chunk,
    version_response,
)
from app.api.schemas import STRUCTURED_FIELDS

MODELS = ["dream-tiny", "llada-tiny"]
LIMIT = 256
DEFAULT = 64
VOCAB = 100
USER = [{"role": "user", "content": "a"}]


def parse(kind: str, body, **kw) -> GenRequest:
    raw = body if isinstance(body, (bytes, str)) else json.dumps(body)
    opts = dict(known_models=MODELS, max_tokens_limit=LIMIT, default_max_tokens=DEFAULT)
    opts.update(kw)
    return parse_request(kind, raw, **opts)


def check_error(err: APIError, status: int, param: str | None, code: str | None) -> APIError:
    assert err.status == status
    assert err.param == param
    if code != "<any>":
        assert err.code == code
    body_dict = err.to_dict()
    assert set(body_dict) == {"error"}
    assert set(body_dict["error"]) == {"message", "type", "param", "code"}
    assert body_dict["error"]["type"] == "invalid_request_error"
    assert body_dict["error"]["param"] == param
    assert isinstance(body_dict["error"]["message"], str) and body_dict["error"]["message"]
    json.dumps(body_dict)
    return err


def expect_error(kind: str, body, status: int = 400, param: str | None = None, code: str | None = "<any>",
                 **kw) -> APIError:
    with pytest.raises(APIError) as info:
        parse(kind, body, **kw)
    return check_error(info.value, status, param, code)


def body_of(kind: str, **fields) -> dict:
    """A minimal valid body of ``kind`` with ``fields`` added."""
    return {"prompt": "a", **fields} if kind == "completion" else {"messages": USER, **fields}


# ---------------------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("raw", [b"{not json", b"", b"\xff\xfe", b'{"prompt": "a",}'])
def test_invalid_json(kind, raw):
    expect_error(kind, raw, param=None, code="invalid_json")


@pytest.mark.parametrize("raw", [b"[]", b'"text"', b"3", b"null"])
def test_body_not_object(raw):
    expect_error("completion", raw, param=None)


@pytest.mark.parametrize("body,param", [
    ({"prompt": "a", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "a", "stream": "perhaps"}, "stream"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": ["a", 3]}, "prompt"),
    ({"prompt": "a", "stop": 7}, "stop"),
    ({"prompt": "a", "threshold": "high"}, "threshold"),
    ({"prompt": "a", "priority": "urgent"}, "priority"),
    ({"prompt": "a", "model": 12}, "model"),
    ({"prompt": "a", "stream_options": {"include_usage": "maybe"}, "stream": True}, "stream_options.include_usage"),
    ({"prompt": "a", "stream_options": 3, "stream": True}, "stream_options"),
    # strict types: a numeric string, a float or a boolean is not an integer; a boolean is not a number
    ({"prompt": "a", "max_tokens": "8"}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 8.0}, "max_tokens"),
    ({"prompt": "a", "max_tokens": True}, "max_tokens"),
    ({"prompt": "a", "n": True}, "n"),
    ({"prompt": "a", "temperature": True}, "temperature"),
    ({"prompt": "a", "temperature": "0.5"}, "temperature"),
    ({"prompt": "a", "top_p": [1]}, "top_p"),
    ({"prompt": "a", "top_k": 1.5}, "top_k"),
    ({"prompt": "a", "seed": "1"}, "seed"),
    ({"prompt": "a", "user": 5}, "user"),
    ({"prompt": "a", "stream": 1}, "stream"),
])
def test_completion_validation_param(body, param):
    err = expect_error("completion", body, param=param)
    if param not in ("prompt", "stop"):
        assert err.code == "invalid_type" and "expected" in err.message, err


@pytest.mark.parametrize("body,param,code", [
    ({"messages": "hi"}, "messages", "invalid_type"),
    ({"messages": ["hi"]}, "messages.0", "invalid_type"),
    ({"messages": [{"role": "user"}]}, "messages.0.content", "missing_required_parameter"),
    ({"messages": [{"role": "user", "content": "a"}, {"content": "b"}]}, "messages.1.role",
     "missing_required_parameter"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0.content", "invalid_type"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages.0.content", "invalid_type"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "invalid_type"),
    ({"messages": [{"role": "user", "content": []}]}, "messages.0.content", "empty_array"),
    ({"messages": [{"role": "user", "content": ["a"]}]}, "messages.0.content.0", "invalid_type"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages.0.content.0.type", "unsupported_value"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_audio"}]}]},
     "messages.0.content.1.type", "unsupported_value"),
    ({"messages": [{"role": "user", "content": [{"text": "a"}]}]}, "messages.0.content.0.type",
     "missing_required_parameter"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0.text",
     "missing_required_parameter"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, "messages.0.content.0.text",
     "invalid_type"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {}}]}]},
     "messages.0.content.0.cache_control", "unknown_parameter"),
    ({"messages": [{"role": 3, "content": "a"}]}, "messages.0.role", "invalid_type"),
    ({"messages": [{"role": "user", "content": "a", "name": 3}]}, "messages.0.name", "invalid_type"),
    ({"messages": [{"role": "user", "content": "a", "weight": 1}]}, "messages.0.weight", "unknown_parameter"),
    ({"messages": USER, "add_generation_prompt": "yes"}, "add_generation_prompt", "invalid_type"),
    ({"messages": USER, "safety_identifier": 5}, "safety_identifier", "invalid_type"),
])
def test_chat_validation_param(body, param, code):
    expect_error("chat", body, param=param, code=code)


def test_missing_prompt_and_messages():
    assert "prompt" in expect_error("completion", {"model": "dream-tiny"}, param="prompt").message
    expect_error("completion", {"prompt": None}, param="prompt")
    expect_error("chat", {"model": "dream-tiny"}, param="messages", code="missing_required_parameter")
    expect_error("chat", {"messages": []}, param="messages", code="empty_array")


def test_unknown_model_is_404():
    err = expect_error("completion", {"model": "gpt-4", "prompt": "a"}, status=404, param="model",
                       code="model_not_found")
    assert "gpt-4" in err.message
    expect_error("chat", {"model": "nope", "messages": USER}, status=404, param="model", code="model_not_found")
    expect_error("completion", {"prompt": "a"}, status=404, param="model", known_models=[])


@pytest.mark.parametrize("value", [0, -3, LIMIT + 1, 10**9])
def test_max_tokens_bounds(value):
    expect_error("completion", {"prompt": "a", "max_tokens": value}, param="max_tokens")
    expect_error("chat", {"messages": USER, "max_tokens": value}, param="max_tokens")


def test_max_completion_tokens_bounds():
    expect_error("chat", {"messages": USER, "max_completion_tokens": LIMIT + 1}, param="max_completion_tokens")


@pytest.mark.parametrize("value", [0, -0.5, 1.0001, 7])
def test_threshold_bounds(value):
    expect_error("completion", {"prompt": "a", "threshold": value}, param="threshold")


@pytest.mark.parametrize("field", ["threshold", "temperature", "top_p", "slo_ms"])
@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_rejected(field, literal):
    expect_error("completion", f'{{"prompt": "a", "{field}": {literal}}}', param=field)


def test_negative_slo():
    expect_error("completion", {"prompt": "a", "slo_ms": -1}, param="slo_ms")
    expect_error("chat", {"messages": USER, "slo_ms": -0.1}, param="slo_ms")


@pytest.mark.parametrize("n", [0, 2, 5])
def test_n_past_the_servers_limit_refused(n):
    expect_error("completion", {"prompt": "a", "n": n}, param="n")  # max_n 1 (the parser's default)
    expect_error("chat", {"messages": USER, "n": n}, param="n")
    if n:
        err = expect_error("chat", {"messages": USER, "n": n + 5}, param="n", max_n=n + 4)
        assert f"1 to {n + 4}" in err.message
        assert parse("chat", {"messages": USER, "n": n}, max_n=4 if n < 5 else 5).n == n


def test_n_one_accepted():
    assert parse("completion", {"prompt": "a", "n": 1}).prompts == ["a"]
    assert parse("chat", {"messages": USER, "n": None}).messages == USER


def test_best_of_equal_to_n_is_a_noop():
    assert parse("completion", {"prompt": "a", "n": 3, "best_of": 3}, max_n=4).n == 3
    expect_error("completion", {"prompt": "a", "n": 2, "best_of": 3}, param="best_of", max_n=4,
                 code="unsupported_parameter")


def test_unknown_kind():
    with pytest.raises(ValueError):
        parse("embedding", {"prompt": "a"})


def test_api_error_shapes():
    err = APIError(500, "boom", type="server_error")
    assert err.to_dict() == {"error": {"message": "boom", "type": "server_error", "param": None, "code": None}}
    assert err.headers == {}
    rl = rate_limit_error("slow down", retry_after_s=1.2)
    assert rl.status == 429 and rl.type == "rate_limit_error" and rl.headers == {"Retry-After": "2"}
    assert rl.to_dict()["error"]["type"] == "rate_limit_error"


# ---------------------------------------------------------------------------------------------------------------
# No silent ignores: every field is implemented, accepted only at its default, or refused
# ---------------------------------------------------------------------------------------------------------------


# A value each unimplemented field would act on (so it is refused), for every field of the no-op tables.
# vLLM's and SGLang's extras: a value each would act on
VLLM_BAD = {"repetition_penalty": 1.1, "min_p": 0.05, "min_tokens": 4, "use_beam_search": True, "length_penalty": 0.5,
            "skip_special_tokens": False, "spaces_between_special_tokens": False, "include_stop_str_in_output": True,
            "truncate_prompt_tokens": 16, "prompt_logprobs": 1, "allowed_token_ids": [1, 2], "bad_words": ["x"],
            "logits_processors": ["x"], "return_tokens_as_token_ids": True, "detokenize": False,
            "no_stop_trim": True, "lora_path": "adapter", "return_hidden_states": True}
COMPLETION_BAD = {"best_of": 2, "frequency_penalty": 0.5, "presence_penalty": -1, "add_special_tokens": False,
                  "logit_bias": {"50": -100}, "suffix": "end", **VLLM_BAD}
CHAT_BAD = {"best_of": 2, "top_logprobs": 3, "add_special_tokens": True,
            "chat_template_kwargs": {"enable_thinking": True},
            **VLLM_BAD, "frequency_penalty": 0.5, "presence_penalty": 1, "logit_bias": {"50": 5},
            "functions": [{"name": "f"}], "function_call": "auto",
            "modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"},
            "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "low", "service_tier": "flex",
            "store": True, "metadata": {"k": "v"}, "web_search_options": {}, "verbosity": "low",
            "prompt_cache_key": "k", "continue_final_message": True}
NOOPS = {"completion": COMPLETION_NOOPS, "chat": CHAT_NOOPS}
BAD = {"completion": COMPLETION_BAD, "chat": CHAT_BAD}


def test_bad_value_tables_cover_every_noop_field():
    assert set(COMPLETION_BAD) == set(COMPLETION_NOOPS)
    assert set(CHAT_BAD) == set(CHAT_NOOPS)


@pytest.mark.parametrize("kind,field", [(k, f) for k in BAD for f in BAD[k]])
def test_unsupported_field_refused(kind, field):
    err = expect_error(kind, body_of(kind, **{field: BAD[kind][field]}), param=field, code="unsupported_parameter")
    assert err.message.startswith(f"Remask does not support '{field}'.")


@pytest.mark.parametrize("kind,field,value", [(k, f, v) for k in NOOPS for f in NOOPS[k] for v in NOOPS[k][f]])
def test_unsupported_field_default_accepted(kind, field, value):
    req = parse(kind, body_of(kind, **{field: value}))
    assert req.kind == kind


@pytest.mark.parametrize("kind,field,value", [
    ("completion", "frequency_penalty", 0.0), ("chat", "presence_penalty", 0.0), ("completion", "best_of", 1),
    ("chat", "logit_bias", {}), ("chat", "tools", []), ("chat", "modalities", ["text"]),
    ("chat", "service_tier", "default"), ("chat", "response_format", {"type": "text"}),
])
def test_numeric_and_empty_defaults_accepted(kind, field, value):
    parse(kind, body_of(kind, **{field: value}))


@pytest.mark.parametrize("kind,field,value", [
    # JSON booleans are not numbers (and numbers are not booleans): not the default, refused
    ("completion", "frequency_penalty", False), ("completion", "best_of", True), ("completion", "min_p", False),
    ("chat", "top_logprobs", False), ("chat", "store", 0), ("completion", "suffix", False),
    ("chat", "modalities", "text"),
])
def test_lookalike_defaults_refused(kind, field, value):
    expect_error(kind, body_of(kind, **{field: value}), param=field, code="unsupported_parameter")


@pytest.mark.parametrize("kind,field", [
    ("completion", "some_future_field"), ("chat", "some_future_field"), ("completion", "chat_template"),
    ("completion", "chat_template_kwargs"), ("completion", "mm_processor_kwargs"), ("chat", "guided_decoding_backend"),
    # fields of the other endpoint
    ("completion", "messages"), ("completion", "max_completion_tokens"), ("completion", "add_generation_prompt"),
    ("completion", "tools"), ("completion", "response_format"), ("completion", "safety_identifier"),
    ("completion", "top_logprobs"), ("chat", "prompt"), ("chat", "echo"), ("chat", "suffix"),
])
def test_unknown_field_refused(kind, field):
    err = expect_error(kind, body_of(kind, **{field: None}), param=field, code="unknown_parameter")
    assert err.message == f"Unrecognized request argument supplied: {field}"


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("key", ["include_obfuscation", "x"])
def test_unknown_stream_options_refused(kind, key):
    body = body_of(kind, stream=True, stream_options={"include_usage": True, key: True})
    err = expect_error(kind, body, param=f"stream_options.{key}", code="unknown_parameter")
    assert err.message == f"Unrecognized request argument supplied: stream_options.{key}"


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_include_canvas_is_remasks_stream_extension(kind):
    req = parse(kind, body_of(kind, stream=True, stream_options={"include_canvas": True}))
    assert req.include_canvas and not req.include_usage
    assert not parse(kind, body_of(kind, stream=True)).include_canvas
    view = {"step": 3, "block": [8, 16], "committed": [[9, 5, "a"]], "masked": [10], "threshold": 0.9,
            "length": 32, "instance": 0, "tp": 1}
    chunk = canvas_chunk(req, view, index=0)
    assert chunk["choices"] == [] and chunk["remask_canvas"]["round"] == 3 and "step" not in chunk["remask_canvas"]
    assert chunk["object"] == ("chat.completion.chunk" if kind == "chat" else "text_completion")


def test_stream_options_need_stream():
    for options in ({"include_usage": True}, {"include_usage": False}):
        for stream in (False, None):
            expect_error("completion", body_of("completion", stream=stream, stream_options=options),
                         param="stream_options", code="invalid_value")
    # absent, null or empty options: nothing asked, nothing to refuse
    for options in (None, {}):
        assert parse("completion", body_of("completion", stream_options=options)).include_usage is False
    assert parse("completion", body_of("completion", stream=True)).include_usage is False
    assert parse("chat", body_of("chat", stream=True, stream_options={"include_usage": None})).include_usage is False


def test_message_fields():
    # what the client's own ChatCompletionMessage.model_dump() carries, sent back in a conversation
    replayed = {"role": "assistant", "content": "4", "refusal": None, "annotations": None, "audio": None,
                "function_call": None, "tool_calls": None}
    req = parse("chat", {"messages": [*USER, replayed, {"role": "user", "content": "b", "name": "bob",
                                                        "tool_call_id": None}]})
    assert req.messages == [*USER, {"role": "assistant", "content": "4"},
                            {"role": "user", "content": "b", "name": "bob"}]
    assert parse("chat", {"messages": [{"role": "user", "content": "a", "name": None}]}).messages == USER


@pytest.mark.parametrize("field,value", [("function_call", {"name": "f"}),
                                         ("refusal", "no"), ("audio", {"id": "a"}), ("annotations", [{}])])
def test_message_unsupported_fields(field, value):
    assert field in MESSAGE_NOOPS
    msg = {"role": "assistant", "content": "x", field: value}
    expect_error("chat", {"messages": [msg]}, param=f"messages.0.{field}", code="unsupported_parameter")


# ---------------------------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt,prompts", [
    ("Hello", ["Hello"]),
    (["one"], ["one"]),
    (["one", "two", "three"], ["one", "two", "three"]),
    ([5, 0, 99], [[5, 0, 99]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
    ([[7]], [[7]]),
    (["x"] * MAX_PROMPTS, ["x"] * MAX_PROMPTS),
])
def test_prompt_forms(prompt, prompts):
    req = parse("completion", {"prompt": prompt}, vocab_size=VOCAB)
    assert req.prompts == prompts and req.messages == []
    if len(prompts) == 1:
        assert req.prompt == prompts[0]
    else:
        with pytest.raises(ValueError):
            _ = req.prompt


@pytest.mark.parametrize("prompt,code", [
    ("", "empty_string"), ([], "empty_array"), ([""], "empty_string"), (["a", ""], "empty_string"),
    ([[]], "empty_array"), ([[1], []], "empty_array"),
    (["a", 1], "invalid_type"), ([1, "a"], "invalid_type"), ([[1], "a"], "invalid_type"), ([1, [2]], "invalid_type"),
    ([True], "invalid_type"), ([1, False], "invalid_type"), ([[True]], "invalid_type"), ([1.0], "invalid_type"),
    ([[1.5]], "invalid_type"), ([["a"]], "invalid_type"), ([[[1]]], "invalid_type"), ({"text": "a"}, "invalid_type"),
    (json.loads("[" * 200 + "]" * 200), "invalid_type"),
    (["x"] * (MAX_PROMPTS + 1), "array_above_max_length"), ([[1]] * 5000, "array_above_max_length"),
])
def test_bad_prompts(prompt, code):
    expect_error("completion", {"prompt": prompt}, param="prompt", code=code)


def test_token_ids_within_the_vocabulary():
    assert parse("completion", {"prompt": [0, VOCAB - 1]}, vocab_size=VOCAB).prompts == [[0, VOCAB - 1]]
    err = expect_error("completion", {"prompt": [1, VOCAB]}, param="prompt", code="invalid_value", vocab_size=VOCAB)
    assert str(VOCAB) in err.message
    err = expect_error("completion", {"prompt": [[1], [2, VOCAB + 5]]}, param="prompt", vocab_size=VOCAB)
    assert "prompt 1" in err.message
    for bad in ([-1], [[3], [-2]]):  # negative: never a token id
        expect_error("completion", {"prompt": bad}, param="prompt")
        expect_error("completion", {"prompt": bad}, param="prompt", vocab_size=VOCAB)
    # without a vocabulary size, any id a 32-bit index holds
    assert parse("completion", {"prompt": [10**6, TOKEN_ID_MAX]}).prompts == [[10**6, TOKEN_ID_MAX]]
    expect_error("completion", {"prompt": [TOKEN_ID_MAX + 1]}, param="prompt")


# ---------------------------------------------------------------------------------------------------------------
# Sampling and stop
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_sampling_defaults(kind):
    req = parse(kind, body_of(kind))
    assert (req.temperature, req.top_p, req.top_k, req.seed) == (None, None, None, None)
    assert req.stop == [] and req.stop_token_ids == []
    req = parse(kind, body_of(kind, temperature=None, top_p=None, top_k=None, seed=None, stop=None,
                              stop_token_ids=None))
    assert (req.temperature, req.top_p, req.top_k, req.seed, req.stop, req.stop_token_ids) == \
        (None, None, None, None, [], [])


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_sampling_values(kind):
    req = parse(kind, body_of(kind, temperature=0, top_p=1, top_k=40, seed=-7, stop="\n\n",
                              stop_token_ids=[0, 99]), vocab_size=VOCAB)
    assert (req.temperature, req.top_p, req.top_k, req.seed) == (0.0, 1.0, 40, -7)
    assert isinstance(req.temperature, float) and isinstance(req.top_p, float)
    assert req.stop == ["\n\n"] and req.stop_token_ids == [0, 99]


@pytest.mark.parametrize("value", [0, 0.0, 0.7, 1, 2, 2.0])
def test_temperature_accepted(value):
    assert parse("completion", body_of("completion", temperature=value)).temperature == value


@pytest.mark.parametrize("value,code", [(-0.01, "decimal_below_min_value"), (2.01, "decimal_above_max_value"),
                                        (-1, "decimal_below_min_value"), (3, "decimal_above_max_value")])
def test_temperature_range(value, code):
    expect_error("chat", body_of("chat", temperature=value), param="temperature", code=code)


@pytest.mark.parametrize("value", [1e-9, 0.5, 1, 1.0])
def test_top_p_accepted(value):
    assert parse("chat", body_of("chat", top_p=value)).top_p == value


@pytest.mark.parametrize("value", [0, 0.0, -0.5, 1.0001, 2])
def test_top_p_range(value):
    expect_error("completion", body_of("completion", top_p=value), param="top_p")


@pytest.mark.parametrize("value,top_k", [(-1, None), (0, None), (1, 1), (50, 50), (VOCAB - 1, VOCAB - 1),
                                         (VOCAB, None), (TOKEN_ID_MAX, None)])
def test_top_k(value, top_k):
    assert parse("completion", body_of("completion", top_k=value), vocab_size=VOCAB).top_k == top_k
    assert parse("completion", body_of("completion", top_k=value)).top_k == (None if value <= 0 else value)


@pytest.mark.parametrize("value", [-2, -100, TOKEN_ID_MAX + 1, 10**30])
def test_top_k_range(value):
    expect_error("completion", body_of("completion", top_k=value), param="top_k")


@pytest.mark.parametrize("value", [0, 1, -1, INT64_MAX, INT64_MIN, 2**40])
def test_seed_accepted(value):
    assert parse("chat", body_of("chat", seed=value)).seed == value


@pytest.mark.parametrize("value,code", [(INT64_MAX + 1, "integer_above_max_value"),
                                        (INT64_MIN - 1, "integer_below_min_value"), (10**100, "<any>"),
                                        (1.0, "invalid_type"), (True, "invalid_type")])
def test_seed_range(value, code):
    expect_error("chat", body_of("chat", seed=value), param="seed", code=code)


@pytest.mark.parametrize("stop,expected", [
    ("x", ["x"]), (["a"], ["a"]), (["a", "b", "c", "d"], ["a", "b", "c", "d"]), ([], []), (None, []),
    (["\n", " ", "é", "\u0000"], ["\n", " ", "é", "\u0000"]),
])
def test_stop_accepted(stop, expected):
    assert parse("completion", body_of("completion", stop=stop)).stop == expected
    assert parse("chat", body_of("chat", stop=stop)).stop == expected


@pytest.mark.parametrize("stop,code", [
    (["a", "b", "c", "d", "e"], "array_above_max_length"), ("", "empty_string"), (["a", ""], "empty_string"),
    (7, "invalid_type"), (["a", 1], "invalid_type"), ([["a"]], "invalid_type"), ({"a": 1}, "invalid_type"),
    (True, "invalid_type"),
])
def test_stop_refused(stop, code):
    expect_error("completion", body_of("completion", stop=stop), param="stop", code=code)
    expect_error("chat", body_of("chat", stop=stop), param="stop", code=code)


@pytest.mark.parametrize("ids", [[VOCAB], [1, -1], [True], [1.0], "1", 1, [[1]], {"1": 1}])
def test_stop_token_ids_refused(ids):
    expect_error("completion", body_of("completion", stop_token_ids=ids), param="stop_token_ids", vocab_size=VOCAB)


def test_stop_token_ids_within_the_vocabulary():
    assert parse("completion", body_of("completion", stop_token_ids=[1]), vocab_size=VOCAB).stop_token_ids == [1]
    assert parse("chat", body_of("chat", stop_token_ids=[0, VOCAB - 1]), vocab_size=VOCAB).stop_token_ids == \
        [0, VOCAB - 1]


def test_stop_token_ids_without_vocabulary():
    assert parse("chat", body_of("chat", stop_token_ids=[])).stop_token_ids == []
    assert parse("chat", body_of("chat", stop_token_ids=[VOCAB, 5000])).stop_token_ids == [VOCAB, 5000]
    expect_error("chat", body_of("chat", stop_token_ids=[TOKEN_ID_MAX + 1]), param="stop_token_ids")


# ---------------------------------------------------------------------------------------------------------------
# Chats
# ---------------------------------------------------------------------------------------------------------------


def test_chat_messages():
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                         {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"}],
            "max_tokens": 8, "slo_ms": 0, "priority": -1, "threshold": 0.5}
    req = parse("chat", body)
    assert req.kind == "chat" and req.prompts == []
    assert req.request_id.startswith("chatcmpl-")
    assert req.messages == body["messages"]
    assert req.add_generation_prompt is True
    assert (req.max_tokens, req.slo_ms, req.priority, req.threshold) == (8, 0.0, -1, 0.5)
    assert req.model == MODELS[0]
    with pytest.raises(ValueError):
        _ = req.prompt  # a chat is rendered by the template, not read as one prompt


def test_developer_is_system():
    req = parse("chat", {"messages": [{"role": "developer", "content": "Rules."}, *USER]})
    assert req.messages == [{"role": "system", "content": "Rules."}, *USER]


@pytest.mark.parametrize("role", ["function"])
def test_tool_roles_refused(role):
    body = {"messages": [*USER, {"role": role, "content": "b", "tool_call_id": None}]}
    err = expect_error("chat", body, param="messages.1.role", code="unsupported_value")
    assert role in err.message


@pytest.mark.parametrize("role", ["robot", "", "User", "\udfff"])
def test_bad_roles(role):
    body = {"messages": [*USER, {"role": role, "content": "b"}]}
    expect_error("chat", body, param="messages.1.role", code="invalid_value")


def test_chat_text_parts_and_max_completion_tokens():
    body = {"model": "llada-tiny", "max_completion_tokens": 12,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "ab"}, {"type": "text", "text": "c"}],
                          "name": "bob"}]}
    req = parse("chat", body)
    assert req.messages == [{"role": "user", "content": "ab\nc", "name": "bob"}]  # parts joined as vLLM does
    assert (req.max_tokens, req.model) == (12, "llada-tiny")
    assert parse("chat", {**body, "max_tokens": 3}).max_tokens == 3
    single = parse("chat", {"messages": [{"role": "system", "content": [{"type": "text", "text": ""}]}]})
    assert single.messages == [{"role": "system", "content": ""}]


@pytest.mark.parametrize("add", [True, False, None])
@pytest.mark.parametrize("last", ["user", "assistant"])
def test_add_generation_prompt(add, last):
    req = parse("chat", {"messages": [*USER, {"role": last, "content": "b"}], "add_generation_prompt": add})
    assert req.add_generation_prompt is (add is not False)
    assert req.messages[-1]["role"] == last


def test_continue_final_message():
    body = {"messages": [*USER, {"role": "assistant", "content": "The"}], "add_generation_prompt": False}
    assert parse("chat", {**body, "continue_final_message": False}).messages[-1]["content"] == "The"
    expect_error("chat", {**body, "continue_final_message": True}, param="continue_final_message",
                 code="unsupported_parameter")


def test_metadata_fields_accepted():
    parse("chat", body_of("chat", user="u1", safety_identifier="s-1"))
    parse("chat", body_of("chat", user=None, safety_identifier=None))
    parse("completion", body_of("completion", user="u1"))


# ---------------------------------------------------------------------------------------------------------------
# Valid requests
# ---------------------------------------------------------------------------------------------------------------


def test_completion_defaults():
    req = parse("completion", {"prompt": "Hello"})
    assert req.kind == "completion"
    assert req.model == MODELS[0]
    assert req.prompts == ["Hello"] and req.prompt == "Hello" and req.messages == []
    assert req.max_tokens == DEFAULT
    assert req.stream is False and req.include_usage is False
    assert req.slo_ms is None and req.priority == 0 and req.threshold is None
    assert req.request_id.startswith("cmpl-") and len(req.request_id) > len("cmpl-") + 16
    assert isinstance(req.created, int) and req.created > 1_600_000_000
    assert parse("completion", {"prompt": "x"}).request_id != req.request_id


def test_default_max_tokens_clamped_to_limit():
    assert parse("completion", {"prompt": "a"}, default_max_tokens=10 * LIMIT).max_tokens == LIMIT


def test_completion_full():
    body = {"model": "llada-tiny", "prompt": ["only one"], "max_tokens": LIMIT, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 3,
            "n": 1, "stop": ["\n"], "stop_token_ids": [2], "user": "u1", "slo_ms": 250.0, "priority": 3,
            "threshold": 1.0, "logprobs": None, "echo": False, "best_of": 1, "suffix": None}
    req = parse("completion", body)
    assert (req.model, req.prompts, req.max_tokens) == ("llada-tiny", ["only one"], LIMIT)
    assert req.stream is True and req.include_usage is True
    assert (req.slo_ms, req.priority, req.threshold) == (250.0, 3, 1.0)
    assert (req.temperature, req.top_p, req.top_k, req.seed, req.stop, req.stop_token_ids) == \
        (0.7, 0.9, 20, 3, ["\n"], [2])


def test_completion_bytes_and_str_bodies():
    assert parse("completion", b'{"prompt": "caf\xc3\xa9"}').prompts == ["café"]
    assert parse("completion", '{"prompt": "x\\u0000"}').prompts == ["x\x00"]
    assert parse("completion", '{"prompt": "\\ud800"}').prompts == ["\ud800"]


def test_null_optional_fields_are_defaults():
    req = parse("chat", {"messages": USER, "model": None, "max_tokens": None, "stream": None, "stream_options": None,
                         "add_generation_prompt": None, "max_completion_tokens": None})
    assert (req.model, req.max_tokens, req.stream, req.add_generation_prompt) == (MODELS[0], DEFAULT, False, True)


# ---------------------------------------------------------------------------------------------------------------
# Schemas: what they document is what the parser accepts
# ---------------------------------------------------------------------------------------------------------------


IMPLEMENTED = {
    "completion": {"model", "prompt", "max_tokens", "stream", "stream_options", "temperature", "top_p", "top_k",
                   "seed", "stop", "stop_token_ids", "n", "user", "slo_ms", "priority", "threshold", "echo",
                   "ignore_eos", "logprobs", *STRUCTURED_FIELDS, "decoding", "decoding_config"},
    "chat": {"model", "messages", "max_tokens", "max_completion_tokens", "stream", "stream_options", "temperature",
             "top_p", "top_k", "seed", "stop", "stop_token_ids", "n", "user", "safety_identifier",
             "add_generation_prompt", "slo_ms", "priority", "threshold", "ignore_eos", "chat_template", "logprobs",
             *STRUCTURED_FIELDS, "response_format", "tools", "tool_choice", "parallel_tool_calls", "decoding",
             "decoding_config"},
}
DECODING = {"decoding", "decoding_config"}  # Remask's decoding rule per request (engine/decoding/)
IMPLEMENTED = {kind: fields | DECODING for kind, fields in IMPLEMENTED.items()}


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_schema_lists_every_accepted_field(kind):
    schema = request_schema(kind, "tiny", 64, vocab_size=VOCAB)
    assert schema["additionalProperties"] is False and "$ref" not in json.dumps(schema)
    props = schema["properties"]
    assert set(props) == IMPLEMENTED[kind] | set(NOOPS[kind])
    for field, values in NOOPS[kind].items():
        assert props[field]["enum"] == list(values), field
    assert props["stream_options"]["anyOf"][0]["additionalProperties"] is False
    assert set(props["stream_options"]["anyOf"][0]["properties"]) == set(STREAM_OPTIONS)
    assert props["temperature"]["minimum"] == 0 and props["temperature"]["maximum"] == 2
    assert props["top_p"]["exclusiveMinimum"] == 0 and props["top_p"]["maximum"] == 1
    assert props["stop_token_ids"]["anyOf"][0]["items"]["maximum"] == VOCAB - 1
    assert "maximum" not in request_schema(kind)["properties"]["stop_token_ids"]["anyOf"][0]["items"]


GOOD_BODIES = {
    "completion": [{"prompt": "a"}, {"prompt": ["a", "b"]}, {"prompt": [1, 2]}, {"prompt": [[1], [2, 3]]},
                   {"prompt": "a", "stop": ["x"] * 4, "temperature": 2, "top_p": 1, "top_k": -1, "seed": INT64_MIN,
                    "echo": False, "logprobs": None, "stream": True, "stream_options": {"include_usage": True}}],
    "chat": [{"messages": USER}, {"messages": [{"role": "system", "content": [{"type": "text", "text": "s"}]},
                                               *USER], "add_generation_prompt": False, "tools": [],
                                  "response_format": {"type": "text"}, "service_tier": "auto", "stop": "x"},
             {"messages": [{"role": "assistant", "content": "x", "tool_calls": None, "refusal": None}]}],
}
BAD_BODIES = {
    "completion": [{"prompt": ""}, {"prompt": []}, {"prompt": [[]]}, {"prompt": ["a", 1]}, {"prompt": [VOCAB]},
                   {"prompt": ["a"] * (MAX_PROMPTS + 1)}, {"prompt": "a", "stop": ["x"] * 5},
                   {"prompt": "a", "stop": ""}, {"prompt": "a", "temperature": 2.5}, {"prompt": "a", "top_p": 0},
                   {"prompt": "a", "top_k": -2}, {"prompt": "a", "echo": 1}, {"prompt": "a", "x": 1},
                   {"prompt": "a", "stream_options": {"include_canvas": 1}, "stream": True},
                   {"prompt": "a", "stop_token_ids": [VOCAB]}, {"prompt": "a", "max_tokens": 65}],
    "chat": [{"messages": []}, {"messages": [{"role": "tool", "content": "x"}]},
             {"messages": [{"role": "user", "content": None}]},
             {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
             {"messages": USER, "tools": [{"type": "function"}]}, {"messages": USER, "top_logprobs": 2},
             {"messages": [{"role": "user", "content": "a", "x": 1}]}, {"messages": USER, "prompt": "a"}],
}


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_schema_agrees_with_the_parser(kind):
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(request_schema(kind, MODELS[0], 64, vocab_size=VOCAB))
    for body in GOOD_BODIES[kind]:
        parse(kind, body, max_tokens_limit=64, vocab_size=VOCAB)
        assert not list(validator.iter_errors(body)), body
    for body in BAD_BODIES[kind]:
        with pytest.raises(APIError):
            parse(kind, body, max_tokens_limit=64, vocab_size=VOCAB)
        assert list(validator.iter_errors(body)), body


def test_tokenize_schemas():
    schema = request_schema("tokenize", "tiny")
    prompt_form, chat_form = schema["anyOf"]
    assert prompt_form["required"] == ["prompt"] and chat_form["required"] == ["messages"]
    assert set(prompt_form["properties"]) == {"model", "prompt", "add_special_tokens", "return_token_strs"}
    assert set(chat_form["properties"]) == {"model", "messages", "add_special_tokens", "add_generation_prompt",
                                            "continue_final_message", "return_token_strs"}
    detok = request_schema("detokenize", "tiny", vocab_size=VOCAB)
    assert detok["required"] == ["tokens"] and detok["properties"]["tokens"]["items"]["maximum"] == VOCAB - 1
    with pytest.raises(ValueError):
        request_schema("embedding")


# ---------------------------------------------------------------------------------------------------------------
# Tokenize and detokenize
# ---------------------------------------------------------------------------------------------------------------


def tokenize(body) -> TokenizeRequest:
    return parse_tokenize(json.dumps(body), MODELS)


def test_tokenize_prompt():
    req = tokenize({"prompt": "Hello"})
    assert req == TokenizeRequest(model=MODELS[0], prompt="Hello", messages=None, add_special_tokens=True,
                                  add_generation_prompt=True)
    assert tokenize({"prompt": "", "add_special_tokens": False, "model": "llada-tiny"}) == \
        TokenizeRequest(model="llada-tiny", prompt="", messages=None, add_special_tokens=False)
    assert tokenize({"prompt": "a", "return_token_strs": False}).prompt == "a"


def test_tokenize_messages():
    req = tokenize({"messages": [{"role": "developer", "content": "s"}, *USER]})
    assert req.prompt is None and req.messages == [{"role": "system", "content": "s"}, *USER]
    assert req.add_special_tokens is False and req.add_generation_prompt is True  # vLLM's defaults for chats
    req = tokenize({"messages": USER, "add_generation_prompt": False, "add_special_tokens": True,
                    "continue_final_message": False})
    assert req.add_generation_prompt is False and req.add_special_tokens is True


@pytest.mark.parametrize("body,status,param,code", [
    ({"prompt": "a", "messages": USER}, 400, "messages", "invalid_value"),
    ({}, 400, "prompt", "missing_required_parameter"),
    ({"model": "dream-tiny"}, 400, "prompt", "missing_required_parameter"),
    ({"prompt": None}, 400, "prompt", "missing_required_parameter"),
    ({"prompt": 5}, 400, "prompt", "invalid_type"),
    ({"prompt": [1, 2]}, 400, "prompt", "invalid_type"),
    ({"prompt": "a", "add_generation_prompt": True}, 400, "add_generation_prompt", "unknown_parameter"),
    ({"prompt": "a", "add_special_tokens": "no"}, 400, "add_special_tokens", "invalid_type"),
    ({"prompt": "a", "extra": 1}, 400, "extra", "unknown_parameter"),
    ({"prompt": "a", "return_token_strs": True}, 400, "return_token_strs", "unsupported_parameter"),
    ({"messages": USER, "continue_final_message": True}, 400, "continue_final_message", "unsupported_parameter"),
    ({"messages": USER, "chat_template": "x"}, 400, "chat_template", "unknown_parameter"),
    ({"messages": []}, 400, "messages", "empty_array"),
    ({"messages": [{"role": "tool", "content": "x"}]}, 400, "messages.0.tool_call_id", "missing_required_parameter"),
    ({"messages": [{"role": "function", "content": "x"}]}, 400, "messages.0.role", "unsupported_value"),
    ({"prompt": "a", "model": "gpt-4"}, 404, "model", "model_not_found"),
])
def test_tokenize_errors(body, status, param, code):
    with pytest.raises(APIError) as info:
        tokenize(body)
    check_error(info.value, status, param, code)


def test_tokenize_invalid_json():
    with pytest.raises(APIError) as info:
        parse_tokenize(b"{oops", MODELS)
    check_error(info.value, 400, None, "invalid_json")


def test_detokenize():
    assert parse_detokenize(json.dumps({"tokens": [1, 2, VOCAB - 1]}), MODELS, VOCAB) == (MODELS[0], [1, 2, VOCAB - 1])
    assert parse_detokenize('{"tokens": [], "model": "llada-tiny"}', MODELS, VOCAB) == ("llada-tiny", [])
    assert parse_detokenize('{"tokens": [123456]}', MODELS, None) == (MODELS[0], [123456])


@pytest.mark.parametrize("body,status,param,code", [
    ({}, 400, "tokens", "missing_required_parameter"),
    ({"tokens": [VOCAB]}, 400, "tokens", "invalid_value"),
    ({"tokens": [-1]}, 400, "tokens", "invalid_value"),
    ({"tokens": [True]}, 400, "tokens", "invalid_type"),
    ({"tokens": "1 2"}, 400, "tokens", "invalid_type"),
    ({"tokens": [[1]]}, 400, "tokens", "invalid_type"),
    ({"tokens": [1], "skip_special_tokens": True}, 400, "skip_special_tokens", "unknown_parameter"),
    ({"tokens": [1], "model": "x"}, 404, "model", "model_not_found"),
])
def test_detokenize_errors(body, status, param, code):
    with pytest.raises(APIError) as info:
        parse_detokenize(json.dumps(body), MODELS, VOCAB)
    check_error(info.value, status, param, code)


def test_tokenize_and_detokenize_responses():
    assert tokenize_response([5, 6, 7], 4096) == {"count": 3, "max_model_len": 4096, "tokens": [5, 6, 7]}
    assert tokenize_response([], 8) == {"count": 0, "max_model_len": 8, "tokens": []}
    assert detokenize_response("héllo") == {"prompt": "héllo"}


# ---------------------------------------------------------------------------------------------------------------
# Responses and chunks
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture
def creq() -> GenRequest:
    return parse("completion", {"prompt": "Hi", "stream": True, "stream_options": {"include_usage": True}})


@pytest.fixture
def multi() -> GenRequest:
    return parse("completion", {"prompt": ["Hi", "Yo", "Hey"]})


@pytest.fixture
def chreq() -> GenRequest:
    return parse("chat", {"messages": [{"role": "user", "content": "Hi"}], "stream": True})


def test_completion_response_shape(creq):
    out = completion_response(creq, [("there", "length")], 2, 5)
    assert out["id"] == creq.request_id and out["object"] == "text_completion"
    assert out["created"] == creq.created and out["model"] == creq.model
    assert out["choices"] == [{"index": 0, "text": "there", "logprobs": None, "finish_reason": "length"}]
    assert out["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}
    json.dumps(out)


def test_completion_response_several_choices(multi):
    out = completion_response(multi, [("a", "stop"), ("bb", "length"), ("", "stop")], 6, 9)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert [(c["text"], c["finish_reason"]) for c in out["choices"]] == [("a", "stop"), ("bb", "length"), ("", "stop")]
    assert out["usage"] == {"prompt_tokens": 6, "completion_tokens": 9, "total_tokens": 15}
    with pytest.raises(TypeError):
        completion_response(multi, "a", 1, 1)


def test_chat_response_shape(chreq):
    out = chat_response(chreq, "hello", "stop", 3, 4)
    assert out["object"] == "chat.completion" and out["id"] == chreq.request_id
    (choice,) = out["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "stop"
    assert choice["message"] == {"role": "assistant", "content": "hello"}
    assert out["usage"]["total_tokens"] == 7


def test_completion_chunks(creq, multi):
    mid = completion_chunk(creq, "ab")
    assert mid["object"] == "text_completion" and mid["id"] == creq.request_id
    assert mid["choices"] == [{"index": 0, "text": "ab", "logprobs": None, "finish_reason": None}]
    assert "usage" in mid and mid["usage"] is None  # include_usage: null usage on every chunk but the last
    assert completion_chunk(creq, "", "stop")["choices"][0]["finish_reason"] == "stop"
    second = completion_chunk(multi, "yo", index=1)
    assert second["choices"] == [{"index": 1, "text": "yo", "logprobs": None, "finish_reason": None}]
    assert completion_chunk(multi, "", "length", index=2)["choices"][0]["index"] == 2
    assert "usage" not in second


def test_chat_chunks(chreq):
    first = chat_chunk(chreq, role=True)
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["choices"][0]["finish_reason"] is None
    mid = chat_chunk(chreq, "lo")
    assert mid["choices"][0]["delta"] == {"content": "lo"}
    last = chat_chunk(chreq, finish_reason="length")
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "length"
    assert "usage" not in mid  # no include_usage requested


def test_usage_chunks(creq, chreq):
    u = usage_chunk(creq, 2, 3)
    assert u["object"] == "text_completion" and u["choices"] == []
    assert u["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert usage_chunk(chreq, 1, 1)["object"] == "chat.completion.chunk"


def test_sse_format(chreq):
    chunk = chat_chunk(chreq, "é\n")
    event = sse(chunk)
    assert event.startswith("data: ") and event.endswith("\n\n")
    assert event.count("\n") == 2
    assert json.loads(event[len("data: "):]) == chunk
    assert sse("[DONE]") == "data: [DONE]\n\n"
    with pytest.raises(ValueError):
        sse("two\nlines")


def test_models_response():
    out = models_response(MODELS)
    assert out["object"] == "list"
    assert [m["id"] for m in out["data"]] == MODELS
    for m in out["data"]:
        assert m["object"] == "model" and m["owned_by"] == "remask" and isinstance(m["created"], int)
    assert models_response(["a"], created=5)["data"][0]["created"] == 5


def test_model_response():
    one = model_response("dream-tiny")
    assert one == models_response(["dream-tiny"])["data"][0]
    assert one["id"] == "dream-tiny" and one["object"] == "model" and one["owned_by"] == "remask"
    assert model_response("x", created=7)["created"] == 7


def test_version_response():
    out = version_response()
    assert set(out) == {"version"} and isinstance(out["version"], str) and out["version"]
    try:
        assert out["version"] == importlib.metadata.version("remask")
    except importlib.metadata.PackageNotFoundError:
        assert out["version"] == "0.0.0"


# ---------------------------------------------------------------------------------------------------------------
# The official client's types
# ---------------------------------------------------------------------------------------------------------------


def test_openai_client_types(creq, chreq, multi):
    types = pytest.importorskip("openai.types")
    chat_types = pytest.importorskip("openai.types.chat")
    c = types.Completion.model_validate(completion_response(creq, [("x", "stop")], 1, 1))
    assert c.choices[0].text == "x" and c.usage.total_tokens == 2
    several = types.Completion.model_validate(completion_response(multi, [("a", "stop"), ("b", "length")], 2, 2))
    assert [(ch.index, ch.text, ch.finish_reason) for ch in several.choices] == [(0, "a", "stop"), (1, "b", "length")]
    ch = chat_types.ChatCompletion.model_validate(chat_response(chreq, "y", "length", 1, 2))
    assert ch.choices[0].message.content == "y" and ch.choices[0].message.role == "assistant"
    first = chat_types.ChatCompletionChunk.model_validate(chat_chunk(chreq, role=True))
    assert first.choices[0].delta.role == "assistant"
    mid = chat_types.ChatCompletionChunk.model_validate(chat_chunk(chreq, "z"))
    assert mid.choices[0].delta.content == "z" and mid.choices[0].finish_reason is None
    chat_types.ChatCompletionChunk.model_validate(chat_chunk(chreq, finish_reason="stop"))
    u = chat_types.ChatCompletionChunk.model_validate(usage_chunk(chreq, 3, 4))
    assert u.choices == [] and u.usage.completion_tokens == 4
    # The client parses streamed completions into Completion without validating; its CompletionChoice types
    # finish_reason as non-null, so only the final chunk (as OpenAI itself sends) passes strict validation.
    last = types.Completion.model_validate(completion_chunk(creq, "w", "length"))
    assert last.choices[0].text == "w"
    assert types.Completion.model_validate(completion_chunk(multi, "", "stop", index=2)).choices[0].index == 2
    types.Completion.model_validate(usage_chunk(creq, 1, 2))
    models = types.Model.model_validate(models_response(MODELS)["data"][0])
    assert models.id == MODELS[0]
    assert types.Model.model_validate(model_response("llada-tiny")).id == "llada-tiny"
    assert pytest.importorskip("openai").types.ErrorObject.model_validate(
        APIError(404, "m", param="model", code="model_not_found").to_dict()["error"]).param == "model"
    refused = pytest.importorskip("openai").types.ErrorObject.model_validate(
        pytest.raises(APIError, parse, "chat", body_of("chat", top_logprobs=2)).value.to_dict()["error"])
    assert refused.code == "unsupported_parameter" and refused.param == "top_logprobs"


def test_openai_client_request_params_are_accepted():
    """What the official client sends for plain calls (its typed params, defaults) parses."""
    pytest.importorskip("openai")
    body = {"model": "dream-tiny", "prompt": ["a", "b"], "max_tokens": 4, "temperature": 0, "stop": None,
            "stream": False, "n": 1, "logprobs": None, "echo": False, "best_of": 1, "user": "me"}
    assert parse("completion", body).prompts == ["a", "b"]
    chat_body = {"model": "dream-tiny", "messages": [{"role": "developer", "content": "d"}, *USER],
                 "max_completion_tokens": 4, "stream": True, "stream_options": {"include_usage": True},
                 "seed": 1, "top_p": 0.5, "tool_choice": "none", "tools": [], "store": False,
                 "extra_body_field_sent_by_nobody": None}
    expect_error("chat", chat_body, param="extra_body_field_sent_by_nobody", code="unknown_parameter")
    chat_body.pop("extra_body_field_sent_by_nobody")
    assert parse("chat", chat_body).include_usage is True
