"""The fault harness's requests and their check: deterministic requests (``fault_requests``), each
result compared with its reference text (``check``), and the verdict and exit status of a scenario
(``verdict``, ``gate``, ``summary_line``)."""

from __future__ import annotations

PROMPTS_CATEGORIES = ("reverse", "choice", "arith", "prose")
LONG_PROMPTS = tuple(f"story: {a} {k}" for a in ("fox", "owl", "elk", "cat") for k in (6, 8))


def fault_requests(n: int, long: bool = False) -> list[dict]:
    """``n`` deterministic streaming completions. Even-numbered ones are greedy (temperature 0), odd ones
    sampled (temperature 1, seed 1000 + their number); every one carries a fixed threshold, so the router
    never picks it. Short ones: task-suite prompts, 24 tokens (96 for stories), thresholds 0.999 and 0.9 in
    turn by pairs. ``long``: 200-token stories at 0.9999 (about one token a step: long streams)."""
    import tasksuite as tasks

    if n < 1:
        raise ValueError("need at least one request")
    examples = [] if long else [e for e in tasks.heldout_set(2 * n + 8) if e.category in PROMPTS_CATEGORIES][:n]
    out = []
    for i in range(n):
        if long:
            body = {"prompt": LONG_PROMPTS[i % len(LONG_PROMPTS)], "max_tokens": 200, "threshold": 0.9999}
        else:
            ex = examples[i]
            body = {"prompt": ex.prompt, "max_tokens": 96 if ex.category == "prose" else 24,
                    "threshold": 0.999 if (i // 2) % 2 == 0 else 0.9}
        body.update({"temperature": 1.0, "seed": 1000 + i} if i % 2 else {"temperature": 0.0})
        out.append({**body, "stream": True})
    return out


def consistent(result: dict, want: str) -> bool:
    """Whether what a request received agrees with its reference text: all of it when it completed, a prefix
    of it otherwise (a stream that ended early)."""
    return result["text"] == want if result["outcome"] == "completed" else want.startswith(result["text"])


def check(results: list[dict], reference: list[str]) -> dict:
    """Compare each result (``stream_one``'s: ``outcome``, ``text``) with the reference text of the same request:
    the counts (``completed``, ``mismatched``, ``failed``, ``lost``, ``cancelled``; each request in one), the
    mismatched requests' positions and the first ten mismatches with where they differ."""
    if len(results) != len(reference):
        raise ValueError(f"{len(results)} results for {len(reference)} reference texts")
    out = {"requests": len(results), "completed": 0, "mismatched": 0, "failed": 0, "lost": 0, "cancelled": 0}
    mismatches, wrong = [], []
    for i, (r, want) in enumerate(zip(results, reference)):
        if r["outcome"] not in ("completed", "failed", "lost", "cancelled"):
            raise ValueError(f"unknown outcome {r['outcome']!r}")
        if consistent(r, want):
            out[r["outcome"]] += 1
            continue
        out["mismatched"] += 1
        wrong.append(i)
        if len(mismatches) < 10:
            got = r["text"]
            at = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            mismatches.append({"request": r.get("index", i), "outcome": r["outcome"],
                               **{k: r["body"][k] for k in ("prompt", "max_tokens", "threshold", "temperature",
                                                            "seed") if k in r.get("body", {})},
                               "first_difference": at, "expected": want, "got": got})
    out["mismatches"], out["mismatched_at"] = mismatches, wrong
    out["reference_chars"] = sum(len(w) for w in reference)
    return out


def verdict(summary: dict, kills: int, failovers: int, max_failed: int) -> list[str]:
    """Why a scenario failed (empty: it passed): any lost or mismatched request, fewer than ``kills``
    faults injected (``kills`` >= 1: zero never passes), fewer than ``failovers`` failovers, more than
    ``max_failed`` clean failures, or nothing to compare (every reference text empty)."""
    problems = []
    if summary["lost"]:
        problems.append(f"{summary['lost']} requests lost")
    if summary["mismatched"]:
        problems.append(f"{summary['mismatched']} requests received another text than their reference")
    if summary["kills"] < max(kills, 1):
        problems.append(f"{summary['kills']} kills, not {max(kills, 1)}: the fault was not injected")
    if summary["failovers"] < failovers:
        problems.append(f"{summary['failovers']} failovers, not at least {failovers}: no request was resumed "
                        f"elsewhere, so the kill tested nothing")
    if summary["failed"] > max_failed:
        problems.append(f"{summary['failed']} clean failures, over the bound of {max_failed}")
    if summary["reference_chars"] == 0:
        problems.append("every reference text is empty: nothing was compared")
    return problems


def summary_line(s: dict) -> str:
    kills = f"{s['kills']} kills" + (f" ({s['kills_are']})" if s.get("kills_are") else "")
    failovers = f"{s['failovers']} failovers" + (f" ({s['failovers_are']})" if s.get("failovers_are") else "")
    return (f"{s['lost']} lost, {s['mismatched']} mismatched; {kills}, {failovers}, "
            f"{s['failed']} failed cleanly (bound {s['max_failed']}); {s['completed']} of {s['requests']} "
            f"completed with the reference text" + (f", {s['cancelled']} cancelled" if s.get("cancelled") else "")
            + f" ({s['reference_chars']} reference characters)")


def gate(summary: dict, kills: int, failovers: int, max_failed: int, extra: list[str] = ()) -> dict:
    summary["max_failed"] = max_failed
    summary["problems"] = verdict(summary, kills, failovers, max_failed) + list(extra)
    summary["passed"] = not summary["problems"]
    return summary


def error_messages(results: list[dict]) -> list[str]:
    """The distinct errors of the requests that failed or were lost (the first ten)."""
    return sorted({f"{r['outcome']}: {r.get('error', 'no [DONE]')[:160]}" for r in results
                   if r["outcome"] in ("failed", "lost")})[:10]
