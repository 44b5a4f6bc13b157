"""The control channel between the ingress and one Denoiser replica.

A TCP connection from the ingress to each replica carries control messages in
(add, abort, thresholds) and one progress batch per round out (the messages:
``app.protocol``). A replica
accepts several ingress connections (during a redeploy the old ingress drains
while the new one serves); each owns the requests it sent. Ray Serve handle calls cost
milliseconds each (a streaming item per request per round measured 7-8 ms at
the median on 2 cores); a frame on an open socket costs tens of
microseconds, written by the round loop the moment a round ends.

Frames are a 4-byte big-endian length and a message as ``app.protocol`` encodes
it (a JSON object): no code ever runs from what arrives (unlike pickle), and a
frame above ``MAX_FRAME`` closes the connection; a frame that is no message of
the protocol is logged and skipped. The ingress proves itself with the replica's secret, which it
learns over Ray when the replica registers; a wrong one is dropped.

The replica side (``ReplicaChannel``) is plain threads, so a busy round loop
never waits on an event loop; the ingress side (``Link``) is asyncio.
Every ``tick_s`` the replica sends a tick with its stats: the ingress declares
a replica dead when its socket closes or its ticks stop.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable

from app import protocol
from app.protocol import VERSION, Hello, Message, ProtocolError, Ready, Tick

log = logging.getLogger(__name__)
HEADER = struct.Struct("!I")
MAX_FRAME = 64 << 20


class ChannelError(Exception):
    """An oversized frame, or a failed handshake."""


def frame(msg: Message) -> bytes:
    """One frame: the length header and ``msg`` encoded."""
    body = protocol.encode(msg)
    if len(body) > MAX_FRAME:
        raise ChannelError(f"frame of {len(body)} bytes exceeds {MAX_FRAME}")
    return HEADER.pack(len(body)) + body


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


def recv_frame(sock: socket.socket) -> Message | None:
    """One message from a blocking socket; None at a clean end of stream (``ProtocolError``: a frame that
    holds none)."""
    head = _recv_exact(sock, HEADER.size)
    if head is None:
        return None
    (n,) = HEADER.unpack(head)
    if n > MAX_FRAME:
        raise ChannelError(f"frame of {n} bytes exceeds {MAX_FRAME}")
    body = _recv_exact(sock, n)
    if body is None:
        return None
    return protocol.decode(body)


class ReplicaChannel:
    """Replica side: listens for ingresses. Several may be connected at once (an ingress replica being
    replaced and its successor, or several ingress replicas); each connection has an id.

    ``on_command(conn_id, msg)`` runs on that connection's reader thread for every message after the
    handshake; ``on_invalid(conn_id, error)`` for every frame that holds no message (``ProtocolError``;
    the connection stays); ``on_disconnect(conn_id)`` runs once when the connection is lost (the
    requests it sent have no receiver any more).
    """

    def __init__(self, on_command: Callable[[int, Message], None], on_disconnect: Callable[[int], None],
                 secret: str, host: str = "127.0.0.1", port: int = 0, tick_s: float = 1.0,
                 stats: Callable[[], dict] | None = None,
                 on_invalid: Callable[[int, ProtocolError], None] | None = None) -> None:
        self.on_command, self.on_disconnect, self.on_invalid = on_command, on_disconnect, on_invalid
        self.secret, self.tick_s, self.stats = secret, tick_s, stats
        self._server = socket.create_server((host, port))
        self.address = (host, self._server.getsockname()[1])
        self._conns: dict[int, socket.socket] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # guards _conns and serialises writes
        self._closed = threading.Event()
        threading.Thread(target=self._accept, name="remask-channel-accept", daemon=True).start()
        threading.Thread(target=self._tick, name="remask-channel-tick", daemon=True).start()

    @property
    def connected(self) -> bool:
        return bool(self._conns)

    @property
    def peers(self) -> list[int]:
        return list(self._conns)

    def send(self, conn_id: int, msg: Message) -> bool:
        """Write one message to one ingress (any thread); False when it is gone or the write failed."""
        return self._write(conn_id, frame(msg))

    def broadcast(self, msg: Message) -> None:
        data = frame(msg)
        for conn_id in self.peers:
            self._write(conn_id, data)

    def _write(self, conn_id: int, data: bytes) -> bool:
        with self._lock:
            conn = self._conns.get(conn_id)
            if conn is None:
                return False
            try:
                conn.sendall(data)
                return True
            except OSError:
                pass
        self._drop(conn_id, conn)
        return False

    def close(self) -> None:
        self._closed.set()
        _hang_up(self._server)
        with self._lock:
            conns, self._conns = list(self._conns.values()), {}
        for conn in conns:
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
            if not isinstance(hello, Hello) or not hmac.compare_digest(hello.secret.encode(), self.secret.encode()):
                log.warning("control channel: refused a peer without the replica's secret")
                conn.close()
                return
            if hello.version != VERSION:
                log.warning("control channel: refused an ingress of protocol version %d (this is %d)", hello.version,
                            VERSION)
                conn.close()
                return
            conn.settimeout(None)
        except (OSError, ValueError, ChannelError) as exc:  # ProtocolError is a ValueError
            log.warning("control channel: refused a peer (%s)", exc)
            conn.close()
            return
        with self._lock:
            if self._closed.is_set():
                _hang_up(conn)
                return
            conn_id = next(self._ids)
            self._conns[conn_id] = conn
        self.send(conn_id, Ready(VERSION))
        try:
            while True:
                try:
                    msg = recv_frame(conn)
                except ProtocolError as exc:
                    log.warning("control channel: %s", exc)
                    if self.on_invalid is not None:
                        self.on_invalid(conn_id, exc)
                    continue
                if msg is None:
                    break
                self.on_command(conn_id, msg)
        except (OSError, ChannelError) as exc:
            log.warning("control channel: connection dropped (%s)", exc)
        self._drop(conn_id, conn)

    def _drop(self, conn_id: int, conn: socket.socket) -> None:
        with self._lock:
            current = self._conns.get(conn_id) is conn
            if current:
                del self._conns[conn_id]
        _hang_up(conn)
        if current:
            self.on_disconnect(conn_id)

    def _tick(self) -> None:
        while not self._closed.wait(self.tick_s):
            if self._conns:
                self.broadcast(Tick(time.time(), self.stats() if self.stats else {}))


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
        link.send(Hello(secret, VERSION))
        try:
            body = await asyncio.wait_for(link._frame(), timeout_s)
            first = None if body is None else protocol.decode(body)
        except ProtocolError as exc:  # a replica from before versions: its ready lacks one
            first = exc
        if not isinstance(first, Ready) or first.version != VERSION:
            link.close()
            why = (f"it speaks protocol version {first.version}, this ingress {VERSION}" if isinstance(first, Ready)
                   else f"{first}" if first is not None else "it hung up")
            raise ChannelError(f"replica at {host}:{port} refused the handshake: {why}")
        return link

    def send(self, msg: Message) -> bool:
        if self.closed:
            return False
        try:
            self.writer.write(frame(msg))
            return True
        except (OSError, RuntimeError):
            self.close()
            return False

    async def recv(self) -> Message | None:
        """The next message; None when the replica is gone (a frame that holds no message is logged and
        skipped)."""
        while (body := await self._frame()) is not None:
            try:
                return protocol.decode(body)
            except ProtocolError as exc:
                log.error("control channel: a replica sent %s", exc)
        return None

    async def _frame(self) -> bytes | None:
        """The next frame's body; None (and the link closed) when the replica is gone."""
        try:
            head = await self.reader.readexactly(HEADER.size)
            (n,) = HEADER.unpack(head)
            if n > MAX_FRAME:
                raise ChannelError(f"frame of {n} bytes exceeds {MAX_FRAME}")
            return await self.reader.readexactly(n)
        except (asyncio.IncompleteReadError, ConnectionError, OSError, ChannelError):
            self.close()
            return None

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.writer.close()
            except (OSError, RuntimeError):
                pass
