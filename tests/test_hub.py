"""Hub ids (engine.models.hub): resolved offline from a hub cache laid out on disk as the hub lays it out
(tests/hubcache.py), for generate, serve configs (build_app's pin) and the resolver's errors. Nothing is
downloaded: HF_HUB_OFFLINE is on and HF_HOME a temporary directory."""

from __future__ import annotations

import os
import re

import pytest

from engine.loading import resolve_model
from engine.models.hub import ALLOW_PATTERNS, is_hub_id, local_model, snapshot_ref
from tests.hubcache import COMMIT, build_hub, go_offline
from tools.cli import main

REPO = "acme/tiny-dream"


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory):
    """HF_HOME holding acme/tiny-dream (refs main and v1) and the directory it was laid out from."""
    return build_hub(tmp_path_factory.mktemp("hub"), "dream", REPO, ("main", "v1"))


@pytest.fixture
def offline(hub_home, monkeypatch):
    """huggingface_hub offline, its cache in hub_home: acme/tiny-dream's snapshot directory."""
    home, _ = hub_home
    go_offline(monkeypatch, home)
    return home / "hub" / "models--acme--tiny-dream" / "snapshots" / COMMIT


def test_hub_ids_are_told_from_names_and_paths(tmp_path, monkeypatch):
    assert is_hub_id("GSAI-ML/LLaDA-8B-Instruct") and is_hub_id("Dream-org/Dream-v0-Instruct-7B")
    for name in ("tiny-bd", "/data/models/x", "./a/b", "~/a", "a/b/c", "../a", "a/..", "llada-8b-shape"):
        assert not is_hub_id(name), name
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not is_hub_id("org/name")  # a local directory of that name wins
    assert resolve_model("org/name").resolve() == tmp_path / "org" / "name"


def test_a_hub_id_resolves_offline_to_its_snapshot_by_branch_tag_or_commit(offline):
    assert resolve_model(REPO) == offline
    assert resolve_model(REPO, "v1") == offline
    assert resolve_model(REPO, COMMIT) == offline
    assert (offline / "config.json").is_symlink() and (offline / "config.json").resolve().parent.name == "blobs"
    assert local_model(REPO) == str(offline) and local_model("tiny-bd") == "tiny-bd"


def test_a_pinned_snapshot_missing_here_resolves_by_its_repo_and_commit(offline, tmp_path):
    elsewhere = tmp_path / "other-node" / "hub" / "models--acme--tiny-dream" / "snapshots" / COMMIT
    assert snapshot_ref(elsewhere) == (REPO, COMMIT)
    assert snapshot_ref(elsewhere / "config.json") is None and snapshot_ref(tmp_path) is None
    assert resolve_model(str(elsewhere)) == offline


def test_what_cannot_be_resolved_offline_is_a_clear_error(offline, capsys):
    with pytest.raises(FileNotFoundError, match="'acme/missing' is not in the hub cache .* HF_HUB_OFFLINE is set"):
        resolve_model("acme/missing")
    with pytest.raises(FileNotFoundError, match="at revision 'v2' is not in the hub cache"):
        resolve_model(REPO, "v2")
    with pytest.raises(ValueError, match="--revision 'v1' applies to a hub id"):
        local_model("tiny-bd", "v1")
    assert main(["generate", "--model", "acme/missing", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "remask: error: hub model 'acme/missing' is not in the hub cache" in err and "Traceback" not in err


def test_generate_decodes_from_a_hub_id(offline, capsys):
    assert main(["generate", "--model", REPO, "--revision", "v1", "--prompt", "Grüße", "--max-tokens", "8",
                 "--show-steps"]) == 0
    out = capsys.readouterr()
    assert f"{REPO} resolved to {offline}" in out.err
    assert out.out.startswith("step   1 ") and re.search(r"\n\[(length|stop); \d+ rounds", out.out)


def test_a_serve_config_naming_a_hub_id_is_pinned_once_to_its_snapshot(offline):
    from app.config import AppConfig
    from deployments.builder import pin_model

    pinned = pin_model(AppConfig(engine={"model": REPO, "revision": "v1"}))
    assert pinned.engine.model == str(offline) and pinned.name == REPO  # clients still say acme/tiny-dream
    named = pin_model(AppConfig(engine={"model": REPO}, http={"served_model_name": "dream"}))
    assert named.engine.model == str(offline) and named.name == "dream"
    assert pin_model(AppConfig()) == AppConfig()  # an embedded model as it is
    with pytest.raises(FileNotFoundError, match="not in the hub cache"):
        pin_model(AppConfig(engine={"model": "acme/missing"}))


def test_the_downloaded_files_are_every_file_the_loader_reads(hf_checkpoints):
    """Each fixture family's files (config, weights and index, tokenizer, chat template, generation config)
    pass ALLOW_PATTERNS; a README or a PyTorch .bin does not (nothing the loader reads)."""
    from huggingface_hub.utils import filter_repo_objects

    for arch, directory in hf_checkpoints.items():
        files = sorted(os.listdir(directory))
        assert sorted(filter_repo_objects(files, allow_patterns=list(ALLOW_PATTERNS))) == files, arch
    assert not list(filter_repo_objects(["README.md", "pytorch_model.bin", "modeling_llada.py"],
                                        allow_patterns=list(ALLOW_PATTERNS)))
