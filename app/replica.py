"""One instance behind its control channel: the replica side of ``app.channel``.

``ReplicaServer`` joins a ``RoundLoop`` (the instance's rounds, in their own
thread) to a ``ReplicaChannel``: commands from the ingress become round-loop
commands, each round's progress batch becomes one frame, and a lost ingress
aborts every request it had sent. Several ingresses may be connected (a
redeploy's old and new ingress): each receives only its own requests'
progress. Publishing a batch only queues its frames (app/channel.py): an
ingress that stops reading is dropped, as a lost one, and never stalls the
round loop for the others. A request the loop gives up on after failed rounds
(an ``ErrorItem`` 503, engine/loop.py) is resumed elsewhere by its ingress. A
broken instance (``InstanceBroken``) hangs up, so the ingress resumes its
requests on the other instances; a replica shutting down
(``drain``) first tells its ingresses, which move its requests elsewhere.
The Denoiser deployment is this plus model loading and registration; tests
run it in-process.

Commands (``app.protocol``, the engine's own: engine/commands.py, handed to the loop as they are): ``Add``
(its ``params``, the engine's ``SamplingParams`` with its decoding rule; its ``est_rounds``, the router's
estimate of its remaining denoising rounds, replaces the instance's admission estimate; ``planned``
promises a ``Thresholds`` answer to every batch carrying the request: the loop waits a little for it before
its next round, engine/loop.py), ``Abort``, and ``Thresholds`` (``after_round`` is the ``round`` of the
batch the message answers; its estimates are as of that round's end). A connection acts only on the requests it sent.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Callable

from app.channel import ReplicaChannel
from app.protocol import ADD, Abort, Add, Draining, ErrorItem, Message, ProgressBatch, ProtocolError, Thresholds
from engine.instance import Instance
from engine.loop import Overloaded, RoundLoop

log = logging.getLogger(__name__)


class ReplicaServer:
    def __init__(self, instance: Instance, *, max_waiting: int = 256, describe: Callable | None = None,
                 host: str = "127.0.0.1", tick_s: float = 1.0, send_timeout_s: float = 10.0,
                 queue_frames: int = 1024, **loop_kwargs) -> None:
        """``loop_kwargs``: the round loop's (e.g. ``threshold_wait_s``, ``threshold_wait_frac``,
        ``max_round_failures``, ``broken_after``). ``send_timeout_s``, ``queue_frames``: the channel's bounds on
        an ingress that stops reading (app/channel.py): past them its connection is dropped and the round
        loop goes on for the others."""
        self.loop = RoundLoop(instance, self._publish, max_waiting=max_waiting, describe=describe,
                              on_fatal=self._broken, **loop_kwargs)
        self._owner: dict[str, int] = {}  # request id -> the connection (ingress) that sent it
        self._lock = threading.Lock()
        self.draining = False
        self.channel = ReplicaChannel(self._command, self._disconnected, secrets.token_hex(16), host=host,
                                      tick_s=tick_s, stats=self.loop.stats, on_invalid=self._invalid,
                                      send_timeout_s=send_timeout_s, queue_frames=queue_frames)

    def info(self) -> dict:
        """What the ingress needs to connect (sent to it over Ray when registering)."""
        host, port = self.channel.address
        return {"host": host, "port": port, "secret": self.channel.secret}

    def close(self) -> None:
        self.channel.close()
        self.loop.stop()

    def drain(self, timeout_s: float) -> int:
        """Shutting down (a redeploy, a scale-down): tell every ingress to send nothing new and to move
        what it can elsewhere; wait up to ``timeout_s`` for the requests still here to finish. Returns how
        many were left (the ingress resumes those elsewhere when this replica hangs up)."""
        self.draining = True
        self.channel.broadcast(Draining())
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self._owner and self.loop.broken is None:
            time.sleep(0.05)
        with self._lock:
            return len(self._owner)

    def _broken(self, exc: Exception) -> None:  # round-loop thread, which has ended
        """The instance can run no more rounds: hang up, so the ingress resumes its requests elsewhere
        (they are not failed here), and refuse new connections."""
        self.channel.close()

    def _disconnected(self, conn_id: int) -> None:  # an ingress is gone: nobody receives its requests
        with self._lock:
            gone = [rid for rid, owner in self._owner.items() if owner == conn_id]
            for rid in gone:
                del self._owner[rid]
        for rid in gone:
            self.loop.abort(rid)

    def _publish(self, batch: ProgressBatch) -> None:  # round-loop thread
        """Each ingress gets the round's items of its own requests (and the instance's stats)."""
        by_conn: dict[int, list] = {}
        with self._lock:
            for item in batch.items:
                owner = self._owner.get(item.req_id)
                if owner is None:
                    continue  # its ingress went away
                by_conn.setdefault(owner, []).append(item)
                if type(item) is ErrorItem or getattr(item, "done", None) is not None:
                    del self._owner[item.req_id]
        for conn_id, items in by_conn.items():
            self.channel.send(conn_id, dataclasses.replace(batch, items=items))

    def _command(self, conn_id: int, msg: Message) -> None:  # channel reader thread
        if isinstance(msg, Add):
            self._add(conn_id, msg)
        elif isinstance(msg, Abort):
            if self._owns(conn_id, msg.req_id, release=True):
                self.loop.abort(msg.req_id)
        elif isinstance(msg, Thresholds):
            self.loop.set_thresholds({k: float(v) for k, v in msg.map.items() if self._owns(conn_id, k)},
                                     {k: float(v) for k, v in msg.estimates.items() if self._owns(conn_id, k)},
                                     msg.after_round)
        else:
            log.warning("control channel: an ingress sent a %s, which only a replica sends", type(msg).__name__)

    def _invalid(self, conn_id: int, exc: ProtocolError) -> None:  # channel reader thread
        """A frame that is no message: refuse the request of a malformed add (its sender would wait for it
        forever), once the id is known to be this connection's."""
        if exc.op == ADD and exc.req_id is not None:
            self._refuse_add(conn_id, exc.req_id, f"malformed request: {exc}", 400)

    def _owns(self, conn_id: int, rid: str, release: bool = False) -> bool:
        with self._lock:
            mine = self._owner.get(rid) == conn_id
            if mine and release:
                del self._owner[rid]
            return mine

    def _claim(self, conn_id: int, rid: str) -> bool:
        """Record ``conn_id`` as the sender of request ``rid``; False (and an error to it) when another
        connection's request has that id (ids are the ingress's; the other one keeps its own)."""
        with self._lock:
            owner = self._owner.setdefault(rid, conn_id)
        if owner != conn_id:  # straight to the sender: the loop's own reject would reach the owner
            self.channel.send(conn_id, self.loop.batch([ErrorItem(rid, "duplicate request id", 400)]))
        return owner == conn_id

    def _refuse_add(self, conn_id: int, rid: str, message: str, status: int, attempt: int = 0) -> None:
        if self._claim(conn_id, rid):
            self.loop.reject(rid, message, status, attempt)  # its error item releases the id

    def _add(self, conn_id: int, msg: Add) -> None:
        rid = msg.req_id
        if self.draining:
            return self._refuse_add(conn_id, rid, "this replica is shutting down", 429, msg.attempt)
        if not self._claim(conn_id, rid):
            return
        if msg.params.constraint is not None:  # compiled here (once per schema), not in the round loop
            from engine.constraints.canvas import engine_grammar

            try:
                engine_grammar(self.loop.instance.engine, msg.params.constraint)
            except Exception as exc:  # a constraint this replica cannot compile: refused, the channel goes on
                return self.loop.reject(rid, f"malformed request: constraint: {exc}", 400, msg.attempt)
        try:
            self.loop.put(msg)  # the engine's own command (engine/commands.py): its deadline from slo_left_s
        except Overloaded as exc:
            self.loop.reject(rid, f"server overloaded: {exc}", 429, msg.attempt)
        except (TypeError, ValueError) as exc:  # its error item releases the id
            self.loop.reject(rid, f"malformed request: {exc}", 400, msg.attempt)

