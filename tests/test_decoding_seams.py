"""The decoding rules wired through the engine and the service (issue 40, items 0, 2, 4 and 5's fixture):

- a rule is chosen by the checkpoint (generation_config.json), the server (engine.decoding, ``remask serve
  --decoding``) and the request (``decoding``, ``decoding_config``), in that order of precedence over
  ``threshold``; an unknown rule or a bad value is a 400 naming the field;
- for every registered rule, greedy and seeded, the deltas streamed through the HTTP front concatenate to
  the plain answer, and an editing rule streams only blocks whose edits are over;
- a request resumed on a fresh engine from its committed tokens and its block's state (canvas, step counters,
  the rule's state) ends as the uninterrupted one does, for every rule, also over the round loop's wire;
- the LLaDA2.1-format fixture (the LLaDA2 fixture with an editing generation config) is served with
  joint_threshold by default, end to end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import httpx
import pytest

from app.protocol import ProgressBatch, StepItem, decode, encode
from engine.commands import Resume, SamplingParams, resolve_rule
from engine.decoding import RULES
from tests.checkpoints import LLADA21_DECODING, build_llada21_checkpoint

# each rule's configuration for tiny-bd: the defaults, but joint_threshold's edits kept to its confident ones
# (tiny-bd never learnt to edit: with edit_threshold 0 it rewrites most of what it commits)
CONFIGS = {"joint_threshold": {"edit_threshold": 0.9, "max_post_edit_steps": 2}}
PROMPTS = ["story: cat 4", "rev: abcdefgh"]


def params(rule: str, seeded: bool, max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0 if seeded else 0.0, seed=11 if seeded else None,
                          decoding=rule, decoding_config=CONFIGS.get(rule))


@pytest.fixture(scope="module")
def tiny_bd():
    from engine.loading import load_engine

    return load_engine("tiny-bd", max_slots=4)


@pytest.fixture(scope="module")
def llada21(hf_checkpoints, tmp_path_factory):
    return build_llada21_checkpoint(hf_checkpoints["llada2"], tmp_path_factory.mktemp("llada21") / "llada21")


def run(engine, seqs) -> list[list[int]]:
    while not all(s.finished for s in seqs):
        engine.step()
    out = [s.output_ids() for s in seqs]
    for s in seqs:
        engine.sequences.pop(s.seq_id, None)
    return out


# ---- chosen three ways ----------------------------------------------------------------------------------

def test_the_rule_is_the_request_s_over_the_server_s_over_the_checkpoint_s(llada21, hf_checkpoints, tiny_bd):
    from engine.loading import engine_rule
    from engine.models.loader import checkpoint_decoding

    assert checkpoint_decoding(hf_checkpoints["llada2"]) is None  # LLaDA2.0: threshold
    assert engine_rule(hf_checkpoints["llada2"]).name == "threshold"
    ckpt = engine_rule(llada21)  # the checkpoint's editing generation config
    assert ckpt.name == "joint_threshold" and {k: ckpt.config()[k] for k in LLADA21_DECODING} == LLADA21_DECODING
    own = build_llada21_checkpoint(hf_checkpoints["llada2"], llada21.parent / "own-keys", named=False)
    assert engine_rule(own) == ckpt  # LLaDA2.1's own generate arguments name the same rule
    server = engine_rule(llada21, None, {"max_post_edit_steps": 5})  # a config alone configures the checkpoint's
    assert server.name == "joint_threshold" and server.max_post_edit_steps == 5 and server.threshold == 0.7
    assert engine_rule(llada21, "credit").name == "credit"  # the server's name over the checkpoint's
    # the request's over the server's: a config alone (or the same name) updates it, another name starts afresh
    base = resolve_rule(None, "joint_threshold", {"edit_threshold": 0.8})
    assert resolve_rule(base, None, None) is base
    assert resolve_rule(base, None, {"threshold": 0.6}).config() == {**base.config(), "threshold": 0.6}
    assert resolve_rule(base, "joint_threshold", {"max_post_edit_steps": 1}).edit_threshold == 0.8
    assert resolve_rule(base, "entropy_bound", None).name == "entropy_bound"
    # the engine: its own rule unless the request names or configures one
    assert tiny_bd.rule.name == "threshold" and tiny_bd.rule_for(SamplingParams()) is tiny_bd.rule
    seq = tiny_bd.add_request("rev: ab", SamplingParams(decoding="credit", decoding_config={"alpha": 0.5}))
    assert seq.rule.name == "credit" and seq.rule.alpha == 0.5
    tiny_bd.abort(seq.seq_id)


def test_an_unknown_rule_or_a_bad_value_names_its_field(tiny_bd):
    from pydantic import ValidationError

    from app.api import APIError, parse_request
    from app.config import AppConfig

    with pytest.raises(ValueError, match="^decoding: unknown decoding rule 'nope'; known: credit"):
        tiny_bd.add_request("x", SamplingParams(decoding="nope"))
    with pytest.raises(ValueError, match="^decoding_config: edit_threshold must be a number in"):
        tiny_bd.add_request("x", SamplingParams(decoding="joint_threshold", decoding_config={"edit_threshold": 2}))
    with pytest.raises(ValidationError, match="engine.decoding_config: unknown field 'typo'"):
        AppConfig(engine={"decoding": "credit", "decoding_config": {"typo": 1}})
    with pytest.raises(ValidationError, match="engine.decoding: unknown decoding rule 'nope'"):
        AppConfig(engine={"decoding": "nope"})
    opts = dict(known_models=["m"], max_tokens_limit=64, default_max_tokens=16)
    cases = [({"decoding": "nope"}, "decoding"),
             ({"decoding": "joint_threshold", "decoding_config": {"max_post_edit_steps": -1}},
              "decoding_config.max_post_edit_steps"),
             ({"decoding_config": {"typo": 1}}, "decoding_config.typo"),  # configures the server's threshold rule
             ({"decoding": 3}, "decoding"), ({"decoding_config": [1]}, "decoding_config")]
    for kind, body in (("completion", {"prompt": "a"}), ("chat", {"messages": [{"role": "user", "content": "a"}]})):
        for extra, param in cases:
            with pytest.raises(APIError) as err:
                parse_request(kind, json.dumps({**body, **extra}), **opts)
            assert err.value.status == 400 and err.value.param == param, (extra, err.value.to_dict())
        ok = parse_request(kind, json.dumps({**body, "decoding": "entropy_bound", "decoding_config": {"gamma": 0.5}}),
                           **opts)
        assert ok.decoding == "entropy_bound" and ok.decoding_config == {"gamma": 0.5}


def test_remask_serve_takes_the_rule_and_refuses_a_bad_one(llada21):
    from tools.cli import build_parser
    from tools.serve_cli import build_doc

    def doc(*argv):
        return build_doc(build_parser().parse_args(["serve", *argv, "--device", "cpu"]))[0]["applications"][0]

    args = doc("tiny-bd", "--decoding", "joint_threshold", "--decoding-config", '{"edit_threshold": 0.8}')["args"]
    assert args["engine"]["decoding"] == "joint_threshold"
    assert args["engine"]["decoding_config"] == {"edit_threshold": 0.8}
    assert "decoding" not in doc(str(llada21))["args"]["engine"]  # the checkpoint's rule, chosen at the replica
    with pytest.raises(ValueError, match="decoding_config: max_post_edit_steps"):  # checked over the checkpoint's
        doc(str(llada21), "--decoding-config", '{"max_post_edit_steps": -2}')
    with pytest.raises(ValueError, match="--decoding-config must be a JSON object"):
        doc("tiny-bd", "--decoding-config", "{edit")
    with pytest.raises(ValueError, match="unknown decoding rule 'nope'"):
        doc("tiny-bd", "--decoding", "nope")


# ---- streaming and resuming -------------------------------------------------------------------------------

async def _front_and_replica(engine, model: str = "tiny-bd"):
    """The HTTP front (``app.frontend``, as the Ingress builds it, without Ray) connected to an in-process
    replica of ``engine``: (client, replica)."""
    from app.config import AppConfig
    from app.frontend import Frontend, build_web
    from app.replica import ReplicaServer
    from engine.instance import Instance

    rep = ReplicaServer(Instance(engine, slots=4), tick_s=0.2)
    fe = Frontend(AppConfig(engine={"model": model, "slots": 4}, router={"predictors": "off"}))
    await fe.dispatcher.connect("r0", 1, **rep.info())
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_web(lambda: fe)), base_url="http://front")
    client.front = fe
    return client, rep


def _stream_text(r: httpx.Response, kind: str) -> str:
    assert r.status_code == 200, r.text[:300]
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    key = (lambda c: c["text"]) if kind == "completion" else (lambda c: c["delta"].get("content", ""))
    return "".join(key(c["choices"][0]) for c in chunks if c["choices"])


@pytest.mark.slow
def test_streamed_deltas_equal_the_plain_answer_for_every_rule(tiny_bd):
    """Every registered rule, greedy and seeded, through both endpoints: the streamed deltas joined are the
    non-streamed answer and the engine's own (offline) answer for the same prompt and sampling."""
    from engine.engine import Engine

    ref = Engine(tiny_bd.model, tiny_bd.tokenizer, max_slots=4)
    prompt = PROMPTS[0]

    async def main():
        client, rep = await _front_and_replica(Engine(tiny_bd.model, tiny_bd.tokenizer, max_slots=4))
        try:
            for rule in sorted(RULES):
                for seeded in (False, True):
                    # the client fixes the threshold (the router's level, each rule's knob through knob_at)
                    p = dataclasses.replace(params(rule, seeded, max_tokens=16), threshold=0.8)
                    want = ref.generate([prompt], p)[0].text
                    body = {"model": "tiny-bd", "max_tokens": 16, "decoding": rule, "temperature": p.temperature,
                            "threshold": 0.8,
                            **({"seed": p.seed} if seeded else {}),
                            **({"decoding_config": p.decoding_config} if p.decoding_config else {})}
                    streamed = await client.post("/v1/completions", json={**body, "prompt": prompt, "stream": True})
                    assert _stream_text(streamed, "completion") == want, (rule, seeded)
            plain = await client.post("/v1/completions", json={**body, "prompt": prompt})  # the last: seeded credit
            assert plain.json()["choices"][0]["text"] == want
            chat = {"model": "tiny-bd", "messages": [{"role": "user", "content": prompt}], "max_tokens": 16,
                    "decoding": "joint_threshold", "decoding_config": CONFIGS["joint_threshold"]}
            streamed = await client.post("/v1/chat/completions", json={**chat, "stream": True})
            plain = await client.post("/v1/chat/completions", json=chat)
            assert _stream_text(streamed, "chat") == plain.json()["choices"][0]["message"]["content"]
        finally:
            await client.aclose()
            rep.close()

    asyncio.run(main())


def test_an_editing_rule_publishes_only_blocks_whose_edits_are_over(tiny_bd):
    """joint_threshold rewrites committed tokens; a step item carries only tokens of finished blocks (so the
    concatenation is never taken back) and, until the request ends, the block's state for a resume."""
    from engine.instance import Instance
    from engine.loop import RoundLoop

    batches: list[ProgressBatch] = []
    inst = Instance(tiny_bd, slots=4)
    loop = RoundLoop(inst, batches.append)
    try:
        loop.submit("e", PROMPTS[0], params("joint_threshold", False, max_tokens=24), canvas=True)
        deadline = time.monotonic() + 30
        while not any(isinstance(i, StepItem) and i.done is not None for b in list(batches) for i in b.items):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        loop.stop()
    items = [decode(encode(b)) for b in batches]  # as the ingress reads them
    steps = [i for b in items for i in b.items if isinstance(i, StepItem)]
    b, start = tiny_bd.cfg.block_size, len(tiny_bd.tokenizer.prompt_ids(PROMPTS[0], tiny_bd.cfg.block_size))
    published = 0
    for item in steps:
        published += len(item.ids)
        if item.done is None:  # only whole blocks (the first one starts where the prompt ends) before the last
            assert (start + published) % b == 0
            assert item.resume is not None and len(item.resume.tail) == b - (start + published) % b
    want = tiny_bd.generate([PROMPTS[0]], params("joint_threshold", False, max_tokens=24))[0].token_ids
    assert [t for i in steps for t in i.ids] == want and steps[-1].done is not None
    assert any(i.canvas.get("edited") for i in steps if i.canvas)  # it did rewrite tokens, and says which


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-bd", "tiny-mdm"])
def test_a_resumed_request_ends_as_the_uninterrupted_one_for_every_rule(model, tiny_bd):
    """For every rule, greedy and seeded: the request's committed tokens and its block's state (canvas,
    counters, rule state) after a few rounds, handed to a fresh engine, decode the rest as the original does."""
    from engine.engine import Engine
    from engine.loading import load_engine

    a = tiny_bd if model == "tiny-bd" else load_engine(model, max_slots=4)
    for rule in sorted(RULES):
        for seeded in (False, True):
            for after in (3,):  # mid-block for most rules (tiny-bd's and tiny-mdm's blocks: 8)
                p = params(rule, seeded)
                seq = a.add_request(PROMPTS[0], p)
                for _ in range(after):
                    if not seq.finished:
                        a.step([seq])
                if seq.finished:
                    a.sequences.pop(seq.seq_id)
                    continue
                committed = seq.output_ids()
                item = StepItem("r", [], 0, False, resume=seq.resume_state(len(committed)))
                resume = decode(encode(ProgressBatch(0.0, 0, 0.0, items=[item]))).items[0].resume  # the wire's codec
                (whole,) = run(a, [seq])
                b = Engine(a.model, a.tokenizer, max_slots=4, rule=a.rule)
                again = b.add_request(PROMPTS[0], p, committed=committed, resume=resume)
                assert again.rule_state == (resume.state if resume else {})
                assert committed + run(b, [again])[0][len(committed):] == whole, (model, rule, seeded, after)


def test_a_resume_state_is_checked():
    from engine.engine import Engine
    from tests.builders import make_model, tiny_bd_tokenizer

    engine = Engine(make_model(), tiny_bd_tokenizer(), max_slots=2)
    mask = engine.cfg.mask_token_id
    with pytest.raises(ValueError, match="resume.tail marks masked positions with -1"):
        engine.add_request("ab", SamplingParams(max_tokens=8), committed=[5], resume=Resume([mask]))
    with pytest.raises(ValueError, match="resume.tail runs past the current block"):
        engine.add_request("ab", SamplingParams(max_tokens=24), committed=[5], resume=Resume([5] * 12))


# ---- the LLaDA2.1-format fixture ----------------------------------------------------------------------------

@pytest.mark.slow
def test_the_llada21_fixture_is_served_with_joint_threshold_end_to_end(llada21):
    """Its generation config names joint_threshold: the engine the replica starts decodes with it (the card's
    configuration), the router's threshold reaches it as its knob, and through the HTTP front a streamed chat
    equals the plain one; a request may still pick threshold."""
    from app.config import AppConfig
    from deployments.startup import start_engine

    engine = start_engine(AppConfig(engine={"model": str(llada21), "slots": 4}, http={"default_max_tokens": 16}))
    assert engine.rule.name == "joint_threshold" and engine.rule.edits
    assert {k: engine.rule.config()[k] for k in LLADA21_DECODING} == LLADA21_DECODING
    seq = engine.add_request([5, 6, 7], SamplingParams(max_tokens=16, threshold=0.01))
    masked = seq.masked_at_start
    (ids,) = run(engine, [seq])
    assert seq.rule is engine.rule and seq._knob() == 0.01 and 0 < len(ids) <= 16
    assert seq.rounds <= masked + LLADA21_DECODING["max_post_edit_steps"]  # a commit a step at least, then the bound

    async def main():
        client, rep = await _front_and_replica(engine, str(llada21))
        assert client.front.dispatcher.default_decoding == "joint_threshold"  # the rule whose knob the router moves
        try:
            # a threshold near 0 commits a block in one step (random weights are never confident), then edits
            chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 16, "temperature": 0,
                    "threshold": 0.01}
            streamed = await client.post("/v1/chat/completions", json={**chat, "stream": True})
            plain = await client.post("/v1/chat/completions", json=chat)
            text = plain.json()["choices"][0]["message"]["content"]
            assert _stream_text(streamed, "chat") == text
            other = await client.post("/v1/chat/completions", json={**chat, "decoding": "threshold"})
            assert other.status_code == 200
            bad = await client.post("/v1/chat/completions", json={**chat, "decoding_config": {"edit_threshold": 3}})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "decoding_config.edit_threshold"
        finally:
            await client.aclose()
            rep.close()

    asyncio.run(main())


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["joint_threshold", "credit"])
def test_a_failover_carries_the_block_state_and_ends_as_the_uninterrupted_run(tiny_bd, rule):
    """Through the ingress: a request whose instance is lost in the middle of a block is resumed on the other
    with its committed tokens and the block's state from its last step item (canvas, counters, the rule's
    state: joint_threshold's edits, credit's credit), and ends with the uninterrupted run's text."""
    import time as clock

    from app.replica import ReplicaServer
    from engine.engine import Engine
    from engine.instance import Instance
    from tests.builders import collect, make_dispatcher, submit

    p = dataclasses.replace(params(rule, True, max_tokens=32), threshold=0.7)
    want = Engine(tiny_bd.model, tiny_bd.tokenizer, max_slots=4).generate([PROMPTS[0]], p)[0].text

    def replica(slow: bool):
        inst = Instance(Engine(tiny_bd.model, tiny_bd.tokenizer, max_slots=4), slots=4)
        if slow:  # rounds slow enough for the test to catch the request inside a block
            step = inst.step
            inst.step = lambda only=None: (clock.sleep(0.03), step(only))[1]
        return ReplicaServer(inst, tick_s=0.2)

    async def main():
        reps = [replica(True), replica(True)]
        d = make_dispatcher()
        for i, r in enumerate(reps):
            await d.connect(f"f{i}", 1, **r.info())
        sent = []
        for inst in d.instances.values():
            inst.link.send = (lambda send: lambda msg: (sent.append(msg), send(msg))[1])(inst.link.send)
        stream = submit(d, "q", PROMPTS[0], 32, threshold=0.7, sampling={
            "temperature": 1.0, "seed": p.seed, "decoding": rule, "decoding_config": p.decoding_config})
        task = asyncio.ensure_future(collect(stream))
        live = d.live["q"]
        assert live.state.decoding == rule  # the router moves this rule's knob
        deadline = clock.monotonic() + 30
        while not (live.resume is not None and live.committed and live.resume.step_in_block >= 1
                   and any(t >= 0 for t in live.resume.tail)):
            assert clock.monotonic() < deadline and not task.done(), "no mid-block state to resume from"
            await asyncio.sleep(0.002)
        d.drop(live.state.instance, "lost (test)")
        text, last = await task
        for r in reps:
            r.close()
        return text, last, sent

    text, last, sent = asyncio.run(main())
    adds = [m for m in sent if type(m).__name__ == "Add"]
    assert len(adds) == 2 and adds[1].resume is not None and adds[1].committed  # resumed with the block's state
    assert adds[1].params.decoding == rule and last["type"] == "done" and last["resumes"] == 1
    assert text == last["text"] == want
