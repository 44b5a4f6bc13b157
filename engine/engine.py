"""The engine: the bottom of the five layers that serve one instance (docs/architecture.md).

``Engine`` holds a model, its tokenizer and unmasking rule, its requests' sequences and the KV pool, and runs
one round at a time: ``step(plan)`` gives each planned sequence one block step (a prefill, a denoising step
over the exact or approximate cache, a recompute) in padded batched forwards (``TorchRunner``), commits
tokens by the rule and reports what each step did (``EngineRound``). It orders nothing itself: under
``Instance`` (engine/instance.py) the scheduler's ``RoundPlan`` picks the sequences, and the round loop,
the replica server and the Denoiser wrap it in turn. Standing alone, its default plan takes unfinished
requests first come, first served, up to ``max_slots`` (``generate``: the offline API the profiler,
benchmarks and reference tools use).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.batch import run_model
from engine.commands import Resume, resolve_rule
from engine.decoding import DecodingRule
from engine.kv_cache import ApproxCache, ExactCache, KVPool
from engine.memory import forward_bytes, kv_bytes_per_token, kv_pool_source
from engine.models.transformer import DLMTransformer
from engine.observer import ObservedStep, PredictorObserver, RoundObserver
from engine.runner import TorchRunner
from engine.sequence import SamplingParams, Sequence, Status, StepInput, StepReport

log = logging.getLogger(__name__)

POOL_PROMPT_TOKENS = 512  # prompt room of a default KV pool slot (plus the default generation length)


@dataclass
class EngineRound:
    """What one engine round did: each sequence's step report, the wall time, the slots' composition."""

    reports: list[StepReport]
    latency_s: float
    composition: list[tuple[str, int, int]] = field(default_factory=list)  # (kind, tokens, context) per slot
    tokens: int = 0

    def __post_init__(self) -> None:
        self.tokens = sum(r.tokens for r in self.reports)


@dataclass
class Output:
    seq_id: int
    text: str
    token_ids: list[int]
    finish_reason: str
    rounds: int
    prefill_steps: int
    steps: list[str] = field(default_factory=list)
    logprobs: list[float] | None = None  # each token's log-probability, when its params asked for them


class Engine:
    def __init__(self, model: DLMTransformer, tokenizer, rule: DecodingRule | str | None = None,
                 cache: str = "dual", max_slots: int = 32, device: str = "cpu",
                 default_gen_length: int | None = None, max_gen_length: int = 1024,
                 kv_slots: int | None = None, kv_slot_tokens: int | None = None,
                 cuda_graphs: bool | None = None, kv_memory_bytes: int | None = None,
                 kv_memory_fraction: float | None = None, kv_residents_max: int | None = None,
                 round_memory_bytes: int | None = None, decoding_config: dict | None = None) -> None:
        """The KV pool (engine/kv_cache.py): ``kv_slots`` x ``kv_slot_tokens`` positions, allocated once on
        ``device``. A slot has room for ``POOL_PROMPT_TOKENS`` of prompt and the default generation
        length (at most the model's context) unless ``kv_slot_tokens`` says otherwise; a longer request's
        cache takes several slots. The number of slots, unless ``kv_slots`` fixes it (0: no pool): as many
        as a memory budget holds (``kv_memory_bytes``; or on CUDA ``kv_memory_fraction`` of the device
        memory free now, after the weights were loaded), at most what ``kv_residents_max`` resident
        requests as long as the model's context could take; without a budget, one per round slot
        (``max_slots``). ``kv_pool_budget`` says how it was sized. ``cuda_graphs``: replay small
        forwards over the pool from CUDA graphs (engine/graphs.py); by default on CUDA with a pool,
        unless the model is a tensor-parallel shard. ``round_memory_bytes``: what one forward may hold beyond
        the weights and the pool (engine/memory.py); the runner cuts a larger forward into several. By default
        on CUDA 90% of the memory free once the pool is allocated, and a pool sized by ``kv_memory_fraction``
        leaves room for the largest round first (so admission, which counts the pool's KV, counts it too);
        on a CPU no bound."""
        self.model = model.eval()
        self.cfg = model.config
        self.tokenizer = tokenizer
        # ids that end every request's output besides the model's EOS (a checkpoint's generation_config EOS
        # ids and end-of-turn token, from its tokenizer adapter); a request adds its own stop_token_ids
        self.stop_ids: tuple[int, ...] = tuple(getattr(tokenizer, "stop_ids", ()))
        # the instance's decoding rule (engine/decoding/): ``rule`` by name (None: threshold) with
        # ``decoding_config``, or a rule; a request may name another or configure this one (``rule_for``)
        self.rule = resolve_rule(rule if not isinstance(rule, str) else None, rule if isinstance(rule, str) else None,
                                 decoding_config)
        self._rules: dict[str, DecodingRule] = {}  # the requests' own rules, by their name and config
        if cache not in ("none", "prefix", "dual"):
            raise ValueError(f"cache must be 'none', 'prefix' or 'dual', got {cache!r}")
        self.cache = cache
        self.max_slots = max_slots
        self.device = torch.device(device)
        self.runner = TorchRunner(model, device)
        self.default_gen_length = default_gen_length or int(self.cfg.extra.get("gen_length", 128))
        tokens = kv_slot_tokens or min(self.cfg.max_position_embeddings, POOL_PROMPT_TOKENS + self.default_gen_length)
        self.kv_pool_budget = self._size_kv_pool(tokens, kv_slots, kv_memory_bytes, kv_memory_fraction,
                                                 kv_residents_max)
        slots = self.kv_pool_budget["slots"]
        if slots:
            self.runner.pool = KVPool(self.cfg.num_layers, self.cfg.num_kv_heads, self.cfg.head_dim, slots, tokens,
                                      self.runner.dtype, self.device)
        if round_memory_bytes is None and self.device.type == "cuda":
            round_memory_bytes = int(torch.cuda.mem_get_info(self.device)[0] * 0.9)
        self.runner.transient_budget = round_memory_bytes
        sharded = any(layer.reduce is not None for layer in model.layers)
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda" and bool(slots) and not sharded
        if cuda_graphs:
            from engine.graphs import ForwardGraphs

            if not slots or sharded:
                raise ValueError("CUDA graphs need a KV pool (kv_slots > 0) and a model on one device")
            # the graphs capture the runner's eager forward over its model; the runner replays through them
            self.runner.graphs = ForwardGraphs(functools.partial(run_model, self.runner.model), self.device)
        self.max_gen_length = max_gen_length
        self.sequences: dict[int, Sequence] = {}
        self._ids = itertools.count()
        self.rounds = 0
        # the instance's observer of its rounds: the work predictors' hooks and the lookahead (engine/observer.py)
        self.observer: RoundObserver = PredictorObserver(self.cfg)

    @property
    def refine_hook(self) -> Callable[[list[Sequence]], None] | None:
        """The observer's refine hook (``PredictorObserver.refine_hook``; predictors/ attach theirs here)."""
        return getattr(self.observer, "refine_hook", None)

    @refine_hook.setter
    def refine_hook(self, hook: Callable[[list[Sequence]], None] | None) -> None:
        self.observer.refine_hook = hook

    @property
    def lookahead(self) -> int:
        """The observer's lookahead blocks (``PredictorObserver.lookahead``; 0: off)."""
        return getattr(self.observer, "lookahead", 0)

    @lookahead.setter
    def lookahead(self, blocks: int) -> None:
        self.observer.lookahead = blocks

    def kv_bytes_per_token(self) -> int:
        """Device bytes of one position of K/V: 2 x layers x kv_heads x head_dim x dtype bytes."""
        return kv_bytes_per_token(self.cfg, self.runner.dtype.itemsize)

    def round_bytes(self, slot_tokens: int) -> int:
        """Transient bytes of the largest round this engine runs (engine/memory.py): ``max_slots`` rows, each a
        full-sequence step over a whole slot (a full-sequence model) or a few blocks (a block-causal one),
        decoding a block each, its K/V written in place."""
        block = self.cfg.block_size
        step = slot_tokens if self.cfg.attention != "block_causal" else min(slot_tokens, 4 * block)
        return forward_bytes(self.cfg, self.runner.dtype.itemsize, self.max_slots, step, slot_tokens - step,
                             self.max_slots * block, copied=False)

    def _size_kv_pool(self, tokens: int, slots: int | None, budget: int | None, fraction: float | None,
                      residents_max: int | None) -> dict:
        """How many slots of ``tokens`` positions the pool gets, and from what (the engine's docstring)."""
        per_slot = (tokens + 1) * self.kv_bytes_per_token()  # a slot's positions and its scratch one
        out = {"slot_tokens": tokens, "bytes_per_slot": per_slot, "budget_bytes": None}
        slots, budget, source, reserve = kv_pool_source(slots, budget, fraction, self.device, self.max_slots,
                                                        lambda: self.round_bytes(tokens), "the largest round's")
        if reserve is not None:
            out["round_reserve_bytes"] = reserve
        if slots is None:
            out["budget_bytes"] = budget
            slots = budget // per_slot
            if residents_max is not None:
                slots = min(slots, residents_max * -(-self.cfg.max_position_embeddings // tokens))
            if slots < 1:
                raise ValueError(f"a KV budget of {budget / 2**20:.1f} MiB holds no slot of {tokens} positions "
                                 f"({per_slot / 2**20:.2f} MiB each)")
        return {**out, "slots": slots, "source": source}

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    committed: list[int] | None = None, resume: Resume | None = None) -> Sequence:
        """``committed``: output tokens already committed (resuming a request elsewhere, e.g. after
        its instance died or it migrated); decoding continues after them with the same blocks (and, for a
        sampling request, the same noise: pass the same seed); ``resume``: the state of the block after them
        (its canvas, step counters and rule state: engine/commands.py), so that it continues exactly. A
        sampling request without a seed gets a random one, kept in ``seq.params`` (which a tensor-parallel
        instance sends its followers)."""
        params = params or SamplingParams()
        params.validate(self.max_gen_length)
        if params.threshold is not None and not 0.0 <= params.threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {params.threshold}")
        bad = [t for t in params.stop_token_ids if t >= self.cfg.vocab_size or t == self.cfg.mask_token_id]
        if bad:
            raise ValueError(f"stop_token_ids {bad} are not tokens the model emits (the vocabulary has "
                             f"{self.cfg.vocab_size} ids; the mask token is {self.cfg.mask_token_id})")
        if params.samples and params.seed is None:
            params = dataclasses.replace(params, seed=secrets.randbits(63))
        ids = self.tokenizer.prompt_ids(prompt, self.cfg.block_size) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        max_tokens = params.max_tokens or self.default_gen_length
        b = self.cfg.block_size
        gen_len = -(-max_tokens // b) * b
        if len(ids) + gen_len > self.cfg.max_position_embeddings:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({gen_len}) exceeds the model's "
                             f"context of {self.cfg.max_position_embeddings} tokens")
        block_causal = self.cfg.attention == "block_causal"
        cache_mode = "exact" if block_causal else (params.cache or self.cache)
        seq = Sequence(next(self._ids), ids, self.cfg, self.rule_for(params), gen_len, cache_mode, max_tokens,
                       threshold=params.threshold, arrival=time.monotonic(),
                       prompt_text=prompt if isinstance(prompt, str) else self.tokenizer.decode(ids),
                       committed=list(committed or ()), params=params, resume=resume,
                       stop_ids=(*(() if params.ignore_eos else self.stop_ids), *params.stop_token_ids))
        if params.constraint is not None:  # structured outputs: the grammar's guard on the canvas
            from engine.constraints.canvas import CanvasGuard, engine_grammar

            seq.guard = CanvasGuard(engine_grammar(self, params.constraint), self.cfg.mask_token_id, committed or ())
        self.sequences[seq.seq_id] = seq
        return seq

    def rule_for(self, params: SamplingParams) -> DecodingRule:
        """A request's decoding rule: its ``decoding`` and ``decoding_config`` over the engine's rule (precedence
        request > server > checkpoint > ``threshold``: ``engine.commands.resolve_rule``); a ValueError naming
        ``decoding`` or ``decoding_config`` for an unknown rule or a bad value."""
        if params.decoding is None and not params.decoding_config:
            return self.rule
        key = json.dumps([params.decoding, params.decoding_config], sort_keys=True, default=str)
        rule = self._rules.get(key)
        if rule is None:
            rule = resolve_rule(self.rule, params.decoding, params.decoding_config)
            if len(self._rules) < 256:
                self._rules[key] = rule
        return rule

    def abort(self, seq_id: int) -> None:
        seq = self.sequences.pop(seq_id, None)
        if seq is not None and not seq.finished:
            seq._finish("abort", 0)

    def _ensure_cache(self, seq: Sequence) -> None:
        if seq.cache is not None or seq.cache_mode == "none":
            return
        args = (self.cfg.num_layers, self.cfg.num_kv_heads, self.cfg.head_dim, seq.kv_capacity(), self.runner.dtype,
                self.device)
        pool = self.runner.pool
        seq.cache = (ExactCache(*args, pool=pool) if seq.cache_mode == "exact"
                     else ApproxCache(*args, variant=seq.cache_mode, pool=pool))

    # ---- one round: schedule -> run -> postprocess -------------------------------------------
    def schedule(self) -> list[Sequence]:
        live = [s for s in self.sequences.values() if not s.finished]
        return live[: self.max_slots]

    def step(self, plan: list[Sequence] | None = None) -> EngineRound:
        plan = self.schedule() if plan is None else plan
        t0 = time.perf_counter()
        inputs, ran = self._prepare(plan)
        outputs = self._run(plan, inputs, ran)
        reports = self._postprocess(plan, inputs, ran, outputs)
        self.rounds += bool(plan)
        comp = [(i.kind.value, len(i.ids), 0 if i.ctx_pos is None else len(i.ctx_pos)) for i in ran]
        return EngineRound(reports, time.perf_counter() - t0, comp)

    def _prepare(self, plan: list[Sequence]) -> tuple[list[StepInput], list[StepInput]]:
        """Each sequence's step input, and what the runner runs for it (the observer may extend it)."""
        for seq in plan:
            self._ensure_cache(seq)
            seq.status = Status.RUNNING
        inputs = [seq.build_step() for seq in plan]
        return inputs, [self.observer.step_input(seq, inp) for seq, inp in zip(plan, inputs)]

    def _run(self, plan: list[Sequence], inputs: list[StepInput], ran: list[StepInput]) -> list:
        """The round's forwards: each sequence names the rows it decodes and how it samples them."""
        if not ran:
            return []
        rows = [seq.decode_rows(inp) for seq, inp in zip(plan, inputs)]
        sampling = [seq.decode_sampling() if r is not None else None for seq, r in zip(plan, rows)]
        stats = [seq.decode_stats() if r is not None else None for seq, r in zip(plan, rows)]
        allowed = [seq.decode_allowed() if r is not None else None for seq, r in zip(plan, rows)]
        return self.runner.run(ran, rows, sampling if any(s is not None for s in sampling) else None,
                               stats if any(s is not None for s in stats) else None,
                               allowed=allowed if any(a is not None for a in allowed) else None)

    def _postprocess(self, plan: list[Sequence], inputs: list[StepInput], ran: list[StepInput],
                     outputs: list) -> list[StepReport]:
        """Each sequence applies its step's results (the runner returned the decode rows' results already on
        the host, so no logits are needed here); then the observer sees the round."""
        reports = [seq.apply(inp, None, out.fresh[:, :, :, :len(inp.ids)], out.top1, out.stats)
                   for seq, inp, out in zip(plan, inputs, outputs)]
        self.observer.round_done([ObservedStep(*s) for s in zip(plan, inputs, ran, outputs, reports)])
        return reports

    # ---- offline API -------------------------------------------------------------------------
    def output(self, seq: Sequence) -> Output:
        ids = seq.output_ids()
        return Output(seq.seq_id, self.tokenizer.decode(ids), ids, seq.finish_reason or "", seq.rounds,
                      seq.prefilled, [k.value for k in seq.history], seq.output_logprobs(len(ids)))

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 on_round: Callable[[EngineRound], None] | None = None, progress: bool = False) -> list[Output]:
        """Run ``prompts`` to completion together; outputs in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(seqs), desc="generate", unit="req")
        done = 0
        while not all(s.finished for s in seqs):
            result = self.step()
            if on_round:
                on_round(result)
            if bar:
                now = sum(s.finished for s in seqs)
                bar.update(now - done)
                done = now
        if bar:
            bar.close()
        outs = [self.output(s) for s in seqs]
        for s in seqs:
            self.sequences.pop(s.seq_id, None)
        return outs
