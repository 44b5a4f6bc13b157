"""Denoiser deployment: one replica is one model instance running its own round loop.

Bound once per TP degree (``Denoiser_TP1``, ``Denoiser_TP2``, ...). The replica
never waits on the ingress: requests, aborts and thresholds arrive over the
replica's control channel (``app.channel``) and apply at the next round
boundary; progress leaves as one batch per round on the same channel. The
replica registers its channel with the app's Ingress over Ray (again whenever
it has had no ingress for a while, e.g. after an ingress restart).

It takes the validated ``AppConfig``; its engine starts as every rank's does
(``deployments.startup.start_engine``): the KV pool sized from a memory budget
(``kv_pool_args``; the scheduler reserves against exactly that pool). It then
measures its own step-latency profile on its device for about
``engine.profile_seconds``
(``engine.profiling.profile_instance``); the registration carries it as
``info["profile"]``: ``LatencyProfile.to_dict()``, which
``engine.latency_profile.LatencyProfile.from_dict`` loads (``meta``: ``tp``, ``slots``,
``replica``, ``device``, ``measured_at``).
"""

from __future__ import annotations

import logging
import threading
import time

from ray import serve

from app import gc_pauses
from app.config import INGRESS, AppConfig, tp_worker_name

log = logging.getLogger("ray.serve")



@serve.deployment(max_ongoing_requests=64, health_check_period_s=5)
class Denoiser:
    def __init__(self, cfg: AppConfig, tp: int = 1) -> None:
        import ray

        from app.replica import ReplicaServer
        from deployments.startup import start_engine
        from engine.instance import Instance

        self.cfg = cfg
        self.tp = tp
        ctx = serve.get_replica_context()
        self.replica_id, self.app_name = ctx.replica_id.unique_id, ctx.app_name
        self.actor_name = ctx.replica_id.to_full_id_str()  # its Ray actor (namespace "serve")
        self.workers, self.worker_names = [], []
        e = cfg.engine
        if tp > 1:
            engine, mirror = self._start_tensor_parallel()
        else:
            engine, mirror = start_engine(cfg), None
        log.info("KV pool: %s", engine.kv_pool_budget)
        self.instance = Instance(engine, policy=e.policy, slots=e.slots, kv_capacity_tokens=e.kv_capacity_tokens,
                                 mirror=mirror, followers_alive=self._followers_alive if tp > 1 else None)
        self.profile = self._measure_profile() if e.profile_seconds > 0 else None
        describe = self._attach_predictors() if cfg.router.predictors != "off" else None
        self.server = ReplicaServer(self.instance, max_waiting=e.max_waiting, describe=describe,
                                    host=ray.util.get_node_ip_address(),
                                    threshold_wait_s=e.threshold_wait_ms / 1e3,
                                    threshold_wait_frac=e.threshold_wait_frac)
        self.loop, self.channel = self.server.loop, self.server.channel
        self._stopped = threading.Event()
        self.register_s = 2.0
        gc_pauses.settle(f"denoiser {self.actor_name}")  # before the round loop serves: no full walk of the model
        threading.Thread(target=self._register, name="remask-register", daemon=True).start()

    def _measure_profile(self) -> dict | None:
        """This replica's step-latency profile, measured on its own device through its instance (rounds
        of 1 to ``slots`` requests for about ``engine.profile_seconds``), in ``LatencyProfile.to_dict`` form."""
        from pathlib import Path

        from engine.profiling import profile_instance

        try:
            prof = profile_instance(self.instance, f"{Path(self.cfg.engine.model).name}-tp{self.tp}-measured",
                                    budget_s=self.cfg.engine.profile_seconds)
        except Exception:  # a replica that cannot measure itself still serves: the ingress keeps its tables
            log.exception("measuring the latency profile failed; registering without one")
            return None
        prof.meta.update(tp=self.tp, replica=self.replica_id, measured_at=time.time())
        log.info("latency profile measured: %s", {k: v[:3] for k, v in prof.curves.items()})
        return prof.to_dict()

    def _attach_predictors(self):
        """The shipped admission and refinement predictors on the instance (modes auto and shipped); in any
        mode but off, the step rows the router's step predictor reads and the online learners train on."""
        from predictors.bundle import PredictorError, load_predictors
        from predictors.features import state_row

        mode = self.cfg.router.predictors
        if getattr(self.instance.engine, "canvas", None) is not None:  # DiffusionGemma (engine/canvas_serving.py)
            log.info("canvas requests: no work predictors' step rows (their features are a masked block's); the "
                     "router learns steps per canvas per level from the canvases this replica's progress "
                     "publishes, and the instance refines a request's estimate from its first canvas's steps")
            return None
        if mode in ("auto", "shipped"):
            try:
                load_predictors(self.cfg.engine.model).attach(self.instance, lookahead=self.cfg.engine.lookahead_blocks)
            except PredictorError as exc:
                if mode == "shipped":
                    raise
                log.info("no shipped work predictors (%s): the router's estimates rank the requests", exc)
        return state_row

    def _start_tensor_parallel(self):
        """Rank 0 here; ranks 1..tp-1 as actors in this replica's placement group; every rank's engine
        from ``start_engine``."""
        import socket

        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from deployments.startup import start_engine
        from deployments.tp_worker import TPWorker

        addr = ray.util.get_node_ip_address()
        with socket.socket() as sock:
            sock.bind((addr, 0))
            port = sock.getsockname()[1]
        init_method = f"tcp://{addr}:{port}"
        pg = ray.util.get_current_placement_group()
        gpus = {"num_gpus": self.cfg.resources.gpus_per_rank} if self.cfg.resources.gpus_per_rank else {}
        for rank in range(1, self.tp):
            strategy = (PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank)
                        if pg is not None else "DEFAULT")
            # named (namespace "serve", like the replica's own actor) so operators and fault tests find them
            name = tp_worker_name(self.actor_name, rank)
            self.workers.append(TPWorker.options(num_cpus=0.01, scheduling_strategy=strategy, name=name,
                                                 namespace="serve", **gpus)
                                .remote(self.cfg, rank, self.tp, init_method))
            self.worker_names.append(name)
        engine = start_engine(self.cfg, 0, self.tp, init_method)
        ray.get([w.ready.remote() for w in self.workers])

        def mirror(commands, plan):
            refs = [w.step.remote(commands, plan) for w in self.workers]
            return lambda: ray.get(refs)

        return engine, mirror

    def _followers_alive(self) -> bool:
        import ray

        try:
            ray.get([w.ready.remote() for w in self.workers], timeout=10)
            return True
        except Exception:  # an actor died, or does not answer
            return False

    def _register(self) -> None:
        """Tell the app's Ingress where this replica's channel is, every ``register_s``: an ingress
        already connected only notes it; a new one (a restart, a redeploy's successor) connects."""
        handle = None
        info = {"replica": self.replica_id, "tp": self.tp, "actor": self.actor_name,
                "workers": self.worker_names, **self.server.info()}
        if self.profile is not None:
            info["profile"] = self.profile  # LatencyProfile.to_dict(): engine.latency_profile.LatencyProfile.from_dict
        while not self._stopped.is_set() and self.loop.broken is None:
            try:
                handle = handle or serve.get_deployment_handle(INGRESS, self.app_name)
                handle.register.remote(info).result(timeout_s=30)
            except Exception as exc:  # the ingress is starting or restarting: try again
                log.info("registering with the ingress failed (%s); retrying", exc)
            self._stopped.wait(1.0 if not self.channel.connected else self.register_s)

    def check_health(self) -> None:
        """Unhealthy (Serve replaces the replica) when the instance broke, e.g. a TP rank died, or a
        round hangs; the ingress has already resumed, or will on the hang-up, its requests elsewhere."""
        stats = self.loop.stats()
        if self.loop.broken is not None:
            raise RuntimeError(f"instance broken: {self.loop.broken}")
        if not stats["alive"]:
            raise RuntimeError("round loop died")
        if stats["round_running_s"] > self.cfg.engine.round_timeout_s:
            self.server.channel.close()  # the ingress resumes its requests now, not when the actor dies
            raise RuntimeError(f"a round has run for {stats['round_running_s']:.0f} s "
                               f"(engine.round_timeout_s {self.cfg.engine.round_timeout_s:g})")

    def __del__(self) -> None:
        """Serve stops this replica (a redeploy, a scale-down, shutdown): drain first. Each ingress moves
        the requests it can to other instances; the rest may finish here for up to ``drain_s``; whatever
        is left then resumes elsewhere when the channel closes (``resources.drain_s``)."""
        stopped = getattr(self, "_stopped", None)
        if stopped is not None:
            stopped.set()
        server = getattr(self, "server", None)
        if server is not None:
            left = server.drain(self.cfg.resources.drain_s) if server.channel.connected else 0
            if left:
                log.warning("%d requests did not finish within drain_s; they resume elsewhere", left)
            server.close()
