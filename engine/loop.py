"""The round loop of one instance, in its own thread.

Control messages (add, abort, thresholds) are queued and take effect at the
next round boundary, so the loop never waits on its callers. Progress leaves
as one *batch* per round boundary through a callback: for every request that
stepped, its newly committed token ids, its step count, its next step's kind,
and (with a ``describe`` function) its step-predictor state row; plus requests
accepted, rejected or finished at that boundary, and the instance's stats.
One message per round, not one per request, keeps the control path cheap; the
receiver turns token ids into text.

A batch::

    {"t": wall-clock emission time, "round": n, "round_ms": last round's time,
     "stats": {...}, "items": [item, ...]}

Items (all carry ``"id"``): ``{"accepted": add_ms, "prompt_tokens": n}``,
``{"error": message, "status": 400 | 429 | 500}``, and step items
``{"ids": [...], "steps": rounds so far, "heavy": next step is prefill or
recompute, "row": [...] or absent, "canvas": {...} or absent (requests sent
with ``canvas``: ``Sequence.canvas_step``), "done": None | {"finish_reason",
"rounds", "completion_tokens"}}``.

A round that raises fails the requests it held (500) and the loop goes on;
one that raises ``InstanceBroken`` (a tensor-parallel rank is gone) ends the
loop instead: its requests get no error, ``on_fatal`` is called, and whoever
sent them resumes them elsewhere from their committed tokens.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.instance import Instance, InstanceBroken
from engine.sched_types import StepKind
from engine.sequence import SamplingParams, Sequence

log = logging.getLogger(__name__)
Batch = dict
HEAVY = (StepKind.PREFILL, StepKind.RECOMPUTE)


class Overloaded(Exception):
    """The instance's waiting queue is full."""


@dataclass
class _Tracked:
    sent: int = 0  # output token ids already published
    seq: Sequence | None = None  # kept when its sender asked for the canvas of each step
    canvas_step: int = 0  # the last step whose canvas was published


class RoundLoop:
    def __init__(self, instance: Instance, on_batch: Callable[[Batch], None], max_waiting: int = 256,
                 idle_wait_s: float = 0.05, describe: Callable[[Sequence, float | None], list[float]] | None = None,
                 on_fatal: Callable[[Exception], None] | None = None) -> None:
        """``describe(seq, threshold)``: the state row a step item carries (the router's step
        features), called after each of the request's steps with the threshold it used.
        ``on_fatal(exc)``: called from the loop's thread when an ``InstanceBroken`` ends it."""
        self.instance = instance
        self._emit = on_batch
        self.max_waiting = max_waiting
        self.idle_wait_s = idle_wait_s
        self.describe = describe
        self.on_fatal = on_fatal
        self.broken: str | None = None  # why the loop ended, if a round broke the instance
        self._round_t0: float | None = None  # when the running round started
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

    # ---- control (any thread) ------------------------------------------------------------
    def submit(self, req_id: str, prompt: str | list[int], params: SamplingParams,
               deadline: float | None = None, sent_at: float | None = None,
               committed: list[int] | None = None, canvas: bool = False) -> None:
        """Queue a request; ``sent_at`` (wall clock) is when its sender dispatched it;
        ``committed``: output tokens another instance already committed (resume); ``canvas``: its step
        items carry the canvas of each denoising step (``Sequence.canvas_step``)."""
        with self._lock:
            if self.instance.scheduler.num_waiting + self._pending >= self.max_waiting:
                raise Overloaded(f"{self.max_waiting} requests already waiting")
            self._pending += 1
        self._cmds.put(("add", req_id, prompt, params, deadline, sent_at, committed, canvas))
        self._wake.set()

    def abort(self, req_id: str) -> None:
        self._cmds.put(("abort", req_id))
        self._wake.set()

    def set_thresholds(self, thresholds: dict[str, float]) -> None:
        """Thresholds of the requests' next steps, from the next round on."""
        self._cmds.put(("thresholds", thresholds))
        self._wake.set()

    def reject(self, req_id: str, message: str, status: int) -> None:
        """Publish an error item for a request refused before it reached the loop (any thread)."""
        self._send([{"id": req_id, "error": message, "status": status}])

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)

    def stats(self) -> dict:
        s = self.instance.scheduler
        t0 = self._round_t0
        return {"running": s.num_running, "resident": len(s.resident), "waiting": s.num_waiting + self._pending,
                "rounds": self.rounds, "filled_slots": self.filled_slots, "last_round_s": self.last_round_s,
                "kv_reserved_tokens": s.kv_reserved, "alive": self._thread.is_alive(),
                "round_running_s": 0.0 if t0 is None else time.perf_counter() - t0}

    # ---- the loop ----------------------------------------------------------------------------
    def _apply_commands(self, items: list[dict]) -> bool:
        applied = False
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return applied
            applied = True
            op = cmd[0]
            if op == "add":
                _, req_id, prompt, params, deadline, sent_at, committed, canvas = cmd
                with self._lock:
                    self._pending -= 1
                try:
                    self.instance.add_request(req_id, prompt, params, deadline=deadline, committed=committed)
                except (ValueError, RuntimeError) as exc:
                    items.append({"id": req_id, "error": str(exc), "status": 400})
                    continue
                seq = self.instance.seqs[req_id]
                self._tracked[req_id] = _Tracked(sent=len(seq.committed), seq=seq if canvas else None)
                items.append({"id": req_id, "accepted": None if sent_at is None else (time.time() - sent_at) * 1e3,
                              "prompt_tokens": len(seq.prompt_ids) - len(seq.committed)})
            elif op == "abort":
                if self._tracked.pop(cmd[1], None) is not None:
                    self.instance.abort(cmd[1])
            elif op == "thresholds":
                for req_id, t in cmd[1].items():
                    if req_id in self._tracked:
                        self.instance.set_threshold(req_id, t)

    def _run(self) -> None:
        while not self._stop.is_set():
            items: list[dict] = []
            applied = self._apply_commands(items)
            if not self.instance.has_work():
                if applied:
                    self._send(items)
                self._wake.wait(self.idle_wait_s)
                self._wake.clear()
                continue
            try:
                self._round_t0 = t0 = time.perf_counter()
                plan, _, done = self.instance.step()
                self.last_round_s = time.perf_counter() - t0
            except InstanceBroken as exc:  # no round can run here any more: hand the requests back
                log.error("instance broken, round loop stopped: %s", exc)
                self.broken = str(exc)
                if self.on_fatal is not None:
                    self.on_fatal(exc)
                return
            except Exception as exc:  # a broken round must not hang every client
                log.exception("round failed")
                for req_id in list(self._tracked):
                    self.instance.abort(req_id)
                    items.append({"id": req_id, "error": f"round failed: {exc}", "status": 500})
                self._tracked.clear()
                self._send(items)
                continue
            finally:
                self._round_t0 = None
            self.rounds += 1
            self.filled_slots += len(plan.slots)
            finished = {r.req_id for r in done}
            for slot in plan.slots:
                item = self._step_item(slot.req_id, slot.req_id in finished)
                if item is not None:
                    items.append(item)
            self._send(items)

    def _step_item(self, req_id: str, finished: bool) -> dict | None:
        tr = self._tracked.get(req_id)
        if tr is None:
            return None
        if finished:
            out = self.instance.outputs.pop(req_id)
            ids = out.token_ids
            seq = None
        else:
            seq = self.instance.seqs[req_id]
            ids = seq.output_ids()
        item = {"id": req_id, "ids": ids[tr.sent:], "done": None}
        tr.sent = max(tr.sent, len(ids))
        if tr.seq is not None and (view := tr.seq.canvas_step()) is not None and view["step"] > tr.canvas_step:
            tr.canvas_step = view["step"]
            item["canvas"] = view
        if finished:
            del self._tracked[req_id]
            item["done"] = {"finish_reason": "length" if out.finish_reason == "length" else "stop",
                            "rounds": out.rounds, "completion_tokens": len(ids)}
            item["steps"], item["heavy"] = out.rounds, False
        else:
            item["steps"], item["heavy"] = seq.rounds, seq.next_kind() in HEAVY
            if self.describe is not None:
                item["row"] = self.describe(seq, seq.threshold)
        return item

    def batch(self, items: list[dict]) -> Batch:
        """A progress batch of ``items`` at this moment (the module docstring's format)."""
        return {"t": time.time(), "round": self.rounds, "round_ms": self.last_round_s * 1e3, "stats": self.stats(),
                "items": items}

    def _send(self, items: list[dict]) -> None:
        try:
            self._emit(self.batch(items))
        except Exception:  # the receiver's problem must not stop the rounds
            log.exception("publishing a round's progress failed")
