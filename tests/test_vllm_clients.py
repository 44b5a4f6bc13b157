"""vLLM's and SGLang's clients served (issue 35 item 3), without Ray: the exact bodies ``vllm bench serve``
sends (completions with and without ``--ignore-eos``, chat with content parts and ``max_completion_tokens``), the
official ``openai`` SDK with vLLM's neutral extras, ``n`` choices, ``echo``, ``max_model_len``, CORS, the response
id equal to ``X-Request-ID``, the chat-template override; and ``ignore_eos`` in the engine itself.

The front is built as the Ingress replica builds it (``app.frontend.Frontend`` around the embedded tiny-bd
model) with the dispatcher's ``submit`` replaced by a fake generation that records what it got; the API's app
(``app.routes.build_web``) is driven in-process by Starlette's test client.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from app.config import AppConfig

testclient = pytest.importorskip("fastapi.testclient")

MODEL = "tiny-bd"


class FakeStream:
    """A generation's events as the dispatcher gives them: accepted, a delta per two characters, done."""

    def __init__(self, text: str, prompt_tokens: int, max_tokens: int) -> None:
        self.events = [{"type": "accepted", "add_ms": 0.1}] + [
            {"type": "delta", "text": text[i:i + 2]} for i in range(0, len(text), 2)] + [
            {"type": "done", "finish_reason": "length", "text": text, "prompt_tokens": prompt_tokens,
             "completion_tokens": len(text), "max_tokens": max_tokens, "rounds": 2, "ttft_s": 0.01, "e2e_s": 0.02,
             "queue_s": 0.0, "threshold": 0.9, "resumes": 0}]

    def __aiter__(self):
        return self

    async def __anext__(self) -> dict:
        await asyncio.sleep(0)
        if not self.events:
            raise StopAsyncIteration
        return self.events.pop(0)

    def cancel(self) -> None:
        self.events = []


def front_of(**http):
    from app.frontend import Frontend
    from app.routes import build_web

    fe = Frontend(AppConfig(engine={"model": MODEL, "slots": 4}, router={"predictors": "off"}, http=http))
    fe.submitted = []

    def submit(rid, ids, max_tokens, **kw):
        fe.submitted.append({"rid": rid, "ids": list(ids), "max_tokens": max_tokens, **kw})
        return FakeStream(f"out{len(fe.submitted) - 1}", len(ids), max_tokens)

    fe.dispatcher.submit = submit
    return fe, testclient.TestClient(build_web(lambda: fe))


def events(r) -> list[dict]:
    assert r.status_code == 200, r.text[:300]
    assert r.text.endswith("data: [DONE]\n\n")
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def error_of(r, param: str, code: str = "unsupported_parameter") -> dict:
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == code and err["type"] == "invalid_request_error"
    return err


# The bodies vLLM's benchmark client (vllm/benchmarks/lib/endpoint_request_func.py) sends: completions hold
# repetition_penalty 1.0 and logprobs null (plus ignore_eos with --ignore-eos), chat a list of text parts and
# max_completion_tokens; both stream with include_usage; `vllm bench serve` adds temperature 0 by default.
def bench_completion(ignore_eos: bool = False) -> dict:
    body = {"model": MODEL, "prompt": "the quick brown fox", "repetition_penalty": 1.0, "max_tokens": 16,
            "logprobs": None, "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    body["temperature"] = 0.0
    return body


BENCH_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}],
              "max_completion_tokens": 16, "stream": True, "stream_options": {"include_usage": True},
              "temperature": 0.0}


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_vllm_bench_completion_body_is_served(ignore_eos):
    fe, client = front_of()
    r = client.post("/v1/completions", json=bench_completion(ignore_eos), headers={"x-request-id": "bench-7"})
    chunks = events(r)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "out0"
    assert chunks[-1]["usage"]["completion_tokens"] == 4 and chunks[-1]["choices"] == []
    assert all(c["id"] == "bench-7" for c in chunks)  # the request id the client (or Serve's proxy) set
    sent = fe.submitted[0]
    assert sent["max_tokens"] == 16 and sent["rid"] == "bench-7"
    assert sent["sampling"].get("ignore_eos", False) is ignore_eos


def test_vllm_bench_chat_body_is_served():
    fe, client = front_of()
    chunks = events(client.post("/v1/chat/completions", json=BENCH_CHAT))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "out0"
    assert chunks[-1]["usage"]["completion_tokens"] == 4 and fe.submitted[0]["max_tokens"] == 16


@pytest.mark.parametrize("field,value", [("repetition_penalty", 1.2), ("min_p", 0.1), ("top_k", -2),
                                         ("use_beam_search", True), ("min_tokens", 3), ("best_of", 2)])
def test_a_non_neutral_value_of_an_unimplemented_field_is_a_400_naming_it(field, value):
    fe, client = front_of()
    r = client.post("/v1/completions", json={**bench_completion(), field: value})
    if field == "top_k":  # implemented: out of range
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_k"
    else:
        assert field in error_of(r, field)["message"]
    error_of(client.post("/v1/completions", json={**bench_completion(), "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}}), "stream_options.continuous_usage_stats")
    assert not fe.submitted


def test_the_openai_sdk_with_neutral_extras():
    openai = pytest.importorskip("openai")
    fe, client = front_of()
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)
    extras = {"repetition_penalty": 1, "min_p": 0, "top_k": -1, "ignore_eos": False, "best_of": 1,
              "skip_special_tokens": True, "spaces_between_special_tokens": True, "include_stop_str_in_output": False,
              "length_penalty": 1, "use_beam_search": False, "min_tokens": 0, "truncate_prompt_tokens": None}
    done = sdk.completions.create(model=MODEL, prompt="hi", max_tokens=4, frequency_penalty=0, presence_penalty=0,
                                  logprobs=None, extra_body=extras)
    assert done.choices[0].text == "out0" and done.usage.completion_tokens == 4
    chat = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       logprobs=False, extra_body={**extras, "top_k": 0, "add_special_tokens": False})
    assert chat.choices[0].message.content == "out1"
    with pytest.raises(openai.BadRequestError) as info:
        sdk.completions.create(model=MODEL, prompt="hi", max_tokens=4, extra_body={"min_p": 0.2})
    assert info.value.body["param"] == "min_p"
    assert client.get("/openapi.json").json()["paths"]["/v1/completions"]["post"]["requestBody"]["content"][
        "application/json"]["schema"]["properties"]["n"]["maximum"] == fe.cfg.http.max_n
    models = sdk.models.list().data
    assert models[0].id == MODEL and models[0].model_extra["max_model_len"] == fe.model_cfg.max_position_embeddings


def test_n_choices_are_independent_requests_streamed_with_their_indices():
    fe, client = front_of(max_n=3)
    body = {"model": MODEL, "prompt": ["a", "b"], "n": 2, "max_tokens": 8, "temperature": 0.7, "seed": 41}
    done = client.post("/v1/completions", json=body).json()
    assert [c["index"] for c in done["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in done["choices"]] == ["out0", "out1", "out2", "out3"]
    assert [s["sampling"]["seed"] for s in fe.submitted] == [41, 42, 41, 42]  # per prompt: seed, seed + 1
    assert [s["rid"] for s in fe.submitted] == [f"{done['id']}-{i}" for i in range(4)]
    prompt_tokens = len(fe.submitted[0]["ids"]) + len(fe.submitted[2]["ids"])  # each prompt once
    assert done["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 16,
                             "total_tokens": prompt_tokens + 16}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 3, "max_tokens": 8,
            "temperature": 1.0, "stream": True, "stream_options": {"include_usage": True}}
    chunks = events(client.post("/v1/chat/completions", json=chat))
    texts: dict[int, str] = {}
    for c in chunks:
        for ch in c["choices"]:
            texts[ch["index"]] = texts.get(ch["index"], "") + ch["delta"].get("content", "")
    assert texts == {0: "out4", 1: "out5", 2: "out6"} and chunks[-1]["usage"]["completion_tokens"] == 12
    seeds = [s["sampling"]["seed"] for s in fe.submitted[4:]]
    assert len(set(seeds)) == 3  # no seed given: each choice draws its own
    r = client.post("/v1/completions", json={**body, "n": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n" and len(fe.submitted) == 7


def test_echo_puts_the_prompt_before_each_choice():
    fe, client = front_of()
    done = client.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "echo": True,
                                                "max_tokens": 4}).json()
    assert done["choices"][0]["text"] == "abcout0"
    chunks = events(client.post("/v1/completions", json={"model": MODEL, "prompt": "xy", "echo": True,
                                                         "max_tokens": 4, "stream": True}))
    assert chunks[0]["choices"][0]["text"] == "xy"
    assert "".join(c["choices"][0]["text"] for c in chunks) == "xyout1"


def test_response_id_is_the_request_id():
    fe, client = front_of()
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 4})
    assert r.json()["id"] == r.headers["x-request-id"]  # made here without Serve's proxy, returned in the header
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "a"}]},
                    headers={"x-request-id": "client-chosen-1"})
    assert r.json()["id"] == "client-chosen-1" and "x-request-id" not in r.headers  # the proxy returns its own


def test_cors_is_off_by_default_and_follows_allowed_origins():
    _, client = front_of()
    r = client.get("/v1/models", headers={"origin": "https://app.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    _, client = front_of(allowed_origins=["https://app.example"])
    pre = client.options("/v1/completions", headers={"origin": "https://app.example",
                                                     "access-control-request-method": "POST",
                                                     "access-control-request-headers": "authorization"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://app.example"
    r = client.get("/v1/models", headers={"origin": "https://app.example"})
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    r = client.get("/v1/models", headers={"origin": "https://other.example"})
    assert "access-control-allow-origin" not in r.headers


def test_chat_template_override_per_request_and_server_wide():
    msgs = [{"role": "user", "content": "q"}]
    template = "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    fe, client = front_of()  # a request's own template runs on the server: only when the operator trusts them
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "chat_template": template})
    assert "trust_request_chat_template" in error_of(r, "chat_template")["message"] and not fe.submitted
    fe, client = front_of(trust_request_chat_template=True)
    client.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 4})
    own = fe.submitted[-1]["ids"]
    client.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 4,
                                              "chat_template": template})
    assert fe.submitted[-1]["ids"] == fe.tokenizer.prompt_ids("[q]", fe.model_cfg.block_size) != own
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "chat_template": "{% if %}"})
    assert error_of(r, "chat_template", "invalid_chat_template") and len(fe.submitted) == 2
    fe, client = front_of(chat_template="{{ messages[0].content }}!")
    client.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 4})
    assert fe.submitted[-1]["ids"] == fe.tokenizer.prompt_ids("q!", fe.model_cfg.block_size)


def test_ignore_eos_decodes_to_max_tokens_in_the_engine():
    from engine.loading import load_engine
    from engine.sequence import SamplingParams

    engine = load_engine(MODEL, max_slots=2)
    prompt = "2+3="
    short = engine.generate([prompt], SamplingParams(max_tokens=24))[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 24  # the model ends its answer early
    full = engine.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 24


# ---- logprobs: each generated token's log-probability in the round that committed it ----------------------------
def test_logprobs_in_the_engine_change_nothing_else():
    from engine.loading import load_engine
    from engine.sequence import SamplingParams

    engine = load_engine(MODEL, max_slots=2)
    plain = engine.generate(["story: owl 8"], SamplingParams(max_tokens=32))[0]
    out = engine.generate(["story: owl 8"], SamplingParams(max_tokens=32, logprobs=True))[0]
    assert out.token_ids == plain.token_ids and plain.logprobs is None
    assert len(out.logprobs) == len(out.token_ids) and all(-104 < lp <= 0 for lp in out.logprobs)
    assert len(set(out.logprobs)) > 1


def test_logprobs_through_the_dispatcher_are_the_committing_rounds():
    """With greedy threshold decoding (0.9) a step commits every position above the threshold and, when none is,
    only the most confident one: so among the tokens one step committed, at most one has a probability of 0.9 or
    less. The canvas events name each step's tokens; the logprobs must agree with that rule."""
    import math

    from tests.builders import collect, make_dispatcher, make_replica, submit

    rep = make_replica()

    async def main():
        d = make_dispatcher()
        await d.connect("lp0", 1, **rep.info())
        stream = submit(d, "lp", "story: owl 8", 24, threshold=0.9, canvas=True, sampling={"logprobs": True})
        views, deltas, last = [], [], None
        async for event in stream:
            if event["type"] == "canvas":
                views.append(event["canvas"])
            elif event["type"] == "delta":
                deltas.append(event)
            last = event
        plain, plain_last = await collect(submit(d, "plain", "story: owl 8", 24, threshold=0.9))
        return views, deltas, last, plain, plain_last

    try:
        views, deltas, last, plain, plain_last = asyncio.run(main())
    finally:
        rep.close()
    assert last["type"] == "done" and last["text"] == plain and "logprobs" not in plain_last
    ids, lps = last["token_ids"], last["logprobs"]
    assert len(ids) == len(lps) == last["completion_tokens"] and all(lp is not None and lp <= 0 for lp in lps)
    assert [t for e in deltas for t in e["token_ids"]] == ids and [x for e in deltas for x in e["logprobs"]] == lps
    by_pos = dict(enumerate(lps))
    steps_checked = 0
    for v in views:
        low = [p for p, _, _ in v["committed"] if p in by_pos and by_pos[p] <= math.log(0.9)]
        assert len(low) <= 1, v
        steps_checked += bool(v["committed"])
    assert steps_checked >= 3 and any(lp <= math.log(0.9) for lp in lps)  # some steps had to take a weak token


def test_logprobs_shapes_in_the_api():
    fe, client = front_of()
    text = "out0"

    def submit(rid, ids, max_tokens, **kw):
        fe.submitted.append({"rid": rid, **kw})
        stream = FakeStream(text, len(ids), max_tokens)
        tid = [fe.tokenizer.encode(c)[0] for c in text]  # tiny-bd's vocabulary: one character a token
        for e in stream.events:
            if e["type"] == "delta":
                n = len(e["text"])
                e["token_ids"], e["logprobs"] = tid[:n], [-0.5] * n
                del tid[:n]
            if e["type"] == "done":
                e["token_ids"] = [fe.tokenizer.encode(c)[0] for c in text]
                e["logprobs"] = [-0.5, -0.25, -1.0, -2.0]
        return stream

    fe.dispatcher.submit = submit
    done = client.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 4,
                                                "logprobs": 0}).json()
    lp = done["choices"][0]["logprobs"]
    assert lp == {"tokens": ["o", "u", "t", "0"], "token_logprobs": [-0.5, -0.25, -1.0, -2.0], "top_logprobs": None,
                  "text_offset": [0, 1, 2, 3]}
    assert fe.submitted[-1]["sampling"]["logprobs"] is True
    chat = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "a"}],
                                                     "logprobs": True, "top_logprobs": 0}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == list("out0") and content[0]["bytes"] == [ord("o")]
    chunks = events(client.post("/v1/completions", json={"model": MODEL, "prompt": "a", "logprobs": 0,
                                                         "stream": True}))
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["text"]]
    assert [t for s in streamed for t in s["tokens"]] == list("out0")
    assert [o for s in streamed for o in s["text_offset"]] == [0, 1, 2, 3]
    # alternatives are not available: a 400 naming the field
    error_of(client.post("/v1/completions", json={"model": MODEL, "prompt": "a", "logprobs": 2}), "logprobs")
    error_of(client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "a"}],
                                                       "logprobs": True, "top_logprobs": 3}), "top_logprobs")
