"""One serving instance: the scheduler orders work, the torch engine runs it.

schedule() -> engine.step(plan) -> update(): the scheduler's RoundPlan says
which requests fill this round's slots; each sequence knows its own next step
kind, which the plan carries. The admission estimate of rounds comes from an
``estimator`` (``predictors.bundle.Predictors.admission_estimate`` when trained
predictors are loaded; the fallback assumes one round per output block). The
refined estimate is whatever the engine's refine hook wrote into
``seq.refined_rounds`` after the first denoising round (the second when the engine's lookahead
ran), or an explicit
``refiner(seq)`` (the simulator's calibrated stand-in). An external estimate (the
cluster router's: ``add_request(est_rounds=)``, ``set_estimate``) replaces
whichever estimate the scheduler holds; the most recent one holds (engine/scheduler/).

KV reservations: by default the scheduler reserves against exactly what the
engine's KV pool holds (its slots x positions per slot; a request reserves the
whole slots its cache will take), so a request whose cache does not fit waits
in the queue and no cache is ever allocated past the pool; a pool whose caches
also hold one ring each (DiffusionGemma's) caps the residents at its rings
(``ring_capped``). An explicit
``kv_capacity_tokens`` overrides this with a token budget (reservations
estimated from blocks, as without a pool).

A failed round (the engine raised during ``step``) raises ``RoundFailed``, which names the round's
requests and, of those, the ones whose state the round changed before it failed (``touched``). The
others are as they were before the round (the engine writes nothing to a sequence before its forward
succeeded) and can run again as they are; a touched one must start over from its committed tokens
(``reset``). ``step(only=...)`` runs a round of just the named resident requests (a failed round's
requests, bisected: engine/loop.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection

from engine.clock import Clock, WallClock
from engine.commands import Abort, Add, Command, Lookahead, Resume, Thresholds
from engine.engine import Engine, EngineRound, Output
from engine.scheduler import Scheduler, SchedulerConfig
from engine.scheduler.policies import make_policy
from engine.scheduler.types import RoundPlan, RoundResult, SchedRequest, SlotAssignment, StepCosts, StepOutcome
from engine.sequence import SamplingParams, Sequence


class InstanceBroken(RuntimeError):
    """A round failed in a way the instance cannot recover from (a tensor-parallel rank died or
    its collective broke: the ranks' states may differ). Its requests must continue elsewhere."""


class RoundFailed(RuntimeError):
    """The engine raised during a round (raised ``from`` its exception). ``batch``: the round's requests;
    ``touched``: those among them whose state the round had changed before it failed (every one on a
    tensor-parallel instance, whose follower ranks may have run the round); the others can run again as
    they are."""

    def __init__(self, message: str, batch: list[str], touched: list[str]) -> None:
        super().__init__(message)
        self.batch, self.touched = batch, touched


def blocks_estimate(seq: Sequence) -> float:
    """One round per output block; a sequence that knows better says so (``admission_rounds``: a canvas
    request's canvases times its rule's step cap, engine/canvas_serving.py)."""
    rounds = getattr(seq, "admission_rounds", None)
    return float(rounds()) if rounds is not None else float(len(seq.blocks))


def ring_capped(cfg: SchedulerConfig, rings: int | None, pages: int) -> SchedulerConfig:
    """``cfg`` with at most ``rings`` residents: a pool whose every cache also holds one of a few rings (a
    DiffusionGemma pool's sliding layers, ``DGPool``) must never admit more residents than it has rings. A
    resident reserves at least one of the pool's ``pages`` (its cache's positions, in whole pages), so at most
    min(k x B, pages) are resident at once; when the rings cover that, ``cfg`` as it is, else the most k' x B'
    within the rings, B' = min(B, rings) (a round never holds more requests than are resident). ``rings`` None:
    a pool without rings (the masked families'), ``cfg`` as it is."""
    if rings is None or rings >= min(cfg.resident_factor * cfg.slots, pages):
        return cfg
    b = min(cfg.slots, rings)
    return dataclasses.replace(cfg, slots=b, resident_factor=rings // b)


class Instance:
    def __init__(self, engine: Engine, policy: str = "dwise", slots: int | None = None,
                 kv_capacity_tokens: int | None = None, clock: Clock | None = None,
                 estimator: Callable[[Sequence], float] = blocks_estimate,
                 refiner: Callable[[Sequence], float] | None = None, costs: StepCosts | None = None,
                 mirror: Callable[[list[Command], RoundPlan], Callable[[], None]] | None = None,
                 followers_alive: Callable[[], bool] | None = None, tp_broken_after: int | None = None,
                 **sched_kwargs) -> None:
        """``costs`` weights remaining work by step kind (e.g. ``profile.step_costs(...)``
        for full-sequence models, whose recompute steps cost more than cached ones).

        ``mirror`` (tensor parallelism) receives the control commands applied since
        the last round and this round's plan before the local forward starts, so
        follower ranks run the same round; it returns a function that waits for them.
        ``followers_alive()`` says whether every follower rank still answers (asked after a failed
        round; without it a failed tensor-parallel round breaks the instance: ``InstanceBroken``).
        ``tp_broken_after``: failed tensor-parallel rounds in a row, every rank answering, that break it
        (default: as many as the round loop's bisection of a full batch may take, engine/loop.py, plus 2:
        the bit length of ``slots``, plus 3).
        """
        self.engine = engine
        self.mirror, self.followers_alive = mirror, followers_alive
        self._failed_rounds = 0
        self._commands: list[Command] = []  # applied since the last round: the follower ranks' (``mirror``)
        pool = engine.runner.pool
        self.kv_from_pool = kv_capacity_tokens is None and pool is not None
        if self.kv_from_pool:
            sched_kwargs = {"kv_limit": 1.0, **sched_kwargs, "kv_slot_tokens": pool.capacity}
            kv_capacity_tokens = pool.slots * pool.capacity
        cfg = SchedulerConfig(slots=slots or engine.max_slots, kv_capacity_tokens=kv_capacity_tokens or 1 << 22,
                              block_size=engine.cfg.block_size, **sched_kwargs)
        if self.kv_from_pool:
            cfg = ring_capped(cfg, getattr(pool, "rings", None), pool.slots)
        self.clock = clock or WallClock()
        self.scheduler = Scheduler(make_policy(policy, costs=costs), cfg, self.clock)
        self.tp_broken_after = tp_broken_after or cfg.slots.bit_length() + 3
        self.estimator, self.refiner = estimator, refiner
        self.seqs: dict[str, Sequence] = {}
        self.outputs: dict[str, Output] = {}
        self.last_round: EngineRound | None = None

    def add_request(self, req_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    deadline: float | None = None, true_rounds: int | None = None,
                    committed: list[int] | None = None, est_rounds: float | None = None,
                    resume: Resume | None = None) -> SchedRequest:
        """``committed``: output tokens a previous instance already committed (resume), ``resume``: the state
        of the block after them (engine/commands.py); ``est_rounds``: an
        external estimate of its remaining denoising rounds (the cluster router's), instead of the
        instance's own admission estimate."""
        seq = self.engine.add_request(prompt, params, committed, resume)
        left = len(seq.blocks) - seq.block_idx  # a resumed request starts past its committed blocks
        est = self.estimator(seq) * left / len(seq.blocks) if est_rounds is None else max(float(est_rounds), 0.0)
        req = SchedRequest(
            req_id=req_id, prompt_blocks=seq.prefill_blocks if seq.cache_mode == "exact" else seq.block_idx,
            output_blocks=left, est_rounds=est, arrival=self.clock.now(), deadline=deadline,
            threshold=seq.threshold, predicted_output_tokens=float(seq.max_tokens), true_rounds=true_rounds,
            full_sequence=seq.cache_mode != "exact",
            kv_positions=(0 if seq.cache_mode == "none" else seq.kv_capacity()) if self.kv_from_pool else None,
        )
        try:
            self.scheduler.add_request(req)
        except ValueError:
            self.engine.abort(seq.seq_id)
            raise
        req.next_kind = seq.next_kind()
        self.seqs[req_id] = seq
        # the follower ranks' add: with the seed the engine drew
        self._commands.append(Add(req_id, prompt, seq.params, committed=list(committed or ()), resume=resume))
        return req

    def set_threshold(self, req_id: str, threshold: float) -> None:
        """The threshold of ``req_id``'s next steps (the cluster router's choice), from the next round."""
        seq = self.seqs.get(req_id)
        if seq is None:
            return
        seq.threshold = threshold
        self.scheduler.requests[req_id].threshold = threshold
        self._commands.append(Thresholds({req_id: threshold}))

    def set_estimate(self, req_id: str, remaining_rounds: float) -> bool:
        """An external estimate of ``req_id``'s remaining denoising rounds, from the next round on (the
        scheduler's alone: follower ranks need not hear it)."""
        return self.scheduler.set_estimate(req_id, remaining_rounds)

    def abort(self, req_id: str) -> None:
        self.scheduler.abort(req_id)
        seq = self.seqs.pop(req_id, None)
        if seq is not None:
            self.engine.abort(seq.seq_id)
            self._commands.append(Abort(req_id))

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def execute(self, plan: RoundPlan) -> RoundResult:
        """Run ``plan`` on the engine; outcomes in the scheduler's terms. The engine's round (its
        composition: kind, query tokens, context per step) stays in ``last_round``."""
        result, self.last_round = execute_plan(self.engine, self.seqs, plan, self.refiner)
        return result

    def step(self, only: Collection[str] | None = None) -> tuple[RoundPlan, RoundResult, list[SchedRequest]]:
        """One round: the scheduler's plan, run. ``only``: run just these requests, those of them that are
        resident once the scheduler has admitted what it would (the loop's bisection of a failed round;
        the plan may be empty, and then nothing runs). Raises ``RoundFailed`` when the engine raised
        (``InstanceBroken`` when a tensor-parallel instance cannot go on)."""
        plan = self.scheduler.schedule()
        if only is not None:
            resident = self.scheduler.resident
            plan.slots = [SlotAssignment(r, resident[r].next_kind) for r in dict.fromkeys(only) if r in resident]
            if not plan.slots:
                return plan, RoundResult([]), []
        marks = [(s.req_id, len(self.seqs[s.req_id].history)) for s in plan.slots]  # a step appends to it first
        try:
            result = self.execute(plan) if self.mirror is None else self._execute_mirrored(plan)
        except InstanceBroken:
            raise
        except Exception as exc:
            batch = [r for r, _ in marks]
            touched = batch if self.mirror is not None else [
                r for r, n in marks if (seq := self.seqs.get(r)) is None or len(seq.history) != n]
            raise RoundFailed(f"round failed: {type(exc).__name__}: {exc}", batch, touched) from exc
        done = self.scheduler.update(plan, result)
        for req in done:
            seq = self.seqs.pop(req.req_id)
            self.outputs[req.req_id] = self.engine.output(seq)
            self.engine.sequences.pop(seq.seq_id, None)
        return plan, result, done

    def _execute_mirrored(self, plan: RoundPlan) -> RoundResult:
        try:
            wait, self._commands = self.mirror(self._commands, plan), []
            result = self.execute(plan)
            wait()
            self._failed_rounds = 0
            # rank 0's engine chose the requests whose next round runs the lookahead: the followers'
            # forwards must have the same shapes
            self._commands += [Lookahead(s.req_id, seq.lookahead_blocks) for s in plan.slots
                               if (seq := self.seqs.get(s.req_id)) is not None and seq.rounds == 1
                               and seq.refine_at == 2]
            return result
        except Exception as exc:
            # a lost rank or a broken collective: the ranks can no longer run rounds together. A round
            # that failed with every rank alive (a bad input, say) fails like any other (the loop finds the
            # request at fault), unless the rounds keep failing.
            self._failed_rounds += 1
            alive = self.followers_alive is not None and self.followers_alive()
            if not alive or self._failed_rounds >= self.tp_broken_after:
                why = "a rank is gone" if not alive else f"{self._failed_rounds} rounds failed in a row"
                raise InstanceBroken(f"tensor-parallel round failed ({why}): {type(exc).__name__}: {exc}") \
                    from exc
            raise

    def reset(self, req_id: str, keep: int) -> None:
        """Start ``req_id`` over from its first ``keep`` output tokens (those its receiver already has), as a
        resume would: its KV slots and reservation are released, and it waits to be admitted again with the
        same prompt, sampling (seed included), threshold, deadline and estimate. For a request a failed
        round left half-updated (``RoundFailed.touched``); committed tokens never change, so the first
        ``keep`` are as they were."""
        seq = self.seqs[req_id]
        req = self.scheduler.requests[req_id]
        committed = seq.output_ids()[:keep]
        params = dataclasses.replace(seq.params, threshold=seq.threshold) if seq.params is not None else None
        prompt, deadline, est = list(seq.prompt_ids), req.deadline, req.est_rounds
        self.abort(req_id)
        self.add_request(req_id, prompt, params, deadline=deadline, committed=committed, est_rounds=est)

    def run(self) -> dict[str, Output]:
        while self.has_work():
            self.step()
        return self.outputs


def execute_plan(engine: Engine, seqs_by_id: dict[str, Sequence], plan: RoundPlan,
                 refiner: Callable[[Sequence], float] | None = None) -> tuple[RoundResult, EngineRound]:
    """Run a RoundPlan on the torch engine and report it in the scheduler's terms."""
    seqs = [seqs_by_id[s.req_id] for s in plan.slots]
    for slot, seq in zip(plan.slots, seqs):
        if seq.next_kind() is not slot.kind:
            raise RuntimeError(f"plan asks {slot.req_id} for a {slot.kind} step; it needs {seq.next_kind()}")
    result = engine.step(seqs)
    outcomes = []
    for slot, seq, rep in zip(plan.slots, seqs, result.reports):
        refined = None
        if seq.rounds == seq.refine_at and rep.kind.value != "prefill":  # the refinement point (round 1, or 2
            # when the engine's lookahead ran)
            refined = refiner(seq) if refiner is not None else seq.refined_rounds
        outcomes.append(StepOutcome(slot.req_id, rep.kind, rep.committed, rep.block_done, rep.finished,
                                    None if rep.finished else seq.next_kind(), refined))
    return RoundResult(outcomes, result.latency_s), result


class Follower:
    """A tensor-parallel follower rank: replays rank 0's commands and plans on
    its own shard, so its collectives meet rank 0's in every forward."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.seqs: dict[str, Sequence] = {}

    def step(self, commands: list[Command], plan: RoundPlan) -> int:
        for cmd in commands:
            if isinstance(cmd, Add):
                self.seqs[cmd.req_id] = self.engine.add_request(cmd.prompt_ids, cmd.params, cmd.committed or None,
                                                                cmd.resume)
            elif isinstance(cmd, Thresholds):
                for req_id, threshold in cmd.map.items():
                    if (seq := self.seqs.get(req_id)) is not None:
                        seq.threshold = threshold
            elif isinstance(cmd, Lookahead):
                if (seq := self.seqs.get(cmd.req_id)) is not None:
                    seq.refine_at, seq.lookahead_blocks = 2, cmd.blocks
            elif isinstance(cmd, Abort):
                if (seq := self.seqs.pop(cmd.req_id, None)) is not None:
                    self.engine.abort(seq.seq_id)
            else:
                raise TypeError(f"a follower takes Add, Thresholds, Lookahead or Abort, not {type(cmd).__name__}")
        if not plan.slots:
            return 0
        result, _ = execute_plan(self.engine, self.seqs, plan)
        for out in result.outcomes:
            if out.finished:
                seq = self.seqs.pop(out.req_id)
                self.engine.sequences.pop(seq.seq_id, None)
        return len(result.outcomes)
