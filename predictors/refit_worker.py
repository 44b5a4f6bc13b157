"""The refit worker: the online learners' fits and scores in a process of their own.

``RefitWorker`` (below) keeps no fit on the serving process's GIL: it sends each due learner's new requests
to one long-lived worker process (``_worker_main``), which fits and scores as ``_Learner.refit`` would and
answers with the scores and, when the new model is better, the model as plain data (``_portable``,
``_rebuild``); the learner swaps it in by the same rule (``_Learner._apply``, predictors/online.py).
"""

from __future__ import annotations

import logging
import marshal
import os
import socket
import subprocess
import sys
import threading
import time
import traceback
import types

from predictors.online import _Learner, _Served

log = logging.getLogger(__name__)


class RefitError(RuntimeError):
    """A refit failed in the worker process (its traceback is the message), or the process died."""


def _portable(model) -> tuple:
    """A fitted model as plain data for the pipe: LightGBM's model text, and for the admission predictor
    its compiled forest's code too (compiling it where it is received would hold that process's GIL for
    about 15 ms)."""
    from predictors.admission import AdmissionPredictor
    from predictors.step import StepPredictor

    if isinstance(model, StepPredictor):
        return ("step", model.booster.model_to_string(), model.interval)
    if isinstance(model, AdmissionPredictor):
        return ("admission", model.booster.model_to_string(), marshal.dumps(model.flat._fn.__code__),
                model.flat.n_features)
    raise TypeError(f"no portable form for {type(model).__name__}")


def _rebuild(portable: tuple):
    """The model of ``_portable``'s answer. LightGBM parses the text with the GIL released (ctypes); the
    admission predictor gets its forest from the received code, so nothing is compiled here."""
    import lightgbm as lgb

    from predictors.admission import AdmissionPredictor, FlatForest
    from predictors.step import StepPredictor

    kind, text = portable[0], portable[1]
    booster = lgb.Booster(model_str=text)
    if kind == "step":
        return StepPredictor(booster, portable[2])
    if kind == "admission":
        flat = FlatForest.__new__(FlatForest)  # FlatForest's own fields, as its constructor sets them
        flat._fn = types.FunctionType(marshal.loads(portable[2]), {"__builtins__": {}}, "forest")
        flat.n_features = portable[3]
        model = AdmissionPredictor.__new__(AdmissionPredictor)
        model.booster, model.flat = booster, flat
        return model
    raise ValueError(f"unknown model kind {kind!r}")


class RefitWorker:
    """Refits its learners in a separate process, so that no fit holds this process's GIL.

    A daemon thread here waits for ``notify()`` (the live service calls it after recording a finished
    request: it only sets an event), and for each learner that is ``due()`` sends a job to one
    long-lived worker process: the requests recorded since its previous job (the process keeps a copy
    of each learner's window: numpy arrays, a few hundred kB per refit), the prior's state, and the
    model in service when the process does not hold it yet. The process fits, scores the new model and
    the one in service on the holdout, and answers with the scores and, when the new model is better,
    the model (``_portable``). This thread then swaps it in as ``refit`` would (``_apply``: the same
    rule, decided on the same scores on both sides), so the only work here is copying rows, the
    pickling of a job and the parse of a model's text (in LightGBM, without the GIL); ``history``
    records each refit's ``parent_cpu_s`` and when it ran (``started``, ``ended``: wall clock).

    The process (``python -c``, under the idle scheduling policy, one LightGBM thread) exits when this
    one does: its pipe closes (and it watches its parent's pid while it fits); ``stop()`` ends it at
    once. A refit that fails in the process is logged with its traceback and counted in ``errors``; the
    learner keeps the model it had. A process that dies, or leaves a job unanswered for ``timeout_s``,
    is ended and started afresh at the next job (``restarts``).
    """

    def __init__(self, *learners: _Learner, name: str = "remask-refit", timeout_s: float = 600.0) -> None:
        # the model classes, imported now rather than at the first swap (their imports hold the GIL for seconds)
        import lightgbm  # noqa: F401

        import predictors.admission  # noqa: F401
        import predictors.step  # noqa: F401

        self.learners = learners
        self.timeout_s = timeout_s  # a job unanswered for this long: the process is ended (and started afresh)
        self._wake = threading.Event()
        self._stopped = False
        self.refits = 0
        self.errors = 0
        self.restarts = -1  # the first start is not a restart
        self._proc: subprocess.Popen | None = None
        self._conn = None
        self._start_process()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- the process ------------------------------------------------------------------------------
    def _start_process(self) -> None:
        from multiprocessing.connection import Connection

        ours, theirs = socket.socketpair()
        paths = [p or os.getcwd() for p in sys.path]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-c", "import sys; from predictors.refit_worker import _worker_main; "
               "_worker_main(int(sys.argv[1]), int(sys.argv[2]))", str(theirs.fileno()), str(os.getpid())]
        try:
            self._proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        self._conn = Connection(ours.detach())
        self._sent = [-1] * len(self.learners)  # per learner: the last request (seq) the process holds
        self._held = [None] * len(self.learners)  # per learner: the version of the model it holds in service
        self.restarts += 1

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def _kill(self) -> None:
        proc, conn = self._proc, self._conn
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(2.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if conn is not None:
            conn.close()

    # ---- the thread -------------------------------------------------------------------------------
    def notify(self) -> None:
        self._wake.set()

    def stop(self, timeout: float | None = 5.0) -> None:
        self._stopped = True
        self._wake.set()
        self._kill()  # a fit under way ends with the process: its answer would be dropped anyway
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._proc is not None and self._proc.poll() is None

    def _run(self) -> None:
        while not self._stopped:
            self._wake.wait()
            self._wake.clear()
            for i, learner in enumerate(self.learners):
                while not self._stopped and learner.due():
                    try:
                        if self._refit(i, learner) is not None:
                            self.refits += 1
                    except Exception:  # noqa: BLE001 - a bad fit must not end the thread
                        if self._stopped:
                            return
                        self.errors += 1
                        log.exception("online refit of %s failed", type(learner).__name__)
                        break

    def _refit(self, i: int, learner: _Learner) -> dict | None:
        cpu0, started = time.thread_time(), time.time()
        if self._proc.poll() is not None or self._conn.closed:
            log.warning("the refit worker process exited (%s): starting another", self._proc.returncode)
            self._kill()
            self._start_process()
        with learner._refit_lock:
            with learner._lock:
                seen = learner.seen
                n = len(learner._reqs)
                new = []
                for r in reversed(learner._reqs):  # the requests the process has not seen (newest first)
                    if r[0] <= self._sent[i]:
                        break
                    new.append(r)
            learner._fitted_at = seen
            if n < learner.min_requests:
                return None
            served = learner._served
            job = {"new": new[::-1], "seen": seen, "refits": len(learner.history),
                   "prior": learner._prior_state(), "version": served.version}
            if self._held[i] != served.version:
                job["served"] = (served.source, served.trained_on, served.cut,
                                 None if served.model is None else _portable(served.model))
            try:
                self._conn.send((i, type(learner), learner._spec(), job))
                if new:
                    self._sent[i] = new[0][0]
                cpu = time.thread_time() - cpu0
                if not self._conn.poll(self.timeout_s):  # waits without the GIL
                    self._kill()
                    raise RefitError(f"no answer from the refit worker process within {self.timeout_s:g} s")
                status, res = self._conn.recv()
            except (OSError, EOFError) as exc:
                if self._stopped:
                    raise
                self._kill()
                raise RefitError(f"the refit worker process died: {exc!r}") from exc
            cpu0 = time.thread_time()
            if status != "ok":
                self._sent[i], self._held[i] = -1, None  # it dropped its copy: the window and model again next time
                raise RefitError(res)
            self._held[i] = res.pop("version")
            res["model"] = None if res["model"] is None else _rebuild(res["model"])
            rec = learner._apply(res, seen)
            rec["parent_cpu_s"] = round(cpu + time.thread_time() - cpu0, 4)
            rec["started"], rec["ended"] = round(started, 3), round(time.time(), 3)  # wall clock: when it ran
            return rec


# The worker's CPU scheduling: "idle" (the default) or "normal", from this environment variable. A test suite
# that keeps every core busy sets "normal": an idle-policy worker there waits for a free core for as long as the
# suite runs (a one-second fit took 10-25 s in make test's runs).
SCHED_ENV = "REMASK_REFIT_SCHED"


def apply_cpu_policy() -> None:
    """This process's CPU policy, as ``SCHED_ENV`` says. Serving comes first by default: the idle policy yields
    the CPU to any other task that wakes, at once."""
    if os.environ.get(SCHED_ENV, "idle") == "normal":
        return
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux: the lowest share a nice value gives
        try:
            os.nice(19)
        except OSError:
            pass


def _worker_main(fd: int, parent: int) -> None:
    """The refit worker process: answers each job with ``_compute`` on its copy of the learner's window."""
    from multiprocessing.connection import Connection

    apply_cpu_policy()

    def watch() -> None:  # the pipe's EOF ends the loop below, but not a fit under way
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()
    # what the fits and scores import (LightGBM, the model classes), now: the parent starts this process with
    # its service, so these seconds of loading pass before it serves rather than during its first refit
    import lightgbm  # noqa: F401

    import predictors.admission  # noqa: F401
    import predictors.features  # noqa: F401
    import predictors.step  # noqa: F401

    conn = Connection(fd)
    copies: dict[int, _Learner] = {}
    while True:
        try:
            i, cls, spec, job = conn.recv()
        except (EOFError, OSError):
            return
        try:
            learner = copies.get(i)
            if learner is None or type(learner) is not cls:
                learner = copies[i] = cls(**spec)
            learner._reqs.extend(job["new"])
            learner.seen = job["seen"]
            learner._set_prior_state(job["prior"])
            if "served" in job:
                source, trained_on, cut, portable = job["served"]
                model = None if portable is None else _rebuild(portable)
                learner._served = _Served(model, source, job["version"], trained_on, cut)
            elif learner._served.version != job["version"]:
                raise RefitError(f"holds version {learner._served.version}, the learner serves {job['version']}")
            res = learner._compute(list(learner._reqs), job["refits"])
            rec = learner._apply(dict(res), job["seen"])  # the same swap as the learner's, on the same scores
            learner.history.clear()
            res["model"] = _portable(res["model"]) if rec["swapped"] else None
            res["version"] = learner._served.version
            conn.send(("ok", res))
        except Exception:  # noqa: BLE001 - reported to the learner's process, which logs it
            copies.pop(i, None)
            try:
                conn.send(("error", traceback.format_exc()))
            except OSError:
                return
