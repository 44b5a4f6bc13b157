"""Attention masks by position: one rule per attention mode.

Blocks are aligned to absolute positions (block b holds positions
[b * size, (b + 1) * size)), as block-diffusion models are trained.
"""

from __future__ import annotations

import torch


def allowed(mode: str, q_pos: torch.Tensor, k_pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """Bool [..., Tq, Tk]: may a query at q_pos attend to a key at k_pos."""
    q = q_pos[..., :, None]
    k = k_pos[..., None, :]
    if mode == "bidirectional":
        return torch.ones(torch.broadcast_shapes(q.shape, k.shape), dtype=torch.bool, device=q_pos.device)
    if mode == "block_causal":
        return torch.div(k, block_size, rounding_mode="floor") <= torch.div(q, block_size, rounding_mode="floor")
    if mode == "causal":
        return k <= q
    raise ValueError(f"unknown attention mode {mode!r}")


def attends_all(mode: str, q_start: int, key_end: int, block_size: int) -> bool:
    """Whether every query at a position >= ``q_start`` may attend every key in [0, ``key_end``): the
    host-side shortcut for ``allowed(...).all()`` over such a step, with no tensor built."""
    if mode == "bidirectional":
        return True
    if mode == "block_causal":
        return (key_end - 1) // block_size <= q_start // block_size
    if mode == "causal":
        return key_end - 1 <= q_start
    raise ValueError(f"unknown attention mode {mode!r}")


def full_mask(mode: str, positions: torch.Tensor, valid: torch.Tensor, block_size: int) -> torch.Tensor:
    """[N, 1, T, T] mask over a padded batch: ``valid`` marks real tokens.

    Padding rows attend to themselves only, so no row is empty.
    """
    m = allowed(mode, positions, positions, block_size) & valid[:, None, :]
    eye = torch.eye(positions.shape[1], dtype=torch.bool, device=positions.device)
    m = m | (eye & ~valid[:, :, None])
    return m[:, None]
