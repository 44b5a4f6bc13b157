"""The checked-in reports name what they ran on, and fail here when a default they depend on has moved since;
the report's summary claims no target where every policy is overloaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sim.report.render import report_profiles
from sim.report.sizes import PLANS
from sim.report.stamp import profile_stamp, stamp_line

ROOT = Path(__file__).resolve().parent.parent
REPORTS = ROOT / "reports"
REGENERATE = "regenerate them: remask report --quick --out reports/ (about 10 minutes on 2 cores)"


def _plan(command: str):
    return PLANS["tiny" if "--tiny" in command else "quick" if "--quick" in command else "full"]


def test_checked_in_reports_were_generated_on_the_current_defaults():
    stamp = json.loads((REPORTS / "stamp.json").read_text())
    want = report_profiles(_plan(stamp["command"]))
    have = {role: s["profile"] for role, s in stamp["profiles"].items()}
    assert have == want, f"reports/ ran on profiles {have}, the defaults are now {want}: {REGENERATE}"
    for role, s in stamp["profiles"].items():
        now = profile_stamp(s["profile"])
        assert now == s, (f"the {role} profile {s['profile']!r} has changed since reports/ was generated "
                          f"(then {s}, now {now}): {REGENERATE}")
    head = (REPORTS / "REPORT.md").read_text()[:4000]
    assert stamp["command"] in head and stamp_line(stamp) in head


def test_profile_stamp_follows_prices_not_layout(tmp_path):
    from engine.latency_profile import load_profile

    src = json.loads((ROOT / "profiles" / "h200-llada8b-measured.json").read_text())
    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    a.write_text(json.dumps(src))
    b.write_text(json.dumps(src, indent=4))  # the same profile, laid out otherwise
    load_profile(str(a)).scaled(1.01, name=src["name"]).save(c)  # every round 1% slower
    sa, sb, sc = (profile_stamp(str(p)) for p in (a, b, c))
    assert sa["pricing_sha256"] == sb["pricing_sha256"] and sa["file_sha256"] != sb["file_sha256"]
    assert sc["pricing_sha256"] != sa["pricing_sha256"]
    assert profile_stamp("h200-llada8b-measured")["profile"] == "h200-llada8b-measured"


def _s(slo: float, lat: float = 3.0) -> dict:
    return {"slo_attainment": slo, "mean_latency_s": lat, "p99_latency_s": 2 * lat, "filled_slots_per_round": 10}


def test_no_verdict_where_every_policy_is_overloaded():
    from sim.report.render_cluster import combined, verdicts

    data = {"cluster_rates": {
        "1.0": {"remask/dwise": _s(0.9), "remask/fcfs": _s(0.9), "infaas/dwise": _s(0.6)},
        "1.6": {"remask/dwise": _s(0.30), "remask/fcfs": _s(0.30), "infaas/dwise": _s(0.22)}},
        "cluster_rates_info": {"1.0": {"rate": 24.0}, "1.6": {"rate": 38.4}}}
    v = {x["scenario"]: x for x in verdicts(data)}
    assert v["load 1 (24.0 req/s)"]["ok"] is True
    assert v["load 1.6 (38.4 req/s)"]["ok"] is None and "no verdict" in v["load 1.6 (38.4 req/s)"]["verdict"]
    text = "\n".join(combined(data))
    assert "meets the target in 1 of 1 scenarios with a verdict" in text and "No verdict in 1" in text


def test_headline_rows_give_the_lead_and_the_command():
    from sim.cli import leads
    from sim.report.render_cluster import headline, headline_rows

    pol = {"infaas": {"slo_attainment": 0.45, "accuracy": 0.895},
           "llumnix": {"slo_attainment": 0.44, "accuracy": 0.895},
           "remask": {"slo_attainment": 0.90, "accuracy": 0.888, "shed": 12, "mean_threshold": 0.81}}
    rep = {"policies": pol, "capacity_rps": 24.0, "arrival_rate_rps": 31.2}
    rep["remask_lead"] = leads(rep)
    assert rep["remask_lead"]["infaas"] == {"slo_pp": 45.0, "accuracy_points": -0.7}
    assert rep["remask_lead"]["llumnix"]["slo_pp"] == 46.0
    data = {"cluster_headline": {"requests": 2000, "seed": 0, "profiles": {
        "h200-llada8b-measured": {"1.3": rep}, "tests/profiles/h200-llada8b-hand.json": {"1.3": rep}}}}
    rows = headline_rows(data)
    assert rows[0]["cmd"] == ("remask simulate --scenario dilaserve-bench --policies infaas,llumnix,remask "
                              "--load 1.3 --requests 2000")
    assert rows[1]["cmd"].endswith("--profile tests/profiles/h200-llada8b-hand.json")
    text = "\n".join(headline(data))
    assert "+45.0" in text and "-0.70" in text and "24.00" in text


@pytest.mark.parametrize("name", sorted(PLANS))
def test_every_plan_names_loads_the_runs_can_take(name):
    p = PLANS[name]
    loads = (*p.cl_loads, p.slo_load, p.ablation_load, p.migration_load, p.length_load, p.burst_load,
             p.diurnal_load, p.cl_seed_load, *p.headline_loads)
    assert all(0.1 <= x <= 3.0 for x in loads), loads
    assert all((ROOT / h).exists() for h in p.headline_profiles)
