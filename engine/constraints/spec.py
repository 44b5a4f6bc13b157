"""What a request constrains its output to: a JSON schema, any JSON object, a regular expression, one of
some strings, or a context-free grammar (EBNF/GBNF or Lark). Pure data: it travels with a request (the
ingress builds it from the API's fields, the protocol carries it as a dict, a resumed request brings it
along) and keys the compiled-grammar cache."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class ConstraintSpec:
    """``kind`` is one of ``KINDS``; ``value`` its text: the schema as canonical JSON (``json_schema``), the
    regular expression, the choices as a JSON array of strings, or the grammar's text (``""`` for
    ``json_object``). ``param`` names the request field it came from (errors name it). ``any_whitespace``:
    JSON may hold any whitespace between tokens (False: the compact form)."""

    kind: str
    value: str = ""
    param: str = ""
    any_whitespace: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown constraint kind {self.kind!r}; known: {', '.join(KINDS)}")
        if not isinstance(self.value, str):
            raise ValueError(f"a {self.kind} constraint's value is text, got {type(self.value).__name__}")

    @classmethod
    def json_schema(cls, schema: dict | bool, param: str = "", any_whitespace: bool = True) -> ConstraintSpec:
        return cls("json_schema", canonical_json(schema), param, any_whitespace)

    @classmethod
    def choice(cls, choices: list[str], param: str = "") -> ConstraintSpec:
        return cls("choice", json.dumps(list(choices), ensure_ascii=False), param)

    @property
    def schema(self) -> dict | bool:
        if self.kind != "json_schema":
            raise ValueError(f"a {self.kind} constraint has no schema")
        return json.loads(self.value)

    @property
    def choices(self) -> list[str]:
        if self.kind != "choice":
            raise ValueError(f"a {self.kind} constraint has no choices")
        return json.loads(self.value)

    @property
    def key(self) -> str:
        """The cache key of its compiled grammar (the field it came from aside)."""
        raw = f"{self.kind}\0{int(self.any_whitespace)}\0{self.value}".encode("utf-8", "surrogatepass")
        return hashlib.sha256(raw).hexdigest()

    def to_dict(self) -> dict:
        return {"kind": self.kind, "value": self.value, "param": self.param, "any_whitespace": self.any_whitespace}

    @classmethod
    def from_dict(cls, d: dict) -> ConstraintSpec:
        unknown = set(d) - {"kind", "value", "param", "any_whitespace"}
        if unknown:
            raise ValueError(f"unknown constraint fields {sorted(unknown)}")
        if "kind" not in d:
            raise ValueError("a constraint needs its 'kind'")
        return cls(str(d["kind"]), d.get("value", ""), str(d.get("param", "")), bool(d.get("any_whitespace", True)))


def canonical_json(value) -> str:
    """``value`` as compact JSON text: equal schemas, equal text (one cache entry). Keys keep their order: a
    schema's property order is the order the document writes them in."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
