"""The one Ray cluster and Serve instance that the service test modules share (fixture ``ray_serve`` in
tests/conftest.py): started by the first test that needs it, stopped at the end of the session. Each module
deploys its applications on it (``serve.run`` or the declarative API) and deletes them when it ends, so the
next module finds Serve empty; Ray's start-up (seconds on a busy 2-core machine) is paid once."""

from __future__ import annotations

import os
import socket
import time
import warnings


def _free_port() -> int:
    """A port nothing listens on now (two sessions on one machine never meet on one port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PORT = int(os.environ.get("REMASK_TEST_PORT") or _free_port())
BASE = f"http://127.0.0.1:{PORT}"
# the cluster's logical resources: 8 CPUs (replicas, TP ranks and ingresses of the largest module) and
# 2 GPUs (the planner test resizes TP groups on them; no device is used)
NUM_CPUS, NUM_GPUS = 8, 2
# what the replicas read from their environment, set before Ray starts (its workers inherit it; a secret in
# Ray's runtime_env would be written to its logs): tests/test_serve_guard.py's key from an environment variable
REPLICA_ENV = {"REMASK_GUARD_KEY": "sk-remask-guard-main-3f9c1a"}


def start() -> str:
    """Start Ray (a cluster of its own, never one another process on this machine started) and Serve's HTTP
    proxy on ``PORT``: the base URL."""
    import ray
    from ray import serve

    # a busy 2-core machine can take longer than Serve's 5 s to start the HTTP proxy
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    os.environ.update(REPLICA_ENV)
    # one torch thread in every Ray worker, as a Ray cluster started without OMP_NUM_THREADS gives its workers
    # (Ray sets it from the actor's CPUs: a Denoiser's 0.5 is 1), whatever the tests run with (the workers would
    # inherit it). With `make test`'s former OMP_NUM_THREADS=2 each replica's and TP rank's rounds ran two OpenMP
    # threads on a machine whose 2 cores are oversubscribed, and a one-step tiny-bd round that takes milliseconds
    # took about 1 s (threads waiting at each op's barrier for a descheduled partner): replicas took 35-50 s to start
    omp = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        ray.init(address="local", num_cpus=NUM_CPUS, num_gpus=NUM_GPUS, include_dashboard=False, log_to_driver=False)
    finally:  # the raylet, which starts every worker, has its environment now
        if omp is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = omp
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    return BASE


def stop() -> None:
    """Shut Serve and Ray down (nothing when Ray is not running: tests/conftest.py stops it after the session's
    last Ray test, before the session's end)."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        return
    serve.shutdown()
    ray.shutdown()
    for name in REPLICA_ENV:
        os.environ.pop(name, None)


# how often a stopping replica looks whether its requests are done (Serve's default: every 2 s, and at least one
# wait before the first look). A test app sets it shorter for its deployments (``quick_stops``): each module's
# teardown (the Ingress's tier, then the Denoisers') and each scale-down of the planner's transitions otherwise
# spend a wait loop idle; the drain itself is the app's (``Denoiser.__del__``) and unchanged
STOP_LOOK_S = 0.2


def quick_stops(tp_degrees=(1,)) -> list[dict]:
    """The ``deployments`` overrides of an application in a Serve config (``ServeDeploySchema``): its Ingress
    and its Denoisers of ``tp_degrees`` look every ``STOP_LOOK_S`` whether a stopping replica is drained."""
    from app.config import INGRESS, denoiser_name

    return [{"name": name, "graceful_shutdown_wait_loop_s": STOP_LOOK_S}
            for name in (INGRESS, *(denoiser_name(d) for d in tp_degrees))]


def deploy(*apps: dict) -> None:
    """Deploy applications from their Serve config entries (``name``, ``route_prefix``, ``args``...; the
    import path is ``deployments.builder:build_app``), as `serve deploy` of a config file does (they start
    side by side); returns at once."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    _get_global_client().deploy_apps(ServeDeploySchema.model_validate({"applications": [
        {"import_path": "deployments.builder:build_app", **a} for a in apps]}))


def delete_apps(*names: str, limit_s: float = 60.0) -> None:
    """Delete a module's applications, all at once (their replicas drain side by side), and wait until they
    are gone and their resources free (looked at every 0.1 s; Serve's own blocking delete looks every 1 s)."""
    from ray import serve
    from ray.serve.context import _get_global_client

    def listed() -> dict:
        with warnings.catch_warnings():  # Serve's own deprecation of a field the planner's deployments set
            warnings.simplefilter("ignore", DeprecationWarning)
            return serve.status().applications

    _get_global_client().delete_apps(list(names), blocking=False)
    t0 = time.monotonic()
    while any(name in listed() for name in names):
        if time.monotonic() - t0 > limit_s:
            raise TimeoutError(f"applications {names} were not deleted within {limit_s:g} s")
        time.sleep(0.1)


def wait_until(cond, limit_s: float = 120.0, step_s: float = 0.5) -> bool:
    """Poll ``cond()`` until it holds (True) or ``limit_s`` passes (False); HTTP errors count as not yet."""
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        try:
            if cond():
                return True
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(step_s)
    return False
