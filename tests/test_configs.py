"""The application config (app/config.py): its sections, the errors of a misplaced or an old flat key, and
the serve configs in the repository (each validates, with every key in its section)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from app.config import (
    DENOISER_PREFIX,
    INGRESS,
    MOVED,
    SECTIONS,
    AppConfig,
    EngineArgs,
    HttpArgs,
    PlannerArgs,
    ResourceArgs,
    RouterArgs,
    denoiser_name,
    denoiser_tp,
    tp_worker_name,
)

ROOT = Path(__file__).resolve().parent.parent
SERVE_CONFIGS = sorted(p.name for p in ROOT.glob("serve_config*.yaml"))


def shipped_args(name: str) -> list[dict]:
    data = yaml.safe_load((ROOT / name).read_text())
    assert data["applications"]
    for app in data["applications"]:
        assert app["import_path"] == "deployments.builder:build_app"
    return [app["args"] for app in data["applications"]]


@pytest.mark.parametrize("name", SERVE_CONFIGS)
def test_serve_configs_validate(name):
    for args in shipped_args(name):
        assert set(args) <= set(SECTIONS)  # sections only at the top
        cfg = AppConfig.model_validate(args)
        for section, keys in args.items():  # every key given reached its section, unchanged in meaning
            got = getattr(cfg, section)
            for key in keys:
                assert key in type(got).model_fields


def test_the_shipped_configs_mean_what_they_say():
    cpu = AppConfig.model_validate(shipped_args("serve_config.yaml")[0])
    assert (cpu.engine.model, cpu.engine.slots, cpu.http.max_tokens_limit, cpu.resources.tp_degrees) == \
        ("tiny-bd", 32, 512, [1])
    gpu = AppConfig.model_validate(shipped_args("serve_config.gpu.yaml")[0])
    assert gpu.name == "llada-8b" and gpu.engine.device == "cuda" and gpu.resources.tp_degrees == [1, 2, 4]
    assert gpu.router.profile == "h200-llada8b-measured" and gpu.profile_name() == "h200-llada8b-measured"
    assert gpu.planner is not None and gpu.planner.gpus == 8
    assert str(gpu.engine.torch_dtype()) == "torch.bfloat16"


def test_sections_and_their_defaults():
    cfg = AppConfig()
    assert isinstance(cfg.http, HttpArgs) and isinstance(cfg.router, RouterArgs)
    assert isinstance(cfg.engine, EngineArgs) and isinstance(cfg.resources, ResourceArgs) and cfg.planner is None
    assert cfg.engine.model == "tiny-bd" and cfg.name == "tiny-bd" and cfg.engine.slots == 32
    assert cfg.router.policy == "remask-fit" and cfg.engine.policy == "dwise"
    assert cfg.router.thresholds == [0.9, 0.8, 0.7] and cfg.resources.tp_degrees == [1]
    assert cfg.http.max_ongoing == 4096
    assert str(cfg.engine.torch_dtype()) == "torch.float32"
    named = AppConfig(http={"served_model_name": "x"}, engine={"model": "tiny-mdm"})
    assert named.name == "x"


def test_sections_normalise_and_check_their_values():
    cfg = AppConfig(router={"thresholds": [0.7, 0.9, 0.9], "predictors": False},
                    resources={"tp_degrees": [4, 1, 2, 1]})
    assert cfg.router.thresholds == [0.9, 0.7] and cfg.router.predictors == "off"
    assert cfg.resources.tp_degrees == [1, 2, 4]
    for bad, where in [({"resources": {"tp_degrees": [3]}}, "powers of two"),
                       ({"router": {"thresholds": [1.5]}}, "thresholds must be"),
                       ({"router": {"policy": "nope"}}, "nope"),
                       ({"router": {"predictors": "sometimes"}}, "predictors"),
                       ({"engine": {"dtype": "int8"}}, "dtype must be"),
                       ({"engine": {"cache": "all"}}, "cache must be"),
                       ({"engine": {"slots": 0}}, "slots"),
                       ({"http": {"max_body_bytes": 10}}, "max_body_bytes"),
                       ({"planner": {"nodes": 0}}, "nodes")]:
        with pytest.raises(ValidationError, match=where):
            AppConfig.model_validate(bad)


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_an_old_flat_key_names_the_section_it_moved_to(old, new):
    section = new.split(".")[0]
    with pytest.raises(ValidationError) as err:
        AppConfig.model_validate({old: None})
    msg = str(err.value)
    assert f"`{old}` moved to `{new}`" in msg and f"under `{section}:`" in msg
    # and the key is at home there
    assert new.split(".")[1] in SECTIONS[section].model_fields


def test_every_old_flat_key_is_named_at_once():
    with pytest.raises(ValidationError) as err:
        AppConfig.model_validate({"model": "tiny-bd", "slots": 4, "router_policy": "remask",
                                  "ingress_max_ongoing": 10, "tp_degrees": [1]})
    msg = str(err.value)
    for old, new in [("model", "engine.model"), ("slots", "engine.slots"), ("router_policy", "router.policy"),
                     ("ingress_max_ongoing", "http.max_ongoing"), ("tp_degrees", "resources.tp_degrees")]:
        assert f"`{old}` moved to `{new}`" in msg


# the keys of the flat AppConfig before the sections (``planner`` kept its name and its own keys)
FLAT_KEYS = """model served_model_name tp_degrees replicas device dtype slots policy kv_capacity_tokens kv_slot_tokens
kv_memory_mb kv_memory_fraction profile_seconds threshold_wait_ms threshold_wait_frac cuda_graphs max_tokens_limit
default_max_tokens max_waiting predictors lookahead_blocks cache router_policy thresholds default_slo_ms profile
shed_over_capacity dead_after_s drain_s ingress_max_ongoing ingress_max_queued park_s round_timeout_s
cpus_per_replica gpus_per_rank api_keys max_body_bytes""".split()


def test_the_flat_layout_had_no_key_left_behind():
    """Every key of the flat layout says where it went, and each lands on a distinct key of a section."""
    assert set(MOVED) == set(FLAT_KEYS) and len(set(MOVED.values())) == len(FLAT_KEYS)


def test_unknown_and_misplaced_keys_are_refused():
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        AppConfig.model_validate({"engines": {}})
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        AppConfig.model_validate({"engine": {"slot": 4}})
    with pytest.raises(ValidationError, match="`thresholds` belongs in the `router` section, not `engine`"):
        AppConfig.model_validate({"engine": {"thresholds": [0.9]}})
    with pytest.raises(ValidationError, match="`slots` belongs in the `engine` section, not `planner`"):
        AppConfig.model_validate({"planner": {"slots": 4}})
    with pytest.raises(ValidationError, match="`api_keys` belongs in the `http` section, not `router`"):
        AppConfig.model_validate({"router": {"api_keys": []}})
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):  # in two sections: no guess
        AppConfig.model_validate({"http": {"policy": "remask"}})


def test_the_config_crosses_to_the_deployments_as_it_is():
    """The builder validates once; the deployments get the object itself, which pickles through Ray."""
    cfg = AppConfig(engine={"model": "tiny-bd", "slots": 4}, router={"thresholds": [0.8]},
                    resources={"tp_degrees": [1, 2], "replicas": {2: 1}}, planner={"gpus_per_node": 2})
    again = pickle.loads(pickle.dumps(cfg))
    assert again == cfg and isinstance(again.planner, PlannerArgs) and again.resources.replicas == {2: 1}


def test_build_app_validates_once_and_binds_the_config(monkeypatch):
    serve = pytest.importorskip("ray.serve")
    from deployments import builder

    app = builder.build_app({"engine": {"model": "tiny-bd", "slots": 4}, "resources": {"tp_degrees": [1, 2]},
                             "http": {"max_ongoing": 7}})
    assert isinstance(app, serve.Application)
    ingress = app._bound_deployment
    assert ingress.name == INGRESS and ingress._deployment_config.max_ongoing_requests == 7
    handles, cfg = ingress.init_args
    assert isinstance(cfg, AppConfig) and cfg.engine.slots == 4
    assert sorted(handles) == [1, 2]
    for d, dep in handles.items():
        assert dep._bound_deployment.name == denoiser_name(d)
        assert dep._bound_deployment.init_args == (cfg, d)  # the very object, not a dict to validate again
    with pytest.raises(ValidationError, match="`slots` moved to `engine.slots`"):
        builder.build_app({"slots": 4})


def test_deployment_names():
    assert denoiser_name(2) == f"{DENOISER_PREFIX}2" == "Denoiser_TP2" and INGRESS == "Ingress"
    assert [denoiser_tp(n) for n in (denoiser_name(4), INGRESS, DENOISER_PREFIX, "Denoiser_TPx")] == [4, None, None,
                                                                                                       None]
    assert tp_worker_name("SERVE_REPLICA::remask#Denoiser_TP2#abc", 1) == "SERVE_REPLICA::remask#Denoiser_TP2#abc:rank1"


def test_the_fault_harness_configs_validate():
    from tools.faults.harness import app_args

    cfg = AppConfig.model_validate(app_args({2: 3}, 16, router={"dead_after_s": 5.0},
                                            http={"served_model_name": "v2"}))
    assert cfg.resources.tp_degrees == [2] and cfg.resources.replicas == {2: 3} and cfg.engine.slots == 16
    assert cfg.router.dead_after_s == 5.0 and cfg.name == "v2" and cfg.http.max_tokens_limit == 256
