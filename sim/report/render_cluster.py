"""REPORT.md sections of the cluster level (DiLaServe Figures 8-13) and the combined-policy verdict."""

from __future__ import annotations

import statistics

from sim.report import paper as P
from sim.report.cluster_runs import ROLES
from sim.report.tables import fmt, md_table, pct_change, pp

COMBINED, DILA, DWISE = "remask/dwise", "remask/fcfs", "infaas/dwise"


def _cell(s: dict | None, key: str, digits: int = 3) -> str:
    if not s:
        return "—"
    v = s.get(key)
    return fmt(v, digits) if v is not None else "—"


def _acc(s: dict) -> str:
    if s.get("accuracy") is None:
        return "—"
    ci = s.get("accuracy_ci95")
    return f"{s['accuracy']:.3f}" + (f" ± {ci:.3f}" if ci else "")


def policy_table(runs: dict[str, dict], roles: bool = True) -> str:
    rows = []
    for c, s in runs.items():
        rows.append([c, ROLES.get(c, "") if roles else "", fmt(s["slo_attainment"], 3), _acc(s),
                     f"{s['mean_latency_s']:.2f} / {s['p99_latency_s']:.2f}", fmt(s["mean_threshold"], 3),
                     fmt(s["filled_slots_per_round"], 1), fmt(s["migrations"])])
    return md_table(["router/instance", "role", "SLO attainment", "accuracy", "mean / p99 latency (s)",
                     "mean threshold", "filled slots / round (of 32)", "migrations"], rows)


def setup_text(data: dict) -> list[str]:
    scope = None
    for runs in data.get("cluster_rates", {}).values():
        for s in runs.values():
            if s.get("accuracy_scope") and "corrected" in s["accuracy_scope"]:
                scope = s["accuracy_scope"]
    roles = md_table(["router/instance", "role", "router", "instance scheduler"],
                     [[c, r, c.split("/")[0], {"fcfs": "fcfs-mixed (FCFS, vLLM-like)", "dwise": "dwise (SRPT)"}
                       [c.split("/")[1]]] for c, r in ROLES.items()])
    est = ("" if not scope or "corrected" not in scope else
           " This run samples the replays: requests whose thresholds all give the same answer in the table take "
           "that answer, corrected by the mean difference over a random sample of real replays (a control "
           "variate); those whose thresholds disagree are replayed. Accuracy cells carry the estimate's 95% "
           f"half-width, e.g. \"{scope}\".")
    prof = data.get("cluster_profile", "h200-llada8b-measured")
    cap = data.get("cluster_capacity_rps")
    return ["## Cluster level (DiLaServe) and the combined policy\n",
            f"Profile: **`{prof}`** (every table of this section). Rates are written as loads: multiples of the "
            "cluster's capacity at the top candidate threshold for the run's mix and instances "
            "(`sim.cluster_scenarios.scenario_capacity`, from the planner's mixed-rounds model: each instance at the "
            "most requests per round at which the mean request still meets its SLO)"
            + (f"; 16 x TP-1 on this profile: **{cap:.2f} req/s** at load 1" if cap else "") + ". "
            "Unless noted: 16 TP-1 instances, B = 32 slots each, LLaDA-8B-shaped "
            "requests (256-token canvas in 8 blocks, approximate KV cache) whose rounds and answers are the "
            "embedded tiny-bd model's, scaled (`sim/cluster_scenarios.py`), Poisson arrivals, SLO = 5x the "
            "request's isolated TP-1 latency at threshold 0.9, candidate thresholds "
            + "/".join(f"{t:g}" for t in data.get("cluster_candidates", ())) + " (those within 2 accuracy points of "
            "0.9's). Accuracy is the tiny model's on its task suite, not LLaDA's on GSM8K; "
            "requests whose threshold changed are decoded again by the model." + est + "\n",
            "The cluster simulator takes the router policy and the instance scheduling policy independently "
            "(`ClusterConfig.instance_policy`), so every pair runs on the same requests:\n", roles,
            "\nNote: the README's cluster figures label pairs by router only; they all ran with DWISE instances "
            "(the simulator's default), i.e. `infaas/dwise`, `llumnix/dwise`, `remask/dwise` here.\n"]


def headline_cmd(profile: str, load: str, n: int, seed: int, default: str) -> str:
    return ("remask simulate --scenario dilaserve-bench --policies infaas,llumnix,remask "
            f"--load {float(load):g} --requests {n}" + (f" --seed {seed}" if seed else "")
            + ("" if profile == default else f" --profile {profile}"))


def headline_rows(data: dict) -> list[dict]:
    """One row per (profile, load) of the headline section: its figures, Remask's leads and the command."""
    d = data.get("cluster_headline")
    if not d:
        return []
    profiles = list(d["profiles"])
    rows = []
    for prof, by_load in d["profiles"].items():
        for load, rep in by_load.items():
            pol = rep["policies"]
            lead = rep.get("remask_lead", {})
            rows.append({"profile": prof, "load": float(load), "capacity_rps": rep["capacity_rps"],
                         "rate": rep["arrival_rate_rps"], "slo": {k: v["slo_attainment"] for k, v in pol.items()},
                         "accuracy": {k: v["accuracy"] for k, v in pol.items()},
                         "shed": pol.get("remask", {}).get("shed"), "threshold": pol.get("remask", {}).get(
                             "mean_threshold"), "lead": lead,
                         "cmd": headline_cmd(prof, load, d["requests"], d["seed"], profiles[0])})
    return rows


def headline(data: dict) -> list[str]:
    rows = headline_rows(data)
    if not rows:
        return []
    f9 = P.DILA["fig9"]
    table = []
    for x in rows:
        s, lead = x["slo"], x["lead"]
        table.append([f"`{x['profile']}`", f"{x['capacity_rps']:.2f}", f"{x['load']:g} ({x['rate']:.1f})",
                      " / ".join(fmt(s.get(k), 3) for k in ("infaas", "llumnix", "remask")),
                      f"{lead['infaas']['slo_pp']:+.1f}" if "infaas" in lead else "—",
                      f"{lead['llumnix']['slo_pp']:+.1f}" if "llumnix" in lead else "—",
                      f"{lead['infaas']['accuracy_points']:+.2f}" if "infaas" in lead else "—",
                      fmt(x["threshold"], 3), fmt(x["shed"]), f"`{x['cmd']}`"])
    return ["### Headline: Remask against INFaaS and Llumnix, per profile (DiLaServe Figure 9)\n",
            "The `remask simulate` command of each row (16 x TP-1, DWISE instances, the papers' baselines at "
            "threshold 0.9 admitting everything, Remask shedding what cannot meet its SLO, every mixed-threshold "
            "answer decoded again). The load is a multiple of that profile's own capacity, so each profile is "
            "as loaded as the other.\n",
            md_table(["profile", "capacity (req/s, load 1)", "load (req/s)", "SLO: INFaaS / Llumnix / Remask",
                      "Remask vs INFaaS (pp)", "vs Llumnix (pp)", "accuracy vs 0.9 (points)",
                      "Remask mean threshold", "Remask shed", "command"], table),
            f"\nPaper ({f9['source']}): at high request rates +{f9['high_rate_slo_pp_vs_infaas']} pp over INFaaS "
            f"(accuracy {f9['high_rate_acc_pct_vs_infaas']}%), +{f9['high_rate_slo_pp_vs_llumnix']} pp over "
            f"Llumnix.\n"]


def _rate(info: dict | None) -> str:
    return f"{info['rate']:.1f} req/s" if info else "?"


def load_label(data: dict, load: str) -> str:
    """'load 1.3 (31.2 req/s)' for a key of the load sweep."""
    return f"load {float(load):g} ({_rate(data.get('cluster_rates_info', {}).get(load))})"


def rates(data: dict) -> list[str]:
    d = data.get("cluster_rates")
    if not d:
        return []
    out = ["### Load sweep (DiLaServe Figure 9)\n",
           "Each load is a multiple of the 16 x TP-1 capacity; the papers' \"high request rate\" is where the "
           "fixed-threshold baselines attain about half.\n"]
    for load, runs in d.items():
        out += [f"**{load_label(data, load)}**\n", policy_table(runs), ""]
    f9 = P.DILA["fig9"]
    rows = []
    for load, runs in d.items():
        c, i, lx = runs.get(COMBINED), runs.get("infaas/fcfs"), runs.get("llumnix/fcfs")
        if c and i and lx:
            rows.append([load_label(data, load), pp(c["slo_attainment"], i["slo_attainment"]),
                         pp(c["slo_attainment"], lx["slo_attainment"]),
                         pp(c["accuracy"], i["accuracy"]) if c["accuracy"] is not None else "—",
                         pct_change(c["mean_latency_s"], i["mean_latency_s"])])
    out += ["Remask (combined) against the paper's baselines:\n",
            md_table(["load", "SLO vs INFaaS", "SLO vs Llumnix", "accuracy vs INFaaS", "mean latency vs INFaaS"], rows),
            f"\nPaper ({f9['source']}): at high request rates +{f9['high_rate_slo_pp_vs_infaas']} pp over INFaaS "
            f"(accuracy {f9['high_rate_acc_pct_vs_infaas']}%) and +{f9['high_rate_slo_pp_vs_llumnix']} pp over "
            f"Llumnix (accuracy {f9['high_rate_acc_pct_vs_llumnix']}%); the summary gives no attainment levels "
            "and no per-rate values.\n"]
    return out


def slo(data: dict) -> list[str]:
    d = data.get("cluster_slo")
    if not d:
        return []
    combos = list(next(iter(d["factors"].values())))
    rows = []
    for f, runs in d["factors"].items():
        c, i, lx = runs.get(COMBINED), runs.get("infaas/fcfs"), runs.get("llumnix/fcfs")
        rows.append([f"{float(f):g}x"] + [fmt(runs[k]["slo_attainment"], 3) for k in combos]
                    + [pp(c["slo_attainment"], i["slo_attainment"]) if c and i else "—",
                       pp(c["slo_attainment"], lx["slo_attainment"]) if c and lx else "—"])
    f9 = P.DILA["fig9"]
    return ["### SLO tightness (DiLaServe §5.3 / Figure 9)\n",
            f"Load {d.get('load', 0):g} ({d['rate']:.1f} req/s, of the capacity at the default SLO of 5x; every k runs "
            "at that rate), SLO = k x isolated latency. Policies that never read SLOs (fixed threshold, "
            "INFaaS or Llumnix dispatch, FCFS or SRPT instances) ran once; their attainment is scored against each "
            "k (their schedule does not depend on it). Remask's router reads SLOs, so it ran once per k.\n",
            md_table(["SLO"] + combos + ["Remask vs INFaaS", "vs Llumnix"], rows),
            f"\nPaper: for moderately tight SLOs (>= 3x) +{f9['tight_slo_pp_vs_infaas']} pp over INFaaS and "
            f"+{f9['tight_slo_pp_vs_llumnix']} pp over Llumnix at accuracy {f9['tight_slo_acc_pct']}%; at very tight "
            "SLOs DiLaServe trades quality for latency to keep attainment high (no values in the summary).\n"]


def ablations(data: dict) -> list[str]:
    d = data.get("cluster_ablations")
    if not d:
        return []
    f10, f13 = P.DILA["fig10"], P.DILA["fig13"]
    out = ["### Threshold-control ablation (DiLaServe Figure 10)\n"]
    for key, title in (("ablation", "candidates 0.9/0.8/0.7"), ("ablation_all_thresholds", "candidates 0.9-0.5")):
        runs = d.get(key)
        if not runs:
            continue
        fx, dy, rm = (runs.get(k) for k in ("fixed-threshold/dwise", "dynamic-no-load-control/dwise", "remask/dwise"))
        info = d.get("ablation_info", {})
        out += [f"**load {info.get('load', '?')} ({_rate(info)}), {title}**\n", policy_table(runs, roles=False)]
        if fx and dy and rm:
            out.append(f"\nDynamic thresholds over fixed: {pp(dy['slo_attainment'], fx['slo_attainment'])} SLO, "
                       f"{pp(dy['accuracy'], fx['accuracy'])} accuracy; load control on top: "
                       f"{pp(rm['slo_attainment'], dy['slo_attainment'])} SLO, "
                       f"{pp(rm['accuracy'], dy['accuracy'])} accuracy.\n")
    out.append(f"Paper ({f10['source']}): dynamic thresholds up to +{f10['dynamic_slo_pp_max']} pp over fixed "
               f"(accuracy at most {f10['dynamic_acc_pct_max']}%), load control a further up to "
               f"+{f10['load_control_slo_pp_max']} pp (accuracy within {f10['load_control_acc_pct_max']}%). Those are "
               "maxima over its load range; one load here.\n")
    runs = d.get("migration")
    if runs:
        nm, any_, rm = (runs.get(k) for k in ("remask-no-migration/dwise", "remask-any-step/dwise", "remask/dwise"))
        tps = "+".join(f"TP-{t}" for t in d["migration_tps"])
        out += ["### Migration ablation (DiLaServe Appendix E / Figure 13)\n",
                f"Load {d.get('migration_info', {}).get('load', '?')} of this cluster's own capacity "
                f"({_rate(d.get('migration_info'))}) on a mixed cluster ({tps}, 16 GPUs), where instances differ and "
                "moving pays; Remask's router with no migration, with migration only at recompute steps (the "
                "default: the KV is rebuilt there anyway), and at any step (a move at a cached step forces a "
                "recompute the gain test does not price).\n", policy_table(runs, roles=False)]
        if nm and any_ and rm:
            out.append("\nRecompute-step migration against none: p99 "
                       f"{pct_change(rm['p99_latency_s'], nm['p99_latency_s'])}, "
                       f"mean {pct_change(rm['mean_latency_s'], nm['mean_latency_s'])}, SLO "
                       f"{pp(rm['slo_attainment'], nm['slo_attainment'])}. Against any-step migration: mean "
                       f"{pct_change(rm['mean_latency_s'], any_['mean_latency_s'])}, SLO "
                       f"{pp(rm['slo_attainment'], any_['slo_attainment'])}. Paper ({f13['source']}): step-level "
                       f"migration cuts tail latency by up to {-f13['step_migration_tail_pct']:.0f}%, migrating "
                       f"only at recompute steps cuts latency by up to {-f13['recompute_only_latency_pct']:.0f}%.\n")
    return out


def lengths(data: dict) -> list[str]:
    d = data.get("cluster_lengths")
    if not d:
        return []
    rows = []
    for v in d["points"].values():
        runs = v["policies"]
        c, i = runs.get(COMBINED), runs.get("infaas/fcfs")
        rows.append([f"{v['output_tokens']} tokens", f"{v['mean_prompt_tokens']:.0f}", f"{v['rate']:.1f}"]
                    + [fmt(runs[k]["slo_attainment"], 3) if k in runs else "—" for k in (
                        "infaas/fcfs", "remask/fcfs", "infaas/dwise", "remask/dwise")]
                    + [pp(c["slo_attainment"], i["slo_attainment"]) if c and i else "—",
                       pp(c["accuracy"], i["accuracy"]) if c and i and c["accuracy"] is not None else "—"])
    f12 = P.DILA["fig12"]
    return ["### Input and output length (DiLaServe Figure 12)\n",
            f"Each point runs at load {d.get('load', '?')} of its own capacity (its requests' steps, sequence lengths "
            "and SLOs at that length), so every point is as loaded as the default lengths are.\n",
            md_table(["output", "mean prompt tokens", "rate", "infaas/fcfs", "remask/fcfs", "infaas/dwise",
                      "remask/dwise", "Remask vs INFaaS SLO", "accuracy"], rows),
            f"\nPaper ({f12['source']}): up to +{f12['input_len_slo_pp_max']} pp over INFaaS across input lengths "
            f"(accuracy within {f12['input_len_acc_pct']}%) and up to +{f12['output_len_slo_pp_max']} pp across "
            f"output lengths (within {f12['output_len_acc_pct']}%).\n"]


def burst(data: dict) -> list[str]:
    d = data.get("cluster_burst")
    if not d:
        return []
    return ["### Cluster burst+Poisson (no paper figure)\n",
            f"DWISE's arrival pattern at cluster level: {d['requests']:,} requests, {d['at_t0']:,} at t = 0 and the "
            f"rest Poisson at {d['rate']:.1f} req/s (load {d.get('load', '?')} of these instances' capacity), on "
            f"{len(d['tp_degrees'])} TP-1 instances, so each instance "
            "holds more requests than its 32 slots and the order inside it matters.\n",
            policy_table(d["policies"])]


def diurnal(data: dict) -> list[str]:
    d = data.get("cluster_diurnal")
    if not d:
        return []
    runs = d["policies"]
    f8 = P.DILA["fig8"]
    c, i, lx = runs.get(COMBINED), runs.get("infaas/fcfs"), runs.get("llumnix/fcfs")
    extra = ""
    if c and i and lx:
        extra = (f"\nRemask against INFaaS: {pp(c['slo_attainment'], i['slo_attainment'])} SLO, mean latency "
                 f"{pct_change(c['mean_latency_s'], i['mean_latency_s'])}; against Llumnix: "
                 f"{pp(c['slo_attainment'], lx['slo_attainment'])}, "
                 f"{pct_change(c['mean_latency_s'], lx['mean_latency_s'])}. "
                 f"Paper ({f8['source']}, with reconfiguration): +{f8['slo_pp_vs_infaas']} / "
                 f"+{f8['slo_pp_vs_llumnix']} pp, latency {f8['latency_pct_vs_infaas']}% / "
                 f"{f8['latency_pct_vs_llumnix']}%, quality score {f8['quality_score_delta']}.\n")
    return ["### Diurnal trace on a static cluster (DiLaServe Figure 8's load shape)\n",
            f"{d['requests']:,} requests over {d['seconds']:g} s, a sinusoidal day (peak-to-mean {d['amplitude']}) "
            f"with bursts, mean {d['mean_rate']:.1f} req/s (load {d.get('load', '?')}), 16 TP-1 instances "
            "(no reconfiguration: that is the next "
            "section). Thresholds and attainment over time: `thresholds_over_time.png`.\n",
            policy_table(runs), extra]


def trace(data: dict, pending: list[str]) -> list[str]:
    out = ["### Reconfiguration over the 2-hour trace (DiLaServe Figures 8 and 11)\n"]
    rep = data.get("cluster_trace")
    if not rep:
        out.append("PENDING: no result from the `dilaserve-trace` scenario (`sim.cluster_trace.run_trace`). "
                   + " ".join(pending) + "\n")
        return out
    rows = []
    for name, s in rep["policies"].items():
        rows.append([name, fmt(s["slo_attainment"], 3), fmt(s.get("accuracy"), 3),
                     f"{s['mean_latency_s']:.2f} / {s['p99_latency_s']:.2f}", fmt(s["mean_threshold"], 3),
                     fmt(s.get("lost")), fmt(s.get("evacuated"))])
    lo, hi = rep["instances_by_load"]["low_load"], rep["instances_by_load"]["peak_load"]

    def mean_tp(m):
        return m["gpus"] / m["instances"] if m.get("instances") else float("nan")

    shift = mean_tp(lo) > mean_tp(hi)
    pol = rep["policies"]
    pl = rep["planner"]
    out += [f"`sim.cluster_trace.run_trace`: {rep['requests']:,} requests, mean {rep['arrival_rate_rps']} req/s "
            f"(windows {rep['low_window_rps']}-{rep['peak_window_rps']}; all-TP-1 capacity "
            f"{rep['capacity_rps_all_tp1']}), {rep['gpus']} GPUs, SLO {rep['slo_factor']}x, time compressed "
            f"{rep['time_compression']}x. Router `{rep.get('router_policy', 'remask')}`; every configuration runs "
            "DWISE instances (the trace runner does not take an instance policy).\n",
            md_table(["configuration", "SLO attainment", "accuracy (kept-one-threshold requests)",
                      "mean / p99 latency (s)", "mean threshold", "lost", "evacuated"], rows),
            f"\nPlanner: {pl['plans']} transitions ({pl['starts']} starts, {pl['stops']} stops). Instances at low load "
            f"{lo} (mean TP {mean_tp(lo):.2f}); at peak {hi} (mean TP {mean_tp(hi):.2f}). DiLaServe Figure 11: "
            f"\"{P.DILA['fig11']['text']}\" -> direction {'reproduced' if shift else 'NOT reproduced'} here. "
            f"Reconfiguration beats the best static mix ({rep.get('best_static')}) on SLO attainment: "
            f"{rep.get('reconfig_beats_best_static')}"
            + (f" ({pp(pol['reconfig']['slo_attainment'], pol[rep['best_static']]['slo_attainment'])}, one seed, "
               f"{rep['requests']:,} requests: no spread is measured for this gap here)"
               if rep.get("best_static") in pol and "reconfig" in pol else "")
            + ". Plot: `tp_configuration_over_time.png`.\n"]
    return out


def cluster_seeds(data: dict) -> list[str]:
    d = data.get("cluster_seeds")
    if not d:
        return []
    rows = [[str(s)] + [f"{d['slo_attainment'][c][k]:.3f} / {d['mean_latency_s'][c][k]:.2f}"
                        for c in d["slo_attainment"]] for k, s in enumerate(d["seeds"])]
    return ["### Seeds (cluster)\n", f"Load {d.get('load', '?')} ({d['rate']:.1f} req/s); each seed draws new "
            "requests and arrival times.\n",
            md_table(["seed"] + [f"{c}: SLO / mean (s)" for c in d["slo_attainment"]], rows)]


# ---- the combined policy -------------------------------------------------------------------------------
def _scenarios(data: dict) -> list[tuple[str, dict]]:
    out = []
    for load, runs in data.get("cluster_rates", {}).items():
        out.append((load_label(data, load), runs))
    for f, runs in data.get("cluster_slo", {}).get("factors", {}).items():
        out.append((f"SLO {float(f):g}x at load {data['cluster_slo'].get('load', 0):g}", runs))
    for v in data.get("cluster_lengths", {}).get("points", {}).values():
        out.append((f"output {v['output_tokens']}, prompt x{v['prompt_scale']}", v["policies"]))
    if data.get("cluster_burst"):
        out.append(("burst+Poisson, 4 instances", data["cluster_burst"]["policies"]))
    if data.get("cluster_diurnal"):
        out.append(("diurnal, static 16 x TP-1", data["cluster_diurnal"]["policies"]))
    return [(n, r) for n, r in out if all(k in r for k in (COMBINED, DILA, DWISE))]


def tolerances(data: dict) -> tuple[float, float]:
    """Noise bands: twice the seed-to-seed standard deviation of the paired difference between the combined
    policy and DiLaServe alone on the same trace (SLO points; mean latency, relative), at least 0.5 pp and 1%."""
    d = data.get("cluster_seeds")
    tol_slo, tol_lat = 0.005, 0.01
    if d and COMBINED in d["slo_attainment"] and DILA in d["slo_attainment"] and len(d["seeds"]) > 1:
        s, lat = d["slo_attainment"], d["mean_latency_s"]
        tol_slo = max(tol_slo, 2 * statistics.stdev(a - b for a, b in zip(s[COMBINED], s[DILA])))
        tol_lat = max(tol_lat, 2 * statistics.stdev(a / b - 1 for a, b in zip(lat[COMBINED], lat[DILA])))
    return tol_slo, tol_lat


WALK = "remask-plan-walk/dwise"  # diagnostic: the router's old migration walk


def _verdict(c: dict, d: dict, w: dict, tol_slo: float, tol_lat: float) -> tuple[bool, str]:
    best_slo = max(d["slo_attainment"], w["slo_attainment"])
    best_lat = min(d["mean_latency_s"], w["mean_latency_s"])
    slo_ok = c["slo_attainment"] >= best_slo - tol_slo
    lat_ok = c["mean_latency_s"] <= best_lat * (1 + tol_lat)
    wins = [k for k, v in (("SLO", c["slo_attainment"] > best_slo + tol_slo),
                           ("mean latency", c["mean_latency_s"] < best_lat * (1 - tol_lat))) if v]
    if slo_ok and lat_ok:
        return True, ("wins on " + " and ".join(wins)) if wins else "ties (within the seed spread)"
    return False, "loses on " + " and ".join(k for k, ok in (("SLO", slo_ok), ("mean latency", lat_ok)) if not ok)


OVERLOADED = 0.5  # below this SLO attainment for every policy, a scenario is too overloaded for a verdict


def verdicts(data: dict) -> list[dict]:
    """Per cluster scenario, whether the combined policy meets the target; ``ok`` None (no verdict) where every
    policy that ran attains less than ``OVERLOADED``: there no policy serves the load, and a tie or a win among
    them claims nothing."""
    tol_slo, tol_lat = tolerances(data)
    out = []
    for name, runs in _scenarios(data):
        c, d, w = runs[COMBINED], runs[DILA], runs[DWISE]
        best = max(s["slo_attainment"] for s in runs.values())
        if best < OVERLOADED:
            out.append({"scenario": name, "combined": c, "dila": d, "dwise": w, "ok": None,
                        "verdict": f"no verdict: every policy below {OVERLOADED:g} (best {best:.3f})"})
            continue
        ok, verdict = _verdict(c, d, w, tol_slo, tol_lat)
        v = {"scenario": name, "combined": c, "dila": d, "dwise": w, "ok": ok, "verdict": verdict}
        if WALK in runs:
            v["walk"] = runs[WALK]
            v["walk_ok"], v["walk_verdict"] = _verdict(runs[WALK], d, w, tol_slo, tol_lat)
        out.append(v)
    return out


def _paired(d: dict, a: str, b: str) -> str | None:
    if a not in d["slo_attainment"] or b not in d["slo_attainment"] or len(d["seeds"]) < 2:
        return None
    s, lat = d["slo_attainment"], d["mean_latency_s"]
    ds = [x - y for x, y in zip(s[a], s[b])]
    dl = [x / y - 1 for x, y in zip(lat[a], lat[b])]
    return (f"SLO {100 * statistics.fmean(ds):+.2f} +- {100 * statistics.stdev(ds):.2f} pp (per seed: "
            f"{', '.join(f'{100 * x:+.1f}' for x in ds)}), mean latency {100 * statistics.fmean(dl):+.2f} +- "
            f"{100 * statistics.stdev(dl):.2f}%")


def combined(data: dict) -> list[str]:
    vs = verdicts(data)
    if not vs:
        return []
    tol_slo, tol_lat = tolerances(data)
    has_walk = any("walk" in v for v in vs)

    def trio(v, key, digits):
        return " / ".join(f"{v[k][key]:.{digits}f}" for k in ("combined", "dila", "dwise"))

    rows = []
    for v in vs:
        row = [v["scenario"], trio(v, "slo_attainment", 3), trio(v, "mean_latency_s", 2), trio(v, "p99_latency_s", 2),
               fmt(v["combined"].get("in_system_per_instance"), 1),
               fmt(v["combined"].get("over_b_rounds_frac"), 2, True), v["verdict"]]
        if has_walk:
            w = v.get("walk")
            row.append(f"{w['slo_attainment']:.3f} / {w['mean_latency_s']:.2f}: {v['walk_verdict']}" if w else "—")
        rows.append(row)
    hdr = ["scenario", "SLO: combined / DiLaServe alone / DWISE alone", "mean latency (s), same order",
           "p99 (s), same order", "in system per instance (combined)", "rounds with more than 32 held (combined)",
           "verdict (combined)"] + (["old plan-order walk: SLO / mean (s): verdict"] if has_walk else [])
    n_ok = sum(v["ok"] is True for v in vs)
    judged = [v for v in vs if v["ok"] is not None]
    idle = [v for v in vs if v["ok"] is None]
    out = ["## Combined policy: DWISE inside instances + DiLaServe thresholds and routing across them\n",
           "Target: at least as good as the better of the two alone on mean latency and SLO attainment in every "
           "cluster scenario. Tolerance: differences within twice the seed-to-seed standard deviation of the "
           "paired difference between the combined policy and DiLaServe alone on the same trace (cluster seeds "
           f"section; at least 0.5 pp and 1%) count as ties: SLO {100 * tol_slo:.1f} pp, mean latency "
           f"{100 * tol_lat:.1f}%. \"Rounds with more than 32 held\" counts the instances' rounds planned while "
           "the instance held more requests than its slots: only then does the order inside an instance choose "
           "who runs.\n",
           md_table(hdr, rows), f"\n**Remask as shipped (`remask/dwise`) meets the target in {n_ok} of {len(judged)} "
           "scenarios with a verdict.**"
           + (f" No verdict in {len(idle)} ({'; '.join(v['scenario'] for v in idle)}): every policy there attains "
              f"less than {OVERLOADED:g}, a load no policy serves, where a tie claims nothing." if idle else "")]
    if has_walk:
        n_walk = sum(v.get("walk_ok", False) for v in vs if "walk" in v)
        out.append(f"With the router's old migration walk in the instance's plan order (`remask-plan-walk/dwise`, "
                   f"a diagnostic variant defined in `sim/report/cluster_runs.py`): {n_walk} of "
                   f"{sum('walk' in v for v in vs)}.")
    d = data.get("cluster_seeds")
    if d:
        for a, label in ((COMBINED, "combined"), (WALK, "old plan-order walk")):
            txt = _paired(d, a, DILA)
            if txt:
                out.append(f"\nPaired over {len(d['seeds'])} seeds at {d['rate']:g} req/s (same requests per seed), "
                           f"{label} minus DiLaServe alone: {txt}.")
    same = [v for v in vs if v["combined"]["slo_attainment"] == v["dila"]["slo_attainment"]
            and v["combined"]["mean_latency_s"] == v["dila"]["mean_latency_s"]]
    expl = ["\nWhy, from these runs:",
            "- The router sets thresholds and places requests; SRPT inside an instance only decides which of its "
            "requests get the B = 32 slots of the next round. Where instances never hold more than 32, SRPT and "
            "FCFS run the same requests in every round, and the router considers a round's requests for "
            "migration in its own order (priority, then arrival: `walk_order` in `cluster/policies.py`), "
            "whatever order the instance hands them back in, so the combined policy and DiLaServe alone decide "
            f"alike: the same SLO attainment and mean latency in {len(same)} of {len(vs)} scenarios"
            + (" (" + "; ".join(v["scenario"] for v in same) + ")." if same else ".")]
    queued = [v for v in vs if v["combined"].get("over_b_rounds_frac", 0) > 0.05]
    if queued:
        expl.append("- Instances held more than 32 requests in over 5% of rounds only in: " + "; ".join(
            f"{v['scenario']} ({100 * v['combined']['over_b_rounds_frac']:.0f}%)" for v in queued) + ". There "
            "SRPT finishes short requests first: " + "; ".join(
            f"{v['scenario']}: mean {v['combined']['mean_latency_s']:.2f} s against "
            f"{v['dila']['mean_latency_s']:.2f} s (DiLaServe alone), p99 {v['combined']['p99_latency_s']:.2f} "
            f"against {v['dila']['p99_latency_s']:.2f} s" for v in queued) + ".")
    order = [v for v in vs if v["ok"] is False
             and (v["dila"]["slo_attainment"] > v["combined"]["slo_attainment"] + tol_slo
                  or v["dila"]["mean_latency_s"] < v["combined"]["mean_latency_s"] * (1 - tol_lat))]
    paused = [v for v in order if v["combined"].get("over_b_rounds_frac", 0) >= 0.01]
    if paused:
        expl.append("- Where DiLaServe alone beats it while instances were often full (" + "; ".join(
            f"{v['scenario']}: {100 * v['combined']['over_b_rounds_frac']:.0f}% of rounds" for v in paused)
            + "), SRPT's pausing can cost attainment too: it serves the longest requests last, and their SLOs are "
            "5x their own isolated latency.")
    order = [v for v in order if v not in paused]
    if order:
        expl.append(
            "- Where DiLaServe alone (the same router, FCFS instances) beats it (" + "; ".join(
                f"{v['scenario']}: SLO {v['combined']['slo_attainment']:.3f} vs {v['dila']['slo_attainment']:.3f}, "
                f"more than 32 held in {100 * v['combined'].get('over_b_rounds_frac', 0):.2f}% of rounds"
                for v in order) + "), SRPT had almost no one to pause and the migration walk does not depend on "
            "the instance order; the few rounds in which an instance held more than 32 are where the two runs "
            "part, and this report does not trace how that carries through later placements.")
    walk = [v for v in vs if "walk" in v]
    if walk:
        expl.append(
            "- The router used to walk a round's requests for migration in the order the instance handed them "
            "back: oldest first under FCFS, shortest remaining first under SRPT; each move changes the loads the "
            "next candidates are judged against, so the first candidates take the free capacity, and moving the "
            "older ones first keeps more deadlines (an older request has used more of its SLO). That old walk, "
            "kept as a diagnostic variant, against the shipped one (SLO attainment, old vs shipped): " + "; ".join(
                f"{v['scenario']}: {v['walk']['slo_attainment']:.3f} vs {v['combined']['slo_attainment']:.3f}"
                for v in walk) + ".")
    router = [v for v in vs if v["ok"] is False and v not in order and v not in paused]
    if router:
        expl.append("- Where DWISE alone (INFaaS dispatch, threshold 0.9) beats it (" + "; ".join(
                    f"{v['scenario']}: mean {v['combined']['mean_latency_s']:.2f} vs "
                    f"{v['dwise']['mean_latency_s']:.2f} s" for v in router) + "), DiLaServe alone is no better "
                    "than the combination there (see the table), so the cost is the router's: its placement and "
                    "migrations (each a control delay, a transfer and half a round's wait at the target) add "
                    "latency that least-outstanding-tokens dispatch without migration does not pay, and its lower "
                    "thresholds have nothing to buy where SLOs are met at 0.9.")
    p99 = [v for v in vs if v["combined"]["p99_latency_s"] > max(v["dila"]["p99_latency_s"],
                                                                  v["dwise"]["p99_latency_s"]) * (1 + tol_lat)]
    if p99:
        expl.append(f"- The tail is SRPT's price: p99 is worse than both alone in {len(p99)} scenario(s) ("
                    + "; ".join(v["scenario"] for v in p99) + ").")
    return out + expl
