"""Hub ids (``org/name``) resolved to a local checkpoint directory with huggingface_hub.

``resolve_hub(repo_id, revision)`` returns the snapshot directory of the hub cache
(``$HF_HOME/hub/models--org--name/snapshots/<commit>``), downloading only the files the loader and the
tokenizer read (``ALLOW_PATTERNS``) when they are not cached yet, with huggingface_hub's progress bar.
huggingface_hub reads ``HF_HOME`` (or ``HF_HUB_CACHE``), ``HF_HUB_OFFLINE`` and ``HF_TOKEN`` itself; nothing
here overrides them. Offline, a cached snapshot resolves through ``refs/<revision>`` with no network; a
model that is not cached is a ``FileNotFoundError`` saying so, never a traceback from the hub client.

A snapshot directory that is absent on this machine (a serve config pinned on another node, see
``deployments.builder``) resolves again from its repo id and commit (``snapshot_ref``).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

log = logging.getLogger(__name__)

# what engine.models.loader (config.json, safetensors and their index) and engine.tokenizer (the tokenizer's
# files, its chat template, generation_config.json) read; trust_remote_code is off, so no *.py
ALLOW_PATTERNS = (
    "config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "*.tiktoken", "vocab.json", "vocab.txt", "merges.txt",
    "chat_template.json", "chat_template.jinja", "additional_chat_templates/*.jinja",
)
_PART = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
_HUB_ID = re.compile(rf"{_PART}/{_PART}")
_SNAPSHOT = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<commit>[0-9a-f]{40})/?")


def is_hub_id(name: str) -> bool:
    """``org/name`` as the hub spells a model repo (not an existing path, not ``./x``, ``/x`` or ``~/x``)."""
    return bool(_HUB_ID.fullmatch(name)) and ".." not in name and not Path(name).exists()


def snapshot_ref(path: str | Path) -> tuple[str, str] | None:
    """(repo id, commit) of a hub cache snapshot directory's path, else None."""
    m = _SNAPSHOT.search(Path(path).as_posix())
    return (f"{m['org']}/{m['name']}", m["commit"]) if m and m.end() == len(Path(path).as_posix()) else None


def resolve_hub(repo_id: str, revision: str | None = None) -> Path:
    """The local snapshot directory of hub model ``repo_id`` at ``revision`` (default: the repo's main
    branch), downloaded first when not cached. Errors: ``FileNotFoundError`` (not cached and the hub cannot
    be reached, no such repo or revision, or a gated one without ``HF_TOKEN``), ``ValueError`` (not a valid
    repo id): the command lines print either as one line."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"hub model {repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    try:
        path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=list(ALLOW_PATTERNS)))
    except HFValidationError as exc:
        raise ValueError(f"{repo_id!r} is not a hub id (org/name): {exc}") from None
    except LocalEntryNotFoundError:
        offline = constants.HF_HUB_OFFLINE
        raise FileNotFoundError(
            f"{where} is not in the hub cache {constants.HF_HUB_CACHE} and "
            + ("HF_HUB_OFFLINE is set" if offline else "the hub cannot be reached")
            + ": download it where the hub is reachable (the same HF_HOME), or give a local directory") from None
    except GatedRepoError:
        raise FileNotFoundError(f"{where} is gated: accept its terms on the hub and set HF_TOKEN") from None
    except RevisionNotFoundError:
        raise FileNotFoundError(f"{where}: no such revision on the hub") from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(f"{where}: no such repository on the hub (or it is private: set HF_TOKEN)") from None
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{where} resolved to {path}, which holds no config.json: not a model checkpoint")
    log.info("%s resolved to %s", where, path)
    return path


def local_model(name: str, revision: str | None = None) -> str:
    """``name`` with a hub id replaced by its snapshot directory (at ``revision``); any other name as it is
    (the command lines resolve once, then hand the directory on)."""
    if is_hub_id(name):
        return str(resolve_hub(name, revision))
    if revision is not None:
        raise ValueError(f"--revision {revision!r} applies to a hub id (org/name), not to {name!r}")
    return name
