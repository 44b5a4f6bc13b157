"""Generation on real-format checkpoints of every supported architecture (tests/checkpoints.py: random
weights, byte-level BPE tokenizers, the families' chat templates), from the CLI and the engine."""

from __future__ import annotations

import pytest

from engine.loading import load_engine
from engine.sequence import SamplingParams
from tests.checkpoints import ARCHS, MULTILINGUAL
from tools.cli import main


@pytest.mark.parametrize("arch", ARCHS)
def test_remask_generate_runs_on_each_architecture(hf_checkpoints, arch, capsys):
    rc = main(["generate", "--model", str(hf_checkpoints[arch]), "--prompt", MULTILINGUAL, "--max-tokens", "12",
               "--system", "Sei kurz.", "--show-steps"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "rounds" in out.splitlines()[-1]  # the closing line: finish reason, rounds


def test_remask_generate_without_a_chat_template(hf_checkpoint_notemplate, capsys):
    for extra in ([], ["--raw"], ["--temperature", "0.8", "--seed", "3"]):
        assert main(["generate", "--model", str(hf_checkpoint_notemplate), "--prompt", "Grüße 🙂",
                     "--max-tokens", "8", *extra]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_text_is_the_decode_of_its_ids_and_stops_at_end_of_turn(hf_checkpoints, arch):
    engine = load_engine(str(hf_checkpoints[arch]), max_slots=4)
    tok = engine.tokenizer
    assert set(tok.stop_ids) <= set(engine.stop_ids)  # the checkpoint's EOS ids and end-of-turn token
    ids = tok.chat_ids([{"role": "system", "content": "Kurz."}, {"role": "user", "content": MULTILINGUAL}],
                       engine.cfg.block_size)
    outs = engine.generate([ids, ids], [SamplingParams(max_tokens=16), SamplingParams(max_tokens=16, stop_token_ids=(
        tok.encode("a")[0],))])
    for out in outs:
        assert out.text == tok.decode(out.token_ids)
        assert not set(out.token_ids) & set(engine.stop_ids)  # an answer ends before its stop token
        assert out.finish_reason in ("stop", "length")


@pytest.mark.parametrize("arch", ["dream", "sdar"])
def test_seeded_sampling_on_a_checkpoint(hf_checkpoints, arch):
    engine = load_engine(str(hf_checkpoints[arch]), max_slots=4)
    ids = engine.tokenizer.prompt_ids("café 日本", engine.cfg.block_size)

    def run(**kw):
        return engine.generate([ids], SamplingParams(max_tokens=24, **kw))[0].token_ids

    assert run(temperature=1.0, seed=5) == run(temperature=1.0, seed=5)
    assert run(temperature=1.0, seed=5) != run(temperature=0.0)
    assert run(temperature=1.0, seed=5) != run(temperature=1.0, seed=6)
