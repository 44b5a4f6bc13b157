from __future__ import annotations

import pytest

from engine.engine import Engine
from engine.instance import Instance
from engine.sequence import SamplingParams
from tests.conftest import make_model

PROMPTS = ["max: a1 b7 c3 d2", "12+5=", "rev: abcdef", "story: cat 3", "x", "hello there friend"]


@pytest.mark.parametrize("attention", ["block_causal", "bidirectional"])
def test_preemption_does_not_change_outputs(tok, attention):
    model = make_model(attention=attention)
    params = [SamplingParams(max_tokens=8 * (1 + i % 3), threshold=0.7) for i in range(len(PROMPTS))]
    alone = Engine(model, tok, max_slots=8).generate(PROMPTS, params)
    results = {}
    for policy in ("dwise", "fcfs-mixed", "fcfs-prefill-first", "mlfq"):
        inst = Instance(Engine(model, tok, max_slots=2), policy=policy, slots=2, resident_factor=3,
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
