"""``remask bench engine``: Remask's engine against two reference decoding loops.

Four contenders decode the same prompts with the same model object:

- ``remask-batched``: Remask's engine with every request at once (threshold rule);
- ``remask-single``: the same engine, one request at a time;
- ``fastdllm-loop``: Fast-dLLM-style threshold decoding with a prefix cache, per request
  (:func:`tools.reference.fastdllm_generate`), at the same threshold;
- ``llada-loop``: LLaDA's low-confidence remasking loop, per request
  (:func:`tools.reference.llada_generate`).

For each: wall time, output tokens, tokens/s, rounds (decoding steps; forwards for the
loops) per second, mean per-request latency, counted FLOPs (``engine/models/flops.py``)
and model FLOP utilisation = FLOPs / time / peak, the peak measured here by a timed
large matmul in the same dtype. Every contender first decodes an untimed warm-up of the
shape it is timed on: one request for the per-request contenders, as many at once as it
runs for the batched engine (which on CUDA captures its rounds' graphs then, as a serving
engine that has run a while has them). The ratios the targets need are returned too:
batched engine throughput over the best reference loop's, and single-request engine
latency over the Fast-dLLM loop's.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from engine.decoding import make_rule
from engine.device import parse_dtype
from engine.device import sync as _sync
from engine.sequence import SamplingParams
from tools.reference import fastdllm_generate, llada_generate

CONTENDERS = ("remask-batched", "remask-single", "fastdllm-loop", "llada-loop")
TARGET_THROUGHPUT_RATIO = 10.0  # batched engine / best reference loop
TARGET_LATENCY_RATIO = 1.0  # single-request engine / Fast-dLLM loop (no worse)


def measure_peak(device: str | torch.device = "cpu", dtype: str | torch.dtype = "float32", size: int | None = None,
                 repeats: int = 7) -> float:
    """Measured peak of a large square matmul in ``dtype`` on ``device``, in FLOP/s (median of ``repeats``
    timed runs after two warm-ups; 8192 x 8192 on CUDA, 1024 x 1024 on a CPU unless ``size`` says)."""
    device, dtype = torch.device(device), parse_dtype(dtype)
    n = size or (8192 if device.type == "cuda" else 1024)
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    inner = 10 if device.type == "cuda" else 1  # several matmuls per sample: launch and sync costs vanish
    times = []
    with torch.inference_mode():
        for i in range(repeats + 2):
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(inner):
                torch.mm(a, b)
            _sync(device)
            if i >= 2:
                times.append((time.perf_counter() - t0) / inner)
    return 2.0 * n**3 / statistics.median(times)


def _check_model(model: str) -> None:
    """Refuse block-causal models before building them (a full-size preset is large)."""
    from engine.models.presets import is_preset, preset_config

    if is_preset(model):
        cfg = preset_config(model)
    else:
        from engine.loading import resolve_model
        from engine.models.loader import load_config

        cfg = load_config(resolve_model(model))
    if cfg.attention != "bidirectional":
        raise ValueError(f"bench engine compares full-sequence decoding loops (LLaDA, Fast-dLLM), which need a "
                         f"bidirectional model; {model!r} is {cfg.attention}")


def _prompts(engine, model: str, n: int, prompt_len: int, seed: int) -> tuple[list[list[int]], list]:
    """``n`` prompts as token ids, and their held-out examples for a task model (else Nones): random ids
    for a preset, held-out task prompts through the model's chat template otherwise."""
    from engine.models.presets import is_preset, random_prompt

    if is_preset(model):
        return [random_prompt(engine.cfg, prompt_len, seed=seed + i) for i in range(n)], [None] * n
    from engine.tokenizer import CharTokenizer
    from tasksuite import heldout_set

    examples = heldout_set(n, seed=2026 + seed)
    ids = [engine.tokenizer.prompt_ids(e.prompt, engine.cfg.block_size) for e in examples]
    # accuracy only means something for the models trained on the task suite (the embedded ones)
    return ids, examples if isinstance(engine.tokenizer, CharTokenizer) else [None] * n


def _summary(wall: float, outputs: list[list[int]], latencies: list[float], rounds: int, forwards: int,
             flops: int, peak: float, tokenizer, examples) -> dict:
    tokens = sum(len(o) for o in outputs)
    res = {
        "requests": len(outputs),
        "wall_s": round(wall, 6),
        "output_tokens": tokens,
        "tokens_per_s": tokens / wall,
        "rounds": rounds,
        "rounds_per_s": rounds / wall,
        "forwards": forwards,
        "tokens_per_round": tokens / max(rounds, 1),
        "mean_latency_s": statistics.fmean(latencies),
        "p50_latency_s": statistics.median(latencies),
        "max_latency_s": max(latencies),
        "flops": flops,
        "flops_per_s": flops / wall,
        "mfu": flops / wall / peak,
    }
    if examples and examples[0] is not None:
        ok = [ex.check(tokenizer.decode(o)) for ex, o in zip(examples, outputs)]
        res["accuracy"] = sum(ok) / len(ok)
    return res


def bench_engine(model: str = "tiny-mdm", device: str = "cpu", dtype: str | torch.dtype = "float32",
                 requests: int = 16, prompt_len: int = 64, gen_length: int | None = None, threshold: float = 0.9,
                 steps_per_block: int | None = None, cache: str = "dual", seed: int = 0,
                 progress: bool = False) -> dict:
    """Time the four contenders on ``requests`` prompts; a JSON-able report.

    prompt_len: prompt tokens of a preset model (random ids); a task model (tiny-mdm)
    takes held-out task prompts of their own lengths. gen_length: max output tokens
    (default: the model's generation length). steps_per_block: the LLaDA loop's steps
    per block (default: the block size, one token per step as LLaDA's papers run it).
    cache: the engine's cache for full-sequence models ('dual' is its default).
    """
    from engine.loading import load_engine

    torch_dtype = parse_dtype(dtype)
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device is CUDA but no CUDA device is available")
    if requests < 1:
        raise ValueError(f"requests must be at least 1, got {requests}")
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must be in [0, 1], got {threshold}")
    if prompt_len < 1:
        raise ValueError(f"prompt_len must be at least 1, got {prompt_len}")
    _check_model(model)
    engine = load_engine(model, device=device, dtype=torch_dtype, rule=make_rule("threshold", threshold=threshold),
                         cache=cache, max_slots=requests)
    cfg, net = engine.cfg, engine.model
    gen = gen_length or engine.default_gen_length
    steps = steps_per_block or cfg.block_size
    if steps < 1:
        raise ValueError(f"steps_per_block must be at least 1, got {steps}")
    params = SamplingParams(max_tokens=gen, threshold=threshold)
    params.validate(engine.max_gen_length)
    all_prompts, all_examples = _prompts(engine, model, requests + 1, prompt_len, seed)
    warm, prompts, examples = all_prompts[0], all_prompts[1:], all_examples[1:]
    peak = measure_peak(dev, torch_dtype)

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(CONTENDERS) * requests, desc="bench engine", unit="req", file=sys.stderr)

    def tick(n: int = 1) -> None:
        if bar:
            bar.update(n)

    results: dict[str, dict] = {}
    outputs: dict[str, list[list[int]]] = {}

    def counters() -> tuple[int, int, int]:
        return engine.rounds, engine.runner.forwards, engine.runner.flops

    # remask-batched: every request at once
    engine.generate([warm] * requests, params)
    finished_at: dict[int, float] = {}

    def on_round(res) -> None:
        now = time.perf_counter()
        done = [r.seq_id for r in res.reports if r.finished]
        for sid in done:
            finished_at[sid] = now
        tick(len(done))

    r0, f0, c0 = counters()
    _sync(dev)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params, on_round=on_round)
    _sync(dev)
    wall = time.perf_counter() - t0
    r1, f1, c1 = counters()
    outputs["remask-batched"] = [o.token_ids for o in outs]
    results["remask-batched"] = _summary(wall, outputs["remask-batched"],
                                         [finished_at[o.seq_id] - t0 for o in outs], r1 - r0, f1 - f0, c1 - c0,
                                         peak, engine.tokenizer, examples)

    # remask-single: the same engine, one request at a time
    def single(p):
        out = engine.generate([p], params)[0]
        return out.token_ids

    def per_request(name: str, run, count) -> None:
        run(warm)
        lat, outs_ = [], []
        before = count()
        for p in prompts:
            _sync(dev)
            t = time.perf_counter()
            outs_.append(run(p))
            _sync(dev)
            lat.append(time.perf_counter() - t)
            tick()
        rounds, forwards, flops = (a - b for a, b in zip(count(), before))
        outputs[name] = outs_
        results[name] = _summary(sum(lat), outs_, lat, rounds, forwards, flops, peak, engine.tokenizer,
                                 examples)

    per_request("remask-single", single, counters)

    loop_counts = [0, 0]  # forwards, flops of the reference loops

    def loop_counter() -> tuple[int, int, int]:
        return loop_counts[0], loop_counts[0], loop_counts[1]

    def reference(fn, **kw):
        def run(p):
            r = fn(net, p, gen, cfg.block_size, **kw)
            loop_counts[0] += r.forwards
            loop_counts[1] += r.flops
            return r.token_ids
        return run

    per_request("fastdllm-loop", reference(fastdllm_generate, threshold=threshold), loop_counter)
    per_request("llada-loop", reference(llada_generate, steps_per_block=steps), loop_counter)
    if bar:
        bar.close()

    best_loop = max(("fastdllm-loop", "llada-loop"), key=lambda n: results[n]["tokens_per_s"])
    throughput_ratio = results["remask-batched"]["tokens_per_s"] / results[best_loop]["tokens_per_s"]
    latency_ratio = results["remask-single"]["mean_latency_s"] / results["fastdllm-loop"]["mean_latency_s"]
    same = sum(a == b for a, b in zip(outputs["remask-single"], outputs["fastdllm-loop"]))
    return {
        "model": model,
        "device": str(dev),
        "dtype": str(torch_dtype).removeprefix("torch."),
        "requests": requests,
        "prompt_tokens_mean": statistics.fmean(len(p) for p in prompts),
        "gen_length": gen,
        "block_size": cfg.block_size,
        "threshold": threshold,
        "steps_per_block": steps,
        "engine_cache": cache,
        "threads": torch.get_num_threads() if dev.type == "cpu" else None,
        "peak_flops_per_s": peak,
        "contenders": results,
        "best_reference_loop": best_loop,
        "batched_vs_best_loop_throughput": throughput_ratio,
        "single_vs_fastdllm_latency": latency_ratio,
        "targets": {
            "batched_throughput_ratio_min": TARGET_THROUGHPUT_RATIO,
            "batched_throughput_met": throughput_ratio >= TARGET_THROUGHPUT_RATIO,
            "single_latency_ratio_max": TARGET_LATENCY_RATIO,
            "single_latency_met": latency_ratio <= TARGET_LATENCY_RATIO,
        },
        "single_same_tokens_as_fastdllm": same / len(prompts),
        "cuda_graphs": None if (g := engine.runner.graphs) is None else  # the engine's (engine/graphs.py)
        {"captures": g.captures, "replays": g.replays, "rounds": engine.rounds, "failed": g.failed},
    }


def format_report(res: dict) -> str:
    """A small human-readable table of :func:`bench_engine`'s report."""
    lines = [f"bench engine: {res['model']} on {res['device']} ({res['dtype']}), {res['requests']} requests, "
             f"gen_length {res['gen_length']}, threshold {res['threshold']}, LLaDA steps/block "
             f"{res['steps_per_block']} (block {res['block_size']}), engine cache {res['engine_cache']}; "
             f"measured peak {res['peak_flops_per_s'] / 1e12:.3g} TFLOP/s",
             f"  {'contender':15s} {'tokens':>7s} {'wall s':>8s} {'tok/s':>9s} {'rounds':>7s} {'rounds/s':>9s} "
             f"{'mean lat s':>10s} {'TFLOP':>8s} {'MFU':>7s}" + ("  accuracy" if "accuracy" in
                                                                   res["contenders"]["remask-batched"] else "")]
    for name, r in res["contenders"].items():
        acc = f"  {r['accuracy']:8.3f}" if "accuracy" in r else ""
        lines.append(f"  {name:15s} {r['output_tokens']:7d} {r['wall_s']:8.3f} {r['tokens_per_s']:9.1f} "
                     f"{r['rounds']:7d} {r['rounds_per_s']:9.1f} {r['mean_latency_s']:10.4f} "
                     f"{r['flops'] / 1e12:8.4f} {r['mfu']:7.2%}{acc}")
    t = res["targets"]
    lines.append(f"  batched / best loop ({res['best_reference_loop']}) throughput: "
                 f"{res['batched_vs_best_loop_throughput']:.2f}x (target >= {t['batched_throughput_ratio_min']:g}x: "
                 f"{'met' if t['batched_throughput_met'] else 'not met'})")
    lines.append(f"  single-request latency / fastdllm-loop: {res['single_vs_fastdllm_latency']:.2f} "
                 f"(target <= {t['single_latency_ratio_max']:g}: {'met' if t['single_latency_met'] else 'not met'})")
    if g := res.get("cuda_graphs"):
        lines.append(f"  engine CUDA graphs: {g['captures']} captured, {g['replays']} forwards replayed over "
                     f"{g['rounds']} rounds" + (f"; capture failed: {g['failed']}" if g["failed"] else ""))
    return "\n".join(lines)
