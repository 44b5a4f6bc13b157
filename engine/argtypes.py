"""Argument types shared by the command lines (``remask``'s subcommands live in several packages)."""

from __future__ import annotations

import argparse


def thresholds(text: str) -> list[float]:
    """Comma-separated confidence thresholds in [0, 1]."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"thresholds must be comma-separated numbers, got {text!r}") from None
    if not values or any(not 0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError("thresholds must lie in [0, 1]")
    return values


def category_mix(text: str) -> dict[str, float]:
    """Category weights such as ``lookup=0.4,prose=0.2``."""
    try:
        mix = {k.strip(): float(v) for k, v in (item.split("=") for item in text.split(",") if item.strip())}
    except ValueError:
        raise argparse.ArgumentTypeError(f"mix must look like lookup=0.4,prose=0.2, got {text!r}") from None
    if not mix or any(v < 0 for v in mix.values()) or not sum(mix.values()):
        raise argparse.ArgumentTypeError("mix weights must be non-negative and not all zero")
    return mix


def int_list(text: str) -> list[int]:
    """Comma-separated positive integers such as ``1,8,64``."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values
