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
    # cluster level (16 GPUs, B = 32, LLaDA-8B-shaped requests). Rates are loads: multiples of the cluster's
    # capacity at the top candidate threshold for the run's mix and instances (sim.cluster_scenarios.
    # scenario_capacity), so they move with the latency profile
    cl_n: int  # requests per cluster run
    cl_loads: tuple[float, ...]
    cl_combos: tuple[str, ...]  # router/instance pairs of the load sweep
    slo_load: float  # of the capacity at the default SLO (5x); every SLO factor runs at that rate
    slo_factors: tuple[float, ...]
    ablation_load: float
    ablation_all_thresholds: bool
    migration_load: float  # of the migration cluster's own capacity
    migration_tps: tuple[int, ...]
    length_load: float  # each length at this load of its own capacity
    lengths: tuple[tuple[int, int], ...]  # (output tokens, prompt tokens per character)
    burst_n: int  # cluster burst+Poisson requests: burst_frac at t = 0, the rest Poisson at burst_load
    burst_load: float
    burst_tps: tuple[int, ...]
    burst_frac: float
    diurnal_n: int
    diurnal_load: float  # mean
    cl_seeds: tuple[int, ...]
    cl_seed_load: float
    # the headline: `remask simulate --scenario dilaserve-bench --policies infaas,llumnix,remask --load X` at
    # each load, on the default profile and on each of headline_profiles beside it
    headline_n: int
    headline_loads: tuple[float, ...]
    headline_profiles: tuple[str, ...]
    max_replays: int | None  # per run; None: every mixed-threshold answer is replayed
    trace_n: int
    trace_statics: tuple[tuple[int, int, int], ...] | None  # None: the scenario's own list
    predictors: bool


ALL_INSTANCE = ("fcfs-prefill-first", "mlfq-prefill-first", "ssjf-prefill-first", "fcfs-mixed", "mlfq", "ssjf",
                "dwise-prefill-rank", "dwise-admission", "dwise", "oracle")
GRID = ("infaas/fcfs", "llumnix/fcfs", "remask/fcfs", "infaas/dwise", "llumnix/dwise", "remask/dwise",
        "remask-plan-walk/dwise")
GRID_QUICK = ("infaas/fcfs", "llumnix/fcfs", "remask/fcfs", "infaas/dwise", "remask/dwise", "remask-plan-walk/dwise")

# the papers' "high request rate": where the fixed-threshold baselines attain about half (INFaaS 0.483 on
# h200-llada8b-measured, 0.495 on the hand table: `remask simulate --scenario dilaserve-bench --policies infaas
# --load 1.1 [--profile ...]`)
HIGH = 1.1
HEADLINE = (1.1, 1.3)  # the headline's loads: the baselines at about half, and 1.3
HAND = "tests/profiles/h200-llada8b-hand.json"  # the earlier H200 table, beside the default profile

FULL = Plan(
    name="full", inst_n=4096, inst_policies=ALL_INSTANCE, sweep_n=2048,
    load_mults=(0.25, 0.5, 0.75, 1.0, 2.0, 4.0), blocks=(8, 16, 32, 64), budgets=(256, 512, 1024, 2048),
    seeds=(0, 1, 2, 3, 4), seed_n=4096,
    cl_n=2000, cl_loads=(0.6, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.5), cl_combos=GRID,
    slo_load=1.0, slo_factors=(1.5, 2.0, 3.0, 5.0, 8.0), ablation_load=HIGH, ablation_all_thresholds=True,
    migration_load=1.0, migration_tps=(4, 4, 2, 2, 1, 1, 1, 1),
    length_load=1.0, lengths=((128, 4), (512, 4), (256, 2), (256, 8)),
    burst_n=2000, burst_load=0.8, burst_tps=(1, 1, 1, 1), burst_frac=0.4,
    diurnal_n=4000, diurnal_load=0.8, cl_seeds=(0, 1, 2, 3, 4), cl_seed_load=HIGH,
    headline_n=2000, headline_loads=HEADLINE, headline_profiles=(HAND,), max_replays=None,
    trace_n=6000, trace_statics=None, predictors=True)

QUICK = Plan(
    name="quick", inst_n=4096, inst_policies=ALL_INSTANCE, sweep_n=1024,
    load_mults=(0.5, 1.0, 2.0, 4.0), blocks=(16, 32, 64), budgets=(256, 1024, 2048),
    seeds=(0, 1, 2), seed_n=2048,
    cl_n=1000, cl_loads=(0.9, HIGH, 1.3), cl_combos=GRID_QUICK,
    slo_load=1.0, slo_factors=(2.0, 3.0, 5.0), ablation_load=HIGH, ablation_all_thresholds=False,
    migration_load=1.0, migration_tps=(4, 4, 2, 2, 1, 1, 1, 1),
    length_load=1.0, lengths=((512, 4), (256, 8)),
    burst_n=1000, burst_load=0.8, burst_tps=(1, 1, 1, 1), burst_frac=0.4,
    diurnal_n=1500, diurnal_load=0.8, cl_seeds=(0, 1, 2, 3), cl_seed_load=HIGH,
    headline_n=2000, headline_loads=HEADLINE, headline_profiles=(HAND,), max_replays=80,
    trace_n=1500, trace_statics=((16, 0, 0), (0, 0, 4)), predictors=True)

TINY = Plan(
    name="tiny", inst_n=96,
    inst_policies=("fcfs-prefill-first", "fcfs-mixed", "dwise-prefill-rank", "dwise-admission", "dwise", "oracle"),
    sweep_n=64, load_mults=(1.0, 4.0), blocks=(16, 32), budgets=(256, 512), seeds=(0, 1), seed_n=64,
    cl_n=60, cl_loads=(1.0,), cl_combos=("infaas/fcfs", "remask/fcfs", "infaas/dwise", "remask/dwise"),
    slo_load=1.0, slo_factors=(3.0,), ablation_load=2.0, ablation_all_thresholds=False,
    migration_load=1.0, migration_tps=(2, 1, 1), length_load=1.0, lengths=((128, 4),),
    burst_n=60, burst_load=1.0, burst_tps=(1, 1), burst_frac=0.4,
    diurnal_n=80, diurnal_load=1.0, cl_seeds=(0, 1), cl_seed_load=1.0,
    headline_n=60, headline_loads=(1.3,), headline_profiles=(HAND,), max_replays=4,
    trace_n=200, trace_statics=((16, 0, 0),), predictors=False)

PLANS = {p.name: p for p in (FULL, QUICK, TINY)}
