"""Workload monitor and the two-stage ILP planner. Empty until the planner issue lands."""
