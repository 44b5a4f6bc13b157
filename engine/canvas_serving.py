"""DiffusionGemma behind the instance stack: ``CanvasServeEngine`` is the ``Engine`` interface over a ``CanvasEngine``.

``Instance`` (the DWISE scheduler), the round loop, the replica server and the dispatcher drive an engine
through a few calls: ``add_request(prompt, SamplingParams, committed, resume)``, ``step(plan) -> EngineRound``,
``output``, ``abort`` and the sequences' state (``next_kind``, ``rounds``, ``finished``, ``output_ids``,
``resume_state``, ...). This module offers exactly those for canvas requests (engine/canvas.py), so SRPT,
streaming, failover and the router's knob reach DiffusionGemma without a special case elsewhere:

- **step kinds**: a request's first step is a ``prefill`` (its prompt's encoder pass; a resumed request's
  prompt and committed canvases, in their original chunks); every later step is a ``denoise`` (one denoising
  step of its canvas). The encoder pass of a canvas that just finished runs in the round of the next canvas's
  first denoising step, before its decoder forward (encoder passes batched, then denoising steps batched),
  so the scheduler's model holds: one prompt prefill, then denoising rounds, a block (canvas) done now and then.
- **estimates**: a request's admission estimate is its canvases times the rule's step cap
  (``admission_rounds``); once its first canvas stops it is refined to the steps that canvas took times the
  canvases (``refined_rounds`` at ``refine_at``: adaptive stopping makes them vary), which the scheduler's
  policy takes as the request's remaining work.
- **the knob**: the request's ``threshold`` (the router's level) reaches the renoise rule as
  ``rule.knob_at(threshold)``: the entropy bound (higher: more kept per step, faster); ``None`` leaves the
  rule's own bound.
- **the rule**: ``renoise`` only (a masked-diffusion rule is a ValueError naming ``decoding``); a request's
  ``decoding_config`` configures it over the engine's (e.g. ``{"max_denoising_steps": 8}``).
- **streaming**: output grows by whole canvases (a canvas is final when it stops; EOS or a stop id inside it
  ends the request), so every published token is final; stop strings are the ingress's, as for every model.
- **structured outputs**: ``SamplingParams.constraint`` reaches the canvas request, whose grammar guard
  checks each canvas as it would stop (engine/canvas.py ``CanvasEngine._check_canvas``); a resume rebuilds it
  from the committed canvases.
- **resume**: ``resume_state`` carries the request's seed (``Resume.state["seed"]``) with no tail: a request
  resumed from its committed canvases (whole canvases: what was published) on a fresh engine encodes them
  again and replays its current canvas from its first step, with draws derived from (seed, canvas index,
  step): the same text as the uninterrupted run. A request without a seed gets one at admission, kept in its
  ``params`` (and in its resume state), so a reset or a failover keeps it too.

Tensor parallelism: each rank's engine holds its shard (``diffusion_gemma.shard``); rank 0's ``Instance``
mirrors its commands and plans to the followers (``engine.instance.Follower``) as for the other families, the
seed rank 0 drew among them.

KV pool: the requests' encoder caches take pages and a ring of one preallocated ``DGPool``
(engine/models/diffusion_gemma.py: full layers ``kv_slot_tokens`` positions per page, sliding layers one ring of
their window per request however long, plus a canvas row per decoder row), sized as the masked ``Engine`` sizes
its pool, the rings apart (``kv_pool_budget`` says how). The runner shows it to ``Instance``, whose scheduler
reserves whole pages for a request's prompt and ``max_tokens`` (``kv_capacity``) and admits at most as many
residents as there are rings, so a resident request always finds its ring and pages; a request takes them at its
first encoder pass and gives them back when it finishes, is aborted or migrates. ``kv_slots=0``: no pool (each
cache its own tensors). CUDA graphs of the decoder step (engine/dg_graphs.py) on CUDA with a pool, single-device
only (``cuda_graphs=False``: off).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import secrets
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from engine.canvas import CanvasEngine, CanvasParams, CanvasSequence
from engine.commands import Resume, SamplingParams, resolve_rule
from engine.decoding.renoise import RenoiseRule
from engine.engine import POOL_PROMPT_TOKENS, EngineRound, Output
from engine.memory import kv_pool_source
from engine.models import diffusion_gemma as dg
from engine.models.config import ModelConfig
from engine.scheduler.scheduler import SchedulerConfig
from engine.scheduler.types import StepKind
from engine.sequence import StepReport


@dataclass
class CanvasObserver:
    """The observer slot of a canvas engine: it keeps each finished canvas's step count (``steps_per_canvas``,
    the predictors' training signal for this family) and the entropy bound of its last step (``bounds``, same
    order; None: the rule's own), the last 4096 of each. The masked-diffusion refinement hook does not apply
    (its features are a masked block's); ``refine_hook`` and ``lookahead`` are accepted and unused."""

    refine_hook: object = None
    lookahead: int = 0
    steps_per_canvas: list[int] = field(default_factory=list)
    bounds: list[float | None] = field(default_factory=list)

    def round_done(self, seqs: list[ServedCanvas], reports: list[StepReport]) -> None:
        for seq, rep in zip(seqs, reports):
            if rep.block_done:
                self.steps_per_canvas.append(seq.inner.steps_per_canvas[-1])
                self.bounds.append(rep.threshold)
        del self.steps_per_canvas[:-4096]
        del self.bounds[:-4096]


class _CanvasRunner:
    """The runner's face a canvas engine shows to ``Instance``, the round loop and the profiler
    (engine/profiling.py): the KV pool (``DGPool``: its ``slots`` x ``capacity`` positions are what the
    instance scheduler reserves against), the decoder's CUDA graphs (``DecodeGraphs``), no round memory budget;
    ``forwards`` counts the model's forwards (encoder and decoder), ``pooled`` the decoder forwards over the
    pool."""

    transient_budget = None

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.forwards = 0
        self.pooled = 0
        self.pool: dg.DGPool | None = None
        self.graphs = None
        self.model = SimpleNamespace(elementwise=None)  # the masked models' fused-elementwise flag: not used


@dataclass
class ServedCanvas:
    """One canvas request as the instance stack reads a ``Sequence`` (module docstring)."""

    inner: CanvasSequence
    cfg: ModelConfig
    rule: RenoiseRule
    params: SamplingParams
    committed: list[int]
    prompt_text: str = ""
    threshold: float | None = None
    arrival: float = 0.0
    cache_mode: str = "exact"
    prefill_blocks: int = 1
    history: list[StepKind] = field(default_factory=list)
    rounds: int = 0  # denoising steps
    refined_rounds: float | None = None
    refine_at: int = -1  # the round its first canvas stopped at (its refinement point)
    lookahead_blocks: int = 0

    def __post_init__(self) -> None:
        length = self.cfg.block_size
        first = len(self.committed) // length
        self.blocks = [(i * length, (i + 1) * length) for i in range(first + -(-self.max_tokens_left // length))]

    @property
    def seq_id(self) -> int:
        return self.inner.seq_id

    @property
    def prompt_ids(self) -> list[int]:
        return self.inner.prompt_ids

    @property
    def max_tokens(self) -> int:
        return self.inner.max_tokens

    @property
    def max_tokens_left(self) -> int:
        return self.inner.max_tokens - len(self.committed)

    @property
    def block_idx(self) -> int:
        return self.inner.canvas_index

    @property
    def step_in_block(self) -> int:
        return self.inner.step_in_canvas

    @property
    def finished(self) -> bool:
        return self.inner.finished

    @property
    def finish_reason(self) -> str | None:
        return self.inner.finish_reason

    @property
    def prefilled(self) -> int:
        return self.inner.prefill_steps

    @property
    def rule_state(self) -> dict:
        return self.inner.state

    def admission_rounds(self) -> float:
        """Its denoising rounds if every canvas of its budget ran to the rule's step cap (an upper bound; as
        ``len(blocks)`` for a masked request, ``Instance`` scales it to the canvases left)."""
        return float(len(self.blocks) * self.rule.max_denoising_steps)

    def next_kind(self) -> StepKind:
        return StepKind.PREFILL if self.inner.prefill_steps == 0 else StepKind.DENOISE

    def kv_capacity(self) -> int:
        return len(self.prompt_ids) + self.max_tokens

    def output_ids(self) -> list[int]:
        return list(self.inner.output_ids)

    def output_logprobs(self, n: int) -> None:
        return None

    def resume_state(self, sent: int) -> Resume:
        """What a resume needs beyond the ``sent`` committed tokens (whole canvases): the seed; the current
        canvas is replayed from its first step."""
        return Resume([], state={"seed": self.inner.seed})

    def canvas_step(self) -> None:
        return None

    def _stepped(self, kind: StepKind) -> None:
        self.history.append(kind)
        if kind is not StepKind.PREFILL:
            self.rounds += 1


def split_kv_budget(budget: int, page: int, ring: int, rows: int, residents: int,
                    most_pages: int | None = None) -> tuple[int, int]:
    """(pages, rings) of a ``DGPool`` that ``budget`` bytes buy: the canvas rows' ``rows`` bytes first, then a
    ``page`` and a ``ring`` together (every resident holds one of each) up to ``residents`` of them, the rest in
    pages only (at most ``most_pages`` in all, when given): never a ring no resident could hold, nor more rings
    than pages."""
    room = max(budget - rows, 0)
    pages = room // (page + ring)
    if pages > residents:  # room past the residents' rings: their rings, the rest in pages
        pages = (room - residents * ring) // page if page else residents
        if most_pages is not None:
            pages = max(min(pages, most_pages), residents)
    return pages, min(pages, residents)


class CanvasServeEngine:
    """The ``Engine`` interface over a ``CanvasEngine`` (module docstring): what ``Instance`` and the round loop
    call. ``rule``: the instance's renoise rule (None: the checkpoint's generation defaults), a name or a rule,
    with ``decoding_config`` over it."""

    def __init__(self, model: dg.DiffusionGemma, tokenizer, device: str | torch.device = "cpu",
                 rule: RenoiseRule | str | None = None, decoding_config: dict | None = None, max_slots: int = 32,
                 default_gen_length: int | None = None, max_gen_length: int = 1024, kv_slots: int | None = None,
                 kv_slot_tokens: int | None = None, kv_memory_bytes: int | None = None,
                 kv_memory_fraction: float | None = None, kv_residents_max: int | None = None,
                 cuda_graphs: bool | None = None, **ignored) -> None:
        """The KV pool (``DGPool``) and the decoder's CUDA graphs as the masked ``Engine`` sizes and switches
        them (the same arguments): ``kv_slots`` pages (the full layers' slots) of ``kv_slot_tokens`` positions
        (default: room for ``POOL_PROMPT_TOKENS`` of prompt, or the sliding window's if longer, and the default
        generation length), or as many as ``kv_memory_bytes`` (on CUDA ``kv_memory_fraction`` of the free memory,
        a rough round's transient memory aside) holds after the canvas rows and the rings, at most what
        ``kv_residents_max`` requests as long as the context take; without either, ``max_slots``; ``kv_slots=0``:
        no pool (each cache its own tensors). The sliding layers' rings, one per resident request: as many as
        ``kv_residents_max`` (default: the scheduler's k x ``max_slots``), at most the pages (``_size_kv_pool``;
        ``Instance`` caps its residents at them). ``cuda_graphs``: default on CUDA with a pool unless the model is
        a tensor-parallel shard."""
        base = RenoiseRule.from_generation(model.config.generation)
        if rule is None or isinstance(rule, str):
            rule = resolve_rule(base, rule, decoding_config, where="engine.")
        elif decoding_config:
            rule = resolve_rule(rule, None, decoding_config, where="engine.")
        if not getattr(rule, "canvas_rule", False):
            raise ValueError(f"engine.decoding: {rule.name!r} decodes masked-diffusion blocks; a DiffusionGemma "
                             "model decodes its canvases with 'renoise'")
        self.canvas = CanvasEngine(model, None, device=device, rule=rule, grammar_tokenizer=tokenizer)
        self.model, self.rule, self.tokenizer = self.canvas.model, rule, tokenizer
        self.dg_cfg = model.config
        self.cfg = model.config.to_model_config()
        self.device = torch.device(device)
        self.stop_ids = tuple(sorted(self.canvas.stop_ids | set(getattr(tokenizer, "stop_ids", ()))))
        self.canvas.stop_ids = frozenset(self.stop_ids)
        self.max_slots = max_slots
        self.default_gen_length = default_gen_length or int(self.dg_cfg.generation.get("max_new_tokens", 256))
        self.max_gen_length = max_gen_length
        self.runner = _CanvasRunner(next(model.parameters()).dtype)
        # a request's ring holds a window's positions: its first page gets at least as many of prompt, so a
        # prompt as long as the window takes one page (a longer one more pages, still one ring: DGPool)
        prompt_room = max(POOL_PROMPT_TOKENS, self.dg_cfg.sliding_window - 1)
        tokens = kv_slot_tokens or min(self.dg_cfg.max_position_embeddings, prompt_room + self.default_gen_length)
        self.kv_pool_budget = self._size_kv_pool(tokens, kv_slots, kv_memory_bytes, kv_memory_fraction,
                                                 kv_residents_max)
        if self.kv_pool_budget["slots"]:
            self.runner.pool = self.canvas.pool = dg.DGPool(
                self.dg_cfg, self.kv_pool_budget["slots"], tokens, self._rows(), self.runner.dtype, self.device,
                rings=self.kv_pool_budget["rings"])
        sharded = any(layer.reduce is not None for layer in model.layers)
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda" and self.runner.pool is not None and not sharded
        if cuda_graphs:
            from engine.dg_graphs import DecodeGraphs

            if self.runner.pool is None or sharded:
                raise ValueError("CUDA graphs need a KV pool (kv_slots > 0) and a model on one device")
            self.runner.graphs = self.canvas.graphs = DecodeGraphs(self.model, self.runner.pool, self.device)
        self.observer = CanvasObserver()
        self.sequences: dict[int, ServedCanvas] = {}
        self._rules: dict[str, RenoiseRule] = {}
        self._ids = itertools.count()
        self.rounds = 0

    def _rows(self) -> int:
        """The pool's canvas rows: the most canvases one decoder forward takes (``max_slots``, rounded up to the
        graphs' power-of-two bucket)."""
        return 1 << (self.max_slots - 1).bit_length()

    def _size_kv_pool(self, tokens: int, slots: int | None, budget: int | None, fraction: float | None,
                      residents_max: int | None) -> dict:
        """How many pages of ``tokens`` positions and how many rings the pool gets, and from what (``__init__``).
        A page: its full layers' ``tokens`` positions; a ring: its sliding layers' window. Rings: one per request
        that can be resident at once (``residents``: ``kv_residents_max``, else the scheduler's default k x
        ``max_slots``), never more than the pages (a resident holds at least one). A budget pays the canvas rows
        first, then a page and a ring together while there are residents to hold the rings (up to
        ``residents``), and the rest in pages only (at most what ``kv_residents_max`` requests as long as the
        context take); ``kv_slots`` and ``max_slots`` give the pages, and the rings follow them."""
        cfg, item = self.dg_cfg, self.runner.dtype.itemsize
        if residents_max is not None and residents_max < 1:
            raise ValueError(f"kv_residents_max must be at least 1, got {residents_max}")
        page, ring, rows = dg.DGPool.sizes(cfg, tokens, self._rows(), item)
        residents = residents_max if residents_max is not None else SchedulerConfig.resident_factor * self.max_slots
        out = {"slot_tokens": tokens, "bytes_per_slot": page, "bytes_per_ring": ring, "canvas_row_bytes": rows,
               "budget_bytes": None, "residents": residents}
        # a round's transient memory, roughly: float32 logits and their softmax over every canvas position, and
        # some tens of activations of the hidden size
        slots, budget, source, reserve = kv_pool_source(
            slots, budget, fraction, self.device, self.max_slots,
            lambda: self._rows() * cfg.canvas_length * (16 * cfg.vocab_size + 64 * cfg.hidden_size * item),
            "the round's")
        if reserve is not None:
            out["round_reserve_bytes"] = reserve
        if slots is None:
            out["budget_bytes"] = budget
            most = None if residents_max is None else residents_max * -(-cfg.max_position_embeddings // tokens)
            slots, _ = split_kv_budget(budget, page, ring, rows, residents, most)
            if slots < 1:
                raise ValueError(f"a KV budget of {budget / 2**20:.1f} MiB holds no page of {tokens} positions and "
                                 f"ring ({page / 2**20:.2f} + {ring / 2**20:.2f} MiB, after {rows / 2**20:.2f} MiB "
                                 "of canvas rows)")
        rings = min(slots, residents)
        out.update(slots=slots, rings=rings, source=source, pages_bytes=slots * page, rings_bytes=rings * ring)
        return out

    @classmethod
    def load(cls, path, device: str = "cpu", dtype: torch.dtype = torch.float32, **kwargs) -> CanvasServeEngine:
        from engine.tokenizer import load_tokenizer

        return cls(dg.load(path, dtype=dtype, device=device), load_tokenizer(path), device=device, **kwargs)

    @property
    def refine_hook(self):
        return self.observer.refine_hook

    @refine_hook.setter
    def refine_hook(self, hook) -> None:
        self.observer.refine_hook = hook

    @property
    def lookahead(self) -> int:
        return self.observer.lookahead

    @lookahead.setter
    def lookahead(self, blocks: int) -> None:
        self.observer.lookahead = blocks

    # ---- requests ------------------------------------------------------------------------
    def rule_for(self, params: SamplingParams) -> RenoiseRule:
        """The request's renoise rule: its ``decoding_config`` over the engine's; a ValueError naming ``decoding``
        for a masked-diffusion rule and ``decoding_config`` for a bad value."""
        if params.decoding not in (None, self.rule.name):
            raise ValueError(f"decoding: {params.decoding!r} decodes masked-diffusion blocks; this DiffusionGemma "
                             f"model decodes its canvases with {self.rule.name!r}")
        if not params.decoding_config:
            return self.rule
        key = json.dumps(params.decoding_config, sort_keys=True, default=str)
        rule = self._rules.get(key)
        if rule is None:
            rule = resolve_rule(self.rule, None, params.decoding_config)
            if len(self._rules) < 256:
                self._rules[key] = rule
        return rule

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    committed: list[int] | None = None, resume: Resume | None = None) -> ServedCanvas:
        """A canvas request; ``committed``: whole canvases a previous instance published (a resume), ``resume``:
        its state there (the seed, when the request had none of its own)."""
        params = params or SamplingParams()
        params.validate(self.max_gen_length)
        if params.threshold is not None and not 0.0 <= params.threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {params.threshold}")
        if params.logprobs:
            raise ValueError("logprobs: not served for DiffusionGemma (a canvas's tokens are its last step's argmax, "
                             "not draws with a probability)")
        if resume is not None and resume.tail:
            raise ValueError("resume.tail must be empty for a DiffusionGemma request (its current canvas is replayed)")
        if params.seed is None:  # drawn once and kept: a reset or a resume elsewhere draws the same noise
            seed = (resume.state.get("seed") if resume is not None else None)
            params = dataclasses.replace(params, seed=int(seed) if seed is not None else secrets.randbits(62))
        rule = self.rule_for(params)
        ids = self.tokenizer.prompt_ids(prompt, 0) if isinstance(prompt, str) else [int(t) for t in prompt]
        max_tokens = params.max_tokens or self.default_gen_length
        knob = None if params.threshold is None else rule.knob_at(params.threshold)
        cp = CanvasParams(max_tokens=max_tokens, seed=int(params.seed), entropy_bound=knob,
                          constraint=params.constraint)
        committed = [int(t) for t in committed or ()]
        if committed:
            snap = {"prompt_ids": ids, "seed": cp.seed, "max_tokens": max_tokens, "entropy_bound": knob,
                    "output_ids": committed, "constraint": params.constraint}
            if len(committed) >= max_tokens:
                raise ValueError(f"{len(committed)} committed tokens leave nothing to generate within "
                                 f"max_tokens={max_tokens}")
            inner = self.canvas.restore(snap)
        else:
            inner = self.canvas.add_request(ids, cp)
        inner.rule = rule
        inner.stop_ids = frozenset((*(() if params.ignore_eos else self.stop_ids), *params.stop_token_ids))
        self.canvas.sequences.pop(inner.seq_id, None)  # this engine keeps its own table
        seq = ServedCanvas(inner, self.cfg, rule, params, committed, threshold=params.threshold,
                           arrival=time.monotonic(),
                           prompt_text=prompt if isinstance(prompt, str) else "")
        self.sequences[seq.seq_id] = seq
        return seq

    def abort(self, seq_id: int) -> None:
        seq = self.sequences.pop(seq_id, None)
        if seq is not None and not seq.finished:
            self.canvas.abort(seq.inner)

    # ---- one round ---------------------------------------------------------------------------
    def schedule(self) -> list[ServedCanvas]:
        return [s for s in self.sequences.values() if not s.finished][: self.max_slots]

    @torch.no_grad()
    def step(self, plan: list[ServedCanvas] | None = None) -> EngineRound:
        """One step of each planned request: the prompt prefills' encoder passes and the just-finished canvases'
        in one forward, then every other request's denoising step in one decoder forward."""
        plan = self.schedule() if plan is None else plan
        t0 = time.perf_counter()
        for seq in plan:
            want = seq.threshold
            knob = None if want is None else seq.rule.knob_at(want)
            if knob != seq.inner.params.entropy_bound:
                seq.inner.params = dataclasses.replace(seq.inner.params, entropy_bound=knob)
        prefill = [s for s in plan if s.next_kind() is StepKind.PREFILL]
        denoise = [s for s in plan if s.next_kind() is StepKind.DENOISE]
        try:
            reports, comp = self._step(plan, prefill, denoise)
        except BaseException:
            # an encoder pass writes its request's cache in place before the round's last forward: every request
            # of a failed round counts as touched (its history grew; ``Instance.step``), so it starts over from its
            # committed canvases, whose replay with the same draws gives the same text
            for seq in plan:
                seq.history.append(seq.next_kind())
            raise
        self.observer.round_done(plan, reports)
        self.rounds += bool(plan)
        return EngineRound(reports, time.perf_counter() - t0, comp)

    def _step(self, plan: list[ServedCanvas], prefill: list[ServedCanvas],
              denoise: list[ServedCanvas]) -> tuple[list[StepReport], list[tuple[str, int, int]]]:
        encoded = {s.seq_id: sum(map(len, s.inner.pending)) for s in plan}
        steps_before = {s.seq_id: s.inner.prefill_steps for s in denoise}
        self.runner.forwards += max((len(s.inner.pending) for s in plan), default=0) + bool(denoise)
        pool = self.runner.pool
        self.runner.pooled += bool(denoise) and pool is not None and dg.PoolStep.over(
            [s.inner.cache for s in denoise], self.dg_cfg.canvas_length) is pool  # placed at their first encoder pass
        self.canvas._prefill([s.inner for s in prefill + [d for d in denoise if d.inner.pending]])
        for s in denoise:  # a canvas's encoder pass is part of the next canvas's first step, not a prefill
            s.inner.prefill_steps = steps_before[s.seq_id]
        done = self.canvas._denoise([s.inner for s in denoise]) if denoise else []
        by_id = dict(zip([s.seq_id for s in denoise], done))
        reports, comp = [], []
        for seq in plan:
            ctx = seq.inner.cache.length
            if seq.seq_id in by_id:
                rep = by_id[seq.seq_id]
                seq._stepped(StepKind.DENOISE)
                if rep.canvas_done and seq.refined_rounds is None and not seq.finished:
                    # its first canvas stopped: the steps it took, for every canvas of its budget
                    seq.refine_at = seq.rounds
                    seq.refined_rounds = float(seq.rounds * (len(seq.blocks) - len(seq.committed)
                                                             // self.cfg.block_size))
                reports.append(StepReport(seq.seq_id, StepKind.DENOISE, rep.tokens + encoded[seq.seq_id],
                                          rep.tokens if rep.canvas_done else 0, rep.canvas_done, seq.finished,
                                          threshold=seq.inner.params.entropy_bound))
                comp.append((StepKind.DENOISE.value, rep.tokens + encoded[seq.seq_id], ctx))
            else:
                seq._stepped(StepKind.PREFILL)
                reports.append(StepReport(seq.seq_id, StepKind.PREFILL, encoded[seq.seq_id], 0, False, False))
                comp.append((StepKind.PREFILL.value, encoded[seq.seq_id], 0))
        return reports, comp

    # ---- outputs -----------------------------------------------------------------------------
    def output(self, seq: ServedCanvas) -> Output:
        ids = seq.output_ids()
        text = self.tokenizer.decode(ids) if self.tokenizer is not None else ""
        return Output(seq.seq_id, text, ids, seq.finish_reason or "", seq.rounds, seq.prefilled,
                      [k.value for k in seq.history], None)

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 **_) -> list[Output]:
        """Run ``prompts`` to completion together; outputs in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        while not all(s.finished for s in seqs):
            self.step([s for s in seqs if not s.finished][: self.max_slots])
        outs = [self.output(s) for s in seqs]
        for s in seqs:
            self.sequences.pop(s.seq_id, None)
        return outs
