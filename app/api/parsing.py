"""Parsing and validation of raw request bodies into :class:`GenRequest` and :class:`TokenizeRequest`; any bad
input raises :class:`~app.api.errors.APIError`."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from app.api.errors import APIError, _missing, _type_error, _value_error, invalid, unknown, unsupported
from app.api.schemas import (
    CHAT_NOOPS,
    COMPLETION_NOOPS,
    INPUT_ROLES,
    INT64_MAX,
    INT64_MIN,
    MAX_PROMPTS,
    MAX_STOP,
    MESSAGE_NOOPS,
    STREAM_OPTIONS,
    TOKEN_ID_MAX,
    TOKENIZE_NOOPS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizePromptRequest,
    _is_int,
    _same,
)
from app.api.structured import Tools, constraint_of, tools_of
from engine.constraints.spec import ConstraintSpec


@dataclass
class GenRequest:
    """A validated generation request, independent of the endpoint it came from."""

    request_id: str
    kind: str  # "completion" | "chat"
    model: str
    prompts: list[str | list[int]]  # completion: one entry per prompt (text, or token ids); chat: []
    messages: list[dict]  # chat: [{"role": "system"|"user"|"assistant", "content": str[, "name": str]}]; else []
    max_tokens: int
    add_generation_prompt: bool = True  # chat (vLLM's extension field); ignored for completions
    stream: bool = False
    include_usage: bool = False
    include_canvas: bool = False  # Remask's stream extension: a ``remask_canvas`` chunk per denoising step
    slo_ms: float | None = None
    priority: int = 0
    threshold: float | None = None
    temperature: float | None = None  # None: the model's default (generation_config.json); 0: greedy
    top_p: float | None = None
    top_k: int | None = None  # None: off (the request's -1 or 0, or a value at least the vocabulary size)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # at most MAX_STOP non-empty strings
    stop_token_ids: list[int] = field(default_factory=list)
    created: int = 0
    logprobs: bool = False  # each generated token's log-probability
    n: int = 1  # choices per prompt, each an independent request
    ignore_eos: bool = False  # decode to max_tokens past the model's end of text
    echo: bool = False  # completions: the prompt before each choice's text
    chat_template: str | None = None  # chat: this request's template instead of the server's
    constraint: ConstraintSpec | None = None  # what the text must be (structured outputs); None: any text
    tools: Tools = field(default_factory=Tools)  # chat: the tools, tool_choice and parallel_tool_calls
    decoding: str | None = None  # the decoding rule by name (engine/decoding/); None: the server's
    decoding_config: dict | None = None  # its configuration (without ``decoding``: the server's rule's)

    @property
    def prompt(self) -> str | list[int]:
        """The prompt of a single-prompt completion (for callers that serve one prompt)."""
        if self.kind != "completion" or len(self.prompts) != 1:
            raise ValueError(f"a {self.kind} request with {len(self.prompts)} prompts has no single prompt")
        return self.prompts[0]


@dataclass
class TokenizeRequest:
    """A validated ``/tokenize`` request: exactly one of ``prompt`` and ``messages``."""

    model: str
    prompt: str | None = None
    messages: list[dict] | None = None  # as GenRequest.messages
    add_special_tokens: bool = True  # absent from the body: True for a prompt, False for messages (as vLLM)
    add_generation_prompt: bool = True  # messages only


def _load_json(body: bytes | str) -> dict:
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        raise invalid("We could not parse the JSON body of your request. (HINT: This likely means you aren't "
                      "using your HTTP library correctly. The OpenAI API expects a JSON payload.)",
                      code="invalid_json") from None
    if not isinstance(data, dict):
        raise invalid(f"The request body must be a JSON object, got {type(data).__name__}.", code="invalid_type")
    return data



_PYDANTIC_TYPES = {"int_type": "an integer", "float_type": "a number", "bool_type": "a boolean",
                   "string_type": "a string", "model_type": "an object", "dict_type": "an object",
                   "list_type": "an array"}


def _validation_error(exc: ValidationError) -> APIError:
    err = exc.errors()[0]
    param = ".".join(str(p) for p in err.get("loc", ())) or None
    if param is not None and err.get("type") in _PYDANTIC_TYPES:
        return _type_error(param, _PYDANTIC_TYPES[err["type"]], err.get("input"))
    if param is not None and err.get("type") == "extra_forbidden":
        return unknown(param)
    msg = err.get("msg", "invalid value")
    return invalid(f"Invalid value for '{param}': {msg}.", param=param, code="invalid_value")


def _check_fields(data: dict, model_cls: type[BaseModel], noops: dict[str, tuple], prefix: str = "") -> None:
    """Refuse unknown fields and known unimplemented ones sent with another value than their default."""
    for key, value in data.items():
        if key in noops:
            if not any(_same(value, ok) for ok in noops[key]):
                raise unsupported(prefix + key, noops[key])
        elif key not in model_cls.model_fields:
            raise unknown(prefix + key)


def _validate(model_cls: type[BaseModel], data: dict, noops: dict[str, tuple]) -> Any:
    _check_fields(data, model_cls, noops)
    options = data.get("stream_options")
    if isinstance(options, dict):
        for key in options:
            if key not in STREAM_OPTIONS:
                raise unknown(f"stream_options.{key}")
        if options.get("continuous_usage_stats") not in (None, False):
            raise unsupported("stream_options.continuous_usage_stats", (False,))
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc) from None


def _resolve_model(model: str | None, known_models: list[str]) -> str:
    if model is None and known_models:
        return known_models[0]
    if model not in known_models:
        raise APIError(404, f"The model `{model}` does not exist or you do not have access to it.",
                       param="model", code="model_not_found")
    return model


def _token_ids(value: Any, param: str, vocab_size: int | None, where: str = "") -> list[int]:
    """``value`` as a list of token ids, each an integer in [0, vocab_size) (or [0, TOKEN_ID_MAX])."""
    if not isinstance(value, list):
        raise _type_error(param, "an array of token ids", value)
    high = vocab_size if vocab_size is not None else TOKEN_ID_MAX + 1
    for i, token in enumerate(value):
        if not _is_int(token):
            raise _type_error(param, "an array of token ids (integers)", token)
        if not 0 <= token < high:
            raise _value_error(param, f"token id {token} (at position {i}{where}) is out of range: token ids are "
                                      f"integers in [0, {high}).")
    return list(value)


def _prompts(value: Any, vocab_size: int | None) -> list[str | list[int]]:
    """The prompts of a completion: a string, an array of strings, an array of token ids (one prompt) or an
    array of arrays of token ids."""
    forms = "a string, an array of strings, an array of token ids or an array of arrays of token ids"
    if value is None:
        raise _missing("prompt")
    if isinstance(value, str):
        items: list = [value]
    elif not isinstance(value, list):
        raise _type_error("prompt", forms, value)
    elif not value:
        raise invalid("Invalid 'prompt': empty array. Expected a non-empty prompt.", param="prompt",
                      code="empty_array")
    elif all(_is_int(v) for v in value):
        items = [value]
    elif all(isinstance(v, str) for v in value) or all(isinstance(v, list) for v in value):
        items = value
    else:
        raise _type_error("prompt", forms + " (not a mix)", value)
    if len(items) > MAX_PROMPTS:
        raise invalid(f"Invalid 'prompt': array too long. Expected at most {MAX_PROMPTS} prompts, but got "
                      f"{len(items)} instead.", param="prompt", code="array_above_max_length")
    out: list[str | list[int]] = []
    for i, item in enumerate(items):
        which = f"prompt {i}" if len(items) > 1 else ""
        if not item:
            raise invalid(f"Invalid 'prompt'{f' ({which})' if which else ''}: empty. Expected a non-empty string or "
                          "array of token ids.", param="prompt",
                          code="empty_string" if isinstance(item, str) else "empty_array")
        out.append(item if isinstance(item, str) else _token_ids(item, "prompt", vocab_size,
                                                                  f", {which}" if which else ""))
    return out


def _content(value: Any, param: str) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        raise _type_error(param, "a string or an array of text parts", value)
    if not isinstance(value, list):
        raise _type_error(param, "a string or an array of text parts", value)
    if not value:
        raise invalid(f"Invalid '{param}': empty array. Expected an array with minimum length 1, but got an empty "
                      "array instead.", param=param, code="empty_array")
    texts = []
    for j, part in enumerate(value):
        where = f"{param}.{j}"
        if not isinstance(part, dict):
            raise _type_error(where, "an object (a text part)", part)
        kind = part.get("type")
        if kind != "text":
            if not isinstance(kind, str):
                raise _type_error(f"{where}.type", "a string", kind) if "type" in part else _missing(f"{where}.type")
            raise invalid(f"Remask does not support content parts of type '{kind}': only 'text' parts are "
                          "supported.", param=f"{where}.type", code="unsupported_value")
        for key in part:
            if key not in ("type", "text"):
                raise unknown(f"{where}.{key}")
        if "text" not in part:
            raise _missing(f"{where}.text")
        if not isinstance(part["text"], str):
            raise _type_error(f"{where}.text", "a string", part["text"])
        texts.append(part["text"])
    return "\n".join(texts)


def _messages(value: Any) -> list[dict]:
    """The messages of a chat, each ``{"role", "content"}`` (and ``"name"`` when sent); "developer" is "system"."""
    if value is None:
        raise _missing("messages")
    if not isinstance(value, list):
        raise _type_error("messages", "an array of messages", value)
    if not value:
        raise invalid("Invalid 'messages': empty array. Expected an array with minimum length 1, but got an empty "
                      "array instead.", param="messages", code="empty_array")
    out = []
    for i, msg in enumerate(value):
        param = f"messages.{i}"
        if not isinstance(msg, dict):
            raise _type_error(param, "an object", msg)
        for key, item in msg.items():
            if key in MESSAGE_NOOPS:
                if not any(_same(item, ok) for ok in MESSAGE_NOOPS[key]):
                    raise unsupported(f"{param}.{key}", MESSAGE_NOOPS[key])
            elif key not in ("role", "content", "name", "tool_calls", "tool_call_id"):
                raise unknown(f"{param}.{key}")
        if "role" not in msg:
            raise _missing(f"{param}.role")
        role = msg["role"]
        if not isinstance(role, str):
            raise _type_error(f"{param}.role", "a string", role)
        if role == "function":
            raise invalid("Remask does not support the legacy 'function' messages: send 'tool' messages.",
                          param=f"{param}.role", code="unsupported_value")
        if role not in INPUT_ROLES:
            raise _value_error(f"{param}.role", f"{role!r}. Supported values are: "
                                                f"{', '.join(repr(r) for r in INPUT_ROLES)}.")
        calls = _message_tool_calls(msg.get("tool_calls"), f"{param}.tool_calls", role)
        if msg.get("tool_call_id") is not None and role != "tool":
            raise invalid(f"Invalid '{param}.tool_call_id': only a 'tool' message answers a tool call.",
                          param=f"{param}.tool_call_id", code="invalid_value")
        if role == "tool" and not isinstance(msg.get("tool_call_id"), str):
            raise (_missing(f"{param}.tool_call_id") if msg.get("tool_call_id") is None
                   else _type_error(f"{param}.tool_call_id", "a string", msg["tool_call_id"]))
        if msg.get("content") is None and calls:
            content = ""  # an assistant turn that only called tools
        elif "content" not in msg:
            raise _missing(f"{param}.content")
        else:
            content = _content(msg["content"], f"{param}.content")
        entry: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
        if calls:
            entry["tool_calls"] = calls
        if role == "tool":
            entry["tool_call_id"] = msg["tool_call_id"]
        name = msg.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise _type_error(f"{param}.name", "a string", name)
            entry["name"] = name
        out.append(entry)
    return out


def _message_tool_calls(value: Any, param: str, role: str) -> list[dict]:
    """An assistant message's ``tool_calls`` (as the client's own responses carry them), for the template."""
    if value is None or value == []:
        return []
    if role != "assistant":
        raise invalid(f"Invalid '{param}': only an assistant message carries tool calls.", param=param,
                      code="invalid_value")
    if not isinstance(value, list):
        raise _type_error(param, "an array of tool calls", value)
    out = []
    for j, call in enumerate(value):
        where = f"{param}.{j}"
        if not isinstance(call, dict):
            raise _type_error(where, "an object", call)
        for key in call:
            if key not in ("id", "type", "function", "index"):
                raise unknown(f"{where}.{key}")
        fn = call.get("function")
        if not isinstance(fn, dict):
            raise (_missing(f"{where}.function") if fn is None else _type_error(f"{where}.function", "an object",
                                                                                 fn))
        for key in ("name", "arguments"):
            if not isinstance(fn.get(key), str):
                raise (_missing(f"{where}.function.{key}") if key not in fn
                       else _type_error(f"{where}.function.{key}", "a string", fn[key]))
        for key in fn:
            if key not in ("name", "arguments"):
                raise unknown(f"{where}.function.{key}")
        if not isinstance(call.get("id"), str):
            raise _missing(f"{where}.id") if "id" not in call else _type_error(f"{where}.id", "a string", call["id"])
        out.append({"id": call["id"], "type": "function",
                    "function": {"name": fn["name"], "arguments": fn["arguments"]}})
    return out


def _max_tokens(value: int | None, param: str, limit: int, default: int) -> int:
    if value is None:
        return min(default, limit)
    if value <= 0:
        raise invalid(f"Invalid '{param}': integer below minimum value. Expected a value >= 1, but got {value} "
                      "instead.", param=param, code="integer_below_min_value")
    if value > limit:
        raise invalid(f"{param} is too large: {value}. At most {limit} completion tokens may be requested, "
                      f"whereas you provided {value}.", param=param, code="integer_above_max_value")
    return value


def _in_range(param: str, value: float | int | None, low: float, high: float, low_open: bool = False) -> None:
    if value is None:
        return
    number = "integer" if _is_int(value) else "decimal"
    if value < low or (low_open and value == low):
        bound = f"> {low}" if low_open else f">= {low}"
        raise invalid(f"Invalid '{param}': {number} below minimum value. Expected a value {bound}, but got {value} "
                      "instead.", param=param, code=f"{number}_below_min_value")
    if value > high:
        raise invalid(f"Invalid '{param}': {number} above maximum value. Expected a value <= {high}, but got "
                      f"{value} instead.", param=param, code=f"{number}_above_max_value")


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise _type_error("stop", "a string or an array of strings", value)
    if len(items) > MAX_STOP:
        raise invalid(f"Invalid 'stop': array too long. Expected an array with maximum length {MAX_STOP}, but got "
                      f"an array with length {len(items)} instead.", param="stop", code="array_above_max_length")
    if any(s == "" for s in items):
        raise invalid("Invalid 'stop': empty string. Expected non-empty stop strings.", param="stop",
                      code="empty_string")
    return list(items)


def _sampling(req: Any, vocab_size: int | None, max_n: int = 1) -> dict:
    """The checked sampling and stop fields, as GenRequest's keyword arguments."""
    if req.n is not None and not 1 <= req.n <= max_n:
        raise invalid(f"Invalid value for 'n': {req.n}. This server generates 1 to {max_n} choices per prompt "
                      "(http.max_n).", param="n", code="invalid_value")
    _in_range("temperature", req.temperature, 0, 2)
    _in_range("top_p", req.top_p, 0, 1, low_open=True)
    _in_range("top_k", req.top_k, -1, TOKEN_ID_MAX)
    _in_range("seed", req.seed, INT64_MIN, INT64_MAX)
    if req.threshold is not None and not 0.0 < req.threshold <= 1.0:
        raise invalid(f"Invalid value for 'threshold': {req.threshold}. Expected a value in (0, 1].",
                      param="threshold", code="invalid_value")
    if req.slo_ms is not None and req.slo_ms < 0:
        raise invalid(f"Invalid value for 'slo_ms': {req.slo_ms}. Expected a non-negative number of milliseconds.",
                      param="slo_ms", code="invalid_value")
    if req.stream_options is not None and req.stream_options.model_fields_set and not req.stream:
        raise invalid("Invalid value for 'stream_options': it is only allowed when 'stream' is true.",
                      param="stream_options", code="invalid_value")
    top_k = req.top_k
    if top_k is not None and (top_k <= 0 or (vocab_size is not None and top_k >= vocab_size)):
        top_k = None  # off, or keeps every token: the same
    return dict(
        temperature=None if req.temperature is None else float(req.temperature),
        top_p=None if req.top_p is None else float(req.top_p), top_k=top_k, seed=req.seed, stop=_stop(req.stop),
        n=req.n or 1, ignore_eos=bool(req.ignore_eos),
        stop_token_ids=[] if req.stop_token_ids is None else _token_ids(req.stop_token_ids, "stop_token_ids",
                                                                        vocab_size))


def _decoding(name: str | None, config: dict | None, base: Any) -> dict:
    """A request's decoding rule and configuration, checked as the engine will make it (``resolve_rule``: the
    request's over the server's): an unknown rule is a 400 naming ``decoding``, an unknown field or a value out
    of range one naming ``decoding_config.<field>``."""
    if name is None and config is None:
        return {}
    from engine.commands import resolve_rule  # the rules import without torch

    try:
        resolve_rule(base, name, config)
    except ValueError as exc:
        msg = str(exc)
        if msg.startswith("decoding:"):
            raise invalid(f"Invalid value for 'decoding': {msg.split(': ', 1)[1]}.", param="decoding",
                          code="invalid_value") from None
        detail = msg.split(": ", 1)[1] if ": " in msg else msg
        field = next((k for k in (config or {}) if detail.startswith(f"{k} ") or f"field {k!r}" in detail), None)
        param = "decoding_config" if field is None else f"decoding_config.{field}"
        raise invalid(f"Invalid value for '{param}': {detail}.", param=param, code="invalid_value") from None
    return {"decoding": name, "decoding_config": None if config is None else dict(config)}


def parse_request(kind: str, body: bytes | str, *, known_models: list[str], max_tokens_limit: int,
                  default_max_tokens: int, vocab_size: int | None = None, max_n: int = 1,
                  request_id: str | None = None, decoding_base: Any = None) -> GenRequest:
    """Validate a raw completion (``kind="completion"``) or chat (``kind="chat"``) body; raise :class:`APIError`.

    Token ids (prompts, ``stop_token_ids``) must be below ``vocab_size`` when it is given; ``n`` at most
    ``max_n``. The request's id is ``request_id`` (the ``X-Request-ID`` it is answered with), else a new one.
    ``decoding_base``: the server's decoding rule (a request's ``decoding_config`` without ``decoding``
    configures it; None: ``threshold``)."""
    if kind not in ("completion", "chat"):
        raise ValueError(f"unknown request kind {kind!r}")
    data = _load_json(body)
    if "best_of" in data and _is_int(data["best_of"]) and _same(data["best_of"], data.get("n", 1)):
        data = {k: v for k, v in data.items() if k != "best_of"}  # best_of == n: the n choices, a no-op
    if kind == "completion":
        req = _validate(CompletionRequest, data, COMPLETION_NOOPS)
        prompts, messages = _prompts(req.prompt, vocab_size), []
        limit_param, max_tokens, add_generation_prompt = "max_tokens", req.max_tokens, True
        prefix, extra = "cmpl-", {"echo": bool(req.echo), "logprobs": req.logprobs is not None}
        if req.logprobs is not None and req.logprobs != 0:
            raise invalid(f"Remask returns each generated token's log-probability ('logprobs': 0), not the top "
                          f"{req.logprobs} alternatives.", param="logprobs", code="unsupported_parameter")
        if req.logprobs is not None and req.echo:
            raise invalid("Remask does not return the prompt's log-probabilities: 'logprobs' with 'echo' is not "
                          "supported.", param="logprobs", code="unsupported_parameter")
    else:
        req = _validate(ChatCompletionRequest, data, CHAT_NOOPS)
        prompts, messages = [], _messages(req.messages)
        limit_param = "max_tokens" if req.max_tokens is not None or req.max_completion_tokens is None \
            else "max_completion_tokens"
        max_tokens = req.max_tokens if req.max_tokens is not None else req.max_completion_tokens
        add_generation_prompt = req.add_generation_prompt is not False
        prefix, extra = "chatcmpl-", {"chat_template": req.chat_template, "logprobs": bool(req.logprobs)}
    constraint = constraint_of(data, kind)
    if kind == "chat":
        tools = tools_of(data)
        implied = tools.constraint()
        if implied is not None and constraint is not None:
            raise invalid(f"tool_choice {tools.choice if tools.choice != 'named' else 'naming a function'!r} "
                          f"constrains the answer to tool calls: it cannot be combined with "
                          f"'{constraint.param.split('.')[0]}'.", param="tool_choice", code="invalid_value")
        extra["tools"] = tools
        constraint = constraint or implied
    extra["constraint"] = constraint
    if constraint is not None and req.ignore_eos:
        raise invalid("'ignore_eos' cannot be combined with a structured-output constraint: the text ends where "
                      "the constraint is complete.", param="ignore_eos", code="invalid_value")
    model = _resolve_model(req.model, known_models)
    sampling = _sampling(req, vocab_size, max_n)
    sampling.update(_decoding(req.decoding, req.decoding_config, decoding_base))
    return GenRequest(
        request_id=request_id or prefix + uuid.uuid4().hex, kind=kind, model=model, prompts=prompts, messages=messages,
        max_tokens=_max_tokens(max_tokens, limit_param, max_tokens_limit, default_max_tokens),
        add_generation_prompt=add_generation_prompt, stream=bool(req.stream),
        include_usage=bool(req.stream and req.stream_options and req.stream_options.include_usage),
        include_canvas=bool(req.stream and req.stream_options and req.stream_options.include_canvas),
        slo_ms=req.slo_ms, priority=req.priority, threshold=req.threshold, created=int(time.time()), **sampling,
        **extra)


def parse_tokenize(body: bytes | str, known_models: list[str]) -> TokenizeRequest:
    """Validate a raw ``/tokenize`` body (vLLM's shape): ``{"prompt": str}`` or ``{"messages": [...]}``, with
    ``add_special_tokens`` (default: true for a prompt, false for messages, as vLLM) and, for messages,
    ``add_generation_prompt`` (default true)."""
    data = _load_json(body)
    if "prompt" in data and "messages" in data:
        raise invalid("Send either 'prompt' or 'messages', not both.", param="messages", code="invalid_value")
    if "messages" in data:
        req = _validate(TokenizeChatRequest, data, {**TOKENIZE_NOOPS, "continue_final_message":
                                                    CHAT_NOOPS["continue_final_message"]})
        messages = _messages(req.messages)
        return TokenizeRequest(model=_resolve_model(req.model, known_models), prompt=None, messages=messages,
                               add_special_tokens=bool(req.add_special_tokens),
                               add_generation_prompt=req.add_generation_prompt is not False)
    req = _validate(TokenizePromptRequest, data, TOKENIZE_NOOPS)
    if req.prompt is None:
        raise _missing("prompt", "Missing required parameter: 'prompt' (or 'messages').")
    return TokenizeRequest(model=_resolve_model(req.model, known_models), prompt=req.prompt, messages=None,
                           add_special_tokens=req.add_special_tokens is not False)


def parse_detokenize(body: bytes | str, known_models: list[str], vocab_size: int | None) -> tuple[str, list[int]]:
    """Validate a raw ``/detokenize`` body ``{"model"?, "tokens": [ids]}``: the model and the token ids."""
    data = _load_json(body)
    req = _validate(DetokenizeRequest, data, {})
    if req.tokens is None:
        raise _missing("tokens")
    tokens = _token_ids(req.tokens, "tokens", vocab_size)
    return _resolve_model(req.model, known_models), tokens

