"""Sizes of a report run: ``full`` (the default), ``quick`` (under 10 minutes on two cores) and ``tiny``
(a smoke test for the unit tests; its numbers mean nothing)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Plan:
    name: str
    # instance level (DWISE workload, one instance, B = 128)
    inst_n: int  # burst and burst+Poisson requests (the paper: 4,096)
    inst_policies: tuple[str, ...]
    sweep_n: int  # requests of each load, block-size and output-budget sweep point
    load_mults: tuple[float, ...]  # Poisson rates as multiples of SGLang's burst throughput
    blocks: tuple[int, ...]
    budgets: tuple[int, ...]
    seeds: tuple[int, ...]
    seed_n: int
    # cluster level (16 GPUs, B = 32, LLaDA-8B-shaped requests)
    cl_n: int  # requests per cluster run
    cl_rates: tuple[float, ...]
    cl_combos: tuple[str, ...]  # router/instance pairs of the rate sweep
    slo_rate: float
    slo_factors: tuple[float, ...]
    ablation_rate: float
    ablation_all_thresholds: bool
    migration_rate: float
    migration_tps: tuple[int, ...]
    length_rate: float
    lengths: tuple[tuple[int, int], ...]  # (output tokens, prompt tokens per character)
    burst_n: int  # cluster burst+Poisson requests: burst_frac at t = 0, the rest Poisson at burst_rate
    burst_rate: float
    burst_tps: tuple[int, ...]
    burst_frac: float
    diurnal_n: int
    diurnal_rate: float
    cl_seeds: tuple[int, ...]
    cl_seed_rate: float
    max_replays: int | None  # per run; None: every mixed-threshold answer is replayed
    trace_n: int
    trace_statics: tuple[tuple[int, int, int], ...] | None  # None: the scenario's own list
    predictors: bool


ALL_INSTANCE = ("fcfs-prefill-first", "mlfq-prefill-first", "ssjf-prefill-first", "fcfs-mixed", "mlfq", "ssjf",
                "dwise-prefill-rank", "dwise-admission", "dwise", "oracle")
GRID = ("infaas/fcfs", "llumnix/fcfs", "remask/fcfs", "infaas/dwise", "llumnix/dwise", "remask/dwise",
        "remask-plan-walk/dwise")
GRID_QUICK = ("infaas/fcfs", "llumnix/fcfs", "remask/fcfs", "infaas/dwise", "remask/dwise", "remask-plan-walk/dwise")

FULL = Plan(
    name="full", inst_n=4096, inst_policies=ALL_INSTANCE, sweep_n=2048,
    load_mults=(0.25, 0.5, 0.75, 1.0, 2.0, 4.0), blocks=(8, 16, 32, 64), budgets=(256, 512, 1024, 2048),
    seeds=(0, 1, 2, 3, 4), seed_n=4096,
    cl_n=2000, cl_rates=(50.0, 65.0, 75.0, 85.0, 95.0, 110.0), cl_combos=GRID,
    slo_rate=75.0, slo_factors=(1.5, 2.0, 3.0, 5.0, 8.0), ablation_rate=110.0, ablation_all_thresholds=True,
    migration_rate=75.0, migration_tps=(4, 4, 2, 2, 1, 1, 1, 1),
    length_rate=75.0, lengths=((128, 4), (512, 4), (256, 2), (256, 8)),
    burst_n=2000, burst_rate=15.0, burst_tps=(1, 1, 1, 1), burst_frac=0.4,
    diurnal_n=4000, diurnal_rate=60.0, cl_seeds=(0, 1, 2, 3, 4), cl_seed_rate=110.0, max_replays=None,
    trace_n=6000, trace_statics=None, predictors=True)

QUICK = Plan(
    name="quick", inst_n=4096, inst_policies=ALL_INSTANCE, sweep_n=1024,
    load_mults=(0.5, 1.0, 2.0, 4.0), blocks=(16, 32, 64), budgets=(256, 1024, 2048),
    seeds=(0, 1, 2), seed_n=2048,
    cl_n=1000, cl_rates=(65.0, 85.0, 110.0), cl_combos=GRID_QUICK,
    slo_rate=75.0, slo_factors=(2.0, 3.0, 5.0), ablation_rate=110.0, ablation_all_thresholds=False,
    migration_rate=75.0, migration_tps=(4, 4, 2, 2, 1, 1, 1, 1),
    length_rate=75.0, lengths=((512, 4), (256, 8)),
    burst_n=1000, burst_rate=15.0, burst_tps=(1, 1, 1, 1), burst_frac=0.4,
    diurnal_n=1500, diurnal_rate=60.0, cl_seeds=(0, 1, 2, 3), cl_seed_rate=110.0, max_replays=80,
    trace_n=1500, trace_statics=((16, 0, 0), (0, 0, 4)), predictors=True)

TINY = Plan(
    name="tiny", inst_n=96,
    inst_policies=("fcfs-prefill-first", "fcfs-mixed", "dwise-prefill-rank", "dwise-admission", "dwise", "oracle"),
    sweep_n=64, load_mults=(1.0, 4.0), blocks=(16, 32), budgets=(256, 512), seeds=(0, 1), seed_n=64,
    cl_n=60, cl_rates=(40.0,), cl_combos=("infaas/fcfs", "remask/fcfs", "infaas/dwise", "remask/dwise"),
    slo_rate=40.0, slo_factors=(3.0,), ablation_rate=80.0, ablation_all_thresholds=False,
    migration_rate=40.0, migration_tps=(2, 1, 1), length_rate=40.0, lengths=((128, 4),),
    burst_n=60, burst_rate=10.0, burst_tps=(1, 1), burst_frac=0.4,
    diurnal_n=80, diurnal_rate=40.0, cl_seeds=(0, 1), cl_seed_rate=40.0, max_replays=4,
    trace_n=200, trace_statics=((16, 0, 0),), predictors=False)

PLANS = {p.name: p for p in (FULL, QUICK, TINY)}
