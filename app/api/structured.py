"""Structured outputs and tool calls at the API: the fields that constrain a request's text (chat's
``response_format``; vLLM's ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` and
``structured_outputs``; SGLang's ``regex``, ``json_schema`` and ``ebnf``) become one
:class:`~engine.constraints.ConstraintSpec`, and ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` a
:class:`Tools` (with the constraint that ``required`` and a named function imply).

Only the shapes are checked here (a 400 naming the field); whether a schema, regex or grammar compiles is
the completion service's check (``engine.constraints.compile_cached``, off the event loop).

A call's text, as the model writes it under ``tool_choice: "required"``, is vLLM's: a JSON array of
``{"name": ..., "parameters": {...}}``; under a named function, the arguments object itself. With ``auto``
the text is read for calls in the Hermes form (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``)
or as that JSON array or object, and names must be among the tools (:func:`parse_tool_calls`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from app.api.errors import _missing, _type_error, _value_error, invalid, unknown, unsupported
from app.api.schemas import STRUCTURED_FIELDS, STRUCTURED_OUTPUTS_KEYS
from engine.constraints.spec import ConstraintSpec

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tools:
    """A chat's tools: their definitions as sent (``{"type": "function", "function": {...}}``, for the chat
    template), ``choice`` ("none", "auto", "required" or "named") with ``name`` for "named", and whether
    several calls may come at once."""

    tools: list[dict] = field(default_factory=list)
    choice: str = "none"
    name: str | None = None
    parallel: bool = True

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def parameters(self, name: str) -> dict:
        for t in self.tools:
            if t["function"]["name"] == name:
                return t["function"].get("parameters") or EMPTY_PARAMETERS
        raise KeyError(name)

    def constraint(self) -> ConstraintSpec | None:
        """What ``required`` and a named function enforce: vLLM's array of calls, or the named function's
        arguments; None for "none" and "auto"."""
        if self.choice == "named":
            i = self.names.index(self.name)
            return ConstraintSpec.json_schema(self.parameters(self.name), f"tools.{i}.function.parameters")
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"const": n}, "parameters": self.parameters(n)},
                  "required": ["name", "parameters"], "additionalProperties": False} for n in self.names]
        schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return ConstraintSpec.json_schema(schema, "tools")


def _schema_value(value: Any, param: str) -> dict | bool:
    """A JSON schema sent as an object, a boolean or its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise _value_error(param, "the schema is not valid JSON text.") from None
    if not isinstance(value, (dict, bool)):
        raise _type_error(param, "a JSON schema (an object, or its JSON text)", value)
    return value


def _text(value: Any, param: str, nonempty: bool = False) -> str:
    if not isinstance(value, str):
        raise _type_error(param, "a string", value)
    if nonempty and not value:
        raise invalid(f"Invalid '{param}': empty string.", param=param, code="empty_string")
    return value


def _choices(value: Any, param: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
        raise _type_error(param, "an array of strings", value)
    if not value:
        raise invalid(f"Invalid '{param}': empty array. Expected at least one choice.", param=param,
                      code="empty_array")
    return list(value)


def _bool(value: Any, param: str) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise _type_error(param, "a boolean", value)
    return value


def _structured_outputs(value: Any) -> ConstraintSpec:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise _type_error(param, "an object", value)
    for key in value:
        if key not in STRUCTURED_OUTPUTS_KEYS:
            raise unknown(f"{param}.{key}")
    ws = not _bool(value.get("disable_any_whitespace"), f"{param}.disable_any_whitespace")
    _bool(value.get("disable_fallback"), f"{param}.disable_fallback")  # one engine: there is nothing to fall to
    if _bool(value.get("disable_additional_properties"), f"{param}.disable_additional_properties"):
        raise unsupported(f"{param}.disable_additional_properties", (False,))
    if value.get("whitespace_pattern") is not None:
        raise unsupported(f"{param}.whitespace_pattern", (None,))
    given = [k for k in ("json", "regex", "choice", "grammar") if value.get(k) is not None]
    if value.get("json_object"):
        given.append("json_object")
    elif "json_object" in value:
        _bool(value["json_object"], f"{param}.json_object")
    if len(given) != 1:
        raise invalid(f"Invalid '{param}': give exactly one of json, regex, choice, grammar and json_object "
                      f"(got {', '.join(given) or 'none'}).", param=param, code="invalid_value")
    kind, where = given[0], f"{param}.{given[0]}"
    if kind == "json":
        return ConstraintSpec.json_schema(_schema_value(value[kind], where), where, ws)
    if kind == "json_object":
        return ConstraintSpec("json_object", "", where, ws)
    if kind == "choice":
        return ConstraintSpec.choice(_choices(value[kind], where), where)
    return ConstraintSpec(kind, _text(value[kind], where, nonempty=kind == "grammar"), where)


def _response_format(value: Any) -> ConstraintSpec | None:
    param = "response_format"
    if not isinstance(value, dict):
        raise _type_error(param, "an object", value)
    kind = value.get("type")
    if kind is None:
        raise _missing(f"{param}.type")
    allowed = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
    if kind not in allowed:
        raise _value_error(f"{param}.type", f"{kind!r}. Supported values are: 'text', 'json_object' and "
                                            "'json_schema'.")
    for key in value:
        if key not in allowed[kind]:
            raise unknown(f"{param}.{key}")
    if kind == "text":
        return None
    if kind == "json_object":
        return ConstraintSpec("json_object", "", param)
    spec = value.get("json_schema")
    where = f"{param}.json_schema"
    if spec is None:
        raise _missing(where)
    if not isinstance(spec, dict):
        raise _type_error(where, "an object", spec)
    for key in spec:
        if key not in ("name", "description", "schema", "strict"):
            raise unknown(f"{where}.{key}")
    if "name" not in spec:
        raise _missing(f"{where}.name")
    if not isinstance(spec["name"], str) or not _NAME.match(spec["name"]):
        raise _value_error(f"{where}.name", "a name of 1 to 64 letters, digits, underscores and dashes.")
    if spec.get("description") is not None:
        _text(spec["description"], f"{where}.description")
    _bool(spec.get("strict"), f"{where}.strict")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise _type_error(f"{where}.schema", "an object (a JSON schema)", schema)
    return ConstraintSpec.json_schema(schema, f"{where}.schema")


def constraint_of(data: dict, kind: str) -> ConstraintSpec | None:
    """The one constraint a raw body asks for (None: plain text); a 400 naming the field for a bad value,
    and for a second constraint besides the first."""
    found: list[tuple[str, ConstraintSpec]] = []
    for name in ("response_format", *STRUCTURED_FIELDS):
        value = data.get(name)
        if value is None or (name == "response_format" and kind != "chat"):
            continue
        if name == "response_format":
            spec = _response_format(value)
        elif name in ("guided_json", "json_schema"):
            if name == "json_schema" and not isinstance(value, str):
                raise _type_error(name, "a JSON schema's text", value)
            spec = ConstraintSpec.json_schema(_schema_value(value, name), name)
        elif name in ("guided_regex", "regex"):
            spec = ConstraintSpec("regex", _text(value, name), name)
        elif name == "guided_choice":
            spec = ConstraintSpec.choice(_choices(value, name), name)
        elif name in ("guided_grammar", "ebnf"):
            spec = ConstraintSpec("grammar", _text(value, name, nonempty=True), name)
        else:
            spec = _structured_outputs(value)
        if spec is not None:
            found.append((name, spec))
    if len(found) > 1:
        raise invalid(f"Send one structured-output constraint: '{found[0][0]}' and '{found[1][0]}' were both "
                      "given.", param=found[1][0], code="invalid_value")
    return found[0][1] if found else None


def _function(tool: Any, i: int) -> dict:
    param = f"tools.{i}"
    if not isinstance(tool, dict):
        raise _type_error(param, "an object", tool)
    for key in tool:
        if key not in ("type", "function"):
            raise unknown(f"{param}.{key}")
    if tool.get("type") != "function":
        if "type" not in tool:
            raise _missing(f"{param}.type")
        raise _value_error(f"{param}.type", f"{tool['type']!r}. Supported values are: 'function'.")
    fn = tool.get("function")
    if fn is None:
        raise _missing(f"{param}.function")
    if not isinstance(fn, dict):
        raise _type_error(f"{param}.function", "an object", fn)
    for key in fn:
        if key not in ("name", "description", "parameters", "strict"):
            raise unknown(f"{param}.function.{key}")
    if "name" not in fn:
        raise _missing(f"{param}.function.name")
    if not isinstance(fn["name"], str) or not _NAME.match(fn["name"]):
        raise _value_error(f"{param}.function.name", f"{fn['name']!r}: a name of 1 to 64 letters, digits, "
                                                     "underscores and dashes.")
    if fn.get("description") is not None:
        _text(fn["description"], f"{param}.function.description")
    _bool(fn.get("strict"), f"{param}.function.strict")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise _type_error(f"{param}.function.parameters", "an object (a JSON schema)", params)
    return {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}


def tools_of(data: dict) -> Tools:
    """A chat body's tools, choice and parallel flag, checked (400s naming the field)."""
    raw = data.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise _type_error("tools", "an array of tools", raw)
    tools = [_function(t, i) for i, t in enumerate(raw or [])]
    names = [t["function"]["name"] for t in tools]
    dup = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if dup is not None:
        raise _value_error("tools", f"two tools are named {dup!r}.")
    parallel = _bool(data.get("parallel_tool_calls"), "parallel_tool_calls")
    choice = data.get("tool_choice")
    name = None
    if choice is None:
        choice = "auto" if tools else "none"
    elif isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise _value_error("tool_choice", f"{choice!r}. Supported values are: 'none', 'auto', 'required' or "
                                              "a named function.")
    elif isinstance(choice, dict):
        for key in choice:
            if key not in ("type", "function"):
                raise unknown(f"tool_choice.{key}")
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _value_error("tool_choice", "a named function is {\"type\": \"function\", \"function\": "
                                              "{\"name\": ...}}.")
        for key in fn:
            if key != "name":
                raise unknown(f"tool_choice.function.{key}")
        name, choice = fn["name"], "named"
        if name not in names:
            raise invalid(f"Invalid value for 'tool_choice': no tool is named {name!r} (tools: "
                          f"{', '.join(map(repr, names)) or 'none'}).", param="tool_choice", code="invalid_value")
    else:
        raise _type_error("tool_choice", "a string or an object", choice)
    if choice in ("auto", "required") and not tools:
        raise invalid(f"Invalid value for 'tool_choice': {choice!r} needs 'tools'.", param="tool_choice",
                      code="invalid_value")
    return Tools(tools, choice, name, parallel is not False)


# ---------------------------------------------------------------- the answer's tool calls


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(name: str, arguments: Any, index: int | None = None) -> dict:
    """One ``message.tool_calls`` entry (``arguments``: JSON text, or a value written as JSON text)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    out = {"id": call_id(), "type": "function", "function": {"name": name, "arguments": args}}
    return out if index is None else {"index": index, **out}


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def _call_of(obj: Any, names: list[str]) -> tuple[str, Any] | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return (obj["name"], args) if isinstance(args, dict) else None


def parse_tool_calls(text: str, tools: Tools) -> tuple[str | None, list[tuple[str, dict]]]:
    """(content, calls) of an answer: under "named", the text is the arguments; under "required", vLLM's
    array; under "auto", Hermes ``<tool_call>`` blocks or a bare call object or array. No calls found: the
    text is the content."""
    names = tools.names
    if tools.choice == "named":
        try:
            args = json.loads(text)
        except ValueError:
            return text, []
        return None, [(tools.name, args)]
    stripped = text.strip()
    if tools.choice == "auto" and "<tool_call>" in text:
        calls = [c for m in _HERMES.finditer(text) for c in [_loads_call(m.group(1), names)] if c is not None]
        if calls:
            rest = _HERMES.sub("", text).strip()
            return rest or None, calls
        return text, []
    if tools.choice in ("auto", "required") and stripped[:1] in ("[", "{"):
        try:
            obj = json.loads(stripped)
        except ValueError:
            return text, []
        items = obj if isinstance(obj, list) else [obj]
        calls = [_call_of(o, names) for o in items]
        if calls and all(c is not None for c in calls):
            return None, calls  # type: ignore[return-value]
    return text, []


def _loads_call(text: str, names: list[str]) -> tuple[str, Any] | None:
    try:
        return _call_of(json.loads(text), names)
    except ValueError:
        return None


class ToolCallStream:
    """A streamed answer's text turned into chat deltas: content pieces, or ``tool_calls`` deltas (each
    call's ``index``, ``id``, ``type`` and ``function.name`` first, then its ``arguments`` in pieces).

    Named function: the text is the arguments, streamed as it comes. ``required``: each array element is
    sent once it is complete. ``auto``: text that may be a call (it starts with ``<tool_call>``, ``{`` or
    ``[``) is held to the end and parsed; any other text streams as content."""

    def __init__(self, tools: Tools) -> None:
        self.tools = tools
        self.buffer = ""
        self.calls = 0  # calls sent so far
        self.mode = "hold" if tools.choice in ("auto", "required") else "named"
        self._named_started = False
        self._pos = 0  # required: where the next array element starts in buffer

    def push(self, text: str) -> list[dict]:
        """The deltas for more answer text: ``{"content": ...}`` or ``{"tool_calls": [...]}``."""
        if not text:
            return []
        if self.mode == "named":
            out = []
            if not self._named_started:
                self._named_started = True
                self.calls = 1
                first = tool_call(self.tools.name, "", 0)
                out.append({"tool_calls": [first]})
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            return out
        if self.mode == "content":
            return [{"content": text}]
        self.buffer += text
        if self.tools.choice == "auto":
            s = self.buffer.lstrip()
            if s and not ("<tool_call>".startswith(s[:11]) or s[0] in "[{"):
                self.mode = "content"
                out, self.buffer = [{"content": self.buffer}], ""
                return out
            return []
        return self._complete_elements()

    def _complete_elements(self) -> list[dict]:
        """required: the array elements complete so far, each sent whole."""
        out = []
        dec = json.JSONDecoder()
        while True:
            i = self._pos
            b = self.buffer
            while i < len(b) and b[i] in " \t\r\n[,":
                i += 1
            if i >= len(b) or b[i] == "]":
                return out
            try:
                obj, end = dec.raw_decode(b, i)
            except ValueError:
                return out
            self._pos = end
            call = _call_of(obj, self.tools.names)
            if call is None:
                return out
            out.append({"tool_calls": [tool_call(call[0], call[1], self.calls)]})
            self.calls += 1

    def finish(self) -> list[dict]:
        """The deltas the end of the text releases (held text parsed as calls, or sent as content)."""
        if self.mode != "hold":
            return []
        if self.tools.choice == "required":
            return [] if self.calls else ([{"content": self.buffer}] if self.buffer else [])
        content, calls = parse_tool_calls(self.buffer, self.tools)
        out = [{"content": content}] if content else []
        for name, args in calls:
            out.append({"tool_calls": [tool_call(name, args, self.calls)]})
            self.calls += 1
        return out
