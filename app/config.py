"""The application's configuration: the ``args`` of serve_config.yaml, and the names of its deployments.

``AppConfig`` has five sections, each its own model:

- ``http``: what the Ingress's HTTP API accepts (API keys, priorities and rate limits, body size and
  deadline, token limits, the served model name, how many streams it holds and Serve's proxy queues);
- ``router``: the cluster router at the ingress (policy, candidate thresholds, step predictors, SLO
  default, latency profile, shedding, dead and parked instances);
- ``engine``: the model and the engine every Denoiser replica runs (device, dtype, instance policy,
  slots, approximate cache, KV pool, round-loop waits and health, the profile it measures at start);
- ``resources``: the Serve deployments (TP degrees, replicas per degree, CPUs and GPUs, drain time);
- ``planner``: the planner sizing the TP groups (``PlannerArgs``; absent: fixed replica counts).

``deployments.builder.build_app`` validates it once; the deployments receive the validated object
(pydantic models pickle through Ray). Unknown keys are refused everywhere; a key of the old flat
layout (``slots:`` at the top) is refused with the section it moved to.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from app.auth import ApiKeySpec
from engine.scheduler import SchedulerConfig

# ---- the deployments' names (the builder, the Denoisers' registration, the autoscaling policy, the fault
# harness and the tests read them here) -----------------------------------------------------------------
INGRESS = "Ingress"  # the Ingress deployment
DENOISER_PREFIX = "Denoiser_TP"  # one Denoiser deployment per TP degree: Denoiser_TP1, Denoiser_TP2, ...


def denoiser_name(tp: int) -> str:
    """The Denoiser deployment of TP degree ``tp``."""
    return f"{DENOISER_PREFIX}{int(tp)}"


def denoiser_tp(name: str) -> int | None:
    """The TP degree of a Denoiser deployment's name (``None`` for any other name)."""
    tail = name[len(DENOISER_PREFIX):] if name.startswith(DENOISER_PREFIX) else ""
    return int(tail) if tail.isdigit() else None


def tp_worker_name(replica_actor: str, rank: int) -> str:
    """The named Ray actor (namespace "serve") of rank ``rank`` >= 1 of the replica whose actor is
    ``replica_actor``."""
    return f"{replica_actor}:rank{rank}"


# ---- the sections --------------------------------------------------------------------------------------
class _Section(BaseModel):
    """A section of ``AppConfig``: unknown keys are refused, a key of another section says which."""

    model_config = ConfigDict(extra="forbid")
    section: ClassVar[str] = ""

    @model_validator(mode="before")
    @classmethod
    def _misplaced(cls, data):
        if isinstance(data, dict):
            wrong = {k: _SECTION_OF[k] for k in data if k not in cls.model_fields and k in _SECTION_OF
                     and _SECTION_OF[k] != cls.section}
            if wrong:
                raise ValueError("; ".join(f"`{k}` belongs in the `{s}` section, not `{cls.section}`"
                                           for k, s in wrong.items()))
        return data


class HttpArgs(_Section):
    """``http``: the Ingress's HTTP API."""

    section: ClassVar[str] = "http"
    served_model_name: str | None = Field(None, description="name clients use; defaults to `engine.model`")
    chat_template: str | None = Field(None, description="a Jinja chat template for every chat instead of the "
                                                        "checkpoint's own: the template, or a file holding it "
                                                        "(read here, at validation)")
    allowed_origins: list[str] = Field([], description="CORS: the origins browsers may call the API from ('*': "
                                                       "any); empty: no CORS headers (off)")
    max_model_len: int | None = Field(None, ge=1, description="the longest prompt + answer, in tokens (default and "
                                                              "cap: the model's context, max_position_embeddings)")
    api_keys: list[ApiKeySpec] = Field([], description="API keys (app.auth); when any are given, /v1/* and "
                                                        "/debug/* need `Authorization: Bearer <key>`")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="largest request body; larger ones get 413")
    max_tokens_limit: int = Field(1024, ge=1, description="largest max_tokens a request may ask for")
    trust_request_chat_template: bool = Field(False, description="accept a request's own `chat_template` (a "
                                                                 "Jinja template run, sandboxed, on this server: "
                                                                 "trusted clients only; else 400)")
    max_n: int = Field(4, ge=1, le=64, description="largest `n` (choices per prompt, each an independent request) "
                                                 "a request may ask for")
    default_max_tokens: int | None = Field(None, description="max_tokens when a request gives none")
    max_ongoing: int = Field(4096, ge=1, description="requests (streams) the Ingress holds at once; past it "
                                                     "Serve's proxy queues them")
    max_queued: int = Field(1024, ge=-1, description="requests Serve's proxy queues for the Ingress past "
                                                     "max_ongoing; past it the proxy answers 429 + Retry-After "
                                                     "itself, without reaching the Ingress (-1: no limit)")
    body_timeout_s: float = Field(30.0, gt=0, description="a request body must arrive within this long (from "
                                                          "the handler's start); later: 408")
    max_priority_without_key: int = Field(0, ge=0, description="with no api_keys, the highest `priority` a request "
                                                               "may ask for (above it: 403); keys set their own "
                                                               "`max_priority`")
    requests_per_second: float | None = Field(None, gt=0, description="request rate (token bucket) of each API key "
                                                                      "that sets none of its own, and with no "
                                                                      "api_keys of each client address; unset: "
                                                                      "no limit (429 + Retry-After past it)")
    request_burst: int | None = Field(None, ge=1, description="that bucket's size: requests at once after an idle "
                                                              "spell (default max(1, requests_per_second))")
    tokens_per_minute: int | None = Field(None, ge=1, description="prompt + max_tokens tokens per minute, counted "
                                                                  "at admission, as requests_per_second applies; "
                                                                  "unset: no limit")

    @field_validator("chat_template")
    @classmethod
    def _chat_template(cls, v: str | None) -> str | None:
        """A file's path becomes its text; a template is kept; anything else is refused."""
        if v is None or "{{" in v or "{%" in v:
            return v
        from pathlib import Path

        path = Path(v).expanduser()
        if not path.is_file():
            raise ValueError(f"chat_template {v!r} is neither a file nor a Jinja template (no {{{{ or {{%)")
        return path.read_text()

    @model_validator(mode="after")
    def _burst_needs_a_rate(self) -> HttpArgs:
        if self.request_burst is not None and self.requests_per_second is None:
            raise ValueError("request_burst is the size of the requests_per_second bucket: set requests_per_second")
        return self


class RouterArgs(_Section):
    """``router``: the cluster router and the dispatcher around it, at the ingress."""

    section: ClassVar[str] = "router"
    policy: str = Field("remask-fit", description="cluster router: remask-fit (remask, placing by SLO fit where "
                                                  "the instances mix TP degrees) | remask | fixed-threshold | "
                                                  "dynamic-no-load-control | infaas | llumnix")
    thresholds: list[float] = Field([0.9, 0.8, 0.7], description="candidate confidence thresholds the router "
                                                                  "chooses from per step (requests without their own)")
    predictors: Literal["auto", "shipped", "online", "off"] = Field(
        "auto", description="the step and admission predictors (cluster.learning): auto = the model's shipped ones "
                            "(and the refinement) as a start, learnt further from the traffic served, else learnt "
                            "from a cold start; shipped = shipped only, no learning; online = learnt from a cold "
                            "start, shipped ones ignored; off = no estimates (fixed thresholds, one round per "
                            "block). true/false mean auto/off")
    default_slo_ms: float = Field(60_000, gt=0, description="SLO of requests that give no slo_ms")
    profile: str | None = Field(None, description="latency profile (profiles/<name>.json) the router predicts "
                                                  "step times with; default cpu-<model> on CPU when measured, "
                                                  "else h200-llada8b-measured; unset, each replica's measured profile "
                                                  "replaces it for its TP degree")
    shed_over_capacity: bool = Field(True, description="429 for a new request when load control finds the "
                                                       "cluster over capacity even at the lowest thresholds")
    dead_after_s: float = Field(5.0, gt=0, description="an instance silent this long is declared dead and its "
                                                       "requests resume elsewhere")
    park_s: float = Field(30.0, ge=0, description="while no instance is up (starting, being replaced), requests "
                                                  "wait this long for one to join, then get 503 (0: at once)")

    @field_validator("thresholds")
    @classmethod
    def _thresholds(cls, v: list[float]) -> list[float]:
        if not v or any(not 0.0 < t <= 1.0 for t in v):
            raise ValueError("thresholds must be a non-empty list of values in (0, 1]")
        return sorted(set(v), reverse=True)

    @field_validator("predictors", mode="before")
    @classmethod
    def _predictors(cls, v):
        return {True: "auto", False: "off"}.get(v, v) if isinstance(v, bool) else v

    @field_validator("policy")
    @classmethod
    def _policy(cls, v: str) -> str:
        from cluster.policies import ROUTER_POLICIES

        ROUTER_POLICIES.make(v)  # raises with the known names
        return v


class EngineArgs(_Section):
    """``engine``: the model and the engine of every Denoiser replica (every rank of a TP group)."""

    section: ClassVar[str] = "engine"
    model: str = Field("tiny-bd", description="embedded model name, local HF-format checkpoint directory or hub "
                                              "id (org/name: engine.models.hub, through the hub cache)")
    revision: str | None = Field(None, description="a hub id's branch, tag or commit (default: main)")
    device: str = Field("cpu", description="'cpu' or 'cuda'")
    dtype: str | None = Field(None, description="float32 | bfloat16 | float16 (default: bfloat16 on cuda)")
    policy: str = Field("dwise", description="instance scheduling policy")
    slots: int = Field(32, ge=1, description="B: block slots per round")
    cache: str = Field("dual", description="approximate cache of full-sequence models: none | prefix | dual")
    max_waiting: int = Field(256, ge=1, description="waiting requests per instance before 429")
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
    cuda_graphs: bool = Field(True, description="on cuda, replay small rounds over the KV pool from CUDA graphs "
                                                "(engine/graphs.py; single-GPU instances); false: always eager")
    lookahead_blocks: int = Field(8, ge=0, description="with router.predictors auto or shipped, a block-causal "
                                                       "request whose first block does not end its answer "
                                                       "appends this many masked blocks to its second round to "
                                                       "read where it ends (refinement); 0: off")
    threshold_wait_ms: float = Field(2.0, ge=0, description="before a round, a replica waits up to this long (and "
                                                            "at most threshold_wait_frac of the last round) for "
                                                            "the ingress's thresholds answering the last round's "
                                                            "batch; 0: never waits")
    threshold_wait_frac: float = Field(0.1, ge=0, description="the wait's bound as a fraction of the last round's "
                                                              "time (threshold_wait_ms)")
    profile_seconds: float = Field(3.0, ge=0, description="each Denoiser replica measures its step-latency profile "
                                                          "for about this long at start and sends it to the "
                                                          "ingress with its registration; 0: off")
    round_timeout_s: float = Field(120.0, gt=0, description="a round running longer than this fails the "
                                                            "replica's health check (a hung rank): Serve "
                                                            "replaces it and its requests resume elsewhere")
    decoding: str | None = Field(None, description="the decoding rule every request uses unless it names its own "
                                                   "(engine/decoding/: threshold, low_confidence, joint_threshold, "
                                                   "entropy_bound, hierarchical, credit, ...); default: the "
                                                   "checkpoint's (its generation_config.json), else threshold")
    decoding_config: dict[str, Any] | None = Field(None, description="the rule's configuration (its fields, e.g. "
                                                                     "{edit_threshold: 0.9}); without decoding it "
                                                                     "configures the checkpoint's rule")

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str | None) -> str | None:
        if v not in (None, "float32", "bfloat16", "float16"):
            raise ValueError("dtype must be float32, bfloat16 or float16")
        return v

    @field_validator("cache")
    @classmethod
    def _cache(cls, v: str) -> str:
        if v not in ("none", "prefix", "dual"):
            raise ValueError("cache must be none, prefix or dual")
        return v

    @model_validator(mode="after")
    def _decoding(self):
        """A named rule and its config are checked here (an unknown rule, an unknown field, a value out of
        range); a config without a name configures the checkpoint's rule, checked as the engine starts."""
        if self.decoding is not None:
            from engine.commands import resolve_rule  # the rules import without torch

            resolve_rule(None, self.decoding, self.decoding_config, where="engine.")
        return self

    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype or ("bfloat16" if self.device.startswith("cuda") else "float32"))


class ResourceArgs(_Section):
    """``resources``: the Serve deployments: how many Denoiser replicas of which TP degrees, what each
    takes, and how long a stopping replica drains."""

    section: ClassVar[str] = "resources"
    tp_degrees: list[int] = Field([1], description="one Denoiser deployment per tensor-parallel degree")
    replicas: dict[int, int] = Field({}, description="replicas per TP degree (default 1 each; with the planner: "
                                                     "the initial counts)")
    cpus_per_replica: float = Field(0.5, gt=0, description="logical CPUs per Denoiser replica")
    gpus_per_rank: float = Field(0.0, ge=0, description="GPUs per TP rank (0 on CPU); below 1 a rank holds that "
                                                        "fraction of a GPU in Ray's accounting, so replicas can share "
                                                        "one: at 0.5 or less a new replica loads beside the one it "
                                                        "replaces (planner.make_before_break), and the KV pool's "
                                                        "default budget shrinks to that fraction (kv_pool_args)")
    drain_s: float = Field(20.0, ge=0, description="a stopping Denoiser (redeploy, scale-down) finishes its "
                                                   "requests for up to this long unless the ingress moves them "
                                                   "to another instance first; a stopping Ingress lets its "
                                                   "streams end for as long (both get 10 s more from Serve)")

    @field_validator("tp_degrees")
    @classmethod
    def _tp(cls, v: list[int]) -> list[int]:
        if not v or any(d < 1 or d & (d - 1) for d in v):
            raise ValueError("tp_degrees must be powers of two, e.g. [1, 2, 4]")
        return sorted(set(v))

    @field_validator("gpus_per_rank")
    @classmethod
    def _gpus(cls, v: float) -> float:
        if v >= 1 and v != int(v):  # Ray refuses a fractional demand of a GPU or more
            raise ValueError(f"gpus_per_rank {v:g}: a fraction of one GPU (below 1) or a whole number of GPUs")
        return v

    @property
    def gpu_share(self) -> float:
        """The fraction of a GPU each rank holds: ``gpus_per_rank`` below 1, else 1 (its GPUs, or none, to itself)."""
        return self.gpus_per_rank if 0 < self.gpus_per_rank < 1 else 1.0

    @property
    def shares_gpus(self) -> bool:
        """Two replicas' ranks fit on one GPU (``gpus_per_rank`` <= 0.5): a new one can load beside an old one."""
        return 0 < self.gpus_per_rank <= 0.5


class PlannerArgs(_Section):
    """``planner``: the cluster the planner sizes and how often it re-plans (``app.autoscaling``)."""

    section: ClassVar[str] = "planner"
    nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(8, ge=1, description="GPUs (or logical GPUs) per node")
    period_s: float = Field(300.0, gt=0, description="re-plan this often")
    window_s: float = Field(300.0, gt=0, description="arrival-rate window of the workload monitor")
    min_gain: float = Field(0.10, ge=0, description="act only when an objective improves this much")
    profile: str | None = Field(None, description="latency profile; default: the router's")
    check_s: float = Field(1.0, gt=0, description="how often the background thread looks")
    step_timeout_s: float = Field(180.0, gt=0, description="move to the next transition step after this long")
    min_requests: int = Field(50, ge=1, description="finished requests before a measured input (steps per token, "
                                                   "SLO scale) replaces its default")
    min_bucket: int = Field(10, ge=1, description="finished requests at a threshold before its steps per token is "
                                                 "measured (the others follow the measured ones)")
    finished_window: int = Field(2000, ge=1, description="finished requests the measured inputs are taken over")
    make_before_break: bool | None = Field(
        None, description="a transition starts its new replicas first and lowers the old counts once they serve "
                          "(the old replicas then drain into the new ones: no request waits for an instance); "
                          "needs replicas that fit beside the ones they replace (resources.gpus_per_rank <= 0.5, "
                          "or 0 on CPUs). Default: on when gpus_per_rank <= 0.5 (above 0), else off (the stops "
                          "that free a start's GPUs go first)")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


SECTIONS: dict[str, type[_Section]] = {"http": HttpArgs, "router": RouterArgs, "engine": EngineArgs,
                                       "resources": ResourceArgs, "planner": PlannerArgs}
# a key -> its section, for the keys that only one section has (``policy``, ``profile`` are in two)
_SECTION_OF: dict[str, str] = {}
for _name, _cls in SECTIONS.items():
    for _key in _cls.model_fields:
        _SECTION_OF[_key] = "" if _key in _SECTION_OF else _name
_SECTION_OF = {k: s for k, s in _SECTION_OF.items() if s}

# the flat layout's keys (before the sections) -> where each is now
MOVED: dict[str, str] = {
    **{k: f"http.{k}" for k in ("served_model_name", "api_keys", "max_body_bytes", "max_tokens_limit",
                                 "default_max_tokens")},
    "ingress_max_ongoing": "http.max_ongoing", "ingress_max_queued": "http.max_queued",
    "router_policy": "router.policy", "profile": "router.profile",
    **{k: f"router.{k}" for k in ("thresholds", "predictors", "default_slo_ms", "shed_over_capacity",
                                   "dead_after_s", "park_s")},
    **{k: f"engine.{k}" for k in ("model", "device", "dtype", "policy", "slots", "cache", "max_waiting",
                                   "kv_capacity_tokens", "kv_slot_tokens", "kv_memory_mb", "kv_memory_fraction",
                                   "cuda_graphs", "lookahead_blocks", "threshold_wait_ms", "threshold_wait_frac",
                                   "profile_seconds", "round_timeout_s")},
    **{k: f"resources.{k}" for k in ("tp_degrees", "replicas", "cpus_per_replica", "gpus_per_rank", "drain_s")},
}


class AppConfig(BaseModel):
    """The application's configuration (serve_config.yaml's ``args``), in sections."""

    model_config = ConfigDict(extra="forbid")

    http: HttpArgs = Field(default_factory=HttpArgs, description="the Ingress's HTTP API")
    router: RouterArgs = Field(default_factory=RouterArgs, description="the cluster router at the ingress")
    engine: EngineArgs = Field(default_factory=EngineArgs, description="the model and engine of every replica")
    resources: ResourceArgs = Field(default_factory=ResourceArgs, description="the Serve deployments")
    planner: PlannerArgs | None = Field(None, description="size the TP groups with the planner (app.autoscaling); "
                                                          "needs the app-level autoscaling_policy "
                                                          "app.autoscaling:planner_policy in the serve config")

    @model_validator(mode="before")
    @classmethod
    def _flat_keys(cls, data):
        """A key of the flat layout at the top: say where it moved (all of them at once)."""
        if isinstance(data, dict):
            moved = [k for k in data if k in MOVED]
            if moved:
                raise ValueError("the config is in sections now: " + "; ".join(
                    f"`{k}` moved to `{MOVED[k]}` (write it under `{MOVED[k].split('.')[0]}:`)" for k in moved))
        return data

    @model_validator(mode="after")
    def _device_and_gpus(self):
        """``engine.device`` and ``resources.gpus_per_rank`` agree: cuda needs GPUs per rank; cpu holds no whole
        GPU (a fraction below 1 stays allowed: Ray's accounting of replicas that share, as on a CPU test cluster
        with logical GPUs)."""
        cuda, gpus = self.engine.device.startswith("cuda"), self.resources.gpus_per_rank
        if cuda and gpus == 0:
            raise ValueError("engine.device cuda with resources.gpus_per_rank 0: Ray would give each rank no GPU "
                             "(set gpus_per_rank to 1, or a fraction to share GPUs)")
        if not cuda and gpus >= 1:
            raise ValueError(f"engine.device {self.engine.device} with resources.gpus_per_rank {gpus:g}: each rank "
                             f"would hold GPUs it never uses (set engine.device cuda, or gpus_per_rank 0)")
        return self

    @model_validator(mode="after")
    def _shared_gpus(self):
        """Resolve ``planner.make_before_break`` from the resources, and refuse GPU shares that cannot work."""
        res = self.resources
        if self.planner is not None:
            if self.planner.make_before_break is None:
                self.planner.make_before_break = res.shares_gpus
            elif self.planner.make_before_break and res.gpus_per_rank > 0.5:
                raise ValueError(f"planner.make_before_break needs replicas that fit beside the ones they replace: "
                                 f"resources.gpus_per_rank {res.gpus_per_rank:g} lets one replica's rank, not two, "
                                 f"on a GPU (set it to 0.5, or make_before_break false)")
        if res.shares_gpus and max(res.tp_degrees) > 1 and self.engine.device.startswith("cuda"):
            # Ray gives a fractional GPU demand the GPU it fits best (the fullest), so the ranks of one TP group
            # can land on one device, which NCCL refuses
            raise ValueError(f"resources.gpus_per_rank {res.gpus_per_rank:g} with TP degrees {res.tp_degrees} on "
                             f"cuda: Ray may place two ranks of a TP group on one GPU; share GPUs only with "
                             f"tp_degrees [1] (or use whole GPUs)")
        return self

    @property
    def name(self) -> str:
        """The model's name on the API."""
        return self.http.served_model_name or self.engine.model

    def profile_name(self) -> str:
        """The router's latency profile: ``router.profile``, else the model's measured CPU profile on a CPU,
        else h200-llada8b-measured."""
        from engine.latency_profile import PROFILES_DIR

        if self.router.profile:
            return self.router.profile
        model, device = self.engine.model, self.engine.device
        if not device.startswith("cuda") and (PROFILES_DIR / f"cpu-{model}.json").exists():
            return f"cpu-{model}"
        return "h200-llada8b-measured"


CPU_KV_MEMORY_MB = 1024  # the KV pool's budget on a CPU when the config gives none


def kv_pool_args(engine: EngineArgs, gpu_share: float = 1.0) -> dict:
    """The engine's KV pool sizing from the config's ``engine`` section: a budget in bytes (``kv_memory_mb``;
    1024 MiB on a CPU) or, on CUDA, ``kv_memory_fraction`` of the memory free after the weights are loaded;
    never more slots than the resident requests could take. ``gpu_share`` (``ResourceArgs.gpu_share``, below 1
    when replicas share GPUs): the default budgets shrink to it (``kv_memory_fraction`` x share of the free
    memory, so a replica loading beside another finds room; 1024 MiB x share on a CPU); an explicit
    ``kv_memory_mb`` is the operator's and is kept."""
    if not 0 < gpu_share <= 1:
        raise ValueError(f"gpu_share must be in (0, 1], got {gpu_share}")
    mb = engine.kv_memory_mb if engine.kv_memory_mb is not None else (
        None if engine.device.startswith("cuda") else CPU_KV_MEMORY_MB * gpu_share)
    return {"kv_memory_bytes": None if mb is None else int(mb * 2**20),
            "kv_memory_fraction": engine.kv_memory_fraction * gpu_share,
            "kv_residents_max": SchedulerConfig.resident_factor * engine.slots}  # k x B residents at most
