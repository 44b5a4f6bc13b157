"""CUDA graphs of DiffusionGemma's decoder step: a canvas round's hot loop, replayed instead of launched.

A canvas round is many small decoder forwards (one per denoising step, up to the rule's step cap per canvas)
over the same caches: each forward launches some hundreds of kernels for a few canvases, bound by the host on a
GPU. Over the DiffusionGemma KV pool (``engine.models.diffusion_gemma.DGPool``) every forward reads and writes
the same tensors: the pool's groups, each layer's canvas rows (where the canvases' K/V go) and the keys gathered
by index, so a graph is keyed by

    (canvases rounded up to a power of two, canvas length, each group's past keys rounded up to ``span_step``)

and holds static buffers for its inputs: canvas ids, self-conditioning (soft embeddings, zeros where a row has
none) and which rows it counts for, positions, per group the gathered keys' pool positions and the mask of the
held ones (``PoolStep``). Filler rows (the bucket's rows past the round's) attend only to their own canvas row;
keys past a row's own point at its canvas row, masked. The answer is the eager pooled forward's: the same
operations on the same values (tests/test_dg_pool.py checks it bit for bit, emulated).

The graph ends at the final normed hidden states [rows, length, hidden] (its static output); the LM head and the
soft cap run eagerly after the replay (one product, and [rows, length, vocab] float32 logits a graph would keep
per shape). Only forwards of at most ``max_tokens`` canvas tokens are captured (a larger one is bound by the
device), only on a single device (a tensor-parallel shard's all-reduce stays eager), and a shape is captured the
second time it is met (the first time, and whenever graphs cannot be captured, its step runs the same
static-shaped forward eagerly). Graphs share one memory pool; the least recently used is dropped past
``max_graphs``. A failed capture turns graphs off for the engine with a warning (the steps run the static-shaped
forward eagerly). ``emulate=True`` runs the same static-buffer forward
eagerly instead of capturing it: the CPU tests' path, everything but the capture.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from engine.graphs import capture_forward
from engine.models import diffusion_gemma as dg

log = logging.getLogger(__name__)


@dataclass
class _Graph:
    canvas: torch.Tensor  # [rows, L] ids
    soft: torch.Tensor  # [rows, L, H] self-conditioning soft embeddings
    counted: torch.Tensor  # [rows] bool: the rows whose self-conditioning counts
    step: dg.PoolStep  # positions, key indices and masks (its tensors are the graph's)
    hidden: torch.Tensor  # [rows, L, H] the final normed hidden states, written by each replay
    replay: object
    loaded: tuple = ()  # the caches (uid, length) whose indices the static step holds now


class DecodeGraphs:
    def __init__(self, model: dg.DiffusionGemma, pool: dg.DGPool, device: torch.device | str,
                 max_tokens: int = 2048, span_step: int = 64, max_graphs: int = 16, emulate: bool = False,
                 capture_at: int = 2) -> None:
        """``capture_at``: a shape is captured the time it is met this often (before, its steps run eagerly over
        the same static shapes)."""
        if min(max_tokens, span_step, max_graphs, capture_at) < 1:
            raise ValueError("max_tokens, span_step, max_graphs and capture_at must be positive")
        if not emulate and torch.device(device).type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the model is on {device}")
        if any(layer.reduce is not None for layer in model.layers):
            raise ValueError("CUDA graphs run on a single device: a tensor-parallel shard's decoder stays eager")
        self.model, self.pool, self.device = model, pool, torch.device(device)
        self.max_tokens, self.span_step, self.max_graphs, self.emulate = max_tokens, span_step, max_graphs, emulate
        self.graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self.capture_at = capture_at
        self.seen: dict[tuple, int] = {}  # shapes met, how often, until captured
        self._last: tuple | None = None  # the last eager step's key and static inputs
        self.mempool = None if emulate else torch.cuda.graph_pool_handle()
        self.captures = self.replays = 0
        self.capture_failures = 0
        self.failed: str | None = None  # why a capture failed: graphs are off from then on

    def rows_bucket(self, rows: int) -> int:
        bucket = 1 << (rows - 1).bit_length()
        return bucket if bucket <= self.pool.rows else rows

    def key(self, caches: list[dg.DGCache], t: int) -> tuple | None:
        """The graph of a step over ``caches`` with canvases of ``t``; None when it takes none (too large, caches
        outside the pool)."""
        if not all(c.pool is self.pool for c in caches):
            return None
        rows = self.rows_bucket(len(caches))
        if rows * t > self.max_tokens or rows > self.pool.rows or t != self.pool.length:
            return None
        return rows, t, tuple(self.past_keys(caches))

    def past_keys(self, caches: list[dg.DGCache]) -> list[int]:
        """Per group, the cached keys a step over ``caches`` reads: the longest held, rounded up to ``span_step``
        (a sliding group's at most its window). The padding keys point at the row's canvas, masked."""
        past = []
        for g, (sliding, _, _) in enumerate(self.pool.shapes):
            layer = self.pool.where.index((g, 0))
            longest = max(c.kept(layer) for c in caches)
            rounded = -(-longest // self.span_step) * self.span_step
            past.append(min(rounded, self.pool.window) if sliding else rounded)
        return past

    def decode(self, canvas: torch.Tensor, caches: list[dg.DGCache], soft: torch.Tensor | None,
               counted: torch.Tensor | None) -> torch.Tensor | None:
        """The logits [N, L, V] of the decoder step over ``caches``: the LM head (eager: one product) over the
        final hidden states from its graph or, a shape not captured yet, from the same static-shaped forward run
        eagerly (so a replay and the steps before it give the same bits); None when the step takes no graph at
        all (run it as without graphs)."""
        n, t = canvas.shape
        key = self.key(caches, t)
        if key is None:
            return None
        graph = self.graphs.get(key) if self.failed is None else None
        if graph is None:
            self.seen[key] = met = self.seen.get(key, 0) + 1
            if met < self.capture_at or self.failed is not None:
                return self._eager(key, canvas, caches, soft, counted)
            try:
                graph = self._build(key, canvas, caches, soft, counted)
            except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
                self.capture_failures += 1
                self.failed = f"{type(exc).__name__}: {exc}"
                log.warning("CUDA graph capture failed, graphs are off for this engine: %s", self.failed)
                return self._eager(key, canvas, caches, soft, counted)
        else:
            self.graphs.move_to_end(key)
            self._load(graph, key, canvas, caches, soft, counted)
        graph.replay()
        self.replays += 1
        return self.model.logits(graph.hidden[:n])

    def _load(self, graph: _Graph, key: tuple, canvas, caches, soft, counted) -> None:
        n = canvas.shape[0]
        graph.canvas[:n].copy_(canvas)
        graph.canvas[n:].fill_(self.model.config.pad_token_id)
        if soft is None:
            graph.soft.zero_()
            graph.counted.zero_()
        else:
            graph.soft[:n].copy_(soft)
            graph.soft[n:].zero_()
            graph.counted[:n].copy_(torch.ones(n, dtype=torch.bool) if counted is None else counted)
            graph.counted[n:].zero_()
        state = tuple((c.uid, c.length) for c in caches)
        if graph.loaded != state:  # the same caches step after step: their indices are loaded once
            fresh = dg.PoolStep(self.pool, caches, key[1], "cpu", rows=key[0], past=list(key[2]))
            graph.step.pos.copy_(fresh.pos)
            for dst, src in zip(graph.step.index, fresh.index):
                dst.copy_(src)
            for dst, src in zip(graph.step.mask, fresh.mask):
                dst.copy_(src)
            graph.loaded = state

    def _inputs(self, key: tuple, canvas, caches, soft, counted) -> _Graph:
        """A graph's static inputs for ``key``, holding this step's."""
        rows, t, past = key
        hidden = self.model.config.hidden_size
        dtype = self.model.embed_tokens.weight.dtype
        step = dg.PoolStep(self.pool, caches, t, self.device, rows=rows, past=list(past))
        step.key = ()  # a graph's step names no caches: its tensors are reloaded for each batch
        graph = _Graph(torch.empty(rows, t, dtype=torch.long, device=self.device),
                       torch.empty(rows, t, hidden, dtype=dtype, device=self.device),
                       torch.empty(rows, dtype=torch.bool, device=self.device), step, None, None)
        self._load(graph, key, canvas, caches, soft, counted)
        graph.loaded = tuple((c.uid, c.length) for c in caches)
        return graph

    def _eager(self, key: tuple, canvas, caches, soft, counted) -> torch.Tensor:
        """The step of a shape not captured (yet, or ever once a capture failed): the graph's forward over its
        static shapes, run eagerly (the last shape's inputs kept: a canvas's steps reuse them)."""
        if self._last is not None and self._last[0] == key:
            graph = self._last[1]
            self._load(graph, key, canvas, caches, soft, counted)
        else:
            graph = self._inputs(key, canvas, caches, soft, counted)
            self._last = (key, graph)
        hidden = self.model.decode_hidden(graph.canvas, graph.step, graph.soft, graph.counted)
        return self.model.logits(hidden[: canvas.shape[0]])

    def _build(self, key: tuple, canvas, caches, soft, counted) -> _Graph:
        graph = self._inputs(key, canvas, caches, soft, counted)

        def forward(_=None) -> torch.Tensor:
            return self.model.decode_hidden(graph.canvas, graph.step, graph.soft, graph.counted)

        if self.emulate:
            hidden = forward()

            def replay() -> None:
                hidden.copy_(forward())
        else:
            replay, hidden = capture_forward(forward, None, self.mempool)
        graph.hidden, graph.replay = hidden, replay
        self.graphs[key] = graph
        self.captures += 1
        self.seen.pop(key, None)
        if len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)  # met again, it is captured again
        return graph
