"""Prints the threshold-timing figures (tests/test_threshold_timing.py bounds them): requests through one tiny-bd
replica in a process of its own, with today's ingress, answers to every batch without waiting, and three wait
bounds.

    .venv/bin/python scripts/threshold_timing_figures.py [requests]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.threshold_timing import measure, summary  # noqa: E402

if __name__ == "__main__":
    torch.set_num_threads(1)
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    for name, answer_all, planned, kw in [
            ("today's ingress (thresholds when changed)", False, False, {}),
            ("an answer to every batch, no wait", True, False, {}),
            ("planned, wait <= min(2 ms, 10 % of a round)", True, True, {}),
            ("planned, wait <= min(5 ms, 25 %)", True, True, {"threshold_wait_s": 0.005, "threshold_wait_frac": 0.25}),
            ("planned, wait <= min(20 ms, 100 %)", True, True, {"threshold_wait_s": 0.02, "threshold_wait_frac": 1.0})]:
        print(f"{name}: {summary(measure(answer_all, planned, n=n, **kw))}", flush=True)
