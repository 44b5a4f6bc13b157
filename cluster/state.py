"""The router's view of requests and instances (pure Python)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field


class ThresholdHistory:
    """The thresholds of a request's steps, in constant memory: what its readers use of the history.

    Appended once per step, the history would grow with every step a request takes; its readers want
    the mean (the ingress's done event) and the last value (the current threshold: the cluster view,
    the step estimators), so it keeps the count, the sum (added in step order: ``mean`` is exactly the
    mean of the full history in step order), the last value, and how often each distinct threshold was
    used (a handful: the router's candidates and a client's fixed one). It answers ``len``, truthiness,
    ``h[-1]`` (the last step's only) and iteration (the values with their multiplicities, grouped by
    value, not in step order: ``sum(h) / len(h)`` may differ from ``h.mean`` in the last bits)."""

    __slots__ = ("count", "total", "last", "_uses")

    def __init__(self, values: Iterable[float] = ()) -> None:
        self.count = 0
        self.total = 0  # the sum in step order, as ``sum(list)`` adds
        self.last: float | None = None
        self._uses: dict[float, int] = {}
        self.extend(values)

    def append(self, threshold: float) -> None:
        self.count += 1
        self.total += threshold
        self.last = threshold
        self._uses[threshold] = self._uses.get(threshold, 0) + 1

    def extend(self, values: Iterable[float]) -> None:
        for t in values:
            self.append(t)

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None

    def uses(self) -> dict[float, int]:
        """Steps per threshold."""
        return dict(self._uses)

    def __len__(self) -> int:
        return self.count

    def __bool__(self) -> bool:
        return self.count > 0

    def __getitem__(self, i: int) -> float:
        if self.count and i in (-1, self.count - 1):
            return self.last  # type: ignore[return-value]
        raise IndexError("a threshold history keeps only its last value")

    def __iter__(self) -> Iterator[float]:
        for t, n in self._uses.items():
            for _ in range(n):
                yield t

    def __repr__(self) -> str:
        return f"ThresholdHistory(count={self.count}, mean={self.mean}, last={self.last})"


@dataclass(eq=False)
class RequestState:
    """What the router keeps of one request: enough to resume it anywhere.

    Progress fields are set from the instance's step events; ``est`` holds the
    step estimator's latest prediction of remaining steps, one per candidate
    threshold of the router's config (same order), and ``allowed`` the
    thresholds load control (Alg. 2) left to it, highest first.
    """

    req_id: str
    arrival: float  # s
    deadline: float  # s, absolute (heterogeneous SLOs: any value per request)
    prompt_tokens: int
    output_tokens: int  # output canvas length
    block_tokens: int = 32
    priority: int = 0  # higher goes first in load control
    full_sequence: bool = True  # approximate cache: each block starts with a recompute step
    instance: int | None = None
    # progress (from step events)
    steps_done: int = 0
    progress: float = 0.0  # fraction of the output committed
    block_progress: float = 0.0  # fraction of the current block committed
    blocks_left: int = 0  # output blocks not yet finished (the current one included)
    step_in_block: int = 0
    next_heavy: bool = True  # the next step is a recompute (full_sequence) or prefill step
    conf_stats: tuple[float, ...] = ()  # min, q25, median, mean, q75 of the last step's confidences
    thresholds_used: ThresholdHistory = field(default_factory=ThresholdHistory)  # one entry per step taken
    # router scratch
    est: list[float] = field(default_factory=list)  # predicted remaining steps per candidate threshold
    cap: int = 0  # index of the highest allowed candidate threshold (candidates run highest first)
    slack: float = 5.0  # SLO over the predicted isolated TP-1 latency at the highest threshold (set on arrival)
    threshold: float | None = None  # last chosen
    migrations: int = 0
    # the cluster driver's (cluster/driver.py)
    fixed_threshold: float | None = None  # the client's own threshold: the router never changes it
    # the request's decoding rule (engine.decoding.RULES): the router's threshold is its candidate level, which
    # the rule turns into its own knob (cluster.thresholds.knob_for); steps are estimated for that knob
    decoding: str = "threshold"
    # whether its text is held to a grammar (predictors.features.constraint_value of its SamplingParams.constraint:
    # 0 free, 1 constrained): a step-model column, as its rule is (a grammar changes the steps per token)
    constrained: float = 0.0
    # a canvas request's own step cap (its decoding_config's max_denoising_steps; None: the replicas' rule's):
    # CanvasStepEstimator's prior for it and the bound on its steps per canvas
    step_cap: int | None = None
    attempt: int = 0  # placements so far: progress or arrivals of an older attempt are stale
    counted: bool = True  # its SLO counts in the admission governor's attainment (the client set it)
    epoch: int = -1  # the governor's epoch it was admitted in (-1: not counted)
    shed: bool = False  # refused on arrival
    extra: dict = field(default_factory=dict)  # owner's data (the simulator's truth, say); never read here

    def __post_init__(self) -> None:
        if not isinstance(self.thresholds_used, ThresholdHistory):
            self.thresholds_used = ThresholdHistory(self.thresholds_used)
        if not self.blocks_left:
            self.blocks_left = max(1, -(-self.output_tokens // self.block_tokens))

    @property
    def heavy_left(self) -> int:
        """Remaining heavy steps. Full-sequence models (approximate cache): one recompute step per
        unfinished block, less the current block's if it ran. Exact-cache (block-causal) models: the
        prefill steps, one per prompt block (an instance prefills a block per round), while they are
        pending (a resumed request, whose steps count, is charged one)."""
        if not self.full_sequence:
            return max(-(-self.prompt_tokens // self.block_tokens) - self.steps_done, 1) if self.next_heavy else 0
        return self.blocks_left - (0 if self.next_heavy else 1)

    def light_left(self, i: int) -> float:
        """Remaining cached (or denoise) steps at candidate ``i``. ``est`` counts denoising steps: a
        recompute step is one of them (it denoises too), a prefill step comes on top (it does not)."""
        light = self.est[i] - self.heavy_left if self.full_sequence else self.est[i]
        return light if light > 0.0 else 0.0

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


@dataclass(eq=False)
class InstanceState:
    """One model instance as the router sees it."""

    inst_id: int
    tp: int
    n_heavy: int = 0  # requests whose next step is a recompute / prefill step
    n_light: int = 0  # requests whose next step is a cached / denoise step
    tokens: int = 0  # prompt + output tokens of its requests (INFaaS's load)
    kv_capacity_tokens: int = 250_000
    # its requests' ids in the order they came (a dict, not a set: a set's order follows the strings' hashes,
    # which change with every process, and the order reaches the threshold plan and the evacuations)
    requests: dict[str, None] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return self.n_heavy + self.n_light

    def add(self, req: RequestState) -> None:
        self.requests[req.req_id] = None
        self.tokens += req.tokens
        if req.next_heavy:
            self.n_heavy += 1
        else:
            self.n_light += 1
        req.instance = self.inst_id

    def remove(self, req: RequestState) -> None:
        self.requests.pop(req.req_id, None)
        self.tokens -= req.tokens
        if req.next_heavy:
            self.n_heavy -= 1
        else:
            self.n_light -= 1
        req.instance = None

    def set_kind(self, req: RequestState, heavy: bool) -> None:
        """``req`` (on this instance) changes its next step kind."""
        if heavy != req.next_heavy:
            d = 1 if heavy else -1
            self.n_heavy += d
            self.n_light -= d
            req.next_heavy = heavy

    def freeness(self) -> float:
        """Llumnix's freeness: free KV tokens per batched request."""
        return (self.kv_capacity_tokens - self.tokens) / max(self.n, 1)
