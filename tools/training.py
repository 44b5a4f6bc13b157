"""Training of the embedded default models on the synthetic task suite.

``tiny-bd`` is a block-diffusion model (block-causal attention, block 8): each
example noises one answer block, with the earlier blocks clean, exactly as the
engine decodes it over an exact KV cache. ``tiny-mdm`` is a full-sequence
masked diffusion model: the answer is padded with EOS to a canvas and masked
either uniformly at a random ratio or semi-autoregressively (earlier blocks
clean, one block partly masked, later blocks fully masked), which is how it
is served with the approximate cache.
"""

from __future__ import annotations

import copy
import json
import math
import random
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import tasksuite as tasks
from engine.models.checkpoint import save_pretrained
from engine.models.config import ModelConfig
from engine.models.masks import full_mask
from engine.models.transformer import DLMTransformer
from engine.tokenizer import CharTokenizer

BLOCK = 8
GEN_LEN = 168  # tiny-mdm's canvas length: covers the longest answer of the suite
PAD_EOS_WEIGHT = 0.1  # loss weight of EOS padding after the first EOS


def default_config(name: str, tok: CharTokenizer) -> ModelConfig:
    if name not in ("tiny-bd", "tiny-mdm"):
        raise ValueError(f"unknown default model {name!r}; known: tiny-bd, tiny-mdm")
    return ModelConfig(
        vocab_size=64,
        hidden_size=128,
        num_layers=6,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=384,
        rope_theta=10000.0,
        attention="block_causal" if name == "tiny-bd" else "bidirectional",
        block_size=BLOCK,
        mask_token_id=tok.mask_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_position_embeddings=512,
        extra={"name": name, "gen_length": GEN_LEN, "chat_template": "char-pad-to-block"},
    )


@dataclass
class TrainingBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    targets: torch.Tensor  # -100 where no loss
    weights: torch.Tensor
    categories: list[str]


def _pad_eos(answer: list[int], length: int, eos: int) -> list[int]:
    return answer + [eos] * (length - len(answer))


def _example_bd(ex: tasks.Example, tok: CharTokenizer, rng: random.Random):
    prompt = tok.prompt_ids(ex.prompt, BLOCK)
    ans = tok.encode(ex.answer) + [tok.eos_token_id]
    ans = _pad_eos(ans, -(-len(ans) // BLOCK) * BLOCK, tok.eos_token_id)
    k = rng.randrange(len(ans) // BLOCK)
    block = ans[k * BLOCK:(k + 1) * BLOCK]
    ratio = rng.random()
    masked = [rng.random() < ratio for _ in block]
    if not any(masked):
        masked[rng.randrange(BLOCK)] = True
    noisy = [tok.mask_token_id if m else t for t, m in zip(block, masked)]
    ids = prompt + ans[:k * BLOCK] + noisy
    targets = [-100] * (len(ids) - BLOCK) + [t if m else -100 for t, m in zip(block, masked)]
    return ids, targets, [1.0] * len(ids)


def _example_mdm(ex: tasks.Example, tok: CharTokenizer, rng: random.Random, gen_len: int = GEN_LEN):
    prompt = tok.prompt_ids(ex.prompt, BLOCK)
    ans = tok.encode(ex.answer) + [tok.eos_token_id]
    if rng.random() < 0.15:
        canvas = gen_len
    else:
        canvas = min(gen_len, -(-len(ans) // BLOCK) * BLOCK + BLOCK * rng.randint(0, 2))
    full = _pad_eos(ans, canvas, tok.eos_token_id)
    ratio = rng.random()
    if rng.random() < 0.5:
        masked = [rng.random() < ratio for _ in full]
    else:
        k = rng.randrange(min(canvas // BLOCK, len(ans) // BLOCK + 1))
        masked = [False] * (k * BLOCK) + [rng.random() < ratio for _ in range(BLOCK)]
        masked += [True] * (canvas - len(masked))
    if not any(masked):
        masked[rng.randrange(len(ans))] = True
    ids = prompt + [tok.mask_token_id if m else t for t, m in zip(full, masked)]
    targets = [-100] * len(prompt) + [t if m else -100 for t, m in zip(full, masked)]
    weights = [1.0] * (len(prompt) + len(ans)) + [PAD_EOS_WEIGHT] * (canvas - len(ans))
    return ids, targets, weights


# Training-only task: associative recall. A lookup prompt in which some needles appear a second time
# with their digits masked, so every repeated needle is a target that only matching its key can fill
# (the suite's lookup has one such target per prompt: its answer). Its examples also carry the usual
# query and answer.
RECALL = "recall"


def _needles(rng: random.Random, keys: tuple[int, int], filler: tuple[int, int]):
    """A lookup prompt's body for the training-only tasks: (keys, {key: two-digit value}, the ``key=value.``
    needles and filler sentences shuffled), with ``keys`` and ``filler`` giving the (least, most) of each."""
    chosen = rng.sample(tasks.KEYS, rng.randint(*keys))
    values = {k: f"{rng.randrange(100):02d}" for k in chosen}
    items = [f"{k}={values[k]}." for k in chosen] + rng.sample(tasks.FILLER, rng.randint(*filler))
    rng.shuffle(items)
    return chosen, values, items


def recall_example(rng: random.Random) -> tasks.Example:
    """A ``recall`` example: 3-5 needles, 0-3 filler sentences, 2 or more needles repeated at the end."""
    while True:
        keys, values, items = _needles(rng, (3, 5), (0, 3))
        items += [f"{k}={values[k]}." for k in rng.sample(keys, rng.randint(2, len(keys)))]
        query = rng.choice(keys)
        prompt = " ".join(items) + f" {query}?"
        if not tasks.is_heldout(prompt):
            return tasks.Example(RECALL, prompt, values[query])


# Training-only task of the DiffusionGemma trainer: a lookup asked several keys at once. The prompt is a
# lookup's (3-4 needles, 1-4 filler sentences) ending in 1-4 distinct queries ("f? c?"), the answer their values
# in that order ("41 84"). Each value is a key match of its own, so an example carries up to four, where the
# suite's lookup carries one (its one-query form is a lookup prompt; the held-out split stays out). The decoder
# takes its loss on the canvas only, so tiny-mdm's ``recall`` (targets in the prompt) does not apply to it.
QUERIES = "queries"


def queries_example(rng: random.Random) -> tasks.Example:
    """A ``queries`` example (the comment above)."""
    while True:
        keys, values, items = _needles(rng, (3, 4), (1, 4))
        asked = rng.sample(keys, rng.randint(1, len(keys)))
        prompt = " ".join(items) + " " + " ".join(f"{k}?" for k in asked)
        if not tasks.is_heldout(prompt):
            return tasks.Example(QUERIES, prompt, " ".join(values[k] for k in asked))


def _repeated_digits(prompt: str) -> list[int]:
    """Character offsets of the digits of every needle whose key already appeared earlier."""
    seen, out = set(), []
    for m in re.finditer(r"(?:^| )([a-z])=(\d\d)\.", prompt):
        if m.group(1) in seen:
            out += [m.start(2), m.start(2) + 1]
        seen.add(m.group(1))
    return out


def _mask_repeats(ex: tasks.Example, tok: CharTokenizer, ids: list[int], targets: list[int]) -> None:
    first = ids.index(tok.bos_token_id) + 1  # the row starts with the chat template: the prompt's first char
    for c in _repeated_digits(ex.prompt):
        targets[first + c], ids[first + c] = ids[first + c], tok.mask_token_id


def build_rows(name: str, examples: list[tasks.Example], tok: CharTokenizer, rng: random.Random,
               lookup_canvas: int | None = None) -> list[tuple]:
    """Training rows; ``lookup_canvas`` caps tiny-mdm's canvas for lookup and recall examples
    (their answers are 3 tokens, so a full canvas is mostly EOS padding: a lookup-only step costs
    about a quarter less with a cap of 24)."""
    rows = []
    for ex in examples:
        if name == "tiny-bd":
            ids, tgt, w = _example_bd(ex, tok, rng)
        else:
            short = lookup_canvas and ex.category in ("lookup", RECALL)
            ids, tgt, w = _example_mdm(ex, tok, rng, lookup_canvas if short else GEN_LEN)
        if ex.category == RECALL:
            _mask_repeats(ex, tok, ids, tgt)
        rows.append((ids, tgt, w, ex.category))
    return rows


def collate(name: str, rows: list[tuple], tok: CharTokenizer) -> TrainingBatch:
    length = max(len(r[0]) for r in rows)
    ids = torch.full((len(rows), length), tok.pad_token_id, dtype=torch.long)
    tgt = torch.full((len(rows), length), -100, dtype=torch.long)
    wts = torch.zeros((len(rows), length))
    valid = torch.zeros((len(rows), length), dtype=torch.bool)
    for i, (r_ids, r_tgt, r_w, _) in enumerate(rows):
        ids[i, :len(r_ids)] = torch.tensor(r_ids)
        tgt[i, :len(r_tgt)] = torch.tensor(r_tgt)
        wts[i, :len(r_w)] = torch.tensor(r_w)
        valid[i, :len(r_ids)] = True
    positions = torch.arange(length).expand(len(rows), length)
    mode = "block_causal" if name == "tiny-bd" else "bidirectional"
    return TrainingBatch(ids, positions, full_mask(mode, positions, valid, BLOCK), tgt, wts, [r[3] for r in rows])


def make_batch(name: str, examples: list[tasks.Example], tok: CharTokenizer, rng: random.Random) -> TrainingBatch:
    return collate(name, build_rows(name, examples, tok, rng), tok)


def sample_mix(rng: random.Random, mix: dict[str, float] | None) -> tasks.Example:
    if not mix:
        return tasks.sample(rng)
    category = rng.choices(list(mix), weights=list(mix.values()))[0]
    if category in TRAINING_ONLY:
        return TRAINING_ONLY[category](rng)
    return tasks.sample(rng, category)


TRAINING_ONLY = {RECALL: recall_example, QUERIES: queries_example}


def bucketed_batches(name: str, tok: CharTokenizer, rng: random.Random, batch_size: int, pool: int = 16,
                     mix: dict[str, float] | None = None, lookup_canvas: int | None = None):
    """Endless batches; each pool of examples is sorted by length so little is padding."""
    while True:
        rows = build_rows(name, [sample_mix(rng, mix) for _ in range(batch_size * pool)], tok, rng, lookup_canvas)
        rows.sort(key=lambda r: len(r[0]))
        chunks = [rows[i:i + batch_size] for i in range(0, len(rows), batch_size)]
        rng.shuffle(chunks)
        for chunk in chunks:
            yield collate(name, chunk, tok)


def loss_fn(model: DLMTransformer, batch: TrainingBatch, teacher: DLMTransformer | None = None,
            distill: tuple[str, ...] = ()) -> tuple[torch.Tensor, dict[str, float]]:
    """The weighted cross-entropy at the target positions; rows of a ``distill`` category take the KL divergence
    from ``teacher``'s distribution there instead."""
    logits, _, _ = model(batch.input_ids, batch.positions, batch.mask)
    ce = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), reduction="none").view_as(batch.weights)
    rows = [i for i, c in enumerate(batch.categories) if c in distill]
    if teacher is not None and rows:
        with torch.no_grad():
            target = teacher(batch.input_ids[rows], batch.positions[rows], batch.mask[rows])[0].log_softmax(-1)
        kl = F.kl_div(logits[rows].log_softmax(-1), target, log_target=True, reduction="none").sum(-1)
        ce = ce.index_put((torch.tensor(rows, device=ce.device),), kl)
    on = batch.targets != -100
    w = batch.weights * on
    loss = (ce * w).sum() / w.sum().clamp(min=1)
    with torch.no_grad():
        hit = (logits.argmax(-1) == batch.targets) & on
        stats: dict[str, list[float]] = {}
        for i, c in enumerate(batch.categories):
            n = int(on[i].sum())
            if n:
                stats.setdefault(c, []).append(float(hit[i].sum()) / n)
    return loss, {c: sum(v) / len(v) for c, v in stats.items()}


def lr_at(progress: float, peak: float, warmup: float = 0.02) -> float:
    if progress < warmup:
        return peak * progress / warmup
    p = min(1.0, (progress - warmup) / (1 - warmup))
    return peak * (0.03 + 0.97 * 0.5 * (1 + math.cos(math.pi * p)))


def train(
    name: str,
    out_dir: str | Path,
    steps: int = 20000,
    minutes: float | None = None,
    batch_size: int = 32,
    lr: float = 2e-3,
    seed: int = 0,
    device: str = "cpu",
    threads: int | None = None,
    save_every_s: float = 300.0,
    log_path: str | Path | None = None,
    progress: bool = True,
    init: str | Path | None = None,
    log_every: int = 200,
    mix: dict[str, float] | None = None,
    lookup_canvas: int | None = None,
    new_ids_only: bool = False,
    distill: tuple[str, ...] = (),
) -> Path:
    """Train one default model; progress is max(step / steps, elapsed / minutes).

    ``mix`` weights the task categories and the training-only ``recall`` task
    (uniform over the categories when None); ``init`` continues from a
    checkpoint (a later phase with its own schedule); ``lookup_canvas`` see
    ``build_rows``. ``new_ids_only`` (with ``init``) trains only the embedding
    and output rows of the ids the tokenizer has and the checkpoint's own
    tokenizer lacks (``new_ids``): every other weight stays bit for bit, so
    the model's hidden states on text without the new characters are the
    checkpoint's, and so are its answers up to the softmax share of the new
    rows (tried on tiny-bd for JSON: its frozen body did not learn the
    category; reports/structured.md, section 4). ``distill`` (with ``init``) names categories whose
    examples are fitted to the checkpoint's own distributions instead of the
    answers (the KL divergence from the frozen checkpoint at every target
    position): learning a new category while the confidences on those stay
    where they were, so their threshold trade-off holds."""

    known = (*tasks.ALL_CATEGORIES, RECALL)
    if mix and set(mix) - set(known):
        raise ValueError(f"unknown categories in mix: {sorted(set(mix) - set(known))}; known: {', '.join(known)}")
    if lookup_canvas is not None and (lookup_canvas < BLOCK or lookup_canvas % BLOCK):
        raise ValueError(f"lookup_canvas must be a positive multiple of {BLOCK}, got {lookup_canvas}")
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = CharTokenizer.default()
    cfg = default_config(name, tok)
    if init:
        from engine.models.checkpoint import load_remask

        model = load_remask(init).to(device).train()
        if model.config.attention != cfg.attention:
            raise ValueError(f"{init} is not a {name} checkpoint")
    else:
        model = DLMTransformer(cfg).to(device)
    keep = None
    if new_ids_only:
        if not init:
            raise ValueError("new_ids_only trains the new ids' rows of a checkpoint: give init")
        fresh = new_ids(CharTokenizer.load(init), tok)
        if not fresh:
            raise ValueError(f"{init}'s tokenizer already has every id of the default tokenizer: no new rows")
        rows = [model.embed_tokens.weight, model.lm_head.weight]
        for prm in model.parameters():
            prm.requires_grad_(False)
        for prm in rows:
            prm.requires_grad_(True)
        old = torch.ones(rows[0].shape[0], dtype=torch.bool, device=device)
        old[fresh] = False
        keep = [(prm, old, prm.detach().clone()) for prm in rows]
    teacher = None
    if distill:
        if not init:
            raise ValueError("distill fits the init checkpoint's distributions: give init")
        from engine.models.checkpoint import load_remask

        teacher = load_remask(init).to(device).eval()
        for prm in teacher.parameters():
            prm.requires_grad_(False)
    params = [prm for prm in model.parameters() if prm.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    batches = bucketed_batches(name, tok, rng, batch_size, mix=mix, lookup_canvas=lookup_canvas)

    def one_step():
        batch = next(batches)
        batch = TrainingBatch(*(t.to(device) if torch.is_tensor(t) else t for t in vars(batch).values()))
        return loss_fn(model, batch, teacher, distill)

    def restore() -> None:
        with torch.no_grad():  # the checkpoint's own rows exactly as they were (AdamW's decay included)
            for prm, old, orig in keep:
                prm[old] = orig[old]

    out_dir = Path(out_dir)
    run_steps(opt, params, one_step, lambda step: _save(model, tok, out_dir, step, seed), steps=steps,
              minutes=minutes, lr=lr, desc=f"train {name}", progress=progress, log_path=log_path,
              log_every=log_every, save_every_s=save_every_s, after_step=restore if keep else None)
    return out_dir


def run_steps(opt, params, one_step, save, steps: int, minutes: float | None, lr: float, desc: str, progress: bool,
              log_path: str | Path | None, log_every: int, save_every_s: float, after_step=None,
              ema_decay: float = 0.98, postfix_every: int = 50, bar_interval_s: float = 2.0) -> int:
    """The training loop both trainers share: ``one_step()`` -> (loss, per-category accuracy) of a batch, then
    backward, clipping to norm 1 and the optimiser's step (``after_step()`` after it); the learning rate a warmup
    and cosine over progress = max(step / steps, elapsed / minutes); a progress bar, exponential moving averages
    of the loss and accuracies (a JSON line to ``log_path`` every ``log_every`` steps), ``save(step)`` every
    ``save_every_s`` and at the end. Returns the steps taken."""
    from tqdm import tqdm

    log = open(log_path, "a") if log_path else None
    start = last_save = time.time()
    bar = tqdm(total=steps, desc=desc, disable=not progress, mininterval=bar_interval_s)
    ema: dict[str, float] = {}
    step = 0
    while True:
        frac = step / steps
        if minutes:
            frac = max(frac, (time.time() - start) / (minutes * 60))
        if frac >= 1.0:
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(frac, lr)
        loss, acc = one_step()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if after_step is not None:
            after_step()
        step += 1
        ema["loss"] = ema_decay * ema.get("loss", loss.item()) + (1 - ema_decay) * loss.item()
        for c, a in acc.items():
            ema[c] = ema_decay * ema.get(c, a) + (1 - ema_decay) * a
        bar.update(1)
        if step % postfix_every == 0:
            bar.set_postfix(loss=f"{ema['loss']:.3f}")
        if log and step % log_every == 0:
            record = {"step": step, "elapsed_s": round(time.time() - start), "lr": opt.param_groups[0]["lr"]}
            log.write(json.dumps({**record, **{k: round(v, 4) for k, v in ema.items()}}) + "\n")
            log.flush()
        if time.time() - last_save > save_every_s:
            save(step)
            last_save = time.time()
    bar.close()
    save(step)
    if log:
        log.close()
    return step


def new_ids(before: CharTokenizer, after: CharTokenizer) -> list[int]:
    """The ids of ``after`` whose token ``before`` lacks (``before``'s ids must be ``after``'s for the rest)."""
    shared = {t: i for t, i in after.vocab.items() if t in before.vocab}
    if any(before.vocab[t] != i for t, i in shared.items()):
        raise ValueError("the tokenizers map a shared token to different ids")
    return sorted(i for t, i in after.vocab.items() if t not in before.vocab)


def _save(model: DLMTransformer, tok: CharTokenizer, out_dir: Path, step: int, seed: int) -> None:
    """Save a CPU copy (the model keeps training on its device)."""
    copy = DLMTransformer(model.config)
    copy.load_state_dict({k: v.detach().to("cpu") for k, v in model.state_dict().items()})
    save_pretrained(copy, out_dir, metadata={"steps": step, "seed": seed})
    tok.save(out_dir)


def average_checkpoints(dirs: list[str | Path], out_dir: str | Path) -> Path:
    """The element-wise mean of several checkpoints of one architecture (a weight average of runs
    continued from the same weights: it smooths the noise each run's last steps leave): Remask's masked
    checkpoints (tiny-bd, tiny-mdm) or DiffusionGemma ones (tiny-dg), written as their trainer writes one, with
    the first checkpoint's tokenizer (and, for DiffusionGemma, its generation defaults)."""
    from engine.models import diffusion_gemma as dg
    from engine.models.checkpoint import load_remask

    if len(dirs) < 2:
        raise ValueError("average at least two checkpoints")
    names = [str(Path(d).name) for d in dirs]
    if len({_is_dg(d) for d in dirs}) > 1:
        raise ValueError("checkpoints to average must share one configuration (DiffusionGemma and not)")
    canvas = _is_dg(dirs[0])
    models = [(dg.load if canvas else load_remask)(d) for d in dirs]
    if any(m.config != models[0].config for m in models[1:]):
        raise ValueError("checkpoints to average must share one configuration")
    avg = (dg.DiffusionGemma if canvas else DLMTransformer)(models[0].config)
    states = [m.state_dict() for m in models]
    avg.load_state_dict({k: sum(st[k].float() for st in states) / len(states) for k in states[0]})
    if canvas:
        dg.save_pretrained(avg, out_dir, tokenizer_dir=dirs[0])
        (Path(out_dir) / "training.json").write_text(json.dumps({"averaged": names}) + "\n")
        return Path(out_dir)
    save_pretrained(avg, out_dir, metadata={"averaged": ",".join(names)})
    for f in Path(dirs[0]).glob("tokenizer*.json"):  # the checkpoints' own tokenizer
        shutil.copy(f, Path(out_dir) / f.name)
    return Path(out_dir)


def _is_dg(directory: str | Path) -> bool:
    from engine.models import diffusion_gemma as dg

    config = Path(directory) / "config.json"
    return config.is_file() and dg.ARCH in json.loads(config.read_text()).get("architectures", ())


# The recipe of the shipped weights: a uniform phase, then a phase that weights
# long-context lookup (the slowest category to learn) more heavily. Step counts
# are those the shipped weights took on 2 CPU cores (README, "Training").
PHASE2_MIX = {"lookup": 0.4, "prose": 0.2, "arith": 0.2, "choice": 0.1, "reverse": 0.1}
RECIPE_STEPS = {"tiny-bd": (8665, 9689), "tiny-mdm": (4591, 5347)}


def train_default(name: str, out_dir: str | Path, steps: tuple[int, int] | None = None, minutes: float | None = None,
                  device: str = "cpu", threads: int | None = None, seed: int = 0, progress: bool = True,
                  batch_size: int = 32) -> Path:
    """Both phases of the default recipe; ``minutes`` (optional) caps each phase's wall time."""
    p1, p2 = steps or RECIPE_STEPS[name]
    out_dir = Path(out_dir)
    phase1 = out_dir.parent / f".{out_dir.name}-phase1"
    train(name, phase1, steps=p1, minutes=minutes, batch_size=batch_size, lr=2e-3, seed=seed, device=device,
          threads=threads, progress=progress)
    return train(name, out_dir, steps=p2, minutes=minutes, batch_size=batch_size, lr=1e-3, seed=seed + 1,
                 device=device, threads=threads, progress=progress, init=phase1, mix=PHASE2_MIX)


# ---------------------------------------------------------------- tiny-dg: a DiffusionGemma of the task suite
#
# ``tiny-dg`` is a small model of the DiffusionGemma architecture (engine/models/diffusion_gemma.py): sliding and
# full attention layers alternating (different head sizes and K/V heads, proportional partial RoPE on the full
# layers), a dense MLP beside routed experts, self-conditioning, soft-capped tied logits. Its canvas is 32 tokens
# (one canvas holds every answer of the suite but prose, which takes up to six). It is trained as the family is:
# uniform-state diffusion. Each example is a prompt, the answer's earlier canvases clean (the encoder's causal
# pass over both, exactly the K/V cache generation builds) and one canvas of the answer (EOS after its end)
# corrupted by replacing each token, with probability t ~ U(0, 1), by a uniform random token; the decoder's loss
# is the cross-entropy of the clean canvas at every position (a uniform-state model cannot tell which tokens are
# noise, so it predicts them all). On half of the batches the decoder first runs without gradients and its
# logits, divided by a temperature drawn from the sampler's range [t_min, t_max] as the generation loop's
# processed logits are, are fed back as self-conditioning to a second pass that takes the loss (analog-bits
# self-conditioning, as transformers' ``self_conditioning_mask`` docstring describes for training).

DG_CANVAS = 32
DG_PAD_WEIGHT = 0.3  # loss weight of the canvas's EOS padding after the answer's EOS
DG_MAX_NEW_TOKENS = 6 * DG_CANVAS  # the longest answer of the suite (161 characters and EOS) fits in six canvases
DG_BATCH = 16
DG_MIX = {"lookup": 0.3, "prose": 0.2, "arith": 0.2, "choice": 0.15, "reverse": 0.15}


def dg_config(tok: CharTokenizer):
    """tiny-dg's architecture: four layers (sliding, full, sliding, full), window 64 (shorter than the suite's
    longest prompts), 4 query heads; sliding layers 2 K/V heads of 32, full layers 1 K/V head of 64 (K = V);
    a dense MLP of 256 beside 4 experts of 128 (top 2)."""
    from engine.models import diffusion_gemma as dg

    types = (dg.SLIDING, dg.FULL, dg.SLIDING, dg.FULL)
    return dg.DiffusionGemmaConfig(
        vocab_size=tok.vocab_size, hidden_size=128, intermediate_size=256, num_heads=4, layer_types=types,
        head_dims=tuple(32 if t == dg.SLIDING else 64 for t in types),
        kv_heads=tuple(2 if t == dg.SLIDING else 1 for t in types), sliding_window=64, num_experts=4,
        top_k_experts=2, moe_intermediate_size=128,
        ropes={dg.SLIDING: dg.Rope(10_000.0), dg.FULL: dg.Rope(1_000_000.0, "proportional", 0.25)},
        canvas_length=DG_CANVAS, pad_token_id=tok.pad_token_id, eos_token_ids=(tok.eos_token_id,),
        bos_token_id=tok.bos_token_id, max_position_embeddings=512,
        image_token_id=tok.vocab_size,  # no image token in the vocabulary: an id no prompt holds (transformers
        # reads one)
        generation={**dg.GENERATION_DEFAULTS, "max_new_tokens": DG_MAX_NEW_TOKENS})


def dg_prompt_ids(tok: CharTokenizer, prompt: str) -> list[int]:
    """tiny-dg's prompt: <bos> prompt <sep>, unpadded (the chat template of its tokenizer; block size 1)."""
    return tok.prompt_ids(prompt, 1)


def dg_init(model) -> None:
    """Initial weights: normal(0, 0.02) for projections, experts, router and embeddings (the embedding is the
    tied LM head); norms and scales one."""
    for name, p in model.named_parameters():
        if name.endswith(("norm.weight", "layernorm.weight", "_layernorm_1.weight", "_layernorm_2.weight",
                          ".scale", "per_expert_scale")) or "norm" in name.split(".")[-2]:
            torch.nn.init.ones_(p)
        else:
            torch.nn.init.normal_(p, std=0.02)


@dataclass
class DGBatch:
    contexts: list[list[int]]  # prompt + the answer's earlier canvases (the encoder's input), per row
    canvas: torch.Tensor  # [N, L] the corrupted canvas
    targets: torch.Tensor  # [N, L] the clean canvas
    weights: torch.Tensor  # [N, L]
    categories: list[str]


def dg_example(ex: tasks.Example, tok: CharTokenizer, rng: random.Random, canvas: int = DG_CANVAS):
    """(context, clean canvas, weights) of one example: one canvas of the answer (chosen uniformly), the
    earlier ones clean in the context."""
    ans = tok.encode(ex.answer) + [tok.eos_token_id]
    n = -(-len(ans) // canvas)
    full = _pad_eos(ans, n * canvas, tok.eos_token_id)
    k = rng.randrange(n)
    weights = [1.0] * len(ans) + [DG_PAD_WEIGHT] * (n * canvas - len(ans))
    return (dg_prompt_ids(tok, ex.prompt) + full[:k * canvas], full[k * canvas:(k + 1) * canvas],
            weights[k * canvas:(k + 1) * canvas])


def dg_batch(examples: list[tasks.Example], tok: CharTokenizer, rng: random.Random, gen: torch.Generator,
             copies: int = 1) -> DGBatch:
    """A batch: each example's context once, its canvas ``copies`` times (rows i * copies ... i * copies + copies
    - 1), each copy noised at its own level t ~ U(0, 1)."""
    rows = [dg_example(ex, tok, rng) for ex in examples]
    clean = torch.tensor([r[1] for r in rows]).repeat_interleave(copies, 0)
    t = torch.rand(len(clean), 1, generator=gen)
    noisy = torch.rand(clean.shape, generator=gen) < t
    random_tokens = torch.randint(0, tok.vocab_size, clean.shape, generator=gen)
    weights = torch.tensor([r[2] for r in rows]).repeat_interleave(copies, 0)
    return DGBatch([r[0] for r in rows], torch.where(noisy, random_tokens, clean), clean, weights,
                   [ex.category for ex in examples for _ in range(copies)])


def _repeat_caches(padded, copies: int):
    """``padded`` (a ``PaddedCaches``) with each row repeated ``copies`` times: several canvases decoded over one
    encoder pass (its gradient flows back through every copy)."""
    if copies == 1:
        return padded
    out = copy.copy(padded)
    out.lengths = [n for n in padded.lengths for _ in range(copies)]
    out.key = None
    out.pasts = [None if kv is None else tuple(x.repeat_interleave(copies, 0) for x in kv) for kv in padded.pasts]
    out.masks = [None if m is None else m.repeat_interleave(copies, 0) for m in padded.masks]
    return out


def dg_loss(model, batch: DGBatch, self_condition: bool, gen: torch.Generator, t_range=(0.4, 0.8)
            ) -> tuple[torch.Tensor, dict[str, float]]:
    """The encoder's causal pass over each row's context into its cache, then the decoder over the corrupted
    canvas (with self-conditioning from a first, gradient-free decoder pass when ``self_condition``); the
    weighted cross-entropy against the clean canvas, and per category the fraction of the answer's positions (its
    tokens and EOS; the EOS padding after it left out) whose argmax is right."""
    from engine.models import diffusion_gemma as dg

    caches = [dg.DGCache(model.config) for _ in batch.contexts]
    model.encode_many(batch.contexts, caches)
    padded = dg.PaddedCaches(caches, batch.canvas.shape[1], batch.canvas.device)
    padded = _repeat_caches(padded, len(batch.canvas) // len(caches))
    sc = None
    if self_condition:
        with torch.no_grad():
            first = model.decode(batch.canvas, padded)
            temp = t_range[0] + (t_range[1] - t_range[0]) * torch.rand(len(first), 1, 1, generator=gen)
            temp = temp.to(first.device)
            sc = model.soft_embeddings(first / temp)
    logits = model.decode(batch.canvas, padded, sc)
    ce = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), reduction="none").view_as(batch.weights)
    loss = (ce * batch.weights).sum() / batch.weights.sum()
    with torch.no_grad():  # over the answer's positions (weight 1: its tokens and first EOS), not the padding
        answer = (batch.weights >= 1).float()
        hit = ((logits.argmax(-1) == batch.targets).float() * answer).sum(-1) / answer.sum(-1).clamp(min=1)
        stats: dict[str, list[float]] = {}
        for i, c in enumerate(batch.categories):
            stats.setdefault(c, []).append(float(hit[i]))
    return loss, {c: sum(v) / len(v) for c, v in stats.items()}


def train_dg(out_dir: str | Path, steps: int = 6000, minutes: float | None = None, batch_size: int = 32,
             lr: float = 2e-3, seed: int = 0, threads: int | None = None, save_every_s: float = 300.0,
             log_path: str | Path | None = None, progress: bool = True, init: str | Path | None = None,
             log_every: int = 50, mix: dict[str, float] | None = None, sc_fraction: float = 0.5,
             device: str = "cpu", copies: int = 1, keep_steps: tuple[int, ...] = ()) -> Path:
    """Train tiny-dg (the section's comment); progress is max(step / steps, elapsed / minutes), the learning rate
    a warmup and cosine over it. ``init`` continues from a tiny-dg checkpoint (one of a smaller vocabulary gets
    the new ids' embedding rows, initialised as at the start); ``copies`` noised canvases per example share one
    encoder pass (a batch then holds ``batch_size * copies`` canvases). After each step in ``keep_steps`` the
    weights are also saved beside ``out_dir`` (``kept_checkpoint``), for a weight average of the run."""

    from engine.models import diffusion_gemma as dg

    mix = DG_MIX if mix is None else mix
    known = (*tasks.ALL_CATEGORIES, QUERIES)
    if bad := set(mix) - set(known):
        raise ValueError(f"unknown categories in mix: {sorted(bad)}; known: {', '.join(known)}")
    if copies < 1:
        raise ValueError(f"copies must be at least 1, got {copies}")
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    tok = CharTokenizer.default()
    if init:
        model = _widen_vocab(dg.load(init), tok.vocab_size).to(device).train()
        for p in model.parameters():
            p.requires_grad_(True)
    else:
        model = dg.DiffusionGemma(dg_config(tok))
        dg_init(model)
        model = model.to(device).train()
    params = [p for p in model.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.98), weight_decay=0.01)

    def one_step():
        batch = dg_batch([sample_mix(rng, mix) for _ in range(batch_size)], tok, rng, gen, copies)
        batch = DGBatch(batch.contexts, batch.canvas.to(device), batch.targets.to(device), batch.weights.to(device),
                        batch.categories)
        return dg_loss(model, batch, rng.random() < sc_fraction, gen)

    out_dir = Path(out_dir)
    taken = [0]

    def keep() -> None:
        taken[0] += 1
        if taken[0] in keep_steps:
            _save_dg(model, tok, kept_checkpoint(out_dir, taken[0]), taken[0], seed)

    run_steps(opt, params, one_step, lambda step: _save_dg(model, tok, out_dir, step, seed), steps=steps,
              minutes=minutes, lr=lr, desc="train tiny-dg", progress=progress, log_path=log_path,
              log_every=log_every, save_every_s=save_every_s, ema_decay=0.95, postfix_every=10, bar_interval_s=5.0,
              after_step=keep if keep_steps else None)
    return out_dir


def kept_checkpoint(out_dir: str | Path, step: int) -> Path:
    """Where ``train_dg(keep_steps=...)`` saves the weights after ``step``: beside ``out_dir``."""
    out_dir = Path(out_dir)
    return out_dir.parent / f".{out_dir.name}-step{step}"


def _widen_vocab(model, vocab_size: int):
    """``model`` with ``vocab_size`` ids: the rows it has kept, new rows normal(0, 0.02) (``dg_init``'s)."""
    import dataclasses

    from engine.models import diffusion_gemma as dg

    old = model.config.vocab_size
    if vocab_size == old:
        return model
    if vocab_size < old:
        raise ValueError(f"the checkpoint has {old} ids, more than the tokenizer's {vocab_size}")
    wide = dg.DiffusionGemma(dataclasses.replace(model.config, vocab_size=vocab_size, image_token_id=vocab_size))
    state = model.state_dict()
    for name, p in wide.state_dict().items():
        if p.shape != state[name].shape:
            grown = torch.empty(p.shape, dtype=p.dtype).normal_(std=0.02)
            grown[:old] = state[name]
            state[name] = grown
    wide.load_state_dict(state)
    return wide


def _save_dg(model, tok: CharTokenizer, out_dir: Path, step: int, seed: int) -> None:
    """A ``DiffusionGemmaForBlockDiffusion`` checkpoint (the family's loader reads it; transformers loads it),
    with the character tokenizer; ``training.json`` records the steps."""
    from engine.models import diffusion_gemma as dg

    copy = dg.DiffusionGemma(model.config)
    copy.load_state_dict({k: v.detach().to("cpu") for k, v in model.state_dict().items()})
    dg.save_pretrained(copy, out_dir)
    tok.save(out_dir)
    (Path(out_dir) / "training.json").write_text(json.dumps({"steps": step, "seed": seed}) + "\n")


# The recipe of the shipped tiny-dg, phase by phase, each continuing from the one before with its own warmup and
# cosine: two phases of single canvases over the uniform-ish mix (DG_MIX), then three of 4 noised copies of each
# canvas over one encoder pass (``copies``) over mixes with the json category, the last two weighting arithmetic
# and prose. Step counts are those the shipped weights took (each run was capped by wall time on a shared 2-core
# CPU; the fourth was stopped at 110 minutes of a 130-minute cosine, lr 8.9e-5; docs/engine.md "Training";
# engine/defaults/tiny-dg/training.json). The first two ran before the tokenizer had JSON's characters (57 ids):
# the third widened the vocabulary to 64 (``_widen_vocab``); the recipe replayed today has 64 ids from the start.
DG_PHASE3_MIX = {"arith": 0.2, "reverse": 0.2, "prose": 0.2, "choice": 0.1, "lookup": 0.15, "json": 0.15}
DG_PHASE4_MIX = {"arith": 0.35, "prose": 0.3, "lookup": 0.12, "reverse": 0.05, "choice": 0.06, "json": 0.12}
DG_PHASE5_MIX = {"arith": 0.5, "prose": 0.1, "lookup": 0.1, "reverse": 0.1, "choice": 0.1, "json": 0.1}
# the sixth: lookups asked several keys at once (the training-only ``queries``) beside the suite's lookup
DG_PHASE6_MIX = {"queries": 0.35, "lookup": 0.2, "arith": 0.15, "prose": 0.1, "json": 0.08, "choice": 0.06,
                 "reverse": 0.06}
DG_RECIPE = (
    {"steps": 4222, "lr": 2e-3, "seed": 0},
    {"steps": 1771, "lr": 1e-3, "seed": 1},
    {"steps": 7268, "lr": 1.5e-3, "seed": 5, "copies": 4, "mix": DG_PHASE3_MIX},
    {"steps": 9531, "lr": 1e-3, "seed": 7, "copies": 4, "mix": DG_PHASE4_MIX},
    {"steps": 3363, "lr": 3e-4, "seed": 9, "copies": 4, "mix": DG_PHASE5_MIX},
    # the shipped weights: the mean of this phase's weights after step 5,842 (79% of its cosine) and its end
    {"steps": 7399, "lr": 1e-3, "seed": 11, "copies": 4, "mix": DG_PHASE6_MIX, "average_at": (5842,)},
)
DG_RECIPE_PHASES = tuple(ph["steps"] for ph in DG_RECIPE)


def train_default_dg(out_dir: str | Path, steps: tuple[int, ...] | None = None, minutes: float | None = None,
                     threads: int | None = None, seed: int = 0, progress: bool = True, batch_size: int = DG_BATCH,
                     log_path: str | Path | None = None, device: str = "cpu") -> Path:
    """Every phase of tiny-dg's recipe (``DG_RECIPE``; ``steps`` replaces its step counts); ``minutes`` (optional)
    caps each phase's wall time. Phases but the last write beside ``out_dir`` (``.NAME-phaseK``)."""
    counts = steps or DG_RECIPE_PHASES
    if len(counts) != len(DG_RECIPE):
        raise ValueError(f"the recipe has {len(DG_RECIPE)} phases, got {len(counts)} step counts")
    out_dir = Path(out_dir)
    init = None
    for k, (phase, n) in enumerate(zip(DG_RECIPE, counts), 1):
        target = out_dir if k == len(DG_RECIPE) else out_dir.parent / f".{out_dir.name}-phase{k}"
        # a phase's kept steps scale with its step count (``steps`` may replace them)
        keep = tuple(max(1, round(k * n / phase["steps"])) for k in phase.get("average_at", ()))
        init = train_dg(target, steps=n, minutes=minutes, batch_size=batch_size, lr=phase["lr"],
                        seed=seed + phase["seed"], threads=threads, progress=progress, init=init, log_path=log_path,
                        device=device, copies=phase.get("copies", 1), mix=phase.get("mix"), keep_steps=keep)
        if keep:  # the phase's result: the weight average of its kept checkpoints and its end
            average_checkpoints([*(kept_checkpoint(target, k) for k in keep), target], target)
    return init
