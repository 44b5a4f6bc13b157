"""OpenAI-compatible request parsing and response shapes for the Remask ingress.

Pure Python (pydantic only): the HTTP layer hands a raw body to :func:`parse_request`, gets a
:class:`GenRequest` back or an :class:`APIError` whose :meth:`APIError.to_dict` is the OpenAI error body,
and builds responses, stream chunks and server-sent events with the helpers below. The shapes follow the
OpenAI API reference (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``) so the official
``openai`` client parses them.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema, field_validator

ErrorType = Literal["invalid_request_error", "rate_limit_error", "server_error", "not_found_error"]
CHAT_ROLES = ("system", "user", "assistant")
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


# The models below validate (through :func:`parse_request`, whose messages follow OpenAI's) and document
# (:func:`request_schema`, the OpenAPI request bodies). Fields typed loosely so that the parser can word its
# own errors carry the schema of what they accept.
_STR_OR_STRS = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}, {"type": "null"}]}


def _check_str_or_str_list(value: Any, what: str) -> Any:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    raise ValueError(f"expected a string or an array of strings for {what}")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _CommonRequest(BaseModel):
    """Fields shared by completion and chat requests; unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="the served model; the only one when absent")
    max_tokens: int | None = Field(None, description="tokens to generate at most (the default when absent)",
                                   json_schema_extra={"minimum": 1})
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, allow_inf_nan=False, description="accepted, not used")
    top_p: float | None = Field(default=None, allow_inf_nan=False, description="accepted, not used")
    n: int | None = Field(1, description="only 1 is supported", json_schema_extra={"minimum": 1, "maximum": 1})
    stop: Annotated[Any, WithJsonSchema(_STR_OR_STRS)] = None
    user: str | None = None
    # Remask extensions
    slo_ms: float | None = Field(default=None, allow_inf_nan=False, json_schema_extra={"minimum": 0},
                                 description="Remask: end-to-end latency objective in milliseconds")
    priority: int = Field(0, description="Remask: scheduling priority")
    threshold: float | None = Field(default=None, allow_inf_nan=False,
                                    json_schema_extra={"exclusiveMinimum": 0, "maximum": 1},
                                    description="Remask: a fixed confidence threshold for parallel unmasking")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> Any:
        return _check_str_or_str_list(value, "stop")


class CompletionRequest(_CommonRequest):
    """``POST /v1/completions``; ``prompt`` is one string (an array holding one string is accepted)."""

    model_config = ConfigDict(extra="ignore", json_schema_extra={"required": ["prompt"]})
    prompt: Annotated[Any, WithJsonSchema({"anyOf": [
        {"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 1}]})] = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        return _check_str_or_str_list(value, "prompt")


class ChatMessage(BaseModel):
    """One chat message; ``content`` is a string (an array of text parts is flattened into one)."""

    model_config = ConfigDict(extra="ignore")
    role: str = Field(json_schema_extra={"enum": list(CHAT_ROLES)})
    content: Annotated[str, WithJsonSchema({"anyOf": [{"type": "string"}, {"type": "array", "items": {
        "type": "object", "required": ["type", "text"],
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]})]

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any) -> Any:
        if isinstance(value, list):
            texts = [p.get("text") for p in value if isinstance(p, dict) and p.get("type") == "text"]
            if len(texts) != len(value) or not all(isinstance(t, str) for t in texts):
                raise ValueError("only text content parts are supported")
            return "".join(texts)
        return value


class ChatCompletionRequest(_CommonRequest):
    """``POST /v1/chat/completions``; ``max_completion_tokens`` is read when ``max_tokens`` is absent."""

    model_config = ConfigDict(extra="ignore", json_schema_extra={"required": ["messages"]})
    messages: list[ChatMessage] | None = Field(None, json_schema_extra={"minItems": 1})
    max_completion_tokens: int | None = Field(None, description="read when max_tokens is absent",
                                              json_schema_extra={"minimum": 1})


def _inline(node: Any, defs: dict) -> Any:
    if isinstance(node, dict):
        if "$ref" in node:
            return _inline(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
        return {k: _inline(v, defs) for k, v in node.items() if k != "$defs"}
    if isinstance(node, list):
        return [_inline(v, defs) for v in node]
    return node


def request_schema(kind: str, model: str | None = None, max_tokens_limit: int | None = None) -> dict:
    """The JSON schema of a completion (``kind="completion"``) or chat body, without ``$ref``s (it sits inline in
    the OpenAPI document); ``model`` and ``max_tokens_limit`` narrow it to one application's values."""
    cls = CompletionRequest if kind == "completion" else ChatCompletionRequest
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
    return schema


def openapi_body(kind: str, model: str | None = None, max_tokens_limit: int | None = None) -> dict:
    """The ``openapi_extra`` of a POST route whose handler reads the raw body: its documented request body."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": request_schema(kind, model, max_tokens_limit)}}}}


# ---------------------------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class GenRequest:
    """A validated generation request, independent of the endpoint it came from."""

    request_id: str
    kind: str  # "completion" | "chat"
    model: str
    prompt: str
    max_tokens: int
    stream: bool = False
    include_usage: bool = False
    slo_ms: float | None = None
    priority: int = 0
    threshold: float | None = None
    created: int = 0


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


def _validation_error(exc: ValidationError) -> APIError:
    err = exc.errors()[0]
    param = ".".join(str(p) for p in err.get("loc", ())) or None
    msg = err.get("msg", "invalid value")
    return invalid(f"Invalid value for '{param}': {msg}.", param=param, code="invalid_value")


def _validate(model_cls: type[BaseModel], data: dict) -> Any:
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc) from None


def _missing(param: str) -> APIError:
    return invalid(f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")


def _resolve_model(model: str | None, known_models: list[str]) -> str:
    if model is None and known_models:
        return known_models[0]
    if model not in known_models:
        raise APIError(404, f"The model `{model}` does not exist or you do not have access to it.",
                       param="model", code="model_not_found")
    return model


def _completion_prompt(req: CompletionRequest) -> str:
    prompt = req.prompt
    if prompt is None:
        raise _missing("prompt")
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise invalid(f"Only a single prompt is supported, got an array of {len(prompt)}.", param="prompt",
                          code="invalid_value")
        prompt = prompt[0]
    return prompt


def _chat_prompt(req: ChatCompletionRequest) -> str:
    if req.messages is None:
        raise _missing("messages")
    if not req.messages:
        raise invalid("Invalid 'messages': empty array. Expected an array with minimum length 1, but got an empty "
                      "array instead.", param="messages", code="empty_array")
    for i, msg in enumerate(req.messages):
        if msg.role not in CHAT_ROLES:
            raise invalid(f"Invalid value for 'messages[{i}].role': {msg.role!r}. Supported values are: "
                          f"{', '.join(repr(r) for r in CHAT_ROLES)}.", param="messages", code="invalid_value")
    return render_chat(req.messages)


def render_chat(messages: list[ChatMessage]) -> str:
    """The plain-text prompt for a chat: every message's content, in order, joined by newlines."""
    return "\n".join(m.content for m in messages)


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


def _check_common(req: _CommonRequest) -> None:
    if req.n not in (None, 1):
        raise invalid(f"Invalid value for 'n': {req.n}. Only n=1 is supported.", param="n", code="invalid_value")
    if req.threshold is not None and not 0.0 < req.threshold <= 1.0:
        raise invalid(f"Invalid value for 'threshold': {req.threshold}. Expected a value in (0, 1].",
                      param="threshold", code="invalid_value")
    if req.slo_ms is not None and req.slo_ms < 0:
        raise invalid(f"Invalid value for 'slo_ms': {req.slo_ms}. Expected a non-negative number of milliseconds.",
                      param="slo_ms", code="invalid_value")


def parse_request(kind: str, body: bytes | str, *, known_models: list[str], max_tokens_limit: int,
                  default_max_tokens: int) -> GenRequest:
    """Validate a raw completion (``kind="completion"``) or chat (``kind="chat"``) body; raise :class:`APIError`."""
    if kind not in ("completion", "chat"):
        raise ValueError(f"unknown request kind {kind!r}")
    data = _load_json(body)
    if kind == "completion":
        req = _validate(CompletionRequest, data)
        prompt, limit_param, max_tokens = _completion_prompt(req), "max_tokens", req.max_tokens
        prefix = "cmpl-"
    else:
        req = _validate(ChatCompletionRequest, data)
        prompt = _chat_prompt(req)
        limit_param = "max_tokens" if req.max_tokens is not None or req.max_completion_tokens is None \
            else "max_completion_tokens"
        max_tokens = req.max_tokens if req.max_tokens is not None else req.max_completion_tokens
        prefix = "chatcmpl-"
    model = _resolve_model(req.model, known_models)
    _check_common(req)
    return GenRequest(
        request_id=prefix + uuid.uuid4().hex, kind=kind, model=model, prompt=prompt,
        max_tokens=_max_tokens(max_tokens, limit_param, max_tokens_limit, default_max_tokens),
        stream=req.stream, include_usage=bool(req.stream and req.stream_options and req.stream_options.include_usage),
        slo_ms=req.slo_ms, priority=req.priority, threshold=req.threshold, created=int(time.time()))


# ---------------------------------------------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------------------------------------------


def usage_dict(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _envelope(req: GenRequest, obj: str, choices: list[dict]) -> dict:
    return {"id": req.request_id, "object": obj, "created": req.created, "model": req.model, "choices": choices}


def completion_response(req: GenRequest, text: str, finish_reason: str, prompt_tokens: int,
                        completion_tokens: int) -> dict:
    """A non-streamed ``text_completion`` object."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    out = _envelope(req, "text_completion", [choice])
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


def completion_chunk(req: GenRequest, text_delta: str, finish_reason: str | None = None) -> dict:
    """One streamed ``text_completion`` chunk (same object as the non-streamed response, without usage)."""
    choice = {"index": 0, "text": text_delta, "logprobs": None, "finish_reason": finish_reason}
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


def models_response(models: list[str], created: int | None = None) -> dict:
    """The ``GET /v1/models`` list."""
    ts = _STARTED if created is None else created
    return {"object": "list",
            "data": [{"id": m, "object": "model", "created": ts, "owned_by": "remask"} for m in models]}
