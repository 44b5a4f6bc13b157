"""The ingress's view of the cluster: the cluster driver carried out over live instances.

``Dispatcher`` (asyncio, no Ray) owns one control channel per instance and
executes what the cluster driver (``cluster.driver.ClusterDriver``, around the
router ``cluster.Router``; the cluster simulator drives the same one) decides:
the driver is its one door into the cluster core (it never calls the router),
and the driver's views are what the debug views read of the cluster. For each
request it

- hands it to the driver on arrival (``ClusterDriver.arrive``: the driver builds
  its cluster state and places it: the router policy, Alg. 3 for ``remask``) and
  sends it with the threshold of its first step (each ``Move`` carries it, with
  the router's estimate of its remaining rounds);
- turns each instance's per-round progress batch into the request's streamed
  text and one call into the driver (``on_round``), whose answer is whole: the
  finished requests, the migrations, and the instance's new thresholds (Alg. 1
  within the load control caps of Alg. 2), sent back as one message per round;
- migrates requests the router moves (abort on the source, resume on the
  destination from the committed tokens: no KV travels);
- resumes every request of an instance that dies on the others, from the
  tokens it had committed, so nothing is lost (or fails it cleanly when no
  instance is left or it failed ``max_resumes`` times);
- moves the requests of an instance that is shutting down (``draining``: a
  redeploy or a scale-down) to the others the same way, as soon as there is
  another; until then they finish where they are;
- cancels a request whose client went away.

A request arrives as token ids (tokenized once, at the ingress) with its
sampling parameters; a seeded request decodes the same text on any instance,
so a resumed one goes on as it would have. Text is decoded here from committed
token ids (``engine.tokenizer.OutputText``: pieces that never split a
character, and ``stop`` strings: the text ends before one, and the request is
cancelled on its instance at once); the instance only sends ids. A request's
events (``RequestStream``): ``accepted`` once, then ``delta`` text, then
``done`` or ``error``. The records it keeps per instance and per request, and
how a step item updates a request, are in app/live.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from app.channel import Link
from app.live import DispatchError, InstanceLink, LiveRequest, RequestStream
from app.protocol import Abort, Add, Done, Draining, ErrorItem, ProgressBatch, StepItem, Thresholds, Tick
from cluster import Router
from cluster.driver import Arrival, ClusterDriver, Move, Plan
from cluster.estimator import request_step_cap
from engine.commands import SamplingParams
from engine.tokenizer import OutputText
from predictors.features import constraint_value

if TYPE_CHECKING:
    from cluster.learning import LiveLearning
    from engine.latency_profile import LatencyProfile

__all__ = ["DispatchError", "Dispatcher", "InstanceLink", "LiveRequest", "RequestStream"]

log = logging.getLogger(__name__)
WATCHDOG_RESTART_S = 1.0  # a watchdog task that ended starts again after this


class Dispatcher:
    def __init__(self, router: Router, decode: Callable[[list[int]], str], *, block_tokens: int,
                 full_sequence: bool, per_instance_limit: int, default_slo_s: float = 60.0, max_resumes: int = 3,
                 dead_after_s: float = 5.0, park_s: float = 30.0, shed_over_capacity: bool = True,
                 on_batch: Callable[[dict, float], None] | None = None,
                 on_migration: Callable[[], None] | None = None,
                 on_arrival: Callable[[int, int], None] | None = None,
                 on_instances: Callable[[dict[int, int]], None] | None = None,
                 learning: LiveLearning | None = None, clock: Callable[[], float] = time.monotonic,
                 calibrate: bool = True, log_decisions: bool = False) -> None:
        """``per_instance_limit``: requests an instance may hold (slots, residents and its waiting
        queue); past it on every instance, new requests get 429. ``park_s``: while no instance is up,
        requests (new or resuming) wait this long for one to join, then get 503. ``shed_over_capacity``:
        a new request gets 429 when, with the work ahead of it, it cannot finish within its SLO even at
        the lowest thresholds (``Router.admissible``), so the admitted ones keep theirs. ``on_batch(batch, now)``
        sees every progress batch (control-path timing, metrics); ``on_arrival(prompt_tokens, max_tokens)``
        every accepted request (the planner's workload); ``on_instances({tp: count})`` the joined
        instances whenever one joins or leaves. ``learning``: the online predictors (``cluster.learning``), given
        every finished request's step rows and rounds. ``clock``: monotonic seconds (a test's own);
        ``calibrate``: scale the latency profiles by the rounds' measured times (``TpLatencyModel.calibrate``);
        ``log_decisions``: the cluster driver keeps its decisions (``driver.decisions``). ``driver``: the
        cluster as the debug views and tests read it (its views: ``serving``, ``instance``, ``request``,
        ``counters``, ``governor``...)."""
        self.decode, self.clock = decode, clock
        # what happens to requests and instances: the cluster simulator drives the same driver
        self.driver = ClusterDriver(router, block_tokens=block_tokens, full_sequence=full_sequence,
                                    shed=shed_over_capacity, calibrate=calibrate,
                                    per_instance_limit=per_instance_limit, log=log_decisions)
        # the router's policy chooses each step's threshold (Alg. 1), or every step takes the fixed one: the
        # policy's for the router's life, asked once
        self.chooses_thresholds = self.driver.chooses_thresholds
        self.block_tokens, self.full_sequence = block_tokens, full_sequence
        self.per_instance_limit, self.default_slo_s = per_instance_limit, default_slo_s
        self.max_resumes, self.dead_after_s, self.park_s = max_resumes, dead_after_s, park_s
        self.on_batch, self.on_migration = on_batch, on_migration
        self.on_arrival, self.on_instances = on_arrival, on_instances
        self.default_decoding = "threshold"  # the replicas' decoding rule, for requests that name none (the front's)
        self.learning = learning
        self.instances: dict[int, InstanceLink] = {}
        self.by_replica: dict[str, int] = {}
        self.live: dict[str, LiveRequest] = {}
        self._ids = itertools.count()
        self.stats = {"resumed": 0, "migrated": 0, "failed_over": 0, "instances_lost": 0, "shed": 0, "drained": 0,
                      "watchdog_errors": 0, "watchdog_restarts": 0}
        self._watchdog: asyncio.Task | None = None

    @property
    def parked(self) -> list[LiveRequest]:
        """Requests waiting for an instance to join."""
        return [self.live[s.req_id] for s in self.driver.held if s.req_id in self.live]

    # ---- instances ---------------------------------------------------------------------------
    def measured_profile(self, tp: int, data: dict) -> LatencyProfile | None:
        """A replica's own latency profile (measured at its start, sent when it registers): the router's for
        degree ``tp`` from now on, unless it is the one already in use. The attention term of the
        configured profile is kept when the measurement has none (it measures one prompt length).
        Returns the profile when it is new."""
        from engine.latency_profile import LatencyProfile

        prof = LatencyProfile.from_dict(data)
        if not self.driver.use_profile(tp, prof):
            return None
        log.info("TP-%d latency profile measured by a replica (%s)", tp, prof.meta.get("replica"))
        return prof

    async def connect(self, replica: str, tp: int, host: str, port: int, secret: str, meta: dict | None = None) -> int:
        """Open a replica's channel and add it to the router (idempotent per live replica)."""
        if replica in self.by_replica:
            inst = self.instances[self.by_replica[replica]]
            inst.last_seen = self.clock()
            return inst.inst_id
        link = await Link.open(host, port, secret)
        if replica in self.by_replica:  # registered twice while connecting
            link.close()
            return self.by_replica[replica]
        inst_id = self.attach(replica, tp, link, meta)
        log.info("instance %d (TP-%d, replica %s) joined at %s:%d", inst_id, tp, replica, host, port)
        return inst_id

    def attach(self, replica: str, tp: int, link, meta: dict | None = None, read: bool = True) -> int:
        """An instance joins over an open ``link``: the router takes it, the requests of draining instances
        and those waiting for one move to it; ``read``: start reading its progress (a test feeds
        ``handle_batch`` itself)."""
        inst_id = next(self._ids)
        inst = InstanceLink(inst_id, replica, tp, link, self.clock(), meta=dict(meta or {}))
        self.instances[inst_id] = inst
        self.by_replica[replica] = inst_id
        moves = self.driver.join(inst_id, tp, self.clock())
        if read:
            inst.task = asyncio.get_running_loop().create_task(self._read(inst))
            self._ensure_watchdog()
        self._forget_gone()
        self._instances_changed()
        self._execute(moves)
        return inst_id

    def drain(self, inst_id: int) -> None:
        """An instance is shutting down (redeploy, scale-down): nothing new goes to it, and its requests
        move to the other instances from their committed tokens (as a migration: no failure is counted),
        now if there is another instance, else when one joins; until then they go on where they are."""
        inst = self.instances.get(inst_id)
        if inst is not None and not inst.draining:
            inst.draining = True
            log.info("instance %d (replica %s) is draining", inst_id, inst.replica)
            now = self.clock()
            self.driver.drain(inst_id, now)
            moves = self.driver.evacuate(inst_id, now, keep_if_alone=True)
            self._forget_gone()
            self._execute(moves)

    def _forget_gone(self) -> None:
        """Close the links of the instances the driver let go (drained ones once their requests moved)."""
        gone = [i for i in self.instances.values() if self.driver.instance(i.inst_id) is None]
        for inst in gone:
            del self.instances[inst.inst_id]
            self.by_replica.pop(inst.replica, None)
            inst.link.close()  # the replica drops what this ingress sent it
        if gone:
            self._instances_changed()

    def drop(self, inst_id: int, reason: str = "lost") -> None:
        """An instance is gone: resume its requests elsewhere."""
        inst = self.instances.pop(inst_id, None)
        if inst is None:
            return
        self.by_replica.pop(inst.replica, None)
        inst.link.close()
        self.stats["instances_lost"] += 1
        self._instances_changed()
        log.warning("instance %d (replica %s) %s; resuming its requests", inst_id, inst.replica, reason)
        for state in self.driver.lost(inst_id, self.clock()):
            live = self.live.get(state.req_id)
            if live is not None:
                self.stats["failed_over"] += 1
                self._resume(live, None, f"its instance was {reason}")

    def _instances_changed(self) -> None:
        if self.on_instances is not None:
            counts: dict[int, int] = {}
            for inst in self.instances.values():
                counts[inst.tp] = counts.get(inst.tp, 0) + 1
            self.on_instances(counts)

    async def _read(self, inst: InstanceLink) -> None:
        while True:
            msg = await inst.link.recv()
            if msg is None:
                break
            inst.last_seen = self.clock()
            if isinstance(msg, ProgressBatch):
                try:
                    self.handle_batch(inst.inst_id, msg)
                except Exception:  # one bad batch must not stop the instance's stream
                    log.exception("handling a progress batch of instance %d failed", inst.inst_id)
            elif isinstance(msg, Tick):
                inst.stats = msg.stats
            elif isinstance(msg, Draining):
                self.drain(inst.inst_id)
            else:
                log.warning("instance %d sent a %s, which only an ingress sends", inst.inst_id, type(msg).__name__)
        if inst.inst_id in self.instances:
            self.drop(inst.inst_id, "disconnected")

    def _ensure_watchdog(self) -> None:
        """Start the watchdog task (silent instances, parked requests) unless it runs; one that ended
        (it should not: each pass is guarded) starts again, after ``WATCHDOG_RESTART_S``."""
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.get_running_loop().create_task(self._watch(), name="remask-watchdog")
            self._watchdog.add_done_callback(self._watchdog_ended)

    def _watchdog_ended(self, task: asyncio.Task) -> None:
        """However it ended (cancelled, an exception outside its guard), it starts again: an event loop that is
        closing drops the timer."""
        exc = None if task.cancelled() else task.exception()
        why = "cancelled" if task.cancelled() else "returned" if exc is None else repr(exc)
        log.log(logging.INFO if task.cancelled() else logging.ERROR, "the dispatcher's watchdog ended (%s); "
                "restarting it in %g s", why, WATCHDOG_RESTART_S, exc_info=exc)
        self.stats["watchdog_restarts"] += 1
        asyncio.get_running_loop().call_later(WATCHDOG_RESTART_S, self._ensure_watchdog)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.dead_after_s / 2))
            try:
                self._watch_once(self.clock())
            except Exception:  # one bad pass must not end dead-instance detection for good
                log.exception("a pass of the dispatcher's watchdog failed")
                self.stats["watchdog_errors"] += 1

    def _watch_once(self, now: float) -> None:
        """Drop the instances silent for over ``dead_after_s`` (each on its own: one that cannot be dropped
        does not shield the others), fail the requests parked too long."""
        for inst in list(self.instances.values()):
            if now - inst.last_seen > self.dead_after_s:
                try:
                    self.drop(inst.inst_id, f"silent for {now - inst.last_seen:.1f} s")
                except Exception:
                    log.exception("the watchdog could not drop instance %d", inst.inst_id)
                    self.stats["watchdog_errors"] += 1
        self._expire_parked(now)

    def _expire_parked(self, now: float) -> None:
        for live in self.parked:
            if now - live.parked_at > self.park_s:
                self._fail(live, 503, f"no model instance joined within {self.park_s:.0f} s")

    # ---- requests ------------------------------------------------------------------------------
    def submit(self, req_id: str, prompt_ids: list[int], max_tokens: int, *, prompt_text: str = "",
               threshold: float | None = None, slo_ms: float | None = None, priority: int = 0,
               sampling: dict | None = None, stop: list[str] | tuple[str, ...] = (),
               canvas: bool = False) -> RequestStream:
        """A new request: its prompt's token ids; ``prompt_text`` (the client's text: the admission
        predictor's features); ``sampling``: the engine's ``SamplingParams`` fields beyond max_tokens and
        threshold (temperature, top_p, top_k, seed, stop_token_ids) — a request that samples should carry a
        seed, so that a resume elsewhere decodes as it would have; ``stop``: strings that end the text;
        ``canvas``: a ``canvas`` event per denoising step (positions committed, still masked, threshold)."""
        prompt_tokens = len(prompt_ids)
        if req_id in self.live:
            raise DispatchError(400, f"duplicate request id {req_id!r}")
        try:
            params = SamplingParams.from_dict(sampling)
            step_cap = request_step_cap(params.decoding_config)  # a canvas request's own: the router's prior
        except ValueError as exc:
            raise DispatchError(400, str(exc)) from None
        if not self.instances and (self.park_s <= 0 or len(self.driver.held) >= self.per_instance_limit):
            raise DispatchError(503, "no model instance is ready; retry shortly")
        if self.instances and self.driver.full():
            raise DispatchError(429, f"every instance holds {self.per_instance_limit} requests")
        now = self.clock()
        if self.on_arrival is not None:
            self.on_arrival(prompt_tokens, max_tokens)
        # the governor counts a request whose SLO the client set; a client-fixed threshold is never the router's;
        # the admission predictor's prompt features (predictors.features.ADMISSION_FEATURES, less the threshold)
        admission = self.driver.arrive(Arrival(
            req_id, prompt_tokens, -(-max_tokens // self.block_tokens) * self.block_tokens,
            slo_ms / 1000.0 if slo_ms is not None else self.default_slo_s, priority, fixed_threshold=threshold,
            counted=slo_ms is not None, decoding=params.decoding or self.default_decoding,
            constrained=constraint_value(params.constraint), step_cap=step_cap,
            admission=(float(len(prompt_text.split())), float(prompt_text.count("\n")), float(prompt_tokens))), now)
        if admission.shed:
            self.stats["shed"] += 1
            raise DispatchError(429, "over capacity: with the requests ahead of it, this one cannot finish "
                                     "within its SLO even at the lowest threshold; retry later")
        live = LiveRequest(req_id, list(prompt_ids), max_tokens, admission.state, asyncio.Queue(), now,
                           OutputText(self.decode, stop), params, canvas)
        self.live[req_id] = live
        if admission.move is not None:
            self._execute([admission.move])
        else:  # no instance serves yet (starting, between a reconfiguration's stops and starts, a redeploy)
            self._park(live)
        return RequestStream(self.cancel, live)

    def _park(self, live: LiveRequest) -> None:
        """A request the driver holds until an instance joins (``park_s`` at most, then 503)."""
        live.parked_at = self.clock()
        self._ensure_watchdog()

    def _execute(self, moves: list[Move]) -> None:
        """Carry out the driver's moves: abort on the instance a request leaves, send it to its new one from
        its committed tokens (no KV travels). A move that an earlier one overtook (its request moved on
        since: an instance that broke mid-way) is dropped."""
        for m in moves:
            live = self.live.get(m.state.req_id)
            if live is None or m.attempt != m.state.attempt:
                continue
            if m.why == "migrate":
                if m.src in self.instances:
                    self.instances[m.src].link.send(Abort(live.req_id))
                self.stats["migrated"] += 1
                if self.on_migration is not None:
                    self.on_migration()
            elif m.why == "evacuate":
                self.stats["drained"] += 1
            self._send_add(live, m)

    def cancel(self, req_id: str) -> None:
        live = self.live.pop(req_id, None)
        if live is None:
            return
        inst_id = live.state.instance
        self.driver.cancelled(live.state)
        if inst_id is not None and inst_id in self.instances:
            self.instances[inst_id].link.send(Abort(req_id))

    def _send_add(self, live: LiveRequest, move: Move) -> None:
        now = self.clock()
        live.sent_threshold = move.threshold
        ok = self.instances[move.dst].link.send(Add(
            live.req_id, live.prompt_ids,
            dataclasses.replace(live.sampling, max_tokens=live.max_tokens, threshold=move.threshold),
            slo_left_s=live.state.deadline - now, sent_at=time.time(), committed=live.committed, resume=live.resume,
            canvas=live.canvas,
            # the router's estimate of its remaining denoising rounds: the instance scheduler's r_i (DWISE)
            est_rounds=move.est_rounds, planned=self._planned(live), attempt=move.attempt))
        if not ok:  # its channel just broke: the reader's drop resumes it, or do it now
            self.drop(move.dst, "unreachable")

    def _resume(self, live: LiveRequest, exclude: int | None, why: str) -> None:
        """Send an active request (unplaced in the router) to another instance from its committed tokens."""
        live.resumes += 1
        if live.resumes > self.max_resumes:
            return self._fail(live, 500, f"request failed on {live.resumes} instances ({why})")
        if len(live.committed) >= live.max_tokens:  # it had finished everything but its done message
            self.driver.finished(live.state, self.clock())
            return self._finish(live, Done("length", live.state.steps_done, len(live.committed)), None)
        move = self.driver.resume(live.state, self.clock(), exclude)
        if move is None:
            if self.park_s <= 0 or self.instances:  # the only other instance refused it, or waiting is off
                return self._fail(live, 503, f"{why} and no other instance is available")
            self.stats["resumed"] += 1
            return self._park(live)  # the driver holds it: the next instance to join takes it
        self.stats["resumed"] += 1
        self._send_add(live, move)

    def _fail(self, live: LiveRequest, status: int, message: str) -> None:
        self.live.pop(live.req_id, None)
        self.driver.cancelled(live.state)
        live.queue.put_nowait({"type": "error", "status": status, "message": message,
                               "accepted": live.accepted})

    def _finish(self, live: LiveRequest, done: Done, tp: int | None) -> None:
        """Its done event (the driver has let it go); ``tp``: the degree of the instance it finished on."""
        self.live.pop(live.req_id, None)
        now = self.clock()
        live.emit(live.out.finish(), now)  # held-back text: an unfinished character, a stop's prefix
        if self.learning is not None and done.finish_reason in ("stop", "length") and live.denoise_steps:
            st = live.state
            self.learning.finished(live.rows, live.row_steps, live.denoise_steps,
                                   [*st.extra["admission"], st.thresholds_used.mean or live.sent_threshold or 0.9],
                                   st.output_tokens / st.block_tokens, st.threshold, decoding=st.decoding,
                                   constrained=st.constrained)
        used = live.state.thresholds_used
        live.queue.put_nowait({
            "type": "done", "finish_reason": done.finish_reason, "text": live.out.text,
            "prompt_tokens": live.state.prompt_tokens, "completion_tokens": len(live.committed),
            "rounds": live.state.steps_done, "ttft_s": (live.first_token or now) - live.arrival,
            "e2e_s": now - live.arrival, "queue_s": (live.first_step or now) - live.arrival,
            "threshold": used.mean if used else live.sent_threshold,
            "migrations": live.state.migrations, "resumes": live.resumes,
            # for the planner's measured inputs: the budget, the SLO, the denoising steps and the TP degree
            "max_tokens": live.max_tokens, "slo_s": live.state.deadline - live.state.arrival,
            "denoise_steps": max(live.denoise_steps, 1), "tp": tp,
            **({"token_ids": list(live.committed), "logprobs": list(live.logprobs)} if live.sampling.logprobs
               else {})})

    # ---- progress ----------------------------------------------------------------------------------
    def handle_batch(self, inst_id: int, batch: ProgressBatch) -> None:
        now = self.clock()
        inst = self.instances.get(inst_id)
        if inst is None:
            return
        inst.stats = batch.stats
        if self.on_batch is not None:
            self.on_batch(batch, now)
        stepped, finished = [], []
        for item in batch.items:
            live = self.live.get(item.req_id)
            if live is None or live.state.instance != inst_id or item.attempt != live.state.attempt:
                continue  # finished, cancelled, or moved away since (it may be back, as a later attempt): stale
            if type(item) is StepItem:
                done = self._item_step(live, item, now, inst)
                stepped.append((live.state, item.heavy, done is not None))
                if done is not None:
                    finished.append((live, done))
            elif type(item) is ErrorItem:
                self._item_error(live, inst_id, item)
            elif not live.accepted:  # an AcceptedItem
                live.accepted = True
                live.queue.put_nowait({"type": "accepted", "add_ms": item.add_ms})
        if not stepped:
            return
        # one call into the cluster, answered whole: the router's step event (the profile calibrated under this
        # deployment's real load), the finished requests let go, the policy's migrations (the admission
        # governor told at once of a request past its deadline), and the instance's new plan
        outcome = self.driver.on_round(inst_id, stepped, now, inst.effective_round_ms(batch), batch.kinds)
        for live, done in finished:
            self._finish(live, done, inst.tp)
        self._execute(outcome.moves)
        self._answer_round(inst_id, outcome.plan, batch.round)

    def _item_step(self, live: LiveRequest, item: StepItem, now: float, inst: InstanceLink) -> Done | None:
        done, cut = live.take_step(item, now, inst, self.decode, self.full_sequence, self.block_tokens)
        if cut and live.state.instance in self.instances:  # a stop string ended the text: the rest is not wanted
            self.instances[live.state.instance].link.send(Abort(live.req_id))
        return done

    def _item_error(self, live: LiveRequest, inst_id: int, item: ErrorItem) -> None:
        if item.status == 429:  # that instance's queue is full: another one, else shed
            if len(self.driver.serving()) > 1 and live.resumes < self.max_resumes:
                return self._resume(live, inst_id, "its instance was full")
            return self._fail(live, 429, f"server overloaded: {item.message}")
        if item.status == 503:  # the instance's rounds failed and it gave the request up (engine/loop.py): not the
            # request's fault; another instance, or this one again when it is the only one (``max_resumes`` bounds it)
            alone = all(i == inst_id for i in self.driver.serving())
            return self._resume(live, None if alone else inst_id, f"its instance gave it up ({item.message})")
        self._fail(live, item.status, item.message)

    def _planned(self, live: LiveRequest) -> bool:
        """Whether the router chooses the request's thresholds: then every batch carrying it is answered
        (``_plan``), and its instance waits a little for the answer before its next round."""
        return self.chooses_thresholds and live.state.fixed_threshold is None

    def _answer_round(self, inst_id: int, plan: Plan, after_round: int | None = None) -> None:
        """Answer an instance's progress batch (of round ``after_round``) with the driver's plan: the thresholds
        of its requests' next steps where the router chooses them (those that changed), and the router's
        estimates of their remaining denoising rounds (the instance scheduler's r_i). Sent for every batch
        while the instance holds a request whose thresholds the router chooses (its loop waits for the
        answer)."""
        if not self.chooses_thresholds or inst_id not in self.instances:
            return
        if not plan.thresholds:
            return
        changed = {}
        for req_id, t in plan.thresholds.items():
            live = self.live.get(req_id)
            if live is not None and t != live.sent_threshold:
                changed[req_id] = t
                live.sent_threshold = t
        estimates = {r: round(e, 2) for r, e in plan.estimates.items()}
        self.instances[inst_id].link.send(Thresholds(changed, estimates, after_round))

    # ---- views -----------------------------------------------------------------------------------
    def describe(self) -> dict:
        return {str(i.inst_id): {"replica": i.replica, "tp": i.tp, "requests": self.driver.instance(i.inst_id).n,
                                 **i.meta, **i.stats} for i in self.instances.values()}
