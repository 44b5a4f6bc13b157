"""Denoiser deployment: one replica is one model instance running its own round loop.

Bound once per TP degree (``Denoiser_TP1``, ``Denoiser_TP2``, ...). The replica
never waits on the ingress: requests, aborts and thresholds arrive over the
replica's control channel (``app.channel``) and apply at the next round
boundary; progress leaves as one batch per round on the same channel. The
replica registers its channel with the app's Ingress over Ray (again whenever
it has had no ingress for a while, e.g. after an ingress restart).

At start the replica sizes its KV pool from a memory budget (``kv_pool_args``;
the scheduler reserves against exactly that pool) and measures its own
step-latency profile on its device for about ``profile_seconds``
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

from app.config import AppConfig, kv_capacity_override, kv_pool_args
from engine.loading import load_engine

log = logging.getLogger("ray.serve")



@serve.deployment(max_ongoing_requests=64, health_check_period_s=5)
class Denoiser:
    def __init__(self, config: dict, tp: int = 1) -> None:
        import ray

        from app.replica import ReplicaServer
        from engine.instance import Instance

        self.cfg = AppConfig(**config)
        self.tp = tp
        ctx = serve.get_replica_context()
        self.replica_id, self.app_name = ctx.replica_id.unique_id, ctx.app_name
        self.actor_name = ctx.replica_id.to_full_id_str()  # its Ray actor (namespace "serve")
        self.workers, self.worker_names = [], []
        mirror = None
        kwargs = dict(device=self.cfg.device, dtype=self.cfg.torch_dtype(), cache=self.cfg.cache,
                      max_slots=self.cfg.slots, default_gen_length=self.cfg.default_max_tokens,
                      max_gen_length=self.cfg.max_tokens_limit, kv_slot_tokens=self.cfg.kv_slot_tokens,
                      cuda_graphs=None if self.cfg.cuda_graphs else False,  # None: where they apply
                      **kv_pool_args(self.cfg))
        if tp > 1:
            engine, mirror = self._start_tensor_parallel(kwargs)
        else:
            engine = load_engine(self.cfg.model, **kwargs)
        log.info("KV pool: %s", engine.kv_pool_budget)
        self.instance = Instance(engine, policy=self.cfg.policy, slots=self.cfg.slots,
                                 kv_capacity_tokens=kv_capacity_override(self.cfg), mirror=mirror,
                                 followers_alive=self._followers_alive if tp > 1 else None)
        self.profile = self._measure_profile() if self.cfg.profile_seconds > 0 else None
        describe = self._attach_predictors() if self.cfg.predictors != "off" else None
        self.server = ReplicaServer(self.instance, max_waiting=self.cfg.max_waiting, describe=describe,
                                    host=ray.util.get_node_ip_address(),
                                    threshold_wait_s=self.cfg.threshold_wait_ms / 1e3,
                                    threshold_wait_frac=self.cfg.threshold_wait_frac)
        self.loop, self.channel = self.server.loop, self.server.channel
        self._stopped = threading.Event()
        self.register_s = 2.0
        threading.Thread(target=self._register, name="remask-register", daemon=True).start()

    def _measure_profile(self) -> dict | None:
        """This replica's step-latency profile, measured on its own device through its instance (rounds
        of 1 to ``slots`` requests for about ``profile_seconds``), in ``LatencyProfile.to_dict`` form."""
        from pathlib import Path

        from engine.profiling import profile_instance

        try:
            prof = profile_instance(self.instance, f"{Path(self.cfg.model).name}-tp{self.tp}-measured",
                                    budget_s=self.cfg.profile_seconds)
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

        if self.cfg.predictors in ("auto", "shipped"):
            try:
                load_predictors(self.cfg.model).attach(self.instance, lookahead=self.cfg.lookahead_blocks)
            except PredictorError as exc:
                if self.cfg.predictors == "shipped":
                    raise
                log.info("no shipped work predictors (%s): the router's estimates rank the requests", exc)
        return state_row

    def _start_tensor_parallel(self, kwargs: dict):
        """Rank 0 here; ranks 1..tp-1 as actors in this replica's placement group."""
        import datetime
        import socket

        import ray
        import torch.distributed as dist
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from deployments.tp_worker import TPWorker
        from engine.engine import Engine
        from engine.loading import resolve_model
        from engine.models.loader import load_model
        from engine.models.tensor_parallel import all_reduce_sum, shard_model
        from engine.tokenizer import load_tokenizer

        addr = ray.util.get_node_ip_address()
        with socket.socket() as sock:
            sock.bind((addr, 0))
            port = sock.getsockname()[1]
        pg = ray.util.get_current_placement_group()
        gpus = {"num_gpus": self.cfg.gpus_per_rank} if self.cfg.gpus_per_rank else {}
        for rank in range(1, self.tp):
            strategy = (PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank)
                        if pg is not None else "DEFAULT")
            # named (namespace "serve", like the replica's own actor) so operators and fault tests find them
            name = f"{serve.get_replica_context().replica_id.to_full_id_str()}:rank{rank}"
            self.workers.append(TPWorker.options(num_cpus=0.01, scheduling_strategy=strategy, name=name,
                                                 namespace="serve", **gpus)
                                .remote(self.cfg.model_dump(), rank, self.tp, addr, port))
            self.worker_names.append(name)
        backend = "nccl" if self.cfg.device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=0, world_size=self.tp,
                                timeout=datetime.timedelta(seconds=120))
        path = resolve_model(self.cfg.model)
        model = shard_model(load_model(path, dtype=kwargs.pop("dtype")), 0, self.tp, all_reduce_sum())
        engine = Engine(model.to(self.cfg.device), load_tokenizer(path), **kwargs)
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
                handle = handle or serve.get_deployment_handle("Ingress", self.app_name)
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
        if stats["round_running_s"] > self.cfg.round_timeout_s:
            self.server.channel.close()  # the ingress resumes its requests now, not when the actor dies
            raise RuntimeError(f"a round has run for {stats['round_running_s']:.0f} s "
                               f"(round_timeout_s {self.cfg.round_timeout_s:g})")

    def __del__(self) -> None:
        """Serve stops this replica (a redeploy, a scale-down, shutdown): drain first. Each ingress moves
        the requests it can to other instances; the rest may finish here for up to ``drain_s``; whatever
        is left then resumes elsewhere when the channel closes."""
        stopped = getattr(self, "_stopped", None)
        if stopped is not None:
            stopped.set()
        server = getattr(self, "server", None)
        if server is not None:
            left = server.drain(self.cfg.drain_s) if server.channel.connected else 0
            if left:
                log.warning("%d requests did not finish within drain_s; they resume elsewhere", left)
            server.close()
