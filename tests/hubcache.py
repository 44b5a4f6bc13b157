"""A hub cache laid out on disk as huggingface_hub lays one out, from a local checkpoint directory: nothing
is downloaded.

``lay_out(checkpoint, hf_home, "org/name")`` writes ``HF_HOME/hub/models--org--name/`` with ``blobs/`` (each
file once, named by its git blob id, or by its sha256 for the weights, which the hub stores in LFS),
``snapshots/<commit>/<file>`` (relative symlinks into ``blobs/``) and ``refs/<revision>`` holding the commit,
which is how an offline ``snapshot_download`` finds the snapshot of a branch or tag.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _blob_id(data: bytes, lfs: bool) -> str:
    if lfs:
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's object id


def lay_out(checkpoint: str | Path, hf_home: str | Path, repo_id: str, *, commit: str = COMMIT,
            revision: str = "main") -> Path:
    """The snapshot directory of ``repo_id`` at ``commit`` (``refs/<revision>`` names it), holding the files
    of ``checkpoint``."""
    org, name = repo_id.split("/")
    repo = Path(hf_home) / "hub" / f"models--{org}--{name}"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for src in sorted(Path(checkpoint).rglob("*")):
        if not src.is_file():
            continue
        data = src.read_bytes()
        blob = repo / "blobs" / _blob_id(data, lfs=src.suffix == ".safetensors")
        blob.write_bytes(data)
        link = snapshot / src.relative_to(checkpoint)
        link.parent.mkdir(parents=True, exist_ok=True)
        up = len(link.relative_to(snapshot).parts) - 1  # a file in a folder of the snapshot: one more ../
        if not link.is_symlink():  # another revision of the same commit laid it out already
            link.symlink_to("../" * up + f"../../blobs/{blob.name}")
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return snapshot


def build_hub(root: Path, arch: str, repo_id: str, revisions: tuple[str, ...] = ("main",)) -> tuple[Path, Path]:
    """(an HF_HOME under ``root`` holding ``repo_id``, each of ``revisions`` naming the snapshot; the checkpoint
    directory of family ``arch`` it was laid out from, tests/checkpoints.py)."""
    from tests.checkpoints import build_checkpoint

    checkpoint = build_checkpoint(arch, root / "checkpoint")
    for revision in revisions:
        lay_out(checkpoint, root / "home", repo_id, revision=revision)
    return root / "home", checkpoint


def go_offline(monkeypatch, hf_home: str | Path) -> None:
    """huggingface_hub offline with its cache under ``hf_home``, in this process (its constants are read at
    import: patched) and in the processes it starts (the environment)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(Path(hf_home) / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
