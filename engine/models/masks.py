"""Attention masks by position: one rule per attention mode.

Blocks are aligned to absolute positions (block b holds positions
[b * size, (b + 1) * size)), as block-diffusion models are trained.
"""

from __future__ import annotations

import torch


def _may_attend(mode: str, q, k, block_size: int):
    """The rule of a masking mode for query positions ``q`` and key positions ``k``: ints, or tensors
    that broadcast (positions are non-negative, so ``//`` is the block index either way)."""
    if mode == "block_causal":
        return k // block_size <= q // block_size
    if mode == "causal":
        return k <= q
    raise ValueError(f"unknown attention mode {mode!r}")


def allowed(mode: str, q_pos: torch.Tensor, k_pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """Bool [..., Tq, Tk]: may a query at q_pos attend to a key at k_pos."""
    q = q_pos[..., :, None]
    k = k_pos[..., None, :]
    if mode == "bidirectional":
        return torch.ones(torch.broadcast_shapes(q.shape, k.shape), dtype=torch.bool, device=q_pos.device)
    return _may_attend(mode, q, k, block_size)


def attends_all(mode: str, q_start: int, key_end: int, block_size: int) -> bool:
    """Whether every query at a position >= ``q_start`` may attend every key in [0, ``key_end``): the
    host-side shortcut for ``allowed(...).all()`` over such a step, with no tensor built. Every rule lets
    a later query see at least what an earlier one sees, and an earlier key be seen by at least whoever
    sees a later one, so this is whether the first query may attend the last key."""
    return mode == "bidirectional" or _may_attend(mode, q_start, key_end - 1, block_size)


def full_mask(mode: str, positions: torch.Tensor, valid: torch.Tensor, block_size: int) -> torch.Tensor:
    """[N, 1, T, T] mask over a padded batch: ``valid`` marks real tokens.

    Padding rows attend to themselves only, so no row is empty.
    """
    m = allowed(mode, positions, positions, block_size) & valid[:, None, :]
    eye = torch.eye(positions.shape[1], dtype=torch.bool, device=positions.device)
    m = m | (eye & ~valid[:, :, None])
    return m[:, None]
