"""CUDA's kernel layouts on a CPU (engine/models/layouts.py): the attention kernel's output handed back in the
strides CUDA's fused kernels use, and CUDA's code paths taken (grouped query heads folded as rows, fused
projections). Every checkpoint family decodes through the engine, the round loop and ``remask generate``
exactly as it does with the CPU's own layouts: a layout assumption (a ``.view`` of a kernel's output) fails
here, not on a user's GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.loading import load_engine
from engine.models import layouts
from engine.progress import ErrorItem
from engine.sequence import SamplingParams
from tests.checkpoints import ARCHS, MULTILINGUAL
from tests.fakes import Sink

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ("Grüße", "x = f(42) + 3.14; 日本語のテキスト", MULTILINGUAL)  # three lengths: one padded batch


def test_the_emulated_attention_output_is_cudas_transposed_buffer():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=gen) for _ in range(3))
    plain = layouts.attention(q, k, v)
    with layouts.cuda_layouts():
        assert layouts.emulating()
        emulated = layouts.attention(q, k, v)
    assert not layouts.emulating()
    assert plain.is_contiguous() and not emulated.is_contiguous()
    assert emulated.stride() == (6 * 4 * 8, 8, 4 * 8, 1)  # a [N, T, H, D] buffer seen as [N, H, T, D]
    assert torch.equal(plain, emulated)
    with pytest.raises(RuntimeError, match="view size is not compatible"):  # what a .view met on the GPU
        emulated.view(2, 4 * 6, 8)


def _decode(engine, n: int = len(PROMPTS)) -> list[list[int]]:
    tok = engine.tokenizer
    ids = [tok.chat_ids([{"role": "user", "content": p}], engine.cfg.block_size) for p in PROMPTS[:n]]
    return [o.token_ids for o in engine.generate(ids, SamplingParams(max_tokens=16))]


@pytest.mark.parametrize("arch", ARCHS)
def test_each_family_decodes_a_batched_round_in_cudas_layouts(hf_checkpoints, arch):
    """Three prompts of different lengths in one batch: the tokens equal those of the CPU's own layouts and
    paths, and the grouped-query families really took the folded path whose ``.view`` stopped on CUDA."""
    reference = _decode(load_engine(str(hf_checkpoints[arch]), max_slots=4))
    with layouts.cuda_layouts():
        engine = load_engine(str(hf_checkpoints[arch]), max_slots=4)
        model = engine.runner.model
        assert model.fused and model.folds_gqa(torch.device("cpu"))  # CUDA's defaults taken
        assert _decode(engine) == reference
    cfg = model.config
    assert (cfg.num_heads > cfg.num_kv_heads) == (arch != "llada")  # LLaDA is the one family without GQA


@pytest.mark.parametrize("arch", ["dream", "llada2"])
def test_the_round_loop_serves_a_batch_in_cudas_layouts(hf_checkpoints, arch):
    """The serving path (Instance under its RoundLoop, KV pool, mixed prefill and denoise rounds) with CUDA's
    layouts: every request ends with the tokens the engine decodes with the CPU's own."""
    from engine.instance import Instance
    from engine.loop import RoundLoop

    reference = _decode(load_engine(str(hf_checkpoints[arch]), max_slots=4))
    with layouts.cuda_layouts():
        engine = load_engine(str(hf_checkpoints[arch]), max_slots=4)
        sink = Sink()
        loop = RoundLoop(Instance(engine, slots=4), sink)
        try:
            tok = engine.tokenizer
            for k, p in enumerate(PROMPTS):
                loop.submit(f"r{k}", tok.chat_ids([{"role": "user", "content": p}], engine.cfg.block_size),
                            SamplingParams(max_tokens=16))
            sink.wait([f"r{k}" for k in range(len(PROMPTS))])
        finally:
            loop.stop()
    assert loop.broken is None and loop.stats()["rounds_failed"] == 0
    assert not any(isinstance(sink.ended(f"r{k}"), ErrorItem) for k in range(len(PROMPTS)))
    assert [sink.ids(f"r{k}") for k in range(len(PROMPTS))] == reference


@pytest.mark.slow
def _generate_answer(path: str, prompt: str, max_tokens: int) -> str:
    """What ``remask generate --temperature 0`` prints for ``prompt`` (a chat) after its steps: the answer and
    its ``[finish; N rounds, P prefill steps]`` line, decoded here in the CPU's own layouts."""
    engine = load_engine(path)
    tok = engine.tokenizer
    defaults = getattr(tok, "generation_defaults", {})
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0,
                            **{k: defaults[k] for k in ("top_p", "top_k") if defaults.get(k) is not None})
    seq = engine.add_request(tok.chat_ids([{"role": "user", "content": prompt}], engine.cfg.block_size), params)
    while not seq.finished:
        engine.step([seq])
    out = engine.output(seq)
    return f"{out.text}\n[{out.finish_reason}; {out.rounds} rounds, {out.prefill_steps} prefill steps]"


@pytest.mark.slow
def test_remask_generate_in_cudas_layouts(hf_checkpoints):
    """``remask generate`` in a fresh process with ``REMASK_CUDA_LAYOUTS=1``: the variable reaches the engine
    and every family prints its answer: the one its engine decodes in the CPU's own layouts, with as many rounds
    and the same finish."""
    prompt = "café 日本"
    env = {**os.environ, "REMASK_CUDA_LAYOUTS": "1", "PYTHONPATH": str(ROOT)}
    code = ("import sys; from engine.models import layouts; assert layouts.emulating(); from tools.cli import main; "
            f"sys.exit(max(main(['generate', '--model', d, '--prompt', {prompt!r}, '--max-tokens', '8', "
            "'--temperature', '0', '--show-steps']) for d in sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, *(str(hf_checkpoints[a]) for a in ARCHS)], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    at = 0
    for arch in ARCHS:
        expected = _generate_answer(str(hf_checkpoints[arch]), prompt, 8)
        found = proc.stdout.find(expected, at)
        assert found >= 0, f"{arch}: expected {expected!r} after offset {at} in\n{proc.stdout[at:][-2000:]}"
        at = found + len(expected)
