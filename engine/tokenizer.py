"""Tokenizers: the embedded models' character tokenizer, the adapter over a checkpoint's own
``transformers`` tokenizer, and the text of an answer as its tokens commit.

- ``CharTokenizer``: the embedded default models' vocabulary, saved as a ``tokenizer.json`` that the
  ``tokenizers`` library and ``transformers.PreTrainedTokenizerFast`` load as they are; the class reads
  the same file without either library so the hot path stays a dict lookup.
- ``HFTokenizer``: a real checkpoint's tokenizer, chat template and ``generation_config.json``.
- ``IncrementalDecoder`` and ``OutputText``: streamed text that never splits a character, and ``stop``
  strings applied to the committed text.

Both tokenizers answer ``completion_ids`` (a completion prompt), ``chat_ids`` (a chat), ``prompt_ids``
(one user message: the CLI), ``encode`` and ``decode``.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ["<pad>", "<eos>", "<mask>", "<bos>", "<sep>", "<unk>"]
# The first 51 characters are the core task suite's; the last 7 write JSON and tool calls (structured outputs).
# tiny-bd and tiny-mdm hold 64 embedding rows, so the 6 specials and 58 characters fill them exactly; a
# checkpoint keeps the tokenizer.json it was trained with (tiny-mdm's has the first 51 characters only).
CHARS = list(" abcdefghijklmnopqrstuvwxyz0123456789.,:;?!=+-*()'\n") + list('{}[]"_\\')
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
                tok = "░" if tok == "<mask>" else tok
            out.append(tok)
        return "".join(out)

    def prompt_ids(self, prompt: str, block_size: int = 1) -> list[int]:
        """The chat template: <bos> prompt <sep>, left-padded to a block boundary
        so that the answer starts a block (no padding for a block size of 1 or 0: tiny-dg, whose canvases
        follow the prompt wherever it ends)."""
        ids = [self.bos_token_id, *self.encode(prompt), self.sep_token_id]
        pad = (-len(ids)) % block_size if block_size > 1 else 0
        return [self.pad_token_id] * pad + ids

    def completion_ids(self, prompt: str | list[int], block_size: int = 1) -> list[int]:
        """The embedded models keep their own format for completions too (``prompt_ids``)."""
        return self.prompt_ids(prompt, block_size) if isinstance(prompt, str) else list(prompt)

    def chat_ids(self, messages: list[dict], block_size: int = 1, add_generation_prompt: bool = True,
                 add_special_tokens: bool = False, chat_template: str | None = None,
                 tools: list[dict] | None = None) -> list[int]:
        """A chat for an embedded model: its messages' contents joined by newlines (or the text
        ``chat_template`` renders, with ``tools`` in its ``tools`` variable), in ``prompt_ids``'s format
        (which has its own specials). The built-in format has no place for tools."""
        if chat_template is not None:
            return self.prompt_ids(render_chat(chat_template, messages, add_generation_prompt, tools), block_size)
        return self.prompt_ids("\n".join(m["content"] for m in messages), block_size)

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
    """Adapter over a local ``transformers`` tokenizer (real LLaDA, Dream, SDAR and LLaDA2 checkpoints).

    Correct across the transformers versions ``pyproject.toml`` allows: chats are rendered to text by
    the checkpoint's own template and encoded here (``apply_chat_template(..., tokenize=True)`` returns
    a list in transformers 4 and a ``BatchEncoding`` in 5). ``stop_ids`` are the ids that end an answer:
    the EOS ids of ``generation_config.json`` and of the tokenizer, and the token the chat template puts
    after an assistant turn (``<|im_end|>``, ``<|eot_id|>``, ...). ``generation_defaults`` holds the
    checkpoint's sampling defaults (``temperature``, ``top_p``, ``top_k``; empty: greedy).
    """

    def __init__(self, directory: str | Path) -> None:
        from transformers import AutoTokenizer

        directory = Path(directory)
        self.tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False)
        self.eos_token_id = self.tok.eos_token_id
        self.pad_token_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos_token_id
        self.bos_token = self.tok.bos_token
        self.has_chat_template = bool(getattr(self.tok, "chat_template", None))
        gen = _read_json(directory / "generation_config.json")
        self.generation_defaults = generation_defaults(gen)
        ids = [*_ids(gen.get("eos_token_id")), *_ids(_read_json(directory / "config.json").get("eos_token_id"))]
        if self.eos_token_id is not None:
            ids.append(self.eos_token_id)
        end = self._end_of_turn()
        if end is not None:
            ids.append(end)
        self.stop_ids = tuple(dict.fromkeys(ids))

    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids, skip_special: bool = True) -> str:
        # no clean-up of spaces: the text of a list of ids is then the text of its pieces, joined
        return self.tok.decode(list(ids), skip_special_tokens=skip_special, clean_up_tokenization_spaces=False)

    def completion_ids(self, prompt: str | list[int], block_size: int = 0) -> list[int]:
        """A completion prompt: raw text with the tokenizer's own special tokens (a BOS where it adds
        one), as vLLM encodes it; token ids pass through."""
        if not isinstance(prompt, str):
            return list(prompt)
        return list(self.tok(prompt, add_special_tokens=True)["input_ids"])

    def chat_text(self, messages: list[dict], add_generation_prompt: bool = True,
                  chat_template: str | None = None, tools: list[dict] | None = None) -> str:
        """The chat as the model reads it: ``chat_template`` when given, else its own template, else the plain
        format (``plain_chat``). ``tools`` (OpenAI's function definitions) fill the template's ``tools``
        variable, where it has one."""
        if chat_template is not None or self.has_chat_template:
            return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                chat_template=chat_template, tools=tools or None)
        return (self.bos_token or "") + plain_chat(messages, add_generation_prompt)

    def chat_ids(self, messages: list[dict], block_size: int = 0, add_generation_prompt: bool = True,
                 add_special_tokens: bool = False, chat_template: str | None = None,
                 tools: list[dict] | None = None) -> list[int]:
        """A chat's ids; the template (``chat_template``, else the checkpoint's) writes the special tokens it
        wants (``add_special_tokens``: the tokenizer's own too, e.g. a BOS, as vLLM's ``/tokenize`` offers)."""
        text = self.chat_text(messages, add_generation_prompt, chat_template, tools)
        return list(self.tok(text, add_special_tokens=add_special_tokens)["input_ids"])

    def prompt_ids(self, prompt: str, block_size: int) -> list[int]:
        """One user message (the CLI's and the engine's text prompts)."""
        return self.chat_ids([{"role": "user", "content": prompt}], block_size)

    def _end_of_turn(self) -> int | None:
        """The special token the template writes right after an assistant message's content, if any."""
        if not self.has_chat_template:
            return None
        mark = "\u2063\u2063"  # a content the template passes through unchanged
        try:
            text = self.tok.apply_chat_template([{"role": "user", "content": "q"},
                                                 {"role": "assistant", "content": mark}], tokenize=False)
        except Exception:  # a template that wants other messages: no end-of-turn token then
            return None
        after = text.split(mark, 1)[1] if mark in text else ""
        ids = self.encode(after)
        special = set(self.tok.all_special_ids) | {i for i, t in self.tok.added_tokens_decoder.items() if t.special}
        return ids[0] if ids and ids[0] in special else None


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool = True,
                tools: list[dict] | None = None) -> str:
    """A Jinja chat template rendered in a sandbox (as Hugging Face renders them), for a tokenizer without
    ``apply_chat_template``; ``tools`` in its ``tools`` variable (None without tools, as Hugging Face)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                            tools=tools or None)


PLAIN_ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}


def plain_chat(messages: list[dict], add_generation_prompt: bool = True) -> str:
    """A chat for a model without a template: ``Role: content`` per message, a blank line between them,
    and ``Assistant:`` to start the answer::

        System: You are terse.

        User: Hello

        Assistant:"""
    parts = [f"{PLAIN_ROLES.get(m['role'], m['role'].title())}: {m['content']}" for m in messages]
    if add_generation_prompt:
        parts.append("Assistant:")
    return "\n\n".join(parts)


def generation_defaults(gen: dict) -> dict:
    """The sampling defaults of a ``generation_config.json``: greedy unless it samples."""
    if not gen.get("do_sample", True) or not gen.get("temperature"):
        return {}
    out = {"temperature": float(gen["temperature"])}
    if gen.get("top_p") is not None and float(gen["top_p"]) < 1.0:
        out["top_p"] = float(gen["top_p"])
    if gen.get("top_k"):
        out["top_k"] = int(gen["top_k"])
    return out


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


class IncrementalDecoder:
    """The text of a growing list of token ids, in pieces that never split a character.

    Each ``push`` decodes only a short window: the ids since the last piece, with the few before them
    for context (a byte-level or SentencePiece decode of a piece alone can differ from the same ids in
    context). A piece whose decode ends in U+FFFD (part of a multi-byte character) is held back until
    the ids that complete it arrive; ``flush`` returns what is left at the end, so the pieces joined are
    ``decode(all ids)``."""

    def __init__(self, decode) -> None:
        self._decode = decode
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # window start (context)
        self._read = 0  # ids already turned into text

    def push(self, ids) -> str:
        self.ids.extend(ids)
        if len(self.ids) == self._read:
            return ""
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd") or not after.startswith(before):
            return ""  # an unfinished character: wait for the rest of it
        piece = after[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += piece
        return piece

    def flush(self) -> str:
        """The rest of ``decode(all ids)`` (held-back bytes included, as U+FFFD if they never completed)."""
        full = self._decode(self.ids)
        self._prefix = self._read = len(self.ids)
        if not full.startswith(self.text):  # a decoder that rewrote earlier text: keep what was sent
            return ""
        piece = full[len(self.text):]
        self.text = full
        return piece


class OutputText:
    """A request's answer as its tokens commit: incremental decoding and ``stop`` strings.

    ``push(ids)`` and ``finish()`` return the text that may be streamed now: everything decoded except
    the last ``len(longest stop) - 1`` characters, which could begin a stop string. Once a stop string
    appears, the text ends before it, ``stopped`` is set, and nothing more is returned."""

    def __init__(self, decode, stop: list[str] | tuple[str, ...] = ()) -> None:
        self.decoder = IncrementalDecoder(decode)
        self.stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.sent = 0  # characters released
        self.stopped = False

    def push(self, ids) -> str:
        if self.stopped:
            return ""
        self.text += self.decoder.push(ids)
        return self._release(final=False)

    def finish(self) -> str:
        if not self.stopped:
            self.text += self.decoder.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stop and not self.stopped:
            start = max(0, self.sent - self._hold)
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[:max(min(hits), self.sent)]
                self.stopped = final = True
        end = len(self.text) if final else max(self.sent, len(self.text) - self._hold)
        piece = self.text[self.sent:end]
        self.sent = end
        return piece


def load_tokenizer(directory: str | Path):
    """The Remask character tokenizer when the directory holds one, else the HF tokenizer."""
    path = Path(directory) / "tokenizer.json"
    if path.exists():
        model = json.loads(path.read_text()).get("model", {})
        if model.get("type") == "WordLevel" and "<mask>" in model.get("vocab", {}):
            return CharTokenizer(model["vocab"])
    return HFTokenizer(directory)
