"""Structured outputs and tool calls end to end (issue 42's "done when", without Ray): the official ``openai``
SDK against the HTTP front (``app.frontend``, as the Ingress builds it) connected to an in-process replica of a
real engine: tiny-bd under guided_regex / guided_choice (plain and streamed), and on both tiny-bd (trained on
the task suite's json category, its character vocabulary) and the random-weight SDAR test checkpoint (byte-level
BPE, a model that knows nothing): finite JSON schemas (enums, booleans, bounded integers and strings, patterns,
nested objects, bounded arrays) and tool calls that validate, plain and streamed; tiny-mdm, whose vocabulary has
no braces or quotes, refuses JSON with a 400 naming the field."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from tasksuite import _prose_pattern, heldout_set

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.slow


def serve(model: str, body):
    """Run ``body(sdk)`` against the front of ``model`` (a name or a directory) with one replica."""
    from app.config import AppConfig
    from app.frontend import Frontend
    from app.replica import ReplicaServer
    from app.routes import build_web
    from engine.instance import Instance
    from engine.loading import load_engine

    async def main():
        rep = ReplicaServer(Instance(load_engine(model, max_slots=4), slots=4), tick_s=0.2)
        fe = Frontend(AppConfig(engine={"model": model, "slots": 4}, router={"predictors": "off"}))
        await fe.dispatcher.connect("r0", 1, **rep.info())
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_web(lambda: fe)), base_url="http://front")
        sdk = openai.AsyncOpenAI(base_url="http://front/v1", api_key="none", http_client=client, max_retries=0)
        try:
            return await body(sdk, fe.cfg.name)
        finally:
            await client.aclose()
            rep.close()

    return asyncio.run(main())


def test_tiny_bd_regex_and_choice_plain_and_streamed():
    ex = [e for e in heldout_set(60) if e.category == "prose"][0]
    pattern = _prose_pattern(ex.prompt.split()[1], int(ex.prompt.split()[2])).pattern

    async def body(sdk, model):
        out = {}
        plain = await sdk.completions.create(model=model, prompt=ex.prompt, max_tokens=160, extra_body={
            "guided_regex": pattern, "threshold": 0.5})
        out["plain"] = (plain.choices[0].text, plain.choices[0].finish_reason)
        stream = await sdk.completions.create(model=model, prompt=ex.prompt, max_tokens=160, stream=True,
                                              extra_body={"guided_regex": pattern, "threshold": 0.5})
        out["streamed"] = "".join([c.choices[0].text async for c in stream if c.choices])
        chat = await sdk.chat.completions.create(model=model, max_tokens=8, messages=[
            {"role": "user", "content": "max: a3 b7 c1 d5"}], extra_body={"guided_choice": ["yes", "no"]})
        out["choice"] = (chat.choices[0].message.content, chat.choices[0].finish_reason)
        return out

    out = serve("tiny-bd", body)
    assert re.fullmatch(pattern, out["plain"][0]) and out["plain"][1] == "stop", out["plain"]
    assert out["streamed"] == out["plain"][0]
    assert out["choice"][0] in ("yes", "no") and out["choice"][1] == "stop"


def test_a_vocabulary_without_braces_refuses_json_naming_the_field():
    async def body(sdk, model):
        with pytest.raises(openai.BadRequestError) as info:
            await sdk.chat.completions.create(model=model, max_tokens=8, messages=[{"role": "user", "content": "x"}],
                                              response_format={"type": "json_object"})
        return info.value.body

    out = serve("tiny-mdm", body)  # its tokenizer.json: the 51 characters of the core task suite
    assert out["param"] == "response_format" and "vocabulary" in out["message"]


TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "days": {
        "type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"], "additionalProperties": False}}}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "n", "tags", "ok", "who"],
          "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9},
                         "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,3}$"},
                                  "maxItems": 2},
                         "ok": {"type": "boolean"},
                         "who": {"type": "object", "additionalProperties": False, "required": ["name", "age"],
                                 "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 6},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 99}}}}}


@pytest.mark.parametrize("model", ["sdar", "tiny-bd"])
def test_json_schemas_and_tool_calls_validate(model, tmp_path):
    """On the byte-level checkpoint (random weights) and on tiny-bd (its character vocabulary writes JSON)."""
    from tests.checkpoints import build_checkpoint

    path = str(build_checkpoint("sdar", tmp_path / "sdar")) if model == "sdar" else model
    model_dir_is_bpe = model == "sdar"
    user = [{"role": "user", "content": "hello"}]

    async def body(sdk, model):
        out = {}
        fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}
        r = await sdk.chat.completions.create(model=model, messages=user, max_tokens=320, response_format=fmt)
        out["schema"] = (r.choices[0].message.content, r.choices[0].finish_reason)
        stream = await sdk.chat.completions.create(model=model, messages=user, max_tokens=320, response_format=fmt,
                                                   stream=True)
        chunks = [c async for c in stream]
        out["schema_streamed"] = ("".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
                                  [c.choices[0].finish_reason for c in chunks if c.choices][-1])
        # tiny-bd never learned to close a list of calls: one call (an untrained model may add calls to the budget)
        parallel = {} if model_dir_is_bpe else {"parallel_tool_calls": False}
        r = await sdk.chat.completions.create(model=model, messages=user, max_tokens=320, tools=[TIME, WEATHER],
                                              tool_choice="required", **parallel)
        out["required"] = r.choices[0]
        named = {"type": "function", "function": {"name": "get_weather"}}
        stream = await sdk.chat.completions.create(model=model, messages=user, max_tokens=320, tools=[TIME, WEATHER],
                                                   tool_choice=named, stream=True)
        out["named_chunks"] = [c async for c in stream]
        with pytest.raises(openai.BadRequestError) as info:
            await sdk.chat.completions.create(model=model, messages=user, tools=[TIME],
                                              tool_choice={"type": "function", "function": {"name": "nope"}})
        out["bad_tool"] = info.value.body
        return out

    out = serve(path, body)
    for key in ("schema", "schema_streamed"):
        text, reason = out[key]
        assert reason == "stop", (key, text)
        jsonschema.validate(json.loads(text), SCHEMA)
    choice = out["required"]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    for call in choice.message.tool_calls:
        tool = {"get_time": TIME, "get_weather": WEATHER}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        assert call.id.startswith("call_")
    deltas = [tc for c in out["named_chunks"] for ch in c.choices for tc in (ch.delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].id.startswith("call_")
    jsonschema.validate(json.loads("".join(d.function.arguments or "" for d in deltas)),
                        WEATHER["function"]["parameters"])
    assert [c.choices[0].finish_reason for c in out["named_chunks"] if c.choices][-1] == "tool_calls"
    assert out["bad_tool"]["param"] == "tool_choice"
