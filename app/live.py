"""What the dispatcher (app/dispatch.py) keeps per instance and per request, and how a report updates it.

- ``InstanceLink``: an instance's control channel, its last reported stats and round, and what a round
  really takes there (``effective_round_ms``);
- ``LiveRequest``: a request the ingress serves: the cluster core's ``RequestState``, its committed
  tokens (and their log-probabilities), its text and its events' queue; ``take_step`` applies one step
  item of its instance's progress (the text it commits, its canvas, the step features the router reads);
- ``RequestStream``: a request's events for the HTTP handler (``accepted``, ``delta``, ``canvas``, then
  ``done`` or ``error``);
- ``DispatchError``: a request refused or failed with an HTTP status.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from app.channel import Link
from app.protocol import Done, ProgressBatch, StepItem
from cluster import RequestState
from engine.commands import Resume, SamplingParams
from engine.tokenizer import OutputText


class DispatchError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class InstanceLink:
    inst_id: int
    replica: str
    tp: int
    link: Link
    last_seen: float
    stats: dict = field(default_factory=dict)
    task: asyncio.Task | None = None
    meta: dict = field(default_factory=dict)  # what the replica told about itself (e.g. its Ray actor name)
    draining: bool = False  # shutting down: it finishes what it holds only while no other instance can take it
    last_round: tuple | None = None  # (round number, emission time) of its last progress batch

    def effective_round_ms(self, batch: ProgressBatch) -> float:
        """What a round really takes on this instance: from the previous round's batch to this one's when
        the two are consecutive (the loop's own overhead, commands and whatever shares the CPU or GPU are
        in it: throughput is what admission needs), else the round's own time."""
        round_ms, n, t = batch.round_ms, batch.round, batch.t
        prev, self.last_round = self.last_round, (n, t)
        if prev is not None and prev[0] == n - 1:
            gap_ms = (t - prev[1]) * 1e3
            if round_ms <= gap_ms <= 3.0 * round_ms:  # longer: the loop was idle in between
                return gap_ms
        return round_ms


@dataclass(eq=False)
class LiveRequest:
    req_id: str
    prompt_ids: list[int]
    max_tokens: int
    state: RequestState
    queue: asyncio.Queue
    arrival: float
    out: OutputText
    sampling: SamplingParams = field(default_factory=SamplingParams)  # its max_tokens and threshold: the fields above
    canvas: bool = False  # the client asked for each step's canvas (``canvas`` events)
    committed: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # of ``committed``, when its sampling asked for them
    first_step: float | None = None  # when its first step's progress arrived (its queue time ends)
    rows: list = field(default_factory=list)  # its StepFeatures after each denoising step (the online learners')
    row_steps: list[int] = field(default_factory=list)  # denoising steps done at each row
    denoise_steps: int = 0
    first_token: float | None = None
    accepted: bool = False
    sent_threshold: float | None = None
    resumes: int = 0
    parked_at: float = 0.0
    resume: Resume | None = None  # its instance's latest resume state (after ``committed``): a resume continues it

    def emit(self, piece: str, now: float) -> None:
        """A piece of text for the client (its first one ends the time to first token)."""
        if piece:
            if self.first_token is None:
                self.first_token = now
            self.queue.put_nowait({"type": "delta", "text": piece})

    def take_step(self, item: StepItem, now: float, inst: InstanceLink, decode: Callable[[list[int]], str],
                  full_sequence: bool, block_tokens: int) -> tuple[Done | None, bool]:
        """Apply one step of this request's instance: its canvas event, the tokens it committed (their text,
        and log-probabilities when asked for), and the step features that the router's estimates read.
        Returns (how it ended, if it did; whether a stop string cut it, so its instance should stop it)."""
        ids = item.ids
        st = self.state
        self.resume = item.resume  # its block's state after these ids (None: a resume restarts the block)
        if self.first_step is None:
            self.first_step = now
        ended = item.done
        view = item.canvas
        if view is not None and self.canvas:
            view = {**view, "committed": [[p, t, decode([t])] for p, t in view["committed"]],
                    **({"edited": [[p, t, decode([t])] for p, t in view["edited"]]} if "edited" in view else {}),
                    "instance": inst.inst_id, "tp": inst.tp}
            self.queue.put_nowait({"type": "canvas", "canvas": view})
        if ids:
            self.committed.extend(ids)
            if self.sampling.logprobs:  # each delta names the tokens it commits, with their log-probabilities
                logprobs = list(item.logprobs or ()) + [None] * (len(ids) - len(item.logprobs or ()))
                self.logprobs.extend(logprobs)
                if self.first_token is None:
                    self.first_token = now
                self.queue.put_nowait({"type": "delta", "text": self.out.push(ids), "token_ids": list(ids),
                                       "logprobs": logprobs})
            else:
                self.emit(self.out.push(ids), now)
            if self.out.stopped and item.done is None:  # a stop string: the rest is not wanted
                return Done("stop", st.steps_done, len(self.committed)), True
            if self.out.stopped and ended.finish_reason == "length":  # a stop string in its last tokens ended it
                ended = Done("stop", ended.rounds, ended.completion_tokens)
        # a block-causal model's prefill steps denoise nothing (the step that ran was heavy)
        f = item.features
        if full_sequence or not st.next_heavy:
            self.denoise_steps += 1
            if f is not None and item.done is None:
                self.rows.append(f)
                self.row_steps.append(self.denoise_steps)
        if f is not None:  # the replica's step features
            st.progress, st.block_progress, st.conf_stats = f.progress, f.block_progress, f.conf_stats
            st.blocks_left, st.step_in_block = max(int(f.blocks_left), 1), int(f.step_in_block)
        else:
            st.progress = len(self.committed) / max(st.output_tokens, 1)
            st.blocks_left = max(1, -(-(st.output_tokens - len(self.committed)) // block_tokens))
        return ended, False


class RequestStream:
    """One request's events, for the HTTP handler; ``cancel(req_id)`` frees it where it runs."""

    def __init__(self, cancel: Callable[[str], None], live: LiveRequest) -> None:
        self._cancel, self._live = cancel, live
        self.ended = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> dict:
        if self.ended:
            raise StopAsyncIteration
        event = await self._live.queue.get()
        if event["type"] in ("done", "error"):
            self.ended = True
        return event

    def cancel(self) -> None:
        """The client went away: free the request's slot and KV on its instance."""
        if not self.ended:
            self.ended = True
            self._cancel(self._live.req_id)
