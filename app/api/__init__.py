"""OpenAI-compatible request parsing and response shapes for the Remask ingress.

Pure Python (pydantic only): the HTTP layer hands a raw body to :func:`parse_request` (or
:func:`parse_tokenize`, :func:`parse_detokenize`), gets a :class:`GenRequest` back or an :class:`APIError`
whose :meth:`APIError.to_dict` is the OpenAI error body, and builds responses, stream chunks and server-sent
events with the helpers below. The shapes follow the OpenAI API reference (``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``) so the official ``openai`` client parses them, with vLLM's
extensions where Remask has them (``top_k``, ``stop_token_ids``, ``add_generation_prompt``, ``/tokenize``,
``/detokenize``, ``/version``).

Nothing in a body is silently ignored: a field is implemented, or accepted only at its default (a no-op) and
refused otherwise (400 ``unsupported_parameter``), or unknown and refused (400 ``unknown_parameter``).
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema, create_model

ErrorType = Literal["invalid_request_error", "rate_limit_error", "server_error", "not_found_error", "permission_error"]
CHAT_ROLES = ("system", "user", "assistant")  # the roles of a parsed chat
INPUT_ROLES = ("system", "developer", "user", "assistant")  # the roles a request may send ("developer": system)
MAX_PROMPTS = 64  # prompts in one /v1/completions request
MAX_STOP = 4  # stop strings (OpenAI's limit)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
TOKEN_ID_MAX = 2**31 - 1  # the largest token id accepted when the vocabulary size is not known
_STARTED = int(time.time())


class APIError(Exception):
    """An error answered with ``status`` and an OpenAI-style body ``{"error": {...}}``."""

    def __init__(self, status: int, message: str, *, type: ErrorType = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        message, param = _printable(message), None if param is None else _printable(param)
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __repr__(self) -> str:
        return (f"APIError({self.status}, {self.message!r}, type={self.type!r}, param={self.param!r}, "
                f"code={self.code!r})")


def _printable(text: str) -> str:
    """``text`` with lone surrogates (valid in JSON strings, not in UTF-8) escaped, so an error that quotes
    a client's string can always be encoded."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 ``invalid_request_error``."""
    return APIError(400, message, param=param, code=code)


def rate_limit_error(message: str, retry_after_s: float | None = None) -> APIError:
    """A 429 ``rate_limit_error``, with a ``Retry-After`` header (whole seconds, at least 1) when given."""
    headers = {"Retry-After": str(max(1, math.ceil(retry_after_s)))} if retry_after_s is not None else None
    return APIError(429, message, type="rate_limit_error", code="rate_limit_exceeded", headers=headers)


def server_error(message: str = "The server had an error while processing your request.",
                 status: int = 500) -> APIError:
    """A 5xx ``server_error``."""
    return APIError(status, message, type="server_error")


def permission_error(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 403 ``permission_error``: the caller may not do what it asked (e.g. a ``priority`` above its key's)."""
    return APIError(403, message, type="permission_error", param=param, code=code)


def request_timeout(seconds: float) -> APIError:
    """A 408 for a request body that did not arrive within ``seconds``."""
    return APIError(408, f"The request body did not arrive within {seconds:g} seconds.", code="request_timeout")


def not_found_error(message: str) -> APIError:
    """A 404 ``not_found_error`` (unknown route or object)."""
    return APIError(404, message, type="not_found_error", code="not_found")


def body_too_large(limit: int) -> APIError:
    """A 413 for a request body over ``limit`` bytes."""
    return APIError(413, f"The request body is too large: at most {limit} bytes are accepted.",
                    code="request_too_large")


def check_content_length(header: str | None, limit: int) -> None:
    """Raise 413 early when a declared ``Content-Length`` is over ``limit`` (the body is still counted as
    it arrives: the header may be absent or wrong)."""
    if header is not None and header.strip().isdigit() and int(header) > limit:
        raise body_too_large(limit)


# ---------------------------------------------------------------------------------------------------------------
# Request models
# ---------------------------------------------------------------------------------------------------------------


# The models below check the types of simple fields (strictly: "8" is not an integer, 1.0 is not one either,
# true is not a number) and document every body (:func:`request_schema`, the OpenAPI request bodies). Fields
# with several forms (prompt, messages, stop, token ids) are typed ``Any`` with the schema of what they accept:
# the parser checks them itself, to word its own errors. Known fields that Remask does not implement are fields
# too, documented with the only values accepted (their defaults).

# Known OpenAI/vLLM fields that Remask does not implement: the values accepted (each a no-op, the default);
# any other value is refused with 400 ``unsupported_parameter``. Numbers compare by value (0 == 0.0), other
# values by type and value (false is not 0).
COMPLETION_NOOPS: dict[str, tuple] = {
    "best_of": (None, 1), "echo": (None, False), "frequency_penalty": (None, 0), "presence_penalty": (None, 0),
    "logit_bias": (None, {}), "logprobs": (None,), "suffix": (None, ""),
}
CHAT_NOOPS: dict[str, tuple] = {
    "frequency_penalty": (None, 0), "presence_penalty": (None, 0), "logit_bias": (None, {}),
    "logprobs": (None, False), "top_logprobs": (None,), "response_format": (None, {"type": "text"}),
    "tools": (None, []), "tool_choice": (None, "none"), "parallel_tool_calls": (None,), "functions": (None,),
    "function_call": (None,), "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,),
    "reasoning_effort": (None,), "service_tier": (None, "auto", "default"), "store": (None, False),
    "metadata": (None,), "web_search_options": (None,), "verbosity": (None,), "prompt_cache_key": (None,),
    "continue_final_message": (None, False),
}
# Fields of one chat message besides role, content and name (what the client's own response messages carry
# when a conversation is sent back: ``message.model_dump()`` has them as null).
MESSAGE_NOOPS: dict[str, tuple] = {
    "tool_calls": (None, []), "tool_call_id": (None,), "function_call": (None,), "refusal": (None,),
    "audio": (None,), "annotations": (None, []),
}
TOKENIZE_NOOPS: dict[str, tuple] = {"return_token_strs": (None, False)}
# stream_options keys Remask implements; any other is refused as unknown. ``include_canvas`` is Remask's
# extension: a ``remask_canvas`` chunk per denoising step (``canvas_chunk``).
STREAM_OPTIONS = ("include_usage", "include_canvas")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _same(a: Any, b: Any) -> bool:
    """JSON equality: numbers by value, everything else by type and value (recursively)."""
    if _is_number(a) and _is_number(b):
        return a == b
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


_TOKEN_ID = {"type": "integer", "minimum": 0, "title": "token id"}  # narrowed to the vocabulary by request_schema
_TOKEN_IDS = {"type": "array", "items": _TOKEN_ID}
_NONEMPTY_STR = {"type": "string", "minLength": 1}
_PROMPT_SCHEMA = {"anyOf": [
    _NONEMPTY_STR,
    {"type": "array", "items": _NONEMPTY_STR, "minItems": 1, "maxItems": MAX_PROMPTS},
    {**_TOKEN_IDS, "minItems": 1},
    {"type": "array", "items": {**_TOKEN_IDS, "minItems": 1}, "minItems": 1, "maxItems": MAX_PROMPTS}],
    "description": f"a string, an array of strings (one choice each), an array of token ids (one prompt) or an "
                   f"array of arrays of token ids; at most {MAX_PROMPTS} prompts"}
_STOP_SCHEMA = {"anyOf": [_NONEMPTY_STR, {"type": "array", "items": _NONEMPTY_STR, "maxItems": MAX_STOP},
                          {"type": "null"}],
                "description": f"up to {MAX_STOP} non-empty strings; generation stops before the first one found"}
_STOP_IDS_SCHEMA = {"anyOf": [_TOKEN_IDS, {"type": "null"}],
                    "description": "token ids that end generation (vLLM's extension)"}
_TEXT_PART = {"type": "object", "required": ["type", "text"], "additionalProperties": False,
              "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}


def _noop_schema(values: tuple) -> dict:
    return {"enum": list(values), "description": "not supported by Remask: only this default is accepted"}


_MESSAGE_SCHEMA = {
    "type": "object", "required": ["role", "content"], "additionalProperties": False,
    "properties": {
        "role": {"enum": list(CHAT_ROLES), "description": "'developer' is accepted too, as 'system'; tool "
                                                          "messages are not supported"},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART, "minItems": 1}],
                    "description": "a string or an array of text parts (joined with newlines)"},
        "name": {"anyOf": [{"type": "string"}, {"type": "null"}], "description": "passed to the chat template"},
        **{k: _noop_schema(v) for k, v in MESSAGE_NOOPS.items()}}}
# an anyOf of one: the shape older clients of this schema read (messages -> anyOf[0] -> items)
_MESSAGES_SCHEMA = {"anyOf": [{"type": "array", "items": _MESSAGE_SCHEMA, "minItems": 1}]}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool | None = Field(False, description="a last chunk with the usage of the whole request")
    include_canvas: bool | None = Field(False, description="Remask: a chunk per denoising step with the canvas "
                                                           "of the request's current block (`remask_canvas`)")


class _CommonRequest(BaseModel):
    """Fields shared by completion and chat requests."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = Field(None, description="the served model; the only one when absent")
    max_tokens: int | None = Field(None, description="tokens to generate at most (the default when absent)",
                                   json_schema_extra={"minimum": 1})
    stream: bool | None = False
    stream_options: StreamOptions | None = Field(None, description="only with stream: true")
    temperature: float | None = Field(None, allow_inf_nan=False, json_schema_extra={"minimum": 0, "maximum": 2},
                                      description="0: greedy; absent: the model's default")
    top_p: float | None = Field(None, allow_inf_nan=False, json_schema_extra={"exclusiveMinimum": 0, "maximum": 1})
    top_k: int | None = Field(None, json_schema_extra={"minimum": -1, "maximum": TOKEN_ID_MAX},
                              description="vLLM's extension: -1 or 0 turns it off")
    seed: int | None = Field(None, json_schema_extra={"minimum": INT64_MIN, "maximum": INT64_MAX})
    stop: Annotated[Any, WithJsonSchema(_STOP_SCHEMA)] = None
    stop_token_ids: Annotated[Any, WithJsonSchema(_STOP_IDS_SCHEMA)] = None
    n: int | None = Field(1, description="only 1 is supported", json_schema_extra={"minimum": 1, "maximum": 1})
    user: str | None = Field(None, description="an end-user id (metadata)")
    # Remask extensions
    slo_ms: float | None = Field(default=None, allow_inf_nan=False, json_schema_extra={"minimum": 0},
                                 description="Remask: end-to-end latency objective in milliseconds")
    priority: int = Field(0, description="Remask: scheduling priority")
    threshold: float | None = Field(default=None, allow_inf_nan=False,
                                    json_schema_extra={"exclusiveMinimum": 0, "maximum": 1},
                                    description="Remask: a fixed confidence threshold for parallel unmasking")


class _CompletionFields(_CommonRequest):
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"required": ["prompt"]})
    prompt: Annotated[Any, WithJsonSchema(_PROMPT_SCHEMA)] = None


class _ChatFields(_CommonRequest):
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"required": ["messages"]})
    messages: Annotated[Any, WithJsonSchema(_MESSAGES_SCHEMA)] = None
    max_completion_tokens: int | None = Field(None, description="read when max_tokens is absent",
                                              json_schema_extra={"minimum": 1})
    add_generation_prompt: bool | None = Field(True, description="vLLM's extension: end the rendered chat with the "
                                                                 "assistant's turn")
    safety_identifier: str | None = Field(None, description="an end-user id (metadata)")


def _with_noops(name: str, base: type[BaseModel], noops: dict[str, tuple], doc: str) -> type[BaseModel]:
    fields: dict[str, Any] = {k: (Annotated[Any, WithJsonSchema(_noop_schema(v))], None) for k, v in noops.items()}
    return create_model(name, __base__=base, __doc__=doc, **fields)


CompletionRequest = _with_noops("CompletionRequest", _CompletionFields, COMPLETION_NOOPS,
                                "``POST /v1/completions``.")
ChatCompletionRequest = _with_noops("ChatCompletionRequest", _ChatFields, CHAT_NOOPS,
                                    "``POST /v1/chat/completions``; ``max_completion_tokens`` is read when "
                                    "``max_tokens`` is absent.")


class _TokenizeCommon(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = Field(None, description="the served model; the only one when absent")
    return_token_strs: Annotated[Any, WithJsonSchema(_noop_schema(TOKENIZE_NOOPS["return_token_strs"]))] = None


class TokenizePromptRequest(_TokenizeCommon):
    """``POST /tokenize`` of a text."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"required": ["prompt"]})
    prompt: str | None = None
    add_special_tokens: bool | None = Field(True, description="e.g. a leading BOS token")


class TokenizeChatRequest(_TokenizeCommon):
    """``POST /tokenize`` of a chat, rendered with the model's chat template."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"required": ["messages"]})
    messages: Annotated[Any, WithJsonSchema(_MESSAGES_SCHEMA)] = None
    add_special_tokens: bool | None = Field(False, description="besides those of the chat template")
    add_generation_prompt: bool | None = True
    continue_final_message: Annotated[Any, WithJsonSchema(_noop_schema(CHAT_NOOPS["continue_final_message"]))] \
        = None


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"required": ["tokens"]})
    model: str | None = Field(None, description="the served model; the only one when absent")
    tokens: Annotated[Any, WithJsonSchema(_TOKEN_IDS)] = None


_SCHEMA_MODELS: dict[str, tuple[type[BaseModel], ...]] = {
    "completion": (CompletionRequest,), "chat": (ChatCompletionRequest,),
    "tokenize": (TokenizePromptRequest, TokenizeChatRequest), "detokenize": (DetokenizeRequest,)}


def _inline(node: Any, defs: dict) -> Any:
    if isinstance(node, dict):
        if "$ref" in node:
            return _inline(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
        return {k: _inline(v, defs) for k, v in node.items() if k != "$defs"}
    if isinstance(node, list):
        return [_inline(v, defs) for v in node]
    return node


def _narrow_token_ids(node: Any, vocab_size: int) -> None:
    if isinstance(node, dict):
        if node.get("title") == "token id":
            node["maximum"] = vocab_size - 1
        for v in node.values():
            _narrow_token_ids(v, vocab_size)
    elif isinstance(node, list):
        for v in node:
            _narrow_token_ids(v, vocab_size)


def _model_schema(cls: type[BaseModel], model: str | None, max_tokens_limit: int | None,
                  vocab_size: int | None) -> dict:
    raw = cls.model_json_schema()
    schema = _inline(raw, raw.get("$defs", {}))
    props = schema["properties"]
    if model is not None:
        props["model"] = {"anyOf": [{"enum": [model]}, {"type": "null"}], "default": None,
                          "description": props["model"].get("description", "")}
    if max_tokens_limit is not None:
        for name in ("max_tokens", "max_completion_tokens"):
            if name in props:
                props[name]["maximum"] = max_tokens_limit
    if vocab_size is not None:
        _narrow_token_ids(schema, vocab_size)
    return schema


def request_schema(kind: str, model: str | None = None, max_tokens_limit: int | None = None,
                   vocab_size: int | None = None) -> dict:
    """The JSON schema of a ``kind`` body (``"completion"``, ``"chat"``, ``"tokenize"``, ``"detokenize"``), without
    ``$ref``s (it sits inline in the OpenAPI document); ``model``, ``max_tokens_limit`` and ``vocab_size`` narrow it
    to one application's values."""
    if kind not in _SCHEMA_MODELS:
        raise ValueError(f"unknown request kind {kind!r}")
    schemas = [_model_schema(cls, model, max_tokens_limit, vocab_size) for cls in _SCHEMA_MODELS[kind]]
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def openapi_body(kind: str, model: str | None = None, max_tokens_limit: int | None = None,
                 vocab_size: int | None = None) -> dict:
    """The ``openapi_extra`` of a POST route whose handler reads the raw body: its documented request body."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": request_schema(kind, model, max_tokens_limit, vocab_size)}}}}


# ---------------------------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------------------------


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


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _type_error(param: str, expected: str, value: Any) -> APIError:
    return invalid(f"Invalid type for '{param}': expected {expected}, but got {_json_type(value)} instead.",
                   param=param, code="invalid_type")


def _value_error(param: str, message: str, code: str = "invalid_value") -> APIError:
    return invalid(f"Invalid value for '{param}': {message}", param=param, code=code)


def _missing(param: str, message: str | None = None) -> APIError:
    return invalid(message or f"Missing required parameter: '{param}'.", param=param,
                   code="missing_required_parameter")


def unsupported(param: str, accepted: tuple = ()) -> APIError:
    """A 400 for a known parameter that Remask does not implement (sent with another value than its default)."""
    hint = f" Omit it or send {' or '.join(json.dumps(v) for v in accepted)}." if accepted else ""
    return invalid(f"Remask does not support '{param}'.{hint}", param=param, code="unsupported_parameter")


def unknown(param: str) -> APIError:
    """A 400 for a field Remask does not know (as OpenAI words it)."""
    return invalid(f"Unrecognized request argument supplied: {param}", param=param, code="unknown_parameter")


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
        raise _type_error(param, "a string or an array of text parts (tool calls are not supported)", value)
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
            elif key not in ("role", "content", "name"):
                raise unknown(f"{param}.{key}")
        if "role" not in msg:
            raise _missing(f"{param}.role")
        role = msg["role"]
        if not isinstance(role, str):
            raise _type_error(f"{param}.role", "a string", role)
        if role in ("tool", "function"):
            raise invalid(f"Remask does not support '{role}' messages (nor tool calls).", param=f"{param}.role",
                          code="unsupported_value")
        if role not in INPUT_ROLES:
            raise _value_error(f"{param}.role", f"{role!r}. Supported values are: "
                                                f"{', '.join(repr(r) for r in INPUT_ROLES)}.")
        if "content" not in msg:
            raise _missing(f"{param}.content")
        entry = {"role": "system" if role == "developer" else role, "content": _content(msg["content"],
                                                                                         f"{param}.content")}
        name = msg.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise _type_error(f"{param}.name", "a string", name)
            entry["name"] = name
        out.append(entry)
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


def _sampling(req: Any, vocab_size: int | None) -> dict:
    """The checked sampling and stop fields, as GenRequest's keyword arguments."""
    if req.n not in (None, 1):
        raise invalid(f"Invalid value for 'n': {req.n}. Only n=1 is supported.", param="n", code="invalid_value")
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
        stop_token_ids=[] if req.stop_token_ids is None else _token_ids(req.stop_token_ids, "stop_token_ids",
                                                                        vocab_size))


def parse_request(kind: str, body: bytes | str, *, known_models: list[str], max_tokens_limit: int,
                  default_max_tokens: int, vocab_size: int | None = None) -> GenRequest:
    """Validate a raw completion (``kind="completion"``) or chat (``kind="chat"``) body; raise :class:`APIError`.

    Token ids (prompts, ``stop_token_ids``) must be below ``vocab_size`` when it is given."""
    if kind not in ("completion", "chat"):
        raise ValueError(f"unknown request kind {kind!r}")
    data = _load_json(body)
    if kind == "completion":
        req = _validate(CompletionRequest, data, COMPLETION_NOOPS)
        prompts, messages = _prompts(req.prompt, vocab_size), []
        limit_param, max_tokens, add_generation_prompt = "max_tokens", req.max_tokens, True
        prefix = "cmpl-"
    else:
        req = _validate(ChatCompletionRequest, data, CHAT_NOOPS)
        prompts, messages = [], _messages(req.messages)
        limit_param = "max_tokens" if req.max_tokens is not None or req.max_completion_tokens is None \
            else "max_completion_tokens"
        max_tokens = req.max_tokens if req.max_tokens is not None else req.max_completion_tokens
        add_generation_prompt = req.add_generation_prompt is not False
        prefix = "chatcmpl-"
    model = _resolve_model(req.model, known_models)
    sampling = _sampling(req, vocab_size)
    return GenRequest(
        request_id=prefix + uuid.uuid4().hex, kind=kind, model=model, prompts=prompts, messages=messages,
        max_tokens=_max_tokens(max_tokens, limit_param, max_tokens_limit, default_max_tokens),
        add_generation_prompt=add_generation_prompt, stream=bool(req.stream),
        include_usage=bool(req.stream and req.stream_options and req.stream_options.include_usage),
        include_canvas=bool(req.stream and req.stream_options and req.stream_options.include_canvas),
        slo_ms=req.slo_ms, priority=req.priority, threshold=req.threshold, created=int(time.time()), **sampling)


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


# ---------------------------------------------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------------------------------------------


def usage_dict(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _envelope(req: GenRequest, obj: str, choices: list[dict]) -> dict:
    return {"id": req.request_id, "object": obj, "created": req.created, "model": req.model, "choices": choices}


def completion_response(req: GenRequest, choices: list[tuple[str, str]], prompt_tokens: int,
                        completion_tokens: int) -> dict:
    """A non-streamed ``text_completion`` object: ``choices`` are ``(text, finish_reason)`` in prompt order, and
    the usage is the whole request's (all prompts)."""
    if isinstance(choices, str):
        raise TypeError("choices is a list of (text, finish_reason) pairs")
    out = _envelope(req, "text_completion", [{"index": i, "text": text, "logprobs": None, "finish_reason": reason}
                                             for i, (text, reason) in enumerate(choices)])
    out["usage"] = usage_dict(prompt_tokens, completion_tokens)
    return out


def chat_response(req: GenRequest, text: str, finish_reason: str, prompt_tokens: int,
                  completion_tokens: int) -> dict:
    """A non-streamed ``chat.completion`` object."""
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
              "finish_reason": finish_reason}
    out = _envelope(req, "chat.completion", [choice])
    out["usage"] = usage_dict(prompt_tokens, completion_tokens)
    return out


def _with_null_usage(req: GenRequest, chunk: dict) -> dict:
    # With stream_options.include_usage, OpenAI sends "usage": null on every chunk but the last.
    if req.include_usage:
        chunk["usage"] = None
    return chunk


def completion_chunk(req: GenRequest, text_delta: str, finish_reason: str | None = None, index: int = 0) -> dict:
    """One streamed ``text_completion`` chunk of choice ``index`` (the prompt's position; same object as the
    non-streamed response, without usage)."""
    choice = {"index": index, "text": text_delta, "logprobs": None, "finish_reason": finish_reason}
    return _with_null_usage(req, _envelope(req, "text_completion", [choice]))


def chat_chunk(req: GenRequest, delta_text: str | None = None, finish_reason: str | None = None,
               role: bool = False) -> dict:
    """One ``chat.completion.chunk``; the first carries ``delta.role == "assistant"`` (``role=True``)."""
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = "assistant"
    if delta_text is not None or role:
        delta["content"] = delta_text if delta_text is not None else ""
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return _with_null_usage(req, _envelope(req, "chat.completion.chunk", [choice]))


def canvas_chunk(req: GenRequest, canvas: dict, index: int = 0) -> dict:
    """Remask's stream extension (``stream_options.include_canvas``): a chunk without choices whose
    ``remask_canvas`` is one denoising step of choice ``index`` on the canvas: ``round`` (the request's
    denoising steps so far), ``instance`` and ``tp`` that ran it, ``threshold``, ``block`` ([start, end) of
    the block it worked on), ``committed`` ([position, token id, text piece] committed by this step),
    ``masked`` (the block's positions still masked) and ``length`` (the canvas); positions count from the
    answer's first token."""
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    view = {"index": index, "round": canvas["step"], **{k: v for k, v in canvas.items() if k != "step"}}
    return _with_null_usage(req, {**_envelope(req, obj, []), "remask_canvas": view})


def usage_chunk(req: GenRequest, prompt_tokens: int, completion_tokens: int) -> dict:
    """The last chunk of a stream with ``include_usage``: no choices, the usage of the whole request."""
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    out = _envelope(req, obj, [])
    out["usage"] = usage_dict(prompt_tokens, completion_tokens)
    return out


def sse(data: dict | str) -> str:
    """One server-sent event: ``data: <json>\\n\\n`` for a dict, ``data: <text>\\n\\n`` for a string."""
    if isinstance(data, str):
        if "\n" in data or "\r" in data:
            raise ValueError("an SSE data string must be a single line")
        payload = data
    else:
        payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n"


SSE_DONE = sse("[DONE]")


def model_response(model_id: str, created: int | None = None) -> dict:
    """One model object (``GET /v1/models/{model}``, and each entry of ``GET /v1/models``)."""
    return {"id": model_id, "object": "model", "created": _STARTED if created is None else created,
            "owned_by": "remask"}


def models_response(models: list[str], created: int | None = None) -> dict:
    """The ``GET /v1/models`` list."""
    return {"object": "list", "data": [model_response(m, created) for m in models]}


def version_response() -> dict:
    """``GET /version`` (vLLM's): the installed remask package's version."""
    try:
        version = importlib.metadata.version("remask")
    except importlib.metadata.PackageNotFoundError:
        version = "0.0.0"
    return {"version": version}


def tokenize_response(tokens: list[int], max_model_len: int) -> dict:
    """``POST /tokenize``'s answer (vLLM's shape)."""
    return {"count": len(tokens), "max_model_len": max_model_len, "tokens": list(tokens)}


def detokenize_response(text: str) -> dict:
    """``POST /detokenize``'s answer (vLLM's shape)."""
    return {"prompt": text}
