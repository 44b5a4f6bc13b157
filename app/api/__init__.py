"""The OpenAI-compatible API of the Remask ingress, pure Python (pydantic only), one module per concern:

- :mod:`app.api.errors`: :class:`APIError` (its :meth:`APIError.to_dict` is the OpenAI error body) and its kinds;
- :mod:`app.api.schemas`: the request models, the fields accepted only at a neutral value, the JSON schemas;
- :mod:`app.api.parsing`: a raw body to a :class:`GenRequest` (:func:`parse_request`, :func:`parse_tokenize`,
  :func:`parse_detokenize`);
- :mod:`app.api.structured`: structured outputs (``response_format``, vLLM's ``guided_*`` and
  ``structured_outputs``) as one constraint, and tools (``tools``, ``tool_choice``, tool calls out of text);
- :mod:`app.api.responses`: responses, stream chunks and server-sent events.

The shapes follow the OpenAI API reference (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``) so
the official ``openai`` client parses them, with vLLM's extensions where Remask has them (``top_k``,
``stop_token_ids``, ``add_generation_prompt``, ``/tokenize``, ``/detokenize``, ``/version``).

Nothing in a body is silently ignored: a field is implemented, or accepted only at a neutral value (a no-op)
and refused otherwise (400 ``unsupported_parameter``), or unknown and refused (400 ``unknown_parameter``).
"""

from app.api.errors import (
                            APIError,
                            ErrorType,
                            body_too_large,
                            check_content_length,
                            invalid,
                            not_found_error,
                            permission_error,
                            rate_limit_error,
                            request_timeout,
                            server_error,
                            unknown,
                            unsupported,
)
from app.api.parsing import GenRequest, TokenizeRequest, parse_detokenize, parse_request, parse_tokenize
from app.api.responses import (
                            SSE_DONE,
                            canvas_chunk,
                            chat_choices_response,
                            chat_chunk,
                            chat_logprobs,
                            chat_response,
                            completion_chunk,
                            completion_logprobs,
                            completion_response,
                            detokenize_response,
                            model_response,
                            models_response,
                            sse,
                            tokenize_response,
                            usage_chunk,
                            usage_dict,
                            version_response,
)
from app.api.schemas import (
                            CHAT_NOOPS,
                            CHAT_ROLES,
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
                            VLLM_NOOPS,
                            ChatCompletionRequest,
                            CompletionRequest,
                            DetokenizeRequest,
                            StreamOptions,
                            TokenizeChatRequest,
                            TokenizePromptRequest,
                            openapi_body,
                            request_schema,
)

__all__ = [
    "APIError", "ErrorType", "body_too_large", "check_content_length", "invalid", "not_found_error",
    "permission_error", "rate_limit_error", "request_timeout", "server_error", "unknown", "unsupported",
    "GenRequest", "TokenizeRequest", "parse_detokenize", "parse_request", "parse_tokenize",
    "SSE_DONE", "canvas_chunk", "chat_choices_response", "chat_logprobs",
    "completion_logprobs", "chat_chunk", "chat_response", "completion_chunk",
    "completion_response",
    "detokenize_response", "model_response", "models_response", "sse", "tokenize_response", "usage_chunk",
    "usage_dict", "version_response",
    "CHAT_NOOPS", "CHAT_ROLES", "COMPLETION_NOOPS", "INPUT_ROLES", "INT64_MAX", "INT64_MIN", "MAX_PROMPTS",
    "MAX_STOP", "MESSAGE_NOOPS", "STREAM_OPTIONS", "TOKEN_ID_MAX", "TOKENIZE_NOOPS", "VLLM_NOOPS",
    "ChatCompletionRequest",
    "CompletionRequest", "DetokenizeRequest", "StreamOptions", "TokenizeChatRequest", "TokenizePromptRequest",
    "openapi_body", "request_schema",
]
