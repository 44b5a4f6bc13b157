"""Denoiser deployment: one replica is one model instance running its own round loop.

Bound once per TP degree (``Denoiser_TP1``, ``Denoiser_TP2``, ...). The replica
never waits on the ingress: requests and aborts are control messages applied
at the next round boundary, and progress streams back as events.
"""

from __future__ import annotations

import asyncio
import logging
import time

from ray import serve

from app.config import AppConfig
from engine.loading import load_engine
from engine.loop import Overloaded, RoundLoop
from engine.sequence import SamplingParams

log = logging.getLogger("ray.serve")


@serve.deployment(max_ongoing_requests=1024, health_check_period_s=5)
class Denoiser:
    def __init__(self, config: dict, tp: int = 1) -> None:
        from engine.instance import Instance

        self.cfg = AppConfig(**config)
        self.tp = tp
        self.workers = []
        mirror = None
        kwargs = dict(device=self.cfg.device, dtype=self.cfg.torch_dtype(), cache=self.cfg.cache,
                      max_slots=self.cfg.slots, default_gen_length=self.cfg.default_max_tokens,
                      max_gen_length=self.cfg.max_tokens_limit)
        if tp > 1:
            engine, mirror = self._start_tensor_parallel(kwargs)
        else:
            engine = load_engine(self.cfg.model, **kwargs)
        self.instance = Instance(engine, policy=self.cfg.policy, slots=self.cfg.slots,
                                 kv_capacity_tokens=self.cfg.kv_capacity_tokens, mirror=mirror)
        if self.cfg.predictors:
            self._attach_predictors()
        self.queues: dict[str, asyncio.Queue] = {}
        self.aio = None
        self.loop = RoundLoop(self.instance, self._on_event, max_waiting=self.cfg.max_waiting)

    def _attach_predictors(self) -> None:
        from predictors.bundle import PredictorError, load_predictors

        try:
            load_predictors(self.cfg.model).attach(self.instance)
        except PredictorError as exc:
            log.warning("no work predictors: %s; assuming one round per block", exc)

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
            self.workers.append(TPWorker.options(num_cpus=0.01, scheduling_strategy=strategy, **gpus)
                                .remote(self.cfg.model_dump(), rank, self.tp, addr, port))
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

    def _on_event(self, req_id: str, event: dict) -> None:  # called from the round-loop thread
        q = self.queues.get(req_id)
        if q is not None and self.aio is not None:
            self.aio.call_soon_threadsafe(q.put_nowait, event)

    async def generate(self, request: dict):
        """Stream events of one request: delta*, then done or error."""
        self.aio = asyncio.get_running_loop()
        rid = request["request_id"]
        q: asyncio.Queue = asyncio.Queue()
        self.queues[rid] = q
        params = SamplingParams(max_tokens=request.get("max_tokens"), threshold=request.get("threshold"))
        deadline = time.monotonic() + request["slo_ms"] / 1000 if request.get("slo_ms") else None
        finished = False
        try:
            try:
                self.loop.submit(rid, request["prompt"], params, deadline, sent_at=request.get("sent_at"))
            except Overloaded as exc:
                finished = True
                yield {"type": "error", "status": 429, "message": f"server overloaded: {exc}"}
                return
            while True:
                event = await q.get()
                finished = event["type"] in ("done", "error")
                yield event
                if finished:
                    return
        finally:
            self.queues.pop(rid, None)
            if not finished:  # the client went away: free its slot and KV
                self.loop.abort(rid)

    async def stats(self) -> dict:
        return {"tp": self.tp, **self.loop.stats()}

    def check_health(self) -> None:
        if not self.loop.stats()["alive"]:
            raise RuntimeError("round loop died")

    def __del__(self) -> None:
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop()
