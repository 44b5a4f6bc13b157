"""Thresholds apply in the round they were chosen for (issue 24 item 6): the ingress answers each progress
batch with the thresholds (and remaining-round estimates) of the round after it; a replica measures how
often they arrive on time, and with ``planned`` requests it waits a little for them.

``ProtocolDispatcher`` is the ingress side of the protocol on top of the real dispatcher: every
``thresholds`` message carries ``after_round`` (the round of the batch it answers); with ``answer_all``
an answer to every batch (an empty map when nothing changed) with the router's ``estimates``; with
``planned`` also the ``add``'s ``planned`` and ``est_rounds``. The figures (today's ingress, answers
without waiting, and three wait bounds; 64 requests through one tiny-bd replica in its own process):

    .venv/bin/python -m tests.test_threshold_timing [requests]
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time

import pytest

import tasksuite as tasks
from app.dispatch import Dispatcher
from app.protocol import Abort, Add, ProgressBatch, SamplingParams, StepItem, Thresholds
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
                    router = self.d.router
                    msg.estimates = {r: router.remaining_steps(router.requests[r])
                                     for r in router.by_id[inst_id].requests if r in router.requests}
                self.answered = True
            elif isinstance(msg, Add) and self.planned:
                live = self.d.live[msg.req_id]
                msg = dataclasses.replace(msg, planned=live.state.fixed_threshold is None,
                                          est_rounds=self.d.router.remaining_steps(live.state))
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
        dispatcher = make_dispatcher()
        dispatcher.shed_over_capacity = False  # every request runs: the same work in both runs
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


@pytest.mark.slow
def test_thresholds_land_on_time_when_the_loop_waits_for_them():
    """The replica in a process (and on a CPU) of its own: without waiting, nearly every answer lands a round
    late; waiting for planned requests' answers (here up to 20 ms, a whole round) lands them on time.
    ``python -m tests.test_threshold_timing`` prints the default bound's figures too."""
    runs = {"today": measure(False, False), "answers, no wait": measure(True, False),
            "wait (20 ms, 100 %)": measure(True, True, threshold_wait_s=0.02, threshold_wait_frac=1.0)}
    for name, s in runs.items():
        print(f"\n{name}: {summary(s)}")
    assert runs["today"]["thresholds_on_time"] + runs["today"]["thresholds_late"] > 0
    waits = runs["wait (20 ms, 100 %)"]
    assert waits["threshold_waits"] > 0 and waits["estimates_applied"] > 0
    # on an idle machine 0-8 % of answers land late with the wait (83-94 % without); a busy one (other jobs
    # sharing the two cores) delays the ingress's answers beyond any wait now and then: at least halved, and
    # at most a quarter
    assert late_share(waits) <= min(0.25, late_share(runs["answers, no wait"]) / 2)


def test_the_replica_takes_est_rounds_planned_estimates_and_after_round_from_its_channel():
    """The protocol on a raw channel: the add's ``est_rounds`` replaces the admission estimate; with
    ``planned`` the loop waits for the answer to each batch (here up to 5 s: the test steps it round by
    round); a thresholds message with only ``estimates`` applies them, one with a ``map`` counts as on
    time when it answers the batch of the round just run."""
    from app.channel import Link

    replica = make_replica(**REPLICA, threshold_wait_s=5.0, threshold_wait_frac=1e6)
    sched = replica.loop.instance.scheduler

    async def batch_of(link: Link) -> ProgressBatch:
        while True:
            msg = await asyncio.wait_for(link.recv(), 10)
            if isinstance(msg, ProgressBatch) and any(isinstance(i, StepItem) for i in msg.items):
                return msg

    async def main():
        link = await Link.open(**replica.info())
        link.send(Add("a", ids("rev: abcdefgh"), SamplingParams(max_tokens=128, threshold=1.0), est_rounds=123.0,
                      planned=True))
        first = await batch_of(link)
        est0 = sched.requests["a"].est_rounds  # the loop waits for the answer: nothing moves meanwhile
        link.send(Thresholds(estimates={"a": 50.0}, after_round=first.round))
        second = await batch_of(link)
        est1 = sched.requests["a"].est_rounds
        link.send(Thresholds({"a": 0.8}, after_round=second.round))
        third = await batch_of(link)
        link.send(Abort("a"))
        link.close()
        return first, est0, second, est1, third

    try:
        first, est0, second, est1, third = asyncio.run(main())
    finally:
        replica.close()
    assert est0 == 123.0 and first.kinds == {"prefill": 1}
    assert est1 == 50.0 - second.kinds.get("denoise", 0)  # as of round 1, less the round run since
    assert second.round == first.round + 1 and third.round == second.round + 1
    s = third.stats
    assert s["estimates_applied"] == 1 and s["answers_on_time"] == 2 and s["answers_late"] == 0
    assert s["thresholds_on_time"] == 1 and s["thresholds_late"] == 0 and s["threshold_wait_timeouts"] == 0


if __name__ == "__main__":  # the figures: python -m tests.test_threshold_timing [requests]
    import sys

    import torch

    torch.set_num_threads(1)
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    for name, answer_all, planned, kw in [
            ("today's ingress (thresholds when changed)", False, False, {}),
            ("an answer to every batch, no wait", True, False, {}),
            ("planned, wait <= min(2 ms, 10 % of a round)", True, True, {}),
            ("planned, wait <= min(5 ms, 25 %)", True, True, {"threshold_wait_s": 0.005, "threshold_wait_frac": 0.25}),
            ("planned, wait <= min(20 ms, 100 %)", True, True, {"threshold_wait_s": 0.02, "threshold_wait_frac": 1.0})]:
        print(f"{name}: {summary(measure(answer_all, planned, n=n, **kw))}", flush=True)
