"""Character-level tokenizer of the embedded default models, in HF format.

The vocabulary is saved as a ``tokenizer.json`` that the ``tokenizers``
library and ``transformers.PreTrainedTokenizerFast`` load as they are; the
class here reads the same file without either library so the hot path stays
a dict lookup.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ["<pad>", "<eos>", "<mask>", "<bos>", "<sep>", "<unk>"]
CHARS = list(" abcdefghijklmnopqrstuvwxyz0123456789.,:;?!=+-*()'\n")
PAD, EOS, MASK, BOS, SEP, UNK = range(6)


class CharTokenizer:
    """Maps each character to one id; specials are never produced by encode()."""

    def __init__(self, vocab: dict[str, int]) -> None:
        self.vocab = dict(vocab)
        self.inverse = {i: t for t, i in self.vocab.items()}
        self.pad_token_id = self.vocab["<pad>"]
        self.eos_token_id = self.vocab["<eos>"]
        self.mask_token_id = self.vocab["<mask>"]
        self.bos_token_id = self.vocab["<bos>"]
        self.sep_token_id = self.vocab["<sep>"]
        self.unk_token_id = self.vocab["<unk>"]

    @classmethod
    def default(cls) -> CharTokenizer:
        return cls({t: i for i, t in enumerate(SPECIALS + CHARS)})

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        unk = self.unk_token_id
        return [self.vocab.get(c, unk) for c in text.lower()]

    def decode(self, ids, skip_special: bool = True) -> str:
        out = []
        for i in ids:
            tok = self.inverse.get(int(i), "")
            if tok in SPECIALS:
                if skip_special:
                    continue
                tok = "_" if tok == "<mask>" else tok
            out.append(tok)
        return "".join(out)

    def prompt_ids(self, prompt: str, block_size: int) -> list[int]:
        """The chat template: <bos> prompt <sep>, left-padded to a block boundary
        so that the answer starts a block."""
        ids = [self.bos_token_id, *self.encode(prompt), self.sep_token_id]
        pad = (-len(ids)) % block_size
        return [self.pad_token_id] * pad + ids

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        added = [
            {"id": self.vocab[t], "content": t, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True}
            for t in SPECIALS
        ]
        data = {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": added,
            "normalizer": {"type": "Lowercase"},
            "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "."}, "behavior": "Isolated", "invert": False},
            "post_processor": None,
            "decoder": {"type": "Fuse"},
            "model": {"type": "WordLevel", "vocab": self.vocab, "unk_token": "<unk>"},
        }
        (directory / "tokenizer.json").write_text(json.dumps(data, indent=1))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
            "mask_token": "<mask>", "sep_token": "<sep>", "unk_token": "<unk>",
            "chat_template": "<bos>{% for m in messages %}{{ m['content'] }}{% endfor %}<sep>",
        }
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))

    @classmethod
    def load(cls, directory: str | Path) -> CharTokenizer:
        data = json.loads((Path(directory) / "tokenizer.json").read_text())
        model = data.get("model", {})
        if model.get("type") != "WordLevel":
            raise ValueError(f"{directory}: not a Remask character tokenizer (model type {model.get('type')!r})")
        return cls(model["vocab"])


class HFTokenizer:
    """Adapter over a local ``transformers`` tokenizer (real LLaDA/Dream/SDAR checkpoints)."""

    def __init__(self, directory: str | Path) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False)
        self.eos_token_id = self.tok.eos_token_id
        self.pad_token_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos_token_id

    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids, skip_special: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special)

    def prompt_ids(self, prompt: str, block_size: int) -> list[int]:
        if getattr(self.tok, "chat_template", None):
            return list(self.tok.apply_chat_template([{"role": "user", "content": prompt}],
                                                     add_generation_prompt=True, tokenize=True))
        return self.tok.encode(prompt)


def load_tokenizer(directory: str | Path):
    """The Remask character tokenizer when the directory holds one, else the HF tokenizer."""
    path = Path(directory) / "tokenizer.json"
    if path.exists():
        model = json.loads(path.read_text()).get("model", {})
        if model.get("type") == "WordLevel" and "<mask>" in model.get("vocab", {}):
            return CharTokenizer(model["vocab"])
    return HFTokenizer(directory)
