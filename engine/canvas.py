"""Canvas requests: DiffusionGemma's uniform-state block diffusion as the engine's two step kinds.

A request's life, one step at a time (``CanvasEngine.step``):

- **prefill** (an encoder pass): the prompt, then each finished canvas, encoded causally into the request's
  K/V cache (``engine.models.diffusion_gemma.DGCache``: sliding-window layers keep only their window);
- **denoise** (one canvas denoising step): the decoder over the current canvas and the cache, then the
  ``renoise`` decoding rule (engine/decoding/renoise.py) keeps the low-entropy sampled tokens and renoises the
  rest; the step's processed logits are the next step's self-conditioning. When the rule says the canvas is
  done, its argmax is appended to the output (cut at an EOS or stop id, a stop string or ``max_tokens``) and,
  unless the request finished, encoded by the next prefill step.

Every draw comes from a generator seeded by (request seed, canvas index, step) (``renoise.canvas_generator``):
a request with a seed gets the same draws whatever else runs beside it (the same text alone or batched as long as
the batch rounds its logits alike: float32 on the CPU does on the test fixture, bf16 may not), and the same text
after a resume. ``snapshot`` is
small JSON (prompt, seed, knobs, the finished canvases' output); ``restore`` encodes the prompt and each finished
canvas again in the same chunks as the first time (the same cache, up to a batch's rounding as above) and replays
the current canvas from its first step (the same draws give the same canvas: the same text as without the pause,
at the cost of the steps replayed; tests/test_diffusion_gemma.py checks it in float32). A request without a seed
gets one at admission.

This is its own sequence type (``CanvasSequence``) beside the masked-diffusion ``Sequence``; served, it runs under
``engine.canvas_serving.CanvasServeEngine``, which gives the instance stack (scheduler, round loop, replica) the
``Engine`` interface over this engine. ``CanvasEngine`` also runs on its own (the offline ``remask generate``
path): each step,
the requests with tokens to encode run their encoder passes (one per request) and all the others' canvases go
through one decoder forward together (``DiffusionGemma.decode``); the encoder passes of several requests likewise
go through one forward (``DiffusionGemma.encode_many``). With a ``DGPool`` (``pool``; the serving engine makes
one) a request's cache takes its slots at its first encoder pass (its prompt and ``max_tokens``) and gives them
back when it finishes or is aborted; the decoder then reads the pool by index (``PoolStep``), from a CUDA graph
when ``graphs`` has one (engine/dg_graphs.py). A cache the pool cannot hold keeps tensors of its own (counted in
``pool.beyond``), and a batch holding one is padded side by side as without a pool (``PaddedCaches``).
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from engine.decoding import renoise
from engine.decoding.renoise import CanvasDecision, CanvasStep, RenoiseRule
from engine.models import diffusion_gemma as dg
from engine.tokenizer import OutputText

PREFILL, DENOISE = "prefill", "denoise"


@dataclass(frozen=True)
class CanvasParams:
    """A canvas request's knobs: ``entropy_bound`` None uses the rule's configured bound; ``constraint``: what
    the text must be (``engine.constraints.ConstraintSpec.to_dict()``, as ``SamplingParams.constraint``), None
    for any text."""

    max_tokens: int | None = None
    seed: int | None = None
    entropy_bound: float | None = None
    stop: tuple[str, ...] = ()
    constraint: dict | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")


@dataclass
class StepReport:
    kind: str  # PREFILL or DENOISE
    tokens: int  # tokens encoded (prefill) or canvas positions denoised
    canvas_done: bool = False
    kept: int = 0  # positions the rule kept (denoise)


@dataclass
class CanvasOutput:
    seq_id: int
    token_ids: list[int]
    text: str
    finish_reason: str
    steps_per_canvas: list[int]
    prefill_steps: int


@dataclass
class CanvasSequence:
    seq_id: int
    prompt_ids: list[int]
    params: CanvasParams
    seed: int
    max_tokens: int
    cache: dg.DGCache
    pending: list[list[int]]  # chunks the next prefill step encodes, one encoder pass each (prompt, canvases)
    output_ids: list[int] = field(default_factory=list)
    canvas_index: int = 0
    canvas: torch.Tensor | None = None  # [L] current canvas (None: not begun)
    self_conditioning: torch.Tensor | None = None  # [L, H] soft embeddings of the last step's processed logits
    step_in_canvas: int = 0
    state: dict = field(default_factory=dict)  # the rule's state for this canvas (JSON)
    steps_per_canvas: list[int] = field(default_factory=list)
    prefill_steps: int = 0
    finished: bool = False
    finish_reason: str | None = None
    text: OutputText | None = None  # the answer's text as canvases finish (stop strings applied)
    unread: str = ""  # text not yet read (``CanvasEngine.read``)
    rule: RenoiseRule | None = None  # its own rule (a request's decoding_config); None: the engine's
    stop_ids: frozenset[int] | None = None  # ids that end its output; None: the engine's
    # structured outputs: the grammar's CanvasGuard (engine/constraints/canvas.py), its state the committed
    # text; ``fallbacks``: canvases the grammar still rejected at the step cap (finished under its mask)
    guard: object | None = None
    fallbacks: int = 0

    @property
    def next_kind(self) -> str:
        return PREFILL if self.pending else DENOISE

    def snapshot(self) -> dict:
        """What a resume needs (JSON): prompt, seed, knobs and the finished canvases' output (the current
        canvas is replayed from its first step: see ``CanvasEngine.restore``)."""
        return {"prompt_ids": self.prompt_ids, "seed": self.seed, "max_tokens": self.max_tokens,
                "entropy_bound": self.params.entropy_bound, "stop": list(self.params.stop),
                "output_ids": self.output_ids, "steps_per_canvas": self.steps_per_canvas,
                "constraint": self.params.constraint}


class CanvasEngine:
    """DiffusionGemma requests through prefill and denoise steps (module docstring)."""

    def __init__(self, model: dg.DiffusionGemma, tokenizer=None, device: str | torch.device = "cpu",
                 rule: RenoiseRule | None = None, grammar_tokenizer=None, pool: dg.DGPool | None = None,
                 graphs=None) -> None:
        """``pool``: the K/V pool the requests' caches take slots of (``DGPool``; None: each cache its own
        tensors); ``graphs``: the decoder step's CUDA graphs over it (engine/dg_graphs.py ``DecodeGraphs``)."""
        self.model = model.to(device).eval()
        self.pool, self.graphs = pool, graphs
        self.cfg = model.config
        self.tokenizer = tokenizer
        # the vocabulary a constraint compiles for (None: ``tokenizer``'s; the serving engine, which decodes text
        # itself, passes its tokenizer here only)
        self.grammar_tokenizer = grammar_tokenizer if grammar_tokenizer is not None else tokenizer
        self.device = torch.device(device)
        self.rule = rule or RenoiseRule.from_generation(self.cfg.generation)
        stop = getattr(tokenizer, "stop_ids", None) or ()
        self.stop_ids = frozenset([*self.cfg.eos_token_ids, *stop])
        self.sequences: dict[int, CanvasSequence] = {}
        self._ids = itertools.count()
        self._padded: dg.PaddedCaches | dg.PoolStep | None = None  # the last denoising batch's caches, side by side

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32,
                        tokenizer=True, **kwargs) -> CanvasEngine:
        from engine.tokenizer import load_tokenizer

        tok = load_tokenizer(path) if tokenizer is True else tokenizer or None
        return cls(dg.load(path, dtype=dtype, device=device), tok, device=device, **kwargs)

    # -- requests

    def add_request(self, prompt_ids: list[int], params: CanvasParams | None = None) -> CanvasSequence:
        params = params or CanvasParams()
        if not prompt_ids:
            raise ValueError("prompt must hold at least one token")
        if bad := [t for t in prompt_ids if not 0 <= int(t) < self.cfg.vocab_size]:
            raise ValueError(f"prompt token ids out of the vocabulary [0, {self.cfg.vocab_size}): {bad[:5]}")
        dg.check_text_only(prompt_ids, self.cfg)
        if params.entropy_bound is not None:
            self.rule.check_knob(params.entropy_bound)
        room = self.cfg.max_position_embeddings - len(prompt_ids)
        if room < 1:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room in the model's context "
                             f"({self.cfg.max_position_embeddings})")
        max_tokens = min(params.max_tokens or int(self.cfg.generation.get("max_new_tokens", 256)), room)
        seed = params.seed if params.seed is not None else random.SystemRandom().randrange(1 << 62)
        seq = CanvasSequence(next(self._ids), [int(t) for t in prompt_ids], params, seed, max_tokens,
                             dg.DGCache(self.cfg), pending=[[int(t) for t in prompt_ids]])
        if params.constraint is not None:
            seq.guard = self.guard(params.constraint)
        if self.tokenizer is not None:
            seq.text = OutputText(self.tokenizer.decode, params.stop)
        self.sequences[seq.seq_id] = seq
        return seq

    def guard(self, constraint: dict, committed=()):
        """A request's grammar guard (engine/constraints/canvas.py) for its ``constraint``, its state the
        ``committed`` output tokens (a resume); compiled once per distinct constraint (``compile_for``). A
        ``ValueError`` (``GrammarError``, naming the field) for a constraint that does not compile."""
        from engine.constraints.canvas import CanvasGuard, compile_for

        if self.grammar_tokenizer is None:
            raise ValueError("constraint: a constrained request needs the model's tokenizer (none was given)")
        stops = (self.cfg.eos_token_ids[0], *sorted(self.stop_ids))  # as the replica compiles it: one entry
        grammar = compile_for(constraint, self.grammar_tokenizer, self.cfg.vocab_size, stops)
        return CanvasGuard(grammar, -1, committed)  # no mask id: a uniform-state canvas has none

    def restore(self, snap: dict) -> CanvasSequence:
        """A request resumed from ``snapshot()`` (on this or another replica): the prompt and each finished
        canvas encoded again in their original chunks, the current canvas begun again from its first step
        (module docstring): the text is the one the request would have given without the pause."""
        params = CanvasParams(max_tokens=snap["max_tokens"], seed=snap["seed"],
                              entropy_bound=snap.get("entropy_bound"), stop=tuple(snap.get("stop", ())),
                              constraint=snap.get("constraint"))
        out, length = list(snap["output_ids"]), self.cfg.canvas_length
        if len(out) % length:
            raise ValueError(f"a snapshot's output_ids hold whole canvases of {length} tokens, got {len(out)}")
        seq = self.add_request(snap["prompt_ids"], dataclasses.replace(params, constraint=None))
        if params.constraint is not None:  # the grammar's state rebuilt from the committed text
            seq.params, seq.guard = params, self.guard(params.constraint, out)
        seq.output_ids = out
        if seq.text is not None:
            seq.text.push(out)  # streamed before the pause
        seq.pending += [out[i:i + length] for i in range(0, len(out), length)]
        seq.canvas_index = len(out) // length
        seq.steps_per_canvas = list(snap.get("steps_per_canvas", []))
        return seq

    # -- steps

    @torch.no_grad()
    def step(self, seqs: list[CanvasSequence]) -> list[StepReport]:
        """One step of each unfinished request in ``seqs``: its prefill (an encoder pass) if it has tokens to
        encode, else one denoising step of its canvas; the encoder passes in one forward, the denoising steps
        in another (caches padded to the longest)."""
        live = [s for s in seqs if not s.finished]
        reports = self._prefill([s for s in live if s.pending])
        denoising = [s for s in live if s.seq_id not in reports]
        if denoising:
            reports.update(zip([s.seq_id for s in denoising], self._denoise(denoising)))
        return [reports[s.seq_id] for s in live]

    def _prefill(self, seqs: list[CanvasSequence]) -> dict[int, StepReport]:
        """The encoder passes of ``seqs``, one forward per round of their chunks (a resumed request has more
        than one: its prompt and its finished canvases, encoded as they first were)."""
        counts = dict.fromkeys((s.seq_id for s in seqs), 0)
        for s in seqs:  # a request's first encoder pass: its cache takes its pool slots for its whole life
            if self.pool is not None and not s.cache.pooled and not s.cache.length:
                s.cache.place(self.pool, self.cache_positions(s), self.model.embed_tokens.weight.dtype)
        while batch := [s for s in seqs if s.pending]:
            chunks = [s.pending.pop(0) for s in batch]
            self.model.encode_many(chunks, [s.cache for s in batch])
            for s, chunk in zip(batch, chunks):
                counts[s.seq_id] += len(chunk)
        for s in seqs:
            s.prefill_steps += 1
        return {s.seq_id: StepReport(PREFILL, counts[s.seq_id]) for s in seqs}

    def cache_positions(self, seq: CanvasSequence) -> int:
        """The most positions ``seq``'s cache may hold: its prompt and ``max_tokens`` (the last canvas is never
        encoded); what the instance scheduler reserves for it (``ServedCanvas.kv_capacity``)."""
        return len(seq.prompt_ids) + seq.max_tokens

    def _decode(self, canvas: torch.Tensor, seqs: list[CanvasSequence]) -> torch.Tensor:
        """The decoder forward of ``seqs``' canvases: over the pool in place when every cache is in it (from a
        CUDA graph when there is one for the shape), else their caches padded side by side."""
        length = self.cfg.canvas_length
        caches = [s.cache for s in seqs]
        pooled = self.pool is not None and dg.PoolStep.over(caches, length) is self.pool
        if len(seqs) == 1 and not pooled:
            return self.model.decode(canvas, caches[0], None if seqs[0].self_conditioning is None
                                     else seqs[0].self_conditioning[None])
        has = torch.tensor([s.self_conditioning is not None for s in seqs], device=self.device)
        sc = None
        if bool(has.any()):
            zeros = torch.zeros_like(next(s.self_conditioning for s in seqs if s.self_conditioning is not None))
            sc = torch.stack([zeros if s.self_conditioning is None else s.self_conditioning for s in seqs])
        if pooled and self.graphs is not None:
            logits = self.graphs.decode(canvas, caches, sc, has)
            if logits is not None:
                return logits
        kind = dg.PoolStep if pooled else dg.PaddedCaches
        if not isinstance(self._padded, kind) or not self._padded.fits(caches):  # once per batch and cache state
            self._padded = dg.PoolStep(self.pool, caches, length, self.device) if pooled \
                else dg.PaddedCaches(caches, length, self.device)
        return self.model.decode(canvas, self._padded, sc, has)

    def _denoise(self, seqs: list[CanvasSequence]) -> list[StepReport]:
        length, vocab = self.cfg.canvas_length, self.cfg.vocab_size
        for seq in seqs:
            if seq.canvas is None:  # a new canvas: uniform noise
                gen = renoise.canvas_generator(seq.seed, seq.canvas_index, -1, self.device)
                seq.canvas = renoise.noise(length, vocab, gen, self.device)
        raw = self._decode(torch.stack([s.canvas for s in seqs]), seqs)
        reports, processed = [], []
        for seq, logits in zip(seqs, raw):
            decision, step_logits = self.denoise_logits(seq, logits)
            processed.append(step_logits)
            seq.canvas = torch.as_tensor(decision.canvas, device=self.device)
            seq.step_in_canvas += 1
            if decision.done:
                self._finish_canvas(seq, decision.output.tolist())
            reports.append(StepReport(DENOISE, length, decision.done, int((~decision.edit).sum())))
        # the next step's self-conditioning, kept as soft embeddings [L, H] rather than logits [L, V]: the
        # processed logits in the embeddings' dtype (as transformers passes them), through the embeddings
        going = [i for i, s in enumerate(seqs) if s.canvas is not None and not s.finished]
        if going:
            dtype = self.model.embed_tokens.weight.dtype
            soft = self.model.soft_embeddings(torch.stack([processed[i] for i in going]).to(dtype))
            for row, i in enumerate(going):
                seqs[i].self_conditioning = soft[row]
        return reports

    def denoise_logits(self, seq: CanvasSequence, raw: torch.Tensor) -> tuple[CanvasDecision, torch.Tensor]:
        """The rule's part of a denoising step on the raw logits [L, V]: temperature, sampling and noise drawn
        from (seed, canvas index, step) in that order (as transformers draws them), then the rule's decision."""
        rule = seq.rule or self.rule
        gen = renoise.canvas_generator(seq.seed, seq.canvas_index, seq.step_in_canvas, raw.device)
        out = renoise.propose(raw, rule.temperature(seq.step_in_canvas), gen)
        fresh = renoise.noise(raw.shape[0], raw.shape[1], gen, raw.device)
        n = raw.shape[0]
        step = CanvasStep(np.zeros(n, dtype=bool), np.ones(n, dtype=bool), out["tokens"].cpu().numpy(),
                          np.zeros(n, dtype=np.float32), entropy=out["entropy"].float().cpu().numpy(),
                          step_in_block=seq.step_in_canvas, masked_at_start=0, knob=seq.params.entropy_bound,
                          state=seq.state, canvas=seq.canvas.cpu().numpy(), argmax=out["argmax"].cpu().numpy(),
                          noise=fresh.cpu().numpy())
        decision = rule.decide(step)
        if seq.guard is not None and decision.done:  # structured outputs: the grammar checks the stopping canvas
            decision = self._check_canvas(seq, rule, decision, step.noise, out["processed"])
        return decision, out["processed"]

    def _check_canvas(self, seq: CanvasSequence, rule: RenoiseRule, decision: CanvasDecision, noise: np.ndarray,
                      processed: torch.Tensor) -> CanvasDecision:
        """A stopping canvas through the request's grammar (engine/constraints/canvas.py): its argmax, as far as
        the request may still output, walked from the committed text (with jump-forward, ``guarding.JUMP``: a
        refused token where the grammar allows one only becomes that one). Accepted, it stops. Rejected, the first
        rejected token and every token after it take this step's noise (forced tokens before it are written on
        the canvas) (the request's (seed, canvas, step)
        draws: the same seed, the same text) and the canvas denoises on; at the step cap instead, the canvas is
        finished under the grammar's mask from that token on (``finish_canvas``: the model's best allowed token
        there, position by position, from this step's processed logits), which always gives valid text."""
        from engine.constraints import canvas as guarding

        room = max(0, seq.max_tokens - len(seq.output_ids))
        output = np.array(decision.output, dtype=np.int64, copy=True)
        output[:room], bad = guarding.check_canvas(seq.guard, output[:room], jump=guarding.JUMP)
        if bad is None:  # accepted (forced tokens written in)
            return CanvasDecision(decision.commit, decision.edit, True, decision.canvas, output)
        if seq.step_in_canvas + 1 < rule.max_denoising_steps:
            canvas, edit = np.array(decision.canvas, copy=True), np.array(decision.edit, copy=True)
            forced = output[:bad] != np.asarray(decision.output[:bad])
            canvas[:bad][forced] = output[:bad][forced]  # the grammar's forced tokens: on the canvas, kept
            edit[:bad][forced] = False
            canvas[bad:], edit[bad:] = noise[bad:], True
            return CanvasDecision(decision.commit, edit, False, canvas, decision.output)

        def best(p: int, allowed: np.ndarray) -> int:
            row = processed[p]
            ok = torch.as_tensor(allowed[: row.shape[0]], device=row.device)
            return int(torch.where(ok, row, torch.finfo(row.dtype).min).argmax())

        seq.fallbacks += 1
        output[:room] = guarding.finish_canvas(seq.guard, output[:room], bad, best)
        return CanvasDecision(decision.commit, decision.edit, True, decision.canvas, output)

    def _finish_canvas(self, seq: CanvasSequence, tokens: list[int]) -> None:
        seq.steps_per_canvas.append(seq.step_in_canvas)
        seq.canvas, seq.self_conditioning, seq.step_in_canvas, seq.state = None, None, 0, {}
        seq.canvas_index += 1
        stops = self.stop_ids if seq.stop_ids is None else seq.stop_ids
        cut = next((i for i, t in enumerate(tokens) if t in stops), None)
        before = len(seq.output_ids)
        if seq.guard is not None and seq.guard.ended:  # the grammar took a stop id: the text ends there
            end = seq.guard.checked - 1 - before
            cut = end if 0 <= end and (cut is None or end < cut) else cut
        room = seq.max_tokens - before
        if cut is not None and cut < room:
            seq.output_ids.extend(tokens[:cut])
            seq.finished, seq.finish_reason = True, "stop"
        elif len(tokens) >= room:
            seq.output_ids.extend(tokens[:room])
            seq.finished, seq.finish_reason = True, "length"
        else:
            seq.output_ids.extend(tokens)
            seq.pending = [list(tokens)]  # the next prefill step encodes the finished canvas
        if seq.text is not None:  # the canvas's text, held back where a stop string may begin
            seq.unread += seq.text.push(seq.output_ids[before:])
            if seq.text.stopped:
                seq.finished, seq.finish_reason = True, "stop"
            if seq.finished:
                seq.unread += seq.text.finish()
        if seq.finished:
            seq.pending = []
            seq.cache.release()  # its pool slots back now (its length stays: the positions it had encoded)

    # -- outputs

    def output(self, seq: CanvasSequence) -> CanvasOutput:
        text = seq.text.text if seq.text is not None else ""
        return CanvasOutput(seq.seq_id, list(seq.output_ids), text, seq.finish_reason or "",
                            list(seq.steps_per_canvas), seq.prefill_steps)

    def abort(self, seq: CanvasSequence) -> None:
        """Stop ``seq`` now (its cache freed)."""
        seq.finished, seq.finish_reason, seq.pending = True, "abort", []
        seq.cache.release()
        seq.cache = dg.DGCache(self.cfg)
        self.sequences.pop(seq.seq_id, None)

    def read(self, seq: CanvasSequence) -> str:
        """The text ``seq`` added since the last read: streaming is canvas by canvas (a canvas's text appears
        when it stops; a stop string's possible beginning is held back until the next canvas or the end)."""
        piece, seq.unread = seq.unread, ""
        return piece

    def stream(self, prompt_ids: list[int], params: CanvasParams | None = None):
        """Run one request, yielding its text piece by piece (one piece per finished canvas, at most)."""
        seq = self.add_request(prompt_ids, params)
        try:
            while not seq.finished:
                self.step([seq])
                if piece := self.read(seq):
                    yield piece
        finally:
            seq.cache.release()  # a stream closed early gives its pool slots back now
            self.sequences.pop(seq.seq_id, None)

    def generate(self, prompts: list[list[int]], params: CanvasParams | None = None) -> list[CanvasOutput]:
        """Run ``prompts`` (token ids) to the end, their steps interleaved round by round."""
        seqs = [self.add_request(p, params) for p in prompts]
        while any(not s.finished for s in seqs):
            self.step(seqs)
        outs = [self.output(s) for s in seqs]
        for s in seqs:
            self.sequences.pop(s.seq_id, None)
        return outs


def is_diffusion_gemma(path: str | Path) -> bool:
    """Whether the checkpoint directory at ``path`` is a DiffusionGemma one (config.json's architectures)."""
    import json

    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    return (json.loads(config.read_text()).get("architectures") or [None])[0] == dg.ARCH
