"""One padded forward's device inputs (``Batch``), the model run over them (``run_model``), and what may
replay such a forward instead of running it (``Replayer``): the types the runner (engine/runner.py), which
builds batches, and the CUDA graphs (engine/graphs.py), which capture and replay them, share. Neither of
those imports the other: the engine hands the graphs the forward they replay and the runner the graphs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.models.transformer import DLMTransformer, Slots


@dataclass
class Batch:
    """One padded forward's device inputs (``TorchRunner.prepare``)."""

    ids: torch.Tensor  # [N, T]
    pos: torch.Tensor  # [N, T]
    bias: torch.Tensor | None  # additive mask [N, 1, T, C + T], None when nothing is masked
    buf: torch.Tensor  # [layers, 2, N, kv_heads, P, head_dim]: keys and values, fresh K/V written in place
    t_max: int
    c_max: int  # the forward attends to the first C + T positions of ``buf`` (P = C + T unless pooled)
    row_of: list[int]  # per step, its row of the batch
    q_off: list[int]  # per step, where its query's K/V start along ``buf``'s positions
    write: torch.Tensor | None = None  # [N, T] where each query row's K/V go, when not at the end (the pool)
    # steps with no context over the whole pool (``buf``): each row's fresh K/V written into its slot in place,
    # attended as they are (``TorchRunner._prepare_in_slots``); None otherwise
    in_slots: Slots | None = None
    kv_rows: list[int] | None = None  # per step, its row of ``buf`` when that is not its row of the batch
    h_off: list[int] | None = None  # per step, where its tokens start along its row (packed steps); None: 0


@torch.inference_mode()
def run_model(model: DLMTransformer, batch: Batch) -> torch.Tensor:
    """The model over a prepared batch: final hidden rows [N, T, H]; fresh K/V land in ``batch.buf``. Only
    device work on the batch's tensors, so it can be captured in a CUDA graph."""
    layers_past = [(batch.buf[layer, 0], batch.buf[layer, 1]) for layer in range(model.config.num_layers)]
    if batch.in_slots is not None:
        room = batch.in_slots
    else:
        room = True if batch.write is None else (batch.write, batch.t_max + batch.c_max)
    return model(batch.ids, batch.pos, batch.bias, layers_past, room=room, head=False)[1]


class Replayer(Protocol):
    """Replays some forwards instead of running them (engine/graphs.py's ``ForwardGraphs``)."""

    def takes(self, batch: Batch) -> bool:
        """Whether ``batch``'s forward is one this replayer handles."""

    def forward(self, batch: Batch) -> torch.Tensor | None:
        """The final hidden rows of ``batch``'s forward, or None: run it eagerly."""

    def rows_bucket(self, rows: int, query: int) -> int:
        """The rows a forward of ``rows`` x ``query`` tokens over the pool should be padded to (filler rows),
        so that its shape is one this replayer handles again; ``rows`` when it would not handle it."""
