"""The messages of the control channel between the ingress and a Denoiser replica (``app.channel``).

Ingress -> replica:

- ``Hello``: the first frame of a connection, with the replica's secret;
- ``Add``: run a request (its prompt as token ids: it is tokenized once, at the ingress);
- ``Abort``: drop a request;
- ``Thresholds``: the router's thresholds and remaining-round estimates for the instance's requests,
  answering the progress batch of round ``after_round``.

Replica -> ingress:

- ``Ready``: the handshake succeeded;
- ``ProgressBatch``: one per round boundary, with a ``StepItem``, ``AcceptedItem`` or ``ErrorItem`` per
  request the boundary concerns (the round loop's records, ``engine.loop``; step items carry
  ``predictors.features.StepFeatures``);
- ``Tick``: the instance's stats, every ``tick_s`` (the ingress declares a replica dead when they stop);
- ``Draining``: the replica is shutting down; send it nothing new.

On the wire a message is one JSON object: ``{"op": <op name>, <field>: <value>, ...}``, the fields named
as in the dataclasses below, a field at its default value left out; a step item's features are a list in
``STEP_FEATURES`` order, a progress item names its kind in ``"item"``. ``encode``/``decode`` (and
``to_wire``/``from_wire`` for the JSON object) are the only serialisation, used by both ends. A frame
with an unknown op, an unknown item kind, a missing field or a field of the wrong type is a
``ProtocolError`` naming it; fields a message does not define are ignored (a newer peer may send more).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.loop import AcceptedItem, Done, ErrorItem, Item, ProgressBatch, StepItem
from predictors.features import STEP_FEATURES, StepFeatures

# the op names: nothing else in the tree spells them
HELLO = "hello"
READY = "ready"
ADD = "add"
ABORT = "abort"
THRESHOLDS = "thresholds"
BATCH = "batch"
TICK = "tick"
DRAINING = "draining"


class ProtocolError(ValueError):
    """A message that is not one of this protocol's. ``op`` and ``req_id`` are what could be read of it
    (so that a replica can refuse a malformed add by its id)."""

    def __init__(self, message: str, op: str | None = None, req_id: str | None = None) -> None:
        super().__init__(message)
        self.op, self.req_id = op, req_id


# ---- the messages (the progress records are engine.loop's) ----------------------------------------------

@dataclass(slots=True)
class Hello:
    secret: str


@dataclass(slots=True)
class Ready:
    pass


@dataclass(slots=True)
class Sampling:
    """A request's sampling parameters beyond max_tokens and threshold (``engine.sequence.SamplingParams``);
    None: the engine's default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: dict | None) -> Sampling:
        """From a dict of these fields (the ingress's, from a client's request); an unknown field or a value
        of the wrong kind is a ``ValueError``."""
        d = {k: v for k, v in (d or {}).items() if v is not None}
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown sampling fields {sorted(unknown)}")
        try:
            return cls(*(None if d.get(k) is None else conv(d[k]) for k, conv in
                         (("temperature", float), ("top_p", float), ("top_k", int), ("seed", int))),
                       stop_token_ids=[int(i) for i in d.get("stop_token_ids", ())])
        except (TypeError, ValueError) as exc:
            raise ValueError(f"bad sampling parameters {d}: {exc}") from None


@dataclass(slots=True)
class Add:
    """Run a request; ``committed`` (a resume): output tokens another instance already committed."""

    req_id: str
    prompt_ids: list[int]
    max_tokens: int | None = None  # None: the model's default
    threshold: float | None = None  # its first steps' threshold; None: the engine's rule's own
    slo_left_s: float | None = None  # time left to its deadline as it was sent
    sent_at: float | None = None  # wall clock at sending (the replica reports the time to its round boundary)
    committed: list[int] = field(default_factory=list)
    sampling: Sampling = field(default_factory=Sampling)
    canvas: bool = False  # its step items carry each denoising step's canvas
    est_rounds: float | None = None  # the router's estimate of its remaining denoising rounds (the scheduler's r_i)
    planned: bool = False  # every batch carrying it gets a ``Thresholds`` answer (its loop waits a little for it)
    attempt: int = 0  # its sender's count of its placements: carried back on its progress items


@dataclass(slots=True)
class Abort:
    req_id: str


@dataclass(slots=True)
class Thresholds:
    """``map``: new thresholds of requests' next steps; ``estimates``: their remaining denoising rounds as of
    the end of round ``after_round`` (the batch this message answers; None: answers none)."""

    map: dict[str, float] = field(default_factory=dict)
    estimates: dict[str, float] = field(default_factory=dict)
    after_round: int | None = None


@dataclass(slots=True)
class Tick:
    t: float  # wall clock
    stats: dict[str, Any] = field(default_factory=dict)  # ``RoundLoop.stats()``


@dataclass(slots=True)
class Draining:
    pass


Message = Hello | Ready | Add | Abort | Thresholds | ProgressBatch | Tick | Draining

# ---- the codec ---------------------------------------------------------------------------------------------
# A field's codec: (decode(value, where) -> value, encode(value) -> JSON value or None for "as it is").

_Codec = tuple[Callable[[Any, str], Any], Callable[[Any], Any] | None]
_MISSING = object()


def _fail(where: str, want: str, v: Any) -> ProtocolError:
    return ProtocolError(f"{where}: expected {want}, got {type(v).__name__} {v!r:.60}")


def _scalar(want: str, *types: type) -> _Codec:
    def dec(v, where):
        if type(v) in types:
            return v
        raise _fail(where, want, v)
    return dec, None


_STR = _scalar("a string", str)
_INT = _scalar("an integer", int)
_FLOAT = _scalar("a number", float, int)
_BOOL = _scalar("a boolean", bool)
_OBJECT = _scalar("an object", dict)


def _optional(codec: _Codec) -> _Codec:
    inner, enc = codec

    def dec(v, where):
        return None if v is None else inner(v, where)
    return dec, (None if enc is None else lambda v: None if v is None else enc(v))


def _ids(v, where):
    if type(v) is list and all(type(i) is int for i in v):
        return v
    raise _fail(where, "a list of token ids", v)


def _number_map(v, where):
    if type(v) is dict and all(type(x) in (float, int) for x in v.values()):
        return v
    raise _fail(where, "an object of numbers", v)


def _features(v, where):
    if type(v) is list and len(v) == len(STEP_FEATURES) and all(type(x) in (float, int) for x in v):
        return StepFeatures(*v)
    raise _fail(where, f"a list of the {len(STEP_FEATURES)} step features", v)


_IDS: _Codec = (_ids, None)
_NUMBERS: _Codec = (_number_map, None)
_FEATURES: _Codec = (_features, None)  # a NamedTuple is a JSON array as it is


class _Record:
    """How one dataclass travels: its fields' codecs (every field must have one)."""

    def __init__(self, cls: type, **codecs: _Codec) -> None:
        self.cls, self.name = cls, cls.__name__
        names = [f.name for f in dataclasses.fields(cls)]
        if set(codecs) != set(names):
            raise TypeError(f"{self.name}: codecs for {sorted(codecs)}, fields {names}")
        self.fields = []  # (name, default or _MISSING, decode, encode)
        for f in dataclasses.fields(cls):
            default = (f.default if f.default is not dataclasses.MISSING else
                       f.default_factory() if f.default_factory is not dataclasses.MISSING else _MISSING)
            self.fields.append((f.name, default, *codecs[f.name]))

    def to_wire(self, obj: Any, out: dict) -> dict:
        for name, default, _, enc in self.fields:
            v = getattr(obj, name)
            if default is _MISSING or v != default:
                out[name] = v if enc is None else enc(v)
        return out

    def from_wire(self, d: Any, where: str) -> Any:
        if type(d) is not dict:
            raise _fail(where, "an object", d)
        kw = {}
        for name, default, dec, _ in self.fields:
            v = d.get(name, _MISSING)
            if v is _MISSING:
                if default is _MISSING:
                    raise ProtocolError(f"{where}: missing field {name!r}")
                continue
            kw[name] = dec(v, f"{where}.{name}")
        return self.cls(**kw)

    def codec(self) -> _Codec:
        """This record as a field of another."""
        return (lambda v, where: self.from_wire(v, where)), (lambda v: self.to_wire(v, {}))


_DONE = _Record(Done, finish_reason=_STR, rounds=_INT, completion_tokens=_INT)
_SAMPLING = _Record(Sampling, temperature=_optional(_FLOAT), top_p=_optional(_FLOAT), top_k=_optional(_INT),
                    seed=_optional(_INT), stop_token_ids=_IDS)

# progress items: the kind's name on the wire (``"item"``) and its record
_ITEMS = {
    "step": _Record(StepItem, req_id=_STR, ids=_IDS, steps=_INT, heavy=_BOOL, features=_optional(_FEATURES),
                    canvas=_optional(_OBJECT), done=_optional(_DONE.codec()), attempt=_INT),
    "accepted": _Record(AcceptedItem, req_id=_STR, add_ms=_optional(_FLOAT), prompt_tokens=_INT, attempt=_INT),
    "error": _Record(ErrorItem, req_id=_STR, message=_STR, status=_INT, attempt=_INT),
}
_ITEM_KIND = {rec.cls: kind for kind, rec in _ITEMS.items()}


def _items_to_wire(items: list[Item]) -> list[dict]:
    out = []
    for item in items:
        kind = _ITEM_KIND[type(item)]
        out.append(_ITEMS[kind].to_wire(item, {"item": kind}))
    return out


def _items_from_wire(v: Any, where: str) -> list[Item]:
    if type(v) is not list:
        raise _fail(where, "a list of items", v)
    out = []
    for i, d in enumerate(v):
        rec = _ITEMS.get(d.get("item")) if type(d) is dict else None
        if rec is None:
            raise ProtocolError(f"{where}[{i}]: not a progress item (its \"item\" is none of {sorted(_ITEMS)})")
        out.append(rec.from_wire(d, f"{where}[{i}]"))
    return out


_MESSAGES = {
    HELLO: _Record(Hello, secret=_STR),
    READY: _Record(Ready),
    ADD: _Record(Add, req_id=_STR, prompt_ids=_IDS, max_tokens=_optional(_INT), threshold=_optional(_FLOAT),
                 slo_left_s=_optional(_FLOAT), sent_at=_optional(_FLOAT), committed=_IDS,
                 sampling=_SAMPLING.codec(), canvas=_BOOL, est_rounds=_optional(_FLOAT), planned=_BOOL,
                 attempt=_INT),
    ABORT: _Record(Abort, req_id=_STR),
    THRESHOLDS: _Record(Thresholds, map=_NUMBERS, estimates=_NUMBERS, after_round=_optional(_INT)),
    BATCH: _Record(ProgressBatch, t=_FLOAT, round=_INT, round_ms=_FLOAT, kinds=_NUMBERS, kind_tokens=_NUMBERS,
                   stats=_OBJECT, items=(_items_from_wire, _items_to_wire)),
    TICK: _Record(Tick, t=_FLOAT, stats=_OBJECT),
    DRAINING: _Record(Draining),
}
_OP = {rec.cls: op for op, rec in _MESSAGES.items()}
OPS = tuple(_MESSAGES)


def op_of(msg: Message) -> str:
    try:
        return _OP[type(msg)]
    except KeyError:
        raise ProtocolError(f"{type(msg).__name__} is not a message of the control channel") from None


def to_wire(msg: Message) -> dict:
    """The JSON object of ``msg``."""
    op = op_of(msg)
    return _MESSAGES[op].to_wire(msg, {"op": op})


def from_wire(d: Any) -> Message:
    """The message a JSON object holds; ``ProtocolError`` when it holds none."""
    if type(d) is not dict:
        raise ProtocolError(f"a message is a JSON object, got {type(d).__name__}")
    op = d.get("op")
    rec = _MESSAGES.get(op) if type(op) is str else None
    req_id = d.get("req_id") if type(d.get("req_id")) is str else None
    if rec is None:
        raise ProtocolError(f"unknown op {op!r} (the ops: {', '.join(OPS)})", None, req_id)
    try:
        return rec.from_wire(d, op)
    except ProtocolError as exc:
        exc.op, exc.req_id = op, req_id
        raise


def encode(msg: Message) -> bytes:
    """``msg`` as the bytes of one frame's body (compact JSON)."""
    return json.dumps(to_wire(msg), separators=(",", ":")).encode()


def decode(body: bytes | str) -> Message:
    """The message of one frame's body; ``ProtocolError`` for anything else (JSON that does not parse too)."""
    try:
        d = json.loads(body)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise ProtocolError(f"a frame must hold JSON ({exc})") from None
    return from_wire(d)
