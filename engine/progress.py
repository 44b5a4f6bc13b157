"""The progress records a round loop emits (engine/loop.py), one ``ProgressBatch`` per round boundary.

For every request that stepped, a ``StepItem`` (its newly committed token ids, its step count, whether its
next step is heavy, its step features, and ``done`` when it finished); an ``AcceptedItem`` or ``ErrorItem``
for requests accepted or refused at that boundary; and the instance's stats. The replica sends them as they
are; the wire protocol (``app.protocol``) encodes them for the control channel, so this module imports
nothing but the standard library (and engine/commands.py, the records going the other way).

``ids`` are final: with a decoding rule that edits committed tokens (``rule.edits``) only the tokens of
blocks whose edits are over are published, so a receiver's concatenated ids (and text) are never taken
back.

``attempt`` on every item is the ``attempt`` its request was submitted with, so that a receiver can tell
the progress of an older placement of the same request from the current one's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.commands import Resume


@dataclass(slots=True)
class Done:
    """How a request ended on this instance."""

    finish_reason: str  # "stop" (an EOS, a stop id or a stop string) or "length" (its max_tokens)
    rounds: int  # rounds it took part in
    completion_tokens: int  # output tokens committed in all (those committed before a resume included)


@dataclass(slots=True)
class StepItem:
    """A request took a step in the round just run."""

    req_id: str
    ids: list[int]  # output token ids committed since its last item
    steps: int  # rounds it has taken part in so far
    heavy: bool  # its next step is a prefill or a recompute
    features: Any = None  # ``describe``'s step features after the step (predictors.features.StepFeatures)
    canvas: dict | None = None  # the step's canvas (``Sequence.canvas_step``), for a request sent with ``canvas``
    done: Done | None = None  # set when it finished in this round
    attempt: int = 0
    logprobs: list[float] | None = None  # of ``ids``, for a request that asked for them
    # where its current block stands after ``ids`` (its canvas, step counters and decoding rule's state), for a
    # request whose rule edits tokens or keeps state: a resume elsewhere continues exactly from it
    resume: Resume | None = None


@dataclass(slots=True)
class AcceptedItem:
    """A request joined the instance at this round boundary."""

    req_id: str
    add_ms: float | None  # from its sender's dispatch (``sent_at``) to the round boundary; None without sent_at
    prompt_tokens: int  # prompt tokens (the output tokens committed before a resume not counted)
    attempt: int = 0


@dataclass(slots=True)
class ErrorItem:
    """A request was refused or failed; the instance holds it no more."""

    req_id: str
    message: str
    # 400 (a bad request), 429 (the instance is full or draining), 500 (its rounds failed: it is at fault),
    # 503 (the instance's rounds failed and it gave up on the request: resume it elsewhere)
    status: int
    attempt: int = 0


Item = StepItem | AcceptedItem | ErrorItem


@dataclass(slots=True)
class ProgressBatch:
    """What one round boundary reports."""

    t: float  # wall-clock emission time
    round: int  # rounds run so far (this batch follows round ``round``)
    round_ms: float  # the last round's time
    kinds: dict[str, int] = field(default_factory=dict)  # the last round's steps per step kind
    kind_tokens: dict[str, int] = field(default_factory=dict)  # and query tokens per step kind
    stats: dict[str, Any] = field(default_factory=dict)  # ``RoundLoop.stats()``
    items: list[Item] = field(default_factory=list)
