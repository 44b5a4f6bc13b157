"""The work predictors: features, models, artifacts and the engine hook."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from predictors.admission import AdmissionPredictor
from predictors.bundle import PredictorError, load_predictors
from predictors.features import confidence_stats, expected_blocks, spearman, with_thresholds
from predictors.refine import Refiner, expected_rounds, survival_nll
from predictors.step import StepPredictor, choose_interval, online_errors


def test_spearman_ties_and_constant():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 1, 2, 2], [1, 1, 2, 2]) == pytest.approx(1.0)
    assert np.isnan(spearman([1, 1, 1], [1, 2, 3]))


def test_confidence_stats_and_threshold_expansion():
    assert confidence_stats(None).tolist() == [0.0] * 5
    assert confidence_stats(torch.tensor([])).tolist() == [0.0] * 5
    assert confidence_stats(torch.tensor([0.1, 0.9, 0.5])).tolist() == pytest.approx([0.1, 0.1, 0.5, 0.5, 0.9])
    rows = np.arange(22, dtype=float).reshape(2, 11)
    out = with_thresholds(rows, [0.5, 0.9])
    assert out.shape == (4, 11)
    assert out[:, 0].tolist() == [0.5, 0.9, 0.5, 0.9]
    assert (out[1, 1:] == rows[0, 1:]).all() and (out[2, 1:] == rows[1, 1:]).all()


def test_flat_forest_matches_lightgbm():
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 50, size=(400, 4))
    rounds = np.maximum(1, (x[:, 2] / 5 + rng.normal(0, 1, 400))).round()
    model = AdmissionPredictor.fit(x, rounds)
    batched = model.predict(x[:50])
    single = [model.predict_one(row) for row in x[:50].tolist()]
    assert np.allclose(batched, single, rtol=1e-9)
    assert spearman(model.predict(x), rounds) > 0.8


def test_survival_mean_and_loss():
    k = 6
    logits = torch.full((1, k), -20.0)
    logits[0, 2] = 20.0  # certain stop at round 3
    assert expected_rounds(logits).item() == pytest.approx(3.0, abs=1e-3)
    assert expected_rounds(torch.full((1, k), -20.0)).item() == pytest.approx(k, abs=1e-3)  # mass past K sits at K
    t = torch.tensor([3])
    assert survival_nll(logits, t).item() < survival_nll(torch.zeros(1, k), t).item()


@pytest.mark.slow
def test_refiner_learns_hidden_signal_and_round_trips(tmp_path):
    rng = np.random.default_rng(1)
    n, h = 600, 16
    hidden = rng.normal(size=(n, h)).astype(np.float32)
    rounds = np.clip(np.round(np.exp(1.5 + hidden[:, 0])), 1, 40).astype(int)
    conf = np.full((n, 5), 0.9)
    x = Refiner.inputs(torch.as_tensor(hidden), [20] * n, [64] * n, [0.9] * n, conf).numpy()
    ref = Refiner.fit(x[:500], rounds[:500], epochs=60, seeds=(0, 1))
    pred = ref.predict(hidden[500:], [20] * 100, [64] * 100, [0.9] * 100, conf[500:])
    assert spearman(pred, rounds[500:]) > 0.8
    ref.save(tmp_path / "r.safetensors")
    again = Refiner.load(tmp_path / "r.safetensors")
    assert np.allclose(again.predict(hidden[500:], [20] * 100, [64] * 100, [0.9] * 100, conf[500:]), pred)


def test_expected_blocks_from_first_round_eos():
    block_only = [torch.zeros(8), torch.tensor([0, 0, 0, 1, 1, 1, 1, 1.0]), None]  # a block-causal first block
    canvas = torch.zeros(40)
    canvas[20:] = 1.0  # a full canvas ending in block 2 of 5
    got = expected_blocks([*block_only, canvas], 8, [21, 21, 21, 5])
    assert got.tolist() == pytest.approx([21.0, 1.0, 1.0, 3.0])  # no end seen: runs on to its budget
    half = expected_blocks([torch.full((8,), 0.5)], 8, [5])
    assert half.item() == pytest.approx(3.0)


def test_structural_term_adds_blocks_beyond_training(tmp_path):
    rng = np.random.default_rng(3)
    n, h = 300, 8
    hidden = rng.normal(size=(n, h)).astype(np.float32)
    rounds = rng.integers(1, 4, size=n)  # single-block requests only
    conf = np.full((n, 5), 0.9)
    x = Refiner.inputs(torch.as_tensor(hidden), [16] * n, [64] * n, [0.9] * n, conf).numpy()
    ref = Refiner.fit(x, rounds, epochs=5, seeds=(0,), blocks=np.ones(n, dtype=int))
    args = (hidden[:3], [16] * 3, [64] * 3, [0.9] * 3, conf[:3])
    base = ref.predict(*args)
    assert np.allclose(ref.predict(*args, blocks=[1.0, 1.0, 8.0]) - base, [0.0, 0.0, 7.0])
    assert base.max() <= 3.0  # the learned part alone never passes the training maximum
    ref.save(tmp_path / "r.safetensors")
    assert Refiner.load(tmp_path / "r.safetensors").max_blocks == 1


def test_engine_records_first_round_eos_without_changing_tokens():
    from engine.loading import load_engine

    engine = load_engine("tiny-bd", max_slots=4)
    plain = engine.generate(["rev: abc"])[0].text
    seq = engine.add_request("rev: abc")
    while not seq.finished:
        engine.step([seq])
    assert engine.output(seq).text == plain == "cba"
    assert seq.first_eos.shape == (engine.cfg.block_size,)  # block-causal: the first block only
    assert expected_blocks([seq.first_eos], engine.cfg.block_size, [21]).item() == pytest.approx(1.0, abs=0.05)


def test_lookahead_reads_the_whole_budget_and_leaves_decoding_alone():
    """With lookahead, a block-causal request whose first block does not end its answer runs its
    second round with the masked rest of its budget appended and is refined after it: tokens,
    rounds and first-block hidden rows are those without lookahead, P(EOS) then covers the budget,
    and a long story is expected to run several blocks. Answers that end in their first block are
    refined after round 1 with no lookahead."""
    from engine.loading import load_engine
    from engine.sequence import SamplingParams

    prompts = ["rev: abc", "story: cat 5", "12+7="]  # 5 sentences: past 3 blocks, within the budget
    runs = {}
    for lookahead in (0, 8):
        engine = load_engine("tiny-bd", max_slots=4)
        engine.lookahead = lookahead
        seqs = [engine.add_request(p, SamplingParams(max_tokens=64)) for p in prompts]
        tokens = []
        while not all(s.finished for s in seqs):
            tokens.append(engine.step().composition)
        runs[lookahead] = seqs, tokens
    (plain, plain_rounds), (ahead, ahead_rounds) = runs[0], runs[8]
    for a, b in zip(plain, ahead):
        assert a.output_ids() == b.output_ids() and a.rounds == b.rounds
        assert torch.allclose(a.first_hidden, b.first_hidden, atol=1e-5)
    assert [s.refine_at for s in ahead] == [1, 2, 1]
    assert [len(s.first_eos) for s in ahead] == [8, 64, 8]
    # one round ran longer: the story's second, by the masked blocks after the one it decoded
    extra = [sum(n for _, n, _ in a) - sum(n for _, n, _ in p) for a, p in zip(ahead_rounds, plain_rounds)]
    assert sorted(extra)[-2] == 0 and max(extra) in (48, 56)
    blocks = expected_blocks([s.first_eos for s in ahead], 8, [8, 8, 8])
    assert blocks[1] > 3.0 > blocks[0] and blocks[2] < 1.5
    assert len(ahead[1].output_ids()) > 3 * 8


def test_online_step_error_beats_oneshot_and_interval_choice():
    rng = np.random.default_rng(2)
    rows, remaining, done, req = [], [], [], []
    for r in range(200):  # each request's true length is only visible in its state after a few steps
        total = int(rng.integers(5, 40))
        for s in range(1, total):
            hint = total if s >= 4 else 20.0
            rows.append([0.9, 64, s / total, 0, 0, s, 0, 0, 0, 0, hint])
            remaining.append(total - s)
            done.append(s)
            req.append(r)
    rows, remaining, done, req = map(np.asarray, (rows, remaining, done, req))
    model = StepPredictor.fit(rows, remaining)
    errs = online_errors(model, rows, remaining, done, req)
    assert errs["every_1"] < 0.7 * errs["oneshot"]
    assert choose_interval({"every_1": 0.10, "every_2": 0.104, "every_4": 0.2}) == 2
    assert model.predict(rows[:3], [0.5, 0.7, 0.9]).shape == (3, 3)


def test_missing_and_corrupt_artifacts(tmp_path):
    with pytest.raises(PredictorError, match="remask predictors train"):
        load_predictors("tiny-bd", tmp_path)
    for f in ("admission.txt", "refine.safetensors", "step.txt"):
        (tmp_path / f).write_text("garbage")
    (tmp_path / "meta.json").write_text(json.dumps({}))
    with pytest.raises(PredictorError, match="corrupt"):
        load_predictors("tiny-bd", tmp_path)


def test_shipped_predictors_refine_inside_the_engine():
    import tasksuite as tasks
    from engine.instance import Instance
    from engine.loading import load_engine

    pred = load_predictors("tiny-bd")
    inst = Instance(load_engine("tiny-bd", max_slots=8), slots=8)
    pred.attach(inst)
    ex = tasks.heldout_set(10)
    reqs = [inst.add_request(f"r{i}", e.prompt) for i, e in enumerate(ex)]
    assert all(r.est_rounds > 0 for r in reqs)
    assert len({round(r.est_rounds, 3) for r in reqs}) > 1  # prompt features matter
    inst.run()
    assert all(r.refined for r in reqs)
    assert len(inst.outputs) == 10


def test_a_failing_refine_hook_does_not_fail_rounds():
    from engine.loading import load_engine

    engine = load_engine("tiny-bd", max_slots=4)

    def broken(seqs):
        raise RuntimeError("boom")

    engine.refine_hook = broken
    assert engine.generate(["rev: abc"])[0].text == "cba"
    assert engine.refine_hook is None


@pytest.mark.slow
def test_collect_train_eval_cli(tmp_path, capsys):
    from tools.cli import main

    data, art = str(tmp_path / "data"), str(tmp_path / "art")
    common = ["--model", "tiny-bd", "--data-dir", data, "--quiet"]
    assert main(["predictors", "collect", "--n", "12", "--n-heldout", "10", "--thresholds", "0.6,0.9", *common]) == 0
    assert main(["predictors", "train", "--epochs", "3", "--out", art, *common]) == 0
    capsys.readouterr()
    assert main(["predictors", "eval", "--artifacts", art, "--no-categories", "--json", *common]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) >= {"admission", "refined", "step", "admission_us", "refine_ms_per_round"}
    assert report["requests"] == 10 and report["step"]["interval"] >= 1
    assert main(["predictors", "eval", "--artifacts", str(tmp_path / "none"), *common]) == 2  # clear error


def test_a_deferred_request_is_refined_even_with_nothing_left_to_append():
    """A story with a two-block budget: deferred after round 1, its lookahead round may already be
    its last block (nothing to append); it is refined after that round all the same."""
    from engine.loading import load_engine
    from engine.sequence import SamplingParams

    engine = load_engine("tiny-bd", max_slots=4)
    load_predictors("tiny-bd").hook_into(engine)
    seq = engine.add_request("story: owl 4", SamplingParams(max_tokens=16))
    while not seq.finished:
        engine.step()
        if seq.rounds == 1:
            assert seq.refine_at == 2 and seq.refined_rounds is None
    assert seq.refined_rounds is not None and seq.rounds >= 2


def test_tensor_parallel_followers_run_the_lookahead_with_rank_0():
    """Rank 0's engine decides which requests run the lookahead; a follower rank (its own engine,
    no predictors) learns it from rank 0's commands, so every forward has the same shapes on both."""
    from engine.instance import Follower, Instance
    from engine.loading import load_engine
    from engine.sequence import SamplingParams

    def recording(engine, seen):  # each round's forward shapes
        inner = engine.step

        def step(plan=None):
            result = inner(plan)
            seen.append(result.composition)
            return result

        engine.step = step
        return engine

    seen, follow_seen = [], []
    follower = Follower(recording(load_engine("tiny-bd", max_slots=4), follow_seen))

    def mirror(commands, plan):
        follower.step(commands, plan)
        return lambda: None

    engine = recording(load_engine("tiny-bd", max_slots=4), seen)
    load_predictors("tiny-bd").hook_into(engine)
    inst = Instance(engine, slots=4, mirror=mirror)
    for i, p in enumerate(["story: cat 4", "rev: abc", "story: dog 2"]):
        inst.add_request(f"r{i}", p, SamplingParams(max_tokens=96))
    inst.run()
    assert follow_seen == seen
    assert any(n > 16 for comp in seen for _, n, _ in comp)  # a lookahead round ran
    assert inst.outputs["r1"].text == "cba"
