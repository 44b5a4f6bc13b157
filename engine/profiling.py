"""Measure a latency profile of an engine: round time by step kind and batch size."""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

from engine.engine import Engine
from engine.profile import LatencyProfile
from engine.sequence import SamplingParams

PROFILE_PROMPT = "story: cat 8 and a few more words"  # two or more prompt blocks


def profile_engine(engine: Engine, name: str, batch_sizes=(1, 2, 4, 8, 16, 32, 64), rounds: int = 6,
                   progress: bool = False) -> LatencyProfile:
    """Run batches of identical requests and record the median time of rounds
    whose steps are all of one kind, against the tokens in the round."""
    samples: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    contexts: list[int] = []
    iterator = batch_sizes
    if progress:
        from tqdm import tqdm

        iterator = tqdm(batch_sizes, desc=f"profile {name}")
    for n in iterator:
        seqs = [engine.add_request(PROFILE_PROMPT, SamplingParams(threshold=1.0)) for _ in range(n)]
        for _ in range(rounds + seqs[0].prefill_blocks + 1):
            if any(s.finished for s in seqs):
                break
            t0 = time.perf_counter()
            result = engine.step(seqs)
            ms = (time.perf_counter() - t0) * 1000
            kinds = {k for k, _, _ in result.composition}
            if len(kinds) == 1:
                samples[kinds.pop()][result.tokens].append(ms)
                contexts += [c for _, _, c in result.composition]
        for s in seqs:
            engine.abort(s.seq_id)
    curves = {}
    for kind, by_tokens in samples.items():
        curves[kind] = [(t, round(statistics.median(v), 3)) for t, v in sorted(by_tokens.items())]
    if "denoise" not in curves:  # full-sequence models: cached steps are the block-sized kind
        curves["denoise"] = curves.get("cached") or curves["recompute"]
    ref = statistics.median(contexts) if contexts else 0.0
    return LatencyProfile(name, curves, ref_context=ref, meta={
        "model": engine.cfg.extra.get("name", engine.cfg.arch), "device": str(engine.device),
        "batch_sizes": list(batch_sizes), "method": "median wall time of single-kind rounds"})
