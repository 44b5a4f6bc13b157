"""The synthetic, checkable task suite the embedded default models learn.

Five categories mirror the papers' workload mix so that denoising work is
heterogeneous and every answer can be checked:

- ``choice``: short exact answers (pick the letter of the largest/smallest);
- ``arith``: two-digit addition and single-digit products;
- ``reverse``: reverse a short word;
- ``prose``: free-form templated prose of 1-8 sentences with free word
  choices (several valid answers, so confidence is genuinely split) and a
  three-digit code that must hold exactly two 1s: every digit is a 1 with
  probability 2/3, so committing them all at once below that confidence
  writes ``111`` and fails, while one at a time always succeeds;
- ``lookup``: a long prompt of filler and a few ``key=value`` needles
  (one-letter keys, two-digit values), asking for one key's value.

A sixth category, ``json``, answers as small JSON objects (structured
outputs): ``json: max a3 b7 c1 d5`` is ``{"pick":"b","value":7}`` and
``json: sort 7 2 9`` is ``{"items":[2,7,9]}``; any document equal to that
object passes (whitespace and key order are free). It is kept out of
``CATEGORIES`` (the core suite the published accuracy figures are over) and
named in ``ALL_CATEGORIES``; ``JSON_SCHEMAS`` holds the JSON schema of each
form, which ``json_schema_for`` picks for a prompt.

Train and held-out examples are split by a hash of the prompt, so the
held-out set is never trained on.
"""

from __future__ import annotations

import json
import random
import re
import zlib
from dataclasses import dataclass

CATEGORIES = ("choice", "arith", "reverse", "prose", "lookup")
JSON = "json"
ALL_CATEGORIES = (*CATEGORIES, JSON)
NOUNS = ["cat", "dog", "fox", "owl", "bee", "cow", "pig", "hen", "elk", "ant", "yak", "emu"]
FILLER = ["the sky is blue.", "it is late.", "we like tea.", "the road is long.", "rain fell.",
          "a bell rang.", "the sea is wide.", "all is calm."]
# (template, {slot: [(word, weight), ...]}); {n} is the story's topic noun.
SENTENCES = [
    ("the {n} was {a}.", {"a": [("happy", 0.55), ("calm", 0.3), ("tired", 0.15)]}),
    ("it {v} by the {p}.", {"v": [("ran", 0.34), ("sat", 0.33), ("slept", 0.33)],
                            "p": [("river", 0.6), ("tree", 0.25), ("house", 0.15)]}),
    ("then the {n} {e}.", {"e": [("ate", 0.34), ("played", 0.33), ("rested", 0.33)]}),
    ("a {f} saw it.", {"f": [("boy", 0.5), ("girl", 0.5)]}),
    ("the {n} felt {g}.", {"g": [("good", 0.7), ("bad", 0.3)]}),
    ("it went {d}.", {"d": [("home", 0.6), ("away", 0.4)]}),
    ("it was {w} out.", {"w": [("sunny", 0.5), ("windy", 0.3), ("cold", 0.2)]}),
    ("the {n} sang.", {}),
]
CODES = ("110", "101", "011")
HELDOUT_MOD = 10
KEYS = "bcdfghjkmnpqrtvwxz"  # one-letter lookup keys


@dataclass(frozen=True)
class Example:
    category: str
    prompt: str
    answer: str  # one reference answer; check() accepts every valid one

    def check(self, output: str) -> bool:
        return check(self.category, self.prompt, output)


def is_heldout(prompt: str) -> bool:
    return zlib.crc32(prompt.encode()) % HELDOUT_MOD == 0


def _choice(rng: random.Random) -> tuple[str, str]:
    vals = rng.sample(range(10), 4)
    op = rng.choice(["max", "min"])
    best = (max if op == "max" else min)(vals)
    return f"{op}: " + " ".join(f"{k}{v}" for k, v in zip("abcd", vals)), "abcd"[vals.index(best)]


def _arith(rng: random.Random) -> tuple[str, str]:
    if rng.random() < 0.7:
        a, b = rng.randrange(100), rng.randrange(10)
        return f"{a}+{b}=", str(a + b)
    a, b = rng.randrange(10), rng.randrange(10)
    return f"{a}*{b}=", str(a * b)


def _reverse(rng: random.Random) -> tuple[str, str]:
    word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 6)))
    return f"rev: {word}", word[::-1]


def _pick(rng: random.Random, options: list[tuple[str, float]]) -> str:
    return rng.choices([w for w, _ in options], weights=[p for _, p in options])[0]


def _prose(rng: random.Random) -> tuple[str, str]:
    noun, n = rng.choice(NOUNS), rng.randint(1, len(SENTENCES))
    parts = []
    for template, slots in SENTENCES[:n]:
        parts.append(template.format(n=noun, **{k: _pick(rng, v) for k, v in slots.items()}))
    parts.append(f"code {rng.choice(CODES)}.")
    parts.append("the end.")
    return f"story: {noun} {n}", " ".join(parts)


def _lookup(rng: random.Random) -> tuple[str, str]:
    keys = rng.sample(KEYS, rng.randint(3, 4))
    items = [f"{k}={rng.randrange(100):02d}." for k in keys]
    items += rng.sample(FILLER, rng.randint(1, 4))
    rng.shuffle(items)
    key = rng.choice(keys)
    value = next(it for it in items if it.startswith(key + "="))[len(key) + 1:-1]
    return " ".join(items) + f" {key}?", value


def _json(rng: random.Random) -> tuple[str, str]:
    if rng.random() < 0.5:
        prompt, pick = _choice(rng)  # "max: a3 b7 c1 d5", "b"
        op, rest = prompt.split(": ", 1)
        value = int(dict((item[0], item[1:]) for item in rest.split())[pick])
        return f"json: {op} {rest}", json.dumps({"pick": pick, "value": value}, separators=(",", ":"))
    items = rng.sample(range(10), rng.randint(3, 4))
    return "json: sort " + " ".join(map(str, items)), json.dumps({"items": sorted(items)}, separators=(",", ":"))


# The JSON schema of each form of the ``json`` category: finite (enums, a bounded integer, a bounded array).
JSON_SCHEMAS = {
    "pick": {"type": "object", "properties": {"pick": {"enum": ["a", "b", "c", "d"]},
                                              "value": {"type": "integer", "minimum": 0, "maximum": 9}},
             "required": ["pick", "value"], "additionalProperties": False},
    "items": {"type": "object", "properties": {"items": {"type": "array", "minItems": 3, "maxItems": 4,
                                                         "items": {"type": "integer", "minimum": 0, "maximum": 9}}},
              "required": ["items"], "additionalProperties": False},
}


def json_schema_for(prompt: str) -> dict:
    """The schema of a ``json`` prompt's answers."""
    return JSON_SCHEMAS["items" if prompt.startswith("json: sort ") else "pick"]


def json_valid(prompt: str, text: str) -> bool:
    """Does ``text`` parse as a JSON document that ``json_schema_for(prompt)`` accepts? (checked here by hand,
    independently of any grammar engine: the schemas are finite and small)."""
    try:
        doc = json.loads(text)
    except ValueError:
        return False

    def digit(v) -> bool:
        return type(v) is int and 0 <= v <= 9

    if type(doc) is not dict:
        return False
    if prompt.startswith("json: sort "):
        items = doc.get("items")
        return set(doc) == {"items"} and type(items) is list and 3 <= len(items) <= 4 and all(map(digit, items))
    return set(doc) == {"pick", "value"} and doc["pick"] in ("a", "b", "c", "d") and digit(doc["value"])


def _json_answer(prompt: str) -> dict:
    body = prompt[len("json: "):]
    if body.startswith("sort "):
        return {"items": sorted(int(v) for v in body.split()[1:])}
    op, rest = body.split(" ", 1)
    pick = _choice_answer(f"{op}: {rest}")
    return {"pick": pick, "value": int(dict((item[0], item[1:]) for item in rest.split())[pick])}


GENERATORS = {"choice": _choice, "arith": _arith, "reverse": _reverse, "prose": _prose, "lookup": _lookup,
              JSON: _json}


def sample(rng: random.Random, category: str | None = None, split: str = "train") -> Example:
    """One example of ``category`` (uniform over the core categories when None)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', not {split!r}")
    if category is not None and category not in GENERATORS:
        raise ValueError(f"unknown category {category!r}; known: {', '.join(ALL_CATEGORIES)}")
    while True:
        cat = category or rng.choice(CATEGORIES)
        prompt, answer = GENERATORS[cat](rng)
        if is_heldout(prompt) == (split == "heldout"):
            return Example(cat, prompt, answer)


def heldout_set(n: int, seed: int = 2026, categories: tuple[str, ...] = CATEGORIES) -> list[Example]:
    """The fixed held-out evaluation set: n examples, ``categories`` in turn (the core five by default)."""
    rng = random.Random(seed)
    return [sample(rng, categories[i % len(categories)], split="heldout") for i in range(n)]


def _prose_pattern(noun: str, n: int) -> re.Pattern:
    parts = []
    for template, slots in SENTENCES[:n]:
        pat = re.escape(template).replace(re.escape("{n}"), noun)
        for k, options in slots.items():
            pat = pat.replace(re.escape("{" + k + "}"), "(?:" + "|".join(w for w, _ in options) + ")")
        parts.append(pat)
    parts.append("code (?:" + "|".join(CODES) + r")\.")
    parts.append(r"the end\.")
    return re.compile(" ".join(parts))


def check(category: str, prompt: str, output: str) -> bool:
    """Is ``output`` a correct answer to ``prompt``?"""
    out = output.strip()
    if category == "prose":
        m = re.fullmatch(r"story: (\w+) (\d+)", prompt)
        return bool(m) and bool(_prose_pattern(m.group(1), int(m.group(2))).fullmatch(out))
    if category == "choice":
        return out == _choice_answer(prompt)
    if category == "arith":
        a, op, b = re.fullmatch(r"(\d+)([+*])(\d+)=", prompt).groups()
        return out == str(int(a) + int(b) if op == "+" else int(a) * int(b))
    if category == "reverse":
        return out == prompt[len("rev: "):][::-1]
    if category == "lookup":
        key = prompt.rsplit(" ", 1)[1].rstrip("?")
        m = re.search(rf"(?:^| ){key}=(\d+)\.", prompt)
        return bool(m) and out == m.group(1)
    if category == JSON:
        try:
            doc = json.loads(out)
        except ValueError:
            return False
        return type(doc) is dict and doc == _json_answer(prompt) and all(
            type(v) is not bool for v in (doc.get("value"), *doc.get("items", ())))
    raise ValueError(f"unknown category {category!r}; known: {', '.join(ALL_CATEGORIES)}")


def _choice_answer(prompt: str) -> str:
    op, rest = prompt.split(": ", 1)
    vals = {item[0]: int(item[1:]) for item in rest.split()}
    pick = max if op == "max" else min
    return pick(vals, key=vals.get)
