"""Measure a latency profile of an engine (round time by step kind, tokens and context), and check a
profile against a recorded real run (the simulator's predicted round times against the measured ones)."""

from __future__ import annotations

import itertools
import random
import statistics
import time
from collections import defaultdict

import torch

from engine.device import device_name, sync
from engine.engine import Engine
from engine.latency_profile import LatencyProfile, ProfilePoint
from engine.models.presets import preset_meta
from engine.sequence import SamplingParams

PROFILE_PROMPT = "story: cat 8 and a few more words"  # two or more prompt blocks


def _prompt(engine: Engine, length: int | None, seed: int = 0):
    """A prompt of about ``length`` tokens: token ids for a preset model (no tokenizer), text otherwise."""
    if engine.cfg.extra.get("preset"):
        from engine.models.presets import random_prompt

        return random_prompt(engine.cfg, length or 2 * engine.cfg.block_size, seed)
    if length is None:
        return PROFILE_PROMPT
    text = (PROFILE_PROMPT + " ") * (length // len(PROFILE_PROMPT) + 1)
    return text[:length]


def _graph_state(engine: Engine) -> tuple[int, int] | None:
    """What changes in a round that meets a shape first (run eagerly) or captures its CUDA graph: a
    one-off cost per shape, not a steady round's (engine/graphs.py). None without graphs."""
    graphs = engine.runner.graphs
    return None if graphs is None else (graphs.captures, len(graphs.seen))


def _timed_step(engine: Engine, seqs) -> tuple[float, list[tuple[str, int, int]]]:
    sync(engine.device)
    t0 = time.perf_counter()
    result = engine.step(seqs)
    sync(engine.device)
    return (time.perf_counter() - t0) * 1000, result.composition


class _EngineRounds:
    """Rounds of identical requests on a bare engine (``remask profile``)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def start(self, prompt, params: SamplingParams, n: int) -> list:
        return [self.engine.add_request(prompt, params) for _ in range(n)]

    def prefill_blocks(self, reqs: list) -> int:
        return reqs[0].prefill_blocks

    def step(self, reqs: list) -> tuple[float, list[tuple[str, int, int]], bool]:
        ms, comp = _timed_step(self.engine, reqs)
        return ms, comp, any(s.finished for s in reqs)

    def stop(self, reqs: list) -> None:
        for s in reqs:
            self.engine.abort(s.seq_id)


class _InstanceRounds:
    """Rounds of identical requests through a serving instance: its scheduler plans them and a
    tensor-parallel instance's follower ranks run them too (a replica measuring itself at start)."""

    def __init__(self, instance) -> None:
        self.instance, self.engine = instance, instance.engine
        self._ids = itertools.count()

    def start(self, prompt, params: SamplingParams, n: int) -> list[str]:
        ids = [f"~profile-{next(self._ids)}" for _ in range(n)]
        for rid in ids:
            self.instance.add_request(rid, prompt, params)
        return ids

    def prefill_blocks(self, reqs: list[str]) -> int:
        return self.instance.seqs[reqs[0]].prefill_blocks

    def step(self, reqs: list[str]) -> tuple[float, list[tuple[str, int, int]], bool]:
        sync(self.engine.device)
        t0 = time.perf_counter()
        self.instance.step()
        sync(self.engine.device)
        ms = (time.perf_counter() - t0) * 1000
        last = self.instance.last_round
        return ms, [] if last is None else last.composition, any(r not in self.instance.seqs for r in reqs)

    def stop(self, reqs: list[str]) -> None:
        for rid in reqs:
            self.instance.abort(rid)
            self.instance.outputs.pop(rid, None)


def profile_engine(engine: Engine, name: str, batch_sizes=(1, 2, 4, 8, 16, 32, 64), rounds: int = 6,
                   progress: bool = False, prompt_lens: tuple[int | None, ...] = (None,),
                   max_tokens: int | None = None, budget_s: float | None = None,
                   warmup: bool | None = None) -> LatencyProfile:
    """Run batches of identical requests and record the median time of rounds whose steps are all of
    one kind, against the tokens in the round. The curves come from the first prompt length; rounds at
    the other (longer) lengths fit the attention term (ms per query token x context token beyond the
    curves' reference context), least squares through the origin. ``budget_s``: stop starting batches
    after this long (the batches left out are listed in ``meta["skipped"]``). ``warmup`` (default: with
    CUDA graphs): each batch runs untimed first (twice if the first pass captured a graph), so every kind's
    rounds are steady when timed (a recompute step comes once a block: without it, a small batch's
    recompute rounds all met their shape first or captured its graph, and its curve had no point there)."""
    return _profile(_EngineRounds(engine), engine, name, batch_sizes, rounds, progress, prompt_lens, max_tokens,
                    budget_s, warmup)


def profile_instance(instance, name: str, budget_s: float = 3.0, batch_sizes: tuple[int, ...] | None = None,
                     rounds: int = 4, max_tokens: int | None = None) -> LatencyProfile:
    """A serving instance's own latency profile, measured through its scheduler in about ``budget_s``
    (a replica at start, before it serves): batches of 1 to the instance's round slots, the extremes
    first so a short budget still spans them. Leaves the instance as it was (no requests)."""
    slots = instance.scheduler.cfg.slots
    if batch_sizes is None:
        sizes = sorted({min(2**k, slots) for k in range(slots.bit_length() + 1)})
        batch_sizes = tuple(dict.fromkeys([sizes[0], sizes[-1], *sizes[1:-1]]))
    # each batch untimed first: a replica's first rounds are cold (lazy initialisation, first allocations; on
    # a loaded CPU about 1 s for a one-step round that takes 2-3 ms warm), and the router priced every round
    # by them until calibration caught up
    prof = _profile(_InstanceRounds(instance), instance.engine, name, batch_sizes, rounds, False, (None,),
                    max_tokens, budget_s, warmup=True)
    prof.meta.update(slots=slots, budget_s=budget_s)
    return prof


def _held(engine: Engine) -> str:
    """What the device held when a round ran out of memory: allocated and reserved memory, the KV pool and the
    round's transient budget (engine/memory.py), so a profile's skipped case says where the memory went."""
    pool = engine.runner.pool
    budget = engine.runner.transient_budget
    held = 0 if pool is None else getattr(pool, "nbytes", None)  # a DiffusionGemma pool counts its groups' tensors
    if held is None:
        held = pool.kv.numel() * pool.kv.element_size()
    parts = [f"KV pool {held / 2**30:.1f} GiB",
             "round budget " + ("none" if budget is None else f"{budget / 2**30:.1f} GiB")]
    if engine.device.type == "cuda":
        parts = [f"allocated {torch.cuda.memory_allocated(engine.device) / 2**30:.1f} GiB",
                 f"reserved {torch.cuda.memory_reserved(engine.device) / 2**30:.1f} GiB", *parts]
    return ", ".join(parts)


def _profile(driver, engine: Engine, name: str, batch_sizes, rounds: int, progress: bool,
             prompt_lens: tuple[int | None, ...], max_tokens: int | None, budget_s: float | None,
             warmup: bool | None = None) -> LatencyProfile:
    samples: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    shapes: dict[tuple[str, int], list[tuple[int, float]]] = defaultdict(list)  # (kind, tokens) -> (steps, context)
    contexts: list[int] = []
    longer: list[tuple[str, int, float, float]] = []  # (kind, tokens, mean context, ms) at other lengths
    grid = [(p, n) for p in prompt_lens for n in batch_sizes]
    iterator = grid
    if progress:
        from tqdm import tqdm

        iterator = tqdm(grid, desc=f"profile {name}", unit="batch")
    params = SamplingParams(threshold=1.0, max_tokens=max_tokens)
    skipped: list[str] = []
    forwards0, pooled0 = engine.runner.forwards, engine.runner.pooled
    graphs = engine.runner.graphs
    warm = graphs is not None if warmup is None else warmup
    t_start = time.perf_counter()
    for i, (plen, n) in enumerate(iterator):
        if i and budget_s is not None and time.perf_counter() - t_start > budget_s:  # the first batch always runs
            skipped.append(f"batch {n} x prompt {plen}: past the {budget_s:g} s budget")
            continue
        steps = rounds + (2 if graphs is not None else 0)
        oom = False
        # the same batch untimed first, until a pass meets no new shape and captures nothing (at most two
        # passes: a shape is captured the second time it is met, and a recompute step comes once a block)
        for _ in range(2 if warm else 0):
            before = _graph_state(engine)
            reqs = driver.start(_prompt(engine, plen), params, n)
            try:
                for _ in range(steps + driver.prefill_blocks(reqs) + 1):
                    if driver.step(reqs)[2]:
                        break
            except torch.OutOfMemoryError:
                oom = _held(engine)
            driver.stop(reqs)
            if oom or _graph_state(engine) == before:
                break
        reqs = driver.start(_prompt(engine, plen), params, n)
        for _ in range(0 if oom else steps + driver.prefill_blocks(reqs) + 1):
            before = _graph_state(engine)
            try:
                ms, comp, finished = driver.step(reqs)
            except torch.OutOfMemoryError:  # too large for this device: keep the points measured so far
                oom = _held(engine)
                break
            kinds = {k for k, _, _ in comp}
            if len(kinds) == 1 and _graph_state(engine) == before:  # a steady round
                tokens = sum(t for _, t, _ in comp)
                if plen == prompt_lens[0]:
                    kind = kinds.pop()
                    samples[kind][tokens].append(ms)
                    shapes[kind, tokens].append((len(comp), statistics.mean(c for _, _, c in comp)))
                    contexts += [c for _, _, c in comp]
                else:
                    longer.append((kinds.pop(), tokens, statistics.mean(c for _, _, c in comp), ms))
            if finished:
                break
        driver.stop(reqs)
        if oom:
            skipped.append(f"batch {n} x prompt {plen}: out of memory ({oom})")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    curves = {}
    for kind, by_tokens in samples.items():
        curves[kind] = [(t, round(statistics.median(v), 3)) for t, v in sorted(by_tokens.items())]
    if "denoise" not in curves:  # full-sequence models: cached steps are the block-sized kind
        curves["denoise"] = curves.get("cached") or curves["recompute"]
    ref = statistics.median(contexts) if contexts else 0.0
    points = []  # each curve point as the rounds it came from: steps, query tokens and context of a step
    for kind, pts in curves.items():
        for t, ms in pts:
            if (kind, t) in shapes:
                n = statistics.median(s for s, _ in shapes[kind, t])
                points.append(ProfilePoint(kind, n, t / n, statistics.median(c for _, c in shapes[kind, t]), ms))
    prof = LatencyProfile(name, curves, ref_context=ref, points=points or None, meta={
        "model": engine.cfg.extra.get("name", engine.cfg.arch), "device": device_name(engine.device),
        "dtype": str(next(engine.model.parameters()).dtype).removeprefix("torch."),
        "batch_sizes": list(batch_sizes), "prompt_lens": list(prompt_lens),
        "method": "median wall time of single-kind rounds (device synchronised)", "skipped": skipped,
        "cuda_graphs": graphs is not None, "graph_tokens": None if graphs is None else graphs.max_tokens,
        "block_size": engine.cfg.block_size, "elementwise": engine.runner.model.elementwise,
        "warmup": "each batch run untimed before it is timed (once or twice: until it meets no new shape)"
        if warm else None,
        "forwards": engine.runner.forwards - forwards0, "forwards_in_kv_pool": engine.runner.pooled - pooled0,
        **preset_meta(engine.cfg)})
    pairs = [(tokens * max(ctx - ref, 0.0), ms - prof.curve_ms(kind, tokens)) for kind, tokens, ctx, ms in longer]
    denom = sum(x * x for x, _ in pairs)
    if denom > 0 and (attn := max(sum(x * y for x, y in pairs) / denom, 0.0)) > 0:  # the model refitted with it
        prof = LatencyProfile(name, curves, ref, attn, meta=prof.meta, points=prof.points)
    return prof


def profile_tp(model: str, tp: int, out: str, device: str = "cpu", dtype: torch.dtype = torch.float32,
               name: str | None = None, **kwargs) -> LatencyProfile:
    """``profile_engine`` of a ``tp``-way tensor-parallel instance: one process per rank (NCCL on CUDA,
    rank r on GPU r; gloo on a CPU), each running the same rounds on its shard with an all-reduce after
    attention and after the MLP of every layer, as the serving TP group does. Rank 0 writes ``out``.
    ``model``: a shape preset (each rank builds its own shard, random weights) or an embedded/local
    model (loaded and sharded)."""
    import os
    import socket

    import torch.multiprocessing as mp

    from engine.models.tensor_parallel import shard_config

    if tp < 2:
        raise ValueError(f"--tp must be at least 2 for a tensor-parallel profile, got {tp}")
    if device.startswith("cuda") and torch.cuda.device_count() < tp:
        raise ValueError(f"TP-{tp} needs {tp} GPUs; this machine has {torch.cuda.device_count()}")
    from engine.models import diffusion_gemma as dg
    from engine.models.presets import dg_preset_config, is_dg_preset, is_preset, preset_config

    # a degree that does not divide the heads fails here, in the parent
    if is_dg_preset(model):
        dg.shard_config(dg_preset_config(model), tp)
    elif is_preset(model):
        shard_config(preset_config(model), tp)
    else:
        from engine.loading import is_canvas_model, resolve_model

        path = resolve_model(model)
        if is_canvas_model(path):
            dg.shard_config(dg.read_config(path), tp)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_tp_rank, args=(tp, port, model, out, device, dtype, name or f"{model.split(':')[0]}-tp{tp}", kwargs),
             nprocs=tp, join=True)
    from engine.latency_profile import load_profile

    return load_profile(out)


def _tp_rank(rank: int, world: int, port: int, model: str, out: str, device: str, dtype, name: str,
             kwargs: dict) -> None:
    import torch.distributed as dist

    from engine.loading import is_canvas_model, resolve_model
    from engine.models.presets import IdTokenizer, build_preset, dg_preset_engine, is_dg_preset, is_preset
    from engine.models.tensor_parallel import all_reduce_sum, shard_model

    cuda = device.startswith("cuda")
    dev = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    show = kwargs.pop("progress", False) and rank == 0
    slots = max(kwargs.get("batch_sizes", (64,)))
    try:
        if is_dg_preset(model):  # a canvas model's shape: each rank its shard of a CanvasServeEngine
            engine = dg_preset_engine(model, device=dev, dtype=dtype, tp=world, reduce=all_reduce_sum(),
                                      max_slots=slots)
            _profile_rank(engine, rank, world, model, out, name, show, kwargs)
            return
        if is_preset(model):
            net = build_preset(model, device=dev, dtype=dtype, tp=world)
            for layer in net.layers:
                layer.reduce = all_reduce_sum()
            tokenizer = IdTokenizer(net.config)
        else:
            from engine.models.loader import load_model
            from engine.tokenizer import load_tokenizer

            path = resolve_model(model)
            if is_canvas_model(path):  # a DiffusionGemma checkpoint: each rank its shard
                from engine.canvas_serving import CanvasServeEngine
                from engine.models import diffusion_gemma as dg

                part = dg.shard(dg.load(path, dtype=dtype), rank, world, all_reduce_sum()).to(dev)
                engine = CanvasServeEngine(part, load_tokenizer(path), device=dev, max_slots=slots)
                _profile_rank(engine, rank, world, model, out, name, show, kwargs)
                return
            net = shard_model(load_model(path, dtype=dtype), rank, world, all_reduce_sum()).to(dev)
            tokenizer = load_tokenizer(path)
        _profile_rank(Engine(net, tokenizer, device=dev, max_slots=slots), rank, world, model, out, name, show,
                      kwargs)
    finally:
        dist.destroy_process_group()


def _profile_rank(engine, rank: int, world: int, model: str, out: str, name: str, show: bool, kwargs: dict) -> None:
    prof = profile_engine(engine, name, progress=show, **kwargs)
    prof.meta.update(tp=world, model=model)
    if rank == 0:
        prof.save(out)


def check_profile(engine: Engine, profile: LatencyProfile, requests: int = 48, slots: int = 16, seed: int = 0,
                  progress: bool = False, warmup: bool | None = None) -> dict:
    """A recorded real run against the profile: requests of mixed prompt and answer lengths arrive a few
    per round (so rounds mix step kinds and batch sizes, as served), each round is timed, and the
    profile's prediction for the round's composition (what the simulator charges) is compared.

    Returns the total time measured and predicted, their relative error, and the median and 90th
    percentile of the per-round relative error, over every round of the run.

    Warm-up is kept out by design (``warmup``; by default on CUDA or with graphs, where there are
    one-off costs to keep out): the same run (same seed: the same requests
    arriving at the same rounds) goes once untimed first, so the timed run meets no shape for the first
    time: its CUDA graphs are captured and the allocator has grown. Those one-off costs are a replica's
    start, not its serving (a replica measures its profile, and so meets its shapes, before it serves),
    and the profile leaves them out too: its curves are medians of steady rounds. The warm-up pass's own
    figures are reported beside (``warmup``: its rounds, time measured and predicted, and how many of its
    rounds met a shape first or captured its graph), so what the one-off costs come to is seen, not
    hidden. ``warming_rounds`` counts such rounds in the timed run (none after a warm-up, unless the
    graph cache dropped one); with CUDA graphs, ``steady`` gives the figures without them."""
    if warmup is None:
        warmup = engine.runner.graphs is not None or torch.device(engine.device).type == "cuda"
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=requests * (2 if warmup else 1), desc="check profile", unit="req")
    forwards0, pooled0 = engine.runner.forwards, engine.runner.pooled
    warm = _recorded_run(engine, profile, requests, slots, seed, bar) if warmup else None
    forwards1, pooled1 = engine.runner.forwards, engine.runner.pooled
    measured, predicted, warming, done = _recorded_run(engine, profile, requests, slots, seed, bar)
    if bar:
        bar.close()
    res = {"profile": profile.name, "model": engine.cfg.extra.get("name", engine.cfg.arch),
           "device": device_name(engine.device), **_errors(measured, predicted), "requests": done,
           "forwards": engine.runner.forwards - forwards1, "forwards_in_kv_pool": engine.runner.pooled - pooled1,
           "warming_rounds": sum(warming), "warmup": None}
    if warm is not None:
        res["warmup"] = {**_errors(warm[0], warm[1]), "warming_rounds": sum(warm[2]),
                         "forwards": forwards1 - forwards0, "forwards_in_kv_pool": pooled1 - pooled0}
    if engine.runner.graphs is not None:
        res["steady"] = _errors([m for m, w in zip(measured, warming) if not w],
                                [p for p, w in zip(predicted, warming) if not w])
    return res


def _recorded_run(engine: Engine, profile: LatencyProfile, requests: int, slots: int, seed: int, bar):
    """One recorded run: each round's measured and predicted ms, whether it met a shape first or captured
    its graph, and the requests finished."""
    rng = random.Random(seed)
    block = engine.cfg.block_size
    pending = [(_prompt(engine, rng.randint(block // 2, 4 * block), seed=i),
                SamplingParams(threshold=rng.choice([0.7, 0.9, 1.0]), max_tokens=rng.choice([1, 2, 4]) * block))
               for i in range(requests)]
    live: list = []
    measured, predicted, warming = [], [], []
    done = 0
    while pending or live:
        for _ in range(rng.randint(0, 3)):
            if pending and len(live) < slots:
                live.append(engine.add_request(*pending.pop()))
        if not live:
            continue
        before = _graph_state(engine)
        ms, comp = _timed_step(engine, live)
        measured.append(ms)
        predicted.append(profile.round_ms(comp))
        warming.append(_graph_state(engine) != before)
        finished = [s for s in live if s.finished]
        live = [s for s in live if not s.finished]
        for s in finished:
            engine.sequences.pop(s.seq_id, None)
        done += len(finished)
        if bar:
            bar.update(len(finished))
    return measured, predicted, warming, done


def _errors(measured: list[float], predicted: list[float]) -> dict:
    """Rounds, total ms measured and predicted (in s), the total's relative error and the median and 90th
    percentile of the rounds' relative errors."""
    errors = sorted(abs(p - m) / m for p, m in zip(predicted, measured) if m > 0)
    total_m, total_p = sum(measured), sum(predicted)
    return {"rounds": len(measured), "measured_s": round(total_m / 1000, 4), "predicted_s": round(total_p / 1000, 4),
            "total_error": round(abs(total_p - total_m) / total_m, 4) if total_m else None,
            "median_round_error": round(statistics.median(errors), 4) if errors else None,
            "p90_round_error": round(errors[int(0.9 * (len(errors) - 1))], 4) if errors else None}
