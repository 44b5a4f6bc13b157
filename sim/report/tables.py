"""Markdown table builders and number formatting for REPORT.md."""

from __future__ import annotations

import math
from collections.abc import Sequence


def fmt(v, digits: int = 1, pct: bool = False, suffix: str = "") -> str:
    """A number for a table cell; None or NaN -> an em dash; strings pass through."""
    if v is None:
        return "—"
    if isinstance(v, str):
        return v
    if isinstance(v, float) and not math.isfinite(v):
        return "—"
    if pct:
        return f"{100 * v:.{digits}f}%"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}{suffix}"
    return f"{v:,.{digits}f}{suffix}"


def ratio(a: float | None, b: float | None, digits: int = 2) -> str:
    """a / b as 'N.NNx' (a speed-up when a is the baseline's latency)."""
    if a is None or b is None or not b or not math.isfinite(a) or not math.isfinite(b):
        return "—"
    return f"{a / b:.{digits}f}x"


def md_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A GitHub markdown table; every row must have one cell per header."""
    for r in rows:
        if len(r) != len(headers):
            raise ValueError(f"row {list(r)!r} has {len(r)} cells for {len(headers)} headers")
    cells = [[str(c).replace("|", "\\|") for c in r] for r in rows]
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in cells]
    return "\n".join(out)


def pp(a: float | None, b: float | None) -> str:
    """Difference of two fractions in percentage points, signed."""
    if a is None or b is None:
        return "—"
    return f"{100 * (a - b):+.1f} pp"


def pct_change(new: float | None, old: float | None) -> str:
    if new is None or old is None or not old:
        return "—"
    return f"{100 * (new - old) / old:+.1f}%"
