"""Measure the grammar engines behind engine/constraints (xgrammar, llguidance) on the models' tokenizers:
compile time, per-token mask time and accept time along a valid document, rollback, and which JSON-schema
features each compiles. Prints one Markdown table per measure (reports/structured.md quotes them).

    OMP_NUM_THREADS=1 python -m scripts.grammar_bench [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from engine.constraints import BACKENDS, ConstraintSpec, Grammar, GrammarError, Vocab
from engine.tokenizer import CharTokenizer, HFTokenizer

# JSON-schema features (the issue's finite schemas first), each with a document it accepts (and in BAD, one it
# refuses)
SCHEMAS: dict[str, tuple[dict, object]] = {
    "enum": ({"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
              "additionalProperties": False}, {"color": "green"}),
    "boolean": ({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}, {"ok": True}),
    "bounded integer": ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
                         "required": ["n"]}, {"n": 42}),
    "bounded string": ({"type": "object", "properties": {"s": {"type": "string", "minLength": 1, "maxLength": 8}},
                        "required": ["s"]}, {"s": "abc"}),
    "pattern": ({"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-z]{2}[0-9]{3}$"}},
                 "required": ["id"]}, {"id": "ab123"}),
    "nested object": ({"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["b"]}}, "required": ["a"]},
        {"a": {"b": 3}}),
    "bounded array": ({"type": "object", "properties": {"xs": {"type": "array", "items": {"enum": [1, 2, 3]},
                                                                 "minItems": 1, "maxItems": 3}},
                       "required": ["xs"]}, {"xs": [1, 3]}),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 4}]}, "abc"),
    "$ref/$defs": ({"$defs": {"p": {"type": "object", "properties": {"x": {"type": "integer"}},
                                    "required": ["x"]}}, "type": "object",
                    "properties": {"p": {"$ref": "#/$defs/p"}}, "required": ["p"]}, {"p": {"x": 1}}),
    "const": ({"type": "object", "properties": {"v": {"const": "x"}}, "required": ["v"]}, {"v": "x"}),
    "number range": ({"type": "number", "minimum": 0, "maximum": 1}, 0.5),
    "nullable": ({"type": ["string", "null"]}, None),
    "format date": ({"type": "string", "format": "date"}, "2024-01-02"),
    "oneOf": ({"oneOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                          "additionalProperties": False},
                         {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"],
                          "additionalProperties": False}]}, {"b": "q"}),
    "recursive": ({"$defs": {"t": {"type": "object", "properties": {"kids": {"type": "array",
                                                                            "items": {"$ref": "#/$defs/t"}}}}},
                   "$ref": "#/$defs/t"}, {"kids": [{"kids": []}]}),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 2]),
    # JSON forbids raw control characters in strings (RFC 8259): the invalid document holds a raw U+0018
    "bounded string, no raw control chars": ({"type": "string", "maxLength": 6}, "ab"),
    "string, no raw control chars": ({"type": "string"}, "ab"),
}
BAD = {"bounded string, no raw control chars": '"a\x18"', "string, no raw control chars": '"a\x18"',
       'enum': '{"color": "pink"}',
       'boolean': '{"ok": 1}',
       'bounded integer': '{"n": 100}',
       'bounded string': '{"s": "abcdefghi"}',
       'pattern': '{"id": "abc12"}',
       'nested object': '{"a": {"b": 10}}',
       'bounded array': '{"xs": [1, 2, 3, 1]}',
       'anyOf': '"abcde"',
       '$ref/$defs': '{"p": {"x": "1"}}',
       'const': '{"v": "y"}',
       'number range': '1.5',
       'nullable': '1',
       'format date': '"2024-13-02"',
       'oneOf': '{"a": 1, "b": "q"}',
       'recursive': '{"kids": [{"kids": 1}]}',
       'uniqueItems': '[1, 1]'}
# the embedded character vocabulary has no braces or quotes: regular languages and choices only
CHAR_SPECS = [(ConstraintSpec("regex", r"(yes|no), [0-9]{1,3}\."), "yes, 42."),
              (ConstraintSpec.choice(["positive", "negative", "neutral"]), "neutral"),
              (ConstraintSpec("grammar", 'root ::= word (" " word)*\nword ::= [a-z]+'), "the quick brown fox")]


def vocabs() -> dict[str, tuple[Vocab, object]]:
    from tests.checkpoints import build_checkpoint

    out = {}
    char = CharTokenizer.default()
    out["tiny-bd (chars, 64)"] = (Vocab.of(char, 64, [1]), char)
    d = Path(tempfile.mkdtemp()) / "sdar"
    build_checkpoint("sdar", d)
    hf = HFTokenizer(d)
    size = json.loads((d / "config.json").read_text())["vocab_size"]
    out[f"sdar test checkpoint (byte-level BPE, {size})"] = (Vocab.of(hf, size, hf.stop_ids), hf)
    return out


def walk(grammar: Grammar, ids: list[int], stop: int, repeat: int) -> tuple[float, float, bool]:
    """Mean us per fill_mask and per accept along ``ids`` then a stop, and whether rolling back the whole
    document and replaying it gives the same masks."""
    masks, accepts = [], []
    for _ in range(repeat):
        m = grammar.matcher()
        for t in [*ids, stop]:
            t0 = time.perf_counter()
            allowed = m.fill_mask()
            t1 = time.perf_counter()
            if not allowed[t]:
                raise AssertionError(f"token {t} not allowed at {m.accepted}")
            ok = m.accept(t)
            t2 = time.perf_counter()
            if not ok:
                raise AssertionError(f"token {t} refused at {m.accepted}")
            masks.append(t1 - t0)
            accepts.append(t2 - t1)
    m = grammar.matcher()
    first = []
    for t in ids:
        first.append(m.fill_mask().copy())
        m.accept(t)
    m.rollback(len(ids))
    same = True
    for t, before in zip(ids, first):
        same &= bool((m.fill_mask() == before).all())
        m.accept(t)
    return statistics.mean(masks) * 1e6, statistics.mean(accepts) * 1e6, same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    rows, coverage = [], {}
    for vname, (vocab, tok) in vocabs().items():
        is_char = vocab.pieces is not None
        specs = CHAR_SPECS if is_char else [(ConstraintSpec.json_schema(s), json.dumps(doc))
                                            for s, doc in SCHEMAS.values()]
        for backend in BACKENDS:
            compile_ms, mask_us, accept_us, rollback = [], [], [], True
            for spec, doc in specs:
                t0 = time.perf_counter()
                try:
                    g = Grammar.compile(spec, vocab, backend)
                except GrammarError:
                    continue
                compile_ms.append((time.perf_counter() - t0) * 1e3)
                ids = tok.encode(doc)
                try:
                    mu, au, same = walk(g, ids, vocab.stop_ids[0], args.repeat)
                except AssertionError:  # a tokenization the grammar does not take (non-canonical): skipped
                    continue
                mask_us.append(mu)
                accept_us.append(au)
                rollback &= same
            rows.append((vname, backend, len(mask_us), statistics.median(compile_ms), statistics.mean(mask_us),
                         statistics.mean(accept_us), rollback))
            if not is_char:
                for name, (schema, doc) in SCHEMAS.items():
                    try:
                        g = Grammar.compile(ConstraintSpec.json_schema(schema), vocab, backend)
                        m = g.matcher()
                        ids = tok.encode(json.dumps(doc))
                        ok = m.accept_prefix(ids) == len(ids) and m.can_end()
                        bad = BAD[name]
                        m2 = g.matcher()
                        strict = not (m2.accept_prefix(tok.encode(bad)) == len(tok.encode(bad)) and m2.can_end())
                        coverage.setdefault(name, {})[backend] = "yes" if ok and strict else (
                            "loose (accepts an invalid document)" if ok else "rejects a valid document")
                    except GrammarError as exc:
                        coverage.setdefault(name, {})[backend] = f"no ({str(exc)[:40]})"
    print("| vocabulary | backend | specs walked | compile ms (median) | fill_mask us/token | accept us/token |"
          " rollback replays |")
    print("|---|---|---|---|---|---|---|")
    for v, b, n, c, mu, au, r in rows:
        print(f"| {v} | {b} | {n} | {c:.2f} | {mu:.1f} | {au:.1f} | {'yes' if r else 'NO'} |")
    print()
    print("| JSON-schema feature | " + " | ".join(BACKENDS) + " |")
    print("|---|" + "---|" * len(BACKENDS))
    for name, by in coverage.items():
        print(f"| {name} | " + " | ".join(by.get(b, "-") for b in BACKENDS) + " |")


if __name__ == "__main__":
    main()
