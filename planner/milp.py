"""A MILP in matrix form, and its solvers: HiGHS through highspy, Gurobi through cvxpy.

Stage 1 builds its model as arrays (``Milp``) instead of cvxpy expressions: the model is small
(tens of rows, a few hundred columns), so cvxpy's canonicalisation cost as much as the solve.
``solve_milp`` hands the arrays straight to HiGHS (``highspy``, the solver cvxpy itself calls) and
goes through cvxpy, with ``solver=`` explicit, only for Gurobi (``solver.resolve`` picks; a Gurobi
failure at solve time falls back to HiGHS and says so, as ``solver.solve`` does).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import cvxpy as cp
import numpy as np
import scipy.sparse as sp

from planner.solver import HIGHS_OPTIONS, SolveInfo, _gurobi_errors, _quiet_highs, _solve_with, resolve

log = logging.getLogger(__name__)

# statuses, spelled as cvxpy spells them
OPTIMAL, USER_LIMIT, INFEASIBLE = cp.OPTIMAL, cp.USER_LIMIT, cp.INFEASIBLE
SOLVED = (cp.OPTIMAL, cp.OPTIMAL_INACCURATE, cp.USER_LIMIT)
# One HiGHS worker: on a model this small a second one only adds synchronisation (measured on 2 shared
# cores: Stage 1 medians halve and the worst cases drop from ~1 s to ~30 ms). HiGHS fixes its thread
# pool at the first solve in a process; when that pool has another size the option is dropped.
HIGHS_THREADS = 1


@dataclass(frozen=True)
class Milp:
    """minimise ``cost @ z`` s.t. ``row_lo <= A @ z <= row_hi``, ``col_lo <= z <= col_hi``, ``z[integer]`` integral."""

    cost: np.ndarray
    A: sp.csr_matrix
    row_lo: np.ndarray
    row_hi: np.ndarray
    col_lo: np.ndarray
    col_hi: np.ndarray
    integer: np.ndarray  # bool per column

    def __post_init__(self) -> None:
        m, n = self.A.shape
        if not (len(self.cost) == len(self.col_lo) == len(self.col_hi) == len(self.integer) == n
                and len(self.row_lo) == len(self.row_hi) == m):
            raise ValueError("Milp: array sizes do not match the constraint matrix")


class Rows:
    """A MILP's constraint rows, built a block at a time: ``add(rows, cols, values, lo, hi)`` takes a block's
    rows numbered from 0 (placed after the rows added before), its entries and its row bounds."""

    def __init__(self) -> None:
        self.n = 0
        self._r: list[np.ndarray] = []
        self._c: list[np.ndarray] = []
        self._v: list[np.ndarray] = []
        self._lo: list[np.ndarray] = []
        self._hi: list[np.ndarray] = []

    def add(self, rows, cols, values, lo, hi) -> None:
        lo = np.asarray(lo, dtype=float)
        self._r.append(np.asarray(rows) + self.n)
        self._c.append(np.asarray(cols))
        self._v.append(np.asarray(values, dtype=float))
        self._lo.append(lo)
        self._hi.append(np.asarray(hi, dtype=float))
        self.n += len(lo)

    def matrix(self, columns: int) -> sp.csr_matrix:
        return sp.csr_matrix((np.concatenate(self._v), (np.concatenate(self._r), np.concatenate(self._c))),
                             shape=(self.n, columns))

    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        return np.concatenate(self._lo), np.concatenate(self._hi)


@dataclass(frozen=True)
class MilpResult:
    z: np.ndarray | None  # None unless the status is in SOLVED
    status: str
    info: SolveInfo


def solve_milp(m: Milp, solver: str = "auto", time_limit: float | None = None,
               rel_gap: float | None = None) -> MilpResult:
    """``rel_gap``: HiGHS's relative MIP gap (default ``HIGHS_OPTIONS``'); the other solvers keep theirs."""
    name = resolve(solver)
    start = time.perf_counter()
    if name == cp.HIGHS:
        z, status = _solve_highs(m, time_limit, rel_gap)
        return MilpResult(z, status, SolveInfo(cp.HIGHS, status, time.perf_counter() - start))
    try:
        z, status = _solve_cvxpy(m, name, time_limit)
        fallback = None
    except _gurobi_errors() as exc:
        fallback = f"Gurobi failed ({str(exc).strip().splitlines()[0][:200]}); solved with HiGHS"
        log.warning(fallback)
        name = cp.HIGHS
        z, status = _solve_highs(m, time_limit, rel_gap)
    return MilpResult(z, status, SolveInfo(name, status, time.perf_counter() - start, fallback))


def _solve_highs(m: Milp, time_limit: float | None, rel_gap: float | None = None) -> tuple[np.ndarray | None, str]:
    import highspy

    _quiet_highs()
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    for k, v in HIGHS_OPTIONS.items():
        h.setOptionValue(k, v)
    if time_limit is not None:
        h.setOptionValue("time_limit", float(time_limit))
    if rel_gap is not None:
        h.setOptionValue("mip_rel_gap", float(rel_gap))
    A = m.A.tocsc()
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = A.shape[1], A.shape[0]
    lp.col_cost_ = np.asarray(m.cost, dtype=float)
    lp.col_lower_, lp.col_upper_ = np.asarray(m.col_lo, dtype=float), np.asarray(m.col_hi, dtype=float)
    lp.row_lower_, lp.row_upper_ = np.asarray(m.row_lo, dtype=float), np.asarray(m.row_hi, dtype=float)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = A.shape[1], A.shape[0]
    lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = A.indptr, A.indices, A.data
    kinds = (highspy.HighsVarType.kContinuous, highspy.HighsVarType.kInteger)
    lp.integrality_ = [kinds[int(i)] for i in m.integer]
    h.passModel(lp)
    S = highspy.HighsModelStatus
    h.setOptionValue("threads", HIGHS_THREADS)
    if h.run() == highspy.HighsStatus.kError and h.getModelStatus() == S.kNotset:
        h.setOptionValue("threads", 0)  # the process's HiGHS thread pool was made with another size
        h.run()
    ms = h.getModelStatus()
    has_solution = h.getInfo().primal_solution_status == 2  # feasible
    if ms == S.kOptimal:
        status = OPTIMAL
    elif ms in (S.kTimeLimit, S.kIterationLimit, S.kSolutionLimit, S.kInterrupt) and has_solution:
        status = USER_LIMIT
    elif ms in (S.kInfeasible, S.kUnboundedOrInfeasible):
        status = INFEASIBLE
    else:
        status = h.modelStatusToString(ms).lower()
    return (np.asarray(h.getSolution().col_value) if status in SOLVED else None), status


def _solve_cvxpy(m: Milp, name: str, time_limit: float | None) -> tuple[np.ndarray | None, str]:
    """The same model through cvxpy (``solver=name``, explicit): Gurobi's path."""
    ints = np.flatnonzero(m.integer)
    conts = np.flatnonzero(~np.asarray(m.integer, dtype=bool))
    zi, zc = cp.Variable(len(ints), integer=True), cp.Variable(len(conts))
    parts = [(ints, zi), (conts, zc)]
    parts = [(idx, v) for idx, v in parts if len(idx)]
    cons = []
    for bound, sense in ((m.row_lo, 1), (m.row_hi, -1)):
        rows = np.flatnonzero(np.isfinite(bound))
        if len(rows):
            lhs = sum(m.A[rows][:, idx] @ v for idx, v in parts)
            cons.append(lhs >= bound[rows] if sense == 1 else lhs <= bound[rows])
    for idx, v in parts:
        lo, hi = m.col_lo[idx], m.col_hi[idx]
        if np.isfinite(lo).any():
            k = np.flatnonzero(np.isfinite(lo))
            cons.append(v[k] >= lo[k])
        if np.isfinite(hi).any():
            k = np.flatnonzero(np.isfinite(hi))
            cons.append(v[k] <= hi[k])
    objective = sum(m.cost[idx] @ v for idx, v in parts)
    problem = cp.Problem(cp.Minimize(objective), cons)
    _solve_with(problem, name, time_limit)
    status = str(problem.status)
    if status not in SOLVED or problem.value is None:
        return None, status
    z = np.zeros(m.A.shape[1])
    for idx, v in parts:
        z[idx] = v.value
    return z, status
