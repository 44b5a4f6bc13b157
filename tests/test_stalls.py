"""Control loops that cannot stall (issue 25 item 5): the replica's channel never waits on an ingress that stops
reading (a bounded queue per connection, a send timeout: the stalled one is dropped, the others go on), and
the dispatcher's watchdog survives a failing pass and restarts if its task ends."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

from app.channel import ReplicaChannel, frame, recv_frame
from app.protocol import VERSION, Hello, Ready, Tick

SECRET = "s3cret"


def _connect(channel: ReplicaChannel, rcvbuf: int | None = None) -> socket.socket:
    """A raw ingress: connected, handshake done."""
    sock = socket.socket()
    if rcvbuf is not None:  # before connecting, so the window it offers stays small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(channel.address)
    sock.sendall(frame(Hello(channel.secret, VERSION)))
    sock.settimeout(10)
    assert isinstance(recv_frame(sock), Ready)
    return sock


def _wait(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class Reader(threading.Thread):
    """An ingress that reads everything: the ``t`` of each tick it got."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(daemon=True)
        self.sock, self.got = sock, []

    def run(self) -> None:
        try:
            while (msg := recv_frame(self.sock)) is not None:
                if isinstance(msg, Tick):
                    self.got.append(msg.t)
        except OSError:
            pass


def _big_tick(k: int) -> Tick:
    return Tick(float(k), {"pad": "x" * 65536})  # 64 kB frames fill a socket's buffers in a few dozen


def _pump(channel: ReplicaChannel, conns: list[int], seconds: float, stop=lambda: False) -> tuple[int, float]:
    """Send a big frame to each of ``conns`` every 5 ms, as a round loop publishes its batches: (frames
    sent, the longest a send call took)."""
    k, longest = 0, 0.0
    end = time.monotonic() + seconds
    while time.monotonic() < end and not stop():
        for c in conns:
            t0 = time.perf_counter()
            channel.send(c, _big_tick(k))
            longest = max(longest, time.perf_counter() - t0)
        k += 1
        time.sleep(0.005)
    return k, longest


def test_an_ingress_that_stops_reading_is_dropped_within_the_send_timeout_and_the_others_get_everything():
    lost: list[tuple[int, float]] = []
    channel = ReplicaChannel(lambda c, m: None, lambda c: lost.append((c, time.monotonic())), SECRET, tick_s=60,
                             send_timeout_s=0.5, queue_frames=100_000)
    try:
        good = _connect(channel)
        reader = Reader(good)
        reader.start()
        stalled = _connect(channel, rcvbuf=4096)
        good_id, stalled_id = channel.peers
        t0 = time.monotonic()
        sent, longest = _pump(channel, [good_id, stalled_id], 8.0, stop=lambda: bool(lost))
        assert lost and lost[0][0] == stalled_id, "the stalled ingress was never dropped"
        # its buffers took a few MB first; after that, it was dropped within the timeout (and some slack)
        assert lost[0][1] - t0 < 6.0
        assert longest < 0.1, f"a send waited {longest:.3f} s on an ingress"
        assert channel.slow_dropped == 1 and channel.peers == [good_id]
        more, _ = _pump(channel, [good_id], 0.2)  # the good one goes on
        channel.send(good_id, Tick(-1.0, {}))
        assert _wait(lambda: reader.got and reader.got[-1] == -1.0, 20)
        assert reader.got == [float(k) for k in range(sent)] + [float(k) for k in range(more)] + [-1.0]
        stalled.settimeout(10)  # the dropped one finds its connection closed once it reads what it was sent
        while stalled.recv(1 << 20):
            pass
    finally:
        channel.close()


def test_an_ingress_whose_queue_overflows_is_dropped_at_once(caplog):
    lost: list[int] = []
    channel = ReplicaChannel(lambda c, m: None, lost.append, SECRET, tick_s=60, send_timeout_s=60.0,
                             queue_frames=8)
    try:
        stalled = _connect(channel, rcvbuf=4096)  # kept: a socket collected would close
        (stalled_id,) = channel.peers
        with caplog.at_level(logging.WARNING, logger="app.channel"):
            t0 = time.monotonic()
            _, longest = _pump(channel, [stalled_id], 10.0, stop=lambda: bool(lost))
        assert lost == [stalled_id] and time.monotonic() - t0 < 5.0 and longest < 0.1
        said = [r.getMessage() for r in caplog.records]
        assert any("stopped reading" in m and "queue_frames" in m for m in said), said
        assert not channel.send(stalled_id, Tick(0.0, {}))  # gone
        stalled.close()
    finally:
        channel.close()


def test_close_sends_what_is_queued_then_hangs_up():
    """The last frames (a broken instance's final errors, say) still reach a reading ingress after close."""
    channel = ReplicaChannel(lambda c, m: None, lambda c: None, SECRET, tick_s=60, queue_frames=10_000)
    sock = _connect(channel)
    (conn_id,) = channel.peers
    for k in range(200):
        channel.send(conn_id, _big_tick(k))
    channel.close()
    got = []
    while (msg := recv_frame(sock)) is not None:
        got.append(msg.t)
    assert got == [float(k) for k in range(200)]


def test_the_round_loop_keeps_serving_one_ingress_while_another_stops_reading(tok):
    """Through a replica: an ingress sends a request and stops reading; the round loop goes on serving
    another ingress's requests to the end, and the stalled one is dropped (its request aborted)."""
    from app.protocol import Add, ProgressBatch, SamplingParams, StepItem
    from app.replica import ReplicaServer
    from engine.engine import Engine
    from engine.instance import Instance
    from tests.builders import make_model

    inst = Instance(Engine(make_model(), tok, max_slots=4), slots=4)
    rep = ReplicaServer(inst, tick_s=0.05, send_timeout_s=0.5, queue_frames=100_000)
    # small kernel buffers on the replica's side, so a few hundred frames fill them (accepted connections
    # take the listening socket's)
    rep.channel._server.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    stalled = _connect(rep.channel, rcvbuf=4096)
    prompt = tok.prompt_ids("story: cat 9", 8)
    stalled.sendall(frame(Add("slow", prompt, SamplingParams(max_tokens=400, threshold=1.0), canvas=True)))
    assert _wait(lambda: "slow" in inst.seqs, 10)
    good = _connect(rep.channel)
    try:
        t0 = time.monotonic()
        done: dict[str, list[int]] = {}
        for k in range(6):  # requests one after another: the loop must run rounds for each
            rid = f"g{k}"
            good.sendall(frame(Add(rid, prompt, SamplingParams(max_tokens=48, threshold=0.9))))
            ids: list[int] = []
            while rid not in done:
                msg = recv_frame(good)
                assert msg is not None
                if isinstance(msg, ProgressBatch):
                    for item in msg.items:
                        if isinstance(item, StepItem) and item.req_id == rid:
                            ids += item.ids
                            if item.done is not None:
                                done[rid] = ids
        assert _wait(lambda: rep.channel.slow_dropped == 1, 10), "the stalled ingress was never dropped"
        assert _wait(lambda: "slow" not in inst.seqs and not inst.has_work(), 10)  # its request was aborted
        assert len(done) == 6 and all(done.values()) and len(rep.channel.peers) == 1
        assert time.monotonic() - t0 < 60 and rep.loop.broken is None
    finally:
        rep.close()
        stalled.close()
        good.close()


# ---- the dispatcher's watchdog --------------------------------------------------------------------------

def test_the_watchdog_survives_a_failing_pass_and_restarts_when_its_task_ends(monkeypatch):
    """One pass raises: logged, and the next passes still drop a silent instance. The task itself ends
    (cancelled): it starts again and goes on detecting."""
    import app.dispatch as dispatch
    from tests.builders import make_dispatcher
    from tests.fakes import RecordingLink

    monkeypatch.setattr(dispatch, "WATCHDOG_RESTART_S", 0.05)

    async def main():
        now = [0.0]
        d = make_dispatcher()
        d.clock, d.dead_after_s = (lambda: now[0]), 0.2  # passes every 0.1 s (real time), silence by the fake clock
        ids = [d.attach(f"w{i}", 1, RecordingLink(), read=False) for i in range(3)]
        real, calls = d._expire_parked, []

        def once_broken(t):
            calls.append(t)
            if len(calls) == 1:
                raise RuntimeError("a bug in one pass")
            return real(t)

        d._expire_parked = once_broken
        d._ensure_watchdog()
        assert await _until(lambda: d.stats["watchdog_errors"] == 1)
        now[0] = 10.0  # the first instance goes silent; the others are heard from
        for i in ids[1:]:
            d.instances[i].last_seen = 10.0
        assert await _until(lambda: ids[0] not in d.instances)
        assert list(d.instances) == ids[1:] and not d._watchdog.done()

        d._watchdog.cancel()  # the task ends
        await asyncio.sleep(0)
        assert await _until(lambda: d.stats["watchdog_restarts"] == 1 and not d._watchdog.done())
        now[0] = 20.0
        d.instances[ids[2]].last_seen = 20.0
        assert await _until(lambda: ids[1] not in d.instances)
        assert list(d.instances) == [ids[2]] and d.stats["instances_lost"] == 2

    asyncio.run(main())


async def _until(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True

