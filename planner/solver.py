"""Solver choice for the planner's ILPs: HiGHS by default, Gurobi when installed and licensed.

``solve(problem, solver)`` always passes ``solver=`` explicitly to cvxpy. With ``solver="auto"``
Gurobi is used when ``gurobipy`` imports and a licence environment can be opened; a Gurobi failure
at solve time (no licence, or the size-limited pip licence's cap of 2,000 variables and
constraints) is logged and the same problem is solved again with HiGHS.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from dataclasses import dataclass

import cvxpy as cp

log = logging.getLogger(__name__)

HIGHS_OPTIONS = {"mip_rel_gap": 1e-6, "mip_heuristic_run_feasibility_jump": False}


@dataclass(frozen=True)
class SolveInfo:
    solver: str  # the solver that produced the answer
    status: str
    seconds: float  # wall time, including model building (cvxpy compilation or, for Stage 1, its arrays)
    fallback: str | None = None  # why the preferred solver was not used


@functools.cache
def gurobi_available() -> bool:
    """True when gurobipy imports and a licence environment opens (checked once per process)."""
    try:
        import gurobipy
    except ImportError:
        return False
    try:
        with gurobipy.Env(params={"OutputFlag": 0}):
            return True
    except gurobipy.GurobiError as exc:  # no licence, expired licence, ...
        log.warning("gurobipy is installed but unusable (%s); using HiGHS", exc)
        return False


def resolve(solver: str) -> str:
    name = solver.upper()
    if name == "AUTO":
        return cp.GUROBI if gurobi_available() else cp.HIGHS
    if name not in (cp.HIGHS, cp.GUROBI):
        raise ValueError(f"unknown solver {solver!r}; known: auto, highs, gurobi")
    return name


@functools.cache
def _quiet_highs() -> None:
    """HiGHS prints a banner on stdout (C level) when the first solver object is made: send it to stderr,
    so ``--json`` output stays clean. Once per process."""
    import highspy

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _solve_with(problem: cp.Problem, name: str, time_limit: float | None) -> None:
    if name == cp.HIGHS:
        _quiet_highs()
        limit = {} if time_limit is None else {"time_limit": float(time_limit)}
        problem.solve(solver=cp.HIGHS, **HIGHS_OPTIONS, **limit)
    else:
        problem.solve(solver=cp.GUROBI, MIPGap=1e-6, **({} if time_limit is None else {"TimeLimit": time_limit}))


def _gurobi_errors() -> tuple[type[BaseException], ...]:
    try:
        import gurobipy
    except ImportError:
        return (cp.error.SolverError,)
    return (cp.error.SolverError, gurobipy.GurobiError)


def solve(problem: cp.Problem, solver: str = "auto", time_limit: float | None = None) -> SolveInfo:
    """Solve ``problem`` in place; returns which solver answered, its status and the wall time.
    ``time_limit`` (s): stop the search and keep the best solution found (status ``user_limit``)."""
    name = resolve(solver)
    start = time.perf_counter()
    fallback = None
    try:
        _solve_with(problem, name, time_limit)
    except _gurobi_errors() as exc:
        if name != cp.GUROBI:
            raise
        fallback = f"Gurobi failed ({str(exc).strip().splitlines()[0][:200]}); solved with HiGHS"
        log.warning(fallback)
        name = cp.HIGHS
        _solve_with(problem, name, time_limit)
    return SolveInfo(name, str(problem.status), time.perf_counter() - start, fallback)
