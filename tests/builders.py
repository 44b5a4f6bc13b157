"""Builders shared by the tests: tiny random models, in-process replicas and the ingress's dispatcher over
them, and the synthetic cluster workload. Test modules import these from here (never from each other)."""

from __future__ import annotations

import functools
import random

import torch

import tasksuite as tasks
from engine.models.config import ModelConfig
from engine.models.transformer import DLMTransformer
from engine.tokenizer import CharTokenizer

# ---- tiny random models ---------------------------------------------------------------------------------


def make_config(**kw) -> ModelConfig:
    tok = CharTokenizer.default()
    base = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                attention="block_causal", block_size=8, mask_token_id=tok.mask_token_id,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_position_embeddings=512)
    base.update(kw)
    return ModelConfig(**base)


# a small LLaDA2-style mixture of experts (one dense layer first) for make_config / make_model
MOE = dict(num_experts=8, experts_per_token=3, moe_intermediate_size=16, shared_experts=1, dense_layers=1,
           expert_groups=4, expert_groups_used=2, routed_scaling=2.5, qk_norm=True, rotary_fraction=0.5)


def make_model(seed: int = 0, **kw) -> DLMTransformer:
    torch.manual_seed(seed)
    model = DLMTransformer(make_config(**kw))
    for p in model.parameters():  # larger weights: sharper, more varied confidences
        p.data.mul_(3.0) if p.dim() > 1 else None
    return model.eval()


# ---- tiny-bd replicas and the dispatcher in front of them (in-process, no Ray) ----------------------------


def make_replica(slots: int = 8, max_waiting: int = 64, mirror=None, kv_slots: int | None = None, **loop_kwargs):
    """A tiny-bd ``ReplicaServer`` on a control channel of its own (``loop_kwargs`` go to its round loop)."""
    from app.replica import ReplicaServer
    from engine.instance import Instance
    from engine.loading import load_engine
    from predictors.bundle import load_predictors
    from predictors.features import state_row

    engine = load_engine("tiny-bd", max_slots=slots, max_gen_length=256,
                         **({} if kv_slots is None else {"kv_slots": kv_slots}))
    inst = Instance(engine, slots=slots, mirror=mirror)
    load_predictors("tiny-bd").attach(inst)
    return ReplicaServer(inst, max_waiting=max_waiting, describe=state_row, tick_s=0.2, **loop_kwargs)


@functools.cache
def tiny_bd_tokenizer():
    """tiny-bd's tokenizer, loaded once."""
    from engine.loading import resolve_model
    from engine.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model("tiny-bd"))


def ids(prompt: str) -> list[int]:
    """The prompt's token ids, as the ingress sends them (tiny-bd's own format)."""
    return tiny_bd_tokenizer().completion_ids(prompt, 8)


def make_dispatcher(**kw):
    """The ingress's ``Dispatcher`` for tiny-bd (``kw``: AppConfig sections), no instance connected yet."""
    from app.config import AppConfig
    from app.dispatch import Dispatcher
    from cluster.factory import build_router
    from engine.loading import resolve_model
    from engine.models.loader import load_config
    from engine.tokenizer import load_tokenizer

    cfg = AppConfig(engine={"model": "tiny-bd", "slots": 8}, **kw)
    path = resolve_model("tiny-bd")
    mcfg = load_config(path)
    return Dispatcher(build_router(cfg, mcfg), load_tokenizer(path).decode, block_tokens=mcfg.block_size,
                      full_sequence=False, per_instance_limit=cfg.engine.slots * 8 + cfg.engine.max_waiting,
                      dead_after_s=2.0, shed_over_capacity=cfg.router.shed_over_capacity)


def submit(d, req_id: str, prompt: str, max_tokens: int, **kw):
    """Submit ``prompt`` (as ids) to dispatcher ``d``: its event stream."""
    return d.submit(req_id, ids(prompt), max_tokens, prompt_text=prompt, **kw)


async def collect(stream) -> tuple[str, dict]:
    """The streamed deltas joined, and the last event."""
    text, last = "", None
    async for event in stream:
        if event["type"] == "delta":
            text += event["text"]
        last = event
    return text, last


def examples(n: int):
    """``n`` held-out tasks whose answers tiny-bd gets right (reverse, choice, arith)."""
    return [e for e in tasks.heldout_set(400) if e.category in ("reverse", "choice", "arith")][:n]


# ---- the synthetic cluster workload (the simulator's and the live router's tests) --------------------------

TS = (0.9, 0.8, 0.7, 0.6, 0.5)


def synthetic(n: int, rate: float, seed: int = 0, slo_factor: float = 5.0):
    """Requests whose steps fall with the threshold (x1 .. x0.6); SLO = slo_factor x isolated TP-1 latency."""
    from engine.latency_profile import load_tp_profiles
    from sim.cluster import ClusterRequestSpec

    rng = random.Random(seed)
    prof = load_tp_profiles("h200-llada8b-measured", [1])[1]
    specs, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        s = rng.choice([8.0, 8.0, 40.0, 120.0, 200.0])
        steps = tuple(max(8.0, round(s * f)) for f in (1.0, 0.9, 0.8, 0.7, 0.6))
        iso = 8 * prof.round_ms([("recompute", 396, 0)]) + (steps[0] - 8) * prof.round_ms([("cached", 32, 396)])
        specs.append(ClusterRequestSpec(f"r{i}", 0, "prose", t, 140, 256, steps, (True,) * 5,
                                        slo_factor * iso / 1000.0))
    return specs


# ---- finished requests for the online step learners -------------------------------------------------------

LEARNER_TS = (0.9, 0.8, 0.7)
LEARNER_BLOCKS, LEARNER_OUT = 8, 256


def learner_request(rng, threshold: float | None = None, rates=(2.0, 4.0, 12.0), faster: float = 1.0,
                    slower: float = 1.0, rows_every: int = 1):
    """A finished request with a known relation, for a step learner: it commits ``rate`` tokens a step (one of
    ``rates`` at 0.9, 1.5x at 0.8, 2x at 0.7; times ``faster``, over ``slower``: a rule or a constraint that changes
    the pace). Its rows are the 11 step features after each step but the last (every ``rows_every``-th):
    (rows, the steps done at each row, the total steps)."""
    import numpy as np

    t = float(rng.choice(LEARNER_TS)) if threshold is None else threshold
    rate = float(rng.choice(list(rates))) * {0.9: 1.0, 0.8: 1.5, 0.7: 2.0}[t] * faster / slower
    total = int(np.ceil(LEARNER_OUT / rate))
    rows, done = [], []
    for k in range(1, total, rows_every):
        p = min(k * rate / LEARNER_OUT, 1.0)
        b = min(int(p * LEARNER_BLOCKS), LEARNER_BLOCKS)
        rows.append([t, LEARNER_OUT, p, p * LEARNER_BLOCKS - b, LEARNER_BLOCKS - b, k % 4, 0.0, 0.0, 0.0, 0.0, 0.0])
        done.append(k)
    return rows, done, total
