"""Tests for the OpenAI-compatible request/response layer (app.api) and the ingress metrics (app.metrics)."""

from __future__ import annotations

import json

import pytest

from app.api import (
    APIError,
    GenRequest,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    models_response,
    parse_request,
    rate_limit_error,
    sse,
    usage_chunk,
)
from app.metrics import Metrics

MODELS = ["dream-tiny", "llada-tiny"]
LIMIT = 256
DEFAULT = 64


def parse(kind: str, body, **kw) -> GenRequest:
    raw = body if isinstance(body, (bytes, str)) else json.dumps(body)
    opts = dict(known_models=MODELS, max_tokens_limit=LIMIT, default_max_tokens=DEFAULT)
    opts.update(kw)
    return parse_request(kind, raw, **opts)


def expect_error(kind: str, body, status: int = 400, param: str | None = None, code: str | None = "<any>",
                 **kw) -> APIError:
    with pytest.raises(APIError) as info:
        parse(kind, body, **kw)
    err = info.value
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
    ({"prompt": "a", "stream_options": {"include_usage": "maybe"}}, "stream_options.include_usage"),
])
def test_completion_validation_param(body, param):
    expect_error("completion", body, param=param)


@pytest.mark.parametrize("body,param", [
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": "a"}, {"content": "b"}]}, "messages.1.role"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages.0.content"),
])
def test_chat_validation_param(body, param):
    expect_error("chat", body, param=param)


def test_missing_prompt_and_messages():
    assert "prompt" in expect_error("completion", {"model": "dream-tiny"}, param="prompt").message
    expect_error("completion", {"prompt": None}, param="prompt")
    expect_error("chat", {"model": "dream-tiny"}, param="messages", code="missing_required_parameter")
    expect_error("chat", {"messages": []}, param="messages", code="empty_array")


def test_prompt_list_longer_than_one():
    expect_error("completion", {"prompt": ["a", "b"]}, param="prompt")
    expect_error("completion", {"prompt": []}, param="prompt")


def test_unknown_model_is_404():
    err = expect_error("completion", {"model": "gpt-4", "prompt": "a"}, status=404, param="model",
                       code="model_not_found")
    assert "gpt-4" in err.message
    expect_error("chat", {"model": "nope", "messages": [{"role": "user", "content": "a"}]}, status=404,
                 param="model", code="model_not_found")
    expect_error("completion", {"prompt": "a"}, status=404, param="model", known_models=[])


@pytest.mark.parametrize("value", [0, -3, LIMIT + 1, 10**9])
def test_max_tokens_bounds(value):
    expect_error("completion", {"prompt": "a", "max_tokens": value}, param="max_tokens")
    expect_error("chat", {"messages": [{"role": "user", "content": "a"}], "max_tokens": value}, param="max_tokens")


def test_max_completion_tokens_bounds():
    body = {"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": LIMIT + 1}
    expect_error("chat", body, param="max_completion_tokens")


@pytest.mark.parametrize("value", [0, -0.5, 1.0001, 7])
def test_threshold_bounds(value):
    expect_error("completion", {"prompt": "a", "threshold": value}, param="threshold")


def test_threshold_nan_rejected():
    expect_error("completion", b'{"prompt": "a", "threshold": NaN}', param="threshold")


def test_negative_slo():
    expect_error("completion", {"prompt": "a", "slo_ms": -1}, param="slo_ms")
    expect_error("chat", {"messages": [{"role": "user", "content": "a"}], "slo_ms": -0.1}, param="slo_ms")


@pytest.mark.parametrize("n", [0, 2, 5])
def test_n_must_be_one(n):
    expect_error("completion", {"prompt": "a", "n": n}, param="n")


@pytest.mark.parametrize("role", ["tool", "developer", "robot", ""])
def test_bad_roles(role):
    body = {"messages": [{"role": "user", "content": "a"}, {"role": role, "content": "b"}]}
    expect_error("chat", body, param="messages")


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
# Valid requests
# ---------------------------------------------------------------------------------------------------------------


def test_completion_defaults():
    req = parse("completion", {"prompt": "Hello"})
    assert req.kind == "completion"
    assert req.model == MODELS[0]
    assert req.prompt == "Hello"
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
            "stream_options": {"include_usage": True}, "temperature": 0.7, "top_p": 0.9, "n": 1, "stop": ["\n"],
            "user": "u1", "slo_ms": 250.0, "priority": 3, "threshold": 1.0, "logprobs": None, "echo": False,
            "some_future_field": {"x": 1}}
    req = parse("completion", body)
    assert (req.model, req.prompt, req.max_tokens) == ("llada-tiny", "only one", LIMIT)
    assert req.stream is True and req.include_usage is True
    assert (req.slo_ms, req.priority, req.threshold) == (250.0, 3, 1.0)


def test_completion_bytes_and_str_bodies():
    assert parse("completion", b'{"prompt": "caf\xc3\xa9"}').prompt == "café"
    assert parse("completion", '{"prompt": ""}').prompt == ""


def test_include_usage_needs_stream():
    req = parse("completion", {"prompt": "a", "stream_options": {"include_usage": True}})
    assert req.include_usage is False
    assert parse("completion", {"prompt": "a", "stream": True}).include_usage is False


def test_chat_rendering():
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                         {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"}],
            "max_tokens": 8, "slo_ms": 0, "priority": -1, "threshold": 0.5}
    req = parse("chat", body)
    assert req.kind == "chat"
    assert req.request_id.startswith("chatcmpl-")
    assert req.prompt == "Be brief.\n2+2?\n4\n3+3?"
    assert (req.max_tokens, req.slo_ms, req.priority, req.threshold) == (8, 0.0, -1, 0.5)
    assert req.model == MODELS[0]


def test_chat_text_parts_and_max_completion_tokens():
    body = {"model": "llada-tiny", "max_completion_tokens": 12,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "ab"}, {"type": "text", "text": "c"}],
                          "name": "bob"}]}
    req = parse("chat", body)
    assert (req.prompt, req.max_tokens, req.model) == ("abc", 12, "llada-tiny")
    assert parse("chat", {**body, "max_tokens": 3}).max_tokens == 3


# ---------------------------------------------------------------------------------------------------------------
# Responses and chunks
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture
def creq() -> GenRequest:
    return parse("completion", {"prompt": "Hi", "stream": True, "stream_options": {"include_usage": True}})


@pytest.fixture
def chreq() -> GenRequest:
    return parse("chat", {"messages": [{"role": "user", "content": "Hi"}], "stream": True})


def test_completion_response_shape(creq):
    out = completion_response(creq, "there", "length", 2, 5)
    assert out["id"] == creq.request_id and out["object"] == "text_completion"
    assert out["created"] == creq.created and out["model"] == creq.model
    assert out["choices"] == [{"index": 0, "text": "there", "logprobs": None, "finish_reason": "length"}]
    assert out["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}
    json.dumps(out)


def test_chat_response_shape(chreq):
    out = chat_response(chreq, "hello", "stop", 3, 4)
    assert out["object"] == "chat.completion" and out["id"] == chreq.request_id
    (choice,) = out["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "stop"
    assert choice["message"] == {"role": "assistant", "content": "hello"}
    assert out["usage"]["total_tokens"] == 7


def test_completion_chunks(creq):
    mid = completion_chunk(creq, "ab")
    assert mid["object"] == "text_completion" and mid["id"] == creq.request_id
    assert mid["choices"] == [{"index": 0, "text": "ab", "logprobs": None, "finish_reason": None}]
    assert "usage" in mid and mid["usage"] is None  # include_usage: null usage on every chunk but the last
    assert completion_chunk(creq, "", "stop")["choices"][0]["finish_reason"] == "stop"


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


# ---------------------------------------------------------------------------------------------------------------
# The official client's types
# ---------------------------------------------------------------------------------------------------------------


def test_openai_client_types(creq, chreq):
    types = pytest.importorskip("openai.types")
    chat_types = pytest.importorskip("openai.types.chat")
    c = types.Completion.model_validate(completion_response(creq, "x", "stop", 1, 1))
    assert c.choices[0].text == "x" and c.usage.total_tokens == 2
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
    types.Completion.model_validate(usage_chunk(creq, 1, 2))
    models = types.Model.model_validate(models_response(MODELS)["data"][0])
    assert models.id == MODELS[0]
    assert pytest.importorskip("openai").types.ErrorObject.model_validate(
        APIError(404, "m", param="model", code="model_not_found").to_dict()["error"]).param == "model"


# ---------------------------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------------------------


def _sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.split(" ")[0] == name:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in exposition")


def test_metrics_render_and_counts():
    m = Metrics()
    other = Metrics()  # a second instance in the same process must not clash
    for _ in range(3):
        m.request_started()
    m.request_finished(0.05, 0.4, True, 12, 0.9, True)
    m.request_finished(None, 1.5, False, 30, None, True)
    m.request_finished(None, 0.01, None, 0, None, False)
    m.set_queue(running=4, waiting=7)
    m.round_observed(3)
    m.round_observed(5)
    m.migration()
    m.rejected("queue_full")
    m.rejected("queue_full")
    m.rejected("slo_infeasible")
    body, ctype = m.render()
    assert ctype.startswith("text/plain")
    text = body.decode()
    for name in ["remask_requests_running", "remask_requests_waiting", "remask_ttft_seconds",
                 "remask_e2e_seconds", "remask_rounds_per_request", "remask_filled_slots_per_round",
                 "remask_threshold", "remask_requests_total", "remask_slo_met_total", "remask_slo_missed_total",
                 "remask_migrations_total", "remask_rejected_total"]:
        assert name in text, name
    names = [ln.split("{")[0].split(" ")[0] for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert all(n.startswith("remask_") for n in names)
    assert _sample(text, "remask_requests_running") == 4
    assert _sample(text, "remask_requests_waiting") == 7
    assert _sample(text, "remask_requests_in_flight") == 0
    assert 'remask_requests_total{outcome="ok"} 2.0' in text
    assert 'remask_requests_total{outcome="error"} 1.0' in text
    assert _sample(text, "remask_slo_met_total") == 1
    assert _sample(text, "remask_slo_missed_total") == 1
    assert _sample(text, "remask_migrations_total") == 1
    assert 'remask_rejected_total{reason="queue_full"} 2.0' in text
    assert 'remask_rejected_total{reason="slo_infeasible"} 1.0' in text
    assert _sample(text, "remask_ttft_seconds_count") == 1
    assert _sample(text, "remask_e2e_seconds_count") == 3
    assert _sample(text, "remask_rounds_per_request_count") == 2
    assert _sample(text, "remask_rounds_per_request_sum") == 42
    assert _sample(text, "remask_filled_slots_per_round_count") == 2
    assert _sample(text, "remask_filled_slots_per_round_sum") == 8
    assert _sample(text, "remask_threshold_count") == 1
    assert _sample(other.render()[0].decode(), "remask_e2e_seconds_count") == 0
