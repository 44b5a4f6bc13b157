"""``remask chat``: a streaming chat client for people.

Each line read from stdin is a user turn; the reply is printed as it streams. With ``--show-steps`` the
client asks for Remask's stream extension ``stream_options: {"include_canvas": true}``: the server then
sends, besides the text chunks, a chunk per denoising round with ``"choices": []`` and a top-level
``remask_canvas`` (round, instance, tp, threshold, block [start, end), the positions committed this round
with token id and text piece, the block's positions still masked, the canvas length; positions count
from the answer's first token). Each is printed as one line by :func:`render_canvas`, like
``remask generate --show-steps`` offline; each text chunk is printed with its arrival time (ms since the
request was sent) and the text so far. A server without the extension refuses the option; the client
then says so and streams without it.

``--api-key`` (default ``$OPENAI_API_KEY``) is sent as ``Authorization: Bearer <key>``; a 401 ends the
session with a message saying what to do (never the key).
"""

from __future__ import annotations

import json
import sys
import time
from typing import TextIO

import httpx

from loadgen.client import Unauthorized, auth_headers, chunk_text, unauthorized_hint

MASK, EMPTY = "_", "·"  # a masked position; a committed token with no text (end of sequence, special)


def _visible(piece: str) -> str:
    return (piece or EMPTY).replace("\r", "").replace("\n", "↵").replace("\t", "→")


def render_canvas(state: dict, chunk: dict) -> str:
    """One line for a ``remask_canvas`` chunk (the parsed SSE event, or its ``remask_canvas`` object);
    '' for any other chunk.

    ``state`` (a dict, empty at the start of a request) accumulates the committed pieces by choice and
    position. The line: the round, the threshold, how many positions this round committed, and the
    canvas: the committed pieces, ``_`` for masked positions (the block's, and all beyond it), the
    current block between ``[`` and ``]``, e.g. ``round   7 thr 0.90 +2 |Hello[ w_rl_]_____|``.
    """
    view = chunk.get("remask_canvas", chunk if "round" in chunk and "block" in chunk else None)
    if not isinstance(view, dict):
        return ""
    pieces = state.setdefault(view.get("index", 0), {})
    committed = view.get("committed") or []
    for pos, _token, piece in committed:
        pieces[int(pos)] = piece
    masked = {int(p) for p in view.get("masked") or ()}
    lo, hi = (view.get("block") or (None, None))[:2]
    length = max(int(view.get("length") or 0), int(hi or 0), max(pieces, default=-1) + 1)
    cells = []
    for pos in range(length):
        if pos == lo:
            cells.append("[")
        cells.append(_visible(pieces[pos]) if pos in pieces and pos not in masked else MASK)
        if hi is not None and pos == hi - 1:
            cells.append("]")
    thr = view.get("threshold")
    where = f" i{view['instance']}" if view.get("instance") is not None else ""
    where += f" tp{view['tp']}" if view.get("tp") is not None else ""
    return (f"round {view.get('round', 0):3d} thr {'  - ' if thr is None else f'{thr:.2f}'} "
            f"+{len(committed):<2d}{where} |{''.join(cells)}|")


class CanvasRefused(RuntimeError):
    """The server does not implement ``stream_options.include_canvas``."""


def stream_reply(client: httpx.Client, body: dict, out: TextIO, show_steps: bool,
                 api_key: str | None = None) -> str:
    """POST ``body`` to /v1/chat/completions and print the reply as it streams; the reply text."""
    text, start, n, canvas = "", time.perf_counter(), 0, {}
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code >= 400:
            resp.read()
            try:
                msg = resp.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                msg = resp.text[:200]
            if resp.status_code == 401:
                raise Unauthorized(f"HTTP 401: {msg} ({unauthorized_hint(api_key)})")
            if resp.status_code == 400 and "include_canvas" in msg:
                raise CanvasRefused(msg)
            raise RuntimeError(f"HTTP {resp.status_code}: {msg}")
        for line in resp.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error'].get('message')}")
            if show_steps and (row := render_canvas(canvas, event)):
                out.write(f"[{(time.perf_counter() - start) * 1000:8.1f} ms] {row}\n")
                out.flush()
            piece = chunk_text(event)
            if not piece:
                continue
            text += piece
            n += 1
            if show_steps:
                out.write(f"[{(time.perf_counter() - start) * 1000:8.1f} ms] chunk {n:3d} +{len(piece):<3d} |{text}|\n")
            else:
                out.write(piece)
            out.flush()
    if show_steps:
        out.write(f"[{(time.perf_counter() - start) * 1000:8.1f} ms] done, {n} chunks\n")
    out.write("\n" if not show_steps else "")
    return text


def chat(url: str, model: str | None = None, show_steps: bool = False, history: bool = True,
         system: str | None = None, extra: dict | None = None, inp: TextIO | None = None,
         out: TextIO | None = None, interactive: bool | None = None, api_key: str | None = None) -> int:
    """The chat loop (stdin and stdout unless ``inp``/``out``); 0 at the end of input, 1 when the server
    refuses the API key (or wants one)."""
    inp, out = inp or sys.stdin, out or sys.stdout
    interactive = inp.isatty() if interactive is None else interactive
    messages: list[dict] = [{"role": "system", "content": system}] if system else []
    canvas = show_steps
    with httpx.Client(base_url=url.rstrip("/"), timeout=600.0, headers=auth_headers(api_key)) as client:
        while True:
            if interactive:
                out.write("you> ")
                out.flush()
            line = inp.readline()
            if not line:
                return 0
            line = line.rstrip("\n")
            if not line.strip():
                continue
            turn = [*messages, {"role": "user", "content": line}]
            while True:
                body = {"messages": turn, "stream": True, **(extra or {})}
                if canvas:
                    body["stream_options"] = {"include_canvas": True}
                if model:
                    body["model"] = model
                try:
                    reply = stream_reply(client, body, out, show_steps, api_key)
                except CanvasRefused as exc:
                    print(f"remask chat: the server has no canvas stream ({exc}); showing text chunks only",
                          file=sys.stderr)
                    canvas = False
                    continue
                except Unauthorized as exc:
                    print(f"remask chat: {exc}", file=sys.stderr)
                    return 1
                except (RuntimeError, httpx.HTTPError) as exc:
                    print(f"remask chat: {exc}", file=sys.stderr)
                    reply = None
                break
            if history and reply is not None:
                messages = [*turn, {"role": "assistant", "content": reply}]
