"""``remask chat``: a streaming chat client for people.

Each line read from stdin is a user turn; the reply is printed as it streams. With ``--show-steps``
every streamed chunk is printed on its own line with its arrival time (ms since the request was
sent) and the text so far. The server streams committed text block by block, not the denoising
canvas with its masks, so this shows when each block committed, not the canvas itself.
"""

from __future__ import annotations

import json
import sys
import time
from typing import TextIO

import httpx

from loadgen.client import chunk_text


def stream_reply(client: httpx.Client, body: dict, out: TextIO, show_steps: bool) -> str:
    """POST ``body`` to /v1/chat/completions and print the reply as it streams; the reply text."""
    text, start, n = "", time.perf_counter(), 0
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code >= 400:
            resp.read()
            try:
                msg = resp.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                msg = resp.text[:200]
            raise RuntimeError(f"HTTP {resp.status_code}: {msg}")
        for line in resp.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error'].get('message')}")
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
         system: str | None = None, extra: dict | None = None, inp: TextIO = sys.stdin,
         out: TextIO = sys.stdout, interactive: bool | None = None) -> int:
    interactive = inp.isatty() if interactive is None else interactive
    messages: list[dict] = [{"role": "system", "content": system}] if system else []
    with httpx.Client(base_url=url.rstrip("/"), timeout=600.0) as client:
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
            body = {"messages": turn, "stream": True, **(extra or {})}
            if model:
                body["model"] = model
            try:
                reply = stream_reply(client, body, out, show_steps)
            except (RuntimeError, httpx.HTTPError) as exc:
                print(f"remask chat: {exc}", file=sys.stderr)
                continue
            if history:
                messages = [*turn, {"role": "assistant", "content": reply}]
