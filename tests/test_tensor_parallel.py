from __future__ import annotations

import copy
import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from engine.engine import Engine
from engine.models.tensor_parallel import all_reduce_sum, shard_config, shard_model
from engine.sequence import SamplingParams
from engine.tokenizer import CharTokenizer
from tests.builders import MOE, make_config, make_model

PROMPTS = ["rev: abcdef", "12+5=", "story: cat 3", "x"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MODELS = {"block_causal": dict(attention="block_causal"), "bidirectional": dict(attention="bidirectional"),
          "moe": dict(attention="block_causal", **MOE)}


def _full(kind: str):
    return make_model(num_heads=4, num_kv_heads=2, intermediate_size=64, **MODELS[kind])


def _rank_main(rank: int, world: int, port: int, kinds: list[str], out_path: str) -> None:
    """One TP rank: each of ``kinds``' models sharded and decoded in turn; rank 0 writes {kind: outputs}."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        got = {}
        for kind in kinds:
            full = _full(kind)
            if kind == "moe":  # as an LLaDA2 checkpoint loads: q/k/v fused
                for layer in full.layers:
                    layer.self_attn.fuse()
            shard = shard_model(full, rank, world, all_reduce_sum())
            outs = Engine(shard, CharTokenizer.default()).generate(PROMPTS,
                                                                   SamplingParams(max_tokens=24, threshold=0.6))
            got[kind] = [[o.token_ids, o.rounds] for o in outs]
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(got, f)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp2_outputs(tmp_path_factory) -> dict:
    """Every model kind decoded by two TP ranks (one pair of spawned processes for all kinds: starting them
    costs more than the decoding)."""
    out = tmp_path_factory.mktemp("tp2") / "tp2.json"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_rank_main, args=(2, _free_port(), list(MODELS), str(out)), nprocs=2, join=True)
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(MODELS))
def test_tp2_gives_the_same_tokens_as_tp1(tp2_outputs, kind):
    ref = Engine(_full(kind), CharTokenizer.default()).generate(PROMPTS, SamplingParams(max_tokens=24, threshold=0.6))
    assert tp2_outputs[kind] == [[o.token_ids, o.rounds] for o in ref]


def test_shard_shapes_and_errors():
    model = make_model(num_heads=4, num_kv_heads=2, intermediate_size=64)
    shard = shard_model(model, 1, 2, reduce=None)
    assert shard.config.num_heads == 2 and shard.config.num_kv_heads == 1 and shard.config.head_dim == 8
    assert shard.layers[0].self_attn.q_proj.weight.shape == (16, 32)
    assert shard.layers[0].self_attn.o_proj.weight.shape == (32, 16)
    assert shard.layers[0].mlp.down_proj.weight.shape == (32, 32)
    torch.testing.assert_close(shard.layers[0].mlp.up_proj.weight, model.layers[0].mlp.up_proj.weight[32:])
    with pytest.raises(ValueError, match="does not divide"):
        shard_config(make_config(num_heads=4, num_kv_heads=2), 4)
    for full in (model, _full("moe")):
        for rank in (0, 1):  # a fused model shards each fused projection on its own: as fusing the shard
            fused = shard_model(copy.deepcopy(full).fuse_projections(), rank, 2, reduce=None)
            want = shard_model(full, rank, 2, reduce=None).fuse_projections()
            assert fused.fused and fused.state_dict().keys() == want.state_dict().keys()
            for k, v in want.state_dict().items():
                assert torch.equal(fused.state_dict()[k], v), k
