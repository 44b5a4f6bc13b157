"""One instance behind its control channel: the replica side of ``app.channel``.

``ReplicaServer`` joins a ``RoundLoop`` (the instance's rounds, in their own
thread) to a ``ReplicaChannel``: commands from the ingress become round-loop
commands, each round's progress batch becomes one frame, and a lost ingress
aborts every request it had sent. A broken instance (``InstanceBroken``)
hangs up, so the ingress resumes its requests on the other instances. The Denoiser deployment is this plus model
loading and registration; tests run it in-process.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable

from app.channel import ReplicaChannel
from engine.instance import Instance
from engine.loop import Overloaded, RoundLoop
from engine.sequence import SamplingParams

log = logging.getLogger(__name__)


class ReplicaServer:
    def __init__(self, instance: Instance, *, max_waiting: int = 256, describe: Callable | None = None,
                 host: str = "127.0.0.1", tick_s: float = 1.0) -> None:
        self.loop = RoundLoop(instance, self._publish, max_waiting=max_waiting, describe=describe,
                              on_fatal=self._broken)
        self.channel = ReplicaChannel(self._command, self.loop.abort_all, secrets.token_hex(16), host=host,
                                      tick_s=tick_s, stats=self.loop.stats)

    def info(self) -> dict:
        """What the ingress needs to connect (sent to it over Ray when registering)."""
        host, port = self.channel.address
        return {"host": host, "port": port, "secret": self.channel.secret}

    def close(self) -> None:
        self.channel.close()
        self.loop.stop()

    def _broken(self, exc: Exception) -> None:  # round-loop thread, which has ended
        """The instance can run no more rounds: hang up, so the ingress resumes its requests elsewhere
        (they are not failed here), and refuse new connections."""
        self.channel.close()

    def _publish(self, batch: dict) -> None:  # round-loop thread
        batch["op"] = "batch"
        self.channel.send(batch)

    def _command(self, msg: dict) -> None:  # channel reader thread
        op = msg.get("op")
        try:
            if op == "add":
                self._add(msg)
            elif op == "abort":
                self.loop.abort(str(msg["id"]))
            elif op == "thresholds":
                self.loop.set_thresholds({str(k): float(v) for k, v in msg["map"].items()})
            else:
                log.warning("control channel: unknown op %r", op)
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("control channel: malformed %r message (%s)", op, exc)

    def _add(self, msg: dict) -> None:
        rid = str(msg["id"])
        params = SamplingParams(max_tokens=msg.get("max_tokens"), threshold=msg.get("threshold"))
        left = msg.get("slo_left_s")
        try:
            self.loop.submit(rid, msg["prompt"], params, None if left is None else time.monotonic() + left,
                             sent_at=msg.get("sent_at"), committed=msg.get("committed") or None)
        except Overloaded as exc:
            self.loop.reject(rid, f"server overloaded: {exc}", 429)
