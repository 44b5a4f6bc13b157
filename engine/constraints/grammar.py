"""The grammar engine behind one small interface: ``Grammar.compile(spec, vocab)`` and its ``Matcher``
(``fill_mask``, ``accept``, ``accept_prefix``, ``rollback``, ``can_end``, ``ended``).

Two backends implement it, both left-to-right token matchers with rollback: xgrammar (the default, chosen
by measurement: reports/structured.md) and llguidance. A ``Vocab`` is a model's vocabulary as the engines
see it: its width (the logits' columns, padding included), the ids that end the text, and either the
``transformers`` tokenizer (byte-level BPE, SentencePiece: the engine decodes each piece itself) or each
id's text (the embedded models' characters; None for special ids, which a grammar never produces).

Compiling is the expensive part (milliseconds to a second): ``compile_cached`` compiles each distinct
(spec, vocab, backend) once; callers on an event loop run it in a thread.
"""

from __future__ import annotations

import functools
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from engine.constraints.spec import ConstraintSpec


class GrammarError(ValueError):
    """A constraint that does not compile (or that the model's vocabulary cannot write); ``param`` names
    the request field it came from."""

    def __init__(self, message: str, param: str = "") -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, eq=False)
class Vocab:
    """A model's vocabulary for the grammar engines (see the module doc). ``key`` identifies it in caches."""

    size: int
    stop_ids: tuple[int, ...]
    key: str
    hf: Any = None  # a transformers PreTrainedTokenizerFast
    pieces: tuple[str | None, ...] | None = None  # each id's text; None: special (never produced by a grammar)
    _cache: dict = field(default_factory=dict, repr=False)  # what `cached` computed once: backends' tokenizers, bounds

    def __post_init__(self) -> None:
        if (self.hf is None) == (self.pieces is None):
            raise ValueError("a Vocab has either a transformers tokenizer or its pieces")
        if not self.stop_ids:
            raise ValueError("a Vocab needs the ids that end the text (stop_ids)")

    def cached(self, key: str, build):
        """``build()``, computed once per vocabulary under ``key`` (a backend's tokenizer object, a bound)."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def text(self, token: int) -> str:
        """Token ``token``'s text ("" for a special or padding id)."""
        if self.pieces is not None:
            return self.pieces[token] or ""
        if token >= len(self.hf):
            return ""
        return self.hf.decode([token], skip_special_tokens=True, clean_up_tokenization_spaces=False)

    @classmethod
    def of(cls, tokenizer, size: int, stop_ids) -> Vocab:
        """The vocabulary of one of engine/tokenizer.py's tokenizers (``HFTokenizer``: its ``tok``;
        ``CharTokenizer``: its characters), ``size`` columns wide."""
        stops = tuple(dict.fromkeys(int(t) for t in stop_ids))
        hf = getattr(tokenizer, "tok", None)
        if hf is not None:
            return cls(size, stops, f"hf:{getattr(hf, 'name_or_path', '')}:{len(hf)}:{size}:{stops}", hf=hf)
        inverse = getattr(tokenizer, "inverse", None)
        if not isinstance(inverse, dict):
            raise ValueError(f"no grammar vocabulary for a {type(tokenizer).__name__}")
        from engine.tokenizer import SPECIALS

        pieces = tuple(None if (p := inverse.get(i)) is None or p in SPECIALS else p for i in range(size))
        return cls(size, stops, f"pieces:{hash(pieces)}:{size}:{stops}", pieces=pieces)


class Matcher(Protocol):
    """A grammar's state after the tokens accepted so far."""

    def fill_mask(self) -> np.ndarray:
        """bool [vocab.size]: the tokens the grammar allows next (a stop id only where it may end)."""
        ...

    def accept(self, token: int) -> bool:
        """Take ``token`` when the grammar allows it (True); else change nothing (False)."""
        ...

    def accept_prefix(self, tokens) -> int:
        """Take the longest allowed prefix of ``tokens``; its length."""
        ...

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens."""
        ...

    def can_end(self) -> bool:
        """Whether the text may end here."""
        ...

    def ended(self) -> bool:
        """Whether a stop id was accepted (nothing may follow)."""
        ...

    @property
    def accepted(self) -> int:
        """Tokens accepted so far (rollbacks subtracted)."""
        ...


def _unpack(bitmask: np.ndarray, size: int) -> np.ndarray:
    """int32 bitmask words (bit j of word i: token 32 i + j) -> bool [size]."""
    return np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), bitorder="little")[:size].astype(bool)


# ---------------------------------------------------------------- xgrammar


@functools.cache
def _xgr():
    import xgrammar

    return xgrammar


def _xgr_compiler(vocab: Vocab):
    def build():
        xgr = _xgr()
        if vocab.hf is not None:
            info = xgr.TokenizerInfo.from_huggingface(vocab.hf, vocab_size=vocab.size,
                                                      stop_token_ids=list(vocab.stop_ids))
        else:
            # RAW pieces; an empty piece is a special token (never allowed by a grammar, but the stop ids)
            info = xgr.TokenizerInfo([p or "" for p in vocab.pieces], xgr.VocabType.RAW, vocab_size=vocab.size,
                                     stop_token_ids=list(vocab.stop_ids))
        return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    return vocab.cached("xgrammar", build)


class XGrammarMatcher:
    def __init__(self, compiled, size: int, stops: tuple[int, ...]) -> None:
        xgr = _xgr()
        self._m = xgr.GrammarMatcher(compiled, max_rollback_tokens=-1)
        self._bits = xgr.allocate_token_bitmask(1, size)
        self._bits_np = self._bits.numpy()
        self.size = size
        self._stops = stops
        self._n = 0

    @property
    def accepted(self) -> int:
        return self._n

    def fill_mask(self) -> np.ndarray:
        self._m.fill_next_token_bitmask(self._bits)
        return _unpack(self._bits_np[0], self.size)

    def accept(self, token: int) -> bool:
        if self._m.is_terminated():
            return False
        ok = bool(self._m.accept_token(int(token)))
        self._n += ok
        return ok

    def accept_prefix(self, tokens) -> int:
        n = 0
        for t in tokens:
            if not self.accept(t):
                break
            n += 1
        return n

    def rollback(self, n: int) -> None:
        if n:
            if not 0 < n <= self._n:
                raise ValueError(f"cannot roll back {n} of {self._n} accepted tokens")
            self._m.rollback(n)
            self._n -= n

    def can_end(self) -> bool:
        return bool(self._m.is_completed())

    def ended(self) -> bool:
        return bool(self._m.is_terminated())


def _xgr_compile(spec: ConstraintSpec, vocab: Vocab):
    comp = _xgr_compiler(vocab)
    ws = spec.any_whitespace
    if spec.kind == "json_schema":
        return comp.compile_json_schema(spec.value, any_whitespace=ws, strict_mode=True,
                                        max_whitespace_cnt=whitespace_cap(vocab))
    if spec.kind == "json_object":
        return comp.compile_json_schema('{"type": "object"}', any_whitespace=ws, strict_mode=False,
                                        max_whitespace_cnt=whitespace_cap(vocab))
    if spec.kind == "regex":
        return comp.compile_regex(spec.value)
    if spec.kind == "choice":
        return comp.compile_regex("|".join(_regex_literal(c) for c in spec.choices))
    return comp.compile_grammar(spec.value)  # EBNF (GBNF)


def _regex_literal(text: str) -> str:
    return "".join("\\" + c if c in r".^$*+?{}[]\|()/" else c for c in text)


# ---------------------------------------------------------------- llguidance


@functools.cache
def _llg():
    import llguidance

    return llguidance


class _PiecesTokenizer:
    """llguidance's view of a pieces vocabulary: each id's bytes, and a greedy longest-match tokenizer."""

    def __init__(self, vocab: Vocab) -> None:
        self.tokens = [(p or f"<|special {i}|>").encode() for i, p in enumerate(vocab.pieces)]
        self.special_token_ids = [i for i, p in enumerate(vocab.pieces) if p is None]
        self.eos_token_id = vocab.stop_ids[0]
        self.bos_token_id = None
        self._ids = {p.encode(): i for i, p in enumerate(vocab.pieces) if p}
        self._longest = max((len(b) for b in self._ids), default=1)

    def __call__(self, data: bytes) -> list[int]:
        out, i = [], 0
        while i < len(data):
            for n in range(min(self._longest, len(data) - i), 0, -1):
                t = self._ids.get(data[i: i + n])
                if t is not None:
                    out.append(t)
                    i += n
                    break
            else:
                i += 1  # a byte no piece spells: skipped
        return out


def _llg_tokenizer(vocab: Vocab):
    def build():
        llg = _llg()
        if vocab.hf is not None:
            from llguidance.hf import from_tokenizer

            return from_tokenizer(vocab.hf, n_vocab=vocab.size, eos_token=list(vocab.stop_ids))
        return llg.LLTokenizer(llg.TokenizerWrapper(_PiecesTokenizer(vocab)), n_vocab=vocab.size,
                               eos_token=list(vocab.stop_ids))

    return vocab.cached("llguidance", build)


# JSON's whitespace between tokens: flexible, but bounded per gap (unbounded, a weak model can spend its whole
# budget on whitespace and never close the document); compact: none at all. The bound is two tokens of the
# vocabulary's own longest whitespace: 16 characters where a token holds eight or more spaces (BPE vocabularies),
# 2 on a character vocabulary (the embedded models), whose every space is a token and a denoising position.
WHITESPACE_TOKENS_PER_GAP = 2
WHITESPACE_CHARS_MAX = 16


def whitespace_cap(vocab: Vocab) -> int:
    """Characters of JSON whitespace allowed per gap on ``vocab`` (computed once per vocabulary)."""
    def build() -> int:
        longest = max((len(t) for t in map(vocab.text, range(vocab.size)) if t and not t.strip(" \n\r\t")),
                      default=1)
        return min(WHITESPACE_CHARS_MAX, WHITESPACE_TOKENS_PER_GAP * longest)

    return vocab.cached("whitespace_cap", build)


def json_whitespace(vocab: Vocab) -> str:
    return r"[\x20\x0A\x0D\x09]{0," + str(whitespace_cap(vocab)) + "}"


def _llg_compile(spec: ConstraintSpec, vocab: Vocab) -> str:
    llg = _llg()
    if spec.kind in ("json_schema", "json_object"):
        schema = spec.value if spec.kind == "json_schema" else '{"type": "object"}'
        options = ({"whitespace_flexible": True, "whitespace_pattern": json_whitespace(vocab)} if spec.any_whitespace
                   else {"whitespace_flexible": False})
        text = llg.LLMatcher.grammar_from_json_schema(schema, overrides=options)
    elif spec.kind in ("regex", "choice"):
        text = llg.grammar_from(spec.kind, spec.value)
    else:
        text = llg.grammar_from("grammar", spec.value)
    error = llg.LLMatcher.validate_grammar(text, _llg_tokenizer(vocab))
    if error:
        raise ValueError(error)
    return text


class LLGuidanceMatcher:
    def __init__(self, grammar: str, tokenizer, size: int, stops: tuple[int, ...]) -> None:
        llg = _llg()
        self._m = llg.LLMatcher(tokenizer, grammar)
        self.size = size
        self._stops = stops
        self._n = 0
        self._ended = False  # a stop id accepted (llguidance's is_stopped also means "nothing more may come")
        self._stop_pushed = False  # that stop id is in llguidance's own history (to roll back with the rest)

    @property
    def accepted(self) -> int:
        return self._n

    def fill_mask(self) -> np.ndarray:
        bits = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[: self.size].astype(bool)

    def accept(self, token: int) -> bool:
        return self.accept_prefix([token]) == 1

    def accept_prefix(self, tokens) -> int:
        tokens = [int(t) for t in tokens]
        if not tokens or self._ended:
            return 0
        stop = next((i for i, t in enumerate(tokens) if t in self._stops), len(tokens))
        tokens = tokens[: stop + 1]  # up to the first stop id, handled on its own below
        n = 0 if self._m.is_stopped() or stop == 0 else self._m.validate_tokens(tokens[:stop])
        if n and not self._m.consume_tokens(tokens[:n]):
            raise RuntimeError(f"llguidance refused tokens it validated: {self._m.get_error()}")
        self._n += n
        if n < len(tokens) and tokens[n] in self._stops and self._m.is_accepting():
            # a stop id where the grammar may end: validate_tokens does not count it, consuming it stops (and
            # enters llguidance's history only when the grammar had not stopped by itself)
            self._stop_pushed = not self._m.is_stopped()
            if not self._m.consume_token(tokens[n]):
                raise RuntimeError(f"llguidance refused a stop where it accepts: {self._m.get_error()}")
            self._n += 1
            self._ended = True
            n += 1
        return n

    def rollback(self, n: int) -> None:
        if n:
            if not 0 < n <= self._n:
                raise ValueError(f"cannot roll back {n} of {self._n} accepted tokens")
            inner = n - (1 if self._ended and not self._stop_pushed else 0)
            if inner:
                self._m.rollback(inner)
            self._n -= n
            self._ended = False

    def can_end(self) -> bool:
        return not self._ended and bool(self._m.is_accepting())

    def ended(self) -> bool:
        return self._ended


# ---------------------------------------------------------------- the interface

BACKENDS = ("xgrammar", "llguidance")
DEFAULT_BACKEND = "llguidance"


@dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled constraint for one vocabulary: immutable and shared by every request that asks for it;
    ``matcher()`` starts a request's state."""

    spec: ConstraintSpec
    vocab: Vocab
    backend: str
    compiled: Any

    @classmethod
    def compile(cls, spec: ConstraintSpec, vocab: Vocab, backend: str | None = None) -> Grammar:
        """Compile ``spec`` (a ``GrammarError`` naming ``spec.param`` when it does not compile, or when the
        vocabulary cannot write its first token)."""
        backend = backend or DEFAULT_BACKEND
        if backend not in BACKENDS:
            raise ValueError(f"unknown grammar backend {backend!r}; known: {', '.join(BACKENDS)}")
        try:
            compiled = (_xgr_compile if backend == "xgrammar" else _llg_compile)(spec, vocab)
        except Exception as exc:  # each engine raises its own kinds (RuntimeError, ValueError, ...)
            raise GrammarError(_first_line(exc), spec.param) from None
        grammar = cls(spec, vocab, backend, compiled)
        if not grammar._writable():
            raise GrammarError("this model's vocabulary cannot write any text the constraint allows",
                               spec.param)
        return grammar

    def _writable(self, steps: int = 4) -> bool:
        """Whether the vocabulary can write more than whitespace at the start: some token is allowed, and not
        only whitespace for ``steps`` tokens (JSON's optional leading whitespace on a vocabulary without
        braces or quotes would otherwise pass)."""
        m = self.matcher()
        stops = set(self.vocab.stop_ids)
        for _ in range(steps):
            ids = np.flatnonzero(m.fill_mask())
            if ids.size == 0:
                return False
            if any(int(t) in stops or not self.vocab.text(int(t)).isspace() for t in ids[:4096]):
                return True
            m.accept(int(ids[0]))
        return False

    def matcher(self) -> Matcher:
        if self.backend == "xgrammar":
            return XGrammarMatcher(self.compiled, self.vocab.size, self.vocab.stop_ids)
        return LLGuidanceMatcher(self.compiled, _llg_tokenizer(self.vocab), self.vocab.size, self.vocab.stop_ids)


def _first_line(exc: Exception) -> str:
    """An engine's error as one line for a client: without xgrammar's ``[time] file.cc:line:`` prefix."""
    text = str(exc).strip() or type(exc).__name__
    text = re.sub(r"^\[[0-9:]+\]\s*\S+:\d+:\s*", "", text)
    return re.sub(r"\s+", " ", text)[:500]


class GrammarCache:
    """Compiled grammars by (spec, vocabulary, backend), the least recently used dropped past ``size``;
    a failed compile is cached too (the same bad schema is refused again without compiling). Thread-safe:
    compiles run in worker threads."""

    def __init__(self, size: int = 256) -> None:
        self.size = size
        self._items: OrderedDict[tuple, Grammar | GrammarError] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0

    def get(self, spec: ConstraintSpec, vocab: Vocab, backend: str | None = None) -> Grammar:
        backend = backend or DEFAULT_BACKEND
        key = (spec.key, vocab.key, backend)
        with self._lock:
            hit = self._items.get(key)
            if hit is not None:
                self._items.move_to_end(key)
        if hit is None:
            try:
                hit = Grammar.compile(spec, vocab, backend)
            except GrammarError as err:
                hit = err
            with self._lock:
                self.compiles += 1
                self._items[key] = hit
                while len(self._items) > self.size:
                    self._items.popitem(last=False)
        if isinstance(hit, GrammarError):
            raise GrammarError(str(hit), spec.param)  # the asking request's field
        return hit


CACHE = GrammarCache()


def compile_cached(spec: ConstraintSpec, vocab: Vocab, backend: str | None = None) -> Grammar:
    """``spec`` compiled for ``vocab`` once per process (``CACHE``; ``backend``: ``DEFAULT_BACKEND``)."""
    return CACHE.get(spec, vocab, backend)
