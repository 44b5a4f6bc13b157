"""The commands an instance takes: one typed vocabulary from the wire to the runner.

``engine/progress.py`` types what a round loop emits; this module types what it takes in. The same records
travel from the ingress to a replica (``app.protocol`` encodes them for the control channel), from the
replica server to its round loop (``RoundLoop.put``), and from an instance to its tensor-parallel follower
ranks (``Instance(mirror=...)``, ``Follower.step``):

- ``Add``: run a request: its prompt ids, its ``SamplingParams`` (max_tokens, threshold, sampling, decoding
  rule: the one shape of a request's decoding from the API to the runner), and, for a request resumed
  elsewhere (a failover, a migration), the output tokens already committed and the state of its current
  block (``Resume``: the block's canvas, its step counters and the decoding rule's state);
- ``Abort``: drop a request;
- ``Thresholds``: new knob values (thresholds) of requests' next steps and estimates of their remaining
  denoising rounds, from the router (``after_round``: the progress batch they answer);
- ``Lookahead``: rank 0's engine chose a request for its lookahead round (engine/observer.py): its followers
  must run the same shapes.

Like ``engine/progress.py`` it imports nothing but the standard library, so the wire protocol and the
ingress use it without the engine's torch.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any

SAMPLING_EPS = 1e-5  # temperatures below this decode greedily (dividing logits by less overflows float32)
MASKED = -1  # a masked position in ``Resume.tail``


@dataclass
class SamplingParams:
    """How one request decodes: its budget, its rule's knob, its sampling and its decoding rule."""

    max_tokens: int | None = None  # None: the model's default generation length
    threshold: float | None = None  # the rule's knob (the threshold for ``threshold``); None: the rule's own
    cache: str | None = None  # full-sequence models: 'none' | 'prefix' | 'dual'
    temperature: float = 0.0  # 0: greedy (argmax); > 0: each token sampled (decoding.sample)
    top_p: float = 1.0  # nucleus filter when sampling, in (0, 1]; 1: off
    top_k: int = 0  # top-k filter when sampling; 0 or -1: off
    seed: int | None = None  # the sampling noise's seed; None: the engine draws one per request
    stop_token_ids: tuple[int, ...] = ()  # ids that end the output as the model's EOS does
    ignore_eos: bool = False  # decode to max_tokens past the model's EOS (and its template's end-of-turn ids)
    logprobs: bool = False  # keep each committed token's log-probability (``Sequence.output_logprobs``)
    # the decoding rule (engine/decoding/) by its registered name and its configuration; None: the engine's
    # (the server's choice, else the checkpoint's, else ``threshold``). A config without a name configures the
    # engine's rule.
    decoding: str | None = None
    decoding_config: dict[str, Any] | None = None
    # structured outputs: what the text must be (``engine.constraints.ConstraintSpec.to_dict()``), enforced on
    # the canvas by the sequence's grammar guard (engine/constraints/canvas.py); None: any text
    constraint: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.stop_token_ids = tuple(self.stop_token_ids)  # a JSON list is welcome

    @property
    def samples(self) -> bool:
        """Whether tokens are sampled (temperature above ``SAMPLING_EPS``) rather than chosen greedily."""
        return self.temperature > SAMPLING_EPS

    def validate(self, limit: int) -> None:
        if self.max_tokens is not None and not 0 < self.max_tokens <= limit:
            raise ValueError(f"max_tokens must be in [1, {limit}], got {self.max_tokens}")
        if self.threshold is not None and (not isinstance(self.threshold, numbers.Real)
                                           or not math.isfinite(self.threshold)):
            raise ValueError(f"threshold must be a finite number, got {self.threshold!r}")
        if self.cache not in (None, "none", "prefix", "dual"):
            raise ValueError(f"cache must be 'none', 'prefix' or 'dual', got {self.cache!r}")
        if not isinstance(self.temperature, numbers.Real) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, numbers.Real) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, numbers.Integral) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= 1, or 0 or -1 (off), got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, numbers.Integral) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if any(not isinstance(t, numbers.Integral) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {list(self.stop_token_ids)!r}")
        if self.decoding is not None and not isinstance(self.decoding, str):
            raise ValueError(f"decoding must be a rule's name (a string), got {self.decoding!r}")
        if self.decoding_config is not None and not isinstance(self.decoding_config, dict):
            raise ValueError(f"decoding_config must be an object, got {self.decoding_config!r}")
        if self.constraint is not None:
            from engine.constraints.spec import ConstraintSpec

            ConstraintSpec.from_dict(self.constraint)  # a ValueError naming what is wrong

    _CONVERT = {"max_tokens": int, "threshold": float, "temperature": float, "top_p": float, "top_k": int,
                "seed": int}

    @classmethod
    def from_dict(cls, d: dict | None) -> SamplingParams:
        """From a dict of these fields (the ingress's, from a client's request; None values keep the defaults);
        an unknown field or a value of the wrong kind is a ``ValueError`` naming it."""
        d = {k: v for k, v in (d or {}).items() if v is not None}
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown sampling fields {sorted(unknown)}")
        kw: dict[str, Any] = {}
        for k, v in d.items():
            try:
                if k in cls._CONVERT:
                    if isinstance(v, (bool, str)) or not isinstance(v, numbers.Real):
                        raise TypeError(f"expected a number, got {type(v).__name__}")
                    kw[k] = cls._CONVERT[k](v)
                elif k == "stop_token_ids":
                    kw[k] = tuple(int(i) for i in v)
                elif k in ("ignore_eos", "logprobs"):
                    kw[k] = bool(v)
                elif k == "cache" or k == "decoding":
                    if not isinstance(v, str):
                        raise TypeError(f"expected a string, got {type(v).__name__}")
                    kw[k] = v
                else:  # decoding_config, constraint
                    if not isinstance(v, dict):
                        raise TypeError(f"expected an object, got {type(v).__name__}")
                    kw[k] = dict(v)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"bad sampling parameter {k}={v!r}: {exc}") from None
        return cls(**kw)


@dataclass(slots=True)
class Resume:
    """Where a request's current block stood when it left an instance, so that another continues it exactly
    (the same canvas, step counters and rule state): a failover or a migration. Output-relative: ``tail``
    follows the request's ``committed`` tokens up to its current block's end."""

    tail: list[int]  # the canvas after ``committed`` to the current block's end (``MASKED``: still masked)
    step_in_block: int = 0  # steps already taken on the current block
    masked_at_start: int = 0  # its masked positions when the block began
    state: dict[str, Any] = field(default_factory=dict)  # the decoding rule's state for the block (JSON)
    logprobs: list[float] = field(default_factory=list)  # of ``tail``'s committed tokens (0 where masked)


@dataclass(slots=True)
class Add:
    """Run a request. ``prompt_ids``: its prompt's token ids (in-process callers may pass text, which the
    engine tokenizes); ``committed`` (a resume): output tokens another instance already committed and
    published, with ``resume`` the state of the block after them."""

    req_id: str
    prompt_ids: list[int] | str
    params: SamplingParams = field(default_factory=SamplingParams)
    slo_left_s: float | None = None  # time left to its deadline as it was sent
    sent_at: float | None = None  # wall clock at sending (the replica reports the time to its round boundary)
    committed: list[int] = field(default_factory=list)
    resume: Resume | None = None
    canvas: bool = False  # its step items carry each denoising step's canvas
    est_rounds: float | None = None  # the router's estimate of its remaining denoising rounds (the scheduler's r_i)
    planned: bool = False  # every batch carrying it gets a ``Thresholds`` answer (its loop waits a little for it)
    attempt: int = 0  # its sender's count of its placements: carried back on its progress items


@dataclass(slots=True)
class Abort:
    req_id: str


@dataclass(slots=True)
class Thresholds:
    """``map``: new knob values (thresholds) of requests' next steps; ``estimates``: their remaining denoising
    rounds as of the end of round ``after_round`` (the batch this message answers; None: answers none)."""

    map: dict[str, float] = field(default_factory=dict)
    estimates: dict[str, float] = field(default_factory=dict)
    after_round: int | None = None


@dataclass(slots=True)
class Lookahead:
    """Rank 0 chose ``req_id`` to run its next round with ``blocks`` masked blocks appended (the observer's
    lookahead, engine/observer.py); a follower rank does the same, so every rank's forwards have one shape."""

    req_id: str
    blocks: int


Command = Add | Abort | Thresholds | Lookahead


def resolve_rule(base: Any, name: str | None, config: dict[str, Any] | None, where: str = ""):
    """The decoding rule a level of choice makes of the level below (``base``, a rule or None: ``threshold``
    with its defaults): the request over the server's rule, the server's over the checkpoint's. No name and no
    config: ``base`` itself. A config without a name, or with ``base``'s own name, configures ``base`` (its
    config updated); another name starts from that rule's defaults. ``where`` prefixes the field names in the
    ValueError an unknown rule (``<where>decoding``) or a bad config value (``<where>decoding_config``)
    raises."""
    from engine.decoding import RULES  # torch-free: the ingress validates with it too

    if base is None:
        base = RULES.make("threshold")
    if name is None and not config:
        return base
    if name is not None and not isinstance(name, str):
        raise ValueError(f"{where}decoding must be a rule's name, got {name!r}")
    if config is not None and not isinstance(config, dict):
        raise ValueError(f"{where}decoding_config must be an object, got {config!r}")
    if name is None or name == base.name:
        name, config = base.name, {**base.config(), **(config or {})}
    try:
        factory = RULES.factory(name)
    except ValueError:
        raise ValueError(f"{where}decoding: unknown decoding rule {name!r}; known: {', '.join(sorted(RULES))}") \
            from None
    # engine/decoding/renoise.py: DiffusionGemma's canvases only (over a canvas rule, its configuration)
    if getattr(factory, "canvas_rule", False) and not getattr(base, "canvas_rule", False):
        raise ValueError(f"{where}decoding: {name!r} decodes DiffusionGemma canvases, not this model's blocks")
    try:
        return RULES.make(name, **(config or {}))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}decoding_config: {exc}") from None
