"""Failed rounds (engine/loop.py): the request at fault is found by bisection and fails alone; the instance's
other requests go on as they would have, and the instance keeps serving."""

from __future__ import annotations

import time

import pytest

from engine.engine import Engine
from engine.instance import Instance
from engine.loop import RoundLoop
from engine.progress import ErrorItem
from engine.sequence import SamplingParams
from tests.builders import make_model
from tests.fakes import Sink

PROMPTS = {f"r{i}": p for i, p in enumerate(["abc", "12+5=", "story: cat 2", "hello", "x y z", "7*6=", "dog 3"])}
PARAMS = dict(max_tokens=40, threshold=0.7)


class Faulty:
    """An instance's ``execute`` that raises (as a CUDA out-of-memory error would, before the engine touched
    anything) for every round whose batch holds ``culprit``, from the instance's ``after``-th round on,
    ``times`` times at most; ``when_after``: raise after the engine ran the round instead (the round's requests
    half-updated)."""

    def __init__(self, inst: Instance, culprit: str, after: int = 0, when_after: bool = False,
                 times: int | None = None) -> None:
        self.inst, self.culprit, self.after, self.when_after, self.times = inst, culprit, after, when_after, times
        self.execute, self.failed, self.rounds = inst.execute, 0, 0
        inst.execute = self

    def __call__(self, plan):
        self.rounds += 1
        hit = (any(s.req_id == self.culprit for s in plan.slots) and self.rounds > self.after
               and (self.times is None or self.failed < self.times))
        if hit and not self.when_after:
            self.failed += 1
            raise RuntimeError("CUDA out of memory (injected)")
        result = self.execute(plan)
        if hit:
            self.failed += 1
            raise RuntimeError("CUDA error after the step (injected)")
        return result


def _instance(model, tok, slots: int = 8) -> Instance:
    return Instance(Engine(model, tok, max_slots=slots), slots=slots)


def _run(loop: RoundLoop, sink: Sink, prompts: dict[str, str], **submit) -> None:
    for rid, p in prompts.items():
        loop.submit(rid, p, SamplingParams(**PARAMS), **submit)
    sink.wait(prompts)


@pytest.fixture(scope="module")
def reference(request):
    """Each prompt's tokens, run on an instance without faults (all together, as the faulty runs do)."""
    from engine.tokenizer import CharTokenizer

    tok = CharTokenizer.default()
    sink = Sink()
    loop = RoundLoop(_instance(make_model(), tok), sink)
    try:
        _run(loop, sink, {**PROMPTS, "after": "late one"})
    finally:
        loop.stop()
    return {rid: sink.ids(rid) for rid in sink.items}


def _assert_idle(inst: Instance) -> None:
    """Every KV slot and reservation is back."""
    import gc

    gc.collect()  # caches give their pool slots back when they are dropped
    pool = inst.engine.runner.pool
    assert inst.scheduler.kv_reserved == 0 and not inst.scheduler.resident and not inst.seqs
    assert pool.free == pool.slots and pool.beyond == 0


@pytest.mark.parametrize("after", [0, 3])
def test_a_request_that_breaks_its_rounds_fails_alone_and_the_others_finish_as_without_it(tok, reference, after):
    """The culprit breaks every round it is in (from the first round, or from the fourth, when the others are
    mid-block): it gets a 500, found in about log2(batch) more failed rounds; every other request ends with
    the very tokens of a run without the fault, streamed once each; the instance then serves a new request."""
    model = make_model()
    inst = _instance(model, tok)
    culprit = "r4"
    fault = Faulty(inst, culprit, after=after)
    sink = Sink()
    loop = RoundLoop(inst, sink)
    try:
        _run(loop, sink, PROMPTS)
        err = sink.ended(culprit)
        assert isinstance(err, ErrorItem) and err.status == 500 and "CUDA out of memory" in err.message
        for rid in PROMPTS:
            if rid != culprit:
                assert sink.ended(rid).done is not None, rid
                assert sink.ids(rid) == reference[rid], rid
        s = loop.stats()
        # 7 requests: the batch's failure, then one per halving down to the culprit, then once more alone
        assert s["requests_failed"] == 1 and s["requests_given_up"] == 0 and s["requests_reset"] == 0
        assert fault.failed == s["rounds_failed"] and 2 <= s["rounds_failed"] <= 2 + len(PROMPTS).bit_length()
        assert s["probe_rounds"] >= 1
        assert culprit not in inst.seqs and not loop.probing.strikes and not loop.probing.probes
        _run(loop, sink, {"after": "late one"})  # the instance keeps serving
        assert sink.ended("after").done is not None and sink.ids("after") == reference["after"]
        assert loop.broken is None
    finally:
        loop.stop()
    _assert_idle(inst)


def test_one_failed_round_fails_nobody(tok, reference):
    """A round that fails once (a transient out-of-memory error): its requests run again, and every request
    ends with the tokens of a run without the failure."""
    inst = _instance(make_model(), tok)
    fault = Faulty(inst, "r2", after=2, times=1)
    sink = Sink()
    loop = RoundLoop(inst, sink)
    try:
        _run(loop, sink, PROMPTS)
        assert fault.failed == 1 and loop.stats()["rounds_failed"] == 1 and loop.stats()["requests_failed"] == 0
        for rid in PROMPTS:
            assert sink.ended(rid).done is not None and sink.ids(rid) == reference[rid], rid
    finally:
        loop.stop()
    _assert_idle(inst)


def test_a_round_that_fails_half_applied_restarts_its_requests_from_what_they_published(tok):
    """The fault strikes after the engine ran the round: the round's requests start over from the tokens
    they had published (KV slots and reservations given back and taken again); the culprit is still
    isolated, and every other request completes, each token streamed once."""
    inst = _instance(make_model(), tok)
    culprit = "r1"
    Faulty(inst, culprit, after=2, when_after=True)
    sink = Sink()
    loop = RoundLoop(inst, sink)
    try:
        _run(loop, sink, PROMPTS)
        err = sink.ended(culprit)
        assert isinstance(err, ErrorItem) and err.status == 500 and "after the step" in err.message
        for rid in PROMPTS:
            if rid != culprit:
                done = sink.ended(rid).done
                assert done is not None and done.completion_tokens == len(sink.ids(rid)), rid
        s = loop.stats()
        assert s["requests_reset"] >= len(PROMPTS) and s["requests_failed"] == 1
    finally:
        loop.stop()
    _assert_idle(inst)


def test_a_tensor_parallel_instance_isolates_the_culprit_without_breaking(tok):
    """A request that breaks the tensor-parallel round (every rank answering) from the third round on: every
    failed round's requests start over on every rank (a follower may have run the round), the bisection still
    isolates the culprit (500), the others complete, and the failures in a row stay under what breaks the
    instance."""
    culprit, rounds = "r5", []

    def mirror(commands, plan):
        rounds.append(plan)
        if any(s.req_id == culprit for s in plan.slots) and len(rounds) > 2:
            raise RuntimeError("collective failed (injected)")
        return lambda: None

    inst = Instance(Engine(make_model(), tok, max_slots=8), slots=8, mirror=mirror, followers_alive=lambda: True)
    sink = Sink()
    loop = RoundLoop(inst, sink)
    try:
        _run(loop, sink, PROMPTS)
        assert sink.ended(culprit).status == 500 and loop.broken is None
        for rid in PROMPTS:
            if rid != culprit:
                done = sink.ended(rid).done
                assert done is not None and done.completion_tokens == len(sink.ids(rid)), rid
        s = loop.stats()
        assert s["requests_failed"] == 1 and s["requests_reset"] >= len(PROMPTS)
    finally:
        loop.stop()
    _assert_idle(inst)


def test_a_fault_that_comes_back_after_a_restart_is_still_isolated(tok):
    """The culprit's round fails once it has taken a step (as a fault past a prefill would), half-applied: it
    starts over and passes its first step again each time. Passing steps it had already taken clears nothing,
    so it is still isolated, and no loop of restarts goes on for ever."""
    inst = _instance(make_model(), tok)
    culprit = "r3"
    real = inst.execute

    def execute(plan):
        result = real(plan)
        if any(s.req_id == culprit for s in plan.slots) and len(inst.seqs[culprit].history) >= 2:
            raise RuntimeError("fails past its first step (injected)")
        return result

    inst.execute = execute
    sink = Sink()
    loop = RoundLoop(inst, sink)
    try:
        for rid, p in PROMPTS.items():
            loop.submit(rid, p, SamplingParams(max_tokens=40, threshold=1.0))  # one token a step at most
        sink.wait(PROMPTS)
        assert sink.ended(culprit).status == 500
        assert all(sink.ended(r).done is not None for r in PROMPTS if r != culprit)
        assert loop.stats()["rounds_failed"] <= 12
    finally:
        loop.stop()
    _assert_idle(inst)


def test_an_instance_whose_every_round_fails_gives_its_requests_back_then_breaks(tok):
    """Every round fails, whatever it holds: no request is blamed (503: resume it elsewhere); after
    ``broken_after`` such give-ups with no successful round the loop ends as a broken instance."""
    inst = _instance(make_model(), tok)

    def always(plan):
        raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")

    inst.execute = always
    sink, fatal = Sink(), []
    loop = RoundLoop(inst, sink, on_fatal=fatal.append, broken_after=3)
    try:
        for rid in ("a", "b", "c"):
            loop.submit(rid, "abc", SamplingParams(max_tokens=8), attempt=2)
        sink.wait(["a", "b", "c"])
        for rid in ("a", "b", "c"):
            err = sink.ended(rid)
            assert err.status == 503 and err.attempt == 2 and "resume it elsewhere" in err.message
        deadline = time.monotonic() + 10
        while not fatal and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "3 requests given up on" in loop.broken and len(fatal) == 1 and not loop.stats()["alive"]
    finally:
        loop.stop()


def test_a_lone_request_that_fails_is_given_back_once_then_failed(tok, reference):
    """Alone on an idle instance, a failing request proves nothing against itself: it is given back (503).
    Sent here again (its next attempt), it fails alone again: now it is at fault (500). The instance is
    not broken and serves the next request."""
    inst = _instance(make_model(), tok)
    Faulty(inst, "bad")
    sink = Sink()
    loop = RoundLoop(inst, sink)
    try:
        loop.submit("bad", "abc", SamplingParams(**PARAMS), attempt=1)
        sink.wait(["bad"])
        assert sink.ended("bad").status == 503
        sink.items.pop("bad")
        loop.submit("bad", "abc", SamplingParams(**PARAMS), attempt=2)
        sink.wait(["bad"])
        err = sink.ended("bad")
        assert err.status == 500 and err.attempt == 2
        _run(loop, sink, {"after": "late one"})
        assert sink.ids("after") == reference["after"] and loop.broken is None
    finally:
        loop.stop()
    _assert_idle(inst)


# ---- through the ingress's dispatcher ---------------------------------------------------------------

def _replica(culprit: str | None = None, **loop_kwargs):
    from app.replica import ReplicaServer
    from engine.loading import load_engine
    from predictors.bundle import load_predictors
    from predictors.features import state_row

    inst = Instance(load_engine("tiny-bd", max_slots=4, max_gen_length=256), slots=4)
    load_predictors("tiny-bd").attach(inst)
    if culprit is not None:
        Faulty(inst, culprit, after=2)
    return ReplicaServer(inst, describe=state_row, tick_s=0.2, **loop_kwargs)


def _serve(culprit: str | None, **loop_kwargs):
    """Eight fixed-threshold requests over two instances whose rounds fail whenever ``culprit`` is in them
    (every round, with ``culprit="*"`` on the first instance): (dispatcher, {id: (text, last event)},
    {id: instance it was first placed on})."""
    import asyncio

    from tests.builders import collect, examples, make_dispatcher, submit

    async def main():
        reps = [_replica(culprit, **loop_kwargs), _replica(None if culprit == "*" else culprit)]
        if culprit == "*":
            reps[0].loop.instance.execute = _always_fails
        d = make_dispatcher()
        for i, r in enumerate(reps):
            await d.connect(f"f{i}", 1, **r.info())
        exs = examples(8)
        streams = {f"q{i}": submit(d, f"q{i}", e.prompt, 24, threshold=0.9) for i, e in enumerate(exs)}
        placed = {rid: d.live[rid].state.instance for rid in streams}
        results = dict(zip(streams, await asyncio.gather(*(collect(s) for s in streams.values()))))
        stats = [r.loop.stats() for r in reps]
        for r in reps:
            r.close()
        return d, results, placed, stats

    return asyncio.run(main())


def _always_fails(plan):
    raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")


@pytest.fixture(scope="module")
def served():
    """The eight requests' texts without any fault."""
    d, results, _, _ = _serve(None)
    assert all(last["type"] == "done" for _, last in results.values()), results
    return {rid: text for rid, (text, _) in results.items()}


@pytest.mark.slow  # a replica pair served twice (~10 s on 2 cores)
def test_through_the_dispatcher_only_the_culprit_fails_and_the_others_keep_their_text(served):
    d, results, placed, stats = _serve("q3")
    text, last = results["q3"]
    assert last["type"] == "error" and last["status"] == 500 and "CUDA out of memory" in last["message"]
    assert last["accepted"] and d.stats["resumed"] == 0 and d.stats["instances_lost"] == 0
    for rid, (text, last) in results.items():
        if rid != "q3":
            assert last["type"] == "done" and text == served[rid] and last["resumes"] == 0, (rid, last)
    where = placed["q3"]
    assert stats[where]["requests_failed"] == 1 and stats[where]["rounds_failed"] >= 2
    assert any(i == where for r, i in placed.items() if r != "q3")  # it shared its instance with others
    assert not d.live


@pytest.mark.slow  # a replica pair served twice (~10 s on 2 cores)
def test_through_the_dispatcher_requests_an_instance_gives_up_on_resume_on_another(served):
    """Every round of the first instance fails: it blames no request but hands each back (503), and the
    dispatcher resumes them on the other instance, where they end with the text of a run without faults."""
    d, results, placed, stats = _serve("*", broken_after=100)
    moved = [rid for rid, i in placed.items() if i == 0]
    assert moved and stats[0]["requests_given_up"] == len(moved) and stats[0]["requests_failed"] == 0
    for rid, (text, last) in results.items():
        assert last["type"] == "done" and text == served[rid], (rid, last)
        assert last["resumes"] == (rid in moved)
    assert d.stats["resumed"] == len(moved) and d.stats["instances_lost"] == 0


def test_a_request_given_up_goes_to_another_instance_or_again_to_its_only_one():
    """An ``ErrorItem`` 503 (the instance gave the request up) resumes it: on another instance when there is
    one, else on the same one again, ``max_resumes`` times at most; a 500 fails it at once."""
    import asyncio

    from app.protocol import Add, ProgressBatch
    from tests.builders import make_dispatcher
    from tests.fakes import RecordingLink

    def gave_up(d, inst, attempt, status=503):
        d.handle_batch(inst, ProgressBatch(0.0, 1, 1.0, items=[ErrorItem("q", "rounds failed", status, attempt)]))

    async def main():
        d = make_dispatcher()
        links = [RecordingLink(), RecordingLink()]
        ids = [d.attach(f"r{i}", 1, links[i], read=False) for i in range(2)]
        d.submit("q", [5, 6, 7], 8)
        first = d.live["q"].state.instance
        gave_up(d, first, 1)
        other = ids[1 - ids.index(first)]
        add = links[other].sent[-1]
        assert isinstance(add, Add) and add.attempt == 2 and d.live["q"].state.instance == other
        sent = [len(link.sent) for link in links]
        gave_up(d, other, 2, status=500)  # at fault: failed, not resumed
        assert "q" not in d.live and [len(link.sent) for link in links] == sent

        alone = make_dispatcher()
        link = RecordingLink()
        only = alone.attach("r", 1, link, read=False)
        stream = alone.submit("q", [5, 6, 7], 8)
        for attempt in range(1, alone.max_resumes + 1):
            gave_up(alone, only, attempt)
            assert link.sent[-1].attempt == attempt + 1  # the same instance, as its next attempt
        gave_up(alone, only, alone.max_resumes + 1)
        events = [e async for e in stream]
        assert events[-1]["type"] == "error" and events[-1]["status"] == 500 and "failed on" in events[-1]["message"]

    asyncio.run(main())
