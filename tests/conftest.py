from __future__ import annotations

import pytest
import torch

from engine.models.config import ModelConfig
from engine.models.transformer import DLMTransformer
from engine.tokenizer import CharTokenizer

torch.set_num_threads(1)


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


@pytest.fixture
def tok() -> CharTokenizer:
    return CharTokenizer.default()


def pytest_collection_modifyitems(config, items):
    """GPU tests run only where CUDA is available (never on CI)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def wait_until(cond, limit_s: float = 120.0, step_s: float = 0.5) -> bool:
    """Poll ``cond()`` until it holds (True) or ``limit_s`` passes (False); HTTP errors count as not yet."""
    import time

    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        try:
            if cond():
                return True
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(step_s)
    return False


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory) -> dict:
    """Tiny real-format checkpoints (config, weights, BPE tokenizer, chat template) of every diffusion-LM
    family, built once per session: {arch: directory} (tests/checkpoints.py)."""
    from tests.checkpoints import ARCHS, build_checkpoint

    root = tmp_path_factory.mktemp("hf_checkpoints")
    return {arch: build_checkpoint(arch, root / arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def hf_checkpoint_notemplate(tmp_path_factory):
    """The tiny Dream checkpoint without a chat template in its tokenizer_config.json."""
    from tests.checkpoints import build_checkpoint

    return build_checkpoint("dream", tmp_path_factory.mktemp("hf_notemplate") / "dream", chat_template=False)
