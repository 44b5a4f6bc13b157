"""The control channel between the ingress and one Denoiser replica.

One TCP connection per replica carries control messages in (add, abort,
thresholds) and one progress batch per round out. Ray Serve handle calls cost
milliseconds each (a streaming item per request per round measured 7-8 ms at
the median on 2 cores); a frame on an open socket costs tens of
microseconds, written by the round loop the moment a round ends.

Frames are a 4-byte big-endian length and a JSON object: no code ever runs
from what arrives (unlike pickle), and a frame above ``MAX_FRAME`` closes the
connection. The ingress proves itself with the replica's secret, which it
learns over Ray when the replica registers; a wrong one is dropped.

The replica side (``ReplicaChannel``) is plain threads, so a busy round loop
never waits on an event loop; the ingress side (``Link``) is asyncio.
Every ``tick_s`` the replica sends a tick with its stats: the ingress declares
a replica dead when its socket closes or its ticks stop.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)
HEADER = struct.Struct("!I")
MAX_FRAME = 64 << 20


class ChannelError(Exception):
    """A malformed or oversized frame, or a failed handshake."""


def encode(msg: dict) -> bytes:
    body = json.dumps(msg, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME:
        raise ChannelError(f"frame of {len(body)} bytes exceeds {MAX_FRAME}")
    return HEADER.pack(len(body)) + body


def _decode(body: bytes) -> dict:
    msg = json.loads(body)
    if not isinstance(msg, dict):
        raise ChannelError("a frame must hold a JSON object")
    return msg


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _hang_up(sock: socket.socket) -> None:
    """Close now: shutdown sends the FIN and wakes a thread blocked in recv (close alone does neither
    while another thread is inside a call on the socket)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def recv_frame(sock: socket.socket) -> dict | None:
    """One frame from a blocking socket; None at a clean end of stream."""
    head = _recv_exact(sock, HEADER.size)
    if head is None:
        return None
    (n,) = HEADER.unpack(head)
    if n > MAX_FRAME:
        raise ChannelError(f"frame of {n} bytes exceeds {MAX_FRAME}")
    body = _recv_exact(sock, n)
    if body is None:
        return None
    return _decode(body)


class ReplicaChannel:
    """Replica side: listens for the ingress, one connection at a time (a new one replaces the old).

    ``on_command(msg)`` runs on the reader thread for every frame after the handshake;
    ``on_disconnect()`` runs once when the current ingress connection is lost or replaced
    (its requests have no receiver any more).
    """

    def __init__(self, on_command: Callable[[dict], None], on_disconnect: Callable[[], None], secret: str,
                 host: str = "127.0.0.1", port: int = 0, tick_s: float = 1.0,
                 stats: Callable[[], dict] | None = None) -> None:
        self.on_command, self.on_disconnect = on_command, on_disconnect
        self.secret, self.tick_s, self.stats = secret, tick_s, stats
        self._server = socket.create_server((host, port))
        self.address = (host, self._server.getsockname()[1])
        self._conn: socket.socket | None = None
        self._lock = threading.Lock()  # guards _conn and serialises writes
        self._closed = threading.Event()
        self.last_peer = 0.0  # monotonic time a peer was last connected (the replica re-registers when stale)
        threading.Thread(target=self._accept, name="remask-channel-accept", daemon=True).start()
        threading.Thread(target=self._tick, name="remask-channel-tick", daemon=True).start()

    @property
    def connected(self) -> bool:
        return self._conn is not None

    def send(self, msg: dict) -> bool:
        """Write one frame (any thread); False when no ingress is connected or the write failed."""
        frame = encode(msg)
        with self._lock:
            conn = self._conn
            if conn is None:
                return False
            try:
                conn.sendall(frame)
                self.last_peer = time.monotonic()
                return True
            except OSError:
                pass
        self._drop(conn)
        return False

    def close(self) -> None:
        self._closed.set()
        _hang_up(self._server)
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            _hang_up(conn)

    # ---- threads ---------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="remask-channel-reader", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            conn.settimeout(10)
            hello = recv_frame(conn)
            if not hello or hello.get("op") != "hello" or not hmac.compare_digest(str(hello.get("secret", "")),
                                                                                   self.secret):
                log.warning("control channel: refused a peer without the replica's secret")
                conn.close()
                return
            conn.settimeout(None)
        except (OSError, ValueError, ChannelError):
            conn.close()
            return
        with self._lock:
            old, self._conn = self._conn, conn
            self.last_peer = time.monotonic()
        if old is not None:  # a restarted ingress: the old one's requests have no receiver
            _hang_up(old)
            self.on_disconnect()
        self.send({"op": "ready"})
        try:
            while True:
                msg = recv_frame(conn)
                if msg is None:
                    break
                self.on_command(msg)
        except (OSError, ValueError, ChannelError) as exc:
            log.warning("control channel: connection dropped (%s)", exc)
        self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        with self._lock:
            current = self._conn is conn
            if current:
                self._conn = None
        _hang_up(conn)
        if current:
            self.on_disconnect()

    def _tick(self) -> None:
        while not self._closed.wait(self.tick_s):
            if self._conn is not None:
                self.send({"op": "tick", "t": time.time(), "stats": self.stats() if self.stats else {}})


class Link:
    """Ingress side of one replica's channel (asyncio)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.closed = False

    @classmethod
    async def open(cls, host: str, port: int, secret: str, timeout_s: float = 10.0) -> Link:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        link = cls(reader, writer)
        link.send({"op": "hello", "secret": secret})
        first = await asyncio.wait_for(link.recv(), timeout_s)
        if first is None or first.get("op") != "ready":
            link.close()
            raise ChannelError(f"replica at {host}:{port} refused the handshake")
        return link

    def send(self, msg: dict) -> bool:
        if self.closed:
            return False
        try:
            self.writer.write(encode(msg))
            return True
        except (OSError, RuntimeError):
            self.close()
            return False

    async def recv(self) -> dict | None:
        """The next frame; None when the replica is gone."""
        try:
            head = await self.reader.readexactly(HEADER.size)
            (n,) = HEADER.unpack(head)
            if n > MAX_FRAME:
                raise ChannelError(f"frame of {n} bytes exceeds {MAX_FRAME}")
            return _decode(await self.reader.readexactly(n))
        except (asyncio.IncompleteReadError, ConnectionError, OSError, ValueError, ChannelError):
            self.close()
            return None

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.writer.close()
            except (OSError, RuntimeError):
                pass
