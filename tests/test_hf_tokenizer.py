"""The tokenizer adapter on real-format checkpoints (byte-level BPE, the families' chat templates and
special tokens), streamed text that never splits a character, and stop strings."""

from __future__ import annotations

import json

import pytest

from engine.tokenizer import HFTokenizer, IncrementalDecoder, OutputText, load_tokenizer, plain_chat
from tests.checkpoints import ARCHS, MULTILINGUAL

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grüße? 日本"},
        {"role": "assistant", "content": "Hallo 🙂"}, {"role": "user", "content": "und dann?"}]
# the marker each family's template writes around a turn, in order of the chat above
MARKERS = {
    "llada": ["<|start_header_id|>system", "Be brief.<|eot_id|>", "<|start_header_id|>user", "Grüße? 日本",
              "<|start_header_id|>assistant<|end_header_id|>\n\nHallo 🙂<|eot_id|>", "und dann?",
              "<|start_header_id|>assistant<|end_header_id|>\n\n"],
    "dream": ["<|im_start|>system\nBe brief.<|im_end|>", "<|im_start|>user\nGrüße? 日本<|im_end|>",
              "<|im_start|>assistant\nHallo 🙂<|im_end|>", "und dann?", "<|im_start|>assistant\n"],
    "sdar": ["<|im_start|>system\nBe brief.<|im_end|>", "<|im_start|>user\nGrüße? 日本<|im_end|>",
             "<|im_start|>assistant\nHallo 🙂<|im_end|>", "und dann?", "<|im_start|>assistant\n"],
    "llada2": ["<role>SYSTEM</role>Be brief.", "<role>HUMAN</role>Grüße? 日本<|role_end|>",
               "<role>ASSISTANT</role>Hallo 🙂<|role_end|>", "und dann?", "<role>ASSISTANT</role>"],
}
END_OF_TURN = {"llada": "<|eot_id|>", "dream": "<|im_end|>", "sdar": "<|im_end|>", "llada2": "<|role_end|>"}


@pytest.fixture(scope="module")
def toks(hf_checkpoints):
    return {arch: load_tokenizer(path) for arch, path in hf_checkpoints.items()}


@pytest.mark.parametrize("arch", ARCHS)
def test_chat_goes_through_the_family_template_with_every_role(toks, arch):
    tok = toks[arch]
    assert isinstance(tok, HFTokenizer) and tok.has_chat_template
    text = tok.decode(tok.chat_ids(CHAT, 8), skip_special=False)
    at = 0
    for marker in MARKERS[arch]:  # every turn, in order, with its own role
        found = text.find(marker, at)
        assert found >= 0, (marker, text)
        at = found + len(marker)
    assert text.endswith(MARKERS[arch][-1])
    # without the generation prompt the text ends with the last user turn
    no_gen = tok.decode(tok.chat_ids(CHAT, 8, add_generation_prompt=False), skip_special=False)
    assert not no_gen.rstrip().endswith(MARKERS[arch][-1].rstrip()) and "und dann?" in no_gen


@pytest.mark.parametrize("arch", ARCHS)
def test_special_ids_and_stop_ids(toks, hf_checkpoints, arch):
    tok = toks[arch]
    config = json.loads((hf_checkpoints[arch] / "config.json").read_text())
    end = tok.tok.convert_tokens_to_ids(END_OF_TURN[arch])
    assert end in tok.stop_ids  # found from the template: the token after an assistant turn
    assert tok.eos_token_id in tok.stop_ids
    eos = config["eos_token_id"]
    assert all(i in tok.stop_ids for i in (eos if isinstance(eos, list) else [eos]))
    gen = json.loads((hf_checkpoints[arch] / "generation_config.json").read_text())
    gen_eos = gen.get("eos_token_id", [])
    assert all(i in tok.stop_ids for i in (gen_eos if isinstance(gen_eos, list) else [gen_eos]))
    mask = config["mask_token_id"]
    assert mask not in tok.stop_ids and tok.decode([mask]) == ""  # a special: skipped in answers


@pytest.mark.parametrize("arch", ARCHS)
def test_completion_prompt_is_raw_text(toks, arch):
    tok = toks[arch]
    ids = tok.completion_ids(MULTILINGUAL)
    assert tok.decode(ids) == MULTILINGUAL  # no template around it
    assert tok.completion_ids([5, 6, 7]) == [5, 6, 7]  # token ids pass through


def test_generation_defaults_come_from_the_checkpoint(toks, hf_checkpoints):
    seen = {}
    for arch, tok in toks.items():
        gen = json.loads((hf_checkpoints[arch] / "generation_config.json").read_text())
        if gen.get("do_sample", True) and gen.get("temperature"):
            assert tok.generation_defaults["temperature"] == gen["temperature"]
            seen[arch] = tok.generation_defaults
        else:
            assert tok.generation_defaults == {}
    assert seen, "at least one fixture family carries sampling defaults"


def test_a_model_without_template_gets_the_plain_format(hf_checkpoint_notemplate):
    tok = load_tokenizer(hf_checkpoint_notemplate)
    assert not tok.has_chat_template
    text = tok.decode(tok.chat_ids(CHAT[:2], 8))
    assert text == "System: Be brief.\n\nUser: Grüße? 日本\n\nAssistant:"
    assert plain_chat(CHAT[:2], add_generation_prompt=False) == "System: Be brief.\n\nUser: Grüße? 日本"
    assert tok.prompt_ids("hi", 8) == tok.chat_ids([{"role": "user", "content": "hi"}], 8)


# ---------------------------------------------------------------- streamed text


def stream_pieces(decode, ids: list[int], sizes) -> list[str]:
    dec, pieces, i, k = IncrementalDecoder(decode), [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)]
        pieces.append(dec.push(ids[i:i + n]))
        i, k = i + n, k + 1
    pieces.append(dec.flush())
    return pieces


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("sizes", [(1,), (2, 1, 3), (5,)])
def test_streamed_pieces_never_split_a_character(toks, arch, sizes):
    tok = toks[arch]
    text = MULTILINGUAL + " Ünïcödé 🙂🚀 end"
    ids = tok.encode(text)
    # byte-level BPE: some characters take several tokens (an emoji's bytes are split)
    assert any("\ufffd" in tok.decode(ids[:k]) for k in range(1, len(ids)))
    pieces = stream_pieces(tok.decode, ids, sizes)
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


def test_an_invalid_byte_is_streamed_once_text_follows_it(toks):
    tok = toks["dream"]
    emoji = tok.encode("🙂")
    assert len(emoji) > 1
    ids = emoji[:1] + tok.encode(" ok, and more text")  # a lone lead byte: never completed
    pieces = stream_pieces(tok.decode, ids, (1,))
    assert "".join(pieces) == tok.decode(ids)
    assert sum(p.count("\ufffd") for p in pieces) == tok.decode(ids).count("\ufffd")


def byte_decode(ids) -> str:
    return bytes(ids).decode("utf-8", "replace")


def push_all(out: OutputText, text: str) -> str:
    return "".join(out.push([b]) for b in text.encode()) + out.finish()


def test_stop_strings_end_the_text_before_them_streamed_or_not():
    out = OutputText(byte_decode, ["日本", "zz"])
    streamed = push_all(out, "Grüße 日本 🙂 more")
    assert streamed == out.text == "Grüße " and out.stopped
    # no stop string: the whole text, and nothing that could begin one is held back at the end
    out = OutputText(byte_decode, ["zzz"])
    assert push_all(out, "abc zz d") == "abc zz d" and not out.stopped
    # a stop string split over many pushes is still found, and nothing of it was streamed
    out = OutputText(byte_decode, ["STOP"])
    pieces = [out.push([b]) for b in b"ab STOP cd"]
    assert "".join(pieces) == "ab " and out.stopped and out.finish() == ""


def test_earliest_stop_string_wins():
    out = OutputText(byte_decode, ["cd", "b"])
    assert push_all(out, "abcd") == "a"
