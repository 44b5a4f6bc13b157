"""What a generated report ran on: the commit and, per latency profile it priced time with, a content stamp.

A profile's stamp is its name, the SHA-256 of its file and a *pricing* fingerprint: the hash of the round times
``LatencyProfile.round_ms`` gives for a fixed set of round compositions (every step kind at several token counts
and contexts, and mixed rounds), rounded to a microsecond. The file hash changes with any edit of the file; the
pricing one with anything that changes what the simulator is charged, the file or the code that reads it. The
report writes the stamp into ``REPORT.md``'s header and ``stamp.json``; ``tests/test_report_stamp.py`` recomputes
it for the checked-in reports and fails when a default they depend on has moved since they were generated, so the
figures a reader sees are never from another model.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STAMP_FILE = "stamp.json"

# (kind, query tokens, context tokens) per slot, one round each; the kinds' own shapes and a few mixes
_TOKENS = (16, 32, 64, 128, 256, 396, 512, 1024, 2048, 4096, 8192)


def _rounds() -> list[list[tuple[str, int, int]]]:
    from engine.scheduler.types import StepKind

    out: list[list[tuple[str, int, int]]] = []
    for kind in sorted(k.value for k in StepKind):
        for q in _TOKENS:
            for ctx in (q, 4 * q, 2048):
                out.append([(kind, q, ctx)])
        out.append([(kind, 32, 320)] * 32)
    out.append([("recompute", 320, 320)] * 3 + [("cached", 32, 320)] * 29)
    out.append([("prefill", 512, 512)] * 2 + [("denoise", 32, 600)] * 60)
    return out


def profile_path(name: str) -> Path:
    """The file of a profile given as a name in profiles/ or as a path (relative to the working directory or,
    failing that, to the repository's root)."""
    from engine.latency_profile import PROFILES_DIR

    path = Path(name)
    if not path.suffix:
        return PROFILES_DIR / f"{name}.json"
    if path.is_absolute() or path.exists():
        return path
    return ROOT / path


def pricing_hash(name: str) -> str:
    """SHA-256 (first 16 hex digits) of the round times the profile gives for ``_rounds()`` (None where a kind
    can be priced by nothing in it)."""
    from engine.latency_profile import load_profile

    prof = load_profile(str(profile_path(name)))
    times = []
    for steps in _rounds():
        try:
            times.append(round(prof.round_ms(steps), 3))
        except ValueError:
            times.append(None)
    return hashlib.sha256(json.dumps(times).encode()).hexdigest()[:16]


def profile_stamp(name: str) -> dict:
    path = profile_path(name)
    return {"profile": name, "file_sha256": hashlib.sha256(path.read_bytes()).hexdigest()[:16],
            "pricing_sha256": pricing_hash(name)}


def git_commit(exclude: Path | None = None) -> str:
    """The short commit, with "(with uncommitted changes)" when tracked files differ from it (those under
    ``exclude``, the report's own output folder, left out)."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=ROOT)
        spec = ["--", "."]
        if exclude is not None:
            try:
                spec.append(f":(exclude){Path(exclude).resolve().relative_to(ROOT)}")
            except ValueError:
                pass  # outside the repository: nothing of it is tracked
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", *spec], capture_output=True,
                               text=True, timeout=10, cwd=ROOT)
        if sha.returncode:
            return "unknown"
        return sha.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def report_stamp(profiles: dict[str, str], out: Path | None = None) -> dict:
    """``profiles``: role (e.g. ``cluster``, ``instance``, ``headline 1``) -> profile name or path."""
    return {"commit": git_commit(out), "profiles": {role: profile_stamp(name) for role, name in profiles.items()}}


def stamp_line(stamp: dict) -> str:
    return "Profiles: " + "; ".join(f"{role} `{s['profile']}` (file {s['file_sha256']}, pricing {s['pricing_sha256']})"
                                    for role, s in stamp["profiles"].items()) + "."
