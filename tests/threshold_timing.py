"""The threshold-timing harness shared by tests/test_threshold_timing.py and scripts/threshold_timing_figures.py:
``ProtocolDispatcher`` (the ingress side of the replica protocol on top of the real dispatcher: every
``thresholds`` message carries ``after_round``, the round of the batch it answers; with ``answer_all`` an answer
to every batch, an empty map when nothing changed, with the router's ``estimates``; with ``planned`` also the
``add``'s ``planned`` and ``est_rounds``), and ``measure``: requests through one tiny-bd replica in a process of
its own, and the loop's threshold counters."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time

import tasksuite as tasks
from app.dispatch import Dispatcher
from app.protocol import Add, ProgressBatch, StepItem, Thresholds
from tests.builders import collect, ids, make_dispatcher, make_replica


class ProtocolDispatcher:
    """Wraps a ``Dispatcher``'s links so its messages follow the replica protocol (app/replica.py):
    ``after_round`` on every thresholds message; ``answer_all``: an answer to every batch that stepped
    a request (an empty map when no threshold changed) with the router's ``estimates``; ``planned``: the
    adds say so (the replica then waits a little for those answers) and carry ``est_rounds``."""

    def __init__(self, d: Dispatcher, answer_all: bool, planned: bool) -> None:
        self.d, self.answer_all, self.planned = d, answer_all, planned
        self.after: int | None = None
        self.answered = True
        handle = d.handle_batch

        def handle_batch(inst_id: int, batch: ProgressBatch) -> None:
            self.after, self.answered = batch.round, False
            handle(inst_id, batch)
            stepped = any(isinstance(i, StepItem) and i.done is None for i in batch.items)
            if self.answer_all and stepped and not self.answered and inst_id in d.instances:
                d.instances[inst_id].link.send(Thresholds())

        d.handle_batch = handle_batch

    def wrap(self, inst_id: int) -> None:
        """Wrap the link of a connected instance."""
        link = self.d.instances[inst_id].link
        send = link.send

        def wrapped(msg) -> bool:
            if isinstance(msg, Thresholds):
                msg = dataclasses.replace(msg, after_round=self.after)
                if self.answer_all:
                    driver = self.d.driver
                    states = [driver.request(r) for r in driver.instance(inst_id).requests]
                    msg.estimates = {s.req_id: driver.estimate(s) or 0.0 for s in states if s is not None}
                self.answered = True
            elif isinstance(msg, Add) and self.planned:
                live = self.d.live[msg.req_id]
                msg = dataclasses.replace(msg, planned=live.state.fixed_threshold is None,
                                          est_rounds=self.d.driver.estimate(live.state) or 0.0)
            return send(msg)

        link.send = wrapped


# the replica of the figures: a deep queue (all requests are sent at once), a fixed KV pool
REPLICA = dict(max_waiting=128, kv_slots=64)


def _cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def _serve(conn, loop_kwargs: dict, cpu: int | None) -> None:
    """A replica in a process of its own, as a Denoiser replica is (the ingress is another process)."""
    import torch

    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    replica = make_replica(**REPLICA, **loop_kwargs)
    try:
        conn.send(replica.info())
        conn.recv()  # served
        conn.send(replica.loop.stats())
    finally:
        replica.close()


def measure(answer_all: bool, planned: bool, n: int = 64, slo_ms: tuple[float, float] = (2000, 1000),
            own_process: bool = True, **loop_kwargs) -> dict:
    """Serve ``n`` requests through one replica (by default in a process of its own, on a CPU of its own
    when there are two: a small machine otherwise runs the ingress as soon as a batch is written to it, while
    the replica's write waits, which no machine with spare cores does); the loop's threshold counters."""
    import multiprocessing

    exs = tasks.heldout_set(400)[:n]
    cpus = _cpus()
    pin = own_process and len(cpus) >= 2
    if own_process:
        parent, child = multiprocessing.get_context("spawn").Pipe()
        proc = multiprocessing.get_context("spawn").Process(target=_serve, daemon=True,
                                                            args=(child, loop_kwargs, cpus[0] if pin else None))
        proc.start()
        if pin:
            os.sched_setaffinity(0, set(cpus[1:]))
        if not parent.poll(120):
            proc.kill()
            raise RuntimeError("the replica process did not start")
        info = parent.recv()
    else:
        replica = make_replica(**REPLICA, **loop_kwargs)
        info = replica.info()

    async def main():
        dispatcher = make_dispatcher(router={"shed_over_capacity": False})  # every request runs: the same work
        d = ProtocolDispatcher(dispatcher, answer_all, planned)
        inst_id = await d.d.connect("r0", 1, **info)
        d.wrap(inst_id)
        streams = [d.d.submit(f"q{i}", ids(e.prompt), 64 if e.category == "prose" else 16, prompt_text=e.prompt,
                              slo_ms=slo_ms[0] + slo_ms[1] * (i % 4)) for i, e in enumerate(exs)]
        return await asyncio.gather(*(collect(s) for s in streams))

    try:
        t0 = time.perf_counter()
        results = asyncio.run(main())
        wall = time.perf_counter() - t0
        if own_process:
            parent.send("done")
            assert parent.poll(30), "the replica process did not answer"
            stats = parent.recv()
        else:
            stats = replica.loop.stats()
    finally:
        if pin:
            os.sched_setaffinity(0, set(cpus))
        if own_process:
            proc.join(timeout=10)
        else:
            replica.close()
    bad = [last for _, last in results if last["type"] != "done"]
    assert not bad, bad[:3]
    keys = ("thresholds_on_time", "thresholds_late", "thresholds_late_rounds", "answers_on_time", "answers_late",
            "threshold_waits", "threshold_wait_timeouts", "threshold_wait_ms", "threshold_answers",
            "threshold_answer_ms_mean", "estimates_applied", "estimates_dropped", "rounds", "last_round_s")
    return {**{k: stats[k] for k in keys}, "wall_s": wall}


def late_share(s: dict, what: str = "answers") -> float:
    return s[f"{what}_late"] / max(s[f"{what}_late"] + s[f"{what}_on_time"], 1)


def summary(s: dict) -> str:
    n, a = s["thresholds_late"] + s["thresholds_on_time"], s["answers_late"] + s["answers_on_time"]
    return (f"thresholds late {s['thresholds_late']}/{n} ({late_share(s, 'thresholds'):.0%}), answers late "
            f"{s['answers_late']}/{a} ({late_share(s):.0%}), answer {s['threshold_answer_ms_mean']:.1f} ms after "
            f"its batch; {s['threshold_waits']} waits ({s['threshold_wait_timeouts']} timed out), "
            f"{s['threshold_wait_ms']:.0f} ms in all; {s['rounds']} rounds, {s['wall_s']:.2f} s")
