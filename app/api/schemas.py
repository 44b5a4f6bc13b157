"""The request models of the OpenAI-compatible API (pydantic) and their JSON schemas (the OpenAPI request
bodies): every field a body may hold, the known fields Remask accepts only at a neutral value, and the limits."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, create_model

CHAT_ROLES = ("system", "user", "assistant", "tool")  # the roles of a parsed chat
INPUT_ROLES = ("system", "developer", "user", "assistant", "tool")  # the roles a request may send ("developer":
# system)
MAX_PROMPTS = 64  # prompts in one /v1/completions request
MAX_STOP = 4  # stop strings (OpenAI's limit)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
TOKEN_ID_MAX = 2**31 - 1  # the largest token id accepted when the vocabulary size is not known


# The models below check the types of simple fields (strictly: "8" is not an integer, 1.0 is not one either,
# true is not a number) and document every body (:func:`request_schema`, the OpenAPI request bodies). Fields
# with several forms (prompt, messages, stop, token ids) are typed ``Any`` with the schema of what they accept:
# the parser checks them itself, to word its own errors. Known fields that Remask does not implement are fields
# too, documented with the only values accepted (their defaults).

# Known OpenAI/vLLM fields that Remask does not implement: the values accepted (each a no-op, the default);
# any other value is refused with 400 ``unsupported_parameter``. Numbers compare by value (0 == 0.0), other
# values by type and value (false is not 0).
# vLLM's and SGLang's sampling extras at their neutral values (what their benchmark clients and SDK users send):
VLLM_NOOPS: dict[str, tuple] = {
    "repetition_penalty": (None, 1), "min_p": (None, 0), "min_tokens": (None, 0), "use_beam_search": (None, False),
    "length_penalty": (None, 1), "skip_special_tokens": (None, True), "spaces_between_special_tokens": (None, True),
    "include_stop_str_in_output": (None, False), "truncate_prompt_tokens": (None,), "prompt_logprobs": (None,),
    "allowed_token_ids": (None,), "bad_words": (None, []), "logits_processors": (None,),
    "return_tokens_as_token_ids": (None, False), "detokenize": (None, True), "no_stop_trim": (None, False),
    "lora_path": (None,), "return_hidden_states": (None, False),
}
COMPLETION_NOOPS: dict[str, tuple] = {
    "best_of": (None, 1), "frequency_penalty": (None, 0), "presence_penalty": (None, 0),
    "logit_bias": (None, {}), "suffix": (None, ""), "add_special_tokens": (None, True),
    **VLLM_NOOPS,
}
CHAT_NOOPS: dict[str, tuple] = {
    "frequency_penalty": (None, 0), "presence_penalty": (None, 0), "logit_bias": (None, {}), "best_of": (None, 1),
    "top_logprobs": (None, 0), "add_special_tokens": (None, False),
    "chat_template_kwargs": (None, {}), **VLLM_NOOPS, "functions": (None,),
    "function_call": (None,), "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,),
    "reasoning_effort": (None,), "service_tier": (None, "auto", "default"), "store": (None, False),
    "metadata": (None,), "web_search_options": (None,), "verbosity": (None,), "prompt_cache_key": (None,),
    "continue_final_message": (None, False),
}
# Fields of one chat message besides role, content and name (what the client's own response messages carry
# when a conversation is sent back: ``message.model_dump()`` has them as null).
MESSAGE_NOOPS: dict[str, tuple] = {
    "function_call": (None,), "refusal": (None,), "audio": (None,), "annotations": (None, []),
}
# Structured outputs (app/api/structured.py): the fields that constrain a request's text, on both endpoints
# (vLLM's guided_* and structured_outputs, SGLang's regex, json_schema and ebnf); chat adds response_format.
# At most one of them per request.
STRUCTURED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
                     "regex", "json_schema", "ebnf")
STRUCTURED_OUTPUTS_KEYS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace",
                           "disable_fallback", "disable_additional_properties", "whitespace_pattern")
TOKENIZE_NOOPS: dict[str, tuple] = {"return_token_strs": (None, False)}
# stream_options keys Remask implements; any other is refused as unknown. ``include_canvas`` is Remask's
# extension: a ``remask_canvas`` chunk per denoising step (``canvas_chunk``).
STREAM_OPTIONS = ("include_usage", "include_canvas", "continuous_usage_stats")


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


_TOOL_CALL_SCHEMA = {
    "type": "object", "required": ["id", "type", "function"], "additionalProperties": False,
    "properties": {"id": {"type": "string"}, "type": {"const": "function"}, "index": {"type": "integer"},
                   "function": {"type": "object", "required": ["name", "arguments"], "additionalProperties": False,
                                "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}}}}}
_MESSAGE_SCHEMA = {
    "type": "object", "required": ["role"], "additionalProperties": False,
    "properties": {
        "role": {"enum": list(CHAT_ROLES), "description": "'developer' is accepted too, as 'system'"},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART, "minItems": 1},
                              {"type": "null"}],
                    "description": "a string or an array of text parts (joined with newlines); null or absent "
                                   "only in an assistant message with tool_calls"},
        "name": {"anyOf": [{"type": "string"}, {"type": "null"}], "description": "passed to the chat template"},
        "tool_calls": {"anyOf": [{"type": "array", "items": _TOOL_CALL_SCHEMA}, {"type": "null"}],
                       "description": "an assistant message's tool calls (passed to the chat template)"},
        "tool_call_id": {"anyOf": [{"type": "string"}, {"type": "null"}],
                         "description": "a tool message: the call it answers"},
        **{k: _noop_schema(v) for k, v in MESSAGE_NOOPS.items()}},
    "allOf": [{"if": {"properties": {"role": {"const": "tool"}}},
               "then": {"required": ["tool_call_id"], "properties": {"tool_call_id": {"type": "string"}}}},
              {"anyOf": [{"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
                         {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array",
                                                                                    "minItems": 1}}}]}]}
# an anyOf of one: the shape older clients of this schema read (messages -> anyOf[0] -> items)
_MESSAGES_SCHEMA = {"anyOf": [{"type": "array", "items": _MESSAGE_SCHEMA, "minItems": 1}]}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool | None = Field(False, description="a last chunk with the usage of the whole request")
    include_canvas: bool | None = Field(False, description="Remask: a chunk per denoising step with the canvas "
                                                           "of the request's current block (`remask_canvas`)")
    continuous_usage_stats: bool | None = Field(False, description="vLLM's: only false is accepted (the usage comes "
                                                                    "in the last chunk)",
                                                json_schema_extra={"enum": [False, None]})


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
    n: int | None = Field(1, description="choices to generate, each an independent request (seeds seed, seed + 1, "
                                         "...); at most `http.max_n`", json_schema_extra={"minimum": 1})
    ignore_eos: bool | None = Field(False, description="vLLM's extension: decode to max_tokens, past the model's "
                                                       "end of text (stop_token_ids still stop)")
    user: str | None = Field(None, description="an end-user id (metadata)")
    # Remask extensions
    slo_ms: float | None = Field(default=None, allow_inf_nan=False, json_schema_extra={"minimum": 0},
                                 description="Remask: end-to-end latency objective in milliseconds")
    priority: int = Field(0, description="Remask: scheduling priority")
    threshold: float | None = Field(default=None, allow_inf_nan=False,
                                    json_schema_extra={"exclusiveMinimum": 0, "maximum": 1},
                                    description="Remask: a fixed confidence threshold for parallel unmasking")
    decoding: str | None = Field(None, description="Remask: the decoding rule by name (threshold, low_confidence, "
                                                   "joint_threshold, entropy_bound, hierarchical, credit, ...); "
                                                   "absent: the server's", json_schema_extra={"minLength": 1})
    decoding_config: dict[str, Any] | None = Field(None, description="Remask: the decoding rule's configuration "
                                                                     "(its fields, e.g. edit_threshold); without "
                                                                     "`decoding` it configures the server's rule")


_JSON_SCHEMA_VALUE = {"anyOf": [{"type": "object"}, {"type": "boolean"}, {"type": "string"}],
                      "description": "a JSON schema (an object, or its JSON text)"}
_STRUCTURED_SCHEMAS = {
    "guided_json": {**_JSON_SCHEMA_VALUE, "description": "vLLM's: the text is a JSON document this schema "
                                                         "accepts (an object, or its JSON text)"},
    "guided_regex": {"type": "string", "description": "vLLM's: the text matches this regular expression"},
    "guided_choice": {"type": "array", "items": {"type": "string"}, "minItems": 1,
                      "description": "vLLM's: the text is one of these strings"},
    "guided_grammar": {"type": "string", "minLength": 1,
                       "description": "vLLM's: the text is a sentence of this EBNF (GBNF) grammar, from rule root"},
    "structured_outputs": {
        "type": "object", "additionalProperties": False,
        "description": "vLLM's: exactly one of json, regex, choice, grammar, json_object",
        "properties": {"json": _JSON_SCHEMA_VALUE, "regex": {"type": "string"},
                       "choice": {"type": "array", "items": {"type": "string"}, "minItems": 1},
                       "grammar": {"type": "string", "minLength": 1}, "json_object": {"type": "boolean"},
                       "disable_any_whitespace": {"type": "boolean"}, "disable_fallback": {"type": "boolean"},
                       "disable_additional_properties": {"type": "boolean"},
                       "whitespace_pattern": {"type": "null"}}},
    "regex": {"type": "string", "description": "SGLang's: as guided_regex"},
    "json_schema": {"type": "string", "description": "SGLang's: a JSON schema's text, as guided_json"},
    "ebnf": {"type": "string", "minLength": 1, "description": "SGLang's: as guided_grammar"},
}
_RESPONSE_FORMAT_SCHEMA = {"anyOf": [
    {"type": "object", "required": ["type"], "additionalProperties": False,
     "properties": {"type": {"enum": ["text", "json_object"]}}},
    {"type": "object", "required": ["type", "json_schema"], "additionalProperties": False,
     "properties": {"type": {"const": "json_schema"}, "json_schema": {
         "type": "object", "required": ["name"], "additionalProperties": False,
         "properties": {"name": {"type": "string"}, "description": {"type": "string"},
                        "schema": {"type": "object"}, "strict": {"anyOf": [{"type": "boolean"}, {"type": "null"}]}}}}},
    {"type": "null"}],
    "description": "text (the default), json_object (any JSON object) or json_schema (a document its schema "
                   "accepts); enforced while decoding"}
_FUNCTION_SCHEMA = {"type": "object", "required": ["name"], "additionalProperties": False,
                    "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 64,
                                            "pattern": "^[a-zA-Z0-9_-]+$"},
                                   "description": {"type": "string"}, "parameters": {"type": "object"},
                                   "strict": {"anyOf": [{"type": "boolean"}, {"type": "null"}]}}}
_TOOLS_SCHEMA = {"anyOf": [{"type": "array", "items": {
    "type": "object", "required": ["type", "function"], "additionalProperties": False,
    "properties": {"type": {"const": "function"}, "function": _FUNCTION_SCHEMA}}}, {"type": "null"}],
    "description": "functions the model may call (shown to it through the chat template's tools variable)"}
_TOOL_CHOICE_SCHEMA = {"anyOf": [
    {"enum": ["none", "auto", "required"]},
    {"type": "object", "required": ["type", "function"], "additionalProperties": False,
     "properties": {"type": {"const": "function"}, "function": {
         "type": "object", "required": ["name"], "additionalProperties": False,
         "properties": {"name": {"type": "string"}}}}},
    {"type": "null"}],
    "description": "none, auto (the default with tools), required (at least one call, enforced) or a named "
                   "function (its arguments enforced)"}


def _structured_fields() -> dict[str, Any]:
    return {k: (Annotated[Any, WithJsonSchema(v)], None) for k, v in _STRUCTURED_SCHEMAS.items()}


class _CompletionFields(_CommonRequest):
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"required": ["prompt"]})
    prompt: Annotated[Any, WithJsonSchema(_PROMPT_SCHEMA)] = None
    echo: bool | None = Field(False, description="the prompt before each choice's text")
    logprobs: int | None = Field(None, description="0: each generated token's log-probability (in the round that "
                                                   "committed it); alternatives (above 0) are not available",
                                 json_schema_extra={"minimum": 0, "maximum": 0})


class _ChatFields(_CommonRequest):
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"required": ["messages"]})
    messages: Annotated[Any, WithJsonSchema(_MESSAGES_SCHEMA)] = None
    max_completion_tokens: int | None = Field(None, description="read when max_tokens is absent",
                                              json_schema_extra={"minimum": 1})
    add_generation_prompt: bool | None = Field(True, description="vLLM's extension: end the rendered chat with the "
                                                                 "assistant's turn")
    safety_identifier: str | None = Field(None, description="an end-user id (metadata)")
    logprobs: bool | None = Field(False, description="each generated token's log-probability (in the round that "
                                                     "committed it); top_logprobs (alternatives) only 0")
    chat_template: str | None = Field(None, description="vLLM's extension: a Jinja chat template for this request "
                                                        "instead of the server's", json_schema_extra={"minLength": 1})


_CHAT_STRUCTURED: dict[str, Any] = {
    "response_format": (Annotated[Any, WithJsonSchema(_RESPONSE_FORMAT_SCHEMA)], None),
    "tools": (Annotated[Any, WithJsonSchema(_TOOLS_SCHEMA)], None),
    "tool_choice": (Annotated[Any, WithJsonSchema(_TOOL_CHOICE_SCHEMA)], None),
    "parallel_tool_calls": (Annotated[Any, WithJsonSchema(
        {"anyOf": [{"type": "boolean"}, {"type": "null"}],
         "description": "false: at most one tool call (required and auto)"})], None),
}


def _with_noops(name: str, base: type[BaseModel], noops: dict[str, tuple], doc: str,
                extra: dict[str, Any] | None = None) -> type[BaseModel]:
    fields: dict[str, Any] = {k: (Annotated[Any, WithJsonSchema(_noop_schema(v))], None) for k, v in noops.items()}
    return create_model(name, __base__=base, __doc__=doc, **_structured_fields(), **(extra or {}), **fields)


CompletionRequest = _with_noops("CompletionRequest", _CompletionFields, COMPLETION_NOOPS,
                                "``POST /v1/completions``.")
ChatCompletionRequest = _with_noops("ChatCompletionRequest", _ChatFields, CHAT_NOOPS,
                                    "``POST /v1/chat/completions``; ``max_completion_tokens`` is read when "
                                    "``max_tokens`` is absent.", _CHAT_STRUCTURED)


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
                  vocab_size: int | None, max_n: int | None = None) -> dict:
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
    if max_n is not None and "n" in props:
        props["n"]["maximum"] = max_n
    return schema


def request_schema(kind: str, model: str | None = None, max_tokens_limit: int | None = None,
                   vocab_size: int | None = None, max_n: int | None = None) -> dict:
    """The JSON schema of a ``kind`` body (``"completion"``, ``"chat"``, ``"tokenize"``, ``"detokenize"``), without
    ``$ref``s (it sits inline in the OpenAPI document); ``model``, ``max_tokens_limit``, ``vocab_size`` and
    ``max_n`` narrow it to one application's values."""
    if kind not in _SCHEMA_MODELS:
        raise ValueError(f"unknown request kind {kind!r}")
    schemas = [_model_schema(cls, model, max_tokens_limit, vocab_size, max_n) for cls in _SCHEMA_MODELS[kind]]
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def openapi_body(kind: str, model: str | None = None, max_tokens_limit: int | None = None,
                 vocab_size: int | None = None, max_n: int | None = None) -> dict:
    """The ``openapi_extra`` of a POST route whose handler reads the raw body: its documented request body."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": request_schema(kind, model, max_tokens_limit, vocab_size, max_n)}}}}

