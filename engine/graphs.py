"""CUDA graphs of the engine's small forwards: replayed instead of launched kernel by kernel.

A forward over a few query rows is bound by the host: an 8B model's forward launches some hundreds of
kernels, each costing the Python and driver several microseconds, while the device reads the weights
in a few milliseconds. Captured once in a CUDA graph, the same forward is one launch. Graphs need
static shapes and static device addresses, which the KV pool gives (engine/kv_cache.py): a forward that
attends to the pool in place always reads and writes the same slots' tensor, so a graph is keyed by

    (the first slot's address and the pool's strides, rows, query length, keys rounded up to ``span_step``)

and its inputs are copied into the graph's own buffers each round: token ids, positions, where each
row's fresh K/V go, and the additive mask. Rounding the keys up keeps the graphs few (a request's
span grows by a block each block): the keys past the round's own are masked, and their pool positions
hold finite K/V (zeroed once, or a finished request's), so the answer is that of the eager forward.

Only forwards of at most ``max_tokens`` rows x query tokens are captured (larger ones are bound by the
device, where a graph saves nothing and holds activation memory), only on a single device (a tensor-
parallel shard's all-reduce stays eager), and a shape is captured the second time it is seen, so a
one-off shape costs no capture. Graphs share one memory pool (they never run concurrently) and the
least recently used is dropped past ``max_graphs``. A capture that fails (out of memory, an operation
that cannot be captured) turns graphs off for the engine, with a warning, and the round runs eagerly.
``emulate=True`` runs the same static-buffer
forward eagerly instead of capturing it: the CPU tests' path, everything but the capture itself.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from engine.batch import Batch

log = logging.getLogger(__name__)


Forward = Callable[[Batch], torch.Tensor]  # a forward over a prepared batch (engine.batch.run_model, bound)


def capture_forward(forward: Forward, batch: Batch, pool=None) -> tuple[Callable[[], None], torch.Tensor]:
    """``forward(batch)`` captured in a CUDA graph: (replay, the hidden rows each replay writes).
    Warmed up twice on a side stream first (allocator, kernel choice); the batch's device tensors are the
    graph's inputs. A pooled forward's warm-ups write the same K/V the replay will, where it will."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            forward(batch)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: CUDA calls of the server's other threads (health checks, transfers) during a capture
    # neither join the graph nor fail it
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        hidden = forward(batch)
    return graph.replay, hidden


@dataclass
class _Graph:
    batch: Batch  # the static inputs: ids, pos, write, bias (buf is the pool's slots)
    hidden: torch.Tensor  # [rows, T, H] written by each replay
    replay: Callable[[], None]


class ForwardGraphs:
    def __init__(self, forward: Forward, device: torch.device | str, max_tokens: int = 512, span_step: int = 64,
                 max_graphs: int = 64, emulate: bool = False) -> None:
        """``forward``: the eager forward over a prepared batch on ``device`` that the graphs capture and
        replay (``functools.partial(engine.batch.run_model, model)``)."""
        if min(max_tokens, span_step, max_graphs) < 1:
            raise ValueError("max_tokens, span_step and max_graphs must be positive")
        if not emulate and torch.device(device).type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the model is on {device}")
        self.run = forward
        self.max_tokens, self.span_step, self.max_graphs = max_tokens, span_step, max_graphs
        self.emulate = emulate
        self.graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self.seen: set[tuple] = set()  # shapes met once: captured when met again
        self.mempool = None if emulate else torch.cuda.graph_pool_handle()
        self.captures = self.replays = 0
        self.capture_failures = 0  # captures that failed: the first turns graphs off (so at most one today)
        self.failed: str | None = None  # why a capture failed: graphs are off from then on

    def takes(self, batch: Batch) -> bool:
        """Whether ``batch`` is a graph's: a forward over the pool in place, small enough to be host-bound."""
        return self.failed is None and batch.write is not None and batch.ids.numel() <= self.max_tokens

    def rows_bucket(self, rows: int, query: int) -> int:
        """The next power of two of ``rows`` while the padded forward stays within ``max_tokens`` (so a round
        of 5, 6 or 7 requests replays the graph of 8 rows: the scheduler's batches change every round, and
        a filler row of a host-bound forward costs the device next to nothing); ``rows`` otherwise, or once
        graphs are off."""
        if self.failed is not None or rows * query > self.max_tokens:
            return rows
        bucket = 1 << (rows - 1).bit_length()
        return bucket if bucket * query <= self.max_tokens else rows

    def key(self, batch: Batch) -> tuple:
        span = batch.t_max + batch.c_max
        keys = min(-(-span // self.span_step) * self.span_step, batch.buf.shape[4])
        return batch.buf.data_ptr(), batch.buf.stride(), batch.ids.shape[0], batch.t_max, keys

    def forward(self, batch: Batch) -> torch.Tensor | None:
        """The final hidden rows of ``batch``'s forward from its graph (a view that the graph's next replay
        overwrites), or None when its shape has no graph yet (run it eagerly)."""
        key = self.key(batch)
        graph = self.graphs.get(key)
        if graph is None and key not in self.seen:
            self.seen.add(key)
            return None
        if graph is None:
            try:
                graph = self._build(key, batch)
            except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:  # the round runs eagerly instead
                self.capture_failures += 1
                self.failed = f"{type(exc).__name__}: {exc}"
                log.warning("CUDA graph capture failed, graphs are off for this engine: %s", self.failed)
                return None
        else:
            self.graphs.move_to_end(key)
            self._load(graph.batch, batch)
        graph.replay()
        self.replays += 1
        return graph.hidden

    def _load(self, static: Batch, batch: Batch) -> None:
        """Copy ``batch``'s inputs into the graph's: the keys past its own span masked."""
        static.ids.copy_(batch.ids)
        static.pos.copy_(batch.pos)
        static.write.copy_(batch.write)
        span = batch.t_max + batch.c_max
        if batch.bias is None:
            static.bias[..., :span].zero_()
        else:
            static.bias[..., :span].copy_(batch.bias)
        static.bias[..., span:].fill_(float("-inf"))

    def _build(self, key: tuple, batch: Batch) -> _Graph:
        keys = key[-1]
        rows, t = batch.ids.shape
        static = replace(batch, ids=torch.empty_like(batch.ids), pos=torch.empty_like(batch.pos),
                         write=torch.empty_like(batch.write), c_max=keys - t,
                         bias=torch.empty((rows, 1, t, keys), dtype=batch.buf.dtype, device=batch.buf.device))
        self._load(static, batch)
        if self.emulate:
            hidden = self.run(static)

            def replay() -> None:
                hidden.copy_(self.run(static))
        else:
            replay, hidden = capture_forward(self.run, static, self.mempool)
        graph = self.graphs[key] = _Graph(static, hidden, replay)
        self.captures += 1
        if len(self.graphs) > self.max_graphs:
            old, _ = self.graphs.popitem(last=False)
            self.seen.discard(old)
        return graph
