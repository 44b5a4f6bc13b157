"""The decoding-rule seam: what a rule sees of one step of one request's current block (``BlockStep``),
what it answers (``Decision``), the interface every rule implements (``DecodingRule``) and the registry
that makes rules by name (``RULES``, ``make_rule``).

A rule decides, from one step's per-position proposals (token and its probability, and the statistics it
asked for in ``needs``) and its own per-block ``state``, which masked positions of the block to commit now
and which already committed output positions to rewrite (an editing rule, LLaDA2.1's token-to-token
edits). It never touches the model, the device or the canvas: the engine builds the ``BlockStep`` from the
runner's rows and applies the ``Decision`` (``apply_decision`` is the plain reference of that last part).

Refinements of the contract (``_notes``' starting point), so consumers know what they may rely on:

- ``BlockStep``'s arrays are host NumPy and block-relative (index 0 is the block's first position; a
  block-causal model's first output block may begin inside the prompt: those positions are neither
  ``masked`` nor ``editable``). ``tokens`` and ``conf`` (and ``entropy``) are meaningful at ``masked``
  positions, and also at ``editable`` ones when the rule names ``"all_rows"`` in ``needs``; elsewhere they
  hold anything (builders put token -1 and 0.0 there). ``current_prob`` is the probability, under this
  step's distribution, of the token now on the canvas (0 at a masked position). ``canvas`` (a field added
  after ``state``, filled when the rule names ``"canvas"`` in ``needs``) is the block's token ids before
  the step (the mask id at masked positions): an editing rule compares its proposals with it.
- ``knob`` may be None: the rule then uses its configured value (``default_knob()``). The router speaks
  one scale for every rule, the candidate *level* (today's thresholds, 0.5 ... 0.9: higher is slower and
  more careful); ``rule.knob_at(level)`` turns a level into the rule's own knob, monotonically, in the
  rule's slower direction as the level rises (``threshold``: the level itself). A request's router-chosen
  threshold therefore reaches a rule as ``knob_at(threshold)``.
- ``state`` is one dict per request *per block*: the engine passes the same dict at every step of a block
  and a fresh ``{}`` when the next block begins, and carries it (JSON) through resume and migration. A
  rule keeps only JSON values in it (lists, not arrays).
- ``Decision.done``: the block is final. For a rule that never edits it is "nothing is left masked after
  this commit"; an editing rule may keep a block open (``done`` False with nothing masked) while it edits,
  up to its own bound.
- Every rule also has ``config()`` (the JSON keyword arguments that rebuild it with
  ``make_rule(rule.name, **rule.config())``), ``check_knob(value)`` (a ValueError naming the knob and its
  range) and, for the code that still calls it, the single-step ``select(conf, step_in_block,
  masked_at_start, threshold)`` of the old ``UnmaskRule`` (stateless rules only: its state lives one step).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np

NEEDS_ENTROPY = "entropy"  # per-position entropy (nats) of the step's distribution
NEEDS_CURRENT_PROB = "current_prob"  # probability of the token now on the canvas
NEEDS_ALL_ROWS = "all_rows"  # rows (token, conf, ...) for every block position, not only the masked ones
NEEDS_CANVAS = "canvas"  # the block's token ids now (BlockStep.canvas)
KNOWN_NEEDS = frozenset({NEEDS_ENTROPY, NEEDS_CURRENT_PROB, NEEDS_ALL_ROWS, NEEDS_CANVAS})


@dataclass
class BlockStep:
    """What a rule sees of one request's current block at one step (host NumPy, block-relative, length L)."""

    masked: np.ndarray  # bool [L]: positions still masked before this step
    editable: np.ndarray  # bool [L]: committed output positions the rule may rewrite (never prompt positions)
    tokens: np.ndarray  # int64 [L]: this step's proposed token per position (argmax, or sampled)
    conf: np.ndarray  # float32 [L]: the model's probability of that token
    current_prob: np.ndarray | None = None  # float32 [L]: probability of the token now on the canvas
    entropy: np.ndarray | None = None  # float32 [L]: entropy (nats) of the position's distribution
    step_in_block: int = 0  # steps already taken on this block
    masked_at_start: int = 0  # masked positions when the block began
    knob: float | None = None  # the request's knob value for this step; None: the rule's configured one
    state: dict = field(default_factory=dict)  # the rule's per-request state for this block (JSON values)
    canvas: np.ndarray | None = None  # int64 [L]: the block's token ids before this step ("canvas" in needs)

    @property
    def size(self) -> int:
        return int(self.masked.shape[0])


@dataclass
class Decision:
    """A rule's answer for one step: what to commit, what to rewrite, whether the block is final."""

    commit: np.ndarray  # bool [L]: masked positions committed now with tokens[...]
    edit: np.ndarray  # bool [L]: editable positions rewritten now with tokens[...]
    done: bool  # the block is final: nothing masked and no edit will follow


@runtime_checkable
class DecodingRule(Protocol):
    name: str  # registry name
    knob: str  # the name of its quality/speed knob ("threshold", "k", "gamma", ...)
    knob_range: tuple[float, float]  # its allowed values, both ends included
    speed_sign: int  # +1: a higher knob is faster (gamma, k); -1: a lower knob is faster (threshold)
    needs: frozenset[str]  # per-position stats beyond conf/tokens (KNOWN_NEEDS)
    edits: bool  # whether it may rewrite committed tokens (streaming then holds a block until done)

    def default_knob(self) -> float: ...

    def knob_at(self, level: float) -> float: ...

    def check_knob(self, value: float) -> float: ...

    def config(self) -> dict[str, Any]: ...

    def decide(self, step: BlockStep) -> Decision: ...


# ---- small pieces the rules share -------------------------------------------------------------------

def real(name: str, value: Any, lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False) -> float:
    """``value`` as a float, or a ValueError naming ``name`` and its range (brackets say which ends are in)."""
    rng = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(float(value)) \
            or value < lo or value > hi or (lo_open and value == lo) or (hi_open and value == hi):
        raise ValueError(f"{name} must be a number in {rng}, got {value!r}")
    return float(value)


def integer(name: str, value: Any, lo: int, hi: int | None = None) -> int:
    """``value`` as an int, or a ValueError naming ``name`` and its range."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value)) \
            and float(value) == int(value):
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
        rng = f"[{lo}, {hi}]" if hi is not None else f"an integer >= {lo}"
        raise ValueError(f"{name} must be an integer in {rng}, got {value!r}" if hi is not None
                         else f"{name} must be {rng}, got {value!r}")
    return value


def at_least_top(conf: np.ndarray, chosen: np.ndarray, k: int, among: np.ndarray | None = None) -> np.ndarray:
    """``chosen`` (bool, over ``conf``) grown to at least ``k`` positions (or all of ``among``: default every
    position) by adding the most confident unchosen ones of ``among``; ties go to the lower index."""
    pool = np.ones(conf.shape, dtype=bool) if among is None else among
    k = min(max(int(k), 1), int(pool.sum()))
    have = int((chosen & pool).sum())
    if have >= k:
        return chosen
    chosen = chosen.copy()
    if k == 1 or k - have == 1:
        c = np.where(pool & ~chosen, conf, -np.inf)
        chosen[int(np.argmax(c))] = True
        return chosen
    c = np.where(pool & ~chosen, conf, -np.inf)
    order = np.argsort(-c, kind="stable")[: k - have]
    chosen[order] = True
    return chosen


def no_edit(step: BlockStep) -> np.ndarray:
    return np.zeros(step.size, dtype=bool)


def commit_only(step: BlockStep, commit: np.ndarray) -> Decision:
    """A non-editing rule's decision: commit ``commit`` (a subset of the masked positions), done when nothing
    stays masked."""
    commit = commit & step.masked
    return Decision(commit, no_edit(step), not bool((step.masked & ~commit).any()))


class RuleBase:
    """Shared behaviour of the built-in rules (frozen dataclasses): knob handling, config, the old select().

    A subclass sets the class attributes of the ``DecodingRule`` protocol, names its configured knob field
    in ``knob`` (a dataclass field of that name holds the default), and implements ``decide``."""

    name: ClassVar[str]
    knob: ClassVar[str]
    knob_range: ClassVar[tuple[float, float]]
    speed_sign: ClassVar[int]
    needs: ClassVar[frozenset[str]] = frozenset()
    edits: ClassVar[bool] = False
    knob_integral: ClassVar[bool] = False

    def default_knob(self) -> float:
        return getattr(self, self.knob)

    def check_knob(self, value: Any) -> float:
        lo, hi = self.knob_range
        if self.knob_integral:
            return integer(self.knob, value, int(lo), None if math.isinf(hi) else int(hi))
        return real(self.knob, value, lo, hi)

    def knob_at(self, level: float) -> float:
        """The knob for the router's candidate ``level`` (a threshold in [0, 1]; higher: slower, more careful).
        Threshold-knobbed rules use the level itself; others override this with a documented monotone map."""
        return self.check_knob(real("threshold", level, 0.0, 1.0))

    def knob_value(self, step: BlockStep) -> float:
        """This step's knob: the step's own (checked), or the configured default."""
        return self.default_knob() if step.knob is None else self.check_knob(step.knob)

    def config(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)  # type: ignore[arg-type]
                if f.init}

    def decide(self, step: BlockStep) -> Decision:  # pragma: no cover - every rule overrides it
        raise NotImplementedError

    # the old UnmaskRule interface, for callers not yet on BlockStep (one step, fresh state)
    def select(self, conf, step_in_block: int, masked_at_start: int, threshold: float | None = None):
        """Bool mask over ``conf`` (the block's masked positions, a tensor): which to commit now.
        ``threshold``: the request's router level (``knob_at``), None for the configured knob."""
        import torch

        c = conf.detach().float().cpu().numpy() if isinstance(conf, torch.Tensor) else np.asarray(conf, np.float32)
        n = c.shape[0]
        knob = None if threshold is None else self.knob_at(threshold)
        step = BlockStep(np.ones(n, dtype=bool), np.zeros(n, dtype=bool), np.full(n, -1, dtype=np.int64), c,
                         step_in_block=step_in_block, masked_at_start=masked_at_start, knob=knob, state={})
        return torch.from_numpy(self.decide(step).commit.copy())


# ---- the registry -----------------------------------------------------------------------------------

class Registry(Mapping[str, Callable[..., DecodingRule]]):
    """Decoding rules by name: ``make(name, **config)`` builds one, a ValueError naming the field for a bad
    config value or an unknown field, and one listing the known names for an unknown rule."""

    def __init__(self) -> None:
        self._factories: dict[str, Callable[..., DecodingRule]] = {}

    def register(self, factory: Callable[..., DecodingRule], name: str | None = None) -> Callable[..., DecodingRule]:
        key = name or getattr(factory, "name", None)
        if not isinstance(key, str) or not key:
            raise ValueError("a decoding rule needs a name")
        if key in self._factories and self._factories[key] is not factory:
            raise ValueError(f"decoding rule {key!r} is already registered")
        self._factories[key] = factory
        return factory

    def __getitem__(self, name: str) -> Callable[..., DecodingRule]:
        return self._factories[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._factories)

    def __len__(self) -> int:
        return len(self._factories)

    def factory(self, name: str) -> Callable[..., DecodingRule]:
        try:
            return self._factories[name]
        except (KeyError, TypeError):
            raise ValueError(f"unknown unmasking rule {name!r} (decoding); known: {', '.join(sorted(self))}") \
                from None

    def make(self, name: str, **config: Any) -> DecodingRule:
        factory = self.factory(name)
        if dataclasses.is_dataclass(factory):
            known = [f.name for f in dataclasses.fields(factory) if f.init]
            for key in config:
                if key not in known:
                    raise ValueError(f"unknown field {key!r} for decoding rule {name!r}; known: {', '.join(known)}")
        return factory(**config)


RULES = Registry()


def register(factory):
    """Class decorator: register a rule under its ``name``."""
    RULES.register(factory)
    return factory


def make_rule(name: str, **config: Any) -> DecodingRule:
    return RULES.make(name, **config)


def apply_decision(block: np.ndarray, step: BlockStep, decision: Decision) -> np.ndarray:
    """The reference of how a ``Decision`` lands on the canvas: a copy of ``block`` (the block's token ids,
    block-relative) with the committed and edited positions set to the step's proposed tokens. A commit
    outside the masked positions or an edit outside the editable ones is a ValueError (a rule's bug)."""
    if (decision.commit & ~step.masked).any():
        raise ValueError("a decision committed a position that was not masked")
    if (decision.edit & ~step.editable).any():
        raise ValueError("a decision edited a position that was not editable")
    if (decision.commit & decision.edit).any():
        raise ValueError("a decision both committed and edited a position")
    out = np.array(block, copy=True)
    write = decision.commit | decision.edit
    out[write] = step.tokens[write]
    return out
