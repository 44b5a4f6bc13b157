"""The instance scheduler: residency, ranking and round plans (DWISE Alg. 1).

Pure Python. Each round, every live request is ranked by the policy's key.
A waiting request becomes resident only if it ranks in the top B, fewer than
k*B requests are resident, and its worst-case KV footprint fits the
reservation budget; a resident request keeps its reservation until it
finishes, so preemption (pausing) never overcommits memory and every
resident request can always finish. The B best-ranked residents run.

KV reservations count what the engine's KV pool really holds when the
config gives its slot size (``kv_slot_tokens``): a request reserves the whole
slots its cache takes, ceil(positions / slot) of them (a cache longer than a
slot takes several slots of the pool, engine/kv_cache.py), against a budget of
exactly the pool's slots. A request that does not fit waits in the queue until
residents finish; one that could never fit is refused at ``add_request``.

r_i, the remaining-work estimate, starts as the admission estimate; the
refinement (after the first denoising round) replaces it, and so does an
external estimate (the cluster router's, ``set_estimate``): whichever came
last holds, and each denoising round decrements it.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from operator import attrgetter

from engine.clock import Clock, WallClock
from engine.scheduler.policies import Policy, make_policy
from engine.scheduler.types import Residency, RoundPlan, RoundResult, SchedRequest, SlotAssignment, StepKind


@dataclass(frozen=True)
class SchedulerConfig:
    slots: int = 128  # B: block slots per round
    resident_factor: int = 8  # k: at most k * B resident requests
    kv_capacity_tokens: int = 1 << 30  # KV pool size, in tokens
    kv_limit: float = 0.9  # reserve at most this fraction of the pool
    slack_blocks: int = 2  # reservation slack per resident request (estimated footprints only)
    block_size: int = 32
    kv_slot_tokens: int = 0  # > 0: the KV pool's slot size; reservations take whole slots

    def __post_init__(self) -> None:
        if self.slots < 1 or self.resident_factor < 1:
            raise ValueError("slots and resident_factor must be at least 1")
        if self.kv_slot_tokens < 0:
            raise ValueError("kv_slot_tokens must be >= 0")
        if not 0 < self.kv_limit <= 1:
            raise ValueError("kv_limit must be in (0, 1]")

    @property
    def kv_budget(self) -> int:
        return int(self.kv_capacity_tokens * self.kv_limit)


_KEY = attrgetter("key")
_GONE = (float("inf"),)


class Scheduler:
    def __init__(self, policy: Policy | str = "dwise", config: SchedulerConfig | None = None,
                 clock: Clock | None = None) -> None:
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.cfg = config or SchedulerConfig()
        self.clock = clock or WallClock()
        self.requests: dict[str, SchedRequest] = {}
        self.resident: dict[str, SchedRequest] = {}
        self._waiting: list[tuple[tuple, int, SchedRequest]] = []  # heap by key
        self._seq = itertools.count()
        self.kv_reserved = 0
        self.round_id = 0
        self.finished: list[SchedRequest] = []
        self._running: set[str] = set()
        self._prefilling: dict[str, SchedRequest] = {}  # residents with prompt blocks left
        self._ranked: list[SchedRequest] = []  # residents, re-sorted in place each round (nearly sorted)
        self._stale = False  # a resident left since the last ranking

    # ---- requests -------------------------------------------------------------------------
    def worst_case_kv(self, req: SchedRequest) -> int:
        """KV tokens ``req`` reserves: its cache's positions when known (else its blocks plus slack), in
        whole pool slots when the config has a slot size."""
        if req.kv_positions is not None:
            tokens = req.kv_positions
        else:
            tokens = (req.prompt_blocks + req.output_blocks + self.cfg.slack_blocks) * self.cfg.block_size
        slot = self.cfg.kv_slot_tokens
        return -(-tokens // slot) * slot if slot else tokens

    def add_request(self, req: SchedRequest) -> None:
        if req.req_id in self.requests:
            raise ValueError(f"duplicate request id {req.req_id!r}")
        req.kv_tokens = self.worst_case_kv(req)
        if req.kv_tokens > self.cfg.kv_budget:
            raise ValueError(f"request {req.req_id!r} needs {req.kv_tokens} KV tokens; "
                             f"the reservation budget is {self.cfg.kv_budget}")
        req.residency = Residency.WAITING
        self.requests[req.req_id] = req
        self._push_waiting(req)

    def _push_waiting(self, req: SchedRequest) -> None:
        req.key = self.policy.key(req)
        heapq.heappush(self._waiting, (req.key, next(self._seq), req))

    def set_estimate(self, req_id: str, remaining_rounds: float) -> bool:
        """An external estimate of ``req_id``'s remaining denoising rounds (the cluster router's): it
        replaces r_i (admission or refined estimate) and re-ranks the request. False if it is gone."""
        req = self.requests.get(req_id)
        if req is None:
            return False
        req.est_rounds = max(float(remaining_rounds), 0.0)
        key = self.policy.key(req)
        if key != req.key:
            if req.residency is Residency.WAITING:
                self._push_waiting(req)  # its old heap entry is stale now: dropped when it surfaces
            else:
                req.key = key  # residents are re-sorted every round
        return True

    def abort(self, req_id: str) -> SchedRequest | None:
        req = self.requests.pop(req_id, None)
        if req is None:
            return None
        if req.req_id in self.resident:
            self._release(req)
        self._running.discard(req_id)
        req.residency = Residency.FINISHED  # lazily dropped from the waiting heap
        return req

    def _release(self, req: SchedRequest) -> None:
        del self.resident[req.req_id]
        self._prefilling.pop(req.req_id, None)
        req.key = _GONE  # sinks to the end of the ranking, popped there
        self._stale = True
        self.kv_reserved -= req.kv_tokens

    @property
    def num_running(self) -> int:
        """Requests of the last round's batch that are still unfinished."""
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self.requests) - len(self.resident)

    def has_work(self) -> bool:
        return bool(self.requests)

    # ---- one round --------------------------------------------------------------------------
    def _admissible(self, req: SchedRequest) -> bool:
        return (len(self.resident) < self.cfg.resident_factor * self.cfg.slots
                and self.kv_reserved + req.kv_tokens <= self.cfg.kv_budget)

    def _admit(self, req: SchedRequest) -> None:
        self.resident[req.req_id] = req
        self.kv_reserved += req.kv_tokens
        req.residency = Residency.PAUSED
        req.admitted_time = self.clock.now()
        self._ranked.append(req)
        if req.remaining_prefill > 0:
            self._prefilling[req.req_id] = req

    def _top_waiting(self) -> SchedRequest | None:
        """The best waiting request; heap entries of requests no longer waiting, or pushed again with a
        new key (``set_estimate``), are dropped on the way."""
        heap = self._waiting
        while heap and (heap[0][2].residency is not Residency.WAITING or heap[0][0] is not heap[0][2].key):
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def _admit_round(self) -> tuple[list[SchedRequest], list[str]]:
        """Admit waiting requests; return all residents, best-ranked first.

        Ranked policies admit a waiting request only if it ranks in the top B
        (Alg. 1); FCFS policies admit in arrival order whenever it fits.
        """
        b = self.cfg.slots
        admitted: list[str] = []
        if self.policy.fcfs_admission:
            while (top := self._top_waiting()) is not None and self._admissible(top):
                heapq.heappop(self._waiting)
                self._admit(top)
                admitted.append(top.req_id)
            # admitted in key (arrival) order, and FCFS keys never change: already ranked
            return list(itertools.islice(self.resident.values(), b)), admitted
        ranked = self._rank_residents()
        top = self._top_waiting()
        if top is None or (len(ranked) >= b and not top.key < ranked[b - 1].key):
            return ranked, admitted  # no waiting request ranks in the top B
        out: list[SchedRequest] = []
        deferred: list[SchedRequest] = []
        i = 0
        while len(out) < b:
            top = self._top_waiting() if len(deferred) < b else None
            res = ranked[i] if i < len(ranked) else None
            if top is not None and (res is None or top.key < res.key):
                heapq.heappop(self._waiting)
                if self._admissible(top):
                    self._admit(top)
                    admitted.append(top.req_id)
                    out.append(top)
                else:
                    deferred.append(top)  # keeps its place in the queue
            elif res is not None:
                out.append(res)
                i += 1
            else:
                break
        for req in deferred:
            heapq.heappush(self._waiting, (req.key, next(self._seq), req))
        out.extend(ranked[i:])  # residents beyond the top B stay ranked, paused
        return out, admitted

    def _rank_residents(self) -> list[SchedRequest]:
        ranked = self._ranked
        ranked.sort(key=_KEY)  # timsort: only the last round's B requests moved
        if self._stale:
            while ranked and ranked[-1].key is _GONE:
                ranked.pop()
            self._stale = False
        return list(ranked)

    def fill_resident(self, target: int) -> int:
        """Admit waiting requests best-first until ``target`` are resident or the
        next does not fit (warm starts and benchmarks); returns how many."""
        n = 0
        while len(self.resident) < target and (top := self._top_waiting()) is not None and self._admissible(top):
            heapq.heappop(self._waiting)
            self._admit(top)
            n += 1
        return n

    def schedule(self) -> RoundPlan:
        ranked, admitted = self._admit_round()
        b = self.cfg.slots
        if not self.policy.mixed and self._prefilling:
            cap = getattr(self.policy, "prefill_per_round", b)
            chosen = sorted(self._prefilling.values(), key=lambda r: r.key)[:cap]
        else:
            chosen = ranked[:b]
        chosen_ids = {r.req_id for r in chosen}
        paused = [rid for rid in self._running if rid not in chosen_ids and rid in self.resident]
        for rid in paused:
            self.resident[rid].residency = Residency.PAUSED
        for r in chosen:
            r.residency = Residency.RUNNING
        self._running = chosen_ids
        self.round_id += 1
        slots = [SlotAssignment(r.req_id, r.next_kind) for r in chosen]
        return RoundPlan(self.round_id, slots, admitted, paused)

    def update(self, plan: RoundPlan, result: RoundResult) -> list[SchedRequest]:
        """Apply a round's outcomes; returns the requests that finished."""
        now = self.clock.now()
        done = []
        planned = {s.req_id for s in plan.slots}
        for out in result.outcomes:
            req = self.requests.get(out.req_id)
            if req is None or out.req_id not in planned:
                continue  # aborted meanwhile, or not part of this round
            req.history.append(out.kind)
            if out.kind is StepKind.PREFILL:
                req.prefill_done += 1
                if req.remaining_prefill <= 0:
                    self._prefilling.pop(req.req_id, None)
            else:
                req.rounds_done += 1
                req.committed_tokens += out.committed
                req.blocks_done += bool(out.block_done)
                if req.first_block_time is None and out.block_done:
                    req.first_block_time = now
                if out.refined_rounds is not None and not req.refined:
                    req.refined = True
                    self.policy.on_refine(req, out.refined_rounds)
            self.policy.on_step(req, out.kind)
            if out.next_kind is not None:
                req.next_kind = out.next_kind
            elif out.kind is StepKind.PREFILL and req.remaining_prefill == 0:
                req.next_kind = StepKind.DENOISE
            if out.finished:
                req.finish_time = now
                if req.first_block_time is None:
                    req.first_block_time = now
                req.residency = Residency.FINISHED
                self._release(req)
                self._running.discard(req.req_id)
                del self.requests[req.req_id]
                self.finished.append(req)
                done.append(req)
            else:
                req.key = self.policy.key(req)
        return done
