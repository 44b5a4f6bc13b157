"""The simulated runner: executes a RoundPlan in virtual time.

Each request's denoising rounds per block come from the workload model; the
round's latency comes from a latency profile over the round's composition.

``canvas=True`` runs DiffusionGemma's rounds as its serving engine reports them
(engine/canvas_serving.py): one prefill step encodes the whole prompt (no
context); each denoising step is one canvas of ``block_size`` tokens over its
cache (the prompt and the finished canvases), the first step of every canvas
after the first also encoding the canvas before it (its tokens added to the
step's); the request's refined estimate arrives when its first canvas stops.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.latency_profile import LatencyProfile
from engine.scheduler.types import RoundPlan, RoundResult, SchedRequest, StepKind, StepOutcome
from sim.workload import SimRequestSpec, sched_request


@dataclass
class _Progress:
    spec: SimRequestSpec
    prompt_blocks: int
    prefill_done: int = 0
    block: int = 0
    in_block: int = 0
    rounds: int = 0


class SimulatedRunner:
    def __init__(self, profile: LatencyProfile, block_size: int = 32, canvas: bool = False) -> None:
        self.profile = profile
        self.block = block_size
        self.canvas = canvas
        self.progress: dict[str, _Progress] = {}

    def register(self, spec: SimRequestSpec) -> SchedRequest:
        req = sched_request(spec, self.block)
        if self.canvas:  # one encoder pass of the whole prompt
            req = replace(req, prompt_blocks=1)
        self.progress[spec.req_id] = _Progress(spec, req.prompt_blocks)
        return req

    def execute(self, plan: RoundPlan) -> RoundResult:
        b = self.block
        steps, outcomes = [], []
        for slot in plan.slots:
            p = self.progress[slot.req_id]
            if slot.kind is StepKind.PREFILL and self.canvas:
                steps.append(("prefill", p.spec.prompt_tokens, 0))
                p.prefill_done = 1
                outcomes.append(StepOutcome(slot.req_id, slot.kind, next_kind=StepKind.DENOISE))
                continue
            if slot.kind is StepKind.PREFILL:
                steps.append(("prefill", b, p.prefill_done * b))
                p.prefill_done += 1
                nxt = StepKind.PREFILL if p.prefill_done < p.prompt_blocks else StepKind.DENOISE
                outcomes.append(StepOutcome(slot.req_id, slot.kind, next_kind=nxt))
                continue
            if self.canvas:  # the canvas over its cache; a new canvas's first step encodes the one before
                encoded = b if p.block and not p.in_block else 0
                steps.append((slot.kind.value, b + encoded, p.spec.prompt_tokens + p.block * b))  # as reported
            else:
                steps.append((slot.kind.value, b, (p.prompt_blocks + p.block) * b))
            p.rounds += 1
            p.in_block += 1
            need = p.spec.block_rounds[p.block]
            block_done = p.in_block >= need
            committed = 0
            if block_done:
                committed = b
                p.block += 1
                p.in_block = 0
            finished = p.block >= len(p.spec.block_rounds)
            if self.canvas:  # refined when the first canvas stops (the live instance's refinement)
                refined = p.spec.refined_est if block_done and p.block == 1 else None
            else:
                refined = p.spec.refined_est if p.rounds == 1 else None
            outcomes.append(StepOutcome(slot.req_id, slot.kind, committed, block_done, finished,
                                        StepKind.DENOISE, refined))
            if finished:
                del self.progress[slot.req_id]
        return RoundResult(outcomes, self.profile.round_ms(steps) / 1000.0)
