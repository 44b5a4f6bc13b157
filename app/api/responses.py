"""The response shapes of the OpenAI-compatible API: completion and chat objects, stream chunks, server-sent
events, and the small GET/POST answers (models, version, tokenize)."""

from __future__ import annotations

import importlib.metadata
import json
import time
from typing import Any

from app.api.parsing import GenRequest

_STARTED = int(time.time())


def usage_dict(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _envelope(req: GenRequest, obj: str, choices: list[dict]) -> dict:
    return {"id": req.request_id, "object": obj, "created": req.created, "model": req.model, "choices": choices}


def completion_response(req: GenRequest, choices: list[tuple[str, str]], prompt_tokens: int,
                        completion_tokens: int, logprobs: list[dict | None] | None = None) -> dict:
    """A non-streamed ``text_completion`` object: ``choices`` are ``(text, finish_reason)`` in prompt order, and
    the usage is the whole request's (all prompts); ``logprobs``: each choice's logprobs object."""
    if isinstance(choices, str):
        raise TypeError("choices is a list of (text, finish_reason) pairs")
    lps = logprobs or [None] * len(choices)
    out = _envelope(req, "text_completion", [{"index": i, "text": text, "logprobs": lp, "finish_reason": reason}
                                             for i, ((text, reason), lp) in enumerate(zip(choices, lps))])
    out["usage"] = usage_dict(prompt_tokens, completion_tokens)
    return out


def chat_response(req: GenRequest, text: str, finish_reason: str, prompt_tokens: int,
                  completion_tokens: int) -> dict:
    """A non-streamed ``chat.completion`` object of one choice."""
    return chat_choices_response(req, [(text, finish_reason)], prompt_tokens, completion_tokens)


def chat_choices_response(req: GenRequest, choices: list[tuple[str, str]], prompt_tokens: int,
                          completion_tokens: int, logprobs: list[dict | None] | None = None,
                          tool_calls: list[list[dict]] | None = None) -> dict:
    """A non-streamed ``chat.completion`` object: ``choices`` are ``(text, finish_reason)`` by index;
    ``logprobs``: each choice's logprobs object; ``tool_calls``: each choice's calls (``tool_call``), its
    message then has them, and its text (None when empty) as content."""
    lps = logprobs or [None] * len(choices)
    calls = tool_calls or [[]] * len(choices)
    out = _envelope(req, "chat.completion", [
        {"index": i, "message": _message(text, tc), "logprobs": lp, "finish_reason": reason}
        for i, ((text, reason), lp, tc) in enumerate(zip(choices, lps, calls))])
    out["usage"] = usage_dict(prompt_tokens, completion_tokens)
    return out


def _message(text: str | None, tool_calls: list[dict]) -> dict:
    if not tool_calls:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": text or None, "tool_calls": tool_calls}


def completion_logprobs(tokens: list[str], logprobs: list[float | None], offset: int = 0) -> dict:
    """A completion choice's ``logprobs`` object (OpenAI's legacy shape): each generated token's text and
    log-probability, its character offset in the text (from ``offset``); no alternatives (``top_logprobs``
    null)."""
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": list(tokens), "token_logprobs": list(logprobs), "top_logprobs": None, "text_offset": offsets}


def chat_logprobs(tokens: list[str], logprobs: list[float | None]) -> dict:
    """A chat choice's ``logprobs`` object: per generated token its text, log-probability and UTF-8 bytes."""
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8", "surrogatepass")),
                         "top_logprobs": []} for t, lp in zip(tokens, logprobs)]}


def _with_null_usage(req: GenRequest, chunk: dict) -> dict:
    # With stream_options.include_usage, OpenAI sends "usage": null on every chunk but the last.
    if req.include_usage:
        chunk["usage"] = None
    return chunk


def completion_chunk(req: GenRequest, text_delta: str, finish_reason: str | None = None, index: int = 0,
                     logprobs: dict | None = None) -> dict:
    """One streamed ``text_completion`` chunk of choice ``index`` (the prompt's position; same object as the
    non-streamed response, without usage)."""
    choice = {"index": index, "text": text_delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return _with_null_usage(req, _envelope(req, "text_completion", [choice]))


def chat_chunk(req: GenRequest, delta_text: str | None = None, finish_reason: str | None = None,
               role: bool = False, index: int = 0, logprobs: dict | None = None,
               tool_calls: list[dict] | None = None) -> dict:
    """One ``chat.completion.chunk``; the first carries ``delta.role == "assistant"`` (``role=True``);
    ``tool_calls``: tool-call deltas (each with its ``index``; the first of a call has its ``id``, ``type``
    and ``function.name``, later ones pieces of ``function.arguments``)."""
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = "assistant"
    if delta_text is not None or (role and tool_calls is None):
        delta["content"] = delta_text if delta_text is not None else ""
    if tool_calls is not None:
        delta["tool_calls"] = tool_calls
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
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


def model_response(model_id: str, created: int | None = None, max_model_len: int | None = None) -> dict:
    """One model object (``GET /v1/models/{model}``, and each entry of ``GET /v1/models``); with
    ``max_model_len`` (vLLM's field: the longest prompt + answer in tokens) when known."""
    out = {"id": model_id, "object": "model", "created": _STARTED if created is None else created,
           "owned_by": "remask"}
    if max_model_len is not None:
        out["max_model_len"] = max_model_len
    return out


def models_response(models: list[str], created: int | None = None, max_model_len: int | None = None) -> dict:
    """The ``GET /v1/models`` list."""
    return {"object": "list", "data": [model_response(m, created, max_model_len) for m in models]}


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
