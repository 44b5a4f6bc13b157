"""Router policies, chosen by name: the real one and its baselines as siblings.

A policy answers three questions: where an arriving request goes
(``place``), which threshold a request's next step uses (``dynamic``:
Alg. 1, else the fixed threshold; ``load_control``: Alg. 2 caps), and whether
a request that just finished a step moves (``migrations``).

- ``remask``: Alg. 1 + Alg. 2 + Alg. 3 (lowest-latency instance, free migration
  at recompute steps when it pays off; a round's requests are considered for
  migration in load control's order, higher priority then oldest first,
  whatever order the instance scheduler ranked them in).
- ``dynamic-no-load-control``: Alg. 1 + Alg. 3, no caps (ablation).
- ``fixed-threshold``: the fixed threshold (0.9) with remask's routing (ablation).
- ``infaas``: arrival to the worker with the fewest outstanding tokens, no
  migration, fixed threshold (INFaaS's least-loaded dispatch).
- ``llumnix``: arrival to the freest instance (free KV per batched request);
  after a step the busiest instance hands a request to the freest one when
  their freeness differs by more than ``llumnix_gap`` (load-balancing
  migration at any step: when the next step would have been a cached step,
  the target recomputes), fixed threshold.

A policy sees the router through ``RouterView``: the members it reads (the latency model, the serving
instances, the router's settings, the latest event's time) and the two it calls (``move``,
``migration_cost_ms``). ``cluster.router.Router`` has them; a policy never imports the router.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from cluster.latency import TpLatencyModel
from cluster.placement import best_instance, can_migrate_free, fit_instance, migration_gain_ms
from cluster.state import InstanceState, RequestState
from engine.registry import Registry


class PolicySettings(Protocol):
    """The router's settings a policy reads (``cluster.router.RouterConfig`` has them)."""

    @property
    def thresholds(self) -> tuple[float, ...]: ...  # the candidates, highest first
    @property
    def migration_margin(self) -> float: ...
    @property
    def llumnix_gap(self) -> float: ...


class RouterView(Protocol):
    """What a policy sees of the router: exactly the members it uses."""

    @property
    def latency(self) -> TpLatencyModel: ...
    @property
    def instances(self) -> Sequence[InstanceState]: ...  # the serving ones (a placement's candidates)
    @property
    def cfg(self) -> PolicySettings: ...
    @property
    def now(self) -> float: ...  # s, the latest event's time

    def move(self, req: RequestState, src: InstanceState, dst: InstanceState) -> None:
        """Account ``req`` to ``dst`` at once, so that the policy's next decisions see the new loads."""

    def migration_cost_ms(self, req: RequestState) -> float:
        """What moving ``req`` costs (its transfer and the fixed cost)."""


class RouterPolicy:
    name = "base"
    dynamic = False  # Alg. 1 per step, else the fixed threshold
    load_control = False  # Alg. 2 caps

    def place(self, router: RouterView, req: RequestState) -> InstanceState:
        raise NotImplementedError

    def migrations(self, router: RouterView, src: InstanceState,
                   stepped: Sequence[RequestState]) -> list[tuple[RequestState, InstanceState]]:
        return []


ROUTER_POLICIES = Registry("router policy")
register = ROUTER_POLICIES.register


def make_router_policy(name: str) -> RouterPolicy:
    return ROUTER_POLICIES.make(name)


def walk_order(req: RequestState) -> tuple:
    """The order in which a round's requests are considered for migration: load control's (Alg. 2 walks
    requests in priority, then arrival order; 4.5), not the order the instance hands them back in (its plan
    order: oldest first under FCFS, shortest remaining first under SRPT). Each move changes the loads the
    next candidates are judged against, so the first candidates get the free capacity; the oldest have
    used the most of their SLO. Arrival order beat both the plan order and earliest deadline first across
    the report's cluster scenarios (README, Cluster router)."""
    return -req.priority, req.arrival, req.req_id


@register("fixed-threshold")
class FixedThresholdPolicy(RouterPolicy):
    """Remask's routing (Alg. 3) with one fixed threshold."""

    def place(self, router, req):
        return best_instance(router.latency, router.instances, req.next_heavy)[0]

    def migrations(self, router, src, stepped):
        return self.walk(router, src, sorted(stepped, key=walk_order))

    def walk(self, router, src, ordered):
        """Move each request of ``ordered`` in turn whose move pays off to the best other instance."""
        out = []
        cfg = router.cfg
        dst = None
        for req in ordered:
            if not can_migrate_free(req):
                continue
            if dst is None:  # the best target, found once per event and again after each move
                dst, lat = best_instance(router.latency, router.instances, True, exclude=src.inst_id)
                if dst is None:
                    break
            steps_ahead = req.est[req.cap] / max(req.blocks_left, 1) if req.est else 1.0
            gain = migration_gain_ms(router.latency, req, src, lat * (1.0 + cfg.migration_margin), steps_ahead)
            # the move costs its transfer and, on average, half a round of waiting for the target's round
            if gain > router.migration_cost_ms(req) + 0.5 * lat:
                out.append((req, dst))
                router.move(req, src, dst)  # later decisions of this event see the new loads
                dst = None
        return out


@register("dynamic-no-load-control")
class DynamicPolicy(FixedThresholdPolicy):
    dynamic = True


@register("remask")
class RemaskPolicy(DynamicPolicy):
    load_control = True


@register("remask-fit")
class RemaskFitPolicy(RemaskPolicy):
    """Remask with SLO-fit placement where the cluster mixes TP degrees (``placement.fit_instance``): an
    arrival goes to the lowest degree on which it would finish in time, and a request at a recompute step
    moves only when it would no longer finish in time where it is, to where it would; where it fits nowhere,
    Alg. 3 (the fastest instance; the usual migration test). On one degree it is ``remask``."""

    margin = 0.2  # a fit keeps this share of the budget in reserve (the step estimates err)

    @staticmethod
    def mixed(router: RouterView) -> bool:
        """The serving instances run more than one TP degree (else this policy is ``remask``)."""
        return len({i.tp for i in router.instances}) > 1

    def place(self, router, req):
        if self.mixed(router):
            inst = fit_instance(router.latency, router.instances, req, (req.deadline - router.now) * 1000.0,
                                range(len(router.cfg.thresholds)), self.margin)
            if inst is not None:
                return inst
        return super().place(router, req)

    def migrations(self, router, src, stepped):
        if not self.mixed(router):
            return super().migrations(router, src, stepped)
        out, rest = [], []
        levels = range(len(router.cfg.thresholds))
        for req in sorted(stepped, key=walk_order):
            if not can_migrate_free(req):
                continue
            budget = (req.deadline - router.now) * 1000.0
            if fit_instance(router.latency, [src], req, budget, levels, self.margin) is not None:
                continue  # it finishes in time where it is
            dst = fit_instance(router.latency, router.instances, req, budget, levels, self.margin,
                               exclude=src.inst_id)
            if dst is None:
                rest.append(req)
                continue
            out.append((req, dst))
            router.move(req, src, dst)
        return out + self.walk(router, src, rest)


@register("infaas")
class InfaasPolicy(RouterPolicy):
    def place(self, router, req):
        return min(router.instances, key=lambda i: (i.tokens, -i.tp, i.inst_id))


@register("llumnix")
class LlumnixPolicy(RouterPolicy):
    def place(self, router, req):
        return max(router.instances, key=lambda i: (i.freeness(), i.tp, -i.inst_id))

    def migrations(self, router, src, stepped):
        if src.n < 2 or not stepped:
            return []
        dst = max(router.instances, key=lambda i: (i.freeness(), -i.inst_id))
        if dst is src or dst.freeness() <= src.freeness() * (1.0 + router.cfg.llumnix_gap):
            return []
        req = max(stepped, key=lambda r: r.arrival)  # the newest: least progress to carry
        src_after = (src.kv_capacity_tokens - src.tokens + req.tokens) / max(src.n - 1, 1)
        dst_after = (dst.kv_capacity_tokens - dst.tokens - req.tokens) / (dst.n + 1)
        if dst_after < src_after:  # the move would only swap the imbalance
            return []
        router.move(req, src, dst)
        return [(req, dst)]
