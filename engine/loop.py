"""The round loop of one instance, in its own thread.

Control messages (add, abort) are queued and take effect at the next round
boundary, so the loop never waits on its callers; progress (newly committed
text, completion, errors) is published through a callback as events.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.instance import Instance
from engine.sequence import SamplingParams

log = logging.getLogger(__name__)
Event = dict


class Overloaded(Exception):
    """The instance's waiting queue is full."""


@dataclass
class _Tracked:
    sent_text: str = ""
    prompt_tokens: int = 0
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    add_ms: float | None = None  # sender's dispatch -> applied at a round boundary


class RoundLoop:
    def __init__(self, instance: Instance, on_event: Callable[[str, Event], None], max_waiting: int = 256,
                 idle_wait_s: float = 0.05) -> None:
        self.instance = instance
        self._emit = on_event
        self.max_waiting = max_waiting
        self.idle_wait_s = idle_wait_s
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._tracked: dict[str, _Tracked] = {}
        self._pending = 0  # submitted but not yet applied
        self._lock = threading.Lock()
        self.rounds = 0
        self.filled_slots = 0
        self.last_round_s = 0.0
        self._thread = threading.Thread(target=self._run, name="remask-round-loop", daemon=True)
        self._thread.start()

    def on_event(self, req_id: str, event: Event) -> None:
        event["t"] = time.time()  # wall clock: the receiver measures the event's delivery time
        self._emit(req_id, event)

    # ---- control (any thread) ------------------------------------------------------------
    def submit(self, req_id: str, prompt: str | list[int], params: SamplingParams,
               deadline: float | None = None, sent_at: float | None = None) -> None:
        """Queue a request; ``sent_at`` (wall clock) is when its sender dispatched it."""
        with self._lock:
            if self.instance.scheduler.num_waiting + self._pending >= self.max_waiting:
                raise Overloaded(f"{self.max_waiting} requests already waiting")
            self._pending += 1
        self._cmds.put(("add", req_id, prompt, params, deadline, sent_at))
        self._wake.set()

    def abort(self, req_id: str) -> None:
        self._cmds.put(("abort", req_id))
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)

    def stats(self) -> dict:
        s = self.instance.scheduler
        return {"running": s.num_running, "resident": len(s.resident), "waiting": s.num_waiting + self._pending,
                "rounds": self.rounds, "filled_slots": self.filled_slots, "last_round_s": self.last_round_s,
                "kv_reserved_tokens": s.kv_reserved, "alive": self._thread.is_alive()}

    # ---- the loop ----------------------------------------------------------------------------
    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, req_id, prompt, params, deadline, sent_at = cmd
                with self._lock:
                    self._pending -= 1
                try:
                    self.instance.add_request(req_id, prompt, params, deadline=deadline)
                    seq = self.instance.seqs[req_id]
                    self._tracked[req_id] = _Tracked(prompt_tokens=len(seq.prompt_ids),
                                                     add_ms=None if sent_at is None else (time.time() - sent_at) * 1e3)
                except (ValueError, RuntimeError) as exc:
                    self.on_event(req_id, {"type": "error", "status": 400, "message": str(exc)})
            elif cmd[0] == "abort":
                req_id = cmd[1]
                if self._tracked.pop(req_id, None) is not None:
                    self.instance.abort(req_id)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._apply_commands()
            if not self.instance.has_work():
                self._wake.wait(self.idle_wait_s)
                self._wake.clear()
                continue
            try:
                t0 = time.perf_counter()
                plan, _, done = self.instance.step()
                self.last_round_s = time.perf_counter() - t0
            except Exception as exc:  # a broken round must not hang every client
                log.exception("round failed")
                for req_id in list(self._tracked):
                    self.instance.abort(req_id)
                    self.on_event(req_id, {"type": "error", "status": 500, "message": f"round failed: {exc}"})
                self._tracked.clear()
                continue
            self.rounds += 1
            self.filled_slots += len(plan.slots)
            finished = {r.req_id: r for r in done}
            for slot in plan.slots:
                self._publish(slot.req_id, finished.get(slot.req_id))

    def _publish(self, req_id: str, finished) -> None:
        tr = self._tracked.get(req_id)
        if tr is None:
            return
        if finished is not None:
            out = self.instance.outputs.pop(req_id)
            text, ids = out.text, out.token_ids
        else:
            seq = self.instance.seqs[req_id]
            ids = seq.output_ids()
            text = self.instance.engine.tokenizer.decode(ids)
        if len(text) > len(tr.sent_text) and text.startswith(tr.sent_text):
            if tr.first_token is None:
                tr.first_token = time.monotonic()
            self.on_event(req_id, {"type": "delta", "text": text[len(tr.sent_text):]})
            tr.sent_text = text
        if finished is not None:
            del self._tracked[req_id]
            now = time.monotonic()
            self.on_event(req_id, {
                "type": "done", "finish_reason": "length" if out.finish_reason == "length" else "stop",
                "text": text, "prompt_tokens": tr.prompt_tokens, "completion_tokens": len(ids),
                "rounds": out.rounds, "ttft_s": (tr.first_token or now) - tr.arrival, "e2e_s": now - tr.arrival,
                "add_ms": tr.add_ms,
            })
