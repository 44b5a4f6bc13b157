from __future__ import annotations

import pytest

from engine.engine import Engine
from engine.instance import Instance
from engine.sequence import SamplingParams
from tests.builders import make_model

PROMPTS = ["max: a1 b7 c3 d2", "12+5=", "rev: abcdef", "story: cat 3", "x", "hello there friend"]


@pytest.mark.parametrize("attention", ["block_causal", "bidirectional"])
def test_preemption_does_not_change_outputs(tok, attention):
    model = make_model(attention=attention)
    params = [SamplingParams(max_tokens=8 * (1 + i % 3), threshold=0.7) for i in range(len(PROMPTS))]
    alone = Engine(model, tok, max_slots=8).generate(PROMPTS, params)
    results = {}
    for policy in ("dwise", "fcfs-mixed", "fcfs-prefill-first", "mlfq"):
        inst = Instance(Engine(model, tok, max_slots=2, kv_slots=6), policy=policy, slots=2, resident_factor=3,
                        estimator=lambda seq: float(len(seq.prompt_ids)))  # long prompts look long
        paused = 0
        for i, (p, sp) in enumerate(zip(PROMPTS, params)):
            inst.add_request(f"q{i}", p, sp)  # arrivals between rounds: short ones overtake
            plan, _, _ = inst.step()
            paused += len(plan.paused)
        while inst.has_work():
            plan, _, _ = inst.step()
            paused += len(plan.paused)
            assert len(plan.slots) <= 2
        results[policy] = inst.outputs
        if policy == "dwise":
            assert paused > 0  # requests really were preempted and resumed
    for policy, outs in results.items():
        for i, ref in enumerate(alone):
            out = outs[f"q{i}"]
            assert (out.token_ids, out.rounds) == (ref.token_ids, ref.rounds), policy


def test_refiner_reaches_the_scheduler(tok):
    model = make_model()
    calls = []

    def refiner(seq):
        calls.append(seq.seq_id)
        return 42.0

    inst = Instance(Engine(model, tok), policy="dwise", slots=4, refiner=refiner)
    req = inst.add_request("a", "story: dog 2", SamplingParams(max_tokens=64, threshold=0.99))
    while inst.has_work() and req.rounds_done < 1:
        inst.step()
    assert calls and req.refined and req.est_rounds == 41.0


def test_abort_frees_everything(tok):
    inst = Instance(Engine(make_model(), tok), slots=2)
    inst.add_request("a", "abc")
    inst.add_request("b", "abcdef")
    inst.step()
    inst.abort("a")
    inst.run()
    assert set(inst.outputs) == {"b"} and not inst.engine.sequences and inst.scheduler.kv_reserved == 0



@pytest.mark.parametrize("attention", ["block_causal", "bidirectional"])
def test_resume_from_committed_tokens(tok, attention):
    """A request moved to another instance after whole blocks committed finishes with the same tokens;
    resumed mid-block it keeps its committed prefix and still finishes."""
    model = make_model(attention=attention)
    prompts = ["story: cat 3", "rev: abcdef", "hello there friend"]
    sp = SamplingParams(max_tokens=24, threshold=0.7)
    alone = Engine(model, tok).generate(prompts, sp)
    resumed = 0
    for i, p in enumerate(prompts):
        src = Instance(Engine(model, tok), slots=4)
        src.add_request("r", p, sp)
        seq = src.seqs["r"]
        cuts = []  # the committed output whenever a block has just finished
        while src.has_work():
            before = seq.block_idx
            src.step()
            if not seq.finished and seq.block_idx > before:
                cuts.append(seq.output_ids())
        assert src.outputs["r"].token_ids == alone[i].token_ids
        for committed in cuts:
            dst = Instance(Engine(model, tok), slots=4)
            dst.add_request("r", p, sp, committed=committed)
            assert dst.scheduler.requests["r"].output_blocks == 3 - len(committed) // 8
            dst.run()
            assert dst.outputs["r"].token_ids == alone[i].token_ids, (attention, p, len(committed))
            resumed += 1
        mid = alone[i].token_ids[:5]  # mid-block: the prefix stays, the rest is decoded again
        if len(mid) == 5:
            dst = Instance(Engine(model, tok), slots=4)
            dst.add_request("r", p, sp, committed=mid)
            dst.run()
            assert dst.outputs["r"].token_ids[:5] == mid
    assert resumed >= 2


def test_resume_rejects_bad_committed_tokens(tok):
    engine = Engine(make_model(), tok)
    with pytest.raises(ValueError, match="nothing to generate"):
        engine.add_request("abc", SamplingParams(max_tokens=8), committed=[5] * 8)
    with pytest.raises(ValueError, match="mask"):
        engine.add_request("abc", SamplingParams(max_tokens=8), committed=[tok.mask_token_id])
