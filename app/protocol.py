"""The messages of the control channel between the ingress and a Denoiser replica (``app.channel``).

Ingress -> replica:

- ``Hello``: the first frame of a connection, with the replica's secret and the protocol's ``VERSION``;
- ``Add``: run a request (its prompt as token ids: it is tokenized once, at the ingress; its ``params``,
  the engine's ``SamplingParams``: max_tokens, threshold, sampling, decoding rule and its config; for a resume,
  its committed tokens and the ``Resume`` state of its current block);
- ``Abort``: drop a request;
- ``Thresholds``: the router's thresholds and remaining-round estimates for the instance's requests,
  answering the progress batch of round ``after_round``.

These are the engine's own commands (``engine.commands``): the replica hands them to its round loop as they
are, and the loop's instance hands the same records to its tensor-parallel follower ranks.

Replica -> ingress:

- ``Ready``: the handshake succeeded (the replica's ``VERSION``: each end refuses another version, so
  that during a redeploy across a protocol change an ingress keeps to the replicas that speak its own);
- ``ProgressBatch``: one per round boundary, with a ``StepItem``, ``AcceptedItem`` or ``ErrorItem`` per
  request the boundary concerns (the round loop's records, ``engine.progress``; step items carry
  ``predictors.features.StepFeatures``);
- ``Tick``: the instance's stats, every ``tick_s`` (the ingress declares a replica dead when they stop);
- ``Draining``: the replica is shutting down; send it nothing new.

On the wire a message is one JSON object, ``{"op": <op name>, <field>: <value>, ...}``, its fields named
as in the dataclasses below, a field at its default value left out. A progress batch's items, the bulk
of the traffic (one per request per round), are JSON arrays instead: the item's kind (``"step"``,
``"accepted"``, ``"error"``), then its fields in the dataclass's order, the trailing ones at their
defaults left out; a step item's features are an array in ``STEP_FEATURES`` order. ``encode``/``decode``
(``to_wire``/``from_wire`` for the JSON object) are the only serialisation, used by both ends. A frame
with an unknown op, an unknown item kind, a missing field or a field of the wrong type is a
``ProtocolError`` that names the field (``batch.items[3].features: ...``); fields beyond those a message
defines are ignored (a newer peer may send more).
"""

from __future__ import annotations

import dataclasses
import json
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from engine.commands import Abort, Add, Resume, SamplingParams, Thresholds
from engine.progress import AcceptedItem, Done, ErrorItem, Item, ProgressBatch, StepItem
from predictors.features import STEP_FEATURES, StepFeatures

# of this protocol (1: the untyped dicts before it; 2: an add's max_tokens, threshold and sampling apart; 3: one
# ``params``, the engine's SamplingParams, with the decoding rule, and the resume state; 4: the params' structured-
# output constraint); bump it with any change a peer would misread
VERSION = 4

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
    """A message that is not one of this protocol's: ``reason``, at the field ``path`` names, of a message
    of op ``op``; ``req_id`` what could be read of its request id (so that a replica can refuse a malformed
    add by its id)."""

    def __init__(self, reason: str, op: str | None = None, req_id: str | None = None) -> None:
        super().__init__(reason)
        self.reason, self.op, self.req_id = reason, op, req_id
        self.path: list[str] = []  # field names and [list positions], outermost first

    def __str__(self) -> str:
        where = (self.op or "") + "".join(p if p.startswith("[") else f".{p}" for p in self.path)
        return f"{where.lstrip('.')}: {self.reason}" if where else self.reason


# ---- the messages (the commands are engine.commands', the progress records engine.progress's) -------------

@dataclass(slots=True)
class Hello:
    secret: str
    version: int  # the sender's VERSION (required: a peer from before versions sends none)


@dataclass(slots=True)
class Ready:
    version: int


@dataclass(slots=True)
class Tick:
    t: float  # wall clock
    stats: dict[str, Any] = field(default_factory=dict)  # ``RoundLoop.stats()``


@dataclass(slots=True)
class Draining:
    pass


Message = Hello | Ready | Add | Abort | Thresholds | ProgressBatch | Tick | Draining

# ---- the codec ---------------------------------------------------------------------------------------------

_MISSING = object()


class _Kind(NamedTuple):
    """How a field's value travels: the JSON types it may arrive as (``type(v) in types``), what to call
    them in an error, then a conversion or a deeper check of a value of those types (None: as it is; it
    raises ProtocolError), and how to write it (None: as it is). Neither sees None."""

    types: tuple[type, ...]
    want: str
    decode: Callable[[Any], Any] | None = None
    encode: Callable[[Any], Any] | None = None


class _Field(NamedTuple):
    name: str
    default: Any  # _MISSING: a required field
    types: tuple[type, ...]
    want: str
    decode: Callable[[Any], Any] | None
    encode: Callable[[Any], Any] | None


def _refuse(want: str, v: Any) -> ProtocolError:
    return ProtocolError(f"expected {want}, got {type(v).__name__} {v!r:.60}")


def _at(exc: ProtocolError, segment: str) -> ProtocolError:
    exc.path.insert(0, segment)
    return exc


def _optional(kind: _Kind) -> _Kind:
    return kind._replace(types=(*kind.types, type(None)), want=f"{kind.want} or null")


_INTS = {int}
_NUMS = {int, float}


def _ids(v: list) -> list:
    if set(map(type, v)) <= _INTS:
        return v
    raise _refuse("a list of token ids", v)


def _numbers(v: dict) -> dict:
    if set(map(type, v.values())) <= _NUMS:
        return v
    raise _refuse("an object of numbers", v)


def _floats(v: list) -> list:
    if set(map(type, v)) <= _NUMS:
        return v
    raise _refuse("a list of numbers", v)


def _features(v: list) -> StepFeatures:
    if len(v) == len(STEP_FEATURES) and set(map(type, v)) <= _NUMS:
        return tuple.__new__(StepFeatures, v)  # StepFeatures(*v), less the call
    raise _refuse(f"an array of the {len(STEP_FEATURES)} step features (numbers)", v)


_STR = _Kind((str,), "a string")
_INT = _Kind((int,), "an integer")
_FLOAT = _Kind((float, int), "a number")
_BOOL = _Kind((bool,), "a boolean")
_OBJECT = _Kind((dict,), "an object")
_IDS = _Kind((list,), "a list of token ids", _ids)
_FLOATS = _Kind((list,), "a list of numbers", _floats)
_ID_TUPLE = _Kind((list,), "a list of token ids", _ids, list)  # a tuple in the record (SamplingParams.stop_token_ids)
_NUMBERS = _Kind((dict,), "an object of numbers", _numbers)
_FEATURES = _Kind((list,), "an array of step features", _features, list)


class _Record:
    """How one dataclass travels, as a JSON object (``to_wire``/``from_wire``) or a JSON array in field
    order (``to_array``/``from_array``); every field has its ``_Kind``."""

    def __init__(self, cls: type, **kinds: _Kind) -> None:
        self.cls = cls
        fields = dataclasses.fields(cls)
        if set(kinds) != {f.name for f in fields}:
            raise TypeError(f"{cls.__name__}: kinds for {sorted(kinds)}, fields {[f.name for f in fields]}")
        self.fields = tuple(
            _Field(f.name, f.default if f.default is not dataclasses.MISSING else
                   f.default_factory() if f.default_factory is not dataclasses.MISSING else _MISSING,
                   *kinds[f.name]) for f in fields)
        self.required = sum(f.default is _MISSING for f in self.fields)  # dataclasses put them first
        # the array form's hot path: the fields with a conversion, all values at once, and the type signatures
        # (``tuple(map(type, values))``) already checked and found good: a few per record
        self._valid: set[tuple[type, ...]] = set()
        self._decoders = tuple((i, f.decode) for i, f in enumerate(self.fields) if f.decode is not None)
        self._encoders = tuple((i, f.encode) for i, f in enumerate(self.fields) if f.encode is not None)
        self._defaults = tuple(f.default for f in self.fields)
        self._values = operator.attrgetter(*(f.name for f in self.fields)) if len(self.fields) > 1 else None

    def as_kind(self) -> _Kind:
        """This record as a field of another (a JSON object)."""
        return _Kind((dict,), "an object", self.from_wire, lambda v: self.to_wire(v, {}))

    def to_wire(self, obj: Any, out: dict) -> dict:
        for f in self.fields:
            v = getattr(obj, f.name)
            if f.default is _MISSING or v != f.default:
                out[f.name] = v if f.encode is None or v is None else f.encode(v)
        return out

    def to_array(self, obj: Any, head: str) -> list:
        """``[head, values...]``, the trailing values at their defaults left out (arrays: two fields or more)."""
        out = [head, *self._values(obj)]
        for i, enc in self._encoders:
            if out[i + 1] is not None:
                out[i + 1] = enc(out[i + 1])
        n = len(out)
        while n > 1 + self.required and out[n - 1] == self._defaults[n - 2]:
            n -= 1
        del out[n:]
        return out

    def from_wire(self, d: dict) -> Any:
        kw = {}
        for f in self.fields:
            v = d.get(f.name, _MISSING)
            if v is _MISSING:
                if f.default is _MISSING:
                    raise ProtocolError(f"missing field {f.name!r}")
                continue
            if type(v) not in f.types:
                raise _at(_refuse(f.want, v), f.name)
            if f.decode is not None and v is not None:
                try:
                    v = f.decode(v)
                except ProtocolError as exc:
                    raise _at(exc, f.name) from None
            kw[f.name] = v
        return self.cls(**kw)

    def from_array(self, a: list) -> Any:
        """From ``a``'s values after its first (the kind); values beyond the fields are ignored."""
        if len(a) <= self.required:
            raise ProtocolError(f"missing field {self.fields[len(a) - 1].name!r}")
        args = a[1:len(self.fields) + 1]
        sig = tuple(map(type, args))
        if sig not in self._valid:
            for f, v in zip(self.fields, args):
                if type(v) not in f.types:
                    raise _at(_refuse(f.want, v), f.name)
            self._valid.add(sig)
        n = len(args)
        for i, dec in self._decoders:
            if i < n and args[i] is not None:
                try:
                    args[i] = dec(args[i])
                except ProtocolError as exc:
                    raise _at(exc, self.fields[i].name) from None
        return self.cls(*args)


_DONE = _Record(Done, finish_reason=_STR, rounds=_INT, completion_tokens=_INT)
_SAMPLING = _Record(SamplingParams, max_tokens=_optional(_INT), threshold=_optional(_FLOAT), cache=_optional(_STR),
                    temperature=_FLOAT, top_p=_FLOAT, top_k=_INT, seed=_optional(_INT), stop_token_ids=_ID_TUPLE,
                    ignore_eos=_BOOL, logprobs=_BOOL, decoding=_optional(_STR), decoding_config=_optional(_OBJECT),
                    constraint=_optional(_OBJECT))
_RESUME = _Record(Resume, tail=_IDS, step_in_block=_INT, masked_at_start=_INT, state=_OBJECT, logprobs=_FLOATS)

# progress items: their kind (an array's first value) and record
_ITEMS = {
    "step": _Record(StepItem, req_id=_STR, ids=_IDS, steps=_INT, heavy=_BOOL, features=_optional(_FEATURES),
                    canvas=_optional(_OBJECT), done=_optional(_DONE.as_kind()), attempt=_INT,
                    logprobs=_optional(_FLOATS), resume=_optional(_RESUME.as_kind())),
    "accepted": _Record(AcceptedItem, req_id=_STR, add_ms=_optional(_FLOAT), prompt_tokens=_INT, attempt=_INT),
    "error": _Record(ErrorItem, req_id=_STR, message=_STR, status=_INT, attempt=_INT),
}
_ITEM_KIND = {rec.cls: kind for kind, rec in _ITEMS.items()}


def _items_to_wire(items: list[Item]) -> list[list]:
    out = []
    for item in items:
        kind = _ITEM_KIND[type(item)]
        out.append(_ITEMS[kind].to_array(item, kind))
    return out


def _items_from_wire(v: list) -> list[Item]:
    out = []
    for a in v:
        rec = _ITEMS.get(a[0]) if type(a) is list and a and type(a[0]) is str else None
        try:
            if rec is None:
                raise ProtocolError(f"not a progress item (an array whose first value is one of {sorted(_ITEMS)})")
            out.append(rec.from_array(a))
        except ProtocolError as exc:
            raise _at(exc, f"[{len(out)}]") from None
    return out


_ITEM_LIST = _Kind((list,), "an array of progress items", _items_from_wire, _items_to_wire)

_MESSAGES = {
    HELLO: _Record(Hello, secret=_STR, version=_INT),
    READY: _Record(Ready, version=_INT),
    ADD: _Record(Add, req_id=_STR, prompt_ids=_IDS, params=_SAMPLING.as_kind(), slo_left_s=_optional(_FLOAT),
                 sent_at=_optional(_FLOAT), committed=_IDS, resume=_optional(_RESUME.as_kind()), canvas=_BOOL,
                 est_rounds=_optional(_FLOAT), planned=_BOOL, attempt=_INT),
    ABORT: _Record(Abort, req_id=_STR),
    THRESHOLDS: _Record(Thresholds, map=_NUMBERS, estimates=_NUMBERS, after_round=_optional(_INT)),
    BATCH: _Record(ProgressBatch, t=_FLOAT, round=_INT, round_ms=_FLOAT, kinds=_NUMBERS, kind_tokens=_NUMBERS,
                   stats=_OBJECT, items=_ITEM_LIST),
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
        return rec.from_wire(d)
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
