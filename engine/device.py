"""Small device helpers shared by the measuring commands (profile, bench engine, bench round)."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: float32, bfloat16, float16") from None


def sync(device: str | torch.device) -> None:
    """Wait for the device's queued work (a timing boundary); nothing to wait for on a CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: str | torch.device) -> str:
    """The GPU's name on CUDA ('NVIDIA H200'), else the device string."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)


def set_threads(n: int) -> None:
    """Cap torch's CPU threads in this process (for callers that keep torch out of their own imports, as the
    simulator's command line does)."""
    torch.set_num_threads(n)
