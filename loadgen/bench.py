"""``remask loadgen bench``: vLLM's ``vllm bench serve`` on Remask's replay, so one command line compares
Remask, vLLM and SGLang.

The flags keep vLLM's names, defaults and meaning (``--base-url``/``--host``/``--port``, ``--endpoint``,
``--backend openai|openai-chat``, ``--model``, ``--tokenizer``, ``--num-prompts``, ``--request-rate``,
``--burstiness``, ``--max-concurrency``, ``--seed``, ``--dataset-name``, ``--random-*``, ``--ignore-eos``,
``--percentile-metrics``, ``--metric-percentiles``, ``--goodput``, ``--save-result``, ``--result-dir``,
``--result-filename``, ``--disable-tqdm``); the summary is printed as vLLM prints it and the saved JSON
carries vLLM's keys. Requests go out through :mod:`loadgen.replay` (open loop, the same client, timings
and ``--max-concurrency`` gate as ``remask loadgen replay``).

- **Datasets.** ``random``: ``--random-input-len`` tokens of the tokenizer (each prompt encodes to exactly
  that many; lengths drawn uniformly within ``--random-range-ratio``, a shared ``--random-prefix-len``
  prefix), ``--random-output-len`` as ``max_tokens``; as in vLLM, ``ignore_eos`` is sent for it.
  ``sharegpt``: a local ShareGPT JSON file (first turn the prompt, second turn's length the output
  length, vLLM's length filters). ``jsonl`` (vLLM's ``custom``): one ``{"prompt": ...}`` (or Remask's
  ``{"messages": [...]}``) a line. ``remask``: held-out task-suite prompts whose answers are checked.
  Structured outputs, as vLLM's structured-output benchmark names them: ``json`` (its prompt "Generate an
  example of a user profile given the following schema: ...", the schema of ``--json-schema-path`` or a
  built-in finite user profile, sent as ``structured_outputs.json``), ``regex`` and ``choice`` (held-out
  task-suite prompts with the regular language or the choices of their category's answers, which the
  embedded models can write: their vocabulary has no braces or quotes); ``--structured-output-ratio`` of the
  requests carry the constraint, and the validity of each constrained answer is counted.
  Nothing is downloaded.
- **Arrivals** as vLLM draws them: gamma gaps of shape ``--burstiness`` (1: Poisson) and mean
  ``1/--request-rate``, rescaled so the last request goes out at ``num_prompts / rate``; ``inf``: all at once.
- **Metrics** as vLLM computes them: over successful requests; TTFT to the first chunk with text, TPOT
  ``(e2el - ttft) / (output_len - 1)`` for requests with more than one output token, ITL every gap
  between chunks, E2EL the whole request; output lengths from the stream's usage (else the tokenizer's
  count of the text); a request is good when its TTFT, TPOT (0 with one token) and E2EL are within every
  ``--goodput`` bound. Empty metrics are 0, as in vLLM.
- **Remask's extras** stay, under the result's ``remask`` key and in a last block of the table: errors by
  kind, answer accuracy (``--dataset-name remask``, ``regex``, ``choice``), structured-output validity,
  per-request SLOs (``--slo-ms``) and their attainment, send lag and the wait for a concurrency slot.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

import numpy as np

from loadgen.client import RequestResult
from loadgen.metrics import parse_goodput, pct_name, summarize
from loadgen.trace import CUSTOM, PROMPT_KEYS, TraceRequest, _jsonl, _prompt_error

BACKENDS = {"openai": "completion", "openai-chat": "chat"}
DATASETS = ("random", "sharegpt", "jsonl", "custom", "remask", "json", "regex", "choice")  # custom: vLLM's jsonl
STRUCTURED = ("json", "regex", "choice")  # the structured-output datasets
# vLLM's structured-output benchmark prompts a user profile for a schema; this one is finite (every field bounded)
USER_PROFILE = {"type": "object", "additionalProperties": False, "required": ["name", "age", "email", "active"],
                "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 24},
                               "age": {"type": "integer", "minimum": 0, "maximum": 120},
                               "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.com$"},
                               "active": {"type": "boolean"},
                               "role": {"enum": ["admin", "user", "guest"]}}}
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
HEADERS = {"ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
           "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}
SHAREGPT_MIN_LEN, SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL = 4, 1024, 2048  # vLLM's filters for ShareGPT


@dataclass
class BenchPrompt:
    prompt: str | None  # a completion prompt (the chat backend sends it as the one user message)
    prompt_len: int  # tokens of the prompt, by the benchmark's tokenizer (vLLM's input_lens)
    output_len: int  # max_tokens
    messages: list[dict] | None = None  # a JSONL line's own chat
    category: str = CUSTOM
    answer: str = ""
    constraint: dict | None = None  # structured outputs: the body fields that constrain it (e.g. guided_regex)
    language: dict | None = None  # the constraint its answer is checked against, sent or not


# ---- tokenizer -------------------------------------------------------------------------------------------------


def load_tokenizer(name: str):
    """The tokenizer ``name`` names: an embedded model's (``tiny-bd``), a local directory's, or one in the
    local Hugging Face cache (read offline: nothing is downloaded)."""
    import engine
    from engine.tokenizer import HFTokenizer
    from engine.tokenizer import load_tokenizer as load_dir

    embedded = Path(engine.__file__).parent / "defaults" / name
    if "/" not in name and (embedded / "tokenizer.json").exists():
        return load_dir(embedded)
    path = Path(name).expanduser()
    if path.is_dir():
        return load_dir(path)
    try:
        from huggingface_hub import snapshot_download

        cached = snapshot_download(name, local_files_only=True,
                                   allow_patterns=["*.json", "*.model", "*.txt", "*.tiktoken"])
        return HFTokenizer(cached)
    except Exception as exc:  # not in the cache, not a repo id, or no tokenizer there
        raise ValueError(f"--tokenizer {name!r}: not an embedded model, not a local directory and not in the "
                         f"local Hugging Face cache ({type(exc).__name__}); pass --tokenizer DIR") from None


def special_ids(tok) -> set[int]:
    if hasattr(tok, "tok"):  # HFTokenizer
        inner = tok.tok
        return set(inner.all_special_ids) | {i for i, t in inner.added_tokens_decoder.items() if t.special}
    from engine.tokenizer import SPECIALS

    return {i for t, i in tok.vocab.items() if t in SPECIALS}


def count_tokens(tok, text: str) -> int:
    return len(tok.encode(text)) if text else 0


# ---- datasets --------------------------------------------------------------------------------------------------


def _to_length(tok, ids: list[int], target: int, allowed: np.ndarray, rng: np.random.Generator) -> tuple[str, int]:
    """Text of ``ids`` that encodes to ``target`` tokens: decode, re-encode, cut or pad with allowed tokens, a
    few times over (BPE merges across the pieces can change the count); (text, its final token count)."""
    text = tok.decode(ids)
    for _ in range(10):
        again = tok.encode(text)
        if len(again) == target:
            break
        again = again[:target] if len(again) > target else \
            again + allowed[rng.integers(0, len(allowed), target - len(again))].tolist()
        text = tok.decode(again)
    return text, count_tokens(tok, text)


def random_prompts(tok, n: int, input_len: int = 1024, output_len: int = 128, range_ratio: float = 0.0,
                   prefix_len: int = 0, seed: int = 0) -> list[BenchPrompt]:
    """vLLM's random dataset: input lengths uniform in [floor(L(1-r)), ceil(L(1+r))] (output lengths alike, at
    least 1), each prompt a run of consecutive allowed token ids from a random offset after a shared random
    prefix, decoded and checked to encode to its length."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must lie in [0, 1), got {range_ratio}")
    if input_len < 1 or output_len < 1 or prefix_len < 0:
        raise ValueError("--random-input-len and --random-output-len must be at least 1, --random-prefix-len >= 0")
    rng = np.random.default_rng(seed)
    lo_in, hi_in = math.floor(input_len * (1 - range_ratio)), math.ceil(input_len * (1 + range_ratio))
    lo_out = max(1, math.floor(output_len * (1 - range_ratio)))
    hi_out = max(1, math.ceil(output_len * (1 + range_ratio)))
    if prefix_len + lo_in < 1:
        raise ValueError("--random-input-len is too small for --random-range-ratio: a prompt could be empty")
    in_lens = rng.integers(lo_in, hi_in + 1, n)
    out_lens = rng.integers(lo_out, hi_out + 1, n)
    offsets = rng.integers(0, tok.vocab_size, n)
    allowed = np.array(sorted(set(range(tok.vocab_size)) - special_ids(tok)))
    prefix = allowed[rng.integers(0, len(allowed), prefix_len)].tolist() if prefix_len else []
    out = []
    for i in range(n):
        inner = allowed[(offsets[i] + i + np.arange(in_lens[i])) % len(allowed)].tolist()
        text, length = _to_length(tok, prefix + inner, prefix_len + int(in_lens[i]), allowed, rng)
        out.append(BenchPrompt(text, length, int(out_lens[i])))
    return out


def _oversample(items: list, n: int, seed: int, no_oversample: bool, what: str) -> list:
    if not items:
        raise ValueError(f"{what}: no usable prompts")
    if len(items) >= n or no_oversample:
        return items[:n]
    return items + random.Random(seed).choices(items, k=n - len(items))


def sharegpt_prompts(path: str, tok, n: int, output_len: int | None = None, seed: int = 0,
                     no_oversample: bool = False) -> list[BenchPrompt]:
    """vLLM's ShareGPT dataset from a local file: conversations with two turns or more, shuffled with the seed;
    the first turn is the prompt, the second's token count the output length (``output_len`` overrides it);
    prompts under 4 or over 1024 tokens, outputs under 4 (unless fixed) and pairs over 2048 are skipped."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--dataset-path {path}: cannot read a ShareGPT JSON file ({exc})") from None
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path}: a ShareGPT file is a JSON list of {{\"conversations\": [...]}}")
    convs = [d["conversations"] for d in data if isinstance(d, dict) and isinstance(d.get("conversations"), list)
             and len(d["conversations"]) >= 2]
    random.Random(seed).shuffle(convs)
    out = []
    for conv in convs:
        if len(out) >= n:
            break
        prompt, completion = (str((t or {}).get("value", "")) if isinstance(t, dict) else "" for t in conv[:2])
        p_len = count_tokens(tok, prompt)
        o_len = output_len if output_len is not None else count_tokens(tok, completion)
        if (p_len < SHAREGPT_MIN_LEN or (output_len is None and o_len < SHAREGPT_MIN_LEN)
                or p_len > SHAREGPT_MAX_PROMPT or p_len + o_len > SHAREGPT_MAX_TOTAL):
            continue
        out.append(BenchPrompt(prompt, p_len, o_len))
    return _oversample(out, n, seed, no_oversample, f"--dataset-path {path}")


def jsonl_prompts(path: str, tok, n: int, output_len: int = 256, seed: int = 0, shuffle: bool = True,
                  no_oversample: bool = False) -> list[BenchPrompt]:
    """vLLM's custom dataset: one ``{"prompt": ...}`` a line (other keys ignored), or Remask's
    ``{"messages": [...]}``; ``output_len`` is every request's max_tokens, or with -1 the line's own
    ``max_tokens`` (``output_tokens`` too, vLLM's column). Shuffled with the seed unless ``shuffle`` is off."""
    out = []
    for lineno, obj in _jsonl(path):
        known = {k: v for k, v in obj.items() if k in PROMPT_KEYS} if isinstance(obj, dict) else obj
        if (err := _prompt_error(known)) is not None:
            raise ValueError(f"{path}:{lineno}: {err}")
        own = known.get("max_tokens") or obj.get("output_tokens")
        if output_len == -1 and not (isinstance(own, int) and own > 0):
            raise ValueError(f"{path}:{lineno}: --custom-output-len -1 needs max_tokens (or output_tokens) per line")
        o_len = own if output_len == -1 else output_len
        if "messages" in known:
            text = "\n".join(m["content"] if isinstance(m["content"], str) else
                             "".join(p.get("text", "") for p in m["content"] if isinstance(p, dict))
                             for m in known["messages"])
            out.append(BenchPrompt(None, count_tokens(tok, text), o_len, messages=known["messages"]))
        else:
            out.append(BenchPrompt(known["prompt"], count_tokens(tok, known["prompt"]), o_len))
    if shuffle:
        random.Random(seed).shuffle(out)
    return _oversample(out, n, seed, no_oversample, f"--dataset-path {path}")


def remask_prompts(tok, n: int, seed: int = 0) -> list[BenchPrompt]:
    """Held-out task-suite prompts (``remask loadgen synth``'s), answers checked; max_tokens the task's need."""
    from loadgen.trace import SynthConfig, synth

    return [BenchPrompt(r.prompt, count_tokens(tok, r.prompt), r.max_tokens, category=r.category, answer=r.answer)
            for r in synth(SynthConfig(n=n, arrivals="burst", seed=seed))]


def structured_prompts(tok, name: str, n: int, seed: int = 0, ratio: float = 1.0, schema_path: str | None = None,
                       output_len: int = 256) -> list[BenchPrompt]:
    """The structured-output datasets (``STRUCTURED``): ``json``, vLLM's user-profile prompt for a JSON schema
    (``schema_path``, else ``USER_PROFILE``) with ``output_len`` tokens at most; ``regex`` and ``choice``,
    held-out task-suite prompts with their category's language (scripts/structured_bench.py's). A fraction
    ``ratio`` of them (the first, after a shuffle with ``seed``) carry their constraint."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"--structured-output-ratio must be in [0, 1], got {ratio}")
    if name == "json":
        schema = USER_PROFILE
        if schema_path is not None:
            try:
                schema = json.loads(Path(schema_path).read_text())
            except (OSError, ValueError) as exc:
                raise ValueError(f"--json-schema-path {schema_path}: not a JSON schema file ({exc})") from None
        text = f"Generate an example of a user profile given the following schema: {json.dumps(schema)}"
        out = [BenchPrompt(text, count_tokens(tok, text), output_len, category="json",
                           constraint={"structured_outputs": {"json": schema}}) for _ in range(n)]
    else:
        out = []
        for p in remask_prompts(tok, n * 4, seed):
            if name == "choice" and p.category != "choice":
                continue
            if name == "choice":
                p.constraint = {"guided_choice": ["a", "b", "c", "d"]}
            else:
                p.constraint = {"guided_regex": _answer_regex(p.category, p.prompt)}
            out.append(p)
            if len(out) == n:
                break
        out = _oversample(out, n, seed, False, f"--dataset-name {name}")
    order = list(range(len(out)))
    random.Random(seed).shuffle(order)
    keep = set(order[: round(ratio * len(out))])
    return [replace(p, language=p.constraint, constraint=p.constraint if i in keep else None)
            for i, p in enumerate(out)]


def _answer_regex(category: str, prompt: str) -> str:
    from tasksuite import _prose_pattern

    if category == "prose":
        return _prose_pattern(prompt.split()[1], int(prompt.split()[2])).pattern
    return {"choice": "[abcd]", "arith": "[0-9]{1,3}", "reverse": "[a-z]{3,6}", "lookup": "[0-9]{2}"}[category]


def valid_structured(constraint: dict, text: str) -> bool:
    """Whether ``text`` is a sentence of ``constraint`` (the body fields a structured prompt sent): the regex
    matches it whole, it is one of the choices, or it is a JSON document that the schema's grammar accepts
    (engine.constraints, on its characters)."""
    import re

    if "guided_regex" in constraint:
        return re.fullmatch(constraint["guided_regex"], text) is not None
    if "guided_choice" in constraint:
        return text in constraint["guided_choice"]
    schema = constraint["structured_outputs"]["json"]
    try:
        json.loads(text)
    except ValueError:
        return False
    from engine.constraints import ConstraintSpec, Grammar, Vocab

    pieces = tuple(sorted(set(text)))
    vocab = Vocab(len(pieces) + 1, (len(pieces),), f"bench:{pieces}", pieces=(*pieces, None))
    matcher = Grammar.compile(ConstraintSpec.json_schema(schema), vocab).matcher()
    ids = [pieces.index(c) for c in text] + [len(pieces)]
    return matcher.accept_prefix(ids) == len(ids)


# ---- arrivals and the trace ------------------------------------------------------------------------------------


def request_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Send offsets (s) as ``vllm bench serve`` draws them: cumulative gamma gaps (shape ``burstiness``, mean
    ``1/rate``; 1 is Poisson), rescaled so the last is ``n / rate``; all 0 at an infinite rate."""
    if not rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {rate}")
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if math.isinf(rate) or n == 0:
        return np.zeros(n)
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / rate)
    else:
        gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), n)
    t = np.cumsum(gaps)
    return t * (n / rate) / t[-1] if t[-1] > 0 else t


def build_trace(prompts: list[BenchPrompt], offsets: np.ndarray, endpoint: str, extra: dict, prefix: str,
                threshold: float | None = None, slo_ms: float | None = None,
                slo_ms_per_token: float = 0.0) -> list[TraceRequest]:
    out = []
    for i, (p, t) in enumerate(zip(prompts, offsets, strict=True)):
        chat = endpoint == "chat" or p.messages is not None
        slo = None if slo_ms is None else round(slo_ms + slo_ms_per_token * p.output_len, 3)
        out.append(TraceRequest(
            request_id=f"{prefix}{i}", arrival_s=float(t), endpoint="chat" if chat else "completion",
            max_tokens=p.output_len, category=p.category, answer=p.answer, prompt=None if chat else p.prompt,
            messages=(p.messages or [{"role": "user", "content": p.prompt}]) if chat else None,
            threshold=threshold, slo_ms=slo, input_len=p.prompt_len, output_len=p.output_len,
            extra={**extra, **(p.constraint or {})}))
    return out


# ---- metrics ---------------------------------------------------------------------------------------------------


def parse_metric_names(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in PERCENTILE_METRICS]
    if not names or bad:
        raise ValueError(f"--percentile-metrics takes a comma-separated subset of {','.join(PERCENTILE_METRICS)}; "
                         f"got {text!r}")
    return list(dict.fromkeys(names))


def parse_metric_percentiles(text: str) -> list[float]:
    try:
        out = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--metric-percentiles takes numbers separated by commas, e.g. 50,90,99; got {text!r}") \
            from None
    if not out or any(not 0.0 < p <= 100.0 for p in out):
        raise ValueError(f"--metric-percentiles must lie in (0, 100]; got {text!r}")
    return list(dict.fromkeys(out))


def output_len_of(r: RequestResult, tok) -> int:
    """Output tokens of a successful request: the stream's usage, else the tokenizer's count of its text."""
    if r.output_tokens:
        return int(r.output_tokens)
    return count_tokens(tok, r.text) if tok is not None else 1


def vllm_metrics(results: list[RequestResult], input_lens: list[int], duration_s: float, tok=None,
                 metrics: list[str] = ("ttft", "tpot", "itl"), percentiles: list[float] = (99.0,),
                 goodput: dict[str, float] | None = None) -> dict:
    """``vllm bench serve``'s result keys for ``results`` (one per prompt, in order; ``input_lens`` theirs)."""
    output_lens, ttfts, tpots, all_tpots, itls, e2els = [], [], [], [], [], []
    completed = total_input = good = 0
    for r, in_len in zip(results, input_lens, strict=True):
        if not r.ok:
            output_lens.append(0)
            continue
        n = output_len_of(r, tok)
        output_lens.append(n)
        total_input += in_len
        completed += 1
        ttft, e2el = (r.ttft_ms or 0.0), r.e2el_ms
        tpot = (e2el - ttft) / (n - 1) if n > 1 else 0.0
        if n > 1:
            tpots.append(tpot)
        all_tpots.append(tpot)
        ttfts.append(ttft)
        e2els.append(e2el)
        itls += r.itl_ms
        if goodput and all(v <= goodput[k] for k, v in (("ttft", ttft), ("tpot", tpot), ("e2el", e2el))
                           if k in goodput):
            good += 1
    total_output = sum(output_lens)
    dur = duration_s if duration_s > 0 else float("inf")  # nothing finished: every rate is 0
    out = {
        "duration": duration_s,
        "completed": completed,
        "failed": len(results) - completed,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / dur,
        "request_goodput": good / dur if goodput else None,
        "output_throughput": total_output / dur,
        "total_token_throughput": (total_input + total_output) / dur,
        "input_lens": list(input_lens),
        "output_lens": output_lens,
        "ttfts": [(r.ttft_ms or 0.0) / 1000.0 if r.ok else 0.0 for r in results],
        "itls": [[g / 1000.0 for g in r.itl_ms] if r.ok else [] for r in results],
        "latencies": [(r.e2el_ms or 0.0) / 1000.0 if r.ok else 0.0 for r in results],
        "start_times": [r.send_s for r in results],
        "queue_times": [r.queued_ms / 1000.0 for r in results],
        "generated_texts": [r.text for r in results],
        "errors": [r.error or "" for r in results],
    }
    out.update(peaks(results, output_lens))
    values = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}
    for m in metrics:
        arr = np.asarray(values[m] or [0.0], dtype=float)
        out[f"mean_{m}_ms"] = float(arr.mean())
        out[f"median_{m}_ms"] = float(np.median(arr))
        out[f"std_{m}_ms"] = float(arr.std())
        for p in percentiles:
            out[f"{pct_name(p)}_{m}_ms"] = float(np.percentile(arr, p))
    return out


def peaks(results: list[RequestResult], output_lens: list[int]) -> dict:
    """vLLM's ``max_output_tokens_per_s`` (the most output tokens in one whole second from the first send, a
    request's tokens spread evenly over its streamed chunks: a diffusion model streams a block a chunk) and
    ``max_concurrent_requests`` (the most successful requests in flight at once, [send, end) intervals)."""
    ok = [(r, n) for r, n in zip(results, output_lens, strict=True) if r.ok]
    if not ok:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    t0 = min(r.send_s for r, _ in ok)
    buckets: dict[int, float] = {}
    events = []
    for r, n in ok:
        for off in r.chunk_offsets_ms:
            second = int(r.send_s - t0 + off / 1000.0)
            buckets[second] = buckets.get(second, 0.0) + n / len(r.chunk_offsets_ms)
        events += [(r.send_s, 1), (r.send_s + r.e2el_ms / 1000.0, -1)]
    level = top = 0
    for _, step in sorted(events):  # an end before a start at the same instant
        level += step
        top = max(top, level)
    return {"max_output_tokens_per_s": max(buckets.values(), default=0.0), "max_concurrent_requests": top}


def _line(label: str, value, spec: str = "") -> str:
    return "{:<40} {:<10}".format(label, format(value, spec) if value is not None else "n/a")


def format_table(res: dict, metrics: list[str], percentiles: list[float]) -> str:
    """The summary as ``vllm bench serve`` prints it, with Remask's extras in a block of their own."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
             _line("Successful requests:", res["completed"]), _line("Failed requests:", res["failed"])]
    if res.get("max_concurrency") is not None:
        lines.append(_line("Maximum request concurrency:", res["max_concurrency"]))
    if res.get("request_rate") not in (None, "inf"):
        lines.append(_line("Request rate configured (RPS):", res["request_rate"], ".2f"))
    lines += [_line("Benchmark duration (s):", res["duration"], ".2f"),
              _line("Total input tokens:", res["total_input_tokens"]),
              _line("Total generated tokens:", res["total_output_tokens"]),
              _line("Request throughput (req/s):", res["request_throughput"], ".2f")]
    if res.get("request_goodput") is not None:
        lines.append(_line("Request goodput (req/s):", res["request_goodput"], ".2f"))
    lines += [_line("Output token throughput (tok/s):", res["output_throughput"], ".2f"),
              _line("Peak output token throughput (tok/s):", res["max_output_tokens_per_s"], ".2f"),
              _line("Peak concurrent requests:", res["max_concurrent_requests"], ".2f"),
              _line("Total Token throughput (tok/s):", res["total_token_throughput"], ".2f")]
    for m in PERCENTILE_METRICS:
        if m not in metrics:
            continue
        short, header = HEADERS[m]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        lines.append(_line(f"Mean {short} (ms):", res[f"mean_{m}_ms"], ".2f"))
        lines.append(_line(f"Median {short} (ms):", res[f"median_{m}_ms"], ".2f"))
        for p in percentiles:
            lines.append(_line(f"P{pct_name(p)[1:]} {short} (ms):", res[f"{pct_name(p)}_{m}_ms"], ".2f"))
    x = res.get("remask") or {}
    lines.append("{s:{c}^{n}}".format(s="Remask", n=50, c="-"))
    if x.get("errors_by_kind"):
        lines.append(_line("Errors by kind:", json.dumps(x["errors_by_kind"])))
    if x.get("accuracy") is not None:
        lines.append(_line("Answer accuracy:", x["accuracy"], ".3f"))
    if x.get("structured_valid") is not None:
        lines.append(_line("Structured outputs valid:", x["structured_valid"], ".3f"))
    if x.get("structured_valid_all") is not None:
        lines.append(_line("Answers valid (all):", x["structured_valid_all"], ".3f"))
    if x.get("slo_attainment") is not None:
        lines.append(_line("SLO attainment:", x["slo_attainment"], ".3f"))
    lines.append(_line("Send lag mean / max (ms):", f"{x.get('mean_send_lag_ms') or 0:.3f} / "
                                                    f"{x.get('max_send_lag_ms') or 0:.3f}"))
    if res.get("max_concurrency") is not None:
        lines.append(_line("Slot wait mean / max (ms):", f"{x.get('mean_queue_ms') or 0:.2f} / "
                                                         f"{x.get('max_queue_ms') or 0:.2f}"))
    lines.append("=" * 50)
    return "\n".join(lines)


def remask_extras(results: list[RequestResult], duration_s: float, trace: list[TraceRequest],
                  server_model: str | None) -> dict:
    s = summarize(results, duration_s)
    return {"errors_by_kind": s["errors_by_kind"], "accuracy": s["accuracy"],
            "accuracy_by_category": s["accuracy_by_category"], "slo_attainment": s["slo_attainment"],
            "mean_send_lag_ms": s["mean_send_lag_ms"], "max_send_lag_ms": s["max_send_lag_ms"],
            "mean_queue_ms": s["mean_queue_ms"], "max_queue_ms": s["max_queue_ms"],
            "server_input_lens": [r.prompt_tokens for r in results],
            "correct": [r.correct for r in results], "slo_ms": [t.slo_ms for t in trace],
            "slo_met": [r.slo_met for r in results], "finish_reasons": [r.finish_reason for r in results],
            "request_ids": [t.request_id for t in trace], "served_model": server_model}


# ---- the command -----------------------------------------------------------------------------------------------


def base_url_of(args) -> str:
    if args.base_url:
        return args.base_url.rstrip("/")
    host = f"[{args.host}]" if ":" in args.host else args.host
    return f"http://{host}:{args.port}"


def endpoint_path(args) -> str:
    kind = BACKENDS[args.backend]
    path = args.endpoint or ("/v1/chat/completions" if kind == "chat" else "/v1/completions")
    if not path.startswith("/"):
        raise ValueError(f"--endpoint must be a path starting with '/', got {path!r}")
    if kind == "chat" and not path.rstrip("/").endswith("chat/completions"):
        raise ValueError(f"--backend openai-chat needs a chat endpoint (…/chat/completions), got --endpoint {path}")
    if kind == "completion" and (not path.rstrip("/").endswith("completions") or "chat" in path):
        raise ValueError(f"--backend openai needs a completions endpoint (…/completions), got --endpoint {path}; "
                         "for a chat endpoint use --backend openai-chat")
    return path


RANDOM_INPUT_LEN, RANDOM_OUTPUT_LEN = 1024, 128  # vLLM's defaults for the random dataset


def served_model(base_url: str, api_key: str | None, model: str | None, timeout_s: float = 30.0) -> dict:
    """The server's ``/v1/models`` entry of ``model`` (``id``, and ``max_model_len`` where the server says it),
    or of its first model when ``model`` is None (vLLM's default for ``--model``): read once per run. A model
    the list lacks, or a server without the list, is ``{"id": model}``; without ``model`` that is an error."""
    import httpx

    from loadgen.client import auth_headers

    try:
        resp = httpx.get(f"{base_url}/v1/models", headers=auth_headers(api_key), timeout=timeout_s)
        resp.raise_for_status()
        data = resp.json()["data"]
        if model is None:
            return {**data[0], "id": data[0]["id"]}  # a KeyError when the entry names no model
        return next((m for m in data if isinstance(m, dict) and m.get("id") == model), {"id": model})
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        if model is not None:
            return {"id": model}
        raise ValueError(f"no --model given and none read from {base_url}/v1/models ({type(exc).__name__}: {exc}); "
                         "is the server running? pass --model NAME") from None


def random_lengths(args, max_model_len: int | None) -> tuple[int, int, str | None]:
    """(input, output) lengths of the random dataset and a note when they were fitted: the flags' values when
    given; else vLLM's defaults (1024, 128), or, when those do not fit the served model's context
    (``max_model_len``, with a sixteenth of it left for the chat template and block padding), the output
    at most a quarter of the context and the input what is left."""
    given_in, given_out = args.random_input_len, args.random_output_len
    n_in, n_out = given_in or RANDOM_INPUT_LEN, given_out or RANDOM_OUTPUT_LEN
    if max_model_len is None or (given_in and given_out) or n_in + n_out + max_model_len // 16 <= max_model_len:
        return n_in, n_out, None
    room = max_model_len - max_model_len // 16
    if not given_out:
        n_out = min(n_out, max(room // 4, 1), room - (given_in or 1))
    if not given_in:
        n_in = room - n_out
    if min(n_in, n_out) < 1:
        return (given_in or RANDOM_INPUT_LEN), (given_out or RANDOM_OUTPUT_LEN), None  # the server will say why
    return n_in, n_out, (f"the served model's context is {max_model_len} tokens: --random-input-len {n_in} "
                         f"--random-output-len {n_out} (vLLM's defaults, {RANDOM_INPUT_LEN} and {RANDOM_OUTPUT_LEN}, "
                         "do not fit; pass both to choose)")


def validate(args) -> None:
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be at least 1, got {args.num_prompts}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
    if not args.burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {args.burstiness}")
    if args.dataset_name in ("random", "remask", *STRUCTURED) and args.dataset_path is not None:
        raise ValueError(f"--dataset-name {args.dataset_name} takes no --dataset-path "
                         "(a file is --dataset-name sharegpt or jsonl)")
    if args.dataset_name in ("sharegpt", "jsonl", "custom") and not args.dataset_path:
        raise ValueError(f"--dataset-name {args.dataset_name} needs --dataset-path FILE (a local file)")
    if args.dataset_path and not Path(args.dataset_path).is_file():
        raise ValueError(f"--dataset-path {args.dataset_path}: no such file")


def load_prompts(args, tok) -> list[BenchPrompt]:
    if args.dataset_name == "random":
        return random_prompts(tok, args.num_prompts, args.random_input_len, args.random_output_len,
                              args.random_range_ratio, args.random_prefix_len, args.seed)
    if args.dataset_name == "sharegpt":
        return sharegpt_prompts(args.dataset_path, tok, args.num_prompts, args.sharegpt_output_len, args.seed,
                                args.no_oversample)
    if args.dataset_name in ("jsonl", "custom"):
        return jsonl_prompts(args.dataset_path, tok, args.num_prompts, args.custom_output_len, args.seed,
                             not args.disable_shuffle, args.no_oversample)
    if args.dataset_name in STRUCTURED:
        return structured_prompts(tok, args.dataset_name, args.num_prompts, args.seed, args.structured_output_ratio,
                                  args.json_schema_path, args.structured_output_len)
    return remask_prompts(tok, args.num_prompts, args.seed)


def _extra_body(args) -> dict:
    extra = dict(args.extra_body or {})
    for key in ("temperature", "top_p", "top_k"):
        if getattr(args, key) is not None:
            extra[key] = getattr(args, key)
    if args.ignore_eos:
        extra["ignore_eos"] = True
    return extra


def result_filename(args, model_id: str, date: str) -> Path:
    conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
    name = args.result_filename or \
        f"{args.label or args.backend}-{args.request_rate}qps{conc}-{model_id.split('/')[-1]}-{date}.json"
    return Path(args.result_dir or ".") / name


def run(args, out=None) -> tuple[dict, bool]:
    """Run the benchmark ``args`` describe, printing to ``out`` (stdout); (the result document, interrupted)."""
    out = out or sys.stdout
    from loadgen.client import resolve_api_key
    from loadgen.replay import ReplayConfig, replay

    validate(args)
    metrics = parse_metric_names(args.percentile_metrics)
    percentiles = parse_metric_percentiles(args.metric_percentiles)
    goodput = parse_goodput(args.goodput)
    path = endpoint_path(args)
    base = base_url_of(args)
    key = resolve_api_key(args.api_key)
    entry = served_model(base, key, args.model)
    model_id = entry["id"]
    if args.dataset_name == "random":
        args.random_input_len, args.random_output_len, note = random_lengths(args, entry.get("max_model_len"))
        if note:
            print(f"Note: {note}", file=out)
    model_name = args.served_model_name or model_id
    tokenizer_id = args.tokenizer or model_id
    tok = load_tokenizer(tokenizer_id)
    # as in vLLM: the random dataset ignores EOS, so each request generates --random-output-len tokens
    auto_eos = args.dataset_name == "random" and not args.ignore_eos
    args.ignore_eos = args.ignore_eos or auto_eos
    prompts = load_prompts(args, tok)
    if args.endpoint and BACKENDS[args.backend] == "completion" and any(p.messages for p in prompts):
        raise ValueError(f"--dataset-path {args.dataset_path} has chat lines ({{\"messages\": ...}}), which "
                         f"--endpoint {args.endpoint} cannot take; use --backend openai-chat")
    offsets = request_offsets(len(prompts), args.request_rate, args.burstiness, args.seed)
    trace = build_trace(prompts, offsets, BACKENDS[args.backend], _extra_body(args), args.request_id_prefix,
                        args.threshold, args.slo_ms, args.slo_ms_per_token)
    cfg = ReplayConfig(url=base, model=model_name, timeout_s=args.timeout, progress=not args.disable_tqdm,
                       api_key=key, max_concurrency=args.max_concurrency, lead_s=0.0,
                       path=path if args.endpoint else None)  # None: a JSONL chat line goes to the chat path

    print("Starting initial single prompt test run...", file=out)
    probe = replay([replace(trace[0], arrival_s=0.0, request_id=trace[0].request_id + "-test")],
                   replace(cfg, progress=False))["requests"][0]
    if not probe["ok"] and auto_eos and "ignore_eos" in (probe["error"] or ""):
        print(f"WARNING: the server refused ignore_eos ({probe['error']}); the random dataset's requests go "
              "without it, so output lengths end at the model's end of sequence", file=out)
        args.ignore_eos = False
        trace = [replace(t, extra={k: v for k, v in t.extra.items() if k != "ignore_eos"}) for t in trace]
        probe = replay([replace(trace[0], arrival_s=0.0, request_id=trace[0].request_id + "-test")],
                       replace(cfg, progress=False))["requests"][0]
    if not probe["ok"]:
        raise ValueError("Initial test run failed - please make sure the benchmark arguments are correctly "
                         f"specified. Error: {probe['error']}")
    print("Initial test run completed. Starting main benchmark run...", file=out)
    distribution = "Poisson process" if args.burstiness == 1.0 else "Gamma distribution"
    print(f"Traffic request rate: {args.request_rate}", file=out)
    print(f"Burstiness factor: {args.burstiness} ({distribution})", file=out)
    print(f"Maximum request concurrency: {args.max_concurrency}", file=out)

    doc = replay(trace, cfg)
    by_id = {r["request_id"]: r for r in doc["requests"]}
    results = [RequestResult(**{k: v for k, v in by_id[t.request_id].items() if k != "send_lag_ms"})
               if t.request_id in by_id else
               RequestResult(t.request_id, t.category, t.endpoint, t.arrival_s, cancelled=True, error="not sent")
               for t in trace]
    duration = doc["summary"]["duration"]
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    res = {"date": date, "endpoint_type": args.backend, "backend": args.backend, "label": args.label,
           "model_id": model_id, "tokenizer_id": tokenizer_id, "num_prompts": args.num_prompts}
    for item in args.metadata or []:
        k, sep, v = item.partition("=")
        if not sep:
            raise ValueError(f"--metadata takes KEY=VALUE pairs, got {item!r}")
        res[k.strip()] = v.strip()
    res.update({"request_rate": args.request_rate if not math.isinf(args.request_rate) else "inf",
                "burstiness": args.burstiness, "max_concurrency": args.max_concurrency})
    res.update(vllm_metrics(results, [p.prompt_len for p in prompts], duration, tok, metrics, percentiles, goodput))
    checked = [(p.constraint is not None, valid_structured(p.language, r.text)) for p, r in zip(prompts, results)
               if p.language is not None and r.ok]
    sent = [v for c, v in checked if c]
    res["remask"] = {**remask_extras(results, duration, trace, model_name), "ignore_eos": args.ignore_eos,
                     "structured_requests": sum(p.constraint is not None for p in prompts),
                     "structured_valid": None if not sent else sum(sent) / len(sent),
                     "structured_valid_all": None if not checked else sum(v for _, v in checked) / len(checked),
                     "endpoint": path, "base_url": base, "interrupted": doc["interrupted"],
                     "goodput_bounds": goodput, "started_at": time.time()}
    print(format_table(res, metrics, percentiles), file=out)
    if args.save_result:
        file = result_filename(args, model_id, date)
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(json.dumps(res))
        print(f"wrote {file}", file=out)
    return res, doc["interrupted"]


def add_parser(sub) -> None:
    """``remask loadgen bench``: ``vllm bench serve``'s flags (the subset that applies to text generation)."""
    b = sub.add_parser("bench", help="vllm bench serve's flags, summary and result JSON (Remask, vLLM, SGLang alike)",
                       description=__doc__.split("\n\n")[0])
    b.add_argument("--backend", default="openai", choices=sorted(BACKENDS),
                   help="openai: completions (prompt); openai-chat: chat completions (messages)")
    b.add_argument("--base-url", help="server base URL, e.g. http://10.0.0.2:8000 (default: http://HOST:PORT)")
    b.add_argument("--host", default="127.0.0.1")
    b.add_argument("--port", type=int, default=8000)
    b.add_argument("--endpoint", help="URL path (default /v1/completions; /v1/chat/completions with openai-chat)")
    b.add_argument("--model", help="model name sent (default: the first of the server's /v1/models)")
    b.add_argument("--served-model-name", help="the name sent in requests, when it is not --model")
    b.add_argument("--tokenizer", help="embedded model name, local directory or cached hub id (default: --model)")
    b.add_argument("--label", help="prefix of the result file name (default: --backend)")
    b.add_argument("--num-prompts", type=int, default=1000)
    b.add_argument("--request-rate", type=float, default=float("inf"), help="req/s; inf: all at once")
    b.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    b.add_argument("--max-concurrency", type=int, help="at most N requests in flight")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--dataset-name", default="random", choices=DATASETS,
                   help="random; sharegpt or jsonl (custom) from --dataset-path; remask: checked task prompts")
    b.add_argument("--dataset-path", help="local ShareGPT JSON or JSONL file (nothing is downloaded)")
    b.add_argument("--json-schema-path", help="json: the JSON schema file (default: a finite user profile)")
    b.add_argument("--structured-output-ratio", type=float, default=1.0,
                   help="json, regex, choice: the fraction of requests that carry the constraint")
    b.add_argument("--structured-output-len", type=int, default=256, help="json: max_tokens of each request")
    b.add_argument("--random-input-len", type=int, default=None,
                   help=f"prompt tokens (default {RANDOM_INPUT_LEN}, or less when the served model's "
                        "max_model_len is smaller)")
    b.add_argument("--random-output-len", type=int, default=None,
                   help=f"output tokens (default {RANDOM_OUTPUT_LEN}, or less as above)")
    b.add_argument("--random-range-ratio", type=float, default=0.0)
    b.add_argument("--random-prefix-len", type=int, default=0)
    b.add_argument("--sharegpt-output-len", type=int, help="fixed output length instead of the second turn's")
    b.add_argument("--custom-output-len", type=int, default=256,
                   help="jsonl: max_tokens of every request; -1: each line's max_tokens")
    b.add_argument("--disable-shuffle", action="store_true", help="jsonl: keep the file's order")
    b.add_argument("--no-oversample", action="store_true", help="fewer requests when the file has fewer prompts")
    b.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (always with --dataset-name random)")
    b.add_argument("--temperature", type=float)
    b.add_argument("--top-p", type=float)
    b.add_argument("--top-k", type=int)
    b.add_argument("--extra-body", type=json.loads, help="JSON object merged into every request body")
    b.add_argument("--percentile-metrics", default="ttft,tpot,itl", help="subset of ttft,tpot,itl,e2el")
    b.add_argument("--metric-percentiles", default="99", help="e.g. 50,90,99")
    b.add_argument("--goodput", nargs="+", metavar="METRIC:MS", help="e.g. ttft:500 tpot:50 e2el:2000")
    b.add_argument("--request-id-prefix", default="bench-", help="X-Request-Id of request i is PREFIX + i")
    b.add_argument("--save-result", action="store_true")
    b.add_argument("--result-dir")
    b.add_argument("--result-filename")
    b.add_argument("--metadata", nargs="*", metavar="KEY=VALUE", help="saved as top-level keys of the result")
    b.add_argument("--disable-tqdm", action="store_true")
    b.add_argument("--api-key", help="Bearer key (default: $OPENAI_API_KEY)")
    b.add_argument("--timeout", type=float, default=6 * 3600.0, help="per-request timeout (s)")
    b.add_argument("--threshold", type=float, help="Remask: per-request confidence threshold")
    b.add_argument("--slo-ms", type=float, help="Remask: per-request SLO of this many ms ...")
    b.add_argument("--slo-ms-per-token", type=float, default=0.0, help="... plus this many per max_tokens")
    b.set_defaults(func=cmd_bench)


def cmd_bench(args) -> int:
    _, interrupted = run(args)
    return 130 if interrupted else 0
