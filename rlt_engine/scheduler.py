"""The scheduler: the only writer of request state (SPEC §3, §6).

Each call of `schedule(worker)` first places waiting requests, then builds that worker's plan at
loop boundaries:

    0. placement of waiting requests (FCFS, or by priority) on the worker holding the longest
       cached prefix of the prompt, then the most free KV
    1. the slot ops owed to the worker (releases, swap exports / imports / drops, admits)
    2. running decode rows (never starved by arrivals): the next loop of every looping
       position, and [finalize →] CODA → PRELUDE → loop 1 for every position that exited
       (refill: at once; no_refill: only when the worker's whole cohort has exited). Under a
       policy whose exits the worker decides (ouro*, kl, latent_diff), and under planned exits
       (fixed, trace) when a plan runs several passes, a live position is one DecodeBatch row
       instead: the worker loops it, tests it (or follows the depths the row carries), samples and
       refills in the plan
    3. prompt chunks of admitted requests, within max_num_batched_tokens, and within
       max_prefill_tokens_while_decoding while a request on the worker decodes (prefill_budget.py);
       with mixed batches they ride the loop passes of step 2's rows (prefill_mixing.py)

`update(worker, result)` applies a StepResult: tokens, exit depths, exit states, finishes, as if
the host had decided them. With pipelined plans (max_plans_in_flight = 2) the next plan is built
before the last one's result arrives: everything the engine plans (prompt chunks, loops of known
exit depth, boundaries) is decided when it is scheduled, a DecodeBatch row whose previous row is
still in flight continues on the worker (`continues`), and a request found finished late has the
rest of its rows dropped as stale. Rows whose key or generation is not the request's current one are
dropped. An early result (the rows of requests that ended mid-plan) is applied as it comes, its plan
still in flight. Per-worker state lives in one WorkerBook per worker; the preemption mode is a strategy;
faults are in scheduler_faults.py.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from protocol.messages import ExitTest, SamplingParams, Stage, StepResult
from rlt_engine.exit_policy import ExitPolicy
from rlt_engine.kv_manager import KVManager
from rlt_engine.placement import Placement
from rlt_engine.plan_builder import DecodeSettings, PlanBuilder
from rlt_engine.preemption import make_preemption
from rlt_engine.prefill_budget import make_prefill_budget
from rlt_engine.prefill_mixing import make_prefill_mixing
from rlt_engine.prefix_cache import BlockHasher, NoPrefixCaching
from rlt_engine.request import Phase, Request, RequestStatus
from rlt_engine.rng import RngRegistry
from rlt_engine.scheduler_faults import SchedulerFaults
from rlt_engine.worker_book import WorkerBook

log = logging.getLogger("rlt.scheduler")


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduling knobs of EngineConfig, plus the model facts the scheduler needs."""

    max_depth: int  # D: loops of every prompt position, the most any position runs
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
    preemption: str = "recompute"  # or "swap": victims' slots go to host memory
    # Most loop passes one plan runs: a row whose exit depth is known (a replay; fixed, trace at 1)
    # runs up to this many loops of its position; a DecodeBatch (the worker decides exits, or follows
    # the planned ones of fixed and trace when this is > 1) this many
    # passes, across as many tokens as its rows exit (≤ loops_per_plan + 1 tokens per row), and at
    # most loops_while_prompt_pending of them while a prompt or a first token is pending
    # (Scheduler._decode_settings).
    loops_per_plan: int = 1
    loops_while_prompt_pending: int = 0  # 0: D
    enable_prefix_caching: bool = False  # full prompt blocks shared through each worker's cache index
    prefix_cache_salt: str = ""  # what a prompt's K/V depends on besides its tokens: model, dtype, layout, D
    prompt_kv_seeded: bool = False  # Huginn's random state init: the prompt's K/V depends on its seed too
    max_plans_in_flight: int = 1  # 2: a worker's next plan is built before its last one's result is read
    mixed_batches: bool = False  # prompt chunks ride the loop passes of the step's decode rows
    max_prefill_tokens_while_decoding: int = 0  # prompt tokens per step while a request decodes (0: no cap)
    prefill_tokens_per_decoding_row: int = 0  # the cap grows to this × decoding requests (0: a fixed cap)
    # The worker's PREFILL graph buckets (WorkerReady): a step's prompt tokens are raised to one (prefill_budget.py).
    prefill_token_buckets: tuple[int, ...] = ()


@dataclass
class SchedulerStats:
    """Counters for tests, benchmarks and health."""

    num_stale_rows: int = 0
    num_early_results: int = 0  # results of requests that ended mid-plan, ahead of their plan's (StepResult.early)
    num_steps: int = 0
    num_replays: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, one lookup per admission
    prefix_cache_hits: int = 0  # of those, tokens whose K/V came from the cache


class Scheduler(SchedulerFaults):
    """Owns every Request; plans steps per worker and applies their results."""

    def __init__(
        self, config: SchedulerConfig, policy: ExitPolicy, kv_managers: list[KVManager], rng: RngRegistry
    ) -> None:
        self.config = config
        self.policy = policy
        self.rng = rng
        self.preemption = make_preemption(config.preemption)
        self.mixing = make_prefill_mixing(config.mixed_batches)
        self.prefill_budget = make_prefill_budget(config.max_prefill_tokens_while_decoding,
                                                  config.prefill_tokens_per_decoding_row,
                                                  config.max_num_batched_tokens, config.prefill_token_buckets)
        exit_test = policy.exit_test
        if exit_test is None and config.loops_per_plan > 1:
            # Several passes per plan: planned positions loop in the worker's decode loop too, so a row
            # that exits early takes its next position at the next pass instead of idling until the
            # plan's deepest row ends (one pass per plan has nothing to idle: RecurrentBatch rows).
            exit_test = ExitTest.PLANNED
        self._decode = None if exit_test is None else DecodeSettings(
            exit_test, max_passes=config.loops_per_plan, refill=config.refill)
        # While a prompt or a first token is pending, a plan's passes are bounded (see _decode_settings).
        self._prompt_decode = None if self._decode is None else DecodeSettings(
            self._decode.exit_test, max_passes=min(config.loops_per_plan,
                                                   config.loops_while_prompt_pending or config.max_depth),
            refill=config.refill)
        self.books = [WorkerBook(w, kv, config.max_num_seqs) for w, kv in enumerate(kv_managers)]
        self.placement = Placement(self.books, self.preemption, priority=config.priority,
                                   max_bypasses=config.max_bypasses, max_num_seqs=config.max_num_seqs,
                                   on_demand_kv=config.on_demand_kv)
        self.stats = SchedulerStats()
        self.hasher = (BlockHasher(config.prefix_cache_salt, kv_managers[0].block_size, config.prompt_kv_seeded)
                       if config.enable_prefix_caching else NoPrefixCaching())
        self.waiting: deque[Request] = deque()
        self._live: dict[str, Request] = {}
        self._by_key: dict[int, Request] = {}
        self._next_key = 1
        self._next_generation = 1
        self._next_step = 1
        self._arrivals = 0

    # ------------------------------------------------------------------ requests

    def is_live(self, request_id: str) -> bool:
        return request_id in self._live

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> tuple[Request, int]:
        """Queue a validated request; returns it and its seed (registered, drawn if not given)."""
        key = self._next_key
        self._next_key += 1
        seed = self.rng.register(key, params.seed)
        limits = self.policy.limits(params, self.config.max_depth)
        request = Request(request_id, key, list(prompt_token_ids), params, limits, self._arrivals,
                          block_hashes=self.hasher.block_hashes(prompt_token_ids, seed))
        eos = frozenset() if params.ignore_eos else self.config.eos_token_ids
        request.stop_token_ids = frozenset(params.stop_token_ids) | eos
        self._arrivals += 1
        self._live[request_id] = request
        self._by_key[key] = request
        self.waiting.append(request)
        return request, seed

    def abort(self, request_id: str) -> Request | None:
        """End a live request with finish reason `abort`; None if it is not live."""
        request = self._live.get(request_id)
        if request is not None:
            self.finish(request, "abort")
        return request

    def finish(self, request: Request, reason: str, slot_open: bool = True) -> None:
        """End a request's life: KV back after its last step, slot released in the next plan, seed dropped.

        `slot_open` False: the worker never opened the request's slot (a failed plan's admit)."""
        if request.status == RequestStatus.RUNNING:
            book = self.books[request.worker]
            book.running.remove(request)
            if request in book.to_admit:
                book.to_admit.remove(request)  # never reached the worker
            elif slot_open:
                book.to_release.append((request.key, request.generation))
            if request.allocation is not None:
                book.kv.free(request.allocation, after_step=request.last_step_id)
        elif request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
            self.preemption.forget(self.books, request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.rng.drop(request.key)
        del self._live[request.request_id]
        del self._by_key[request.key]

    def stop_at(self, request: Request, num_outputs: int) -> None:
        """A stop string ended the request's text with output `num_outputs` − 1: the outputs after it
        (a plan may sample several) are dropped before any is delivered, and the request ends with
        `stop` (one that a later output had already ended keeps its reason only if none is dropped)."""
        if num_outputs < request.num_outputs:
            for outputs in (request.output_token_ids, request.exit_depths, request.logprobs):
                del outputs[num_outputs:]  # in place: the output processor shares these lists
            request.finish_reason = "stop"
        if not request.is_finished:
            self.finish(request, "stop")

    @property
    def num_unfinished(self) -> int:
        return len(self._live)

    @property
    def running(self) -> list[list[Request]]:
        """Each worker's running requests (a view for health and tests)."""
        return [book.running for book in self.books]

    def has_work(self, worker: int) -> bool:
        """Whether schedule(worker) would produce a plan."""
        book = self.books[worker]
        return book.alive and bool(book.running or book.has_slot_ops or self.waiting)

    # ------------------------------------------------------------------ schedule

    def schedule(self, worker: int) -> PlanBuilder | None:
        """Build `worker`'s next plan, or None when it has nothing to do."""
        self._place_waiting()
        book = self.books[worker]
        plan = PlanBuilder(self._next_step, self.rng.seed, self._decode_settings(book))
        budget = self.config.max_num_batched_tokens
        cohort_busy = not self.config.refill and any(r.phase == Phase.LOOP for r in book.running)
        book.short_of_blocks = False
        book.emit_slot_ops(plan)
        for request in list(book.running):
            if budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            if self._decoding_on_worker(book, request):
                # Its state is the result of a plan in flight: the worker goes on from there (no_refill:
                # the cohort's boundary work waits for that result).
                if self.config.refill and self._schedule_decode(plan, request, exited=False, continues=True):
                    budget -= 1
                continue
            if request.phase == Phase.LOOP:
                if self._schedule_loop(plan, request):
                    budget -= 1
            elif request.phase == Phase.BOUNDARY and not cohort_busy:
                if self._ensure_positions(plan, request, min(request.position + 2, request.max_positions)):
                    self._schedule_boundary(plan, request)
                    budget -= 1
        rides = self.mixing.rides(plan)
        budget = self.prefill_budget.tokens(book.running, budget)
        for request in list(book.running):
            if budget <= 0:
                break
            if request.phase == Phase.PREFILL and request.status == RequestStatus.RUNNING:
                budget -= self._schedule_prefill(plan, request, budget, rides, cohort_busy)
        if plan.is_empty:
            return None
        for key in plan.named:
            self._by_key[key].last_step_id = plan.step_id
        book.sent(plan)
        self._next_step += 1
        self.stats.num_steps += 1
        return plan

    def _decode_settings(self, book: WorkerBook) -> DecodeSettings | None:
        """The DecodeBatch settings of the worker's next plan: at most min(loops_per_plan,
        loops_while_prompt_pending) passes (that setting's default: D) while a prompt is pending (a
        request waits to be placed, or one on the worker has prompt chunks left) or a first token is
        (one on the worker has no output yet: its prompt's last position is in this plan or in one in
        flight), else loops_per_plan. A prompt's first token, and a waiting request's placement, come
        with the result of a plan in flight, and a plan in flight is read after the next one is
        submitted (in-process, a DecodeBatch's submit runs its passes): a long plan would delay them by
        all its passes, while a short one pays a prefill step for fewer decode tokens."""
        prompt_pending = bool(self.waiting) or any(r.phase == Phase.PREFILL or not r.num_outputs for r in book.running)
        return self._prompt_decode if prompt_pending else self._decode

    def _place_waiting(self) -> None:
        """Place waiting requests, in the order and on the workers `Placement` decides. Under
        priority scheduling a request that cannot be placed may preempt lower-priority work. A
        request whose prompt prefix is being computed for another one waits for it (FCFS: so do
        the ones behind it, for as long as that prefix's plan runs)."""
        while self.waiting:
            request = self.placement.next_waiting(self.waiting)
            if self.placement.awaits_prefix(request):
                return
            book = self.placement.worker_for(request)
            if book is None and self.config.priority:
                victim = self.placement.priority_victim(request)
                if victim is not None:
                    freed_now = self._frees_at_once(victim)
                    self.preempt(victim)
                    if not freed_now:
                        return  # the victim's blocks and slot return after its export or its plan in flight
                    continue
            if book is None:
                return
            self.waiting.remove(request)
            if self.config.priority:  # under FCFS nobody is ever bypassed
                for other in self.waiting:
                    if other.arrival < request.arrival:
                        other.num_bypasses += 1
            request.allocation = book.kv.allocate(self.placement.initial_positions(request),
                                                  self.placement.cache_keys(request))
            request.worker = book.index
            request.generation = self._next_generation
            self._next_generation += 1
            request.status = RequestStatus.RUNNING
            book.running.append(request)
            if not self.preemption.resume(book, request):  # swap: an import resumes it where it left
                self._admit(book, request)

    def _admit(self, book: WorkerBook, request: Request) -> None:
        """Queue the admit of a placed request: its prompt from the end of its cached prefix."""
        request.phase = Phase.PREFILL
        request.num_prefilled = request.allocation.num_cached_positions
        self.stats.prefix_cache_queries += request.prompt_len
        self.stats.prefix_cache_hits += request.num_prefilled
        if request.num_cached_tokens < 0:  # the life's first admission (vLLM's num_cached_tokens)
            request.num_cached_tokens = request.num_prefilled
        book.to_admit.append(request)

    def _ensure_positions(self, plan: PlanBuilder, request: Request, num_positions: int) -> bool:
        """Grow the request's KV to cover `num_positions`, preempting others if needed."""
        allocation, book = request.allocation, self.books[request.worker]
        assert allocation is not None
        while allocation.num_positions < num_positions:
            if not book.kv.can_grow():
                book.short_of_blocks = True
                victim = self._growth_victim(book, request, plan)
                if victim is None:
                    return False
                freed_now = self._frees_at_once(victim)
                self.preempt(victim)
                if not freed_now:
                    return False  # its blocks return after its export runs, or after its plan in flight
                continue
            plan.append_blocks(request, book.kv.grow(allocation))
        return True

    def _frees_at_once(self, victim: Request) -> bool:
        """Whether preempting `victim` frees its blocks for this step's plan: recompute, and no plan
        naming it is in flight (a swapped victim's blocks return after its export)."""
        completed = self.books[victim.worker].kv.completed_step
        return self.preemption.frees_blocks_at_once and victim.last_step_id <= completed

    def _decoding_on_worker(self, book: WorkerBook, request: Request) -> bool:
        """Whether a plan in flight carries a DecodeBatch row of the request: its position, depth and
        exit state are then that plan's result, which the engine has not read yet."""
        return self._decode is not None and request.decode_step_id > book.kv.completed_step

    @staticmethod
    def _growth_victim(book: WorkerBook, request: Request, plan: PlanBuilder) -> Request | None:
        """Highest priority number, then most blocks held; never one already in this step."""
        victims = [
            r for r in book.running
            if r is not request and r.key not in plan.named and r.phase != Phase.LAST_CODA
        ]
        if not victims:
            return None
        return max(victims, key=lambda r: (r.params.priority, r.allocation.num_blocks if r.allocation else 0))

    def preempt(self, request: Request) -> None:
        """Take a running request off its worker; it waits at the front of the queue.

        The preemption strategy queues its slot ops (swap: an export; recompute: a release). A
        request that never reached its worker just gives its blocks back. Either way a request
        that does not keep its progress replays depth-faithfully on resume.
        """
        book = self.books[request.worker]
        book.running.remove(request)
        if request in book.to_admit:
            book.to_admit.remove(request)
            book.kv.free(request.allocation, after_step=request.last_step_id)
            self._reset_for_replay(request)
        else:
            self.preemption.take_off(book, request)
            if not self.preemption.keeps_progress:
                self._reset_for_replay(request)
        request.allocation = None
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.stats.num_preemptions += 1

    def _schedule_loop(self, plan: PlanBuilder, request: Request) -> bool:
        """The position's next loops: up to `loops_per_plan` of them when its exit depth is known,
        else a DecodeBatch row (False: it could not be scheduled this step)."""
        if request.exit_depth is None:
            return self._schedule_decode(plan, request, exited=False)
        self._plan_loops(plan, request, request.depth + 1)
        return True

    def _plan_loops(self, plan: PlanBuilder, request: Request, first_depth: int) -> None:
        """The loops of a position whose exit depth is known, from `first_depth`; when they reach it the
        position's boundary is next, decided now (a pipelined plan may carry it before this one's result)."""
        num_loops = self._num_loops(request, first_depth)
        request.depth = first_depth + num_loops - 1
        plan.recurrent(request, request.position, first_depth, num_loops)
        if request.depth >= request.exit_depth:
            request.phase = Phase.BOUNDARY

    def _num_loops(self, request: Request, first_depth: int) -> int:
        """Loops one plan runs from `first_depth` of a position whose exit depth is known."""
        assert request.exit_depth is not None
        return max(1, min(self.config.loops_per_plan, request.exit_depth - first_depth + 1))

    def _schedule_decode(self, plan: PlanBuilder, request: Request, exited: bool, continues: bool = False) -> bool:
        """A DecodeBatch row for the request's position (the worker decides its exit). Its next position
        must have blocks (an exit is always followed by its PRELUDE); the positions a plan may reach
        get them too while blocks are free. False: no block for the next position this step.

        `continues`: a plan in flight carries the request's previous row, so the host's position lags
        by up to that plan's tokens; the row goes on from where the worker left it."""
        if not self._ensure_positions(plan, request, min(request.position + 2, request.max_positions)):
            return False
        num_plans = self.config.max_plans_in_flight if continues else 1
        self._reserve_ahead(plan, request, num_plans)
        # Planned exits: the depths of every position the row may loop in this plan and the one in flight.
        output_index = request.position - (request.prompt_len - 1)
        planned = self.policy.planned_exits(request, output_index, num_plans * (self.config.loops_per_plan + 1))
        plan.decode(request, exited, continues, planned)
        request.decode_step_id = plan.step_id
        return True

    def _reserve_ahead(self, plan: PlanBuilder, request: Request, num_plans: int) -> None:
        """Blocks for every position the request's DecodeBatch rows of `num_plans` plans (this one and
        those in flight) may reach, from free blocks only (never by preemption): up to loops_per_plan
        + 1 new positions per plan, plus the one after them, which the worker wants covered before
        it loops the last. Those the plans do not reach serve the next plans; a request that ends
        frees them with the rest of its allocation."""
        allocation, kv = request.allocation, self.books[request.worker].kv
        assert allocation is not None
        reach = min(request.position + num_plans * (self.config.loops_per_plan + 1) + 1, request.max_positions)
        while allocation.num_positions < reach and kv.can_grow():
            plan.append_blocks(request, kv.grow(allocation))

    def _schedule_prefill(
        self, plan: PlanBuilder, request: Request, budget: int, rides: bool, cohort_busy: bool
    ) -> int:
        """Schedule the next prompt chunk (`rides`: in the plan's loop passes); returns the tokens it costs.

        The prompt's last chunk is followed by its boundary work in the same plan, except under no_refill
        while the cohort loops, and after a riding chunk unless that work is a DecodeBatch row."""
        remaining = request.prompt_len - request.num_prefilled
        chunk = min(remaining, self.config.prefill_chunk_size, budget)
        if self.config.kv_layout == "shared":
            chunk = 1  # SHARED: a position finishes all its loops before the next one starts
        start = request.num_prefilled
        if not self._ensure_positions(plan, request, start + chunk):
            return 0
        plan.prefill(request, start, request.prompt_token_ids[start : start + chunk])
        request.num_prefilled += chunk
        self.books[request.worker].kv.cache_computed(request.allocation, request.num_prefilled, plan.step_id)
        if request.num_prefilled == request.prompt_len:
            request.phase = Phase.BOUNDARY
            request.position = request.prompt_len - 1
            request.depth = request.exit_depth = self.config.max_depth
            if not cohort_busy and (not rides or self._decodes_first_output(request)):
                self._schedule_boundary(plan, request)
        return chunk

    def _decodes_first_output(self, request: Request) -> bool:
        """Whether the boundary after the prompt is a DecodeBatch row: the worker decides exits and output
        0 is not a replayed one. The worker holds such a row until a riding chunk's last loop has run;
        CODA rows, which run before the plan's loop passes, would read a state not computed yet."""
        return self._decode is not None and request.num_outputs == 0

    def _schedule_boundary(self, plan: PlanBuilder, request: Request) -> None:
        """[finalize →] CODA of the exited position, then PRELUDE + loop 1 of the next one.

        The CODA at position t produces output t − (P − 1). If that output was already
        delivered (a replay), nothing is sampled and the next position is fed the delivered
        token explicitly; otherwise the sampled token stays on the worker (token −1).
        """
        position, exit_depth = request.position, request.exit_depth
        assert exit_depth is not None
        output_index = position - (request.prompt_len - 1)
        replaying = output_index < request.num_outputs
        if self._decode is not None and not replaying:
            # The worker decides the next position's exit: this boundary is its work too, so EOS and
            # max_tokens are checked where the token is sampled and the next token refills at once.
            self._schedule_decode(plan, request, exited=True)
            return
        if self.config.kv_layout == "last_exited" and exit_depth < self.config.max_depth:
            plan.finalize(request, position, exit_depth)
        if not replaying:
            plan.coda(request, position, output_index, exit_depth)
            if output_index + 1 >= request.params.max_tokens:
                request.phase = Phase.LAST_CODA
                return
        elif self.config.coda_has_kv and output_index > 0:
            plan.coda(request, position, -1, exit_depth)  # coda K/V of the exit state only
        next_output = output_index + 1  # the output the next position's CODA produces
        request.position = position + 1
        request.phase = Phase.LOOP
        request.exit_state = self.policy.initial_state
        if next_output < request.num_outputs:
            request.exit_depth = request.exit_depths[next_output]
        elif self._decode is None:
            request.exit_depth = self.policy.planned_exit(request, next_output)
        else:
            request.exit_depth = None  # a live position loops in the worker's decode loop
        token = request.output_token_ids[output_index] if replaying else -1
        plan.prelude(request, request.position, token)
        if request.exit_depth is None:  # the live position after a replay: the worker decides its exit
            request.depth = 0
            self._schedule_decode(plan, request, exited=False)
            return
        self._plan_loops(plan, request, 1)

    def _reset_for_replay(self, request: Request) -> None:
        """Start a new life of the request's slot: prompt again, delivered outputs replayed."""
        request.worker = -1
        request.generation = 0
        request.phase = Phase.PREFILL
        request.num_prefilled = 0
        request.position = 0
        request.depth = 0
        request.exit_depth = None
        request.decode_step_id = -1

    # ------------------------------------------------------------------ results

    def update(self, worker: int, result: StepResult) -> list[Request]:
        """Apply one StepResult of `worker`; returns the requests whose output changed. An early result
        (rows of requests that ended mid-plan) leaves its plan in flight: the plan's own result completes it."""
        if result.early:
            self.stats.num_early_results += 1
        else:
            self.books[worker].completed(result.step_id, result.num_free_slots)
        changed: dict[int, Request] = {}
        rows = zip(
            result.col("keys").tolist(), result.col("generations").tolist(), result.col("stages").tolist(),
            result.col("depths").tolist(), result.col("exit_states").tolist(), result.col("tokens").tolist(),
            result.col("logprobs").tolist(), strict=True,
        )
        for key, generation, stage, depth, exit_state, token, logprob in rows:
            request = self._by_key.get(key)
            if request is None or request.generation != generation or request.worker != worker:
                self.stats.num_stale_rows += 1  # also the rest of a request a token of this result ended
                continue
            if stage == Stage.CODA:
                self._apply_token(request, token, logprob, depth)
                changed[key] = request
            elif stage == Stage.DECODE:
                self._apply_decoded_token(request, token, logprob, depth)
                changed[key] = request
            elif stage == Stage.RECURRENT:  # a DecodeBatch row stopped looping its position
                request.depth, request.exit_state = depth, exit_state
            elif stage == Stage.EXITED:
                request.depth = request.exit_depth = depth
                request.phase = Phase.BOUNDARY
        return list(changed.values())

    def _apply_token(self, request: Request, token: int, logprob: float, exit_depth: int) -> None:
        request.output_token_ids.append(token)
        request.exit_depths.append(exit_depth)
        request.logprobs.append(logprob)
        if token in request.stop_token_ids:  # before length: a stop token as the last output is a stop
            self.finish(request, "stop")
        elif request.num_outputs >= request.params.max_tokens:
            self.finish(request, "length")

    def _apply_decoded_token(self, request: Request, token: int, logprob: float, exit_depth: int) -> None:
        """A token the worker sampled after deciding its position's exit; unless it ended the request,
        the worker embedded it at the next position in the same plan."""
        self._apply_token(request, token, logprob, exit_depth)
        if not request.is_finished:
            request.position += 1
            request.phase, request.depth, request.exit_depth = Phase.LOOP, 0, None
            request.exit_state = self.policy.initial_state

