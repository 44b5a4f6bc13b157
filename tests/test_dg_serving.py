"""DiffusionGemma served through the instance stack (engine/canvas_serving.py, issue 41's serving criterion):

- ``load_engine`` on a DiffusionGemma checkpoint (built by transformers: tests/checkpoints.py) gives a
  ``CanvasServeEngine`` that answers as the offline ``CanvasEngine`` does, through ``Instance`` (the DWISE
  scheduler) too: one prompt prefill, then denoising rounds; the first canvas's steps refine the estimate;
- the router's level reaches the renoise rule as its entropy bound (``knob_at``); a masked rule is refused;
- the HTTP front with an in-process replica serves completions and streamed chat through the openai client:
  the streamed deltas join to the plain answer and to the offline engine's; an image content part is a 400;
- a seeded request (and one without a seed: the engine's draw travels in its resume state) resumed on a fresh
  engine from its published canvases ends as the uninterrupted run;
- structured outputs (``guided_regex``, ``response_format``) are enforced on its canvases through the front;
- ``remask serve google/diffusiongemma-26B-A4B-it --dry-run`` from an offline hub cache writes a serve config
  the app's config class accepts, whose model resolves to the cached checkpoint.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from engine.commands import SamplingParams
from tests.builders import collect
from tests.dg_builders import ThreadAllReduce

PROMPT = "What is 2+2?"
HUB_ID = "google/diffusiongemma-26B-A4B-it"


@pytest.fixture(scope="module")
def dg_dir(tmp_path_factory):
    from tests.checkpoints import build_diffusion_gemma

    return build_diffusion_gemma(tmp_path_factory.mktemp("dgserve") / "ckpt")


@pytest.fixture(scope="module")
def served(dg_dir):
    from engine.loading import load_engine

    return load_engine(str(dg_dir), max_slots=4)


def offline(engine, prompt: str | list[int], max_tokens: int, seed: int, bound: float | None = None):
    """The offline CanvasEngine's answer (engine/canvas.py) for the same model, prompt (text: as a chat turn;
    else token ids) and seed."""
    from engine.canvas import CanvasEngine, CanvasParams

    ref = CanvasEngine(engine.model, engine.tokenizer)
    ids = engine.tokenizer.prompt_ids(prompt, 0) if isinstance(prompt, str) else prompt
    return ref.generate([ids], CanvasParams(max_tokens=max_tokens, seed=seed, entropy_bound=bound))[0]


def test_load_engine_serves_the_family_through_the_instance(served, dg_dir):
    from engine.canvas_serving import CanvasServeEngine
    from engine.instance import Instance
    from engine.loading import load_engine
    from engine.scheduler.types import StepKind

    assert isinstance(served, CanvasServeEngine) and served.rule.name == "renoise"
    assert served.rule.max_denoising_steps == 6  # the checkpoint's generation_config.json
    want = offline(served, PROMPT, 20, 7)
    inst = Instance(served, slots=4)
    req = inst.add_request("a", PROMPT, SamplingParams(max_tokens=20, seed=7))
    inst.add_request("b", "Name a colour.", SamplingParams(max_tokens=20, seed=3))
    # admission: its canvases (20 tokens over canvases of 8: 3) at the rule's step cap
    assert req.est_rounds == 3 * 6 and req.prompt_blocks == 1
    seq = inst.seqs["a"]
    plan, _, _ = inst.step()
    assert [s.kind for s in plan.slots] == [StepKind.PREFILL] * 2  # the prompts' encoder passes, one round
    refined = None
    while "a" not in inst.outputs:
        plan, result, _ = inst.step()
        assert {s.kind for s in plan.slots} == {StepKind.DENOISE}
        out = next((o for o in result.outcomes if o.req_id == "a"), None)
        if out is not None and out.refined_rounds is not None:
            refined = out.refined_rounds
    inst.run()
    got = inst.outputs["a"]
    assert got.token_ids == want.token_ids and got.text == want.text
    assert got.prefill_steps == 1 and got.rounds == sum(want.steps_per_canvas)
    assert refined == want.steps_per_canvas[0] * 3  # the first canvas's steps, for each of its canvases
    assert seq.finished and served.observer.steps_per_canvas
    resumed = inst.add_request("r", PROMPT, SamplingParams(max_tokens=20, seed=7), committed=got.token_ids[:8])
    assert resumed.est_rounds == 2 * 6  # the canvases left at the step cap
    inst.abort("r")
    with pytest.raises(ValueError, match="engine.decoding: 'threshold' decodes masked-diffusion blocks"):
        load_engine(str(dg_dir), rule="threshold")
    with pytest.raises(ValueError, match="decoding: 'threshold' decodes masked-diffusion blocks"):
        served.add_request(PROMPT, SamplingParams(decoding="threshold"))
    with pytest.raises(ValueError, match="logprobs: not served for DiffusionGemma"):
        served.add_request(PROMPT, SamplingParams(logprobs=True))
    with pytest.raises(ValueError, match="images are not served"):
        served.add_request([5, served.dg_cfg.image_token_id])


def test_the_router_level_is_the_entropy_bound(served):
    """The level (threshold) moves the renoise rule's bound through knob_at: a lower level, a higher bound
    (faster); the answer is the offline engine's at that bound."""
    from engine.instance import Instance

    rule = served.rule
    assert rule.knob_at(0.5) > rule.knob_at(0.7) > rule.knob_at(0.9)
    assert rule.knob_at(0.9) == pytest.approx(rule.entropy_bound)
    inst = Instance(served, slots=4)
    inst.add_request("k", PROMPT, SamplingParams(max_tokens=8, seed=5, threshold=0.9))
    inst.step()
    inst.set_threshold("k", 0.2)  # the router's answer: from the next round on
    inst.step()
    assert inst.seqs["k"].inner.params.entropy_bound == pytest.approx(rule.knob_at(0.2))
    inst.run()
    want = offline(served, PROMPT, 8, 5, bound=rule.knob_at(0.2))
    assert inst.outputs["k"].token_ids == want.token_ids


@pytest.mark.parametrize("seeded", [True, False])
def test_a_resumed_request_ends_as_the_uninterrupted_one(served, dg_dir, seeded, monkeypatch):
    """Paused in its second canvas, resumed on a fresh engine from what its replica published (whole canvases)
    and its resume state: the same text. Without a seed, the engine's draw travels in the resume state: the
    engine's first draw is pinned to the seeded case's seed (an answer of two canvases; a free draw may end in the
    first), every later draw differs, so a resume that drew again would not give the same text."""
    from engine import canvas_serving
    from engine.loading import load_engine

    draws = iter([11, *range(1000, 1100)])
    monkeypatch.setattr(canvas_serving.secrets, "randbits", lambda bits: next(draws))
    params = SamplingParams(max_tokens=20, seed=11 if seeded else None)
    seq = served.add_request(PROMPT, params)
    while not seq.finished and not (seq.block_idx == 1 and seq.step_in_block == 2):
        served.step([seq])
    assert not seq.finished, "the fixture's answer ended in its first canvas"
    committed, state = seq.output_ids(), seq.resume_state(len(seq.output_ids()))
    assert len(committed) == 8 and state.tail == []
    while not seq.finished:
        served.step([seq])
    whole = served.output(seq)
    served.sequences.pop(seq.seq_id)
    fresh = load_engine(str(dg_dir))
    again = fresh.add_request(PROMPT, params, committed=committed, resume=state)
    while not again.finished:
        fresh.step([again])
    assert fresh.output(again).token_ids == whole.token_ids


async def _front(engine, model: str, replicas=None, predictors: str = "off"):
    """The HTTP front (as the Ingress builds it, without Ray) and an in-process replica of ``engine`` (or the
    ``replicas`` given), connected."""
    from app.config import AppConfig
    from app.frontend import Frontend
    from app.replica import ReplicaServer
    from app.routes import build_web
    from engine.instance import Instance

    rep = ReplicaServer(Instance(engine, slots=4), tick_s=0.2) if replicas is None else None
    fe = Frontend(AppConfig(engine={"model": model, "slots": 4}, router={"predictors": predictors}))
    for i, r in enumerate([rep] if replicas is None else replicas):
        await fe.dispatcher.connect(f"r{i}", 1, **r.info())
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_web(lambda: fe)), base_url="http://front")
    return http, rep, fe


@pytest.mark.slow  # about 3 s on 2 busy cores: a front, a replica and six requests
def test_completions_and_streamed_chat_through_the_openai_client(served, dg_dir):
    openai = pytest.importorskip("openai")
    model = str(dg_dir)
    tok = served.tokenizer
    want = offline(served, tok.completion_ids(PROMPT, 0), 16, 5)  # the rule's own bound: level 0.9
    colour = [{"role": "user", "content": "Name a colour."}]
    want_chat = offline(served, tok.chat_ids(colour, 0), 20, 9, bound=served.rule.knob_at(0.5))

    async def main():
        http, rep, fe = await _front(served, model)
        client = openai.AsyncOpenAI(base_url="http://front/v1", api_key="none", http_client=http, max_retries=0)
        try:
            assert fe.dispatcher.default_decoding == "renoise"
            level = {"threshold": 0.9}  # the client fixes the router's level: the rule's configured bound
            out = await client.completions.create(model=model, prompt=PROMPT, max_tokens=16, seed=5, extra_body=level)
            assert out.choices[0].text == want.text and out.choices[0].finish_reason == want.finish_reason
            stream = await client.completions.create(model=model, prompt=PROMPT, max_tokens=16, seed=5, stream=True,
                                                     extra_body=level)
            assert "".join([c.choices[0].text async for c in stream if c.choices]) == want.text
            stop = want.text[5:7]  # a stop string inside a canvas ends the text before it
            cut = await client.completions.create(model=model, prompt=PROMPT, max_tokens=16, seed=5, stop=[stop],
                                                  extra_body=level)
            assert cut.choices[0].text == want.text[: want.text.find(stop)] and cut.choices[0].finish_reason == "stop"
            chat = {"model": model, "messages": colour, "max_tokens": 20, "seed": 9,
                    "extra_body": {"threshold": 0.5}}  # a faster level: a higher bound
            plain = await client.chat.completions.create(**chat)
            assert plain.choices[0].message.content == want_chat.text
            stream = await client.chat.completions.create(**chat, stream=True)
            deltas = [c.choices[0].delta.content or "" async for c in stream if c.choices]
            assert "".join(deltas) == want_chat.text
            # canvas by canvas: at most one piece of text per canvas of 8 tokens (and the final chunk)
            assert 1 <= len([d for d in deltas if d]) <= 3
            image = {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}
            r = await http.post("/v1/chat/completions", json=image)
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content.1.type"
            r = await http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 8,
                                                         "decoding": "threshold"})
            assert r.status_code == 400 and "decoding" in r.json()["error"]["message"], r.text
        finally:
            await http.aclose()
            rep.close()

    asyncio.run(main())


@pytest.mark.slow  # about 3 s on 2 busy cores: a front, a replica and constrained requests of many canvases
def test_structured_outputs_are_enforced_on_the_canvases(served, dg_dir):
    """``guided_regex`` (completions) and ``response_format`` (chat, plain and streamed) for a DiffusionGemma
    model: the random checkpoint's own text breaks them; constrained, the answers are valid, end by stop, and
    are the offline engine's with the same constraint and seed (engine/canvas.py ``_check_canvas``)."""
    import json
    import re

    from engine.canvas import CanvasEngine, CanvasParams
    from engine.constraints import ConstraintSpec

    openai = pytest.importorskip("openai")
    jsonschema = pytest.importorskip("jsonschema")
    model, tok = str(dg_dir), served.tokenizer
    regex = r"(red|green|blue)-[0-9]{1,3}"
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["colour", "n"], "additionalProperties": False}
    colour = [{"role": "user", "content": "Name a colour."}]
    ref = CanvasEngine(served.model, served.tokenizer)

    def offline_constrained(ids, spec, max_tokens, seed):
        return ref.generate([ids], CanvasParams(max_tokens=max_tokens, seed=seed, constraint=spec.to_dict()))[0]

    free = offline(served, tok.completion_ids(PROMPT, 0), 24, 5)
    assert not re.fullmatch(regex, free.text)
    want = offline_constrained(tok.completion_ids(PROMPT, 0), ConstraintSpec("regex", regex), 24, 5)
    want_chat = offline_constrained(tok.chat_ids(colour, 0), ConstraintSpec.json_schema(schema), 160, 9)

    async def main():
        http, rep, fe = await _front(served, model)
        client = openai.AsyncOpenAI(base_url="http://front/v1", api_key="none", http_client=http, max_retries=0)
        try:
            out = await client.completions.create(model=model, prompt=PROMPT, max_tokens=24, seed=5,
                                                  extra_body={"threshold": 0.9, "guided_regex": regex})
            text = out.choices[0].text
            assert re.fullmatch(regex, text) and out.choices[0].finish_reason == "stop", text
            assert text == want.text
            chat = {"model": model, "messages": colour, "max_tokens": 160, "seed": 9, "extra_body": {"threshold": 0.9},
                    "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}}
            plain = await client.chat.completions.create(**chat)
            doc = plain.choices[0].message.content
            jsonschema.validate(json.loads(doc), schema)
            assert plain.choices[0].finish_reason == "stop" and doc == want_chat.text
            stream = await client.chat.completions.create(**chat, stream=True)
            assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == doc
        finally:
            await http.aclose()
            rep.close()

    asyncio.run(main())
    # resumed on the serving engine from its first published canvas: the guard rebuilt from it, the same text
    spec = ConstraintSpec.json_schema(schema).to_dict()
    assert len(want_chat.token_ids) > 8
    again = served.add_request(tok.chat_ids(colour, 0), SamplingParams(max_tokens=160, seed=9, constraint=spec),
                               committed=want_chat.token_ids[:8])
    assert again.inner.guard.checked == 8
    while not again.finished:
        served.step([again])
    assert served.output(again).token_ids == want_chat.token_ids
    served.sequences.pop(again.seq_id)


def test_serve_dry_run_of_the_hub_id_writes_a_valid_config(dg_dir, tmp_path, monkeypatch, capsys):
    import yaml

    from app.config import AppConfig
    from engine.loading import resolve_model
    from tests.hubcache import go_offline, lay_out
    from tools.cli import main

    lay_out(dg_dir, tmp_path / "home", HUB_ID)
    go_offline(monkeypatch, tmp_path / "home")
    assert main(["serve", HUB_ID, "--dry-run", "--device", "cpu"]) == 0
    doc = yaml.safe_load(capsys.readouterr().out)
    app = doc["applications"][0]
    cfg = AppConfig.model_validate(app["args"])  # the app's own config class
    assert cfg.engine.model == HUB_ID and app["import_path"] == "deployments.builder:build_app"
    assert (resolve_model(cfg.engine.model) / "config.json").read_bytes() == (dg_dir / "config.json").read_bytes()
    assert cfg.http.max_tokens_limit == 512  # the fixture's context
    assert main(["serve", HUB_ID, "--dry-run", "--decoding", "threshold"]) == 2
    assert "masked-diffusion" in capsys.readouterr().err


def test_a_failover_resumes_from_the_published_canvases_with_the_engine_s_seed(served, dg_dir):
    """Through the ingress: a request without a seed, its instance lost after its first canvas was published,
    is resumed on the other instance from that canvas and its last resume state (the seed its first engine
    drew), and ends with the text an uninterrupted run with that seed gives."""
    import copy
    import time as clock

    from app.replica import ReplicaServer
    from engine.canvas_serving import CanvasServeEngine
    from engine.instance import Instance

    def replica():
        inst = Instance(CanvasServeEngine(served.model, served.tokenizer), slots=4)
        step = inst.step  # rounds slow enough for the test to catch the request between two canvases
        inst.step = lambda only=None: (clock.sleep(0.01), step(only))[1]
        return ReplicaServer(inst, tick_s=0.2)

    ids = served.tokenizer.completion_ids(PROMPT, 0)

    async def main():
        reps = [replica(), replica()]
        http, _, fe = await _front(served, str(dg_dir), reps)
        d = fe.dispatcher
        sent = []
        for inst in d.instances.values():
            inst.link.send = (lambda send: lambda msg: (sent.append(copy.deepcopy(msg)), send(msg))[1])(
                inst.link.send)  # copied: the dispatcher extends a request's committed list in place
        task = asyncio.ensure_future(collect(d.submit("q", ids, 24, prompt_text=PROMPT, threshold=0.9)))
        live = d.live["q"]
        deadline = clock.monotonic() + 30
        while not (live.committed and live.resume is not None):
            assert clock.monotonic() < deadline and not task.done(), "no published canvas to resume from"
            await asyncio.sleep(0.002)
        d.drop(live.state.instance, "lost (test)")
        text, last = await task
        await http.aclose()
        for r in reps:
            r.close()
        return text, last, sent

    text, last, sent = asyncio.run(main())
    adds = [m for m in sent if type(m).__name__ == "Add"]
    assert len(adds) == 2 and adds[0].params.seed is None and adds[0].resume is None
    assert len(adds[1].committed) in (8, 16)  # whole canvases: what was published
    seed = adds[1].resume.state["seed"]
    want = offline(served, ids, 24, seed)
    assert last["type"] == "done" and last["resumes"] == 1 and text == last["text"] == want.text


def test_a_tensor_parallel_instance_gives_tp1s_text(served):
    """TP 2 as a replica runs it (``deployments.startup`` shards the model with ``diffusion_gemma.shard``): rank 0's
    ``Instance`` mirrors its commands and plans to a ``Follower`` rank (a thread here, its all-reduce a barrier),
    which runs the same rounds on its shard; rank 0's answers are TP 1's, with the seed rank 0 drew sent along."""
    from concurrent.futures import ThreadPoolExecutor

    from engine.canvas_serving import CanvasServeEngine
    from engine.instance import Follower, Instance
    from engine.models import diffusion_gemma as dg

    ar = ThreadAllReduce(2)
    ranks = [CanvasServeEngine(dg.shard(served.model, r, 2, ar.for_rank(r)), served.tokenizer) for r in range(2)]
    follower = Follower(ranks[1])
    pool = ThreadPoolExecutor(1)

    adds = {}

    def mirror(commands, plan):
        adds.update({c.req_id: c for c in commands if type(c).__name__ == "Add"})
        done = pool.submit(follower.step, commands, plan)
        return done.result

    inst = Instance(ranks[0], slots=4, mirror=mirror, followers_alive=lambda: True)
    inst.add_request("s", PROMPT, SamplingParams(max_tokens=20, seed=4))
    inst.add_request("u", "Name a colour.", SamplingParams(max_tokens=12))  # rank 0 draws its seed
    inst.set_threshold("s", 0.6)
    try:
        out = inst.run()
    finally:
        pool.shutdown()
    assert not follower.seqs  # the follower finished them too
    assert out["s"].token_ids == offline(served, PROMPT, 20, 4, bound=served.rule.knob_at(0.6)).token_ids
    seed = adds["u"].params.seed
    assert seed is not None and out["u"].token_ids == offline(served, "Name a colour.", 12, seed).token_ids


def test_a_failed_round_touches_its_requests_and_a_reset_gives_the_same_text(served, monkeypatch):
    """A round whose decoder forward raises after its encoder passes wrote their caches: every request of it is
    touched (``RoundFailed.touched``), and each, started over from its committed canvases (``Instance.reset``,
    as the round loop does), ends with the text the uninterrupted run gives."""
    from engine.instance import Instance, RoundFailed

    inst = Instance(served, slots=4)
    inst.add_request("f", PROMPT, SamplingParams(max_tokens=20, seed=2))
    inst.step()  # its prompt's encoder pass
    while inst.seqs["f"].block_idx < 1:
        inst.step()
    inst.add_request("g", "Name a colour.", SamplingParams(max_tokens=12, seed=8))
    decode = served.model.decode
    monkeypatch.setattr(served.model, "decode", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RoundFailed) as failed:
        inst.step()  # g's prefill ran, f's canvas encode ran, then f's decoder forward failed
    monkeypatch.setattr(served.model, "decode", decode)
    assert sorted(failed.value.touched) == ["f", "g"]
    for rid in failed.value.touched:
        inst.reset(rid, len(inst.seqs[rid].output_ids()))
    out = inst.run()
    assert out["f"].token_ids == offline(served, PROMPT, 20, 2).token_ids
    assert out["g"].token_ids == offline(served, "Name a colour.", 12, 8).token_ids


# canvases of the fixture's random model stop after 2-5 of their 6 steps (its mean entropy falls with the rule's
# temperature schedule), so steps per canvas vary and stay below the cap, the router's prior
ADAPTIVE = {"stability_threshold": 0, "confidence_threshold": 5.95}


def test_the_router_learns_steps_per_canvas_and_picks_each_request_s_level(served, dg_dir):
    """Issue 41 item 4, through the ingress's dispatcher, its router built as the app builds it, and a replica
    running the real engine (a clock the test moves and the configured profile: the SLO budgets are exact):

    - the router's estimates start at the rule's step cap for every canvas of a request's budget and are learnt
      per level from the canvases the replica finished: the router's table is the engine's own count of each
      finished canvas's steps at the entropy bound of its level;
    - a request with a tight SLO gets a lower level than one with a loose SLO, and the rule decodes it with that
      level's higher entropy bound (``knob_at``);
    - in a burst load control caps the later arrivals' levels, and the rule sees the capped levels' bounds
      (that the cap, not the budget, lowers them: tests/test_canvas_steps.py, the same burst without load
      control)."""
    from app.config import AppConfig
    from app.dispatch import Dispatcher
    from app.replica import ReplicaServer
    from cluster.factory import build_router
    from engine.canvas_serving import CanvasServeEngine
    from engine.instance import Instance
    from engine.models.loader import load_config

    cfg = AppConfig(engine={"model": str(dg_dir), "slots": 4, "decoding_config": ADAPTIVE})
    mcfg = load_config(dg_dir)
    engine = CanvasServeEngine(served.model, served.tokenizer, decoding_config=ADAPTIVE)
    rule, levels = engine.rule, tuple(cfg.router.thresholds)
    cap = rule.max_denoising_steps
    bounds: dict[int, set] = {}  # the entropy bounds each request's denoising steps ran at, by its seed
    step = engine.step

    def spy(plan=None):
        out = step(plan)
        for seq in plan or ():
            if seq.rounds:
                bounds.setdefault(seq.params.seed, set()).add(seq.inner.params.entropy_bound)
        return out

    engine.step = spy
    ids = served.tokenizer.completion_ids(PROMPT, 0)

    now = 0.0  # the dispatcher's clock: it moves only between the phases
    canvases = []

    async def main():
        nonlocal now
        d = Dispatcher(build_router(cfg, mcfg, canvas_steps=cap), served.tokenizer.decode,
                       block_tokens=mcfg.block_size, full_sequence=False, per_instance_limit=64,
                       shed_over_capacity=False, calibrate=False, clock=lambda: now)
        d.default_decoding = engine.rule.name  # the replicas' rule, as the front sets it
        rep = ReplicaServer(Instance(engine, slots=4), tick_s=0.2)
        try:
            await d.connect("r0", 1, **rep.info())
            assert d.driver.counters()["estimator"] == "CanvasStepEstimator"

            def send(rid, seed, slo_ms):
                stream = d.submit(rid, ids, 16, prompt_text=PROMPT, slo_ms=slo_ms, sampling={"seed": seed})
                return d.driver.request(rid), asyncio.ensure_future(collect(stream))

            # two canvases of 8 at the cap: the prior, at every level
            first = [send(f"loose{i}", i, 600_000) for i in range(3)] + [send(f"tight{i}", 10 + i, 1) for i in range(3)]
            assert first[0][0].est == [2.0 * cap] * len(levels)
            done = [(await task)[1] for _, task in first]
            learnt = d.driver.estimator_state()
            canvases.append(len(engine.observer.steps_per_canvas))  # the first six requests' canvases
            probe, task = send("probe", 20, 600_000)
            est = probe.est
            await task
            now = 10.0  # load control reruns (at most every 0.1 s) for the burst, against its own budgets
            burst = [send(f"b{i}", 30 + i, 150) for i in range(16)]
            states = [st for st, _ in burst]
            for _, task in burst:
                await task
            return done, learnt, est, states
        finally:
            rep.close()

    done, learnt, est, burst = asyncio.run(main())
    assert all(e["type"] == "done" for e in done)
    # loose: 0.9; tight: the lowest level
    assert [e["threshold"] for e in done] == pytest.approx([levels[0]] * 3 + [levels[-1]] * 3)
    assert bounds[0] == {rule.knob_at(levels[0])} and bounds[10] == {rule.knob_at(levels[-1])}  # what the rule saw
    assert rule.knob_at(levels[-1]) == pytest.approx(4 * rule.knob_at(levels[0]))  # two levels lower: 4x the bound
    # the router's table is the replica's count of each finished canvas at the bound of its level
    obs = engine.observer
    for level in (levels[0], levels[-1]):
        steps = [n for n, b in zip(obs.steps_per_canvas[:canvases[0]], obs.bounds) if b == rule.knob_at(level)]
        assert learnt["steps_per_canvas"][f"{level:g}"] == {"canvases": len(steps),
                                                             "mean": round(sum(steps) / len(steps), 3)}
        assert len(steps) >= 3 and sum(steps) < cap * len(steps)  # stopped before the cap: not the prior
    # a new request's estimate: its two canvases at the steps learnt per level (no next-canvas rate measured yet)
    assert learnt["next_canvas"]["source"] == "prior"
    assert est == pytest.approx([2.0 * v for v in learnt["estimate"].values()], abs=2e-3) and est[0] < 2 * cap
    # the burst: load control caps the later arrivals; each level within its cap, its bound what the rule used
    assert burst[0].cap == 0 and any(st.cap > 0 for st in burst)
    for i, st in enumerate(burst):
        assert levels.index(st.threshold) >= st.cap
        assert bounds[30 + i] <= {rule.knob_at(level) for level in levels[st.cap:]}, (i, st.cap, bounds[30 + i])


def test_the_front_estimates_canvas_requests_from_the_replicas_rule(dg_dir):
    """The app's front builds its router with the canvas estimator, its prior the step cap of the replicas' rule
    (the server's decoding_config over the checkpoint's), and serves what it learnt at /debug/predictors; with
    ``router.predictors: off`` the levels stay fixed. A decoding_config configures the renoise rule, the
    server's and a request's."""
    from app.config import AppConfig
    from app.frontend import Frontend

    fe = Frontend(AppConfig(engine={"model": str(dg_dir), "decoding_config": {"max_denoising_steps": 4}}))
    d = fe.dispatcher
    assert d.driver.counters()["estimator"] == "CanvasStepEstimator" and d.chooses_thresholds
    assert fe.learning is None  # no masked-block learners (nor their refit worker) for canvas requests
    info = asyncio.run(fe.predictors())
    assert info["enabled"] and info["step"]["step_cap"] == 4 and info["step"]["estimate"] == {
        f"{t:g}": 4.0 for t in fe.cfg.router.thresholds}
    off = Frontend(AppConfig(engine={"model": str(dg_dir)}, router={"predictors": "off"}))
    assert off.dispatcher.driver.counters()["policy"] == "fixed-threshold"
    assert asyncio.run(off.predictors()) == {"enabled": False}


def test_a_decoding_config_configures_the_renoise_rule(served):
    from engine.canvas_serving import CanvasServeEngine

    seq = served.add_request(PROMPT, SamplingParams(max_tokens=8, seed=1, decoding_config={"max_denoising_steps": 2}))
    assert seq.rule.max_denoising_steps == 2 and seq.admission_rounds() == 2.0
    served.abort(seq.seq_id)
    eng = CanvasServeEngine(served.model, served.tokenizer, decoding_config={"max_denoising_steps": 3})
    assert eng.rule.name == "renoise" and eng.rule.max_denoising_steps == 3


