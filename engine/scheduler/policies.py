"""Instance scheduling policies, chosen by name from a registry.

A policy gives each live request a sort key (smaller runs first) and says
whether prompt and denoising blocks share a round. Keys are recomputed only
when a request's state changes (it ran, was refined or was demoted), so the
scheduler can rank a large waiting set cheaply.
"""

from __future__ import annotations

from engine.registry import Registry
from engine.scheduler.types import SchedRequest, StepCosts, StepKind


class Policy:
    name = "base"
    mixed = True  # prompt and denoising blocks share a round
    fcfs_admission = False  # admit strictly in arrival order

    def __init__(self, costs: StepCosts | None = None) -> None:
        self.costs = costs or StepCosts()

    def key(self, req: SchedRequest) -> tuple:
        raise NotImplementedError

    def on_step(self, req: SchedRequest, kind: StepKind) -> None:
        """After ``req`` ran one step of ``kind`` (its counters already updated)."""

    def on_refine(self, req: SchedRequest, total_rounds: float) -> None:
        """The refinement hook: a better estimate of total rounds after the first round."""


POLICIES = Registry("scheduling policy")
register = POLICIES.register


def make_policy(name: str, **kwargs) -> Policy:
    return POLICIES.make(name, **kwargs)


@register("dwise")
class DwisePolicy(Policy):
    """Preemptive shortest remaining work: R_i = P_i + r_i (cost-weighted),
    r_i decremented per round and clamped at 0, replaced once by the refined
    estimate after the first denoising round."""

    def __init__(self, costs: StepCosts | None = None, refine: bool = True) -> None:
        super().__init__(costs)
        self.refine = refine

    def key(self, req):
        if req.full_sequence:
            return (req.remaining_work(self.costs), req.arrival)
        r = req.est_rounds if req.est_rounds > 0.0 else 0.0  # hot path: inlined remaining_work
        return ((req.prompt_blocks - req.prefill_done) * self.costs.prefill + r * self.costs.denoise, req.arrival)

    def on_step(self, req, kind):
        if kind is StepKind.PREFILL or (req.refined and req.rounds_done == 1 and self.refine):
            return
        req.est_rounds = req.est_rounds - 1.0 if req.est_rounds > 1.0 else 0.0

    def on_refine(self, req, total_rounds):
        if self.refine:
            req.est_rounds = max(total_rounds - req.rounds_done, 0.0)


@register("oracle")
class OraclePolicy(Policy):
    """Ranks by true remaining work (upper bound; needs true_rounds)."""

    def key(self, req):
        if req.true_rounds is None:
            raise ValueError(f"oracle policy needs the true rounds of request {req.req_id}")
        return (req.remaining_work(self.costs, req.true_remaining), req.arrival)


@register("fcfs-mixed")
class FcfsMixedPolicy(Policy):
    fcfs_admission = True

    def key(self, req):
        return (req.arrival, req.req_id)


@register("fcfs-prefill-first")
class FcfsPrefillFirstPolicy(FcfsMixedPolicy):
    """SGLang's dLLM path: FCFS admission; while any admitted prompt still has
    prefill blocks, the round carries prefill blocks only, at most
    ``prefill_per_round`` requests of them (SGLang prefills one new request's
    next block per round)."""

    mixed = False

    def __init__(self, costs: StepCosts | None = None, prefill_per_round: int = 1) -> None:
        super().__init__(costs)
        self.prefill_per_round = prefill_per_round


@register("ssjf")
class SsjfPolicy(Policy):
    """Speculative shortest job first: rank by predicted output length."""

    def key(self, req):
        return (req.predicted_output_tokens, req.arrival)


@register("mlfq")
class MlfqPolicy(Policy):
    """FastServe's skip-join MLFQ: a request joins the queue whose quantum covers
    its first step's cost (long prompts skip the top levels) and is demoted
    once it has used its level's quantum; quanta double per level."""

    def __init__(self, costs: StepCosts | None = None, levels: int = 6, base_quantum: int = 4) -> None:
        super().__init__(costs)
        self.levels, self.base = levels, base_quantum

    def quantum(self, level: int) -> int:
        return self.base * 2**level

    def key(self, req):
        if req.attained == 0 and req.level == 0:
            first = req.remaining_prefill or 1  # prompt blocks before the first output
            while req.level < self.levels - 1 and self.quantum(req.level) < first:
                req.level += 1
        return (req.level, req.arrival)

    def on_step(self, req, kind):
        req.attained += 1
        if req.level < self.levels - 1 and req.attained >= sum(self.quantum(i) for i in range(req.level + 1)):
            req.level += 1

