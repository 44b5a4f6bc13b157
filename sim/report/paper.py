"""The papers' own figures, typed in from ``../shared/papers`` (nothing here is computed).

Every entry names where it comes from. DWISE (``dwise.txt``): LLaDA2.1-mini on one GH200, B = 128,
4,096 requests; ``B`` is burst, ``P`` burst+Poisson. DiLaServe (``dilaserve-summary-zh.txt``, a
summary in Chinese): only the differences its text quotes; it gives no absolute SLO attainment,
latency or accuracy values, so tables show "not in the summary" where Remask has a level.
"""

from __future__ import annotations

NOT_IN_SUMMARY = "not in the summary"

# DWISE Table 2, LLaDA2.1-mini columns.
DWISE_T2 = {
    "source": "DWISE Table 2 (LLaDA2.1-mini)",
    "mean_latency_s": {
        "B": {"SGLang": 545.5, "MLFQ": 625.9, "SSJF": 602.7, "LTR": 645.3, "S3": 412.1, "TRAIL": 661.1,
              "DWISE": 76.9},
        "P": {"SGLang": 535.9, "MLFQ": 616.9, "SSJF": 584.6, "LTR": 613.9, "S3": 408.9, "TRAIL": 661.3,
              "DWISE": 48.5},
    },
    "throughput_rps": {
        "B": {"SGLang": 3.90, "MLFQ": 4.13, "SSJF": 3.96, "LTR": 3.95, "S3": 3.86, "TRAIL": 3.74, "DWISE": 8.02},
        "P": {"SGLang": 3.76, "MLFQ": 4.00, "SSJF": 3.91, "LTR": 3.97, "S3": 3.67, "TRAIL": 3.59, "DWISE": 8.21},
    },
}
# DWISE end-to-end text on Figures 6 and 7, LLaDA2.x range.
DWISE_P50_SPEEDUP = {"source": "DWISE Figure 6 (text, LLaDA2.x range)", "B": "6.2-11x", "P": "14-42x"}
DWISE_P99_SPEEDUP = {"source": "DWISE Figure 7 (text, LLaDA2.x range)", "B": "1.9-2.3x", "P": "1.9-2.3x"}

# DWISE Table 3 (LLaDA2.1-mini).
DWISE_T3 = {
    "source": "DWISE Table 3",
    "SGLang": {"rounds": 63926, "prefill_only_rounds_pct": 94.6, "prefill_only_time_pct": 78.2,
               "idle_slots_pct": 96.1, "filled_slots_per_round": 5.0},
    "DWISE": {"rounds": 2819, "prefill_only_rounds_pct": 3.0, "prefill_only_time_pct": 11.2,
              "idle_slots_pct": 11.6, "filled_slots_per_round": 113.2},
}

# DWISE Table 4: mean latency (s) with every policy on DWISE's mixed-phase batch former.
DWISE_T4 = {
    "source": "DWISE Table 4",
    "B": {"FCFS": 251.7, "SSJF": 282.6, "S3": 188.4, "LTR": 271.1, "TRAIL": 198.5, "DWISE": 76.9},
    "P": {"FCFS": 228.0, "SSJF": 256.9, "S3": 165.1, "LTR": 248.3, "TRAIL": 160.7, "DWISE": 48.5},
}

# DWISE Figure 8 (§6.3 text): speed-up over SGLang, burst+Poisson, components enabled one at a time.
DWISE_F8 = {
    "source": "DWISE Figure 8 (§6.3 text)",
    "mixed-phase batching only": 2.35,
    "+ rank by remaining prefill blocks (r=0)": 8.15,
    "+ admission estimate": 10.33,
    "+ first-round refinement (DWISE)": 11.06,
    "oracle ranking": 13.10,
}

# DWISE Figure 9 (§6.3 text): Poisson arrivals, speed-up of DWISE over SGLang.
DWISE_F9 = {
    "source": "DWISE Figure 9 (§6.3 text)",
    "below SGLang's throughput (lambda <= 3.8 req/s)": {"mean": "1.9-4.5x", "p99": "1.6-4.2x"},
    "SGLang overloaded (lambda = 7.5, 15 req/s)": {"mean": "25-31x", "p99": "2.5-11x"},
    "sglang_throughput_rps": 3.8,
}

# DWISE Table 10: three traces (seeds).
DWISE_T10 = {
    "source": "DWISE Table 10",
    "B": {"SGLang": (528.0, 7.8), "DWISE": (74.3, 0.4), "speedup": (7.10, 0.14)},
    "P": {"SGLang": (521.8, 6.8), "DWISE": (48.7, 1.1), "speedup": (10.72, 0.14)},
}

# DWISE Table 14: output budget. Columns: mean output tokens, mean rounds, SGLang and DWISE mean latency (s),
# speed-up (the value in parentheses matches the text's p99 speed-up: 1.74x at 2,048).
DWISE_T14 = {
    "source": "DWISE Table 14",
    "B": {256: (176, 62, 526.2, 73.0, 7.21, 2.12), 512: (295, 100, 607.3, 104.9, 5.79, 1.99),
          1024: (425, 144, 688.7, 145.3, 4.74, 1.78), 2048: (536, 180, 782.1, 175.8, 4.45, 1.74)},
    "P": {256: (177, 62, 568.7, 45.4, 12.54, 2.45), 512: (294, 100, 610.0, 76.6, 7.97, 2.01),
          1024: (426, 145, 664.1, 113.4, 5.86, 1.75), 2048: (537, 181, 764.5, 147.5, 5.18, 1.74)},
}

# DWISE Table 15: TTFT (s).
DWISE_T15 = {"source": "DWISE Table 15",
             "B": {"SGLang": (525.2, 541.1), "DWISE": (67.1, 45.2)},  # (mean, p50)
             "P": {"SGLang": (521.5, 570.5), "DWISE": (40.0, 6.8)}}

# DWISE Figure 1 and Table 5: predictors (Spearman with true rounds; median predicted / actual).
DWISE_PRED = {"source": "DWISE Figure 1, Table 5", "admission_spearman": 0.740, "refined_spearman": 0.868,
              "admission_ratio": 1.03, "raw_refined_ratio": 1.16, "calibrated_ratio": 1.00}
# SDAR-8B (4-token blocks), DWISE Table 2: the paper's only other block size with prefill in rounds.
DWISE_SDAR = {"source": "DWISE Table 2 (SDAR-8B, 4-token blocks)",
              "B": {"SGLang": 9053, "DWISE": 609}, "P": {"SGLang": 8973, "DWISE": 668}}

# DiLaServe (the summary's §6 text; figure numbers as the summary gives them).
DILA = {
    "fig8": {"source": "DiLaServe §5.2 / Figure 8 (real trace, 16 GPUs, LLaDA)",
             "slo_pp_vs_infaas": 21.1, "slo_pp_vs_llumnix": 30.2,
             "latency_pct_vs_infaas": -34.7, "latency_pct_vs_llumnix": -46.0, "quality_score_delta": -0.09,
             "low_load_latency_pct": (-16.6, -30.0), "high_load_latency_pct": (-32.2, -44.0)},
    "fig9": {"source": "DiLaServe §5.3 / Figure 9 (16 TP-1, no reconfiguration)",
             "high_rate_slo_pp_vs_infaas": 55.0, "high_rate_acc_pct_vs_infaas": -0.7,
             "high_rate_slo_pp_vs_llumnix": 56.6, "high_rate_acc_pct_vs_llumnix": -0.9,
             "tight_slo_pp_vs_infaas": 33.9, "tight_slo_pp_vs_llumnix": 42.3, "tight_slo_acc_pct": -0.1},
    "fig10": {"source": "DiLaServe §5.4 / Figure 10 (LLaDA, GSM8K)",
              "dynamic_slo_pp_max": 70.8, "dynamic_acc_pct_max": -1.9,
              "load_control_slo_pp_max": 42.4, "load_control_acc_pct_max": 1.7},
    "fig11": {"source": "DiLaServe §5.4 / Figure 11",
              "text": "low load: a few high-TP instances; higher peak RPS: more low-TP instances"},
    "fig12": {"source": "DiLaServe §5.4 / Figure 12",
              "input_len_slo_pp_max": 81.0, "input_len_acc_pct": -1.0,
              "output_len_slo_pp_max": 82.3, "output_len_acc_pct": -0.8},
    "fig13": {"source": "DiLaServe Appendix E / Figure 13, Table 6",
              "step_migration_tail_pct": -19.0, "recompute_only_latency_pct": -38.0},
    "step_predictor": {"source": "DiLaServe §3.2.3 / Figures 6-7",
                       "oneshot_error_max_pct": 75.0, "progress_error_cut_pct": 34.9,
                       "confidence_error_cut_pct": 15.8},
    "fig4": {"source": "DiLaServe §2.2.2 / Figure 4", "tp2_step_pct": -25.0, "tp4_step_pct": -55.0},
}
