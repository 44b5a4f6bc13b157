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

The replica never waits on an ingress either: ``send`` writes what the socket
takes at once (a send that never blocks) and queues the rest for the
connection (a bounded queue, ``queue_frames``); one writer thread per
connection drains that queue. An ingress that stops reading fills its
socket's buffers, then its queue: a frame it has not taken within
``send_timeout_s``, or a queue overflowing, drops that connection (closed and
logged, as a lost connection: the requests it sent are aborted) while the
round loop and the other connections go on. ``close`` lets each writer send
what is queued for up to ``CLOSE_FLUSH_S``, then hangs up.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable

from app import protocol
from app.protocol import VERSION, Hello, Message, ProtocolError, Ready, Tick

log = logging.getLogger(__name__)
HEADER = struct.Struct("!I")
MAX_FRAME = 64 << 20
CLOSE_FLUSH_S = 1.0  # on close, how long the writers may still send what is queued
_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)  # a send that never blocks (Linux); 0: the writer thread blocks


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


class _Peer:
    """One ingress connection: its socket and the frames queued for it (at most ``limit``), which its
    writer thread sends in order. A frame put while nothing is queued or being sent is first tried at once,
    in the caller's thread, with a send that never blocks (the common case: one system call, as a direct
    write); what the socket does not take then is queued first."""

    def __init__(self, conn: socket.socket, limit: int) -> None:
        self.conn, self.limit = conn, limit
        self.frames: deque[bytes | memoryview] = deque()
        self.cond = threading.Condition()
        self.open = True  # takes frames; once False the writer sends what is queued (``flush``) and ends
        self.busy = False  # a frame is being sent (by the writer, or by ``put``)

    def put(self, data: bytes) -> bool:
        """Queue (or send) a frame; False when the queue is full or the peer takes no more."""
        with self.cond:
            if not self.open or len(self.frames) >= self.limit:
                return False
            if self.frames or self.busy or not _DONTWAIT:
                self.frames.append(data)
                self.cond.notify()
                return True
            self.busy = True
        try:
            sent = self.conn.send(data, _DONTWAIT)
        except OSError:  # full (BlockingIOError), or broken: the writer finds out which
            sent = 0
        with self.cond:
            self.busy = False
            if sent < len(data):
                self.frames.appendleft(memoryview(data)[sent:])
            self.cond.notify()
        return True

    def take(self) -> bytes | memoryview | None:
        """The next frame (waits for one; the caller sends it, then calls ``sent``); None once the peer is
        closed and its queue sent."""
        with self.cond:
            while (not self.frames or self.busy) and self.open:
                self.cond.wait()
            while self.busy:  # closed while ``put`` sends: let it finish
                self.cond.wait()
            if not self.frames:
                return None
            self.busy = True
            return self.frames.popleft()

    def sent(self) -> None:
        with self.cond:
            self.busy = False
            self.cond.notify_all()

    def stop(self, flush: bool) -> None:
        """No more frames: the writer sends those queued (``flush``) or none, then ends."""
        with self.cond:
            self.open = False
            if not flush:
                self.frames.clear()
            self.cond.notify_all()


class ReplicaChannel:
    """Replica side: listens for ingresses. Several may be connected at once (an ingress replica being
    replaced and its successor, or several ingress replicas); each connection has an id.

    ``on_command(conn_id, msg)`` runs on that connection's reader thread for every message after the
    handshake; ``on_invalid(conn_id, error)`` for every frame that holds no message (``ProtocolError``;
    the connection stays); ``on_disconnect(conn_id)`` runs once when the connection is lost (the
    requests it sent have no receiver any more), a connection dropped for not reading included.

    ``send_timeout_s``: the longest an ingress may take to accept one frame; ``queue_frames``: the frames
    that may wait for an ingress; past either, its connection is dropped (module docstring).
    """

    def __init__(self, on_command: Callable[[int, Message], None], on_disconnect: Callable[[int], None],
                 secret: str, host: str = "127.0.0.1", port: int = 0, tick_s: float = 1.0,
                 stats: Callable[[], dict] | None = None,
                 on_invalid: Callable[[int, ProtocolError], None] | None = None, send_timeout_s: float = 10.0,
                 queue_frames: int = 1024) -> None:
        if send_timeout_s <= 0 or queue_frames < 1:
            raise ValueError("send_timeout_s must be > 0 and queue_frames at least 1")
        self.on_command, self.on_disconnect, self.on_invalid = on_command, on_disconnect, on_invalid
        self.secret, self.tick_s, self.stats = secret, tick_s, stats
        self.send_timeout_s, self.queue_frames = send_timeout_s, queue_frames
        self.slow_dropped = 0  # connections dropped for not reading (a send timed out, or the queue overflowed)
        self._server = socket.create_server((host, port))
        self.address = (host, self._server.getsockname()[1])
        self._conns: dict[int, _Peer] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # guards _conns
        self._closed = threading.Event()
        threading.Thread(target=self._accept, name="remask-channel-accept", daemon=True).start()
        threading.Thread(target=self._tick, name="remask-channel-tick", daemon=True).start()

    @property
    def connected(self) -> bool:
        return bool(self._conns)

    @property
    def peers(self) -> list[int]:
        return list(self._conns)

    def queued(self) -> dict[int, int]:
        """Frames waiting to be sent, per connection."""
        return {conn_id: len(peer.frames) for conn_id, peer in list(self._conns.items())}

    def send(self, conn_id: int, msg: Message) -> bool:
        """Queue one message for one ingress (any thread; never waits on the ingress); False when it is
        gone, or was just dropped because its queue is full."""
        return self._enqueue(conn_id, frame(msg))

    def broadcast(self, msg: Message) -> None:
        data = frame(msg)
        for conn_id in self.peers:
            self._enqueue(conn_id, data)

    def _enqueue(self, conn_id: int, data: bytes) -> bool:
        peer = self._conns.get(conn_id)
        if peer is None:
            return False
        if peer.put(data):
            return True
        if peer.open:  # full: it has not read for a while
            self._slow(conn_id, peer, f"{len(peer.frames)} frames are waiting for it (queue_frames)")
        return False

    def _slow(self, conn_id: int, peer: _Peer, why: str) -> None:
        with self._lock:
            current = self._conns.get(conn_id) is peer
        if current:
            self.slow_dropped += 1
            log.warning("control channel: dropped ingress connection %d, which stopped reading: %s", conn_id, why)
        self._drop(conn_id, peer)

    def close(self) -> None:
        """Stop: no new connection; each writer sends what is queued (``CLOSE_FLUSH_S`` at most), then hangs
        up (``on_disconnect`` is not called)."""
        self._closed.set()
        _hang_up(self._server)
        with self._lock:
            peers, self._conns = list(self._conns.values()), {}
        for peer in peers:
            peer.stop(flush=True)
            try:
                peer.conn.shutdown(socket.SHUT_RD)  # its reader ends: no command is taken any more
            except OSError:
                pass
        if peers:  # a writer still sending then (to an ingress that does not read) is cut off
            timer = threading.Timer(CLOSE_FLUSH_S, lambda: [_hang_up(peer.conn) for peer in peers])
            timer.daemon = True
            timer.start()

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
        peer = _Peer(conn, self.queue_frames)
        # the ready first in the queue, sent by the writer once the connection is listed: nothing listed can
        # reach the ingress before it (a tick, a broadcast), and an ingress that has it is listed
        peer.frames.append(frame(Ready(VERSION)))
        with self._lock:
            if self._closed.is_set():
                _hang_up(conn)
                return
            conn_id = next(self._ids)
            self._conns[conn_id] = peer
        threading.Thread(target=self._write, args=(conn_id, peer), name="remask-channel-writer", daemon=True).start()
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
        self._drop(conn_id, peer)

    def _write(self, conn_id: int, peer: _Peer) -> None:
        """The connection's writer: sends its frames in order, each within ``send_timeout_s``."""
        while (data := peer.take()) is not None:
            try:
                self._send_frame(peer.conn, data)
                peer.sent()
            except TimeoutError:
                self._slow(conn_id, peer, f"it took no frame for {self.send_timeout_s:g} s (send_timeout_s)")
                return
            except OSError:  # it went away (the reader sees it too), or close() cut it off
                break
        self._drop(conn_id, peer)  # still current: its connection failed; else it was closed and is flushed now
        _hang_up(peer.conn)

    def _send_frame(self, conn: socket.socket, data: bytes | memoryview) -> None:
        """Send all of ``data`` on a blocking socket without blocking on it: non-blocking sends, waiting for
        room at most until ``send_timeout_s`` from now (TimeoutError; part of the frame may be gone, so the
        connection cannot go on)."""
        deadline = time.monotonic() + self.send_timeout_s
        view = memoryview(data)
        poller = None
        while view:
            try:
                view = view[conn.send(view, _DONTWAIT):]
                continue
            except BlockingIOError:
                pass
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            if poller is None:
                poller = select.poll()
                poller.register(conn, select.POLLOUT)
            if any(ev & (select.POLLERR | select.POLLHUP | select.POLLNVAL) for _, ev in poller.poll(left * 1e3)):
                raise ConnectionError("the connection broke")

    def _drop(self, conn_id: int, peer: _Peer) -> None:
        """A connection failed (or was found slow): hang up, and tell ``on_disconnect``. One that ``close``
        let go is the writer's to hang up once it has sent its queue."""
        with self._lock:
            current = self._conns.get(conn_id) is peer
            if current:
                del self._conns[conn_id]
        if current:
            peer.stop(flush=False)
            _hang_up(peer.conn)
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
