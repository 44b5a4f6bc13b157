"""Cluster capacity for load control (Alg. 2), from the latency profiles (pure Python).

DiLaServe: capacity = tokens an instance processes per second x the SLO.
Throughput depends on the batch, and a batch is only useful while its step
latency still lets requests meet their SLOs, so the throughput is taken at
the *SLO batch*: the largest batch whose step latency is at most ``slack``
times a lone request's, where a request's slack is its SLO over its
predicted isolated latency (5 for the default SLO of 5x the isolated
latency). Step kinds are mixed in the cluster's current proportion of
recompute (heavy) to cached (light) steps; loads are in TP-1
instance-milliseconds at that batch, a step priced at its share of the
mixed round it runs in (``step_costs``), and a TP-d instance counts as its
throughput relative to a TP-1 instance.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cluster.latency import TpLatencyModel
from cluster.state import InstanceState


@dataclass(frozen=True)
class Capacity:
    batch: int  # SLO batch of a TP-1 instance
    heavy_cost: float  # TP-1 instance-ms per recompute step at that batch
    light_cost: float  # TP-1 instance-ms per cached step at that batch
    speed: float  # cluster throughput, in TP-1 instances at their SLO batch

    def within(self, window_ms: float, util: float = 1.0) -> float:
        """Load the cluster can serve within ``window_ms``."""
        return window_ms * self.speed * util


def mixed_ms(model: TpLatencyModel, tp: int, batch: int, heavy_share: float) -> float:
    h = min(batch, round(heavy_share * batch))
    return model.round_ms(tp, h, batch - h)


def step_rounds_ms(model: TpLatencyModel, tp: int, batch: int, heavy_share: float) -> tuple[float, float]:
    """Latency of the round a request's recompute step is in, and of the round its cached step is in: rounds
    of ``batch`` steps, the other ``batch - 1`` requests' steps recompute steps in ``heavy_share``. (A round's
    latency is what every request in it waits, whatever its own step: a request's recompute step is one
    heavy step among mostly cached ones, not a round of recompute steps.)"""
    others = max(batch, 1) - 1
    heavy = min(others, max(0, round(heavy_share * others)))
    return model.round_ms(tp, heavy + 1, others - heavy), model.round_ms(tp, heavy, others - heavy + 1)


def slo_batch(model: TpLatencyModel, tp: int, slack: float, heavy_share: float) -> int:
    lone = heavy_share * model.round_ms(tp, 1, 0) + (1.0 - heavy_share) * model.round_ms(tp, 0, 1)
    for b in range(model.slots, 0, -1):
        if mixed_ms(model, tp, b, heavy_share) <= slack * lone:
            return b
    return 1


def step_costs(model: TpLatencyModel, tp: int, batch: int, heavy_share: float) -> tuple[float, float]:
    """Instance ms a recompute step and a cached step cost in the rounds an instance runs: rounds of ``batch``
    steps, ``h`` of them recompute steps (``heavy_share`` of the batch, at least one). The round's recompute
    steps run as their own forward, so a recompute step costs its forward's time over its h steps (the
    forward's fixed costs included: one recompute among cached steps pays them alone), a cached step its
    forward's over the other ``batch - h``; h of the first and ``batch - h`` of the second add up to the
    round. (Costs at a round of ``batch`` recompute steps would share those fixed costs ``batch`` ways, which
    mixed rounds never do: load control then took a recompute step for a fraction of its price.)"""
    b = max(batch, 1)
    h = min(b, max(1, round(heavy_share * b)))
    light_round = model.round_ms(tp, 0, b - h) if b > h else 0.0
    heavy = (model.round_ms(tp, h, b - h) - light_round) / h
    light = light_round / (b - h) if b > h else model.round_ms(tp, 0, b) / b
    return heavy, light


def cluster_capacity(model: TpLatencyModel, instances: Sequence[InstanceState], slack: float,
                     heavy_share: float) -> Capacity:
    ref = 1 if 1 in model.profiles else model.degrees[0]
    per_tp = {}
    for tp in {inst.tp for inst in instances} | {ref}:
        b = slo_batch(model, tp, slack, heavy_share)
        per_tp[tp] = b / mixed_ms(model, tp, b, heavy_share)  # steps per ms
    b = slo_batch(model, ref, slack, heavy_share)
    if model.shape.full_sequence:  # a recompute step runs as a forward of its own beside the cached steps
        heavy, light = step_costs(model, ref, b, heavy_share)
    else:  # a prefill step is one block, as long as a denoise step: the two share the round's forward
        heavy, light = model.step_ms(ref, b, "prefill") / b, model.step_ms(ref, b, "denoise") / b
    return Capacity(b, heavy, light, sum(per_tp[inst.tp] for inst in instances) / per_tp[ref])
