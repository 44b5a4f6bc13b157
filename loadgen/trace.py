"""Traces: one JSON object a line, one request each, sorted by arrival.

Every request's prompt is a held-out task-suite example, so the answer a server streams back can be
checked. Synthesis is deterministic in ``seed``: arrivals, lengths and prompts draw from separate
generators derived from it, so changing the arrival process keeps the same prompts.

Own prompts: ``remask loadgen synth --prompts-file FILE.jsonl`` takes the prompts from a JSONL file
(:func:`read_prompts`: one object a line with ``prompt`` or ``messages``, optional ``max_tokens``), in
file order, wrapping around when ``--n`` is larger than the file. They go into the trace like any other
request (category ``custom``, no reference answer, so they do not count towards accuracy), so the
replay stays one file in, and the arrivals, SLOs and thresholds of synthesis apply to them as well.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

import tasksuite as tasks
from loadgen.arrivals import ArrivalParams, arrivals
from loadgen.lengths import max_tokens_for, sample_lengths

CUSTOM = "custom"  # the category of prompts from a prompts file: no reference answer, never checked


@dataclass
class TraceRequest:
    request_id: str
    arrival_s: float
    endpoint: str  # "completion" | "chat"
    max_tokens: int | None
    category: str
    answer: str  # one reference answer; tasksuite.check accepts every valid one
    prompt: str | None = None  # completion requests
    messages: list[dict] | None = None  # chat requests
    threshold: float | None = None
    slo_ms: float | None = None
    priority: int = 0
    input_len: int | None = None  # nominal lengths from a length distribution, when one was used
    output_len: int | None = None
    extra: dict = field(default_factory=dict)  # more body fields, sent as they are (e.g. ignore_eos, temperature)

    @property
    def text(self) -> str:
        """The task prompt (a chat request carries it as its one user message)."""
        if self.prompt is not None:
            return self.prompt
        return "\n".join(_content_text(m.get("content")) for m in self.messages or [])

    def check(self, output: str) -> bool | None:
        """Is ``output`` a right answer? None for prompts without a reference answer (a prompts file's)."""
        if self.category not in tasks.CATEGORIES:
            return None
        return tasks.check(self.category, self.text, output)

    def body(self, model: str | None) -> dict:
        """The JSON body of this request (streamed, with usage)."""
        out: dict = {"stream": True, "stream_options": {"include_usage": True}}
        if model:
            out["model"] = model
        if self.endpoint == "chat":
            out["messages"] = self.messages
        else:
            out["prompt"] = self.prompt
        for key in ("max_tokens", "threshold", "slo_ms"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.priority:
            out["priority"] = self.priority
        out.update(self.extra)
        return out


def _content_text(content) -> str:
    if isinstance(content, list):  # OpenAI content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


PROMPT_KEYS = ("prompt", "messages", "max_tokens")


def _prompt_error(obj) -> str | None:
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {type(obj).__name__}"
    unknown = sorted(set(obj) - set(PROMPT_KEYS))
    if unknown:
        return f"unknown keys {unknown}; a line has prompt or messages, and optionally max_tokens"
    if ("prompt" in obj) == ("messages" in obj):
        return "needs exactly one of prompt (a string) or messages (a list of {role, content})"
    if "prompt" in obj and not (isinstance(obj["prompt"], str) and obj["prompt"]):
        return "prompt must be a non-empty string"
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs:
            return "messages must be a non-empty list"
        for i, m in enumerate(msgs):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), (str, list))):
                return f"messages[{i}] must be an object with a string role and a string (or parts) content"
    mt = obj.get("max_tokens")
    if mt is not None and (not isinstance(mt, int) or isinstance(mt, bool) or mt < 1):
        return f"max_tokens must be a positive integer, not {mt!r}"
    return None


def read_prompts(path: str | Path) -> list[dict]:
    """The prompts of a JSONL file: one object a line, ``{"prompt": "..."}`` (a completion) or
    ``{"messages": [{"role": "user", "content": "..."}]}`` (a chat), each with an optional ``max_tokens``.
    Blank lines are skipped; a bad line raises ValueError naming ``path:line``."""
    out = []
    for lineno, obj in _jsonl(path):
        if (err := _prompt_error(obj)) is not None:
            raise ValueError(f"{path}:{lineno}: {err}")
        out.append(obj)
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


@dataclass(frozen=True)
class SynthConfig:
    n: int = 200
    arrivals: str = "poisson"
    arrival_params: ArrivalParams = ArrivalParams()
    seed: int = 0
    mix: dict[str, float] | None = None  # category weights; uniform when None
    endpoint: str = "completion"  # "completion" | "chat" | "mixed"
    lengths: str | None = None  # None: max_tokens from the task alone
    max_tokens_cap: int = 256
    threshold: float | None = None
    slo_ms: float | None = None
    slo_ms_per_token: float = 0.0
    priorities: tuple[int, ...] = (0,)
    prompts: str = "sample"  # "sample": drawn with the seed; "eval": `remask eval`'s held-out set, in order
    eval_seed: int = 2026
    prompts_file: str | None = None  # own prompts (read_prompts), in file order, instead of the task suite


def _categories(rng: random.Random, n: int, mix: dict[str, float] | None) -> list[str]:
    if mix is None:
        return [rng.choice(tasks.CATEGORIES) for _ in range(n)]
    unknown = set(mix) - set(tasks.CATEGORIES)
    if unknown:
        raise ValueError(f"unknown categories {sorted(unknown)}; known: {', '.join(tasks.CATEGORIES)}")
    names = list(mix)
    return rng.choices(names, weights=[mix[c] for c in names], k=n)


def synth(cfg: SynthConfig) -> list[TraceRequest]:
    """A trace of ``cfg.n`` requests."""
    if cfg.endpoint not in ("completion", "chat", "mixed"):
        raise ValueError(f"endpoint must be completion, chat or mixed, not {cfg.endpoint!r}")
    seeds = np.random.SeedSequence(cfg.seed).spawn(3)
    t = arrivals(cfg.arrivals, cfg.n, cfg.arrival_params, np.random.default_rng(seeds[0]))
    lens = sample_lengths(cfg.lengths, cfg.n, np.random.default_rng(seeds[1])) if cfg.lengths else None
    rng = random.Random(int(seeds[2].generate_state(1)[0]))
    if cfg.prompts_file is not None:
        return _synth_from_file(cfg, t, lens, rng)
    if cfg.prompts == "eval":  # the very prompts `remask eval --n N` scores, so the two compare one to one
        examples = tasks.heldout_set(cfg.n, cfg.eval_seed)
    elif cfg.prompts == "sample":
        examples = [tasks.sample(rng, cat, split="heldout") for cat in _categories(rng, cfg.n, cfg.mix)]
    else:
        raise ValueError(f"prompts must be sample or eval, not {cfg.prompts!r}")
    out = []
    for i, ex in enumerate(examples):
        cat = ex.category
        in_len = int(lens[0][i]) if lens else None
        out_len = int(lens[1][i]) if lens else None
        max_tokens = max_tokens_for(ex, out_len, cfg.max_tokens_cap)
        kind = cfg.endpoint if cfg.endpoint != "mixed" else rng.choice(("completion", "chat"))
        slo = None if cfg.slo_ms is None else round(cfg.slo_ms + cfg.slo_ms_per_token * max_tokens, 3)
        out.append(TraceRequest(
            request_id=f"req-{i:06d}", arrival_s=round(float(t[i]), 6), endpoint=kind, max_tokens=max_tokens,
            category=cat, answer=ex.answer, prompt=ex.prompt if kind == "completion" else None,
            messages=[{"role": "user", "content": ex.prompt}] if kind == "chat" else None,
            threshold=cfg.threshold, slo_ms=slo, priority=rng.choice(cfg.priorities),
            input_len=in_len, output_len=out_len))
    return out


def _synth_from_file(cfg: SynthConfig, t, lens, rng: random.Random) -> list[TraceRequest]:
    """Requests with the prompts of ``cfg.prompts_file``: ``prompt`` lines go to ``cfg.endpoint`` (a chat gets
    the prompt as its one user message), ``messages`` lines always to chat; ``max_tokens`` from the line,
    else the nominal output length (``cfg.lengths``), else ``cfg.max_tokens_cap``."""
    lines = read_prompts(cfg.prompts_file)
    out = []
    for i in range(cfg.n):
        line = lines[i % len(lines)]
        out_len = int(lens[1][i]) if lens else None
        max_tokens = line.get("max_tokens") or (min(out_len, cfg.max_tokens_cap) if out_len else cfg.max_tokens_cap)
        if "messages" in line:
            kind, prompt, messages = "chat", None, line["messages"]
        else:
            kind = cfg.endpoint if cfg.endpoint != "mixed" else rng.choice(("completion", "chat"))
            prompt = line["prompt"] if kind == "completion" else None
            messages = [{"role": "user", "content": line["prompt"]}] if kind == "chat" else None
        slo = None if cfg.slo_ms is None else round(cfg.slo_ms + cfg.slo_ms_per_token * max_tokens, 3)
        out.append(TraceRequest(
            request_id=f"req-{i:06d}", arrival_s=round(float(t[i]), 6), endpoint=kind, max_tokens=max_tokens,
            category=CUSTOM, answer="", prompt=prompt, messages=messages, threshold=cfg.threshold, slo_ms=slo,
            priority=rng.choice(cfg.priorities), input_len=int(lens[0][i]) if lens else None, output_len=out_len))
    return out


def write_trace(trace: list[TraceRequest], path: str | Path) -> None:
    with open(path, "w") as f:
        for r in trace:
            f.write(json.dumps({k: v for k, v in asdict(r).items() if v is not None and v != {}}) + "\n")


def read_trace(path: str | Path) -> list[TraceRequest]:
    """Requests of a JSONL trace, sorted by arrival; raises ValueError on a malformed line."""
    out = []
    for lineno, obj in _jsonl(path):
        try:
            r = TraceRequest(**obj)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{lineno}: not a trace request ({exc})") from None
        if r.endpoint not in ("completion", "chat") or (r.prompt is None) == (r.messages is None):
            raise ValueError(f"{path}:{lineno}: needs endpoint completion with a prompt or chat with messages")
        out.append(r)
    return sorted(out, key=lambda r: r.arrival_s)


def _jsonl(path: str | Path):
    """(line number, object) of each non-blank line of a JSONL file; ValueError naming ``path:line`` for a
    line that is not JSON."""
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path}:{lineno}: not JSON ({exc})") from None
