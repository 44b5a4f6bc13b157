"""Model-in-the-loop runner: the real engine makes every unmasking decision
(so rounds and accuracy are real), while time is charged from a latency
profile over each round's composition, in virtual time."""

from __future__ import annotations

from engine.engine import Engine
from engine.instance import execute_plan
from engine.latency_profile import LatencyProfile
from engine.scheduler.types import RoundPlan, RoundResult, SchedRequest
from engine.sequence import SamplingParams, Sequence
from sim.workload import SimRequestSpec


class ModelInTheLoopRunner:
    def __init__(self, engine: Engine, profile: LatencyProfile, threshold: float | None = None) -> None:
        self.engine, self.profile = engine, profile
        self.params = SamplingParams(threshold=threshold)
        self.seqs: dict[str, Sequence] = {}
        self.specs: dict[str, SimRequestSpec] = {}
        self.ids: dict[int, str] = {}  # engine seq id -> request id

    def register(self, spec: SimRequestSpec) -> SchedRequest:
        seq = self.engine.add_request(spec.extra["prompt"], self.params)
        self.seqs[spec.req_id], self.specs[spec.req_id] = seq, spec
        self.ids[seq.seq_id] = spec.req_id
        return SchedRequest(
            req_id=spec.req_id, prompt_blocks=seq.prefill_blocks, output_blocks=len(seq.blocks),
            est_rounds=spec.admission_est, arrival=spec.arrival, predicted_output_tokens=spec.predicted_output_tokens,
            true_rounds=spec.true_rounds, full_sequence=seq.cache_mode != "exact",
        )

    def _refined(self, seq: Sequence) -> float | None:
        """The spec's stand-in estimate, or (NaN) what the engine's refine hook wrote."""
        est = self.specs[self.ids[seq.seq_id]].refined_est
        return seq.refined_rounds if est != est else est

    def execute(self, plan: RoundPlan) -> RoundResult:
        result, engine_round = execute_plan(self.engine, self.seqs, plan, refiner=self._refined)
        for out in result.outcomes:
            if out.finished:
                seq = self.seqs.pop(out.req_id)
                spec = self.specs.pop(out.req_id)
                text = self.engine.output(seq).text
                spec.extra["correct"] = spec.extra["check"](text)
                self.engine.sequences.pop(seq.seq_id, None)
                self.ids.pop(seq.seq_id, None)
        result.latency_s = self.profile.round_ms(engine_round.composition) / 1000.0
        return result

