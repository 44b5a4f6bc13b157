"""The stateful planner: monitor -> periodic Stage 1 -> hysteresis -> Stage 2 (see planner/__init__).

Stage 1 is built from the monitor's classes and the inputs of ``planner.inputs``: the configured
step model, SLO scale and profiles until finished requests (``observe_finished``) and replicas'
profiles (``set_profile``) measure them."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from engine.latency_profile import LatencyProfile
from planner.costs import StepModel
from planner.inputs import FinishedRequest, Inputs, InputsConfig, MeasuredInputs
from planner.stage1 import CapacityPlan, Stage1Config, plan_capacity
from planner.stage1_mixed import single_degree_counts
from planner.stage2 import Cluster, Stage2Config, plan_transition
from planner.transition import Instance, TransitionPlan
from planner.workload import WorkloadClass, WorkloadMonitor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlannerConfig:
    period_s: float = 300.0  # re-plan every 5 minutes
    min_gain: float = 0.10  # act only when the primary or the secondary objective improves this much
    # the mixed-rounds Stage 1 (plans with ``slo_met``): a change is priced. It takes ``change_s`` (new
    # instances load while the old ones serve, ``overlap_slowdown`` times slower); it pays when the share
    # of the period's requests within SLO it gains, less what the overlap loses, is at least ``min_met_gain``
    min_met_gain: float = 0.02
    confirm_below: float = 0.0  # a change that gains less than this (net) waits until the next period proposes it too
    # what "proposes it too" means: "same", the same counts; "change", a change from the same running configuration
    # that pays (with many configurations to choose from, near-equal ones take turns as the proposal)
    confirm: str = "same"
    change_s: float = 0.0
    overlap_slowdown: float = 1.0
    secondary_floor: float = 0.05  # relative gains in slack are taken over max(|current slack|, floor)
    # the mixed-rounds Stage 1: weigh the loads the next period may bring instead of one. The window's mean load
    # times each of the last ``forecast_history`` period-to-period changes of that mean (once ``forecast_min``
    # are known): a configuration's share within SLO is its mean over them, so a mix that collapses if the
    # load rises as it has risen before pays for it in proportion
    forecast: bool = False
    forecast_history: int = 12
    forecast_min: int = 3
    stage1: Stage1Config = field(default_factory=Stage1Config)
    stage2: Stage2Config = field(default_factory=Stage2Config)
    steps: StepModel = field(default_factory=StepModel)  # the default until finished requests measure it
    inputs: InputsConfig = field(default_factory=InputsConfig)  # when measurements replace defaults

    def __post_init__(self) -> None:
        if self.confirm not in ("same", "change"):
            raise ValueError(f"confirm must be 'same' or 'change', got {self.confirm!r}")


@dataclass(frozen=True)
class Decision:
    act: bool
    reason: str
    proposal: CapacityPlan
    current: CapacityPlan  # the running configuration evaluated on the same workload
    gain_primary: float = 0.0
    gain_secondary: float = 0.0
    wanted: bool = False  # the change pays (``act``, unless it waits for confirmation)


class Planner:
    def __init__(self, cluster: Cluster, profiles: dict[int, LatencyProfile], config: PlannerConfig | None = None,
                 monitor: WorkloadMonitor | None = None, current: list[Instance] | None = None,
                 clock: Callable[[], float] = time.monotonic, profile_sources: dict[int, str] | None = None) -> None:
        """``profile_sources``: per degree "configured" (default) or "scaled" (TP-1's times scaled)."""
        self.cluster, self.profiles = cluster, dict(profiles)
        self.config = config or PlannerConfig()
        self.monitor = monitor or WorkloadMonitor()
        self.clock = clock
        grid = self.monitor.grid
        self.inputs = MeasuredInputs(self.config.steps, profiles, self.config.stage1.slo_scale,
                                     lambda i, o: grid.name(grid.classify(i, o)), self.config.inputs,
                                     profile_sources, batch=self.config.stage1.batches[0])
        smallest = min(profiles)  # default start: every GPU in a smallest-degree instance
        self.current = current if current is not None else [
            Instance(f"init-{n}-{k}", n, smallest) for n, g in enumerate(cluster.gpus_per_node)
            for k in range(g // smallest)]
        self._rates: list[WorkloadClass] | None = None
        self._last_mean: float | None = None  # the forecast's: the window's mean rate at the last re-plan
        self._changes: list[float] = []  # ... and the ratios of consecutive ones
        self._last = clock()
        self.last_decision: Decision | None = None

    # -- inputs -------------------------------------------------------------------------------
    def observe(self, input_tokens: int, output_tokens: int, now: float | None = None) -> None:
        """One request arrival (output_tokens: its output budget)."""
        self.monitor.record(self.clock() if now is None else now, input_tokens, output_tokens)

    def observe_finished(self, request: FinishedRequest) -> None:
        """One finished request (O(1)): measures steps per token and the SLO scale."""
        self.inputs.record(request)

    def set_profile(self, tp: int, profile: LatencyProfile) -> None:
        """A replica's measured latency profile for its TP degree."""
        self.inputs.set_profile(tp, profile)
        self.profiles = self.inputs.profiles()[0]

    def observe_rates(self, classes: list[WorkloadClass] | None) -> None:
        """Class rates measured elsewhere (e.g. replicas' metrics); they replace the monitor's. None: back to it."""
        self._rates = classes

    def set_current(self, instances: list[Instance]) -> None:
        """The placement actually running (after a transition was carried out, or partly)."""
        self.current = list(instances)

    def current_counts(self) -> dict[int, int]:
        c = Counter(i.tp for i in self.current)
        return {d: c.get(d, 0) for d in sorted(self.profiles)}

    # -- decisions ------------------------------------------------------------------------------
    def maybe_replan(self, now: float | None = None) -> TransitionPlan | None:
        """Once per period: a transition plan when the proposal is enough better, else None."""
        now = self.clock() if now is None else now
        if now - self._last < self.config.period_s:
            return None
        self._last = now
        classes, source = self.classes(now)
        if not classes:
            return None
        scenarios = self.forecast(now) if self.config.forecast and source == "measured" else None
        decision = self.decide(classes, scenarios=scenarios)
        self.last_decision = decision
        log.info("planner: %s (proposal %s, current %s)", decision.reason, decision.proposal.counts,
                 decision.current.counts)
        if not decision.act:
            return None
        plan = plan_transition(self.cluster, self.current, decision.proposal.counts, self.config.stage2)
        self.current = list(plan.final)
        return plan

    def forecast(self, now: float) -> list[tuple[float, list[WorkloadClass]]] | None:
        """The next period's loads, equally likely: the window's mean load times each recent period-to-period
        change of it (None until ``forecast_min`` changes are known). Called once per period."""
        cfg = self.config
        mean = self.monitor.classes_mean(now)
        total = sum(c.rate for c in mean)
        last, self._last_mean = self._last_mean, total
        if last and total:
            self._changes.append(total / last)
            del self._changes[:-cfg.forecast_history]
        if len(self._changes) < cfg.forecast_min or not total:
            return None
        k = 1.0 / len(self._changes)
        return [(k, [replace(c, rate=c.rate * r) for c in mean]) for r in self._changes]

    def classes(self, now: float | None = None) -> tuple[list[WorkloadClass], str]:
        """The workload the next plan sizes for, and its source ("configured": ``observe_rates``)."""
        if self._rates is not None:
            return self._rates, "configured"
        return self.monitor.classes(self.clock() if now is None else now), "measured"

    def describe_inputs(self, now: float | None = None) -> dict:
        """Every model-dependent input of the next plan: {name: {"value", "source", "requests", ...}}."""
        inp = self.inputs.snapshot()
        classes, src = self.classes(now)
        classes = inp.with_slos(classes)
        out = dict(inp.sources)
        out["classes"] = {"value": [{"name": c.name, "rate": round(c.rate, 4), "input_tokens": round(c.input_tokens, 1),
                                     "output_tokens": round(c.output_tokens, 1),
                                     "slo_ms": None if c.slo_ms is None else round(c.slo_ms, 1)} for c in classes],
                          "source": src, "requests": self.monitor.arrivals(),  # in the window (classes() evicted)
                          "grid": {"input_edges": list(self.monitor.grid.input_edges),
                                   "output_edges": list(self.monitor.grid.output_edges)}}
        return out

    def decide(self, classes: list[WorkloadClass], inputs: Inputs | None = None,
               scenarios: list[tuple[float, list[WorkloadClass]]] | None = None) -> Decision:
        """Stage 1 for the proposal and for the running configuration; ``inputs``: default the current ones;
        ``scenarios`` (the mixed-rounds model): (weight, classes) loads to weigh instead of ``classes`` alone."""
        cfg = self.config
        inp = inputs or self.inputs.snapshot()
        classes = inp.with_slos(classes)
        stage1 = cfg.stage1 if inp.slo_scale == cfg.stage1.slo_scale else replace(cfg.stage1, slo_scale=inp.slo_scale)
        slots = self.cluster.slots(inp.profiles)
        args = (classes, self.cluster.gpus, inp.profiles, inp.steps, stage1, slots)
        proposal = plan_capacity(*args)
        current = plan_capacity(*args, fixed_counts=self.current_counts())
        weighed = bool(scenarios) and proposal.slo_met is not None
        if weighed:
            scenarios = [(w, inp.with_slos(c)) for w, c in scenarios]
            proposal, current = self._weighed(proposal, current, scenarios, args)
            args = (scenarios,) + args[1:]
        same = {d: n for d, n in proposal.counts.items() if n} == {d: n for d, n in current.counts.items() if n}
        if same:
            return Decision(False, "proposal equals the running configuration", proposal, current)
        if not proposal.feasible:
            return Decision(True, "overloaded: no configuration meets SLO and stability; all TP-1", proposal, current)
        if not current.feasible and not weighed:
            return Decision(True, "the running configuration is unstable or misses SLOs", proposal, current)
        gp = (proposal.primary - current.primary) / max(abs(current.primary), 1e-9)
        gs = (proposal.secondary - current.secondary) / max(abs(current.secondary), cfg.secondary_floor)
        if proposal.slo_met is not None and current.slo_met is not None:
            return self._priced(proposal, current, gp, gs, args)
        act = gp >= cfg.min_gain or gs >= cfg.min_gain
        reason = f"gain primary {gp:+.1%}, secondary {gs:+.1%} ({'>=' if act else '<'} {cfg.min_gain:.0%})"
        return Decision(act, reason, proposal, current, gp, gs)

    def _priced(self, proposal: CapacityPlan, current: CapacityPlan, gp: float, gs: float, args) -> Decision:
        """The mixed-rounds model's decision: the share within SLO a change gains over the rest of the period
        against what the running instances lose while the new ones load beside them; with no loss of that
        share, a threshold or slack gain of ``min_gain`` acts too (low load: positions the mix for a rise)."""
        cfg = self.config
        span = max(cfg.period_s - cfg.change_s, 0.0)
        loss, during = 0.0, current.slo_met
        if cfg.change_s > 0 and cfg.overlap_slowdown != 1.0:
            load, gpus, profiles, steps, stage1, slots = args
            slow = {d: p.scaled(cfg.overlap_slowdown) for d, p in profiles.items()}
            loads = load if load and isinstance(load[0], tuple) else [(1.0, load)]  # scenarios, or one load
            during = sum(w * (plan_capacity(c, gpus, slow, steps, stage1, slots,
                                            fixed_counts=self.current_counts()).slo_met or 0.0) for w, c in loads)
            loss = max(current.slo_met - during, 0.0) * cfg.change_s
        net = ((proposal.slo_met - current.slo_met) * span - loss) / cfg.period_s
        act = net >= cfg.min_met_gain or (net >= 0 and (gp >= cfg.min_gain or (gp >= 0 and gs >= cfg.min_gain)))
        last = self.last_decision
        if cfg.confirm == "change":
            agreed = last is not None and last.wanted and last.current.counts == current.counts
        else:
            agreed = last is not None and last.proposal.counts == proposal.counts
        wait = act and net < cfg.confirm_below and not agreed
        reason = (f"within SLO {current.slo_met:.3f} -> {proposal.slo_met:.3f} ({during:.3f} during the change), "
                  f"net {net:+.3f} ({'>=' if net >= cfg.min_met_gain else '<'} {cfg.min_met_gain}); "
                  f"primary {gp:+.1%}, secondary {gs:+.1%}: "
                  f"{'wait for the next period to agree' if wait else 'act' if act else 'keep'}")
        return Decision(act and not wait, reason, proposal, current, gp, gs, wanted=act)

    def _weighed(self, proposal: CapacityPlan, current: CapacityPlan, scenarios,
                 args) -> tuple[CapacityPlan, CapacityPlan]:
        """The proposal and the running configuration with their share within SLO weighed over ``scenarios``;
        the proposal is the best of the point proposal, every single-degree configuration and the running
        one by that share (then by its thresholds at the point load), the running one on ties."""
        _, gpus, profiles, steps, stage1, slots = args
        running = self.current_counts()
        candidates = [running, dict(proposal.counts), *single_degree_counts(sorted(profiles), gpus, slots)]
        seen, scored = set(), []
        for counts in candidates:
            key = tuple(sorted((d, n) for d, n in counts.items() if n))
            if key in seen:
                continue
            seen.add(key)
            met = sum(w * (plan_capacity(c, gpus, profiles, steps, stage1, slots, fixed_counts=counts).slo_met or 0.0)
                      for w, c in scenarios)
            point = current if counts == running else plan_capacity(*args, fixed_counts=counts)
            scored.append((round(met, 4), point.primary if point.feasible else -1.0, counts == running, met, point))
        best = max(scored, key=lambda s: s[:3])
        now = next(s for s in scored if s[2])

        def weighed(s) -> CapacityPlan:  # a configuration infeasible at the point load has no slack there
            plan = s[4]
            return replace(plan, slo_met=s[3], feasible=True,
                           secondary=plan.secondary if plan.secondary is not None else -1.0)
        return weighed(best), weighed(now)
