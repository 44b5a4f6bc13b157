"""The completion service: ``/v1/completions`` and ``/v1/chat/completions`` from the raw HTTP request to the
response, behind whatever routes them (the Ingress deployment, or a test's app).

For one request it holds one of the key's concurrent slots, parses and checks the body (``app.api``), refuses a
prompt certainly too long before tokenizing, tokenizes off the event loop, fills the sampling defaults, submits
each choice to the dispatcher (``n`` choices per prompt, seeds ``seed``, ``seed + 1``, ...), and answers with
one JSON object or a stream of server-sent events, counting every outcome in the request metrics. The response
``id`` is the request id (``X-Request-ID``: Serve's proxy sets and returns it; without the proxy the service
makes one and returns it in that header).
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time

from fastapi.responses import JSONResponse, StreamingResponse

from app import api
from app.api.schemas import INT64_MIN
from app.api.structured import ToolCallStream, parse_tool_calls, tool_call
from app.auth import ApiKey
from app.config import AppConfig
from app.gate import Gate, client_address
from app.metrics import failure_reason
from app.middleware import REQUEST_ID_HEADER, error_response, request_id

log = logging.getLogger(__name__)


def chars_per_token(tokenizer) -> int | None:
    """The most characters of text one token can stand for (the longest vocabulary entry; a byte-level
    vocabulary spells one byte per character, at least one byte per character of text), so that a text
    of ``c`` characters is at least ``ceil(c / chars_per_token)`` tokens. ``None`` when the tokenizer shows
    no vocabulary."""
    vocab = getattr(tokenizer, "vocab", None)
    if not isinstance(vocab, dict) and hasattr(getattr(tokenizer, "tok", None), "get_vocab"):
        vocab = tokenizer.tok.get_vocab()
    return max((len(t) for t in vocab), default=None) if isinstance(vocab, dict) else None


class Stream(StreamingResponse):
    """A streamed response that calls ``on_close`` once sent, whether the stream ended, failed, was never
    started or its client went away (a generator's ``finally`` does not run if it never started)."""

    def __init__(self, content, on_close, **kw) -> None:
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def choice_seed(seed: int | None, j: int) -> int | None:
    """Choice ``j``'s seed: ``seed + j``, wrapped into the 64-bit range."""
    return None if seed is None else (seed + j - INT64_MIN) % (1 << 64) + INT64_MIN


def usage_tokens(req: api.GenRequest, dones) -> tuple[int, int]:
    """The usage of ``(index, done)`` pairs: each prompt's tokens once (its ``n`` choices read the same prompt,
    as OpenAI counts them), every choice's completion tokens."""
    prompt = completion = 0
    for index, done in dones:
        prompt += done["prompt_tokens"] if index % req.n == 0 else 0
        completion += done["completion_tokens"]
    return prompt, completion


class CompletionService:
    """Serves generation requests for one application: its config, the model's config and tokenizer, the
    dispatcher that runs requests on the instances, the gate (keys, limits, body), the request metrics, the
    recent SLO outcomes (the playground) and, when on, the planner service (fed each finished request)."""

    def __init__(self, cfg: AppConfig, model_cfg, tokenizer, dispatcher, gate: Gate, metrics, outcomes,
                 planner=None) -> None:
        self.cfg, self.model_cfg, self.tokenizer = cfg, model_cfg, tokenizer
        self.dispatcher, self.gate, self.keys = dispatcher, gate, gate.keys
        self.metrics, self.outcomes, self.planner = metrics, outcomes, planner
        self.chars_per_token = chars_per_token(tokenizer)  # the cheap length check before tokenizing
        self.max_model_len = min(cfg.http.max_model_len or model_cfg.max_position_embeddings,
                                 model_cfg.max_position_embeddings)
        self._vocab = None  # the grammar engine's view of the vocabulary (built on the first constraint)
        self._decoding_base = None  # the server's decoding rule (``decoding_base``), made on first use

    @property
    def decoding_base(self):
        """The replicas' decoding rule (engine.decoding over the checkpoint's: ``engine.loading.engine_rule``),
        which a request's ``decoding_config`` without ``decoding`` configures: checked here as there."""
        if self._decoding_base is None:
            from engine.loading import engine_rule, resolve_model

            e = self.cfg.engine
            self._decoding_base = engine_rule(resolve_model(e.model, e.revision), e.decoding, e.decoding_config)
        return self._decoding_base

    # ---- one request ---------------------------------------------------------------------
    async def serve(self, kind: str, request):
        """Authenticate, hold one of the key's concurrent slots until the response is sent, and serve."""
        key = self.gate.authorize(request)
        self.gate.admit(request, key)
        try:
            lease = self.keys.acquire(key)
        except api.APIError:
            self.metrics.rejected("key_concurrency")
            raise
        rid, new = request_id(request.scope)
        try:
            response = await self.generate(kind, request, key, rid)
        except BaseException:
            lease.release()
            raise
        if isinstance(response, dict):
            response = JSONResponse(response)
        if isinstance(response, Stream):
            cancel = response.on_close
            response.on_close = lambda: (lease.release(), cancel())
        else:
            lease.release()
        if new:  # outside Serve's proxy: the response names the id it answers with
            response.headers[REQUEST_ID_HEADER] = rid
        return response

    def parse(self, kind: str, body: bytes, key: ApiKey, rid: str | None = None) -> api.GenRequest:
        """The request, checked against everything the body and the key decide before tokenizing: the
        fields, ``priority`` (403 above the key's), and the prompts' lengths (:meth:`check_lengths`)."""
        http = self.cfg.http
        req = api.parse_request(kind, body, known_models=[self.cfg.name],
                                max_tokens_limit=key.max_tokens_limit(http.max_tokens_limit),
                                default_max_tokens=http.default_max_tokens
                                or int(self.model_cfg.extra.get("gen_length", 128)),
                                vocab_size=self.model_cfg.vocab_size, max_n=http.max_n, request_id=rid,
                                decoding_base=self.decoding_base)
        key.check_priority(req.priority)
        if req.chat_template is not None and not http.trust_request_chat_template:
            raise api.invalid("This server does not accept a request's own 'chat_template' (its operator may allow "
                              "it: http.trust_request_chat_template).", param="chat_template",
                              code="unsupported_parameter")
        self.check_lengths(req, key)
        return req

    def charge(self, req: api.GenRequest, prompts: list[list[int]], key: ApiKey, request) -> None:
        """The request's prompt tokens + max_tokens (each choice's) against the caller's tokens per minute."""
        self.keys.charge(key, (sum(map(len, prompts)) + req.max_tokens * len(prompts)) * req.n,
                         client_address(request))

    def prompt_ids(self, req: api.GenRequest) -> list[list[int]]:
        """Each prompt as token ids: a chat through the checkpoint's template (or the request's or the server's
        ``chat_template``), a completion as raw text (the embedded models keep their own format). Runs off the
        event loop."""
        b = self.model_cfg.block_size
        if req.kind == "chat":
            template = req.chat_template or self.cfg.http.chat_template
            kw = {"chat_template": template} if template else {}
            if req.tools.tools:  # the template's ``tools`` variable, where it has one
                kw["tools"] = req.tools.tools
            try:
                return [self.tokenizer.chat_ids(req.messages, b, add_generation_prompt=req.add_generation_prompt,
                                                **kw)]
            except Exception as exc:  # a template that does not render these messages
                if not template:
                    raise
                raise api.invalid(f"The chat template failed to render the messages: {exc}",
                                  param="chat_template", code="invalid_chat_template") from None
        return [self.tokenizer.completion_ids(p, b) for p in req.prompts]

    def vocab(self):
        """The grammar engines' view of the model's vocabulary (its stop ids end a constrained text)."""
        if self._vocab is None:
            from engine.constraints import Vocab

            tok = self.tokenizer
            stops = getattr(tok, "stop_ids", None) or (tok.eos_token_id,)
            self._vocab = Vocab.of(tok, self.model_cfg.vocab_size, stops)
        return self._vocab

    def check_constraint(self, req: api.GenRequest) -> None:
        """Compile the request's constraint (once per distinct one: ``engine.constraints.compile_cached``); a
        400 naming its field when it does not compile. Runs off the event loop."""
        if req.constraint is None:
            return
        from engine.constraints import GrammarError, compile_cached

        try:
            compile_cached(req.constraint, self.vocab())
        except GrammarError as err:
            param = err.param or req.constraint.param
            raise api.invalid(f"Invalid '{param}': {err}", param=param, code="invalid_constraint") from None

    def context_room(self, req: api.GenRequest) -> int:
        """Prompt tokens the model's context leaves beside the request's canvas (whole blocks)."""
        b = self.model_cfg.block_size
        return self.max_model_len - -(-req.max_tokens // b) * b

    def _too_long(self, what: str, req: api.GenRequest) -> api.APIError:
        return api.APIError(400, f"prompt ({what}) + max_tokens ({req.max_tokens}) exceeds the model's context of "
                                 f"{self.max_model_len} tokens", param="prompt", code="context_length_exceeded")

    def check_lengths(self, req: api.GenRequest, key: ApiKey) -> None:
        """Refuse, before tokenizing, a prompt certainly too long: token ids by their count, text by the fewest
        tokens its characters can make (``chars_per_token``), against the context and the key's limit. A
        1 MiB prompt is refused here in microseconds; one that may fit is tokenized off the event loop."""
        cpt = self.chars_per_token
        if req.kind == "chat":
            texts = [sum(len(m["content"]) + len(m.get("name", "")) for m in req.messages)]
        else:
            texts = [len(p) for p in req.prompts]  # token ids or characters
        room = self.context_room(req)
        for prompt, size in zip(req.prompts or [None], texts):
            exact = isinstance(prompt, list)
            if not exact and cpt is None:
                continue
            least = size if exact else math.ceil(size / cpt)
            what = f"{least} tokens" if exact else f"at least {least} tokens ({size} characters)"
            if least > room:
                raise self._too_long(what, req)
            if key.max_prompt_tokens is not None and least > key.max_prompt_tokens:
                raise api.invalid(f"This API key allows prompts of at most {key.max_prompt_tokens} tokens; your "
                                  f"prompt has {what}.", param="prompt", code="prompt_too_long")

    def check_prompt(self, ids: list[int], req: api.GenRequest, key: ApiKey) -> None:
        if not ids:
            raise api.invalid("The prompt is empty.", param="prompt", code="empty_prompt")
        key.check_prompt(len(ids))
        if len(ids) > self.context_room(req):  # the engine's canvas is whole blocks
            raise self._too_long(f"{len(ids)} tokens", req)

    def sampling(self, req: api.GenRequest) -> dict:
        """The engine's sampling fields: the request's, else the checkpoint's defaults, else greedy. A request
        that samples gets a seed when it has none, so a resume elsewhere decodes as it would have."""
        defaults = getattr(self.tokenizer, "generation_defaults", {})
        out = {"temperature": req.temperature if req.temperature is not None else defaults.get("temperature", 0.0),
               "top_p": req.top_p if req.top_p is not None else defaults.get("top_p", 1.0),
               "top_k": req.top_k if req.top_k is not None else defaults.get("top_k", 0),
               "seed": req.seed, "stop_token_ids": list(req.stop_token_ids)}
        if req.ignore_eos:
            out["ignore_eos"] = True
        if req.logprobs:
            out["logprobs"] = True
        if req.constraint is not None:
            out["constraint"] = req.constraint.to_dict()
        if req.decoding is not None:  # the request's own rule (vLLM-style extra fields), over the server's
            out["decoding"] = req.decoding
        if req.decoding_config is not None:
            out["decoding_config"] = req.decoding_config
        if out["temperature"] > 0 and out["seed"] is None:
            out["seed"] = secrets.randbits(63)
        return out

    def echo_text(self, req: api.GenRequest, i: int, ids: list[int]) -> str:
        """Prompt ``i`` as echoed before its completion (``echo``): the client's text, or its token ids' text."""
        if not req.echo:
            return ""
        prompt = req.prompts[i]
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)

    @staticmethod
    def prompt_text(req: api.GenRequest, i: int) -> str:
        if req.kind == "chat":
            return "\n".join(m["content"] for m in req.messages)
        return req.prompts[i] if isinstance(req.prompts[i], str) else ""

    def submit(self, req: api.GenRequest, prompts: list[list[int]]) -> tuple[list, list[str]]:
        """Each choice to the dispatcher: prompt ``i``'s ``n`` choices are indices ``i * n`` to ``i * n + n - 1``,
        choice ``j`` of a prompt seeded ``seed + j``. The streams and each choice's echoed prompt, by index."""
        sampling = self.sampling(req)
        streams, echoes = [], []
        total = len(prompts) * req.n
        try:
            for i, ids in enumerate(prompts):
                for j in range(req.n):
                    index = i * req.n + j
                    rid = req.request_id if total == 1 else f"{req.request_id}-{index}"
                    seeded = {**sampling, "seed": choice_seed(sampling["seed"], j)}
                    if j and req.seed is None and seeded["temperature"] > 0:
                        seeded["seed"] = secrets.randbits(63)  # independent choices
                    streams.append(self.dispatcher.submit(
                        rid, ids, req.max_tokens, prompt_text=self.prompt_text(req, i), threshold=req.threshold,
                        slo_ms=req.slo_ms, priority=req.priority, sampling=seeded, stop=req.stop,
                        canvas=req.include_canvas))
                    echoes.append(self.echo_text(req, i, ids))
        except BaseException:
            self.cancel(streams)
            raise
        return streams, echoes

    async def generate(self, kind: str, request, key: ApiKey, rid: str | None = None):
        from app.dispatch import DispatchError

        streams: list = []
        try:
            req = self.parse(kind, await self.gate.body(request), key, rid)
            if req.constraint is not None:
                await asyncio.to_thread(self.check_constraint, req)
            prompts = await asyncio.to_thread(self.prompt_ids, req)
            for ids in prompts:
                self.check_prompt(ids, req, key)
            self.charge(req, prompts, key, request)
            streams, echoes = self.submit(req, prompts)
        except api.APIError as err:
            self.metrics.rejected("rate_limited" if err.status == 429 else failure_reason(err.status))
            return error_response(err)
        except DispatchError as exc:
            return self.refused(exc.status, str(exc))
        except BaseException as exc:
            if isinstance(exc, Exception):  # a JSON 500 (app.middleware.ServerErrors)
                self.metrics.rejected("error")
            raise
        for _ in streams:
            self.metrics.request_started()
        try:
            firsts = [await s.__anext__() for s in streams]
        except BaseException as exc:
            self.cancel(streams)
            for _ in streams:
                self.metrics.request_failed("error" if isinstance(exc, Exception) else "cancelled")
            raise
        failed = next((e for e in firsts if e["type"] == "error"), None)
        if failed is not None:
            self.cancel(streams)
            self.metrics.request_dropped(len(streams))  # refused() counts the refusal
            return self.refused(failed.get("status", 500), failed["message"])
        if req.stream:
            started: list[bool] = []  # sse() notes that it ran: it counts its streams' outcomes itself

            def closed() -> None:
                self.cancel(streams)
                if not started:  # the client went away before the first chunk
                    for _ in streams:
                        self.metrics.request_failed("cancelled")

            return Stream(self.sse(req, streams, started, echoes), closed, media_type="text/event-stream")
        return await self.collect(req, firsts, streams, echoes)

    async def collect(self, req: api.GenRequest, firsts: list[dict], streams: list, echoes: list[str]):
        """A non-streamed answer: every choice's last event, then one JSON object."""
        dones = []
        gap = self.metrics.gap_timer()
        try:
            for first, stream in zip(firsts, streams):
                done = first
                async for event in stream:
                    done = event
                    if event["type"] == "delta" and stream is streams[0]:  # later choices' deltas queue meanwhile
                        gap()
                dones.append(done)
        except BaseException as exc:
            for _ in streams:  # the handler was cancelled (or failed): its client got none of them
                self.metrics.request_failed("error" if isinstance(exc, Exception) else "cancelled")
            raise
        finally:
            self.cancel(streams)  # a no-op once they ended; frees them if this handler was cancelled
        for done in dones:
            if done["type"] == "done":
                self.finished(req, done)
            else:
                self.metrics.request_dropped()  # refused() counts the refusal
        bad = next((d for d in dones if d["type"] != "done"), None)
        if bad is not None:
            return self.refused(bad.get("status", 500), bad.get("message", "generation failed"))
        prompt_tokens, completion_tokens = usage_tokens(req, enumerate(dones))
        choices = [(echo + d["text"], d["finish_reason"]) for echo, d in zip(echoes, dones)]
        logprobs = [self.logprobs(req, d["token_ids"], d["logprobs"], d["text"]) for d in dones] \
            if req.logprobs else None
        if req.kind == "completion":
            return api.completion_response(req, choices, prompt_tokens, completion_tokens, logprobs)
        calls = None
        if req.tools.choice != "none":  # tool calls out of each answer's text
            calls, shaped = [], []
            for text, reason in choices:
                content, found = parse_tool_calls(text, req.tools)
                calls.append([tool_call(name, args) for name, args in found])
                shaped.append((content if found else text, "tool_calls" if found and reason == "stop" else reason))
            choices = shaped
        return api.chat_choices_response(req, choices, prompt_tokens, completion_tokens, logprobs, calls)

    def logprobs(self, req: api.GenRequest, ids: list[int], logprobs: list, text: str | None = None,
                 offset: int = 0) -> dict:
        """The logprobs object of tokens ``ids``: each token's text (decoded alone) and log-probability; with
        ``text`` (the choice's whole answer), the tokens past it (after a stop string) left out."""
        tokens = [self.tokenizer.decode([t]) for t in ids]
        if text is not None:
            keep, length = 0, 0
            while keep < len(tokens) and length + len(tokens[keep]) <= len(text):
                length += len(tokens[keep])
                keep += 1
            tokens, logprobs = tokens[:keep], logprobs[:keep]
        if req.kind == "chat":
            return api.chat_logprobs(tokens, logprobs)
        return api.completion_logprobs(tokens, logprobs, offset)

    @staticmethod
    def cancel(streams) -> None:
        for s in streams:
            s.cancel()

    def refused(self, status: int, message: str) -> JSONResponse:
        self.metrics.rejected(failure_reason(status))
        kind = {429: "rate_limit_error", 400: "invalid_request_error", 503: "service_unavailable"}.get(
            status, "server_error")
        return error_response(api.APIError(status, message, type=kind,
                                           headers={"Retry-After": "1"} if status in (429, 503) else None))

    async def sse(self, req: api.GenRequest, streams, started: list, echoes: list[str] | None = None):
        """Every choice's events as server-sent events, interleaved as they come (each chunk names its
        choice's ``index``; with ``include_canvas``, a ``remask_canvas`` chunk per denoising step); the
        usage chunk and ``[DONE]`` once all choices ended."""
        started.append(True)
        chat = req.kind == "chat"
        events: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, stream) -> None:
            try:
                async for event in stream:
                    await events.put((index, event))
            except Exception:
                log.exception("unexpected error in choice %d of %s", index, req.request_id)
                await events.put((index, {"type": "error", "status": 500,
                                          "message": f"The server had an error while streaming {req.request_id}."}))
            finally:
                await events.put((index, None))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        open_, dones, failed = len(streams), {}, False
        offsets = [len(e) for e in echoes] if echoes else [0] * len(streams)  # each choice's text so far
        gap, errors = self.metrics.gap_timer(), 0
        # chat with tools: each choice's text becomes content or tool-call deltas
        calls = [ToolCallStream(req.tools) for _ in streams] if chat and req.tools.choice != "none" else None
        try:
            for index in range(len(streams)):
                if chat:
                    yield api.sse(api.chat_chunk(req, role=True, index=index))
                elif echoes and echoes[index]:
                    yield api.sse(api.completion_chunk(req, echoes[index], index=index))
            while open_:
                index, event = await events.get()
                if event is None:
                    open_ -= 1
                elif event["type"] == "delta":
                    gap(index)
                    lp = None
                    if req.logprobs and "token_ids" in event:
                        lp = self.logprobs(req, event["token_ids"], event["logprobs"], offset=offsets[index])
                        offsets[index] += sum(len(t) for t in lp.get("tokens", ()))
                    if calls is not None:
                        for delta in calls[index].push(event["text"]):
                            yield api.sse(api.chat_chunk(req, delta.get("content"), index=index,
                                                         tool_calls=delta.get("tool_calls")))
                        continue
                    yield api.sse(api.chat_chunk(req, event["text"], index=index, logprobs=lp) if chat
                                  else api.completion_chunk(req, event["text"], index=index, logprobs=lp))
                elif event["type"] == "canvas":
                    yield api.sse(api.canvas_chunk(req, event["canvas"], index=index))
                elif event["type"] == "done":
                    dones[index] = event
                    reason = event["finish_reason"]
                    if calls is not None:
                        for delta in calls[index].finish():
                            yield api.sse(api.chat_chunk(req, delta.get("content"), index=index,
                                                         tool_calls=delta.get("tool_calls")))
                        if calls[index].calls and reason == "stop":
                            reason = "tool_calls"
                    yield api.sse(api.chat_chunk(req, finish_reason=reason, index=index) if chat
                                  else api.completion_chunk(req, "", reason, index=index))
                elif event["type"] == "error":
                    failed = True
                    errors += 1
                    self.metrics.request_failed(failure_reason(event.get("status")))
                    yield api.sse({"error": {"message": event.get("message", "generation failed"),
                                             "type": "server_error", "param": None, "code": event.get("status")}})
            if req.include_usage and not failed:
                yield api.sse(api.usage_chunk(req, *usage_tokens(req, dones.items())))
            yield api.sse("[DONE]")
        except Exception:  # the stream has started: its client gets an error event, then the end
            log.exception("unexpected error in the stream of %s", req.request_id)
            for _ in range(len(streams) - len(dones) - errors):
                self.metrics.request_failed("error")
            errors = len(streams) - len(dones)
            yield api.sse({"error": {"message": f"The server had an error while streaming {req.request_id}.",
                                     "type": "server_error", "param": None, "code": 500}})
        finally:
            for t in tasks:
                t.cancel()
            for done in dones.values():
                self.finished(req, done)
            if len(dones) < len(streams):  # the client disconnected or a choice failed: free them on their instances
                self.cancel(streams)
                for _ in range(len(streams) - len(dones) - errors):  # the client went away
                    self.metrics.request_failed("cancelled")

    def finished(self, req: api.GenRequest, done: dict) -> None:
        slo_met = None if req.slo_ms is None else done["e2e_s"] * 1000 <= req.slo_ms
        self.metrics.request_finished(
            finish_reason=done["finish_reason"], prompt_tokens=done.get("prompt_tokens", 0),
            completion_tokens=done.get("completion_tokens", 0), e2e_s=done["e2e_s"], ttft_s=done.get("ttft_s"),
            queue_s=done.get("queue_s"), rounds=done.get("rounds", 0), threshold=done.get("threshold"),
            slo_met=slo_met, resumes=done.get("resumes", 0))
        if slo_met is not None:
            self.outcomes.add(time.monotonic(), slo_met)
        if self.planner is not None and done.get("tp") is not None:  # the planner's inputs, measured
            self.planner.observe_finished(
                prompt_tokens=done["prompt_tokens"], output_tokens=done["max_tokens"], steps=done["denoise_steps"],
                threshold=done.get("threshold"), slo_s=None if req.slo_ms is None else done["slo_s"],
                e2e_s=done["e2e_s"], tp=done["tp"])
