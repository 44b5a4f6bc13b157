"""tiny-dg: the embedded DiffusionGemma. Its training examples and loss, the canvas evaluation, and
``remask export`` to a checkpoint on which transformers' own ``generate`` gives Remask's answers to held-out
prompts when fed the same draws.

The fast tests use a random model of tiny-dg's architecture, shrunk (tools/training.py ``dg_config``: sliding and
full layers with their own head sizes and K/V heads, proportional RoPE, experts, the character tokenizer), with
few denoising steps; the ``slow`` ones load the shipped weights.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

import tasksuite as tasks
from engine.models import diffusion_gemma as dg
from engine.tokenizer import CharTokenizer
from tests.dg_builders import STEPS, random_dg, same_draws
from tools import training as T
from tools.evaluate import canvas_prompt_ids


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    """A random tiny-dg-shaped checkpoint saved as training saves it (tests/dg_builders.py)."""
    tok = CharTokenizer.default()
    out = tmp_path_factory.mktemp("tinydg") / "small"
    T._save_dg(random_dg(tok), tok, out, step=0, seed=0)
    return out


def test_training_examples_hold_the_prompt_and_earlier_canvases(tok):
    rng = random.Random(3)
    ex = tasks.Example("prose", "story: cat 8", "x" * 40)  # two canvases of 32
    seen = set()
    for _ in range(20):
        context, canvas, weights = T.dg_example(ex, tok, rng)
        assert len(canvas) == len(weights) == T.DG_CANVAS
        prompt = T.dg_prompt_ids(tok, ex.prompt)
        assert context[:len(prompt)] == prompt and prompt[0] == tok.bos_token_id and prompt[-1] == tok.sep_token_id
        k = (len(context) - len(prompt)) // T.DG_CANVAS
        seen.add(k)
        full = tok.encode(ex.answer) + [tok.eos_token_id] * (2 * T.DG_CANVAS - 40)
        assert context[len(prompt):] == full[:k * T.DG_CANVAS] and canvas == full[k * T.DG_CANVAS:(k + 1) * 32]
        assert weights.count(1.0) == (32 if k == 0 else 9)  # the answer and its EOS; the padding weighs less
    assert seen == {0, 1}


def test_corruption_is_uniform_noise_at_a_sampled_level(tok):
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    batch = T.dg_batch([tasks.sample(rng, "lookup") for _ in range(256)], tok, rng, gen)
    changed = (batch.canvas != batch.targets).float().mean(1)
    assert 0.3 < float(changed.mean()) < 0.6  # t ~ U(0, 1), a 63/64 chance that a drawn token differs
    assert float(changed.min()) < 0.1 and float(changed.max()) > 0.85
    assert int(batch.canvas.max()) < tok.vocab_size and int(batch.canvas.min()) >= 0


def test_a_few_training_steps_lower_the_loss(small_dir, tmp_path):
    out = T.train_dg(tmp_path / "m", steps=3, batch_size=4, progress=False, init=small_dir, lr=1e-3)
    again = dg.load(out)
    assert again.config == dg.load(small_dir).config
    tok, rng, gen = CharTokenizer.default(), random.Random(1), torch.Generator().manual_seed(1)
    batch = T.dg_batch([tasks.sample(rng, "arith") for _ in range(8)], tok, rng, gen)
    model = dg.load(small_dir).train()
    with torch.no_grad():
        before, _ = T.dg_loss(model, batch, True, gen)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(5):
        loss, acc = T.dg_loss(model, batch, False, gen)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss) < float(before) and set(acc) == {"arith"}


def test_queries_examples_ask_several_keys_and_keep_out_of_the_heldout_split():
    """The trainer's ``queries`` task: a lookup prompt asked 1-4 distinct keys, answered with their values in
    the order asked; never a held-out prompt; its one-query form is a lookup the suite checks."""
    import re

    rng, seen = random.Random(4), set()
    for _ in range(200):
        ex = T.queries_example(rng)
        assert ex.category == T.QUERIES and not tasks.is_heldout(ex.prompt)
        body, asked = re.fullmatch(r"(.*?\.)((?: [a-z]\?)+)", ex.prompt).groups()
        keys = [k[0] for k in asked.split()]
        needles = dict(re.findall(r"(?:^| )([a-z])=(\d\d)\.", body))
        assert 3 <= len(needles) <= 4 and len(set(keys)) == len(keys) and set(keys) <= set(needles)
        assert ex.answer == " ".join(needles[k] for k in keys)
        if len(keys) == 1:
            assert tasks.check("lookup", ex.prompt, ex.answer)
        seen.add(len(keys))
    assert seen == {1, 2, 3, 4}
    rows = T.dg_batch([T.queries_example(rng) for _ in range(4)], CharTokenizer.default(), rng,
                      torch.Generator().manual_seed(0))
    assert rows.categories == [T.QUERIES] * 4
    with pytest.raises(ValueError, match="unknown categories in mix: \\['recall'\\]"):
        T.train_dg("unused", steps=1, mix={"recall": 1.0}, progress=False)


def test_checkpoints_of_runs_average_into_a_loadable_checkpoint(small_dir, tmp_path):
    """`remask train-default --average A B --out C` of DiffusionGemma checkpoints: C's weights are the mean of
    A's and B's, written as training writes a checkpoint (it loads, with the tokenizer and generation defaults)."""
    from tools.cli import main

    tok = CharTokenizer.default()
    other = dg.load(small_dir)
    with torch.no_grad():
        # parameters and buffers (the layer scalars), each tensor once (the LM head is the embedding)
        for t in {t.data_ptr(): t for t in other.state_dict().values()}.values():
            t.add_(1.0)
    T._save_dg(other, tok, tmp_path / "b", step=1, seed=0)
    assert main(["train-default", "--average", str(small_dir), str(tmp_path / "b"), "--out", str(tmp_path / "c")]) == 0
    avg, a = dg.load(tmp_path / "c"), dg.load(small_dir)
    assert avg.config == a.config
    for (name, pa), pc in zip(a.state_dict().items(), avg.state_dict().values()):
        assert torch.allclose(pc, pa + 0.5, atol=1e-6), name
    assert CharTokenizer.load(tmp_path / "c").vocab_size == tok.vocab_size
    with pytest.raises(ValueError, match="share one configuration"):
        T.average_checkpoints([small_dir, Path(__file__).parents[1] / "engine/defaults/tiny-bd"], tmp_path / "d")


def test_the_recipe_runs_every_phase_and_ends_with_its_weight_average(tmp_path):
    """`remask train-default --model tiny-dg`'s recipe at a few steps a phase: each phase continues from the one
    before; the last keeps its weights after its kept step (scaled to the step count given) and ends as the mean
    of those and its end."""
    counts = (1, 1, 1, 1, 1, 4)
    assert len(counts) == len(T.DG_RECIPE) and T.DG_RECIPE[-1]["average_at"]
    out = T.train_default_dg(tmp_path / "dg", steps=counts, batch_size=2, progress=False)
    kept = T.kept_checkpoint(out, 3)  # 5,842 of 7,399 steps: 3 of 4
    assert json.loads((out / "training.json").read_text()) == {"averaged": [kept.name, "dg"]}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*(f".dg-phase{k}" for k in range(1, 6)), kept.name,
                                                                  "dg"])
    with pytest.raises(ValueError, match="the recipe has 6 phases"):
        T.train_default_dg(tmp_path / "x", steps=(1, 1))


def test_canvas_evaluation_counts_accuracy_and_steps(small_dir):
    from engine.canvas import CanvasEngine
    from tools.evaluate import evaluate_canvas

    engine = CanvasEngine.from_pretrained(small_dir)
    first, again = (evaluate_canvas(engine, [None, 5.0], n=5) for _ in range(2))
    assert first == again  # each request's draws come from its seed
    r = first[0]
    assert r["entropy_bound"] == 0.1 and r["requests"] == 5 and 0.0 <= r["accuracy"] <= 1.0
    assert 1 <= r["steps_per_canvas"] <= STEPS and r["mean_rounds"] >= r["steps_per_canvas"]
    assert first[1]["steps_per_canvas"] <= r["steps_per_canvas"]  # a higher bound keeps more: no more steps


def _answers_match(model_dir, exported, monkeypatch, n: int, max_tokens: int) -> list[str]:
    """Remask's CanvasEngine and transformers' generate (on the exported checkpoint) on the first ``n`` held-out
    prompts, request i with seed 100 + i: the same text."""
    from transformers import DiffusionGemmaForBlockDiffusion

    from engine.canvas import CanvasEngine, CanvasParams

    engine = CanvasEngine.from_pretrained(model_dir)
    hf = DiffusionGemmaForBlockDiffusion.from_pretrained(str(exported), dtype=torch.float32).eval()
    texts = []
    for i, ex in enumerate(tasks.heldout_set(n)):
        ids = canvas_prompt_ids(engine.tokenizer, ex.prompt)
        ours = engine.generate([ids], CanvasParams(seed=100 + i, max_tokens=max_tokens))[0]
        same_draws(monkeypatch, 100 + i)
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=max_tokens)
        monkeypatch.undo()
        new = out.sequences[0, len(ids):].tolist()
        cut = next((j for j, t in enumerate(new) if t in engine.stop_ids), len(new))
        assert engine.tokenizer.decode(new[:cut]) == ours.text, (ex.prompt, ours.text)
        texts.append(ours.text)
    return texts


def test_export_and_transformers_generate_give_remasks_answers(small_dir, tmp_path, monkeypatch):
    from tools.cli import main

    out = tmp_path / "exported"
    assert main(["export", str(small_dir), str(out)]) == 0
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    texts = _answers_match(small_dir, out, monkeypatch, n=2, max_tokens=2 * T.DG_CANVAS)
    assert any(texts)  # random weights, but some text before an EOS


def test_tiny_dg_is_an_embedded_model_of_the_family():
    from engine.canvas import is_diffusion_gemma
    from engine.loading import DEFAULT_MODELS, resolve_model

    assert "tiny-dg" in DEFAULT_MODELS
    path = resolve_model("tiny-dg")
    assert is_diffusion_gemma(path)
    cfg = dg.read_config(path)
    assert cfg.layer_types == (dg.SLIDING, dg.FULL, dg.SLIDING, dg.FULL) and len(set(cfg.head_dims)) == 2
    assert cfg.canvas_length == T.DG_CANVAS and cfg.vocab_size == CharTokenizer.default().vocab_size
    assert cfg == T.dg_config(CharTokenizer.default())  # what train-default builds


@pytest.mark.slow
def test_shipped_tiny_dg_exports_and_transformers_answers_as_remask(tmp_path, monkeypatch):
    from engine.loading import resolve_model
    from tools.cli import main

    out = tmp_path / "tiny-dg-hf"
    assert main(["export", "tiny-dg", str(out)]) == 0
    texts = _answers_match(resolve_model("tiny-dg"), out, monkeypatch, n=10, max_tokens=2 * T.DG_CANVAS)
    examples = tasks.heldout_set(10)
    assert all(len(t) == 1 and t in "abcd" for ex, t in zip(examples, texts) if ex.category == "choice"), texts
    assert sum(ex.check(t) for ex, t in zip(examples, texts)) >= 1, texts  # trained: some right answers


def test_remask_eval_on_a_canvas_model(small_dir, capsys):
    import json

    from tools.cli import main

    assert main(["eval", "--model", str(small_dir), "--n", "2", "--entropy-bounds", "0.1,2", "--json", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["entropy_bound"] for r in out["results"]] == [0.1, 2.0] and out["results"][0]["requests"] == 2
    assert main(["eval", "--model", str(small_dir), "--decoding", "threshold", "--quiet"]) == 2
    assert "renoise" in capsys.readouterr().err
    assert main(["eval", "--model", "tiny-bd", "--entropy-bounds", "0.1", "--quiet"]) == 2
    assert "DiffusionGemma" in capsys.readouterr().err


def test_noised_copies_share_one_encoder_pass(small_dir, tok):
    rng, gen = random.Random(2), torch.Generator().manual_seed(2)
    examples = [tasks.sample(rng, c) for c in ("arith", "json", "reverse")]
    batch = T.dg_batch(examples, tok, rng, gen, copies=4)
    assert len(batch.contexts) == 3 and batch.canvas.shape == (12, T.DG_CANVAS)
    assert batch.categories == [c for c in ("arith", "json", "reverse") for _ in range(4)]
    clean = batch.targets.view(3, 4, -1)
    assert bool((clean == clean[:, :1]).all())  # one clean canvas per example
    assert len({tuple(r) for r in batch.canvas[:4].tolist()}) > 1  # each copy noised on its own
    model = dg.load(small_dir)
    with torch.no_grad():
        loss, _ = T.dg_loss(model, batch, False, gen)
        # the same rows with each context repeated (four encoder passes) give the same loss
        repeated = T.DGBatch([c for c in batch.contexts for _ in range(4)], batch.canvas, batch.targets,
                             batch.weights, batch.categories)
        again, _ = T.dg_loss(model, repeated, False, gen)
    assert torch.allclose(loss, again, atol=1e-5)


def test_a_narrower_checkpoint_widens_to_the_tokenizer_and_keeps_its_ids(small_dir, tmp_path):
    model = dg.load(small_dir)
    narrow = dg.DiffusionGemma(model.config.replace(vocab_size=57, image_token_id=57))
    state = {k: v[:57] if k in ("embed_tokens.weight", "lm_head.weight") else v
             for k, v in model.state_dict().items()}
    narrow.load_state_dict(state)
    wide = T._widen_vocab(narrow, 64)
    assert wide.config.vocab_size == 64 and wide.config.image_token_id == 64
    assert wide.lm_head.weight is wide.embed_tokens.weight  # still tied
    assert torch.equal(wide.embed_tokens.weight[:57], narrow.embed_tokens.weight)
    assert float(wide.embed_tokens.weight[57:].detach().std()) < 0.05
    with pytest.raises(ValueError, match="more than the tokenizer"):
        T._widen_vocab(wide, 57)
    dg.save_pretrained(narrow, tmp_path / "narrow")
    out = T.train_dg(tmp_path / "w", steps=1, batch_size=2, progress=False, init=tmp_path / "narrow", copies=2,
                     mix={"json": 1.0})
    assert dg.read_config(out).vocab_size == CharTokenizer.default().vocab_size
