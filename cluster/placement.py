"""Instance choice and migration (Alg. 3), pure Python.

On arrival and at step boundaries a request goes to the instance with the
lowest profiled step latency at its load *with the request added*, ties to
the higher TP degree: at low load that is a high-TP instance, at high load
the least-loaded one. A running request moves only at a step boundary where
moving costs no extra compute (its next step rebuilds KV anyway: a
recompute step of an approximate-cache model) and only when the latency it
saves over its current block exceeds the migration's own cost. Migration
carries the prompt and the committed tokens, never KV.
"""

from __future__ import annotations

from collections.abc import Sequence

from cluster.latency import TpLatencyModel
from cluster.state import InstanceState, RequestState


def latency_with(model: TpLatencyModel, inst: InstanceState, heavy: bool = True) -> float:
    """Step latency of ``inst`` once one more request (whose next step is heavy or not) joins it."""
    return model.round_ms(inst.tp, inst.n_heavy + heavy, inst.n_light + (not heavy))


def best_instance(model: TpLatencyModel, instances: Sequence[InstanceState], heavy: bool = True,
                  exclude: int | None = None) -> tuple[InstanceState | None, float]:
    """FindBestInstance: (instance, its step latency with the request added), lowest latency, then higher TP."""
    best, best_key = None, (float("inf"), 0)
    for inst in instances:
        if inst.inst_id == exclude:
            continue
        key = (latency_with(model, inst, heavy), -inst.tp)
        if key < best_key:
            best, best_key = inst, key
    return best, best_key[0]


def finish_ms(model: TpLatencyModel, inst: InstanceState, req: RequestState, k: int) -> float:
    """What ``req``'s remaining steps at candidate threshold ``k`` take on ``inst``, each step in a round of
    the instance's requests with ``req`` among them (counted once if it is there already)."""
    nh, nl = inst.n_heavy, inst.n_light
    if req.instance == inst.inst_id:
        if req.next_heavy:
            nh -= 1
        else:
            nl -= 1
    tp = inst.tp
    return req.heavy_left * model.round_ms(tp, nh + 1, nl) + req.light_left(k) * model.round_ms(tp, nh, nl + 1)


def fit_instance(model: TpLatencyModel, instances: Sequence[InstanceState], req: RequestState, budget_ms: float,
                 levels: Sequence[int], margin: float = 0.2, exclude: int | None = None
                 ) -> InstanceState | None:
    """SLO fit: an instance of the lowest TP degree on which ``req`` would finish within ``budget_ms``
    (``finish_ms`` times ``1 + margin``), trying the candidate thresholds ``levels`` in turn (the highest
    first), the fastest of that degree with the request added; None when it fits nowhere. A high-TP instance
    takes a step faster but spends more GPU time on it than a TP-1 one: a request that meets its SLO on the
    cheaper degree leaves the fast instances to the requests that need them."""
    for k in levels:
        best, best_key = None, (0, 0.0)
        for inst in instances:
            if inst.inst_id == exclude or finish_ms(model, inst, req, k) * (1.0 + margin) > budget_ms:
                continue
            key = (inst.tp, latency_with(model, inst, req.next_heavy))
            if best is None or key < best_key:
                best, best_key = inst, key
        if best is not None:
            return best
    return None


def migration_gain_ms(model: TpLatencyModel, req: RequestState, src: InstanceState, dst_latency_ms: float,
                      steps_ahead: float) -> float:
    """Latency ``req`` saves over ``steps_ahead`` steps by moving from ``src`` (where it is counted)
    to an instance whose step latency with it added is ``dst_latency_ms``."""
    here = model.round_ms(src.tp, src.n_heavy, src.n_light)
    return (here - dst_latency_ms) * steps_ahead


def can_migrate_free(req: RequestState) -> bool:
    """Approximate-cache models move only at recompute steps (the KV is rebuilt there anyway);
    exact-cache models would have to rebuild their KV, so they stay put."""
    return req.full_sequence and req.next_heavy
