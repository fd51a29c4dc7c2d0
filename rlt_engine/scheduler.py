"""The scheduler: the only writer of request state (SPEC §3, §6).

Each call of `schedule(worker)` builds that worker's next plan at loop boundaries:

    1. running decode rows first (never starved by arrivals): the next loop of every looping
       position, and [finalize →] CODA → PRELUDE → loop 1 for every position that exited
       (refill: at once; no_refill: only when the worker's whole cohort has exited)
    2. prompt chunks of admitted requests, within max_num_batched_tokens
    3. admission of waiting requests (FCFS) while slots and KV allow

`update(worker, result)` applies a StepResult: tokens, signals, exits, finishes. Rows whose
key or generation is not the request's current one are dropped.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from protocol.messages import AppliedOps, SamplingParams, Signal, Stage, StepResult
from rlt_engine.exit_policy import ExitPolicy
from rlt_engine.kv_manager import KVManager
from rlt_engine.plan_builder import PlanBuilder, SlotOps
from rlt_engine.request import Phase, Request, RequestStatus
from rlt_engine.rng import RngRegistry
from rlt_engine.swap_book import SwapBook

log = logging.getLogger("rlt.scheduler")


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduling knobs of EngineConfig, plus the model facts the scheduler needs."""

    max_depth: int  # D
    kv_layout: str
    refill: bool
    max_num_seqs: int
    max_num_batched_tokens: int
    prefill_chunk_size: int
    eos_token_ids: frozenset[int]
    coda_has_kv: bool  # Huginn: coda blocks attend, so replayed positions re-run them for K/V
    on_demand_kv: bool = False  # admit with prompt + one block, grow as positions advance
    priority: bool = False  # scheduling_policy="priority": lower priority number first
    max_bypasses: int = 8
    swap: bool = False  # preemption="swap": victims' slots go to host memory instead of being recomputed
    # Most loops one plan runs for a row whose exit depth is known before it starts (no signal:
    # fixed, trace). 1 = one loop per plan; the row leaves the runner's pass when its count ends.
    loops_per_plan: int = 1


@dataclass
class SchedulerStats:
    """Counters for tests, benchmarks and health."""

    num_stale_rows: int = 0
    num_steps: int = 0
    num_replays: int = 0
    num_preemptions: int = 0


class Scheduler:
    """Owns every Request; plans steps per worker and applies their results."""

    def __init__(
        self, config: SchedulerConfig, policy: ExitPolicy, kv_managers: list[KVManager], rng: RngRegistry
    ) -> None:
        self.config = config
        self.policy = policy
        self.kv = kv_managers
        self.rng = rng
        self.stats = SchedulerStats()
        self.waiting: deque[Request] = deque()
        self.running: list[list[Request]] = [[] for _ in kv_managers]
        self.alive = [True] * len(kv_managers)
        self.responsive = [True] * len(kv_managers)  # heard from lately: new requests may go there
        self._live: dict[str, Request] = {}
        self._by_key: dict[int, Request] = {}
        self._to_admit: list[list[Request]] = [[] for _ in kv_managers]
        self._to_release: list[list[tuple[int, int]]] = [[] for _ in kv_managers]
        # Slots whose release was sent but not yet completed: a plan applies admits before
        # releases, so a released slot is only reusable from the step after its release.
        self._releases_in_flight: list[dict[int, int]] = [{} for _ in kv_managers]
        self.swap = SwapBook(len(kv_managers))
        # A worker whose running requests could not grow last step admits nothing new, so
        # that freed blocks go to the work already running (no admit/preempt ping-pong).
        self._short_of_blocks = [False] * len(kv_managers)
        self._in_flight: list[SlotOps | None] = [None] * len(kv_managers)  # slot ops of the plan in flight
        self._next_key = 1
        self._next_generation = 1
        self._next_step = 1
        self._arrivals = 0

    # ------------------------------------------------------------------ requests

    def is_live(self, request_id: str) -> bool:
        return request_id in self._live

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        """Queue a validated request; its seed is registered (drawn if not given)."""
        key = self._next_key
        self._next_key += 1
        seed = self.rng.register(key, params.seed)
        limits = self.policy.limits(params, self.config.max_depth)
        request = Request(request_id, key, list(prompt_token_ids), params, limits, seed, self._arrivals)
        self._arrivals += 1
        self._live[request_id] = request
        self._by_key[key] = request
        self.waiting.append(request)
        return request

    def abort(self, request_id: str) -> Request | None:
        """End a live request with finish reason `abort`; None if it is not live."""
        request = self._live.get(request_id)
        if request is None:
            return None
        if request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        self.finish(request, "abort")
        return request

    def finish(self, request: Request, reason: str, slot_open: bool = True) -> None:
        """End a request's life: KV back after its last step, slot released in the next plan, seed dropped.

        `slot_open` False: the worker never opened the request's slot (a failed plan's admit)."""
        if request.status == RequestStatus.RUNNING:
            self.running[request.worker].remove(request)
            if request in self._to_admit[request.worker]:
                self._to_admit[request.worker].remove(request)  # never reached the worker
            elif slot_open:
                self._to_release[request.worker].append((request.key, request.generation))
            if request.allocation is not None:
                self.kv[request.worker].free(request.allocation, after_step=request.last_step_id)
        elif request.key in self.swap.swapped_on:
            worker = self.swap.swapped_on[request.key]
            unexported = self.swap.forget(request, self.kv[worker])
            if unexported is not None:
                self._to_release[worker].append(unexported)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.rng.drop(request.key)
        del self._live[request.request_id]
        del self._by_key[request.key]

    @property
    def num_unfinished(self) -> int:
        return len(self._live)

    def has_work(self, worker: int) -> bool:
        """Whether schedule(worker) would produce a plan."""
        pending = self.running[worker] or self._to_release[worker] or self.waiting or self.swap.has_ops(worker)
        return self.alive[worker] and bool(pending)

    # ------------------------------------------------------------------ schedule

    def schedule(self, worker: int) -> PlanBuilder | None:
        """Build `worker`'s next plan, or None when it has nothing to do."""
        self._place_waiting()
        plan = PlanBuilder(self._next_step, self.policy.signal)
        budget = self.config.max_num_batched_tokens
        cohort_busy = not self.config.refill and any(r.phase == Phase.LOOP for r in self.running[worker])
        self._short_of_blocks[worker] = False
        for key, generation in self._to_release[worker]:
            plan.release(key, generation)
        freed_slots = len(self._to_release[worker]) + self.swap.emit(plan, worker, self.kv[worker])
        if freed_slots:
            self._releases_in_flight[worker][plan.step_id] = freed_slots
        self._to_release[worker].clear()
        for request in self._to_admit[worker]:
            plan.admit(request, request.allocation)
        self._to_admit[worker].clear()
        for request in list(self.running[worker]):
            if budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            if request.phase == Phase.LOOP:
                self._schedule_loop(plan, request)
                budget -= 1
            elif request.phase == Phase.BOUNDARY and not cohort_busy:
                if self._ensure_positions(plan, request, min(request.position + 2, request.max_positions)):
                    self._schedule_boundary(plan, request)
                    budget -= 1
        for request in list(self.running[worker]):
            if budget <= 0:
                break
            if request.phase == Phase.PREFILL and request.status == RequestStatus.RUNNING:
                budget -= self._schedule_prefill(plan, request, budget, cohort_busy)
        if plan.is_empty:
            return None
        self._in_flight[worker] = plan.slot_ops
        self._next_step += 1
        self.stats.num_steps += 1
        return plan

    def _place_waiting(self) -> None:
        """Admit waiting requests (FCFS, or by priority) on the worker with the most free KV.

        Ties go to the worker with the fewest running requests. Under priority scheduling a
        request that cannot be placed may preempt strictly lower-priority running work.
        """
        while self.waiting:
            request = self._next_waiting()
            worker = self._placement(request)
            if worker is None and self.config.priority and self._preempt_for(request):
                if self.config.swap:
                    return  # the victim's blocks and slot return only after its export runs
                continue
            if worker is None:
                return
            self.waiting.remove(request)
            if self.config.priority:  # under FCFS nobody is ever bypassed
                for other in self.waiting:
                    if other.arrival < request.arrival:
                        other.num_bypasses += 1
            request.worker = worker
            request.allocation = self.kv[worker].allocate(self._initial_positions(request))
            request.generation = self._next_generation
            self._next_generation += 1
            request.status = RequestStatus.RUNNING
            self.running[worker].append(request)
            if request.key in self.swap.swapped_on:
                self.swap.swap_in(request)  # resumes in the phase it left
            else:
                request.phase = Phase.PREFILL
                self._to_admit[worker].append(request)

    def _next_waiting(self) -> Request:
        if not self.config.priority:
            return self.waiting[0]
        starved = [r for r in self.waiting if r.num_bypasses >= self.config.max_bypasses]
        if starved:
            return min(starved, key=lambda r: r.arrival)
        return min(self.waiting, key=lambda r: (r.params.priority, r.arrival))

    def _initial_positions(self, request: Request) -> int:
        if request.key in self.swap.positions:
            return self.swap.positions[request.key]
        if not self.config.on_demand_kv:
            return request.max_positions
        return min(request.max_positions, request.prompt_len + self.kv[0].block_size)

    def _placement(self, request: Request) -> int | None:
        swapped_on = self.swap.swapped_on.get(request.key)
        if swapped_on is not None and not self.swap.can_resume(request, self.kv[swapped_on].completed_step):
            return None
        responsive = [w for w in range(len(self.kv)) if self.alive[w] and self.responsive[w]]
        candidates = [
            w for w, kv in enumerate(self.kv)
            if self.alive[w]
            and (self.responsive[w] or not responsive)  # a late worker only when every one is late
            and not self._short_of_blocks[w]
            and swapped_on in (None, w)
            and self._num_slots_held(w) < self.config.max_num_seqs
            and kv.can_allocate(self._initial_positions(request))
        ]
        if not candidates:
            return None
        return max(candidates, key=lambda w: (self.kv[w].num_free_blocks, -len(self.running[w])))

    def _preempt_for(self, request: Request) -> bool:
        """Preempt the lowest-priority running request whose priority is strictly lower."""
        victims = [
            r for w, running in enumerate(self.running) if self.alive[w]
            for r in running if r.params.priority > request.params.priority and r.phase != Phase.LAST_CODA
        ]
        if not victims:
            return False
        self.preempt(max(victims, key=lambda r: (r.params.priority, r.allocation.num_blocks if r.allocation else 0)))
        return True

    def _ensure_positions(self, plan: PlanBuilder, request: Request, num_positions: int) -> bool:
        """Grow the request's KV to cover `num_positions`, preempting others if needed."""
        allocation, kv = request.allocation, self.kv[request.worker]
        assert allocation is not None
        while allocation.num_positions < num_positions:
            if not kv.can_grow():
                self._short_of_blocks[request.worker] = True
                victim = self._growth_victim(request, plan.step_id)
                if victim is None:
                    return False
                self.preempt(victim)
                if self.config.swap:
                    return False  # a swapped victim's blocks return only after its export runs
                continue
            plan.append_blocks(request, kv.grow(allocation))
        return True

    def _growth_victim(self, request: Request, step_id: int) -> Request | None:
        """Highest priority number, then most blocks held; never one already in this step."""
        victims = [
            r for r in self.running[request.worker]
            if r is not request and r.last_step_id != step_id and r.phase != Phase.LAST_CODA
        ]
        if not victims:
            return None
        return max(victims, key=lambda r: (r.params.priority, r.allocation.num_blocks if r.allocation else 0))

    def preempt(self, request: Request) -> None:
        """Take a running request off its worker; it waits at the front of the queue.

        swap: its slot state and pages are exported to the worker's host memory and imported
        on resume. recompute (or a request that never reached its worker): slot and blocks go
        back now and the request replays depth-faithfully on resume.
        """
        worker = request.worker
        self.running[worker].remove(request)
        never_started = request in self._to_admit[worker]
        if never_started:
            self._to_admit[worker].remove(request)
        if self.config.swap and not never_started:
            self.swap.swap_out(request, request.allocation)
        else:
            if not never_started:
                self._to_release[worker].append((request.key, request.generation))
            self.kv[worker].free(request.allocation, after_step=request.last_step_id)
            self._reset_for_replay(request)
        request.allocation = None
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.stats.num_preemptions += 1

    def _num_slots_held(self, worker: int) -> int:
        releasing = (
            len(self._to_release[worker]) + self.swap.num_pending_exports(worker)
            + sum(self._releases_in_flight[worker].values())
        )
        return len(self.running[worker]) + releasing

    def _schedule_loop(self, plan: PlanBuilder, request: Request) -> None:
        """The position's next loops: one, or up to `loops_per_plan` when no exit can come in between."""
        first = request.depth + 1
        num_loops = self._num_loops(request, first)
        request.depth = first + num_loops - 1
        plan.recurrent(request, request.position, first, num_loops)

    def _num_loops(self, request: Request, first_depth: int) -> int:
        """Loops one plan runs from `first_depth`: several only when the exit depth is known up
        front (a policy with no signal, so nothing read between loops could end the position)."""
        if self.policy.signal != Signal.NONE or request.exit_depth is None:
            return 1
        return max(1, min(self.config.loops_per_plan, request.exit_depth - first_depth + 1))

    def _schedule_prefill(self, plan: PlanBuilder, request: Request, budget: int, cohort_busy: bool) -> int:
        """Schedule the next prompt chunk; returns the tokens it costs."""
        remaining = request.prompt_len - request.num_prefilled
        chunk = min(remaining, self.config.prefill_chunk_size, budget)
        if self.config.kv_layout == "shared":
            chunk = 1  # SHARED: a position finishes all its loops before the next one starts
        start = request.num_prefilled
        if not self._ensure_positions(plan, request, start + chunk):
            return 0
        plan.prefill(request, start, request.prompt_token_ids[start : start + chunk])
        request.num_prefilled += chunk
        if request.num_prefilled == request.prompt_len:
            request.phase = Phase.BOUNDARY
            request.position = request.prompt_len - 1
            request.depth = request.exit_depth = self.config.max_depth
            if not cohort_busy:
                self._schedule_boundary(plan, request)
        return chunk

    def _schedule_boundary(self, plan: PlanBuilder, request: Request) -> None:
        """[finalize →] CODA of the exited position, then PRELUDE + loop 1 of the next one.

        The CODA at position t produces output t − (P − 1). If that output was already
        delivered (a replay), nothing is sampled and the next position is fed the delivered
        token explicitly; otherwise the sampled token stays on the worker (token −1).
        """
        position, exit_depth = request.position, request.exit_depth
        assert exit_depth is not None
        if self.config.kv_layout == "last_exited" and exit_depth < self.config.max_depth:
            plan.finalize(request, position, exit_depth)
        output_index = position - (request.prompt_len - 1)
        replaying = output_index < request.num_outputs
        if not replaying:
            plan.coda(request, position, output_index)
            request.coda_exit_depth = exit_depth
            if output_index + 1 >= request.params.max_tokens:
                request.phase = Phase.LAST_CODA
                return
        elif self.config.coda_has_kv and output_index > 0:
            plan.coda(request, position, output_index=-1)  # coda K/V of the exit state only
        next_output = output_index + 1  # the output the next position's CODA produces
        request.position = position + 1
        request.phase = Phase.LOOP
        request.depth = 1
        request.hazard_remaining = 1.0
        if next_output < request.num_outputs:
            request.exit_depth = request.exit_depths[next_output]
        else:
            request.exit_depth = self.policy.planned_exit(request, next_output)
        token = request.output_token_ids[output_index] if replaying else -1
        plan.prelude(request, request.position, token)
        num_loops = self._num_loops(request, 1)
        request.depth = num_loops
        plan.recurrent(request, request.position, 1, num_loops)

    # ------------------------------------------------------------------ faults

    def worker_lost(self, worker: int) -> list[Request]:
        """A worker died: replay its requests elsewhere; returns those that end with an error.

        A request that has now lost two workers ends with an error, so a request that kills
        workers cannot take the whole fleet down.
        """
        self.alive[worker] = False
        self._to_admit[worker].clear()
        self._to_release[worker].clear()
        self._releases_in_flight[worker].clear()
        self._in_flight[worker] = None
        failed: list[Request] = []
        for request in reversed(self.running[worker]):
            request.num_workers_lost += 1
            request.allocation = None  # the blocks died with the worker's pool
            request.status = RequestStatus.WAITING
            if request.num_workers_lost >= 2:
                failed.append(request)
                self.finish(request, "error")
                continue
            self._reset_for_replay(request)
            self.waiting.appendleft(request)
            self.stats.num_replays += 1
        self.running[worker].clear()
        lost_copies = set(self.swap.worker_lost(worker))
        for request in self.waiting:
            if request.key in lost_copies:  # its host copy died with the worker: replay instead
                self._reset_for_replay(request)
                self.stats.num_replays += 1
        return failed

    def step_failed(self, worker: int, result: StepResult) -> list[Request]:
        """The worker's plan failed midway: reconcile the books with the slot ops it says it
        applied, then end every request the plan reached on that worker with an error.

        Slot ops that never ran are sent again (releases, drops) or undone in the books: a slot an
        admit never opened is not released; a swap victim whose export never ran still holds its
        slot (released now) and has no host copy, so it replays instead. Requests placed after the
        plan was sent (still to admit) are untouched."""
        sent, self._in_flight[worker] = self._in_flight[worker], None
        assert sent is not None, f"worker {worker} failed a step the scheduler never sent"
        applied = result.applied or AppliedOps()
        self.kv[worker].retire(result.step_id)  # the worker has stopped using the plan's blocks
        self._releases_in_flight[worker].pop(result.step_id, None)
        never_opened = set(sent.admits[applied.admits:]) | set(sent.imports[applied.imports:])
        releases = [s for s in self._to_release[worker] if s not in never_opened]  # aborted in flight
        releases += sent.releases[applied.releases:]
        drops = sent.swap_drops[applied.swap_drops:] + [key for key, _ in sent.imports]  # copies maybe restored
        for key, generation in sent.exports[applied.exports:]:
            releases.append((key, generation))  # still in its slot, with no host copy
            request = self._by_key.get(key)
            if request is not None and self.swap.swapped_on.get(key) == worker:
                self.swap.cancel(key)
                self._reset_for_replay(request)
                self.stats.num_replays += 1
        self._to_release[worker] = releases
        self.swap.drop_later(worker, drops)
        failed = [r for r in self.running[worker] if r not in self._to_admit[worker]]
        for request in failed:
            self.finish(request, "error", slot_open=(request.key, request.generation) not in never_opened)
        return failed

    def fail_all(self, reason: str) -> list[Request]:
        """End every live request (no worker is left to run them)."""
        requests = list(self._live.values())
        for request in requests:
            self.finish(request, reason)
        return requests

    def set_responsive(self, worker: int, responsive: bool) -> None:
        """A late worker gets no new requests; those placed on it but never sent wait for another."""
        if self.responsive[worker] == responsive:
            return
        self.responsive[worker] = responsive
        if responsive:
            log.warning("worker %d is heard from again", worker)
            return
        log.warning("worker %d is late (no word for half of worker_timeout): new requests go elsewhere", worker)
        kv = self.kv[worker]
        for request in reversed(self._to_admit[worker]):
            self.running[worker].remove(request)
            kv.free(request.allocation, after_step=kv.completed_step)  # never named in a plan
            request.allocation = None
            request.status = RequestStatus.WAITING
            self._reset_for_replay(request)
            self.waiting.appendleft(request)
        self._to_admit[worker].clear()

    def worker_started(self, worker: int, kv_manager: KVManager) -> None:
        """A (replacement) worker is ready with an empty pool."""
        self.kv[worker] = kv_manager
        self.alive[worker] = self.responsive[worker] = True

    def _reset_for_replay(self, request: Request) -> None:
        """Start a new life of the request's slot: prompt again, delivered outputs replayed."""
        request.worker = -1
        request.generation = 0
        request.phase = Phase.PREFILL
        request.num_prefilled = 0
        request.position = 0
        request.depth = 0
        request.exit_depth = None

    # ------------------------------------------------------------------ results

    def update(self, worker: int, result: StepResult) -> list[Request]:
        """Apply one StepResult of `worker`; returns the requests whose output changed."""
        self.kv[worker].retire(result.step_id)
        self._releases_in_flight[worker].pop(result.step_id, None)
        self._in_flight[worker] = None
        changed: dict[int, Request] = {}
        rows = zip(
            result.col("keys").tolist(), result.col("generations").tolist(), result.col("stages").tolist(),
            result.col("depths").tolist(), result.col("signals").tolist(), result.col("tokens").tolist(),
            result.col("logprobs").tolist(), strict=True,
        )
        for key, generation, stage, depth, signal, token, logprob in rows:
            request = self._by_key.get(key)
            if request is None or request.generation != generation or request.worker != worker:
                self.stats.num_stale_rows += 1
                continue
            if stage == Stage.CODA:
                self._apply_token(request, token, logprob)
                changed[key] = request
            elif stage == Stage.RECURRENT:
                self._apply_loop(request, depth, signal)
        return list(changed.values())

    def _apply_token(self, request: Request, token: int, logprob: float) -> None:
        request.output_token_ids.append(token)
        request.exit_depths.append(request.coda_exit_depth)
        request.logprobs.append(logprob)
        params = request.params
        if request.num_outputs >= params.max_tokens:
            self.finish(request, "length")
        elif token in params.stop_token_ids or (not params.ignore_eos and token in self.config.eos_token_ids):
            self.finish(request, "stop")

    def _apply_loop(self, request: Request, depth: int, signal: float) -> None:
        if request.exit_depth is None and self.policy.signal != Signal.NONE:
            request.exit_depth = self.policy.observe(request, depth, signal)
        if request.exit_depth is not None and depth >= request.exit_depth:
            request.phase = Phase.BOUNDARY
