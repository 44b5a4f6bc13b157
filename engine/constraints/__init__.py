"""Structured outputs: what a request constrains its text to (``ConstraintSpec``), the grammar engine behind
one interface (``Grammar``, ``Matcher``, ``Vocab``, ``compile_cached``) and its enforcement on a diffusion
canvas (``engine.constraints.canvas``)."""

from engine.constraints.grammar import (
    BACKENDS,
    CACHE,
    DEFAULT_BACKEND,
    Grammar,
    GrammarCache,
    GrammarError,
    Matcher,
    Vocab,
    compile_cached,
)
from engine.constraints.spec import KINDS, ConstraintSpec, canonical_json

__all__ = ["BACKENDS", "CACHE", "DEFAULT_BACKEND", "Grammar", "GrammarCache", "GrammarError", "Matcher", "Vocab",
           "compile_cached", "KINDS", "ConstraintSpec", "canonical_json"]
