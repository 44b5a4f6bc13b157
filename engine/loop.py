"""The round loop of one instance, in its own thread: the third of an instance's five layers, over
``Instance`` and under the replica server (docs/architecture.md).

Control messages (engine/commands.py: ``Add``, ``Abort``, ``Thresholds``, through ``put`` or the
``submit``/``abort``/``set_thresholds`` shorthands) are queued and take effect at the
next round boundary, so the loop never waits on its callers (with one bounded
exception, below). Progress leaves
as one ``ProgressBatch`` (engine/progress.py) per round boundary through a callback: for every
request that stepped, a ``StepItem`` (its newly committed token ids, its step
count, whether its next step is heavy, and with a ``describe`` function its step
features); an ``AcceptedItem`` or ``ErrorItem`` for requests accepted or
rejected at that boundary; and the instance's stats. One message per round, not
one per request, keeps the control path cheap; the receiver turns token ids into
text. The replica sends these records as they are (``app.protocol`` encodes
them for the control channel).

Thresholds and external estimates. ``set_thresholds(map, estimates, after_round)``
carries the cluster router's thresholds and its estimates of remaining
denoising rounds, chosen after the batch of round ``after_round``. They are
meant for round ``after_round + 1``: applied before it starts they are *on
time*, after it started *late*. ``stats()`` counts messages that changed a
threshold (``thresholds_on_time``, ``thresholds_late``, and the rounds they
were late by, ``thresholds_late_rounds``), every message with an
``after_round`` (``answers_on_time``, ``answers_late``) and the mean time from
a batch's emission to its answer's arrival (``threshold_answer_ms_mean``).

A request submitted with ``planned=True`` has a sender that answers every
batch carrying it with such a message (an empty one when nothing changed);
after a round that stepped one, the loop waits for that answer before
scheduling the next round, at most ``min(threshold_wait_s, threshold_wait_frac
x the last round's time)`` (``threshold_waits``, ``threshold_wait_timeouts``,
``threshold_wait_ms``).

An estimate made after round n is the request's remaining rounds as of then:
the loop subtracts the denoising rounds the request ran since (it remembers
the last 64 rounds; an older estimate is dropped), and drops it when the
request's refinement came after round n: the most recent estimate holds
(engine/scheduler/). The ``add``'s ``est_rounds`` replaces the instance's
admission estimate.

Failed rounds. A round whose engine step raises (a CUDA out-of-memory error, a
request that breaks the forward) fails no request by itself: the loop finds
the request at fault by bisection, in probe rounds that run some of its
requests by themselves (engine/probing.py holds that state and its decisions:
when a request is convicted, gets a 500 or is handed back with a 503, and when
``broken_after`` give-ups mean the instance itself is broken: the loop ends as
below). Any other exception (the scheduler's) hands every request back (503).

A round that raises ``InstanceBroken`` (a tensor-parallel rank is gone) ends
the loop: its requests get no error, ``on_fatal`` is called, and whoever
sent them resumes them elsewhere from their committed tokens.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.commands import Abort, Add, Resume, Thresholds
from engine.instance import Instance, InstanceBroken, RoundFailed
from engine.probing import Probing
from engine.progress import AcceptedItem, Done, ErrorItem, Item, ProgressBatch, StepItem
from engine.scheduler.types import StepKind
from engine.sequence import SamplingParams, Sequence

log = logging.getLogger(__name__)
HEAVY = (StepKind.PREFILL, StepKind.RECOMPUTE)


class Overloaded(Exception):
    """The instance's waiting queue is full."""


@dataclass
class _Tracked:
    sent: int = 0  # output token ids already published
    seq: Sequence | None = None  # kept when its sender asked for the canvas of each step
    canvas_step: int = 0  # the last step whose canvas was published
    attempt: int = 0  # the attempt its sender submitted it as: every item about it carries it
    planned: bool = False  # its sender answers each batch carrying it with thresholds (``after_round``)
    refined_round: int | None = None  # the round after which the instance refined its estimate
    reset_at: int | None = None  # tokens it had published when a failed round made it start over (``reset``)


@dataclass(slots=True)
class _Queued:
    """A command waiting for the next round boundary: when it was queued (``perf_counter``) and, for an add,
    its deadline (``time.monotonic()``)."""

    cmd: Add | Abort | Thresholds
    at: float
    deadline: float | None = None


class RoundLoop:
    def __init__(self, instance: Instance, on_batch: Callable[[ProgressBatch], None], max_waiting: int = 256,
                 idle_wait_s: float = 0.05, describe: Callable[[Sequence, float | None], Any] | None = None,
                 on_fatal: Callable[[Exception], None] | None = None, threshold_wait_s: float = 0.002,
                 threshold_wait_frac: float = 0.1, max_round_failures: int = 2, broken_after: int = 3) -> None:
        """``describe(seq, threshold)``: the step features a step item carries (the router's:
        ``predictors.features.state_row``), called after each of the request's steps with the threshold it
        used.
        ``on_fatal(exc)``: called from the loop's thread when an ``InstanceBroken`` ends it.
        ``threshold_wait_s``, ``threshold_wait_frac``: the bound on waiting for the thresholds of
        planned requests (module docstring; 0: never wait).
        ``max_round_failures``: failed rounds in a row, the last one alone, that convict a request;
        ``broken_after``: requests given up on (503) with no successful round in between that end the loop
        as a broken instance (module docstring)."""
        self.probing = Probing(max_round_failures, broken_after)  # failed rounds (engine/probing.py)
        self.instance = instance
        self._emit = on_batch
        self.max_waiting = max_waiting
        self.idle_wait_s = idle_wait_s
        self.describe = describe
        self.on_fatal = on_fatal
        self.broken: str | None = None  # why the loop ended, if a round broke the instance
        self._broken_exc: InstanceBroken | None = None
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
        self.last_kinds: dict[str, int] = {}
        self.last_kind_tokens: dict[str, int] = {}
        self.threshold_wait_s, self.threshold_wait_frac = threshold_wait_s, threshold_wait_frac
        self._recent: deque[tuple[int, set[str]]] = deque(maxlen=64)  # (round, requests that took a denoising step)
        self._expect: int | None = None  # a planned request stepped in this round: its answer is due
        self._answered = -1  # the latest round a thresholds message answered
        self.counts = dict.fromkeys(("thresholds_on_time", "thresholds_late", "thresholds_late_rounds",
                                     "threshold_waits", "threshold_wait_timeouts", "estimates_applied",
                                     "estimates_dropped", "threshold_answers", "answers_on_time", "answers_late",
                                     "rounds_failed", "probe_rounds", "requests_failed", "requests_given_up",
                                     "requests_reset"), 0)
        self.threshold_wait_ms = 0.0
        self.threshold_answer_ms = 0.0  # summed over the answers (after_round) to this loop's batches
        self._emitted: deque[tuple[int, float]] = deque(maxlen=64)  # (round, when its batch left)
        self._thread = threading.Thread(target=self._run, name="remask-round-loop", daemon=True)
        self._thread.start()

    # ---- control (any thread) ------------------------------------------------------------
    def put(self, cmd: Add | Abort | Thresholds, deadline: float | None = None) -> None:
        """Queue a command (engine/commands.py) for the next round boundary. An ``Add``'s deadline is
        ``deadline`` (``time.monotonic()``) or else its ``slo_left_s`` from now; a full waiting queue refuses
        it (``Overloaded``)."""
        if isinstance(cmd, Add):
            if deadline is None and cmd.slo_left_s is not None:
                deadline = time.monotonic() + cmd.slo_left_s
            with self._lock:
                if self.instance.scheduler.num_waiting + self._pending >= self.max_waiting:
                    raise Overloaded(f"{self.max_waiting} requests already waiting")
                self._pending += 1
        elif not isinstance(cmd, (Abort, Thresholds)):
            raise TypeError(f"a round loop takes Add, Abort or Thresholds, not {type(cmd).__name__}")
        self._cmds.put(_Queued(cmd, time.perf_counter(), deadline))
        self._wake.set()

    def submit(self, req_id: str, prompt: str | list[int], params: SamplingParams,
               deadline: float | None = None, sent_at: float | None = None,
               committed: list[int] | None = None, canvas: bool = False, est_rounds: float | None = None,
               planned: bool = False, attempt: int = 0, resume: Resume | None = None) -> None:
        """Queue a request (an ``Add``, engine/commands.py); ``sent_at`` (wall clock) is when its sender
        dispatched it; ``committed``: output tokens another instance already committed (resume), ``resume``:
        the state of its block after them; ``canvas``: its step
        items carry the canvas of each denoising step (``Sequence.canvas_step``); ``est_rounds``: its
        remaining denoising rounds as its sender estimates them (replaces the admission estimate);
        ``planned``: its sender answers each batch carrying it with thresholds (module docstring);
        ``attempt``: its sender's count of its placements, carried back on its items."""
        self.put(Add(req_id, prompt, params, sent_at=sent_at, committed=list(committed or ()), resume=resume,
                     canvas=canvas, est_rounds=est_rounds, planned=planned, attempt=attempt), deadline)

    def abort(self, req_id: str) -> None:
        self.put(Abort(req_id))

    def set_thresholds(self, thresholds: dict[str, float], estimates: dict[str, float] | None = None,
                       after_round: int | None = None) -> None:
        """Thresholds of the requests' next steps and estimates of their remaining denoising rounds, from
        the next round on; ``after_round``: the round whose batch they answer (module docstring)."""
        self.put(Thresholds(thresholds, estimates or {}, after_round))

    def reject(self, req_id: str, message: str, status: int, attempt: int = 0) -> None:
        """Publish an error item for a request refused before it reached the loop (any thread)."""
        self._send([ErrorItem(req_id, message, status, attempt)])

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)

    def stats(self) -> dict:
        s = self.instance.scheduler
        t0 = self._round_t0
        pool = self.instance.engine.runner.pool
        return {"running": s.num_running, "resident": len(s.resident), "waiting": s.num_waiting + self._pending,
                "rounds": self.rounds, "filled_slots": self.filled_slots, "last_round_s": self.last_round_s,
                "kv_reserved_tokens": s.kv_reserved, "kv_capacity_tokens": s.cfg.kv_budget,
                "kv_beyond_pool": 0 if pool is None else pool.beyond, "alive": self._thread.is_alive(),
                "round_running_s": 0.0 if t0 is None else time.perf_counter() - t0, **self._graph_stats(),
                **self.counts, "threshold_wait_ms": round(self.threshold_wait_ms, 3),
                "threshold_answer_ms_mean": round(self.threshold_answer_ms / max(self.counts["threshold_answers"], 1),
                                                  3)}

    def _graph_stats(self) -> dict:
        """The engine's CUDA graphs (engine/graphs.py): captures, replays, failed captures and, once one failed
        (graphs are then off for this instance), why; zeros and None where the engine has no graphs."""
        g = self.instance.engine.runner.graphs
        return {"cuda_graph_captures": getattr(g, "captures", 0), "cuda_graph_replays": getattr(g, "replays", 0),
                "cuda_graph_capture_failures": getattr(g, "capture_failures", 0),
                "cuda_graphs_off": getattr(g, "failed", None)}

    # ---- the loop ----------------------------------------------------------------------------
    def _apply_commands(self, items: list[Item]) -> bool:
        applied = False
        while True:
            try:
                queued = self._cmds.get_nowait()
            except queue.Empty:
                return applied
            applied = True
            cmd = queued.cmd
            if isinstance(cmd, Add):
                self._apply_add(cmd, queued.deadline, items)
            elif isinstance(cmd, Abort):
                self.probing.forget(cmd.req_id)
                self.probing.convicted.pop(cmd.req_id, None)
                if self._tracked.pop(cmd.req_id, None) is not None:
                    self.instance.abort(cmd.req_id)
            else:
                self._apply_thresholds(cmd.map, cmd.estimates, cmd.after_round, queued.at)

    def _apply_add(self, cmd: Add, deadline: float | None, items: list[Item]) -> None:
        with self._lock:
            self._pending -= 1
        try:
            self.instance.add_request(cmd.req_id, cmd.prompt_ids, cmd.params, deadline=deadline,
                                      committed=cmd.committed or None, est_rounds=cmd.est_rounds,
                                      resume=cmd.resume)
        except (ValueError, RuntimeError) as exc:
            items.append(ErrorItem(cmd.req_id, str(exc), 400, cmd.attempt))
            return
        seq = self.instance.seqs[cmd.req_id]
        self._tracked[cmd.req_id] = _Tracked(sent=len(seq.committed), seq=seq if cmd.canvas else None,
                                             attempt=cmd.attempt, planned=cmd.planned)
        sent_at = cmd.sent_at
        items.append(AcceptedItem(cmd.req_id, None if sent_at is None else (time.time() - sent_at) * 1e3,
                                  len(seq.prompt_ids) - len(seq.committed), cmd.attempt))

    def _apply_thresholds(self, thresholds: dict[str, float], estimates: dict[str, float], after: int | None,
                          arrived: float) -> None:
        changed = False
        for req_id, t in thresholds.items():
            if req_id in self._tracked:
                self.instance.set_threshold(req_id, t)
                changed = True
        for req_id, rounds in estimates.items():
            self._apply_estimate(req_id, rounds, after)
        if after is None:
            return
        late = self.rounds - after  # it takes effect in round self.rounds + 1; it was meant for round after + 1
        self.counts["answers_late" if late > 0 else "answers_on_time"] += 1
        if after > self._answered:
            self._answered = after
            sent = next((t for n, t in reversed(self._emitted) if n == after), None)
            if sent is not None:  # how long the answer took: from the batch's emission to its arrival
                self.counts["threshold_answers"] += 1
                self.threshold_answer_ms += (arrived - sent) * 1e3
        if changed:
            self.counts["thresholds_late" if late > 0 else "thresholds_on_time"] += 1
            self.counts["thresholds_late_rounds"] += max(late, 0)

    def _apply_estimate(self, req_id: str, rounds: float, after: int | None) -> None:
        """An external estimate of ``req_id``'s remaining rounds as of round ``after`` (None: now)."""
        tr = self._tracked.get(req_id)
        if tr is None:
            return
        if after is not None:
            since = self.rounds - after
            if since > len(self._recent) or (tr.refined_round is not None and tr.refined_round > after):
                self.counts["estimates_dropped"] += 1  # older than what is recorded, or the refinement is newer
                return
            rounds -= sum(1 for n, ids in self._recent if n > after and req_id in ids)
        self.counts["estimates_applied"] += self.instance.set_estimate(req_id, rounds)

    def _await_thresholds(self, items: list[Item]) -> None:
        """Before a round: wait (bounded) for the answer to the last round's batch when a planned request
        stepped in it, applying whatever arrives meanwhile."""
        want, self._expect = self._expect, None
        if want is None or self._answered >= want or self.threshold_wait_s <= 0:
            return
        t0 = time.perf_counter()
        deadline = t0 + min(self.threshold_wait_s, self.threshold_wait_frac * self.last_round_s)
        self.counts["threshold_waits"] += 1
        while self._answered < want and not self._stop.is_set():
            left = deadline - time.perf_counter()
            if left <= 0:
                self.counts["threshold_wait_timeouts"] += 1
                break
            self._wake.clear()  # cleared before the queue is read: a command put after it sets it again
            if self._apply_commands(items) and not any(tr.planned for tr in self._tracked.values()):
                break  # aborted meanwhile: no answer is due any more
            if self._answered < want:
                self._wake.wait(left)
        self.threshold_wait_ms += (time.perf_counter() - t0) * 1e3

    def _run(self) -> None:
        while not self._stop.is_set():
            items: list[Item] = []
            applied = self._apply_commands(items)
            if not self.instance.has_work():
                if applied:
                    self._send(items)
                self._wake.wait(self.idle_wait_s)
                self._wake.clear()
                continue
            self._await_thresholds(items)
            only = self._next_probe(items)
            if self.broken is not None:  # the verdict found the instance broken: its items first, then on_fatal
                self._send(items)
                return self._fatal()
            failed: RoundFailed | str | None = None
            try:
                self._round_t0 = t0 = time.perf_counter()
                plan, result, done = self.instance.step(only)
                self.last_round_s = time.perf_counter() - t0
            except InstanceBroken as exc:  # no round can run here any more: hand the requests back
                self._end(exc)
                self._send(items)
                return self._fatal()
            except RoundFailed as exc:
                # the traceback as text: a log record that kept it would keep the round's KV caches alive
                log.error("%s (requests %s)\n%s", exc, exc.batch, "".join(traceback.format_exception(exc.__cause__)))
                failed = RoundFailed(str(exc), exc.batch, exc.touched)  # without the traceback, which holds caches
            except Exception as exc:  # outside the engine (the scheduler): nothing here can be trusted
                log.exception("round failed outside the engine")
                failed = f"round failed: {type(exc).__name__}: {exc}"
            finally:
                self._round_t0 = None
            if failed is not None:
                self.counts["rounds_failed"] += 1
                if isinstance(failed, RoundFailed):
                    self._round_failed(failed, only is not None, items)
                else:
                    self._give_up_all(failed, items)
                self._send(items)
                if self.broken is not None:
                    return self._fatal()
                continue
            if only is not None and not plan.slots:  # none of its requests could run: back to ordinary rounds
                self.probing.probe_passed()
                self._send(items)
                continue
            self.probing.round_succeeded()
            self.rounds += 1
            self.filled_slots += len(plan.slots)
            finished = {r.req_id for r in done}
            self._note_round(plan, result, finished)
            for slot in plan.slots:
                item = self._step_item(slot.req_id, slot.req_id in finished)
                if item is not None:
                    items.append(item)
                self._cleared(slot.req_id)
            if only is not None:
                self.counts["probe_rounds"] += 1
                self.probing.probe_ran(all((tr := self._tracked.get(r)) is None or tr.reset_at is None
                                           for r in only))
            self._send(items)

    # ---- failed rounds (engine/probing.py) ---------------------------------------------------------
    def _next_probe(self, items: list[Item]) -> list[str] | None:
        """The requests the next round runs by themselves (None: an ordinary round); once every probe has
        run, the verdict on the convicted requests."""
        only = self.probing.next_probe(self._tracked)
        if only is None and self.probing.convicted:
            self._verdict(items)
        return only

    def _round_failed(self, failed: RoundFailed, probing: bool, items: list[Item]) -> None:
        self.probing.round_failed(failed, probing)
        touched = set(failed.touched)
        for req_id in failed.batch:
            tr = self._tracked.get(req_id)
            if req_id in touched and tr is not None:
                try:  # half-updated: over again from what its receiver has
                    self.instance.reset(req_id, tr.sent)
                    self.counts["requests_reset"] += 1
                    tr.reset_at = tr.sent
                except (ValueError, RuntimeError, KeyError) as exc:
                    self._drop(req_id, ErrorItem(req_id, f"{failed}; restarting it failed: {exc}", 503, tr.attempt),
                               items)
        self.probing.bisect(failed, [r for r in failed.batch if r in self._tracked],
                            self.instance.scheduler.cfg.slots)

    def _cleared(self, req_id: str) -> None:
        """``req_id`` took a step in a round that succeeded: its failures in a row are over, unless it had
        started over and has not yet got past where it was (``Probing.clear``)."""
        tr = self._tracked.get(req_id)
        short = tr is not None and tr.reset_at is not None and tr.sent <= tr.reset_at
        if self.probing.clear(req_id, short) and tr is not None:
            tr.reset_at = None

    def _verdict(self, items: list[Item]) -> None:
        """Every probe has run: each convicted request fails (500) or is handed back (503)."""
        for req_id, why, at_fault in self.probing.verdict(self._tracked):
            attempt = self._tracked[req_id].attempt
            if at_fault:
                self.counts["requests_failed"] += 1
                self._drop(req_id, ErrorItem(req_id, why, 500, attempt), items)
            else:
                self._hand_back(req_id, f"{why}; no round succeeded on this instance since", attempt, items)
        if self.probing.broken():
            self._end(InstanceBroken(self.probing.broken_reason()))

    def _hand_back(self, req_id: str, why: str, attempt: int, items: list[Item]) -> None:
        self.counts["requests_given_up"] += 1
        self.probing.gave_up(req_id)
        self._drop(req_id, ErrorItem(req_id, f"{why}: resume it elsewhere", 503, attempt), items)

    def _give_up_all(self, why: str, items: list[Item]) -> None:
        """A failure outside the engine: every request is handed back (its sender resumes it elsewhere)."""
        for req_id, tr in list(self._tracked.items()):
            self._hand_back(req_id, why, tr.attempt, items)
        self.probing.drop_all()
        if self.probing.broken():
            self._end(InstanceBroken(self.probing.broken_reason()))

    def _drop(self, req_id: str, item: ErrorItem, items: list[Item]) -> None:
        self._tracked.pop(req_id, None)
        self.probing.forget(req_id)
        self.instance.abort(req_id)
        items.append(item)

    def _end(self, exc: InstanceBroken) -> None:
        """The instance can run no more rounds: the loop ends once its last items are sent (``_fatal``);
        the requests it still holds get no error."""
        if self.broken is None:
            log.error("instance broken, round loop stopped: %s", exc)
            self.broken, self._broken_exc = str(exc), exc

    def _fatal(self) -> None:
        if self.on_fatal is not None and self._broken_exc is not None:
            self.on_fatal(self._broken_exc)

    def _note_round(self, plan, result, finished: set[str]) -> None:
        """What the next round's bookkeeping needs of this one: the requests that took a denoising step,
        those the instance refined, whether a planned request's answer is due, the composition by kind."""
        n = self.rounds
        self._recent.append((n, {s.req_id for s in plan.slots if s.kind is not StepKind.PREFILL}))
        for out in result.outcomes:
            if out.refined_rounds is not None and (tr := self._tracked.get(out.req_id)) is not None:
                tr.refined_round = n
        self._expect = n if any((tr := self._tracked.get(s.req_id)) is not None and tr.planned
                                and s.req_id not in finished for s in plan.slots) else None
        kinds: dict[str, int] = {}
        tokens: dict[str, int] = {}
        last = self.instance.last_round
        for kind, t, _ in last.composition if last is not None else ():
            kinds[kind] = kinds.get(kind, 0) + 1
            tokens[kind] = tokens.get(kind, 0) + t
        self.last_kinds, self.last_kind_tokens = kinds, tokens

    def _step_item(self, req_id: str, finished: bool) -> StepItem | None:
        tr = self._tracked.get(req_id)
        if tr is None:
            return None
        if finished:
            out = self.instance.outputs.pop(req_id)
            ids, logprobs = out.token_ids, out.logprobs
            item = StepItem(req_id, ids[tr.sent:], out.rounds, False, attempt=tr.attempt,
                            done=Done("length" if out.finish_reason == "length" else "stop", out.rounds, len(ids)))
            del self._tracked[req_id]
        else:
            seq = self.instance.seqs[req_id]
            ids = seq.output_ids()
            logprobs = seq.output_logprobs(len(ids))
            item = StepItem(req_id, ids[tr.sent:], seq.rounds, seq.next_kind() in HEAVY, attempt=tr.attempt,
                            features=None if self.describe is None else self.describe(seq, seq.threshold))
        if logprobs is not None:
            item.logprobs = logprobs[tr.sent:]
        tr.sent = max(tr.sent, len(ids))
        if not finished and (seq.rule.edits or seq.rule_state):  # a resume elsewhere continues the block exactly
            item.resume = seq.resume_state(tr.sent)
        if tr.seq is not None and (view := tr.seq.canvas_step()) is not None and view["step"] > tr.canvas_step:
            tr.canvas_step = view["step"]
            item.canvas = view
        return item

    def batch(self, items: list[Item]) -> ProgressBatch:
        """A progress batch of ``items`` at this moment."""
        return ProgressBatch(time.time(), self.rounds, self.last_round_s * 1e3, self.last_kinds,
                             self.last_kind_tokens, self.stats(), items)

    def _send(self, items: list[Item]) -> None:
        if not self._emitted or self._emitted[-1][0] != self.rounds:
            self._emitted.append((self.rounds, time.perf_counter()))
        try:
            self._emit(self.batch(items))
        except Exception:  # the receiver's problem must not stop the rounds
            log.exception("publishing a round's progress failed")
