"""One instance behind its control channel: the replica side of ``app.channel``.

``ReplicaServer`` joins a ``RoundLoop`` (the instance's rounds, in their own
thread) to a ``ReplicaChannel``: commands from the ingress become round-loop
commands, each round's progress batch becomes one frame, and a lost ingress
aborts every request it had sent. Several ingresses may be connected (a
redeploy's old and new ingress): each receives only its own requests'
progress. A broken instance (``InstanceBroken``) hangs up, so the ingress
resumes its requests on the other instances; a replica shutting down
(``drain``) first tells its ingresses, which move its requests elsewhere.
The Denoiser deployment is this plus model loading and registration; tests
run it in-process.

Commands (beyond ``abort``):

- ``{"op": "add", "id", "prompt_ids" | "prompt", "max_tokens", "threshold", "slo_left_s", "sent_at",
  "committed", "sampling", "canvas", "est_rounds", "planned"}``: ``est_rounds`` (optional) is the
  router's estimate of the request's remaining denoising rounds (at its threshold), which replaces the
  instance's admission estimate; ``planned: true`` promises a ``thresholds`` answer to every batch
  carrying the request (the loop waits a little for it before its next round: engine/loop.py).
- ``{"op": "thresholds", "map": {id: threshold}, "estimates": {id: remaining rounds},
  "after_round": n}``: both maps optional; ``after_round`` is the ``round`` of the batch the message
  answers (the estimates are as of that round's end).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable

from app.channel import ReplicaChannel
from engine.instance import Instance
from engine.loop import Overloaded, RoundLoop
from engine.sequence import SamplingParams

log = logging.getLogger(__name__)


class ReplicaServer:
    def __init__(self, instance: Instance, *, max_waiting: int = 256, describe: Callable | None = None,
                 host: str = "127.0.0.1", tick_s: float = 1.0, **loop_kwargs) -> None:
        """``loop_kwargs``: the round loop's (e.g. ``threshold_wait_s``, ``threshold_wait_frac``)."""
        self.loop = RoundLoop(instance, self._publish, max_waiting=max_waiting, describe=describe,
                              on_fatal=self._broken, **loop_kwargs)
        self._owner: dict[str, int] = {}  # request id -> the connection (ingress) that sent it
        self._lock = threading.Lock()
        self.draining = False
        self.channel = ReplicaChannel(self._command, self._disconnected, secrets.token_hex(16), host=host,
                                      tick_s=tick_s, stats=self.loop.stats)

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
        self.channel.broadcast({"op": "draining"})
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

    def _publish(self, batch: dict) -> None:  # round-loop thread
        """Each ingress gets the round's items of its own requests (and the instance's stats)."""
        by_conn: dict[int, list[dict]] = {}
        with self._lock:
            for item in batch["items"]:
                owner = self._owner.get(item["id"])
                if owner is None:
                    continue  # its ingress went away
                by_conn.setdefault(owner, []).append(item)
                if "error" in item or item.get("done"):
                    del self._owner[item["id"]]
        for conn_id, items in by_conn.items():
            self.channel.send(conn_id, {**batch, "op": "batch", "items": items})

    def _command(self, conn_id: int, msg: dict) -> None:  # channel reader thread
        op = msg.get("op")
        try:
            if op == "add":
                self._add(conn_id, msg)
            elif op == "abort":
                if self._owns(conn_id, str(msg["id"]), release=True):
                    self.loop.abort(str(msg["id"]))
            elif op == "thresholds":
                after = msg.get("after_round")
                self.loop.set_thresholds({str(k): float(v) for k, v in (msg.get("map") or {}).items()
                                          if self._owns(conn_id, str(k))},
                                         {str(k): float(v) for k, v in (msg.get("estimates") or {}).items()
                                          if self._owns(conn_id, str(k))},
                                         None if after is None else int(after))
            else:
                log.warning("control channel: unknown op %r", op)
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("control channel: malformed %r message (%s)", op, exc)

    def _owns(self, conn_id: int, rid: str, release: bool = False) -> bool:
        with self._lock:
            mine = self._owner.get(rid) == conn_id
            if mine and release:
                del self._owner[rid]
            return mine

    def _add(self, conn_id: int, msg: dict) -> None:
        rid = str(msg["id"])
        with self._lock:
            if rid in self._owner:  # ids are the ingress's; another ingress's request keeps its own
                owner = self._owner[rid]
            else:
                owner = self._owner[rid] = conn_id
        if owner != conn_id:  # straight to the sender: the loop's own reject would reach the owner
            items = [{"id": rid, "error": "duplicate request id", "status": 400}]
            self.channel.send(conn_id, {**self.loop.batch(items), "op": "batch"})
            return
        if self.draining:
            return self.loop.reject(rid, "this replica is shutting down", 429)
        try:
            params = sampling_params(msg)
            prompt = [int(i) for i in msg["prompt_ids"]] if "prompt_ids" in msg else str(msg["prompt"])
            left = msg.get("slo_left_s")
            est = msg.get("est_rounds")
            self.loop.submit(rid, prompt, params, None if left is None else time.monotonic() + left,
                             sent_at=msg.get("sent_at"), committed=msg.get("committed") or None,
                             canvas=bool(msg.get("canvas")), est_rounds=None if est is None else float(est),
                             planned=bool(msg.get("planned")))
        except Overloaded as exc:
            self.loop.reject(rid, f"server overloaded: {exc}", 429)
        except (KeyError, TypeError, ValueError) as exc:  # its error item releases the id
            self.loop.reject(rid, f"malformed request: {exc}", 400)


SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed")


def sampling_params(msg: dict) -> SamplingParams:
    """The engine's parameters of an ``add`` message: max_tokens, threshold, and its ``sampling`` section
    (temperature, top_p, top_k, seed, stop_token_ids; absent ones keep the engine's defaults)."""
    sampling = msg.get("sampling") or {}
    unknown = set(sampling) - {*SAMPLING_FIELDS, "stop_token_ids"}
    if unknown:
        raise ValueError(f"unknown sampling fields {sorted(unknown)}")
    extra = {k: sampling[k] for k in SAMPLING_FIELDS if sampling.get(k) is not None}
    if sampling.get("stop_token_ids"):
        extra["stop_token_ids"] = tuple(int(i) for i in sampling["stop_token_ids"])
    return SamplingParams(max_tokens=msg.get("max_tokens"), threshold=msg.get("threshold"), **extra)
