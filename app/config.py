"""The application's configuration: the ``args`` of serve_config.yaml."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from app.auth import ApiKeySpec
from app.autoscaling import PlannerArgs
from engine.scheduler import SchedulerConfig


class AppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field("tiny-bd", description="embedded model name or local HF-format checkpoint directory")
    served_model_name: str | None = Field(None, description="name clients use; defaults to `model`")
    tp_degrees: list[int] = Field([1], description="one Denoiser deployment per tensor-parallel degree")
    replicas: dict[int, int] = Field({}, description="replicas per TP degree (default 1 each)")
    device: str = Field("cpu", description="'cpu' or 'cuda'")
    dtype: str | None = Field(None, description="float32 | bfloat16 | float16 (default: bfloat16 on cuda)")
    slots: int = Field(32, ge=1, description="B: block slots per round")
    policy: str = Field("dwise", description="instance scheduling policy")
    kv_capacity_tokens: int | None = Field(None, ge=1, description="an explicit KV budget per instance, in tokens "
                                                                     "(default: exactly what the KV pool holds, "
                                                                     "sized by kv_memory_mb / kv_memory_fraction)")
    kv_slot_tokens: int | None = Field(None, ge=1, description="positions per slot of the engine's preallocated "
                                                               "KV pool (as many slots as the memory budget holds, "
                                                               "allocated at start; a longer request takes several "
                                                               "slots); default 512 + the default generation length")
    kv_memory_mb: float | None = Field(None, gt=0, description="KV pool budget per instance (per TP rank), in MiB; "
                                                               "default: kv_memory_fraction of the free device "
                                                               "memory on cuda, 1024 MiB on cpu. The scheduler "
                                                               "reserves KV against exactly what the pool holds "
                                                               "(unless kv_capacity_tokens is set)")
    kv_memory_fraction: float = Field(0.9, gt=0, le=1, description="on cuda without kv_memory_mb: the fraction of "
                                                                   "the device memory free after the weights are "
                                                                   "loaded that the KV pool takes")
    profile_seconds: float = Field(3.0, ge=0, description="each Denoiser replica measures its step-latency profile "
                                                          "for about this long at start and sends it to the "
                                                          "ingress with its registration; 0: off")
    threshold_wait_ms: float = Field(2.0, ge=0, description="before a round, a replica waits up to this long (and "
                                                            "at most threshold_wait_frac of the last round) for "
                                                            "the ingress's thresholds answering the last round's "
                                                            "batch; 0: never waits")
    threshold_wait_frac: float = Field(0.1, ge=0, description="the wait's bound as a fraction of the last round's "
                                                              "time (threshold_wait_ms)")
    cuda_graphs: bool = Field(True, description="on cuda, replay small rounds over the KV pool from CUDA graphs "
                                                "(engine/graphs.py; single-GPU instances); false: always eager")
    max_tokens_limit: int = Field(1024, ge=1, description="largest max_tokens a request may ask for")
    default_max_tokens: int | None = Field(None, description="max_tokens when a request gives none")
    max_waiting: int = Field(256, ge=1, description="waiting requests per instance before 429")
    predictors: Literal["auto", "shipped", "online", "off"] = Field(
        "auto", description="the step and admission predictors (cluster.learning): auto = the model's shipped ones "
                            "(and the refinement) as a start, learnt further from the traffic served, else learnt "
                            "from a cold start; shipped = shipped only, no learning; online = learnt from a cold "
                            "start, shipped ones ignored; off = no estimates (fixed thresholds, one round per "
                            "block). true/false mean auto/off")
    lookahead_blocks: int = Field(8, ge=0, description="with predictors, a block-causal request whose first "
                                                       "block does not end its answer appends this many masked "
                                                       "blocks to its second round to read where it ends "
                                                       "(refinement); 0: off")
    cache: str = Field("dual", description="approximate cache of full-sequence models: none | prefix | dual")
    router_policy: str = Field("remask", description="cluster router: remask | fixed-threshold | "
                                                     "dynamic-no-load-control | infaas | llumnix")
    thresholds: list[float] = Field([0.9, 0.8, 0.7], description="candidate confidence thresholds the router "
                                                                  "chooses from per step (requests without their own)")
    default_slo_ms: float = Field(60_000, gt=0, description="SLO of requests that give no slo_ms")
    profile: str | None = Field(None, description="latency profile (profiles/<name>.json) the router predicts "
                                                  "step times with; default cpu-<model> on CPU when measured, "
                                                  "else h200-llada8b")
    shed_over_capacity: bool = Field(True, description="429 for a new request when load control finds the "
                                                       "cluster over capacity even at the lowest thresholds")
    dead_after_s: float = Field(5.0, gt=0, description="an instance silent this long is declared dead and its "
                                                       "requests resume elsewhere")
    drain_s: float = Field(20.0, ge=0, description="a stopping Denoiser (redeploy, scale-down) finishes its "
                                                   "requests for up to this long unless the ingress moves them "
                                                   "to another instance first; a stopping Ingress lets its "
                                                   "streams end for as long (both get 10 s more from Serve)")
    ingress_max_ongoing: int = Field(4096, ge=1, description="requests (streams) the Ingress holds at once; "
                                                           "past it Serve's proxy queues them")
    ingress_max_queued: int = Field(-1, ge=-1, description="requests Serve's proxy queues for the Ingress past "
                                                          "ingress_max_ongoing; past it the proxy answers 429 "
                                                          "+ Retry-After itself, without reaching the Ingress "
                                                          "(-1: no limit)")
    park_s: float = Field(30.0, ge=0, description="while no instance is up (starting, being replaced), requests "
                                                  "wait this long for one to join, then get 503 (0: at once)")
    round_timeout_s: float = Field(120.0, gt=0, description="a round running longer than this fails the "
                                                            "replica's health check (a hung rank): Serve "
                                                            "replaces it and its requests resume elsewhere")
    planner: PlannerArgs | None = Field(None, description="size the TP groups with the planner (app.autoscaling); "
                                                          "needs the app-level autoscaling_policy "
                                                          "app.autoscaling:planner_policy in the serve config")
    cpus_per_replica: float = Field(0.5, gt=0, description="logical CPUs per Denoiser replica")
    gpus_per_rank: float = Field(0.0, ge=0, description="GPUs per TP rank (0 on CPU)")
    api_keys: list[ApiKeySpec] = Field([], description="API keys (app.auth); when any are given, /v1/* and "
                                                        "/debug/* need `Authorization: Bearer <key>`")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="largest request body; larger ones get 413")

    @field_validator("tp_degrees")
    @classmethod
    def _tp(cls, v: list[int]) -> list[int]:
        if not v or any(d < 1 or d & (d - 1) for d in v):
            raise ValueError("tp_degrees must be powers of two, e.g. [1, 2, 4]")
        return sorted(set(v))

    @field_validator("predictors", mode="before")
    @classmethod
    def _predictors(cls, v):
        return {True: "auto", False: "off"}.get(v, v) if isinstance(v, bool) else v

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str | None) -> str | None:
        if v not in (None, "float32", "bfloat16", "float16"):
            raise ValueError("dtype must be float32, bfloat16 or float16")
        return v

    @field_validator("thresholds")
    @classmethod
    def _thresholds(cls, v: list[float]) -> list[float]:
        if not v or any(not 0.0 < t <= 1.0 for t in v):
            raise ValueError("thresholds must be a non-empty list of values in (0, 1]")
        return sorted(set(v), reverse=True)

    @field_validator("router_policy")
    @classmethod
    def _policy(cls, v: str) -> str:
        from cluster.policies import ROUTER_POLICIES

        ROUTER_POLICIES.make(v)  # raises with the known names
        return v

    def profile_name(self) -> str:
        from engine.latency_profile import PROFILES_DIR

        if self.profile:
            return self.profile
        if not self.device.startswith("cuda") and (PROFILES_DIR / f"cpu-{self.model}.json").exists():
            return f"cpu-{self.model}"
        return "h200-llada8b"

    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype or ("bfloat16" if self.device.startswith("cuda") else "float32"))

    @property
    def name(self) -> str:
        return self.served_model_name or self.model


CPU_KV_MEMORY_MB = 1024  # the KV pool's budget on a CPU when the config gives none


def kv_pool_args(cfg: AppConfig) -> dict:
    """The engine's KV pool sizing from the config: a budget in bytes (``kv_memory_mb``; 1024 MiB on a CPU)
    or, on CUDA, ``kv_memory_fraction`` of the memory free after the weights are loaded; never more
    slots than the resident requests could take."""
    mb = cfg.kv_memory_mb if cfg.kv_memory_mb is not None else (
        None if cfg.device.startswith("cuda") else CPU_KV_MEMORY_MB)
    return {"kv_memory_bytes": None if mb is None else int(mb * 2**20), "kv_memory_fraction": cfg.kv_memory_fraction,
            "kv_residents_max": SchedulerConfig.resident_factor * cfg.slots}  # k x B residents at most


def kv_capacity_override(cfg: AppConfig) -> int | None:
    """``kv_capacity_tokens`` when the config sets it: the scheduler then
    reserves against that many tokens instead of the KV pool's real capacity."""
    return cfg.kv_capacity_tokens
