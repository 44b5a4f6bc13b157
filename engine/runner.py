"""The torch runner: executes one round's steps as padded batched forwards.

Steps of very different lengths (a full-sequence recompute beside 8-token
blocks) are grouped by length so that little of each forward is padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.models.masks import allowed
from engine.models.transformer import DLMTransformer
from engine.sequence import StepInput


@dataclass
class StepOutput:
    logits: torch.Tensor  # [T, V]
    fresh: torch.Tensor  # [layers, 2, kv_heads, T, head_dim]
    hidden: torch.Tensor  # [T, hidden]: final-layer hidden rows


def group_by_length(inputs: list[StepInput]) -> list[list[int]]:
    """Indices of ``inputs`` grouped so each group's lengths are within 2x."""
    order = sorted(range(len(inputs)), key=lambda i: len(inputs[i].ids))
    groups: list[list[int]] = []
    for i in order:
        if groups and len(inputs[i].ids) <= 2 * len(inputs[groups[-1][0]].ids):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


class TorchRunner:
    def __init__(self, model: DLMTransformer, device: str | torch.device = "cpu") -> None:
        self.model = model
        self.cfg = model.config
        self.device = torch.device(device)
        self.forwards = 0

    @torch.inference_mode()
    def run(self, inputs: list[StepInput]) -> list[StepOutput]:
        outputs: list[StepOutput | None] = [None] * len(inputs)
        for group in group_by_length(inputs):
            for i, out in zip(group, self._forward([inputs[i] for i in group])):
                outputs[i] = out
        return outputs  # type: ignore[return-value]

    def _forward(self, inputs: list[StepInput]) -> list[StepOutput]:
        cfg, dev = self.cfg, self.device
        n = len(inputs)
        t_max = max(len(s.ids) for s in inputs)
        c_max = max((0 if s.ctx_pos is None else len(s.ctx_pos)) for s in inputs)
        ids = torch.full((n, t_max), cfg.pad_token_id, dtype=torch.long)
        pos = torch.zeros((n, t_max), dtype=torch.long)
        mask = torch.zeros((n, 1, t_max, c_max + t_max), dtype=torch.bool)
        past = None
        if c_max:
            ref = next(s.ctx_kv for s in inputs if s.ctx_kv is not None)
            shape = (cfg.num_layers, 2, n, cfg.num_kv_heads, c_max, cfg.head_dim)
            past = torch.zeros(shape, dtype=ref.dtype, device=dev)
        for i, s in enumerate(inputs):
            t = len(s.ids)
            ids[i, :t], pos[i, :t] = s.ids, s.pos
            mask[i, 0, :t, c_max : c_max + t] = allowed(s.mode, s.pos, s.pos, cfg.block_size)
            mask[i, 0, torch.arange(t, t_max), torch.arange(c_max + t, c_max + t_max)] = True
            if s.ctx_pos is not None and len(s.ctx_pos):
                c = len(s.ctx_pos)
                mask[i, 0, :t, :c] = allowed(s.mode, s.pos, s.ctx_pos, cfg.block_size)
                past[:, :, i, :, :c] = s.ctx_kv
        layers_past = None if past is None else [(past[l, 0], past[l, 1]) for l in range(cfg.num_layers)]
        logits, hidden, fresh = self.model(ids.to(dev), pos.to(dev), mask.to(dev), layers_past)
        self.forwards += 1
        kv = torch.stack([torch.stack(pair) for pair in fresh])  # [layers, 2, n, kv_heads, t_max, head_dim]
        outs = []
        for i, s in enumerate(inputs):
            t = len(s.ids)
            outs.append(StepOutput(logits[i, :t], kv[:, :, i, :, :t], hidden[i, :t]))
        return outs
