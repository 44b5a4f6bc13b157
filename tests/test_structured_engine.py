"""Structured outputs through the engine (issue 42 items 2 and 3): the embedded tiny-bd model under a regular
expression or choices (its vocabulary has no braces or quotes: no JSON), a request resumed from its committed
prefix, and JSON schemas on the random-weight SDAR test checkpoint (byte-level BPE), whose documents must
validate although the model knows nothing."""

from __future__ import annotations

import json
import re

import pytest

from engine.commands import SamplingParams
from engine.constraints.spec import ConstraintSpec
from tasksuite import _prose_pattern, heldout_set


@pytest.fixture(scope="module")
def tiny():
    from engine.loading import load_engine

    return load_engine("tiny-bd", max_slots=16)


def run(engine, prompts, params):
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while not all(s.finished for s in seqs):
        engine.step()
    outs = [(engine.output(s), s) for s in seqs]
    for s in seqs:
        engine.sequences.pop(s.seq_id, None)
    return outs


def prose(n: int = 4):
    return [ex for ex in heldout_set(60) if ex.category == "prose"][:n]


def test_a_regex_holds_where_the_free_model_breaks_it(tiny):
    """At threshold 0.5 tiny-bd commits the story's code digits together and writes 111 (the task's trap):
    the story's own regular language (codes 110, 101, 011) is then broken. Constrained, every story parses
    and ends with finish_reason stop, and several tokens still commit per step."""
    exs = prose()
    specs = [ConstraintSpec("regex", _prose_pattern(ex.prompt.split()[1], int(ex.prompt.split()[2])).pattern)
             for ex in exs]
    free = run(tiny, [ex.prompt for ex in exs], [SamplingParams(max_tokens=168, threshold=0.5)] * len(exs))
    held = run(tiny, [ex.prompt for ex in exs],
               [SamplingParams(max_tokens=168, threshold=0.5, constraint=s.to_dict()) for s in specs])
    assert not all(re.fullmatch(s.value, o.text) for s, (o, _) in zip(specs, free))  # the trap bites freely
    for spec, (out, seq) in zip(specs, held):
        assert out.finish_reason == "stop" and re.fullmatch(spec.value, out.text), out.text
        assert seq.guard.remasked >= 0 and seq.rounds < len(out.token_ids)  # parallel: fewer rounds than tokens


def test_choices_override_the_models_answer(tiny):
    exs = [ex for ex in heldout_set(30) if ex.category == "choice"][:4]
    spec = ConstraintSpec.choice(["yes", "no"])
    outs = run(tiny, [ex.prompt for ex in exs], [SamplingParams(max_tokens=8, constraint=spec.to_dict())] * 4)
    for out, _ in outs:
        assert out.text in ("yes", "no") and out.finish_reason == "stop"


def test_a_resumed_request_rebuilds_its_grammar_from_the_committed_prefix(tiny):
    ex = prose(1)[0]
    spec = ConstraintSpec("regex", _prose_pattern(ex.prompt.split()[1], int(ex.prompt.split()[2])).pattern)
    params = SamplingParams(max_tokens=168, threshold=0.5, constraint=spec.to_dict())
    (whole, _), = run(tiny, [ex.prompt], [params])
    prefix = whole.token_ids[:13]  # a resume elsewhere after 13 tokens (mid-block)
    seq = tiny.add_request(ex.prompt, params, committed=prefix)
    assert seq.guard.checked == 13
    while not seq.finished:
        tiny.step()
    out = tiny.output(seq)
    tiny.sequences.pop(seq.seq_id, None)
    assert out.token_ids[:13] == prefix and re.fullmatch(spec.value, out.text) and out.finish_reason == "stop"
    bad = tiny.tokenizer.encode("the cat was purple.")
    with pytest.raises(ValueError, match="breaks the constraint"):
        tiny.add_request(ex.prompt, params, committed=bad)


FINITE = {  # the finite schemas: enums, booleans, bounded integers and strings, patterns, nesting, arrays
    "type": "object", "additionalProperties": False,
    "required": ["answer", "n", "ok", "tag", "xs", "inner"],
    "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                   "ok": {"type": "boolean"}, "tag": {"type": "string", "pattern": "^[a-z]{2,4}$"},
                   "xs": {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 1, "maxItems": 3},
                   "inner": {"type": "object", "additionalProperties": False, "required": ["name"],
                             "properties": {"name": {"type": "string", "maxLength": 6}}}}}


@pytest.fixture(scope="module")
def sdar(tmp_path_factory):
    from engine.loading import load_engine
    from tests.checkpoints import build_checkpoint

    return load_engine(str(build_checkpoint("sdar", tmp_path_factory.mktemp("sdar") / "sdar")), max_slots=8)


@pytest.mark.slow
@pytest.mark.parametrize("threshold", [0.9, 0.1])
def test_json_schemas_validate_on_a_model_that_knows_nothing(sdar, threshold):
    jsonschema = pytest.importorskip("jsonschema")
    specs = [ConstraintSpec.json_schema(FINITE, any_whitespace=False),
             ConstraintSpec.json_schema({"type": "array", "items": {"type": "object", "properties": {
                 "name": {"const": "get_time"}, "parameters": {"type": "object", "properties": {
                     "zone": {"enum": ["utc", "cet"]}}, "required": ["zone"], "additionalProperties": False}},
                 "required": ["name", "parameters"], "additionalProperties": False}, "minItems": 1, "maxItems": 2},
                 any_whitespace=False)]
    outs = run(sdar, ["hello"] * len(specs),
               [SamplingParams(max_tokens=200, threshold=threshold, constraint=s.to_dict()) for s in specs])
    for spec, (out, _) in zip(specs, outs):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), spec.schema)  # strict JSON: no raw control characters either


@pytest.mark.slow
def test_a_constrained_request_resumed_after_its_replica_dies_still_parses():
    """Item 3: the constraint travels in the add's params; the replica that takes over rebuilds the grammar from
    the committed prefix (and checks the resumed block's tail as its frontier reaches it)."""
    import asyncio

    from tests.builders import collect, make_dispatcher, make_replica, submit

    exs = prose(4)
    specs = [ConstraintSpec("regex", _prose_pattern(ex.prompt.split()[1], int(ex.prompt.split()[2])).pattern,
                            "guided_regex") for ex in exs]

    async def main():
        reps = [make_replica(slots=4), make_replica(slots=4)]
        d = make_dispatcher()
        for i, r in enumerate(reps):
            await d.connect(f"s{i}", 1, **r.info())
        streams = [submit(d, f"c{i}", ex.prompt, 160, threshold=0.5, sampling={"constraint": s.to_dict()})
                   for i, (ex, s) in enumerate(zip(exs, specs))]
        victims = [rid for rid, lv in d.live.items() if lv.state.instance == 0]
        for _ in range(300):  # kill instance 0 once some of its requests have committed text
            await asyncio.sleep(0.01)
            if any(d.live.get(r) is not None and d.live[r].committed for r in victims):
                break
        reps[0].close()
        results = await asyncio.gather(*(collect(s) for s in streams))
        reps[1].close()
        return d, victims, results

    d, victims, results = asyncio.run(main())
    assert victims and d.stats["failed_over"] >= 1
    for spec, (text, last) in zip(specs, results):
        assert last["type"] == "done" and last["finish_reason"] == "stop", last
        assert text == last["text"] and re.fullmatch(spec.value, text), text
    assert sum(last["resumes"] for _, last in results) >= 1


def test_every_decoding_rule_keeps_the_text_valid(tiny):
    """The guard wraps whatever rule decides (engine/decoding's seam), the editing joint_threshold included
    (an edit the grammar refuses is dropped)."""
    from engine.decoding import RULES

    ex = prose(2)[1]
    spec = ConstraintSpec("regex", _prose_pattern(ex.prompt.split()[1], int(ex.prompt.split()[2])).pattern)
    names = sorted(r for r in RULES if not getattr(RULES[r], "canvas_rule", False))  # renoise: DiffusionGemma's
    outs = run(tiny, [ex.prompt] * len(names),
               [SamplingParams(max_tokens=168, decoding=name, constraint=spec.to_dict()) for name in names])
    for name, (out, _) in zip(names, outs):
        assert out.finish_reason == "stop" and re.fullmatch(spec.value, out.text), (name, out.text)


def test_logprobs_under_a_constraint(tiny):
    """Each token's log-probability is under the distribution it was chosen from: the frontier's masked to the
    grammar, a token the grammar forced (jump-forward) at probability 1."""
    import math

    ex = prose(1)[0]
    spec = ConstraintSpec("regex", _prose_pattern(ex.prompt.split()[1], int(ex.prompt.split()[2])).pattern)
    (out, _), = run(tiny, [ex.prompt], [SamplingParams(max_tokens=168, logprobs=True, constraint=spec.to_dict())])
    assert len(out.logprobs) == len(out.token_ids)
    assert all(math.isfinite(lp) and lp <= 0 for lp in out.logprobs)
    assert any(lp == 0 for lp in out.logprobs)  # some of the story's fixed words were forced


@pytest.mark.slow
def test_a_replica_refuses_a_constraint_it_cannot_compile_and_goes_on():
    """The replica compiles an add's constraint as it arrives (off its round loop): one it cannot compile (a regex
    that does not parse, sent past the ingress's own check) is a 400 for that request, and the next is served."""
    import asyncio

    from tests.builders import collect, make_dispatcher, make_replica, submit

    async def main():
        rep = make_replica(slots=2)
        d = make_dispatcher()
        await d.connect("g0", 1, **rep.info())
        bad = ConstraintSpec("regex", "(", "guided_regex").to_dict()
        refused = await collect(submit(d, "bad", "story: fox 1", 32, sampling={"constraint": bad}))
        good = await collect(submit(d, "good", "max: a3 b7 c1 d5", 8,
                                    sampling={"constraint": ConstraintSpec.choice(["b", "c"]).to_dict()}))
        rep.close()
        return refused, good

    (_, refused), (text, good) = asyncio.run(main())
    assert refused["type"] == "error" and refused["status"] == 400 and "constraint" in refused["message"]
    assert good["type"] == "done" and text in ("b", "c")


def test_sampled_tokens_keep_the_text_valid(tiny):
    """With temperature the frontier's token is drawn from the grammar-masked distribution (the runner masks
    the row before sampling), and the provisional ones are checked as with greedy decoding."""
    exs = prose(3)
    specs = [ConstraintSpec("regex", _prose_pattern(ex.prompt.split()[1], int(ex.prompt.split()[2])).pattern)
             for ex in exs]
    outs = run(tiny, [ex.prompt for ex in exs], [SamplingParams(max_tokens=168, threshold=0.5, temperature=1.0,
                                                                seed=7 + i, constraint=s.to_dict())
                                                 for i, s in enumerate(specs)])
    for spec, (out, _) in zip(specs, outs):
        assert out.finish_reason == "stop" and re.fullmatch(spec.value, out.text), out.text
