"""The cluster router: threshold control, instance choice and migration.

Event-driven and pure Python; the live ingress and the cluster simulator
call the same methods:

- ``add_request(req, now)``: placement on arrival (policy; Alg. 3 for remask);
  the request gets its first estimate and a load-control cap.
- ``plan_thresholds(inst_id, reqs, now)``: the threshold of each request's
  next step on that instance (Alg. 1 within the caps, or the fixed one).
- ``on_step(inst_id, stepped, now)``: after an instance's round; the caller
  has already written each request's progress fields. An estimator with an
  ``observe`` hook learns from the round first; then it updates estimates,
  step kinds and loads, runs load control (Alg. 2) on its interval, and
  returns the migrations ``[(req, dst_inst_id)]`` the policy decided.
- ``finish(req)``: the request left the cluster; it leaves every structure here.

Memory follows the live requests only: a finished request leaves ``requests``,
the load-control order, its instance's set and the estimator's state in
``finish``, and a request's threshold history is kept as its count, sum and
last value (``ThresholdHistory``), not one entry per step.

The instance scheduler still orders work inside each instance: the router
decides where a request runs and which threshold its steps use, the
instance decides when each of its requests gets a slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cluster.capacity import cluster_capacity, step_rounds_ms
from cluster.estimator import StepEstimator
from cluster.latency import TpLatencyModel
from cluster.policies import RouterPolicy, make_router_policy
from cluster.state import InstanceState, RequestState
from cluster.thresholds import choose_threshold, load_control, request_load


@dataclass(frozen=True)
class RouterConfig:
    thresholds: tuple[float, ...] = (0.9, 0.8, 0.7, 0.6, 0.5)  # candidates
    fixed_threshold: float = 0.9  # of the fixed-threshold policies
    load_control_interval_s: float = 0.1  # Alg. 2 reruns at most this often (and caps arrivals in between)
    capacity_util: float = 1.0  # fraction of the cluster's throughput load control may commit
    capacity_slo: str = "mean"  # SLO window and slack of the capacity: mean or min over active requests (4.5)
    capacity_window: str = "remaining"  # the window: what is left of the SLOs ('remaining') or whole SLOs ('slo')
    migration_margin: float = 0.1  # a destination must be this much faster
    migration_ms: float = 2.0  # fixed cost of a migration (control call, request state transfer)
    migration_gbps: float = 10.0  # transfer bandwidth for the prompt and committed tokens
    estimate_every: int = 1  # step-estimator update granularity, in steps
    llumnix_gap: float = 0.25  # llumnix migrates when freeness differs by more than this fraction

    def __post_init__(self) -> None:
        if not self.thresholds or list(self.thresholds) != sorted(self.thresholds, reverse=True):
            raise ValueError("thresholds must be non-empty and listed highest first")
        if self.capacity_slo not in ("mean", "min"):
            raise ValueError("capacity_slo must be 'mean' or 'min'")
        if self.capacity_window not in ("remaining", "slo"):
            raise ValueError("capacity_window must be 'remaining' or 'slo'")


class Router:
    def __init__(self, policy: RouterPolicy | str, latency: TpLatencyModel, estimator: StepEstimator,
                 instances: Sequence[tuple[int, int]], cfg: RouterConfig | None = None) -> None:
        self.policy = make_router_policy(policy) if isinstance(policy, str) else policy
        self.latency, self.estimator = latency, estimator
        self.cfg = cfg or RouterConfig()
        if tuple(estimator.thresholds) != self.cfg.thresholds:
            raise ValueError("the step estimator must predict the router's candidate thresholds")
        self.instances = [InstanceState(i, tp) for i, tp in instances]
        self.by_id = {inst.inst_id: inst for inst in self.instances}
        self.requests: dict[str, RequestState] = {}
        # load-control order (priority, then arrival) of the live requests: an insertion-ordered set, so that
        # ``finish`` drops a request in O(1)
        self._order: dict[RequestState, None] = {}
        # what an arrival's priority is compared with (higher: the order is re-sorted at once): the latest
        # arrival since the last load-control run, even if it has finished since, else the order's tail at that
        # run; the tail the order had when finished requests stayed in it until a run, so that runs (and
        # the simulator's figures) are what they were
        self._tail: RequestState | None = None
        self._resort = False
        self._last_control = float("-inf")
        self._headroom = 0.0
        self._pos = {t: i for i, t in enumerate(self.cfg.thresholds)}
        self._fixed = self._index(self.cfg.fixed_threshold)
        self._ref_tp = 1 if 1 in latency.profiles else latency.degrees[0]
        self.cap = cluster_capacity(latency, self.instances, 5.0, 0.1)  # refreshed by each load-control run
        self.stats = {"migrations": 0, "load_control_runs": 0}
        self.now = 0.0  # s, the latest event's time (placements judge deadlines against it)

    def _index(self, threshold: float) -> int:
        i = self._pos.get(threshold)
        if i is None:
            ts = self.cfg.thresholds
            i = min(range(len(ts)), key=lambda k: abs(ts[k] - threshold))
        return i

    # ---- events -----------------------------------------------------------------------------
    def add_request(self, req: RequestState, now: float) -> int:
        if req.req_id in self.requests:
            raise ValueError(f"duplicate request id {req.req_id!r}")
        self.requests[req.req_id] = req
        self.now = now
        req.est = self.estimator.predict([req])[0]
        lat, tp = self.latency, self._ref_tp
        alone = req.heavy_left * lat.round_ms(tp, 1, 0) + req.light_left(0) * lat.round_ms(tp, 0, 1)
        req.slack = (req.deadline - req.arrival) * 1000.0 / max(alone, 1e-9)
        inst = self.policy.place(self, req)
        inst.add(req)
        if self._tail is not None and req.priority > self._tail.priority:
            self._resort = True  # it goes ahead of earlier, lower-priority arrivals: walk again
        self._order[req] = None
        self._tail = req
        self._control(now, arriving=req)
        return inst.inst_id

    def plan_thresholds(self, inst_id: int, reqs: Sequence[RequestState], now: float) -> list[float]:
        ts = self.cfg.thresholds
        if not self.policy.dynamic:
            t = ts[self._fixed]
            for r in reqs:
                r.threshold = t
            return [t] * len(reqs)
        inst = self.by_id[inst_id]
        lat, tp, nh, nl = self.latency, inst.tp, inst.n_heavy, inst.n_light
        # the instance's step latency with the request taking a cached step, and what a recompute step adds;
        # the instance's counts hold the request at its next step's kind
        now_ms = lat.round_ms(tp, nh, nl)
        if_heavy = (lat.round_ms(tp, nh - 1, nl + 1), now_ms) if nh else (now_ms, now_ms)
        if_light = (now_ms, lat.round_ms(tp, nh + 1, nl - 1)) if nl else (now_ms, now_ms)
        out = []
        capped = self.policy.load_control
        for r in reqs:
            light_ms, heavy_ms = if_heavy if r.next_heavy else if_light
            extra = heavy_ms - light_ms
            i = choose_threshold(r.est, r.cap if capped else 0, (r.deadline - now) * 1000.0, light_ms,
                                 r.heavy_left * (extra if extra > 0.0 else 0.0))
            r.threshold = ts[i]
            out.append(ts[i])
        return out

    def on_step(self, inst_id: int, stepped: Sequence[tuple[RequestState, bool, bool]],
                now: float) -> list[tuple[RequestState, int]]:
        """``stepped``: (request, next step is heavy, finished) for each request of the round."""
        inst = self.by_id[inst_id]
        self.now = now
        observe = getattr(self.estimator, "observe", None)
        if observe is not None:  # an estimator that learns from the steps (before they change the states here)
            observe(stepped)
        live = []
        refresh = []
        every = self.cfg.estimate_every
        for req, heavy, finished in stepped:
            if req.threshold is not None:
                req.thresholds_used.append(req.threshold)
            req.steps_done += 1
            if finished:
                self.finish(req)
                continue
            inst.set_kind(req, heavy)
            live.append(req)
            if every == 1 or req.steps_done % every == 0 or heavy:
                refresh.append(req)
            elif req.est and req.threshold is not None:  # count down: one step at t is est[k] / est[t] at k
                cur = req.est[self._index(req.threshold)]
                if cur > 1.0:
                    req.est = [e - e / cur if e > 1.0 else e for e in req.est]
        if refresh:
            for req, row in zip(refresh, self.estimator.predict(refresh)):
                req.est = row
        self._control(now)
        moves = self.policy.migrations(self, inst, live)
        return [(req, dst.inst_id) for req, dst in moves]

    def finish(self, req: RequestState) -> None:
        if self.requests.get(req.req_id) is not req:
            return  # not here (finished already, or another request under its id)
        del self.requests[req.req_id]
        self._order.pop(req, None)
        if req.instance is not None:
            self.by_id[req.instance].remove(req)
        forget = getattr(self.estimator, "forget", None)
        if forget is not None:
            forget(req.req_id)

    def admissible(self, req: RequestState, now: float, util: float = 1.0) -> bool:
        """Load control's test for an arrival (already added) against the SLOs, at the lowest threshold.

        A request's steps run one a round, so it needs at least its serial time: its remaining steps, each
        at the latency of a round as full as the instances are now (up to the SLO batch), recompute steps
        among the others in their share of the active requests' remaining steps (``step_rounds_ms``: a
        recompute step of its own is one among mostly cached ones, not a round of them). Meanwhile the
        cluster serves the work that goes before it at its throughput, the request's own rounds among it:
        instances serve the shortest remaining work first (DWISE), so that is the work of the active
        requests no longer than it (priority at least its own), and the arrival goes before every longer
        one. A request finishes in time when its serial time, and the work before it plus its own at the
        cluster's throughput, both fit before its deadline. The arrival is admitted when (1) it finishes in
        time, and (2) no longer request that would finish in time misses once this one goes first (a
        request already past hope does not block arrivals). Without (2) a stream of short arrivals, each
        admissible alone, starves the long requests. ``util`` scales the throughput the test trusts (the
        live ingress lowers it while admitted requests miss their SLOs: whatever the profile does not
        know, such as a saturated HTTP path)."""
        cap, last = self.cap, len(self.cfg.thresholds) - 1
        util *= self.cfg.capacity_util
        hc, lc = cap.heavy_cost, cap.light_cost
        # remaining recompute and cached steps at the lowest threshold of every active request; the others'
        # that go before or after the arrival
        heavy = light = 0.0
        rest = []
        for r in self.requests.values():
            if r.est:
                h, k = r.heavy_left, r.light_left(last)
                heavy += h
                light += k
                if r is not req and r.priority >= req.priority:
                    rest.append((h, k, r.deadline))
        # its rounds hold about as many requests as an instance has now (the SLO batch at most), recompute steps
        # in the share they have in the active requests' remaining steps (a burst of arrivals, all at their
        # first, recompute step, does not make every future round one of recompute steps)
        per_instance = len(self.requests) / max(len(self.instances), 1)
        batch = min(max(round(per_instance), 1), cap.batch)
        heavy_ms, light_ms = step_rounds_ms(self.latency, self._ref_tp, batch,
                                            heavy / (heavy + light) if heavy + light > 0.0 else 0.0)
        # work; its steps, one round each
        own, own_serial = ((req.heavy_left * hc + req.light_left(last) * lc,
                            req.heavy_left * heavy_ms + req.light_left(last) * light_ms) if req.est else (0.0, 0.0))
        others = sorted((h * hc + k * lc, h * heavy_ms + k * light_ms, d) for h, k, d in rest)
        before_own = 0.0  # work that goes before the arrival
        before = 0.0  # work that goes before the request being looked at
        for load, serial, deadline in others:
            if load <= own:
                before_own += load
            else:  # a longer request: would the arrival, going before it, make it miss?
                window = (deadline - now) * 1000.0
                budget = cap.within(window, util)
                if serial <= window and before + load <= budget < before + load + own:
                    return False
            before += load
        window = (req.deadline - now) * 1000.0
        # its own serial time is refused only when it misses even with its estimate one typical error too
        # high (the estimator's measured arrival_error): a point estimate refused requests that then met
        # their SLOs (dilaserve-bench at 85 req/s: 205 shed and 99.8% of the admitted met, table estimates)
        err = min(float(getattr(self.estimator, "arrival_error", 0.0) or 0.0), 1.0)
        return own_serial / (1.0 + err) <= window and before_own + own <= cap.within(window, util)

    def reject(self, req: RequestState) -> None:
        """Undo ``add_request`` for a request shed on arrival: it leaves, and its load at the lowest
        threshold (what the arrival took from the headroom) goes back."""
        if self.policy.load_control and req.est:
            self._headroom += request_load(req, len(self.cfg.thresholds) - 1, self.cap.heavy_cost,
                                           self.cap.light_cost)
        self.finish(req)

    # ---- a changing cluster (the live ingress: replicas join, die and are replaced) -----------
    def add_instance(self, inst_id: int, tp: int) -> InstanceState:
        if inst_id in self.by_id:
            raise ValueError(f"duplicate instance id {inst_id}")
        if tp not in self.latency.profiles:
            raise ValueError(f"no latency profile for TP-{tp}; profiled degrees: {self.latency.degrees}")
        inst = InstanceState(inst_id, tp)
        self.instances.append(inst)
        self.by_id[inst_id] = inst
        self.cap = cluster_capacity(self.latency, self.instances, 5.0, 0.1)
        return inst

    def remove_instance(self, inst_id: int) -> list[RequestState]:
        """Drop an instance; its requests (still active here, unplaced) are returned for ``place``."""
        inst = self.by_id.pop(inst_id)
        self.instances.remove(inst)
        orphans = [self.requests[r] for r in inst.requests if r in self.requests]
        for req in orphans:
            inst.remove(req)
            if req.full_sequence:  # wherever it goes, it rebuilds its KV first
                req.next_heavy = True
            req.migrations += 1
        self.cap = cluster_capacity(self.latency, self.instances, 5.0, 0.1)
        return orphans

    def place(self, req: RequestState, exclude: int | None = None, now: float | None = None) -> int | None:
        """Place an active request again (its instance died or refused it); None: nowhere to go. ``now``: the
        time (SLO-fit placement judges the deadline against it; default the latest event's)."""
        if now is not None:
            self.now = now
        if req.instance is not None:
            self.by_id[req.instance].remove(req)
        candidates = [i for i in self.instances if i.inst_id != exclude]
        if not candidates:
            return None
        saved, self.instances = self.instances, candidates
        try:
            inst = self.policy.place(self, req)
        finally:
            self.instances = saved
        inst.add(req)
        return inst.inst_id

    # ---- helpers for policies -----------------------------------------------------------------
    def move(self, req: RequestState, src: InstanceState, dst: InstanceState) -> None:
        """Account ``req`` to ``dst``. No KV travels: a full-sequence request moved at a cached
        step recomputes on arrival."""
        src.remove(req)
        if req.full_sequence:
            req.next_heavy = True
        dst.add(req)
        req.migrations += 1
        self.stats["migrations"] += 1

    def migration_cost_ms(self, req: RequestState) -> float:
        """Prompt and committed tokens (4 bytes each) over the link, plus the fixed cost."""
        return self.cfg.migration_ms + req.tokens * 4 / (self.cfg.migration_gbps * 1e6)

    def remaining_steps(self, req: RequestState) -> float:
        """Predicted remaining steps at the request's current threshold (the instance scheduler's estimate)."""
        t = req.threshold if req.threshold is not None else self.cfg.thresholds[self._fixed]
        return req.est[self._index(t)] if req.est else 0.0

    def capacity(self, now: float) -> float:
        """Load (TP-1 instance-ms) the cluster can serve within the SLO window; refreshes ``self.cap``.

        The window is the mean (or min) of what is left of the active requests' SLOs: the remaining
        work must fit the time left for it. (Whole SLOs, ``capacity_window='slo'``, the paper's
        wording, admit about twice the backlog: requests are on average half-way through.)"""
        reqs = list(self.requests.values())
        if not reqs:
            return 0.0
        if self.cfg.capacity_window == "slo":
            slos = [r.deadline - r.arrival for r in reqs]
        else:
            slos = [r.deadline - now for r in reqs]
            slos = [x if x > 0.0 else 0.0 for x in slos]
        slacks = [r.slack for r in reqs]
        if self.cfg.capacity_slo == "min":
            window_s, slack = min(slos), min(slacks)
        else:
            window_s, slack = sum(slos) / len(slos), sum(slacks) / len(slacks)
        n = sum(inst.n for inst in self.instances)
        share = sum(inst.n_heavy for inst in self.instances) / n if n else 0.1
        self.cap = cluster_capacity(self.latency, self.instances, slack, share)
        return self.cap.within(1000.0 * window_s, self.cfg.capacity_util)

    def _control(self, now: float, arriving: RequestState | None = None) -> None:
        if not self.policy.load_control:
            return
        if now - self._last_control >= self.cfg.load_control_interval_s or self._resort:
            if self._resort:
                self._order = dict.fromkeys(sorted(self._order, key=lambda r: (-r.priority, r.arrival)))
                self._resort = False
            order = list(self._order)
            self._tail = order[-1] if order else None
            capacity = self.capacity(now)
            self._headroom = load_control(order, capacity, self.cap.heavy_cost, self.cap.light_cost)
            self._last_control = now
            self.stats["load_control_runs"] += 1
        elif arriving is not None:  # it is last in the order: the walk's next step, against the headroom left
            last = len(self.cfg.thresholds) - 1
            low = request_load(arriving, last, self.cap.heavy_cost, self.cap.light_cost)
            self._headroom -= low
            arriving.cap = last
            for i in range(last):
                extra = request_load(arriving, i, self.cap.heavy_cost, self.cap.light_cost) - low
                if extra <= self._headroom:
                    arriving.cap = i
                    self._headroom -= extra
                    break
