"""Structured outputs and tool calls at the API (issue 42 item 1), without Ray: the fields parsed into one
constraint (400s naming the field), the compile check once per distinct schema, the constraint handed to the
dispatcher, and tool calls shaped as OpenAI's (``message.tool_calls``, ``finish_reason: "tool_calls"``,
streamed deltas), driven through the official ``openai`` SDK against the front (``app.frontend``) of the tiny
SDAR test checkpoint (a byte-level BPE vocabulary that can write JSON), its dispatcher replaced by a fake
generation that answers the text a test sets."""

from __future__ import annotations

import asyncio
import json

import pytest

from app.api import APIError, parse_request
from app.api.structured import ToolCallStream, Tools, parse_tool_calls
from app.config import AppConfig
from engine.constraints import CACHE, ConstraintSpec

testclient = pytest.importorskip("fastapi.testclient")
openai = pytest.importorskip("openai")

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                   "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer",
                                                                                   "minimum": 0, "maximum": 9}},
          "required": ["answer", "n"], "additionalProperties": False}


def parse(kind: str, body: dict):
    return parse_request(kind, json.dumps(body), known_models=["m"], max_tokens_limit=64, default_max_tokens=16)


def refused(kind: str, body: dict, param: str) -> APIError:
    with pytest.raises(APIError) as info:
        parse(kind, body)
    assert info.value.status == 400 and info.value.param == param, info.value
    return info.value


# ---------------------------------------------------------------- parsing


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("field,value,spec", [
    ("guided_json", SCHEMA, ConstraintSpec.json_schema(SCHEMA, "guided_json")),
    ("guided_json", json.dumps(SCHEMA), ConstraintSpec.json_schema(SCHEMA, "guided_json")),
    ("guided_regex", "[a-z]+ [0-9]", ConstraintSpec("regex", "[a-z]+ [0-9]", "guided_regex")),
    ("guided_choice", ["yes", "no"], ConstraintSpec.choice(["yes", "no"], "guided_choice")),
    ("guided_grammar", 'root ::= "a"+', ConstraintSpec("grammar", 'root ::= "a"+', "guided_grammar")),
    ("structured_outputs", {"json": SCHEMA}, ConstraintSpec.json_schema(SCHEMA, "structured_outputs.json")),
    ("structured_outputs", {"regex": "a+", "disable_fallback": True},
     ConstraintSpec("regex", "a+", "structured_outputs.regex")),
    ("structured_outputs", {"json_object": True, "disable_any_whitespace": True},
     ConstraintSpec("json_object", "", "structured_outputs.json_object", False)),
    ("structured_outputs", {"choice": ["a"]}, ConstraintSpec.choice(["a"], "structured_outputs.choice")),
    ("regex", "a|b", ConstraintSpec("regex", "a|b", "regex")),
    ("json_schema", json.dumps(SCHEMA), ConstraintSpec.json_schema(SCHEMA, "json_schema")),
    ("ebnf", 'root ::= "x"', ConstraintSpec("grammar", 'root ::= "x"', "ebnf")),
])
def test_each_constraint_field_on_both_endpoints(kind, field, value, spec):
    body = {"prompt": "a"} if kind == "completion" else {"messages": USER}
    assert parse(kind, {**body, field: value}).constraint == spec


def test_response_format():
    assert parse("chat", {"messages": USER, "response_format": {"type": "text"}}).constraint is None
    assert parse("chat", {"messages": USER, "response_format": {"type": "json_object"}}).constraint == \
        ConstraintSpec("json_object", "", "response_format")
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    assert parse("chat", {"messages": USER, "response_format": fmt}).constraint == \
        ConstraintSpec.json_schema(SCHEMA, "response_format.json_schema.schema")
    assert parse("chat", {"messages": USER, "guided_json": None, "response_format": None}).constraint is None


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "text", "x": 1}}, "response_format.x"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": []}}},
     "response_format.json_schema.schema"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": 3}, "guided_json"),
    ({"guided_regex": 3}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", 1]}, "guided_choice"),
    ({"guided_grammar": ""}, "guided_grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs.regexp"),
    ({"structured_outputs": {"json": {}, "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
    ({"guided_choice": ["a"], "ignore_eos": True}, "ignore_eos"),
])
def test_bad_constraint_fields_are_400s_naming_them(body, param):
    refused("chat", {"messages": USER, **body}, param)


def test_tools_and_tool_choice():
    req = parse("chat", {"messages": USER, "tools": [WEATHER, TIME]})
    assert req.tools.choice == "auto" and req.tools.names == ["get_weather", "get_time"] and req.constraint is None
    assert parse("chat", {"messages": USER, "tools": [WEATHER], "tool_choice": "none"}).constraint is None
    named = parse("chat", {"messages": USER, "tools": [WEATHER, TIME],
                           "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert named.tools.choice == "named" and named.tools.name == "get_time"
    assert named.constraint == ConstraintSpec.json_schema(TIME["function"]["parameters"],
                                                          "tools.1.function.parameters")
    required = parse("chat", {"messages": USER, "tools": [WEATHER, TIME], "tool_choice": "required",
                              "parallel_tool_calls": False})
    schema = required.constraint.schema
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [c["properties"]["name"]["const"] for c in schema["items"]["anyOf"]] == ["get_weather", "get_time"]
    assert "maxItems" not in parse("chat", {"messages": USER, "tools": [WEATHER], "tool_choice": "required"}
                                   ).constraint.schema


@pytest.mark.parametrize("body,param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "x": 1}}]}, "tools.0.function.x"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_bad_tools_are_400s_naming_the_field(body, param):
    refused("chat", {"messages": USER, **body}, param)


def test_a_tool_conversation_is_accepted():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "x"}'}}
    req = parse("chat", {"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                                      {"role": "tool", "tool_call_id": "call_1", "content": "12 C"}],
                         "tools": [WEATHER]})
    assert req.messages[1] == {"role": "assistant", "content": "", "tool_calls": [call]}
    assert req.messages[2] == {"role": "tool", "content": "12 C", "tool_call_id": "call_1"}
    refused("chat", {"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id")
    refused("chat", {"messages": [{"role": "user", "content": "x", "tool_calls": [call]}]}, "messages.0.tool_calls")


def test_tool_calls_out_of_text():
    tools = Tools([WEATHER, TIME], "auto")
    assert parse_tool_calls("hello", tools) == ("hello", [])
    assert parse_tool_calls('<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>', tools) \
        == (None, [("get_time", {"zone": "utc"})])
    assert parse_tool_calls('[{"name": "get_time", "parameters": {"zone": "x"}}]', tools) == \
        (None, [("get_time", {"zone": "x"})])
    assert parse_tool_calls('{"name": "unknown", "arguments": {}}', tools)[1] == []
    assert parse_tool_calls('{"zone": "x"}', Tools([TIME], "named", "get_time")) == (None, [("get_time",
                                                                                             {"zone": "x"})])


def test_required_calls_stream_as_each_completes():
    stream = ToolCallStream(Tools([WEATHER, TIME], "required"))
    text = '[{"name": "get_time", "parameters": {"zone": "utc"}}, {"name": "get_weather", "parameters": ' \
           '{"city": "paris", "unit": "c"}}]'
    deltas = [d for i in range(0, len(text), 7) for d in stream.push(text[i:i + 7])] + stream.finish()
    calls = [d["tool_calls"][0] for d in deltas]
    assert [c["index"] for c in calls] == [0, 1]
    assert [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "paris", "unit": "c"}
    assert all(c["id"].startswith("call_") for c in calls) and calls[0]["id"] != calls[1]["id"]


def test_auto_streams_plain_text_as_content():
    stream = ToolCallStream(Tools([WEATHER], "auto"))
    assert stream.push("It is") == [{"content": "It is"}] and stream.push(" sunny") == [{"content": " sunny"}]
    assert stream.finish() == [] and stream.calls == 0


# ---------------------------------------------------------------- through the front and the openai SDK


class FakeStream:
    """A generation's events: accepted, the text in pieces of five characters, done (finish ``stop``)."""

    def __init__(self, text: str, prompt_tokens: int, max_tokens: int) -> None:
        self.events = [{"type": "accepted", "add_ms": 0.1}] + [
            {"type": "delta", "text": text[i:i + 5]} for i in range(0, len(text), 5)] + [
            {"type": "done", "finish_reason": "stop", "text": text, "prompt_tokens": prompt_tokens,
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


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    from app.frontend import Frontend
    from app.routes import build_web
    from tests.checkpoints import build_checkpoint

    path = build_checkpoint("sdar", tmp_path_factory.mktemp("structured") / "sdar")
    fe = Frontend(AppConfig(engine={"model": str(path), "slots": 4}, router={"predictors": "off"}, http={}))
    fe.submitted, fe.answer = [], "x"

    def submit(rid, ids, max_tokens, **kw):
        fe.submitted.append({"rid": rid, "ids": list(ids), "max_tokens": max_tokens, **kw})
        return FakeStream(fe.answer, len(ids), max_tokens)

    fe.dispatcher.submit = submit
    client = testclient.TestClient(build_web(lambda: fe))
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)
    return fe, sdk


def test_json_schema_through_the_sdk_reaches_the_dispatcher_compiled_once(front):
    fe, sdk = front
    fe.answer = '{"answer": "yes", "n": 3}'
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    before = CACHE.compiles
    for _ in range(3):
        out = sdk.chat.completions.create(model=fe.cfg.name, messages=USER, response_format=fmt, max_tokens=32)
        assert json.loads(out.choices[0].message.content) == {"answer": "yes", "n": 3}
    assert CACHE.compiles - before <= 1  # one compile for the three (none when an earlier test compiled it)
    sent = fe.submitted[-1]["sampling"]["constraint"]
    assert ConstraintSpec.from_dict(sent) == ConstraintSpec.json_schema(SCHEMA, "response_format.json_schema.schema")


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format.json_schema.schema"),
    ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex"),
    ({"extra_body": {"guided_grammar": "root ::= missing_rule"}}, "guided_grammar"),
    ({"extra_body": {"structured_outputs": {"json": {"type": "string", "minLength": 5, "maxLength": 2}}}},
     "structured_outputs.json"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
])
def test_what_does_not_compile_is_a_400_naming_the_field(front, extra, param):
    fe, sdk = front
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model=fe.cfg.name, messages=USER, max_tokens=8, **extra)
    assert info.value.status_code == 400 and info.value.body["param"] == param, info.value.body


def test_completions_take_vllms_fields(front):
    fe, sdk = front
    fe.answer = "no"
    out = sdk.completions.create(model=fe.cfg.name, prompt="a", max_tokens=4,
                                 extra_body={"guided_choice": ["yes", "no"]})
    assert out.choices[0].text == "no"
    assert ConstraintSpec.from_dict(fe.submitted[-1]["sampling"]["constraint"]).choices == ["yes", "no"]


def test_required_tool_call_through_the_sdk(front):
    fe, sdk = front
    fe.answer = '[{"name": "get_weather", "parameters": {"city": "paris", "unit": "c"}}]'
    out = sdk.chat.completions.create(model=fe.cfg.name, messages=USER, tools=[WEATHER, TIME],
                                      tool_choice="required", max_tokens=64)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "paris", "unit": "c"}
    assert fe.submitted[-1]["sampling"]["constraint"]["param"] == "tools"


def test_named_tool_call_streamed_assembles(front):
    fe, sdk = front
    fe.answer = '{"zone": "Europe/Paris"}'
    stream = sdk.chat.completions.create(model=fe.cfg.name, messages=USER, tools=[WEATHER, TIME], stream=True,
                                         tool_choice={"type": "function", "function": {"name": "get_time"}})
    chunks = list(stream)
    deltas = [tc for c in chunks for ch in c.choices for tc in (ch.delta.tool_calls or [])]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_time" and deltas[0].index == 0
    assert len(deltas) > 2  # the arguments come in pieces
    args = "".join(d.function.arguments or "" for d in deltas)
    assert json.loads(args) == {"zone": "Europe/Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_with_a_hermes_call_and_with_plain_text(front):
    fe, sdk = front
    fe.answer = '<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>'
    out = sdk.chat.completions.create(model=fe.cfg.name, messages=USER, tools=[WEATHER, TIME], max_tokens=64)
    assert out.choices[0].finish_reason == "tool_calls"
    assert out.choices[0].message.tool_calls[0].function.name == "get_time"
    assert fe.submitted[-1]["sampling"].get("constraint") is None  # auto constrains nothing
    fe.answer = "It is sunny."
    stream = sdk.chat.completions.create(model=fe.cfg.name, messages=USER, tools=[WEATHER], stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "It is sunny."
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_tools_reach_the_chat_template(front):
    fe, sdk = front
    fe.answer = "ok"
    template = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}"
                "{% for m in messages %}{{ m.content }}{% endfor %}")
    fe.cfg.http.trust_request_chat_template = True
    try:
        sdk.chat.completions.create(model=fe.cfg.name, messages=USER, tools=[WEATHER, TIME], max_tokens=4,
                                    extra_body={"chat_template": template})
    finally:
        fe.cfg.http.trust_request_chat_template = False
    text = fe.completions.tokenizer.decode(fe.submitted[-1]["ids"])
    assert text.startswith("TOOLS:get_weather;get_time;")
