"""The fault harness's content check and verdict (tools/faults/), without Ray: counting lost and mismatched
requests, the exit status of a scenario, the RSS slope, the node scenario's Serve config."""

from __future__ import annotations

import io
import json

import pytest

from tools.cli import main
from tools.faults import checks, harness, node, soak
from tools.faults.cli import print_checked


def result(text: str, outcome: str = "completed", **body) -> dict:
    return {"outcome": outcome, "text": text, "body": {"prompt": "rev: abc", **body}}


REF = ["cba", "the fox ran.", "42"]


def test_identical_texts_complete():
    s = checks.check([result("cba"), result("the fox ran."), result("42")], REF)
    assert (s["completed"], s["mismatched"], s["lost"], s["failed"]) == (3, 0, 0, 0)
    assert s["mismatches"] == [] and s["mismatched_at"] == [] and s["reference_chars"] == 17


def test_a_different_final_text_is_mismatched_with_where_it_differs():
    s = checks.check([result("cba"), result("the fix ran.", seed=1001, temperature=1.0), result("42")], REF)
    assert (s["completed"], s["mismatched"]) == (2, 1)
    (m,) = s["mismatches"]
    assert m["request"] == 1 and m["first_difference"] == 5 and m["seed"] == 1001
    assert m["expected"] == "the fox ran." and m["got"] == "the fix ran."
    # a completed text that stops short of the reference, or runs past it, is mismatched too
    s = checks.check([result("cb"), result("the fox ran.!"), result("42")], REF)
    assert s["mismatched"] == 2 and s["mismatched_at"] == [0, 1]
    assert [m["first_difference"] for m in s["mismatches"]] == [2, 12]


def test_streams_that_ended_early_must_have_received_a_prefix():
    ok = [result("cb", "cancelled"), result("the fox", "lost"), result("", "failed")]
    s = checks.check(ok, REF)
    assert (s["cancelled"], s["lost"], s["failed"], s["mismatched"]) == (1, 1, 1, 0)
    bad = [result("cx", "cancelled"), result("the owl", "lost"), result("43", "failed")]
    s = checks.check(bad, REF)
    assert s["mismatched"] == 3 and s["lost"] == 0 and s["failed"] == 0 and s["cancelled"] == 0


def test_check_refuses_unknown_outcomes_and_uneven_lists():
    with pytest.raises(ValueError, match="unknown outcome"):
        checks.check([result("cba", "done")], ["cba"])
    with pytest.raises(ValueError, match="2 results for 3"):
        checks.check([result("cba"), result("x")], REF)


def summary(lost=0, mismatched=0, kills=2, failovers=5, failed=0, reference_chars=120) -> dict:
    return {"requests": 10, "completed": 10 - lost - mismatched - failed, "lost": lost, "mismatched": mismatched,
            "failed": failed, "cancelled": 0, "kills": kills, "failovers": failovers, "mismatches": [],
            "reference_chars": reference_chars}


def test_verdict_passes_only_a_clean_run():
    assert checks.verdict(summary(), kills=2, failovers=2, max_failed=0) == []
    assert checks.verdict(summary(failed=2), kills=2, failovers=2, max_failed=2) == []


@pytest.mark.parametrize("bad,needle", [
    (dict(mismatched=1), "another text"),
    (dict(lost=1), "lost"),
    (dict(kills=0, failovers=0), "0 kills"),
    (dict(kills=1), "1 kills, not 2"),
    (dict(failovers=0), "0 failovers"),
    (dict(failovers=1), "1 failovers, not at least 2"),
    (dict(failed=3), "3 clean failures, over the bound of 2"),
    (dict(reference_chars=0), "nothing was compared"),
])
def test_verdict_fails_on_each_fault(bad, needle):
    problems = checks.verdict(summary(**bad), kills=2, failovers=2, max_failed=2)
    assert problems and any(needle in p for p in problems), problems


def test_zero_kills_never_pass_even_when_none_were_asked():
    assert checks.verdict(summary(kills=0), kills=0, failovers=0, max_failed=0)


def gated(**kw) -> dict:
    reports = [{"replica": "r1", "requests_held": 4, "detected_s": 0.4, "failed_over": 5, "resume_gap_s": None,
                "replaced_s": 20.0}]
    return checks.gate({**summary(**kw), "scenario": "kill", "kill_reports": reports}, 2, 2, 0)


def test_exit_status_and_the_summary_line():
    out = io.StringIO()
    assert print_checked(gated(), False, out) == 0
    text = out.getvalue()
    assert text.startswith("kill: 0 lost, 0 mismatched; 2 kills, 5 failovers") and text.rstrip().endswith("PASS")
    assert "kill r1 (4 requests): dropped by the ingress after 0.4 s, 5 failed over" in text
    for bad in (dict(mismatched=1), dict(kills=0, failovers=0), dict(failovers=0), dict(lost=1)):
        out = io.StringIO()
        assert print_checked(gated(**bad), False, out) == 1, bad
        assert "FAIL: " in out.getvalue()
    out = io.StringIO()
    assert print_checked(gated(mismatched=1), True, out) == 1
    res = json.loads(out.getvalue())
    assert res["mismatched"] == 1 and res["passed"] is False and res["problems"]


def test_a_mismatch_is_printed_with_its_request():
    s = checks.check([result("cba"), result("the fix ran.", seed=1001, temperature=1.0, threshold=0.9), result("42")],
                     REF)
    s.update(scenario="kill", kills=2, failovers=3)
    out = io.StringIO()
    assert print_checked(checks.gate(s, 2, 2, 0), False, out) == 1
    assert "1 mismatched" in out.getvalue()
    assert "MISMATCH request 1 (completed; seed 1001, temperature 1.0, threshold 0.9) at character 5" in out.getvalue()


def test_fault_requests_are_deterministic_with_fixed_thresholds():
    a, b = checks.fault_requests(12), checks.fault_requests(12)
    assert a == b and len(a) == 12
    assert all(r["stream"] and r["threshold"] in (0.9, 0.999) for r in a)  # the router never picks a threshold
    assert [r["temperature"] for r in a[:4]] == [0.0, 1.0, 0.0, 1.0]
    assert [r.get("seed") for r in a[:4]] == [None, 1001, None, 1003]
    assert {r["threshold"] for r in a} == {0.9, 0.999}
    long = checks.fault_requests(4, long=True)
    assert all(r["max_tokens"] == 200 and r["threshold"] == 0.9999 for r in long)
    with pytest.raises(ValueError):
        checks.fault_requests(0)


def test_rss_slope_is_fitted_after_the_warm_up():
    # 200 MB of start-up growth in the first minute, then 0.5 MB/min for 20 minutes
    samples = [(t, 100 + 200 * min(t, 60) / 60 + 0.5 * max(t - 60, 0) / 60) for t in range(0, 1260, 10)]
    slope, span = soak.rss_slope(samples, warmup_s=60)
    assert slope == pytest.approx(0.5, abs=1e-6) and span == pytest.approx(20.0, abs=0.2)
    assert soak.rss_slope(samples, warmup_s=0)[0] > 1.0  # the start-up growth counted: far steeper
    assert soak.rss_slope(samples[:3], warmup_s=60) == (None, 0.0)
    assert soak.rss_slope([], warmup_s=0) == (None, 0.0)


def test_soak_kills_one_per_period_before_the_end():
    assert soak.soak_kills(1800, 300) == 5
    assert soak.soak_kills(601, 300) == 2
    assert soak.soak_kills(120, 300) == 0
    with pytest.raises(ValueError):
        soak.soak_kills(600, 0)


def test_node_config_places_denoisers_by_the_custom_resource():
    from ray.serve.schema import ServeDeploySchema

    from app.config import AppConfig

    args = harness.app_args({1: 2}, 16, router=harness.FAULT_ROUTER)
    cfg = node.node_serve_config(args, 8799)
    ServeDeploySchema.model_validate(cfg)  # Serve accepts it as a config file
    (app,) = cfg["applications"]
    assert AppConfig.model_validate(app["args"]).router.shed_over_capacity is False  # and the app its args
    deps = {d["name"]: d for d in app["deployments"]}
    den = deps["Denoiser_TP1"]
    assert den["ray_actor_options"]["resources"] == {node.DENOISER_RESOURCE: 1}
    assert den["placement_group_bundles"][0][node.DENOISER_RESOURCE] == 1
    assert node.HEAD_RESOURCE in deps["Ingress"]["ray_actor_options"]["resources"]
    assert cfg["proxy_location"] == "HeadOnly" and app["args"]["resources"]["replicas"] == {1: 2}
    with pytest.raises(ValueError, match="TP-1"):
        node.node_serve_config(harness.app_args({2: 1}, 16), 8799)


@pytest.mark.parametrize("argv,needle", [
    (["faults", "--replicas", "1"], "--replicas >= 2"),
    (["faults", "--kills", "0"], "--kills >= 1"),
    (["faults", "--max-failed", "-1"], "--max-failed >= 0"),
    (["faults", "--scenario", "soak", "--minutes", "0"], "--minutes > 0"),
    (["faults", "--scenario", "soak", "--kill-every", "0"], "--kill-every > 0"),
])
def test_bad_arguments_are_refused_before_any_work(argv, needle, capsys):
    assert main(argv) == 2
    assert needle in capsys.readouterr().err
