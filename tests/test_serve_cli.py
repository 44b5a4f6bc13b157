"""``remask serve MODEL`` (tools/serve_cli.py): the serve config it writes (``--dry-run``) means what
serve_config.yaml means, parses with the app's config class and Serve's schema, takes vLLM's options and a
hub id from an offline hub cache; device/GPU mismatches are refused at start. One slow test starts it for real
and stops it with Ctrl-C."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from app.config import AppConfig
from tests.hubcache import COMMIT, build_hub, go_offline
from tests.serving import quick_stops
from tools.cli import main

ROOT = Path(__file__).resolve().parent.parent
REPO = "acme/tiny-sdar"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """HF_HOME holding acme/tiny-sdar, and the checkpoint directory it was laid out from."""
    return build_hub(tmp_path_factory.mktemp("serve_hub"), "sdar", REPO)


@pytest.fixture
def no_cuda(monkeypatch):
    """--device auto sees no GPU (the same answer on a GPU machine)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def dry_run(capsys, *argv: str) -> dict:
    assert main(["serve", *argv, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# Remask, written by `remask serve --dry-run`")
    return yaml.safe_load(out)


def app_of(doc: dict) -> dict:
    (app,) = doc["applications"]
    return app


def test_serve_tiny_bd_writes_what_serve_config_yaml_means(capsys, no_cuda):
    from ray.serve.schema import ServeDeploySchema

    ours, make_serve = dry_run(capsys, "tiny-bd"), yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    ServeDeploySchema.model_validate(ours)  # what `serve run FILE` checks first
    for key in ("proxy_location", "http_options"):
        assert ours[key] == make_serve[key]
    ours_app, theirs = app_of(ours), app_of(make_serve)
    assert {k: v for k, v in ours_app.items() if k != "args"} == {k: v for k, v in theirs.items() if k != "args"}
    assert AppConfig.model_validate(ours_app["args"]) == AppConfig.model_validate(theirs["args"])


def test_vllm_options_land_in_the_config(capsys, no_cuda, tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    doc = dry_run(capsys, "tiny-mdm", "--host", "0.0.0.0", "--port", "9001", "--tp", "1", "2,4",
                  "--served-model-name", "mdm", "--api-key", "k1", "--api-key", "k2", "--chat-template", str(template),
                  "--max-model-len", "300", "--allowed-origins", '["https://a.example", "https://b.example"]')
    assert doc["http_options"] == {"host": "0.0.0.0", "port": 9001}
    cfg = AppConfig.model_validate(app_of(doc)["args"])
    assert cfg.engine.model == "tiny-mdm" and cfg.name == "mdm" and cfg.resources.tp_degrees == [1, 2, 4]
    assert [k.name for k in cfg.http.api_keys] == ["key-1", "key-2"]  # as salted hashes (the next test)
    assert all(k.key is None and k.key_hash for k in cfg.http.api_keys)
    assert cfg.http.chat_template == template.read_text()  # the file's text: the config stands alone
    assert cfg.http.max_model_len == 300 and cfg.http.max_tokens_limit == 300  # no answer past it
    assert cfg.http.allowed_origins == ["https://a.example", "https://b.example"]
    assert cfg.engine.device == "cpu" and cfg.resources.gpus_per_rank == 0
    doc = dry_run(capsys, "tiny-bd", "--tensor-parallel-size", "2", "--allowed-origins", "*")
    assert app_of(doc)["args"]["resources"]["tp_degrees"] == [2]
    assert app_of(doc)["args"]["http"]["allowed_origins"] == ["*"]


KEY = "sk-remask-cli-7d2e91c4"  # a key given with --api-key: it must show up nowhere but in the requests


@pytest.mark.slow
def test_an_api_key_from_the_command_line_is_in_no_config_log_or_debug_page(capsys, caplog, no_cuda):
    """``--api-key KEY``: what Serve logs at every deploy (the application's args, and what the built
    application carries: its deployments' arguments and options, runtime environments included), the printed
    config, the ingress's logs and its /debug pages hold no KEY; the ingress takes KEY and refuses another."""
    import json
    import logging

    from fastapi import testclient
    from ray import cloudpickle

    from app.auth import hash_key
    from app.frontend import Frontend
    from app.routes import build_web
    from deployments.builder import build_app

    caplog.set_level(logging.DEBUG)
    assert main(["serve", "tiny-bd", "--api-key", KEY, "--dry-run"]) == 0
    printed = capsys.readouterr()
    assert KEY not in printed.out + printed.err
    args = app_of(yaml.safe_load(printed.out))["args"]
    (spec,) = args["http"]["api_keys"]
    assert spec["name"] == "key-1" and set(spec) == {"name", "key_hash"} and KEY not in json.dumps(args)
    salt = bytes.fromhex(spec["key_hash"].split("$")[2])
    assert spec["key_hash"] == hash_key(KEY, salt=salt)  # salted: another run writes another hash
    app = build_app(args)  # what `serve run` deploys; Serve pickles it to its controller
    assert KEY.encode() not in cloudpickle.dumps(app) and KEY not in repr(app)

    cfg = AppConfig.model_validate(args)
    fe = Frontend(cfg.model_copy(update={"router": cfg.router.model_copy(update={"predictors": "off"})}))
    client = testclient.TestClient(build_web(lambda: fe))
    auth = {"Authorization": f"Bearer {KEY}"}
    assert client.get("/v1/models", headers=auth).status_code == 200
    assert client.get("/v1/models", headers=auth).status_code == 200  # the second time from what it remembered
    assert client.get("/v1/models", headers={"Authorization": "Bearer sk-another"}).status_code == 401
    for page in ("/debug/cluster", "/debug/instances", "/debug/planner", "/debug/predictors", "/debug/control",
                 "/openapi.json", "/health"):
        r = client.get(page, headers=auth)
        assert r.status_code in (200, 503) and KEY not in r.text, page
    logged = "\n".join(f"{r.getMessage()} {r.args!r}" for r in caplog.records)
    assert caplog.records and KEY not in logged and KEY not in caplog.text


def test_device_auto_takes_cuda_with_a_gpu_per_rank(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = AppConfig.model_validate(app_of(dry_run(capsys, "tiny-bd", "--tp", "1,2"))["args"])
    assert cfg.engine.device == "cuda" and cfg.resources.gpus_per_rank == 1
    cfg = AppConfig.model_validate(app_of(dry_run(capsys, "tiny-bd", "--device", "cpu"))["args"])
    assert cfg.engine.device == "cpu" and cfg.resources.gpus_per_rank == 0


def test_config_file_is_the_start_and_the_options_override_it(capsys, hub, no_cuda):
    _, checkpoint = hub
    doc = dry_run(capsys, str(checkpoint), "--config", str(ROOT / "serve_config.checkpoint.yaml"), "--device", "cpu",
                  "--port", "8123")
    args = app_of(doc)["args"]
    assert doc["http_options"]["port"] == 8123 and doc["proxy_location"] == "HeadOnly"
    assert args["engine"]["model"] == str(checkpoint) and args["engine"]["device"] == "cpu"
    assert args["resources"]["gpus_per_rank"] == 0
    assert args["http"] == {"served_model_name": "dream-7b", "max_tokens_limit": 1024, "default_max_tokens": 256}
    # the GPU config keeps its planner and its app-level autoscaling policy; its device stays without --device
    doc = dry_run(capsys, "tiny-bd", "--config", str(ROOT / "serve_config.gpu.yaml"))
    assert app_of(doc)["autoscaling_policy"] == {"policy_function": "app.autoscaling:planner_policy"}
    cfg = AppConfig.model_validate(app_of(doc)["args"])
    assert cfg.engine.device == "cuda" and cfg.resources.gpus_per_rank == 1 and cfg.planner.gpus == 8


def test_a_hub_id_resolves_from_the_offline_cache_and_stays_a_hub_id(capsys, hub, monkeypatch, no_cuda):
    home, _ = hub
    go_offline(monkeypatch, home)
    assert main(["serve", REPO, "--revision", "main", "--dry-run"]) == 0
    out = capsys.readouterr()
    assert f"resolved to {home / 'hub' / 'models--acme--tiny-sdar' / 'snapshots' / COMMIT}" in out.err
    engine = app_of(yaml.safe_load(out.out))["args"]["engine"]
    assert engine["model"] == REPO and engine["revision"] == "main"  # portable: each `serve run` resolves it
    assert main(["serve", "acme/missing", "--dry-run"]) == 2
    assert "hub model 'acme/missing' is not in the hub cache" in capsys.readouterr().err


def test_mismatches_and_bad_input_are_errors_at_start(capsys, tmp_path, no_cuda):
    with pytest.raises(ValidationError, match="engine.device cuda with resources.gpus_per_rank 0"):
        AppConfig(engine={"device": "cuda"})
    with pytest.raises(ValidationError, match="engine.device cpu with resources.gpus_per_rank 1"):
        AppConfig(resources={"gpus_per_rank": 1})
    assert AppConfig(resources={"gpus_per_rank": 0.5}).resources.shares_gpus  # logical GPU shares on a CPU
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"applications": [{"name": "remask", "import_path": "deployments.builder:build_app",
                                                     "args": {"engine": {"device": "cuda"}}}]}))
    cases = [(["tiny-bd", "--config", str(bad)], "engine.device cuda with resources.gpus_per_rank 0"),
             ([], "name a MODEL"),
             (["tiny-bd", "--chat-template", "no-such-file"], "neither a file nor a Jinja template"),
             (["tiny-bd", "--allowed-origins", '["*", 3]'], "a JSON list of strings"),
             (["tiny-bd", "--config", str(ROOT / "pyproject.toml")], "not a serve config"),
             (["nowhere/at/all"], "unknown model 'nowhere/at/all'")]
    for argv, message in cases:
        assert main(["serve", *argv, "--dry-run"]) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_serve_a_hub_id_for_real_and_stop_it_with_ctrl_c(hub, tmp_path):
    """`remask serve org/name --api-key KEY` in a process of its own (its own Ray, its logs in a directory of
    their own), offline: /health, one completion (its usage counts the prompt as /tokenize does, and the answer
    as its finish says), a wrong key refused, then SIGINT: Serve and Ray shut down and the command exits 0. KEY
    is in none of the command's output, Ray's logs (Serve logs the application's args at every deploy) or the
    /debug pages."""
    import shutil
    import tempfile

    import httpx

    home, _ = hub
    port = _free_port()
    # the start made light: no profile measurement, no learners; the stop too: the stopping replicas look every
    # 0.2 s whether they are drained (Serve's default: every 2 s, the Ingress's tier and then the Denoiser's)
    config = tmp_path / "light.yaml"
    config.write_text(yaml.safe_dump({"applications": [{"name": "remask", "route_prefix": "/",
                                                        "import_path": "deployments.builder:build_app", "args": {
        "engine": {"slots": 4, "profile_seconds": 0}, "router": {"predictors": "off"},
        "resources": {"cpus_per_replica": 0.1}}, "deployments": quick_stops()}]}))
    ray_tmp = tempfile.mkdtemp(prefix="rk", dir="/tmp")  # short: Ray's socket paths live under it
    # one torch thread in Ray's workers, as a `remask serve` without OMP_NUM_THREADS gives them (`make test` sets 2,
    # and this cluster runs beside the shared one and the other tests on 2 cores)
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "RAY_DEDUP_LOGS": "0", "RAY_TMPDIR": ray_tmp,
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "tools.cli", "serve", REPO, "--config", str(config), "--port",
                             str(port), "--device", "cpu", "--address", "local", "--api-key", KEY], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        assert proc.poll() is None, proc.stdout.read()
        request = {"model": REPO, "prompt": "Grüße", "max_tokens": 8, "temperature": 0}
        assert httpx.post(f"{url}/v1/completions", json=request, timeout=60).status_code == 401  # no key
        assert httpx.post(f"{url}/v1/completions", json=request, timeout=60,
                          headers={"Authorization": "Bearer sk-wrong"}).status_code == 401
        r = httpx.post(f"{url}/v1/completions", json=request, timeout=60, headers=auth)
        assert r.status_code == 200, r.text
        body = r.json()
        (choice,), usage = body["choices"], body["usage"]
        prompt = httpx.post(f"{url}/tokenize", json={"model": REPO, "prompt": "Grüße"}, headers=auth, timeout=30)
        assert body["model"] == REPO and body["object"] == "text_completion" and isinstance(choice["text"], str)
        assert usage["prompt_tokens"] == prompt.json()["count"]  # the prompt as the served tokenizer counts it
        assert 1 <= usage["completion_tokens"] <= 8
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert choice["finish_reason"] == ("length" if usage["completion_tokens"] == 8 else "stop"), body
        pages = [httpx.get(f"{url}{p}", headers=auth, timeout=30).text
                 for p in ("/debug/cluster", "/debug/instances", "/debug/planner")]
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert "remask: stopping" in out and "Traceback" not in out
        assert KEY not in out and not any(KEY in p for p in pages)
        logs = [f for f in Path(ray_tmp).rglob("*") if f.is_file() and "logs" in f.parts]
        assert any(f.name.startswith("controller") for f in logs), sorted(f.name for f in logs)[:20]
        leaked = [f.name for f in logs if KEY.encode() in f.read_bytes()]
        assert not leaked, f"the key is in Ray's logs: {leaked}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        shutil.rmtree(ray_tmp, ignore_errors=True)
