"""The ingress's dispatcher against real instances on their control channels, in-process (no Ray):
placement across instances, streamed text, thresholds from the router, cancellation, and requests
resumed when an instance dies."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

import tasksuite as tasks
from app.channel import ChannelError, Link, frame
from app.config import AppConfig
from app.dispatch import Dispatcher, DispatchError
from app.protocol import ProgressBatch, Tick
from app.replica import ReplicaServer
from cluster.factory import build_router
from engine.instance import Instance
from engine.loading import load_engine
from predictors.bundle import load_predictors
from predictors.features import state_row
from tests.builders import collect, examples, make_dispatcher, make_replica, submit, tiny_bd_tokenizer
from tests.fakes import RecordingLink


@pytest.fixture(scope="module")
def replicas():
    reps = [make_replica(), make_replica()]
    yield reps
    for r in reps:
        r.close()


def test_requests_spread_over_instances_and_stream_correct_answers(replicas):
    async def main():
        d = make_dispatcher()
        for i, r in enumerate(replicas):
            await d.connect(f"r{i}", 1, **r.info())
        exs = examples(24)
        streams = [submit(d, f"q{i}", e.prompt, 16, slo_ms=30_000) for i, e in enumerate(exs)]
        placed = {d.live[f"q{i}"].state.instance for i in range(len(exs))}
        results = await asyncio.gather(*(collect(s) for s in streams))
        return d, exs, results, placed

    d, exs, results, placed = asyncio.run(main())
    assert placed == {0, 1}  # the router used both instances
    assert all(last["type"] == "done" for _, last in results)
    assert all(text == last["text"] for text, last in results)  # the deltas add up to the answer
    assert all(last["tp"] == 1 for _, last in results)  # the degree it finished on (the planner's measured input)
    correct = sum(e.check(text) for e, (text, _) in zip(exs, results))
    assert correct >= 0.8 * len(exs), correct
    # the router chose each request's thresholds from the candidates, step by step
    used = {last["threshold"] for _, last in results}
    assert used and all(0.7 <= t <= 0.9 for t in used)
    assert not d.live and all(d.driver.instance(i).n == 0 for i in d.driver.serving()) and d.driver.serving()


class Rank:
    """A tensor-parallel follower rank as the instance sees it (``Instance(mirror=...)``), that can die."""

    def __init__(self) -> None:
        self.dead = False

    def __call__(self, commands, plan):
        if self.dead:
            raise ConnectionError("rank 1 is gone")  # what a lost TP worker's call raises
        return lambda: None


@pytest.mark.parametrize("fault", ["replica", "tp-rank"])
def test_a_dead_instance_loses_no_request(fault):
    """The replica's process dies (its socket closes), or one of its TP ranks dies (the instance can run
    no round: it hangs up without failing its requests): either way they resume on the other instance."""
    rank = Rank()

    def kill(rep):
        if fault == "replica":
            rep.close()
        else:
            rank.dead = True

    async def main():
        reps = [make_replica(slots=4, mirror=rank), make_replica(slots=4)]
        d = make_dispatcher()
        for i, r in enumerate(reps):
            await d.connect(f"k{i}", 1, **r.info())
        exs = examples(16)
        # one token per step: long enough to be caught mid-way
        streams = [submit(d, f"q{i}", e.prompt, 16, threshold=0.9999) for i, e in enumerate(exs)]
        victims = [rid for rid, lv in d.live.items() if lv.state.instance == 0]
        for _ in range(200):  # kill instance 0 once some of its requests have committed text
            await asyncio.sleep(0.02)
            if any(d.live.get(r) is not None and d.live[r].committed for r in victims):
                break
        kill(reps[0])
        results = await asyncio.gather(*(collect(s) for s in streams))
        for r in reps:
            r.close()
        return d, exs, results, victims, reps

    d, exs, results, victims, reps = asyncio.run(main())
    assert victims
    if fault == "tp-rank":
        assert "rank 1 is gone" in reps[0].loop.broken and not reps[0].loop.stats()["alive"]
    assert len(results) == len(exs) and all(last["type"] == "done" for _, last in results), results
    assert all(text == last["text"] for text, last in results)
    assert d.stats["instances_lost"] == 1 and d.stats["failed_over"] >= 1
    assert sum(last["resumes"] for _, last in results) == d.stats["failed_over"]
    correct = sum(e.check(text) for e, (text, _) in zip(exs, results))
    assert correct >= 0.75 * len(exs), correct


def test_cancel_frees_the_instance_and_errors_are_clean(replicas):
    async def main():
        d = make_dispatcher()
        d.park_s = 0.3
        early = submit(d, "early", "rev: abc", 16)  # no instance yet: it waits, then 503
        _, gave_up = await collect(early)
        assert gave_up["type"] == "error" and gave_up["status"] == 503, gave_up
        d.park_s = 0
        with pytest.raises(DispatchError) as none_ready:
            submit(d, "x", "rev: abc", 16)
        d.park_s = 30
        waiting = submit(d, "waits", "rev: abc", 16)  # served once an instance joins
        await d.connect("c0", 1, **replicas[0].info())
        text, last = await collect(waiting)
        assert last["type"] == "done" and text == "cba", last
        s = submit(d, "long", "story: owl 8", 200, threshold=0.999)
        first = await s.__anext__()
        assert first["type"] == "accepted"
        s.cancel()
        state = {}
        for _ in range(100):
            await asyncio.sleep(0.05)
            state = replicas[0].loop.stats()
            if state["resident"] == 0 and state["kv_reserved_tokens"] == 0:
                break
        bad = submit(d, "bad", "x" * 600, 16)  # the instance refuses it: a clean 400
        _, last = await collect(bad)
        return none_ready.value, state, last, d

    none_ready, state, last, d = asyncio.run(main())
    assert none_ready.status == 503
    assert state["resident"] == 0 and state["kv_reserved_tokens"] == 0, state
    assert last["type"] == "error" and last["status"] == 400
    assert not d.live


def test_stop_string_ends_the_text_and_frees_the_instance(replicas):
    """A stop string found in the committed text ends the answer before it (streamed text too), with
    finish_reason stop, and the request's slot and KV are freed on its instance at once."""
    async def main():
        d = make_dispatcher()
        await d.connect("s0", 1, **replicas[0].info())
        full_text, full = await collect(submit(d, "full", "story: owl 8", 200, threshold=0.999))
        words = full_text.split()
        assert len(words) > 6, full_text
        stop = " " + words[3]
        r0 = replicas[0].loop.stats()["rounds"]
        streamed, last = await collect(submit(d, "stop", "story: owl 8", 200, threshold=0.999, stop=[stop]))
        state = {}
        for _ in range(100):
            state = replicas[0].loop.stats()
            if state["resident"] == 0 and state["kv_reserved_tokens"] == 0:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # nothing left to run: no more rounds
        return full_text, full, stop, streamed, last, state, replicas[0].loop.stats()["rounds"] - r0, d

    full_text, full, stop, streamed, last, state, rounds, d = asyncio.run(main())
    cut = full_text[:full_text.index(stop)]
    assert streamed == last["text"] == cut
    assert last["finish_reason"] == "stop" and last["completion_tokens"] < full["completion_tokens"]
    assert state["resident"] == 0 and state["kv_reserved_tokens"] == 0, state
    assert rounds < full["rounds"] / 2, (rounds, full["rounds"])  # cancelled at the stop, not run to its end
    assert not d.live


def test_canvas_events_replay_the_answer_step_by_step(replicas):
    """A request sent with ``canvas`` gets one canvas event per denoising step: every answer position is
    committed exactly once, by one step, with the token the answer has there; masked positions are those
    of the step's block not committed yet."""
    async def main():
        d = make_dispatcher()
        await d.connect("v0", 1, **replicas[1].info())
        stream = submit(d, "c", "story: owl 8", 40, threshold=0.9, canvas=True)
        views, text, last = [], "", None
        async for event in stream:
            if event["type"] == "canvas":
                views.append(event["canvas"])
            elif event["type"] == "delta":
                text += event["text"]
            last = event
        plain_text, _ = await collect(submit(d, "p", "story: owl 8", 40, threshold=0.9))
        return views, text, last, plain_text

    views, text, last, plain_text = asyncio.run(main())
    assert last["type"] == "done" and text == last["text"] == plain_text  # the canvas changes nothing else
    assert views and [v["step"] for v in views] == list(range(1, len(views) + 1))  # every denoising step, once
    committed = {}
    for v in views:
        bs, be = v["block"]
        for pos, tok, piece in v["committed"]:
            assert bs <= pos < be and pos not in committed and pos not in v["masked"]
            committed[pos] = tok
            assert isinstance(piece, str)
        assert all(bs <= p < be and p not in committed for p in v["masked"])
        assert v["instance"] is not None and v["tp"] == 1 and v["length"] >= 40
    ids = ids_of_answer(text)
    assert [committed[p] for p in range(len(ids))] == ids


def ids_of_answer(text: str) -> list[int]:
    return tiny_bd_tokenizer().encode(text)


@pytest.mark.slow
def test_online_learners_train_on_the_requests_served(replicas):
    """With the online learners (no shipped predictor), every finished request's step rows and rounds reach
    them, a refit runs off the event loop, and the router estimates with the learnt model."""
    import time as _time

    from cluster import OnlineStepEstimator
    from cluster.learning import LiveLearning
    from predictors.online import OnlineAdmissionLearner, OnlineStepLearner

    cfg = AppConfig(engine={"model": "tiny-bd", "slots": 8})
    step = OnlineStepLearner(cfg.router.thresholds, min_requests=8, refit_every=8)
    learning = LiveLearning(step, OnlineAdmissionLearner(min_requests=8, refit_every=8))

    async def main():
        from engine.loading import resolve_model
        from engine.models.loader import load_config

        mcfg = load_config(resolve_model("tiny-bd"))
        d = Dispatcher(build_router(cfg, mcfg, learning), ids_decode(), block_tokens=mcfg.block_size,
                       full_sequence=False, per_instance_limit=cfg.engine.slots * 8 + cfg.engine.max_waiting,
                       learning=learning)
        counters = d.driver.counters()
        assert counters["estimator"] == OnlineStepEstimator.__name__ and counters["policy"] == "remask-fit"
        for i, r in enumerate(replicas):
            await d.connect(f"l{i}", 1, **r.info())
        prompts = PROSE * 8
        results = await asyncio.gather(*(collect(submit(d, f"q{i}", p, 48, slo_ms=30_000))
                                         for i, p in enumerate(prompts)))
        return results

    try:
        results = asyncio.run(main())
        deadline = _time.monotonic() + 60
        while len(step.history) < 1 or len(learning.admission.history) < 1:
            assert _time.monotonic() < deadline, "no refit within 60 s"
            _time.sleep(0.05)
        info = learning.describe()
    finally:
        learning.close()
    assert all(last["type"] == "done" for _, last in results)
    assert learning.recorded == 16 and step.seen == 16
    assert step.history[0]["trained_on"] >= 6 and step.history[0]["rows"] > 50, step.history
    assert info["step"]["tokens_per_step"], info  # the prior is measured: tokens a step commits per threshold
    assert info["step"]["source"] in ("prior", "online") and info["refit_errors"] == 0, info


def ids_decode():
    return tiny_bd_tokenizer().decode


def test_channel_refuses_a_wrong_secret_and_oversized_frames(replicas):
    host, port = replicas[1].channel.address

    async def main():
        with pytest.raises(ChannelError):
            await Link.open(host, port, "not-the-secret", timeout_s=5)

    asyncio.run(main())
    with socket.create_connection((host, port)) as sock:  # a frame header claiming 4 GiB
        sock.sendall(b"\xff\xff\xff\xff")
        sock.settimeout(5)
        assert sock.recv(16) == b""  # the replica hung up, without reading the rest
    assert len(frame(Tick(0.0))) < 64


@pytest.mark.slow
def test_router_migrates_requests_to_a_new_instance():
    """tiny-mdm (full-sequence, approximate cache): requests piled on one instance move to a second one
    that joins, at block boundaries (their next step recomputes anyway), and still finish correctly."""
    from engine.loading import resolve_model
    from engine.models.loader import load_config
    from engine.tokenizer import load_tokenizer

    def mdm_replica() -> ReplicaServer:
        engine = load_engine("tiny-mdm", max_slots=8, max_gen_length=256)
        inst = Instance(engine, slots=8)
        load_predictors("tiny-mdm").attach(inst)
        return ReplicaServer(inst, describe=state_row, tick_s=0.2)

    async def main():
        reps = [mdm_replica(), mdm_replica()]
        cfg = AppConfig(engine={"model": "tiny-mdm", "slots": 8})
        path = resolve_model("tiny-mdm")
        mcfg = load_config(path)
        d = Dispatcher(build_router(cfg, mcfg), load_tokenizer(path).decode, block_tokens=mcfg.block_size,
                       full_sequence=True, per_instance_limit=200)
        await d.connect("m0", 1, **reps[0].info())
        exs = [e for e in tasks.heldout_set(400) if e.category == "prose"][:12]
        streams = [submit(d, f"q{i}", e.prompt, 96, slo_ms=30_000) for i, e in enumerate(exs)]
        await d.connect("m1", 1, **reps[1].info())
        results = await asyncio.gather(*(collect(s) for s in streams))
        for r in reps:
            r.close()
        return d, exs, results

    d, exs, results = asyncio.run(main())
    assert all(last["type"] == "done" and text == last["text"] for text, last in results)
    assert d.stats["migrated"] >= 1 and d.driver.counters()["migrations"] >= 1
    assert sum(last["migrations"] for _, last in results) >= 1
    assert sum(e.check(text) for e, (text, _) in zip(exs, results)) >= 0.5 * len(exs)


PROSE = ["story: fox 8", "story: owl 6"]


def test_requests_wait_for_a_replacement_when_the_only_instance_dies():
    async def main():
        first = make_replica(slots=4)
        d = make_dispatcher()
        await d.connect("only", 1, **first.info())
        streams = [submit(d, f"w{i}", p, 200, threshold=0.9999) for i, p in enumerate(PROSE)]
        for _ in range(200):
            await asyncio.sleep(0.02)
            if any(len(lv.committed) > 1 for lv in d.live.values()):
                break
        first.close()
        for _ in range(100):
            await asyncio.sleep(0.02)
            if d.parked:
                break
        parked = len(d.parked)
        second = make_replica(slots=4)  # the replacement joins; the parked requests resume on it
        await d.connect("replacement", 1, **second.info())
        results = await asyncio.gather(*(collect(s) for s in streams))
        second.close()
        return parked, results

    parked, results = asyncio.run(main())
    assert parked >= 1
    assert all(last["type"] == "done" and tasks.check("prose", p, text) for p, (text, last) in zip(PROSE, results))


def test_load_control_sheds_arrivals_the_cluster_cannot_serve_in_time(replicas):
    async def main():
        d = make_dispatcher()
        await d.connect("s0", 1, **replicas[0].info())
        relaxed = [submit(d, f"ok{i}", "story: fox 8", 200, slo_ms=60_000) for i in range(8)]
        shed_relaxed = d.stats["shed"]
        tight, refused = [], 0
        for i in range(80):  # a burst whose SLOs the one instance cannot all meet
            try:
                tight.append(submit(d, f"t{i}", "rev: abcdef", 16, slo_ms=300))
            except DispatchError as exc:
                assert exc.status == 429
                refused += 1
        results = await asyncio.gather(*(collect(s) for s in relaxed + tight))
        return d, shed_relaxed, refused, len(tight), results

    d, shed_relaxed, refused, admitted, results = asyncio.run(main())
    assert shed_relaxed == 0
    assert refused > 0 and admitted > 0 and d.stats["shed"] == refused
    assert all(last["type"] == "done" for _, last in results)  # what was admitted completes
    assert not d.live and not d.driver.active()


def test_two_ingresses_share_a_replica_and_keep_their_own_requests():
    """A redeploy's old and new ingress both connected to one replica: each sees only its own requests'
    progress, and the old one going away aborts only its requests."""
    async def main():
        rep = make_replica(slots=4)
        old, new = make_dispatcher(), make_dispatcher()
        await old.connect("r", 1, **rep.info())
        await new.connect("r", 1, **rep.info())
        keep = [submit(new, f"n{i}", p, 200, threshold=0.9999) for i, p in enumerate(PROSE)]
        submit(old, "o0", "story: elk 7", 200, threshold=0.9999)
        deadline = time.monotonic() + 20  # a loaded CI machine can take seconds over the first rounds
        while time.monotonic() < deadline:
            await asyncio.sleep(0.02)
            if all(lv.committed for lv in new.live.values()) and len(old.live["o0"].committed) > 1:
                break
        both_streamed = len(old.live["o0"].committed) > 1 and all(lv.committed for lv in new.live.values())
        old.instances[0].link.close()  # the old ingress's process ends
        for _ in range(100):
            await asyncio.sleep(0.02)
            if rep.loop.stats()["resident"] + rep.loop.stats()["waiting"] <= len(PROSE):
                break
        after_close = rep.loop.stats()
        results = await asyncio.gather(*(collect(s) for s in keep))
        rep.close()
        return after_close, results, both_streamed

    after_close, results, both_streamed = asyncio.run(main())
    assert both_streamed  # both ingresses were served at once
    assert after_close["resident"] + after_close["waiting"] <= len(PROSE), after_close  # only its own went
    assert all(last["type"] == "done" and tasks.check("prose", p, text) for p, (text, last) in zip(PROSE, results))


def test_a_draining_replica_hands_its_requests_over_and_takes_no_new_ones():
    """A replica shutting down (redeploy, scale-down) says so: its requests move to the other instance
    from their committed tokens (no failure counted), new ones go elsewhere, and it drains to empty."""
    async def main():
        reps = [make_replica(slots=4), make_replica(slots=4)]
        d = make_dispatcher()
        for i, r in enumerate(reps):
            await d.connect(f"g{i}", 1, **r.info())
        streams = [submit(d, f"q{i}", p, 200, threshold=0.9999) for i, p in enumerate(PROSE * 2)]
        on_first = [rid for rid, lv in d.live.items() if lv.state.instance == 0]
        for _ in range(200):
            await asyncio.sleep(0.02)
            if any(len(d.live[r].committed) > 1 for r in on_first if r in d.live):
                break
        left = await asyncio.to_thread(reps[0].drain, 30.0)
        later = submit(d, "later", "rev: abc", 16)
        results = await asyncio.gather(*(collect(s) for s in streams + [later]))
        for r in reps:
            r.close()
        return d, on_first, left, results

    d, on_first, left, results = asyncio.run(main())
    assert on_first and left == 0
    assert d.stats["drained"] == len(on_first) and d.stats["failed_over"] == 0
    assert all(last["type"] == "done" for _, last in results), results
    assert all(tasks.check("prose", p, text) for p, (text, _) in zip(PROSE * 2, results))
    assert results[-1][0] == "cba" and list(d.instances) == [1]


def test_admission_governor_cuts_on_misses_and_grows_back_while_shedding():
    from cluster.admission import AdmissionGovernor

    g = AdmissionGovernor(window_s=0.5, min_requests=4, start=1.0)
    for k in range(4):  # admitted under util 1.0: half of them miss
        g.finished(k % 2 == 0, 0.1 * k, shed=0)
    assert g.util == 1.0  # the window is not over yet
    g.finished(False, 0.6, shed=0)
    assert g.util == pytest.approx(0.7) and g.epoch == 1 and g.cuts == 1
    for k in range(10):  # all met, but nothing shed: no reason to admit more
        g.finished(True, 1.0 + 0.1 * k, shed=0)
    assert g.util == pytest.approx(0.7)
    for k in range(6):  # all met while arrivals are being shed: admit more
        g.finished(True, 3.0 + 0.1 * k, shed=50 + k)
    assert g.util == pytest.approx(0.77)


def test_effective_round_time_includes_the_gaps_between_consecutive_rounds():
    from app.dispatch import InstanceLink

    inst = InstanceLink(0, "r", 1, None, 0.0)

    def eff(n: int, t: float, round_ms: float) -> float:
        return inst.effective_round_ms(ProgressBatch(t, n, round_ms))

    assert eff(5, 100.0, 10.0) == 10.0  # no previous round: its own time
    assert eff(6, 100.025, 10.0) == pytest.approx(25.0)  # CPU shared
    assert eff(7, 101.0, 10.0) == 10.0  # idle in between
    assert eff(9, 101.015, 10.0) == 10.0  # not consecutive


def test_a_request_back_on_its_first_instance_ignores_that_instance_s_stale_progress():
    """A -> B -> A: the request leaves A (its queue was full), B refuses it too, and it is back on A as a
    third attempt while A's round of the first attempt is still being reported: that round's tokens are
    stale and must not reach the client."""
    from app.protocol import Add
    from engine.progress import Done, ErrorItem, StepItem

    async def main():
        d = make_dispatcher()
        links = [RecordingLink(), RecordingLink()]
        a, b = (d.attach(f"r{i}", 1, links[i], read=False) for i in range(2))
        stream = d.submit("q", [5, 6, 7], 8)
        first = d.live["q"].state.instance
        other = b if first == a else a
        add1 = links[first].sent[-1]
        assert isinstance(add1, Add) and add1.attempt == 1
        d.handle_batch(first, ProgressBatch(0.0, 1, 1.0, items=[ErrorItem("q", "full", 429, 1)]))
        add2 = links[other].sent[-1]
        assert isinstance(add2, Add) and add2.attempt == 2 and d.live["q"].state.instance == other
        d.handle_batch(other, ProgressBatch(0.0, 1, 1.0, items=[ErrorItem("q", "full", 429, 2)]))
        add3 = links[first].sent[-1]
        assert isinstance(add3, Add) and add3.attempt == 3 and d.live["q"].state.instance == first
        # A reports the first attempt's step (tokens 90, 91), then the third attempt's
        d.handle_batch(first, ProgressBatch(0.0, 2, 1.0, items=[StepItem("q", [90, 91], 1, False, attempt=1)]))
        assert d.live["q"].committed == []
        d.handle_batch(first, ProgressBatch(0.0, 3, 1.0, items=[
            StepItem("q", [11, 12], 1, False, done=Done("length", 1, 2), attempt=3)]))
        events = []
        async for e in stream:
            events.append(e)
        done = events[-1]
        assert done["type"] == "done" and done["completion_tokens"] == 2 and done["resumes"] == 2
        assert d.decode([11, 12]) == done["text"]

    asyncio.run(main())
