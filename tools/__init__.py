"""Remask's tools: the `remask` CLI, fault harness, benchmarks, training and evaluation."""
