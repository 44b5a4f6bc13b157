"""Predictors that learn from served traffic: nothing from offline training is needed.

DiLaServe trains its step predictor online from about 100 requests. ``OnlineStepLearner`` does the
same for the step predictor (``predictors.step``: the 11 ``STEP_FEATURES`` of a request after each
step, its decoding rule's two ``RULE_FEATURES`` columns, the rule and its knob at the row's level, and
its constraint's ``CONSTRAINT_FEATURES`` column, 1 when its text is held to a grammar -> remaining
steps) and ``OnlineAdmissionLearner`` for DWISE's admission predictor
(``predictors.admission``: ``ADMISSION_FEATURES`` -> total rounds). Both

- ``record`` each FINISHED request (its rows and true labels) into a window of the most recent
  ``window`` requests (O(1): one append under a lock held for nothing else);
- refit (``due()`` after every ``refit_every`` finished requests, once ``min_requests`` have
  finished; ``early`` adds refits at those request counts): fit on the window less its most recent
  ``holdout`` share, score the new model and the one in service on that share (MAPE and Spearman),
  and swap the new one in only when its MAPE is lower. The swap is one attribute assignment.
  ``refit()`` does it all at once (the cluster simulator, in virtual time); a ``RefitWorker``
  (``predictors.refit_worker``) has the fit and the scores computed in a worker process, so the
  serving process's GIL is free while the event loop records and predicts;
- predict with the model in service: before the first, a prior that needs no training (``describe``
  says which: "prior", "shipped" for a model given as ``start``, "online").

The step prior: remaining tokens (output_len x (1 - progress)) over the tokens a step of the row's
rule commits at the row's threshold (its level), measured over the finished requests (per rule,
constraint column and level, from the progress between consecutive rows; a constrained request's rule
never measured constrained takes the rule's free rates). A lower level unmasks a superset of what a higher
one does (every rule's knob moves in its faster direction as the level falls), so a level never
measured takes the rate of the nearest measured higher one of the same rule, and before any
measurement of the rule a step commits 1 token (the least a step commits; no table is made up). The
admission prior: one round per output block.

Rules and constraints: the step learner keeps 14-column rows (``features.decoding_rows``: the 11 step
features, the rule's code and its knob at the row's level, and the constraint's column; the same columns
``cluster.thresholds.request_row`` asks with). A refit fits on all 14 when its training rows mix
constrained and free requests; else on the first 13 when they hold more than one rule, and on the first
11 when they hold one (its rule column is constant and its knob a function of the level: the 11 say it
all, and free threshold-only traffic gets exactly the model it got before rules had columns). Any model
answers a 14-column row (``StepPredictor`` reads the columns it was trained on, a prefix), so a shipped
11- or 13-feature model serves until the first refit beats it.

Only numpy and ``predictors.features`` (the feature names, Spearman) here; LightGBM and the model classes
are imported by the fits (and by ``RefitWorker`` at its start).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from predictors.features import (
    ADMISSION_FEATURES,
    CONSTRAINT_FEATURES,
    RULE_CODES,
    RULE_FEATURES,
    STEP_FEATURES,
    decoding_rows,
    rule_code,
)
from predictors.features import spearman as _spearman

log = logging.getLogger(__name__)

STEP_WIDTH = len(STEP_FEATURES)  # threshold, output_len, progress, ...
RULE_COL = STEP_WIDTH  # the rule's code (``features.rule_code``); its knob follows
DECODING_WIDTH = STEP_WIDTH + len(RULE_FEATURES)  # with the rule's columns
CONSTRAINT_COL = DECODING_WIDTH  # 1 when the request's text is held to a grammar (``features.constraint_value``)
ROW_WIDTH = DECODING_WIDTH + len(CONSTRAINT_FEATURES)  # the rows the step learner keeps and predicts
THRESHOLD_CODE = rule_code("threshold")
ADMISSION_WIDTH = len(ADMISSION_FEATURES)  # words, newlines, tokens, threshold
SCORE_ROWS = 10_000  # holdout rows a refit scores the two models on (a uniform sample when there are more)


def mape(pred: np.ndarray, true: np.ndarray) -> float:
    """Mean absolute percentage error (true values are >= 1)."""
    if not len(true):
        return float("nan")
    return float(np.mean(np.abs(np.asarray(pred, float) - true) / np.maximum(true, 1e-9)))


def spearman(a, b) -> float:
    return _spearman(a, b) if len(a) > 1 else float("nan")


def _round(x: float) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else round(float(x), 4)


@dataclass(frozen=True)
class _Served:
    """The predictor in service (swapped as a whole: one attribute assignment)."""

    model: object | None  # a StepPredictor / AdmissionPredictor; None: the prior
    source: str  # prior | shipped | online
    version: int
    trained_on: int  # requests
    cut: int  # requests recorded before it was trained (its holdout and everything after are new to it)


class _Learner:
    """Window, refit schedule, model swap and scoring shared by the two learners."""

    width = 0

    def __init__(self, *, window: int, refit_every: int, holdout: float, min_requests: int, seed: int,
                 early: Sequence[int], recent: int, start) -> None:
        if window < 2 or refit_every < 1 or not 0.0 < holdout < 1.0 or min_requests < 2:
            raise ValueError("need window >= 2, refit_every >= 1, 0 < holdout < 1, min_requests >= 2")
        self.window, self.refit_every, self.holdout = window, refit_every, holdout
        self.min_requests, self.seed, self.recent = min_requests, seed, recent
        self.early = tuple(sorted(int(n) for n in early))
        self._reqs: deque = deque(maxlen=window)  # (seq, rows float32 [k, width], labels float32 [k], prior aux [k])
        self._lock = threading.Lock()  # record and snapshot only, never a fit
        self._refit_lock = threading.Lock()  # one refit at a time
        self.seen = 0  # finished requests recorded
        self._fitted_at = 0  # ``seen`` when the last refit started
        self._served = _Served(start, "prior" if start is None else "shipped", 0, 0, 0)
        self.history: list[dict] = []  # one entry per refit
        self._described: tuple | None = None

    # ---- recording (event loop) ---------------------------------------------------------------
    def _append(self, rows: np.ndarray, labels: np.ndarray, aux: np.ndarray | None = None) -> None:
        with self._lock:
            self._reqs.append((self.seen, rows, labels, aux))
            self.seen += 1

    def due(self) -> bool:
        """``min_requests`` finished, and ``refit_every`` more (or an ``early`` count) since the last refit."""
        n = self.seen
        if n < self.min_requests or n <= self._fitted_at:
            return False
        if n - self._fitted_at >= self.refit_every:
            return True
        return any(self._fitted_at < e <= n for e in self.early)

    # ---- the model in service ---------------------------------------------------------------------
    @property
    def source(self) -> str:
        return self._served.source

    @property
    def version(self) -> int:
        return self._served.version

    @property
    def holdout_mape(self) -> float | None:
        """The MAPE of the model in service on the newest requests at the last refit (None before one)."""
        return self.history[-1]["mape"] if self.history else None

    def _predict(self, rows: np.ndarray, served: _Served | None = None, aux: np.ndarray | None = None) -> np.ndarray:
        served = served or self._served
        if served.model is None:
            return self._prior(rows, aux)
        return self._clip(np.asarray(self._model_predict(served.model, rows), dtype=np.float64))

    # ---- refit ------------------------------------------------------------------------------------
    def refit(self) -> dict | None:
        """Fit on the window less the holdout and swap the new model in if it predicts the holdout better,
        here and now (the cluster simulator's path: its fits take no virtual time). Returns the refit's record
        (also appended to ``history``), or None when too few requests."""
        with self._refit_lock:
            with self._lock:
                reqs = list(self._reqs)
                seen = self.seen
            self._fitted_at = seen
            if len(reqs) < self.min_requests:
                return None
            return self._apply(self._compute(reqs, len(self.history)), seen)

    def _compute(self, reqs: list, n_refits: int) -> dict:
        """The fit and both models' scores on the holdout (no swap): what a refit worker's process runs."""
        n_hold = max(1, round(self.holdout * len(reqs)))
        train, hold = reqs[:-n_hold], reqs[-n_hold:]
        x, y, _ = self._stack(train)
        xh, yh, aux = self._stack(hold)
        if len(yh) > SCORE_ROWS:  # scores of a uniform sample: as good, and predicting costs time
            keep = np.sort(np.random.default_rng(self.seed + n_refits).choice(len(yh), SCORE_ROWS, replace=False))
            xh, yh, aux = xh[keep], yh[keep], None if aux is None else aux[keep]
        t0 = time.perf_counter()
        model = self._fit(x, y, n_refits)
        fit_s = time.perf_counter() - t0
        new_pred = self._predict(xh, _Served(model, "online", 0, 0, 0))
        cur_pred = self._predict(xh, self._served, aux)
        return {"model": model, "new": {"mape": mape(new_pred, yh), "spearman": spearman(new_pred, yh)},
                "in_service": {"mape": mape(cur_pred, yh), "spearman": spearman(cur_pred, yh)},
                "trained_on": len(train), "rows": int(len(y)), "holdout_requests": n_hold,
                "holdout_rows": int(len(yh)), "cut": hold[0][0], "fit_s": fit_s}

    def _apply(self, res: dict, seen: int) -> dict:
        """Swap the computed model in when its holdout MAPE is lower (a nan score of the one in service
        loses); record the refit."""
        cur = self._served
        new, old = res["new"], res["in_service"]
        swap = not new["mape"] >= old["mape"]
        if swap:
            self._served = _Served(res["model"], "online", cur.version + 1, res["trained_on"], res["cut"])
        served = new if swap else old
        rec = {"requests_seen": seen, "trained_on": res["trained_on"], "rows": res["rows"],
               "holdout_requests": res["holdout_requests"], "holdout_rows": res["holdout_rows"],
               "new": _scores(new), "in_service": _scores(old), "swapped": swap, "source": self._served.source,
               "version": self._served.version, "mape": _round(served["mape"]),
               "spearman": _round(served["spearman"]), "fit_s": round(res["fit_s"], 3)}
        self.history.append(rec)
        return rec

    def _stack(self, reqs) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Rows, labels and the prior's per-row data (None when the learner keeps none) of ``reqs``."""
        if not reqs:
            return np.zeros((0, self.width)), np.zeros(0), None
        aux = None if reqs[0][3] is None else np.concatenate([r[3] for r in reqs]).astype(np.float64)
        return (np.concatenate([r[1] for r in reqs]).astype(np.float64),
                np.concatenate([r[2] for r in reqs]).astype(np.float64), aux)

    # ---- report -----------------------------------------------------------------------------------
    def describe(self) -> dict:
        """Source, version, requests the model in service was trained on, and its error on the last
        ``recent`` finished requests it was not trained on (MAPE and Spearman of every row's prediction
        against the truth; cached until the next record or swap)."""
        served = self._served
        with self._lock:
            key = (served.version, self.seen)
            recent = [r for r in list(self._reqs)[-self.recent:] if r[0] >= served.cut]
        if self._described is None or self._described[0] != key:
            x, y, aux = self._stack(recent)
            pred = self._predict(x, served, aux) if len(y) else np.zeros(0)
            self._described = (key, {"mape_recent": _round(mape(pred, y)), "spearman_recent": _round(spearman(pred, y)),
                                     "recent_requests": len(recent)})
        return {"source": served.source, "version": served.version, "trained_on": served.trained_on,
                "requests_seen": self.seen, **self._described[1], "refits": len(self.history)}

    # ---- per learner ------------------------------------------------------------------------------
    def _prior(self, rows: np.ndarray, aux: np.ndarray | None = None) -> np.ndarray:
        raise NotImplementedError

    def _fit(self, x: np.ndarray, y: np.ndarray, n_refits: int):
        raise NotImplementedError

    def _spec(self) -> dict:
        """Constructor arguments of an empty copy (a refit worker's process keeps one per learner)."""
        return {"window": self.window, "refit_every": self.refit_every, "holdout": self.holdout,
                "min_requests": self.min_requests, "seed": self.seed, "early": self.early, "recent": self.recent}

    def _prior_state(self):
        """What the prior predicts from beyond the rows (sent to a refit worker's copy with every job)."""
        return None

    def _set_prior_state(self, state) -> None:
        pass

    def _model_predict(self, model, x: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    @staticmethod
    def _clip(v: np.ndarray) -> np.ndarray:
        return np.maximum(v, 1.0)


def _scores(s: dict) -> dict:
    return {k: _round(v) for k, v in s.items()}


class OnlineStepLearner(_Learner):
    """DiLaServe's step predictor, learnt from finished requests (see the module's docstring).

    ``record(rows, steps_done, total_steps, decoding=rule, constrained=c)``: a finished request's step rows
    (``STEP_FEATURES``, one after each of its steps but the last, given the ``RULE_FEATURES`` columns of
    its ``decoding`` rule, default ``threshold``, and the ``CONSTRAINT_FEATURES`` column ``constrained``,
    default 0; or 13-column rows that carry the rule's, or 14-column rows that carry both;
    ``steps_done[k]``: steps taken when row k was recorded, default 1, 2, ...), labelled
    ``total_steps - steps_done[k]`` remaining steps. ``predict_rows`` is ``StepPredictor.predict_rows``'s
    contract: remaining steps (>= 1) per row, which carries its own threshold (and rule, knob and
    constraint: an 11-column row is a free request's of the threshold rule, a 13-column row a free one's).
    ``start``, a shipped ``StepPredictor``, serves until an online model beats it.
    """

    width = ROW_WIDTH

    def __init__(self, thresholds: Sequence[float] = (), *, window: int = 2000, refit_every: int = 50,
                 holdout: float = 0.2, min_requests: int = 100, start=None, seed: int = 0,
                 early: Sequence[int] = (), recent: int = 200, max_rows: int = 50_000) -> None:
        super().__init__(window=window, refit_every=refit_every, holdout=holdout, min_requests=min_requests,
                         seed=seed, early=early, recent=recent, start=start)
        self.thresholds = tuple(float(t) for t in thresholds)
        self.max_rows = max_rows
        # (rule code, constraint column) -> level -> [tokens committed, steps]; the measured rates per (rule
        # code, constraint column): (levels ascending, tokens/step); the rule names seen, per code
        self._tokens: dict[tuple[float, float], dict[float, list[float]]] = {}
        self._rates: dict[tuple[float, float], tuple[np.ndarray, np.ndarray]] = {}
        self._names: dict[float, str] = {THRESHOLD_CODE: "threshold"}

    def record(self, rows: Sequence[Sequence[float]], steps_done: Sequence[int] | None, total_steps: int,
               last_threshold: float | None = None, decoding: str | None = None,
               constrained: float = 0.0) -> None:
        """A finished request: its rows (after each step but the last) and its total steps.
        ``last_threshold``: the threshold of its steps after the last row (default: the last row's);
        needed for the tokens-per-step measurement of a request with no rows (one step). ``decoding``: its
        decoding rule (default ``threshold``), whose columns 11-column rows get; ``constrained``: its
        constraint's column (``features.constraint_value``; default 0, free), which 11- and 13-column rows
        get (``features.decoding_rows``)."""
        x = decoding_rows(rows, decoding, constrained)
        done = np.arange(1, len(x) + 1) if steps_done is None else np.asarray(steps_done, dtype=np.float64)
        if len(done) != len(x):
            raise ValueError(f"{len(x)} rows but {len(done)} step counts")
        if decoding is not None:
            self._names.setdefault(rule_code(decoding), decoding)
        self._measure(x, done, float(total_steps), last_threshold)
        keep = done < total_steps  # a row after the last step has nothing left to predict
        if keep.any():
            self._append(x[keep].astype(np.float32), (total_steps - done[keep]).astype(np.float32))
        else:
            with self._lock:
                self.seen += 1

    def _measure(self, x: np.ndarray, done: np.ndarray, total: float, last_threshold: float | None) -> None:
        """Tokens committed per step at each level of the request's rule, from the progress between
        consecutive rows (the steps after the last row at ``last_threshold``, default the last row's)."""
        if not len(x):
            return  # no row: neither the output length nor the progress is known
        code = (float(x[-1, RULE_COL]), float(x[-1, CONSTRAINT_COL]))
        prog = np.r_[0.0, x[:, 2]]
        tail_t = x[-1, 0] if last_threshold is None else last_threshold
        ts = np.round(np.r_[x[:, 0], tail_t], 4)
        tokens = np.maximum(np.r_[np.diff(prog) * x[:, 1], (1.0 - prog[-1]) * x[-1, 1]], 0.0)
        steps = np.r_[np.diff(np.r_[0.0, done]), total - done[-1]]
        uniq, inv = np.unique(ts, return_inverse=True)
        tok_sum, step_sum = np.bincount(inv, tokens), np.bincount(inv, np.maximum(steps, 0.0))
        with self._lock:
            acc = self._tokens.setdefault(code, {})
            for t, tok, st in zip(uniq.tolist(), tok_sum.tolist(), step_sum.tolist()):
                if st > 0:
                    a = acc.setdefault(t, [0.0, 0.0])
                    a[0] += tok
                    a[1] += st
            ts_ = sorted(acc)
            rates = [max(acc[t][0] / acc[t][1], 1.0) if acc[t][1] else 1.0 for t in ts_]
            for i in range(len(ts_) - 2, -1, -1):  # a lower level commits at least as much as a higher one
                rates[i] = max(rates[i], rates[i + 1])
            self._rates = {**self._rates, code: (np.asarray(ts_), np.asarray(rates))}  # swapped whole

    def _spec(self) -> dict:
        return {**super()._spec(), "thresholds": self.thresholds, "max_rows": self.max_rows}

    def _prior_state(self):
        return self._rates

    def _set_prior_state(self, state) -> None:
        self._rates = state

    def tokens_per_step(self, threshold: float, decoding: str = "threshold", constrained: float = 0.0) -> float:
        """The prior's rate for rule ``decoding`` at level ``threshold`` (of requests whose constraint column is
        ``constrained``; none measured: the rule's free ones): measured, else the nearest measured higher
        level's, else 1."""
        return float(self._rate_of(np.asarray([float(threshold)]), np.asarray([rule_code(decoding)]),
                                   np.asarray([float(constrained)]))[0])

    def _rate_of(self, t: np.ndarray, codes: np.ndarray, cons: np.ndarray | None = None) -> np.ndarray:
        rates = self._rates
        out = np.ones(len(t))
        cons = np.zeros(len(t)) if cons is None else cons
        keys = np.unique(np.stack([codes, cons], axis=1), axis=0) if len(t) else np.zeros((0, 2))
        for code, c in keys.tolist():
            measured = rates.get((code, c))
            if measured is None or not len(measured[0]):
                measured = rates.get((code, 0.0))  # a constraint not measured with the rule: its free rates
            if measured is None or not len(measured[0]):
                continue
            ts, r = measured
            sel = (codes == code) & (cons == c)
            i = np.searchsorted(ts, t[sel] - 1e-6)  # the first measured level >= t
            out[sel] = np.where(i < len(ts), r[np.minimum(i, len(ts) - 1)], 1.0)
        return out

    def _prior(self, rows: np.ndarray, aux: np.ndarray | None = None) -> np.ndarray:
        left = rows[:, 1] * (1.0 - rows[:, 2])
        return self._clip(left / self._rate_of(rows[:, 0], rows[:, RULE_COL], rows[:, CONSTRAINT_COL]))

    def predict_rows(self, rows) -> np.ndarray:
        rows = decoding_rows(rows)
        if not len(rows):
            return np.zeros(0)
        return self._predict(rows)

    def _fit(self, x, y, n_refits):
        """LightGBM on at most ``max_rows`` rows (a uniform sample: a request's consecutive rows say much the
        same, and a fit's time grows with its rows), on all 14 columns when the rows mix constrained and free
        requests, else on the 13 when they hold more than one rule, else on the 11 step features (one rule's
        code is constant and its knob a function of the level). A model reads the first columns of a row, as
        many as it was trained on."""
        from predictors.step import StepPredictor

        if len(y) and np.all(x[:, CONSTRAINT_COL] == x[0, CONSTRAINT_COL]):
            x = x[:, :DECODING_WIDTH]
            if np.all(x[:, RULE_COL] == x[0, RULE_COL]):
                x = x[:, :STEP_WIDTH]
        if len(y) > self.max_rows:
            keep = np.sort(np.random.default_rng(self.seed + n_refits).choice(len(y), self.max_rows, replace=False))
            x, y = x[keep], y[keep]
        return StepPredictor.fit(x, y, seed=self.seed)

    def _model_predict(self, model, x):
        return model.predict_rows(x)

    def _name(self, key: tuple[float, float]) -> str:
        """The rule of a (rule code, constraint column) key: as recorded, else the listed rule's
        (``features.RULE_CODES``), else the code; ", constrained" when the column is not 0."""
        code, c = key
        if code in self._names:
            name = self._names[code]
        else:
            name = RULE_CODES[int(code)] if code < len(RULE_CODES) and code == int(code) else f"{code:g}"
        return name if c == 0.0 else f"{name}, constrained" if c == 1.0 else f"{name}, constrained {c:g}"

    def describe(self) -> dict:
        """``tokens_per_step``: the threshold rule's measured rates on free requests;
        ``tokens_per_step_by_rule`` (when other rules or constrained requests were measured): every rule's,
        constrained ones apart."""
        d = super().describe()
        rates = self._rates

        def table(key):
            ts, r = rates.get(key, ((), ()))
            return {f"{t:g}": round(float(v), 3) for t, v in zip(ts, r)}

        free = (THRESHOLD_CODE, 0.0)
        d["tokens_per_step"] = table(free)
        if any(key != free for key in rates):
            d["tokens_per_step_by_rule"] = {self._name(k): table(k) for k in sorted(rates)}
        return d


class OnlineAdmissionLearner(_Learner):
    """DWISE's admission predictor, learnt from finished requests: ``ADMISSION_FEATURES`` (words,
    newlines, prompt tokens, threshold) -> total rounds. ``record(row, rounds, blocks=None)`` per
    finished request; ``predict(rows, blocks)`` / ``predict_one(row, blocks)``. The prior: one round
    per block of the output budget (``blocks``, else ``default_blocks``), a lower bound for a
    block-wise decoder; ``describe()['prior']`` says so. ``start``: a shipped ``AdmissionPredictor``.
    """

    width = ADMISSION_WIDTH

    def __init__(self, *, default_blocks: float = 1.0, window: int = 2000, refit_every: int = 50,
                 holdout: float = 0.2, min_requests: int = 100, start=None, seed: int = 0,
                 early: Sequence[int] = (), recent: int = 200) -> None:
        super().__init__(window=window, refit_every=refit_every, holdout=holdout, min_requests=min_requests,
                         seed=seed, early=early, recent=recent, start=start)
        self.default_blocks = float(default_blocks)

    def record(self, row: Sequence[float], rounds: float, blocks: float | None = None) -> None:
        """A finished request: its admission row, its total rounds and its output budget in blocks."""
        x = np.asarray(row, dtype=np.float32).reshape(1, ADMISSION_WIDTH)
        b = np.asarray([self.default_blocks if blocks is None else float(blocks)])
        self._append(x, np.asarray([max(float(rounds), 1.0)], dtype=np.float32), b)

    def _prior(self, rows: np.ndarray, aux: np.ndarray | None = None) -> np.ndarray:
        b = self.default_blocks if aux is None else aux
        return self._clip(np.broadcast_to(np.asarray(b, dtype=np.float64), (len(rows),)).copy())

    def predict(self, rows, blocks: float | Sequence[float] | None = None) -> np.ndarray:
        """Total rounds per row; ``blocks`` (the output budget in blocks) only feeds the prior."""
        rows = np.asarray(rows, dtype=np.float64).reshape(-1, ADMISSION_WIDTH)
        return self._predict(rows, None, None if blocks is None else np.asarray(blocks, dtype=np.float64))

    def predict_one(self, row: Sequence[float], blocks: float | None = None) -> float:
        """One request (the serving path): LightGBM's compiled trees (``FlatForest``), about 6 us."""
        model = self._served.model
        if model is None:
            return max(self.default_blocks if blocks is None else float(blocks), 1.0)
        return max(model.predict_one(list(row)), 1.0)

    def _spec(self) -> dict:
        return {**super()._spec(), "default_blocks": self.default_blocks}

    def _fit(self, x, y, n_refits):
        from predictors.admission import AdmissionPredictor

        return AdmissionPredictor.fit(x, y, seed=self.seed)

    def _model_predict(self, model, x):
        return model.predict(x)

    def describe(self) -> dict:
        d = super().describe()
        if d["source"] == "prior":
            d["prior"] = "one round per output block"
        return d
