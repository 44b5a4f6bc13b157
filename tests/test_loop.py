from __future__ import annotations

import threading
import time

import pytest
import torch

from engine.engine import Engine
from engine.instance import Instance
from engine.loop import Overloaded, RoundLoop
from engine.progress import AcceptedItem, ErrorItem, ProgressBatch, StepItem
from engine.sequence import SamplingParams
from tests.builders import make_model


class Collector:
    """Gathers a loop's batches into per-request items."""

    def __init__(self) -> None:
        self.items: dict[str, list] = {}
        self.batches: list[ProgressBatch] = []
        self.done = threading.Event()
        self.expect = 0

    def __call__(self, batch: ProgressBatch) -> None:
        self.batches.append(batch)
        for item in batch.items:
            self.items.setdefault(item.req_id, []).append(item)
        ended = sum(any(ended_by(i) for i in its) for its in self.items.values())
        if ended >= self.expect:
            self.done.set()

    def ids(self, req_id: str) -> list[int]:
        return [t for i in self.items[req_id] if isinstance(i, StepItem) for t in i.ids]


def ended_by(item) -> bool:
    return isinstance(item, ErrorItem) or isinstance(item, StepItem) and item.done is not None


def stepped(batch: ProgressBatch) -> bool:
    return any(isinstance(i, StepItem) for i in batch.items)


def test_round_loop_streams_every_request_to_completion(tok):
    model = make_model()
    ref = Engine(model, tok).generate(["abc", "12+5=", "story: cat 2"], SamplingParams(max_tokens=24, threshold=0.5))
    sink = Collector()
    loop = RoundLoop(Instance(Engine(model, tok, max_slots=2), slots=2), sink)
    try:
        sink.expect = 4
        for i, p in enumerate(["abc", "12+5=", "story: cat 2"]):
            loop.submit(f"q{i}", p, SamplingParams(max_tokens=24, threshold=0.5), attempt=i)
        loop.submit("long", "x" * 600, SamplingParams(max_tokens=8))  # longer than the context
        assert sink.done.wait(30)
        for i, r in enumerate(ref):
            items = sink.items[f"q{i}"]
            assert isinstance(items[0], AcceptedItem) and items[0].add_ms is None and items[0].prompt_tokens > 0
            done = items[-1].done
            assert done.completion_tokens == len(r.token_ids) and done.rounds == r.rounds
            assert sink.ids(f"q{i}") == r.token_ids  # every committed token exactly once
            assert [i.steps for i in items[1:]] == sorted(i.steps for i in items[1:])
            assert {item.attempt for item in items} == {i}  # every item carries the attempt it was sent as
        assert sink.items["long"][-1].status == 400 and "context" in sink.items["long"][-1].message
        assert len(sink.batches) <= loop.rounds + 4  # one batch per round, not one message per request
        stats = loop.stats()
        assert stats["rounds"] > 0 and stats["resident"] == 0 and stats["kv_reserved_tokens"] == 0
    finally:
        loop.stop()


def test_abort_and_overload(tok):
    sink = Collector()
    inst = Instance(Engine(_never_ends(tok), tok, max_slots=1), slots=1)
    loop = RoundLoop(inst, sink, max_waiting=2)
    try:
        loop.submit("a", "abc", SamplingParams(max_tokens=400, threshold=1.0))
        time.sleep(0.2)
        loop.abort("a")
        deadline = time.time() + 10
        while inst.has_work() and time.time() < deadline:
            time.sleep(0.05)
        assert not inst.has_work() and inst.scheduler.kv_reserved == 0
        assert sink.ids("a") and not any(ended_by(i) for i in sink.items["a"])  # streamed, never done
        loop._stop.set()  # freeze the loop so the queue fills
        loop._thread.join(timeout=5)
        loop.submit("b", "abc", SamplingParams())
        loop.submit("c", "abc", SamplingParams())
        with pytest.raises(Overloaded):
            loop.submit("d", "abc", SamplingParams())
    finally:
        loop.stop()


def test_a_failed_tensor_parallel_round_breaks_the_instance_only_when_a_rank_is_gone(tok):
    """Every follower answers: a failed round fails no request (its requests start over from the tokens they
    had published, on every rank, and complete as they would have) and the loop goes on, until rounds fail
    ``tp_broken_after`` times in a row (what bisecting a full batch may take; a request that fails alone
    meanwhile is given back, 503). A follower gone: the loop ends at once, its requests get no error (the
    ingress resumes them elsewhere) and ``on_fatal`` hears why."""
    from engine.instance import InstanceBroken

    class Followers:
        def __init__(self) -> None:
            self.fail, self.alive = 0, True

        def __call__(self, commands, plan):
            if self.fail:
                self.fail -= 1
                raise RuntimeError("collective failed")
            return lambda: None

    for alive in (True, False):
        followers = Followers()
        followers.alive = alive
        inst = Instance(Engine(make_model(), tok, max_slots=4), slots=4, mirror=followers,
                        followers_alive=lambda f=followers: f.alive)
        sink, fatal = Collector(), []
        loop = RoundLoop(inst, sink, on_fatal=fatal.append)
        try:
            followers.fail = 1
            sink.expect = 1
            loop.submit("a", "abc", SamplingParams(max_tokens=8))
            if alive:  # an ordinary failure: the request runs again and the instance serves the next one
                assert sink.done.wait(30)
                ref = Engine(make_model(), tok).generate(["abc"], SamplingParams(max_tokens=8))[0]
                assert sink.items["a"][-1].done is not None and sink.ids("a") == ref.token_ids
                assert loop.broken is None and loop.stats()["rounds_failed"] == 1
                assert loop.stats()["requests_reset"] == 1  # a tensor-parallel round's requests start over
                sink.done.clear()
                sink.expect = 2
                loop.submit("b", "abc", SamplingParams(max_tokens=8))
                assert sink.done.wait(30) and sink.items["b"][-1].done is not None
                followers.fail = 1000  # then every round fails
                assert inst.tp_broken_after == 6  # 4 slots: 3 bits, and 3
                for k in range(3):
                    loop.submit(f"c{k}", "abc", SamplingParams(max_tokens=8))
                    time.sleep(0.2)
                deadline = time.monotonic() + 30
                while loop.broken is None and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert "6 rounds failed in a row" in loop.broken
                assert [sink.items[f"c{k}"][-1].status for k in range(2)] == [503, 503]  # each failed alone twice
            else:
                deadline = time.monotonic() + 30
                while loop.broken is None and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert "a rank is gone" in loop.broken
                assert not any(isinstance(i, ErrorItem) for i in sink.items.get("a", ()))  # no error for it
            assert len(fatal) == 1 and isinstance(fatal[0], InstanceBroken)
        finally:
            loop.stop()


def _never_ends(tok):
    """A model whose answers never reach EOS (every request runs its whole budget)."""
    model = make_model()
    head = model.lm_head

    class NeverEnds(torch.nn.Module):
        def forward(self, h):
            logits = head(h)
            logits[..., tok.eos_token_id] -= 100.0
            return logits

    model.lm_head = NeverEnds()
    return model


def test_external_estimates_replace_r_i_count_elapsed_rounds_and_yield_to_a_newer_refinement(tok):
    """The add's ``est_rounds`` replaces the admission estimate; an estimate made after round n applies
    less the denoising rounds the request ran since; one older than the instance's refinement is
    dropped. Each batch carries the round's composition by step kind."""
    inst = Instance(Engine(_never_ends(tok), tok, max_slots=2), slots=2, refiner=lambda seq: 42.0)
    seen: list[tuple[int, float, bool, dict, dict]] = []
    done = threading.Event()
    loop = None

    def on_batch(batch):
        req = inst.scheduler.requests.get("a")
        if req is None or not stepped(batch):
            return done.set() if req is None and seen else None
        seen.append((batch.round, req.est_rounds, req.refined, batch.kinds, batch.kind_tokens))
        # the answer to this batch, as if it had taken a round to arrive: as of the previous round
        loop.set_thresholds({}, {"a": 1000.0}, after_round=batch.round - 1)

    loop = RoundLoop(inst, on_batch)
    try:
        loop.submit("a", "story: dog 2", SamplingParams(max_tokens=24, threshold=1.0), est_rounds=7.0)
        assert done.wait(30)
    finally:
        loop.stop()
    stats = loop.stats()
    r = next(i for i, s in enumerate(seen) if s[2])  # the refinement's round (the first denoising one)
    assert seen[0][1] == 7.0  # the add's estimate, as sent (a prefill round leaves it)
    assert all(s[1] == 1000.0 for s in seen[1:r])  # answers during the prefill: no denoising round since
    assert seen[r][1] == 41.0  # refined: 42 less the round done
    assert seen[r + 1][1] == 40.0 and stats["estimates_dropped"] == 1  # the answer older than it: dropped
    # later answers: 1000 as of the previous round, less the round run since, less the round after it
    assert r + 2 < len(seen) and all(s[1] == 998.0 for s in seen[r + 2:])
    assert stats["estimates_applied"] == len(seen) - 1  # every answer but the dropped one
    assert all(s[3] in ({"prefill": 1}, {"denoise": 1}) for s in seen)
    assert seen[-1][3] == {"denoise": 1} and seen[-1][4]["denoise"] % 8 == 0


@pytest.mark.parametrize("planned", [False, True])
def test_thresholds_answering_a_batch_land_late_unless_the_loop_waits_for_them(tok, planned):
    """Every batch is answered 5 ms after it left (thresholds for the next round, ``after_round``). A loop
    that does not wait starts the next round first: the thresholds land late. For a ``planned`` request
    the loop waits for the answer (here up to 0.5 s): they land on time."""
    inst = Instance(Engine(_never_ends(tok), tok, max_slots=2), slots=2)
    done = threading.Event()
    loop = None

    def on_batch(batch):
        if any(ended_by(i) for i in batch.items):
            return done.set()
        if stepped(batch):
            t = 0.9 if batch.round % 2 else 0.95
            threading.Timer(0.005, loop.set_thresholds, ({"a": t},), {"after_round": batch.round}).start()

    loop = RoundLoop(inst, on_batch, threshold_wait_s=0.5, threshold_wait_frac=1e6)
    try:
        loop.submit("a", "abc", SamplingParams(max_tokens=48, threshold=1.0), planned=planned)
        assert done.wait(60)
    finally:
        loop.stop()
    s = loop.stats()
    answered = s["thresholds_on_time"] + s["thresholds_late"]
    assert answered >= 3
    if planned:
        assert s["thresholds_late"] == 0 and s["threshold_waits"] > 0 and s["threshold_wait_timeouts"] == 0
        assert s["threshold_answer_ms_mean"] >= 4.0
    else:
        assert s["thresholds_late"] >= 0.75 * answered and s["threshold_waits"] == 0
        assert s["thresholds_late_rounds"] >= s["thresholds_late"]
