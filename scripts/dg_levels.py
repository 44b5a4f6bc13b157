"""Issue 41 item 4's figure: the router's levels for DiffusionGemma requests, chosen from their SLO budgets with
the steps per canvas it learns from the traffic, on a DiffusionGemma checkpoint (tiny-dg by default), through
the ingress's dispatcher and an in-process replica of the real engine (no Ray), printed as JSON.

    .venv/bin/python scripts/dg_levels.py --model tiny-dg --n 60

The held-out task-suite prompts (``tasksuite.heldout_set``, the five core categories) go in three phases of
``--n`` requests each, ``max_tokens`` ``--max-tokens``, request i seeded i:

- ``loose``: SLO 600 s, all at once: the router's top level (0.9, the checkpoint's entropy bound);
- ``tight``: SLO 1 ms, all at once: no level fits, so the lowest (four times the bound with 0.9, 0.8, 0.7);
- ``fit``: one at a time, each with the SLO that the router's learnt estimate at the middle level just fits
  (1.1 x a lone request's prefill and its estimated steps at that level, at the profile's round latency).

The dispatcher's clock stands still within a phase (the budgets are the SLOs, exactly) and the configured latency
profile is not calibrated by the CPU's rounds, so the levels are the router's decisions on its estimates alone.
Per phase: the levels requests decoded with (mean per request, as the done event reports it), accuracy
(``tasksuite.check``), denoising steps per request; then what the router learnt (steps per canvas per level, the
chance of a next canvas, the estimate per level) and what the replica measured (steps per canvas per entropy
bound, from its engine's observer).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


async def run(args) -> dict:
    import tasksuite as tasks
    from app.config import AppConfig
    from app.dispatch import Dispatcher
    from app.replica import ReplicaServer
    from cluster import StepShape, TpLatencyModel
    from cluster.estimator import CanvasStepEstimator
    from cluster.factory import build_router
    from engine.instance import Instance
    from engine.latency_profile import load_tp_profiles
    from engine.loading import load_engine, resolve_model
    from engine.models.loader import load_config
    from tools.evaluate import canvas_prompt_ids

    cfg = AppConfig(engine={"model": args.model, "slots": args.slots})
    path = resolve_model(args.model)
    mcfg = load_config(path)
    engine = load_engine(args.model, max_slots=args.slots)
    rule, levels = engine.rule, tuple(cfg.router.thresholds)
    clock = {"now": 0.0}
    d = Dispatcher(build_router(cfg, mcfg, canvas_steps=rule.max_denoising_steps), engine.tokenizer.decode,
                   block_tokens=mcfg.block_size, full_sequence=False, per_instance_limit=4 * args.n,
                   shed_over_capacity=False, calibrate=False, clock=lambda: clock["now"])
    d.default_decoding = rule.name
    rep = ReplicaServer(Instance(engine, slots=args.slots), tick_s=0.5)
    # a lone request's rounds at the router's profile (as build_router reads it): its prefill, then cached steps
    lat = TpLatencyModel(load_tp_profiles(cfg.profile_name(), [1]), args.slots,
                         StepShape(mcfg.block_size, int(mcfg.extra.get("gen_length", 128)) + 64, False))
    light, heavy = lat.round_ms(1, 0, 1), lat.round_ms(1, 1, 0)
    examples = tasks.heldout_set(args.n, 2026)
    prompts = [canvas_prompt_ids(engine.tokenizer, e.prompt) for e in examples]
    budget_canvases = -(-args.max_tokens // mcfg.block_size)
    out: dict = {"model": args.model, "levels": levels, "bounds": [round(rule.knob_at(t), 4) for t in levels],
                 "step_cap": rule.max_denoising_steps, "profile": cfg.profile_name(),
                 "lone_round_ms": round(light, 3), "phases": {}}

    async def one(rid: str, i: int, slo_ms: float) -> dict:
        stream = d.submit(rid, prompts[i], args.max_tokens, prompt_text=examples[i].prompt, slo_ms=slo_ms,
                          sampling={"seed": i})
        text, last = "", None
        async for event in stream:
            if event["type"] == "delta":
                text += event["text"]
            last = event
        return {"text": last.get("text", text), "threshold": last.get("threshold"), "steps": last.get("denoise_steps"),
                "ok": tasks.check(examples[i].category, examples[i].prompt, last.get("text", text))}

    def summary(results: list[dict], slos: list[float]) -> dict:
        by_level = Counter(round(r["threshold"], 2) for r in results)
        return {"requests": len(results), "slo_ms_median": round(statistics.median(slos), 2),
                "mean_level": round(statistics.mean(r["threshold"] for r in results), 3),
                "requests_by_level": {f"{k:g}": v for k, v in sorted(by_level.items(), reverse=True)},
                "accuracy": round(statistics.mean(r["ok"] for r in results), 3),
                "steps_per_request": round(statistics.mean(r["steps"] for r in results), 2)}

    try:
        await d.connect("r0", 1, **rep.info())
        t0 = time.perf_counter()
        for phase, slo in (("loose", 600_000.0), ("tight", 1.0)):
            clock["now"] += 100.0
            res = await asyncio.gather(*(one(f"{phase}{i}", i, slo) for i in range(args.n)))
            out["phases"][phase] = summary(res, [slo] * args.n)
        learnt = d.driver.estimator_state()
        mid = levels[len(levels) // 2]
        spc = learnt["estimate"][f"{mid:g}"]
        later = CanvasStepEstimator.later_canvases(learnt["next_canvas"]["p"], budget_canvases - 1)
        slo_fit = 1.1 * (max(heavy - light, 0.0) + spc * (1.0 + later) * light)
        res = []
        for i in range(args.n):
            clock["now"] += 100.0
            res.append(await one(f"fit{i}", i, slo_fit))
        out["phases"]["fit"] = summary(res, [slo_fit] * args.n)
        out["wall_s"] = round(time.perf_counter() - t0, 1)
        out["router_learnt"] = d.driver.estimator_state()
        obs = engine.observer
        per_bound = defaultdict(list)
        for n, b in zip(obs.steps_per_canvas, obs.bounds):
            per_bound[round(b, 4) if b is not None else None].append(n)
        out["replica_measured"] = {f"{b:g}": {"canvases": len(v), "mean": round(statistics.mean(v), 3)}
                                   for b, v in sorted(per_bound.items())}
    finally:
        rep.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-dg")
    ap.add_argument("--n", type=int, default=60, help="requests per phase")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--slots", type=int, default=32)
    args = ap.parse_args(argv)
    print(json.dumps(asyncio.run(run(args)), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
