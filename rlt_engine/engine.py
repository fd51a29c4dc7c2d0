"""LLMEngine: the step loop (schedule → submit → collect → update → publish)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from protocol.messages import ExecutionPlan, HealthReport, SamplingParams, StepResult, WorkerHealth, WorkerReady
from rlt_engine.config import EngineConfig
from rlt_engine.errors import EngineDeadError, InvalidRequestError
from rlt_engine.executor import WorkerLost, make_executor
from rlt_engine.exit_policy import TraceExit, make_exit_policy
from rlt_engine.kv_manager import KVManager
from rlt_engine.output_processor import GenerationOutput, OutputProcessor
from rlt_engine.request import Request
from rlt_engine.rng import RngRegistry
from rlt_engine.scheduler import Scheduler, SchedulerConfig
from rlt_engine.tokenizer import load_tokenizer

log = logging.getLogger("rlt.engine")

PlanListener = Callable[[int, ExecutionPlan], None]
MAX_FAILED_STARTS = 3  # replacements in a row that die before serving: then the worker index stays dead
# loops_per_plan = 0 on CUDA: a plan runs up to 4·D loop passes. A replayed position runs at most its
# D loops per plan anyway; a DecodeBatch runs ~4·D / (mean loops per token) tokens per row between
# two engine round trips (Ouro-1.4B on the H200: 16 passes, ~18 ms at c = 1, ~6 tokens at 2.5 loops).
AUTO_PLAN_DEPTHS = 4


class LLMEngine:
    """Owns the scheduler, the KV managers, the RngRegistry and the executor."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config = config.resolved()
        self.tokenizer = load_tokenizer(config.model)
        self.outputs = OutputProcessor(self.tokenizer)
        self.executor = make_executor(config)
        try:
            readies = self.executor.start()
            # A configuration the model cannot serve fails here, with no worker left behind.
            self.policy = make_exit_policy(config.exit_mode, readies[0].model)
        except BaseException:
            self.executor.shutdown()
            raise
        ready = readies[0]
        self.model_info = ready.model
        self.max_depth = ready.max_depth  # D (the user's option is `max_loops`, SPEC §8)
        kv_managers = [KVManager(r.num_blocks, config.block_size, r.num_planes) for r in readies]
        self.rng = RngRegistry()
        scheduler_config = SchedulerConfig(
            max_depth=self.max_depth,
            kv_layout=config.kv_layout,
            refill=config.scheduling == "refill",
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            prefill_chunk_size=config.prefill_chunk_size,
            eos_token_ids=frozenset(ready.model.eos_token_ids),
            coda_has_kv=ready.model.num_outer_kv_layers > 0,
            on_demand_kv=config.kv_growth == "on_demand",
            priority=config.scheduling_policy == "priority",
            max_bypasses=config.max_bypasses,
            preemption=config.preemption,
            loops_per_plan=config.loops_per_plan or AUTO_PLAN_DEPTHS * self.max_depth,
            loops_while_prompt_pending=config.loops_while_prompt_pending,
            enable_prefix_caching=config.enable_prefix_caching,
            prefix_cache_salt=f"{config.model}|{config.dtype}|{config.kv_layout}|D={self.max_depth}|"
                              f"{config.state_init}",
            # The runner draws Huginn's random initial state per (seed, position) (ModelRunner.initial_state).
            prompt_kv_seeded=ready.model.family == "huginn" and config.state_init == "random",
            max_plans_in_flight=config.max_plans_in_flight,
            mixed_batches=config.mixed_batches,
            max_prefill_tokens_while_decoding=config.max_prefill_tokens_while_decoding,
            prefill_tokens_per_decoding_row=config.prefill_tokens_per_decoding_row,
            prefill_token_buckets=ready.prefill_token_buckets,
        )
        self.scheduler = Scheduler(scheduler_config, self.policy, kv_managers, self.rng)
        self._in_flight = [0] * len(readies)  # per worker: plans submitted whose result is not read yet
        self._restarting: set[int] = set()  # replacements starting (restart_workers), off the step loop
        self._failed_starts = [0] * len(readies)  # replacements in a row that died before serving
        self._plan_listeners: list[PlanListener] = []
        self.num_worker_restarts = 0
        self._closed = False
        self.is_dead = False  # no worker left: every request failed, nothing more can run

    # ------------------------------------------------------------------ requests

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None
    ) -> None:
        """Queue a request; raises InvalidRequestError / CapacityError for this request only."""
        if self.is_dead:
            raise EngineDeadError("every worker of this engine is gone; start a new engine")
        params = params or SamplingParams()
        prompt_token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._validate(request_id, prompt_token_ids, params)
        request, seed = self.scheduler.add(request_id, prompt_token_ids, params)
        self.outputs.track(request, seed)

    def abort_request(self, request_id: str) -> GenerationOutput | None:
        """Abort a live request; returns its life's final output (finish reason `abort`), or None if
        no such request is live. No later step() returns an output of that life."""
        request = self.scheduler.abort(request_id)
        return None if request is None else self.outputs.output(request)

    @property
    def kv_managers(self) -> list[KVManager]:
        """Each worker's KV manager (a replacement worker's is new)."""
        return [book.kv for book in self.scheduler.books]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    @property
    def has_work_in_flight(self) -> bool:
        """Whether a plan is running on some worker or a replacement worker is starting."""
        return bool(any(self._in_flight) or self._restarting)

    def health(self) -> HealthReport:
        """Liveness and load: alive workers, waiting and running requests, KV usage per worker, counters."""
        scheduler, stats = self.scheduler, self.scheduler.stats
        workers = [
            WorkerHealth(index=b.index, alive=b.alive, kv_blocks_total=b.kv.num_blocks,
                         kv_blocks_used=b.kv.num_used_blocks if b.alive else 0, running=len(b.running),
                         free_slots=b.num_free_slots, responsive=b.alive and b.responsive,
                         kv_blocks_cached=b.kv.num_cached_blocks if b.alive else 0)
            for b in scheduler.books
        ]
        running = sum(len(b.running) for b in scheduler.books)
        return HealthReport(workers=workers, waiting=len(scheduler.waiting), running=running,
                            num_preemptions=stats.num_preemptions, num_replays=stats.num_replays,
                            num_worker_restarts=self.num_worker_restarts,
                            prefix_cache_queries=stats.prefix_cache_queries, prefix_cache_hits=stats.prefix_cache_hits)

    def reset_prefix_cache(self) -> None:
        """Evict every cached prompt block no request holds, on every worker (benchmarks start cold)."""
        for book in self.scheduler.books:
            book.kv.reset_prefix_cache()

    def add_plan_listener(self, listener: PlanListener) -> None:
        """Call `listener(worker, plan)` for every plan submitted (tests and tracing)."""
        self._plan_listeners.append(listener)

    def _validate(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        depth, info = self.max_depth, self.model_info
        if self.scheduler.is_live(request_id):
            raise InvalidRequestError(f"request id {request_id!r} is already live; wait for it to finish or abort it")
        if not prompt:
            raise InvalidRequestError("the prompt is empty")
        if min(prompt) < 0 or max(prompt) >= info.vocab_size:
            raise InvalidRequestError(f"prompt token ids must be in [0, {info.vocab_size})")
        if params.forced_tokens is not None and max(params.forced_tokens) >= info.vocab_size:
            raise InvalidRequestError(f"forced_tokens must be token ids in [0, {info.vocab_size})")
        if params.max_loops is not None and params.max_loops > depth:
            raise InvalidRequestError(f"max_loops {params.max_loops} exceeds the engine's depth D = {depth}")
        if params.min_loops > (params.max_loops or depth):
            raise InvalidRequestError(f"min_loops {params.min_loops} exceeds max_loops {params.max_loops or depth}")
        self._validate_trace(params)
        positions = len(prompt) + params.max_tokens - 1
        if positions > info.max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) − 1 = {positions} positions "
                f"exceeds the model's limit of {info.max_model_len}"
            )
        self.scheduler.books[0].kv.check_fits(positions)

    def _validate_trace(self, params: SamplingParams) -> None:
        is_trace = isinstance(self.policy, TraceExit)
        if params.exit_depths is None:
            if is_trace:
                raise InvalidRequestError("exit_mode 'trace' needs exit_depths, one entry per output token")
            return
        if not is_trace:
            raise InvalidRequestError("exit_depths is only used with exit_mode 'trace'")
        depths, d = params.exit_depths, self.max_depth
        if depths[0] != d:
            raise InvalidRequestError(
                f"exit_depths[0] must be D = {d} (output 0 comes from the prompt), got {depths[0]}"
            )
        if any(not 1 <= e <= d for e in depths):
            raise InvalidRequestError(f"every exit_depths entry must be in 1 … {d}")

    # ------------------------------------------------------------------ step

    def step(self, timeout: float | None = None) -> list[GenerationOutput]:
        """Fill every worker's plans in flight, read the results that come; returns the outputs this
        step changed.

        `timeout` bounds the wait for a worker's result (None: wait for one); a serving loop
        passes a short timeout so that it can answer clients in between. With max_plans_in_flight
        = 2 a worker's next plan is built and sent before its last one's result is read, so the
        engine's work overlaps the worker's. Workers are filled again before the outputs are returned,
        except in a step that brings a request's first token (its TTFT would include those plans).
        """
        self._check_responsive()
        changed = self._collect(0.0) if self.executor.has_events else []  # e.g. a death seen meanwhile
        self._submit_idle_workers()
        if self.has_work_in_flight:
            changed += self._collect(timeout)
        # Submit before publishing: the next plans (and any slot releases) are on their way. Not when a
        # first token came: in-process, a DecodeBatch's submit runs its passes, and it would wait for them.
        if not any(self.outputs.holds_first_output(r) for r in changed):
            self._submit_idle_workers()
        unique = {request.key: request for request in changed}  # one output per request and step
        return [self.outputs.output(r) for r in unique.values()]

    def _collect(self, timeout: float | None) -> list[Request]:
        changed: list[Request] = []
        for worker, event in self.executor.collect(timeout=timeout):
            if isinstance(event, StepResult) and not event.early:  # an early result leaves its plan in flight
                self._in_flight[worker] -= 1
            changed.extend(self._apply(worker, event))
        return changed

    def _check_responsive(self) -> None:
        """A worker silent for half of worker_timeout gets no new requests until it is heard again."""
        late_after = self.config.worker_timeout / 2
        for worker, silent in self.executor.silence().items():
            self.scheduler.set_responsive(worker, silent <= late_after)

    def _submit_idle_workers(self) -> None:
        """Up to max_plans_in_flight plans per worker; each is built from what the engine knows now."""
        for worker in range(len(self.scheduler.books)):
            while self._in_flight[worker] < self.config.max_plans_in_flight and self.scheduler.has_work(worker):
                builder = self.scheduler.schedule(worker)
                if builder is None:
                    break
                plan = builder.build()
                for listener in self._plan_listeners:
                    listener(worker, plan)
                self.executor.submit(worker, plan)
                self._in_flight[worker] += 1

    def _apply(self, worker: int, result: StepResult | WorkerLost | WorkerReady) -> list[Request]:
        if isinstance(result, WorkerReady):
            return self._on_worker_ready(worker, result)
        if isinstance(result, WorkerLost):
            return self._on_worker_lost(worker, result)
        if result.error:
            log.error("worker %d failed step %d: %s", worker, result.step_id, result.error)
            return self.scheduler.step_failed(worker, result)
        changed = self.scheduler.update(worker, result)
        for request in changed:
            kept = self.outputs.decode(request)
            if kept is not None:  # a stop string matched in its new text
                self.scheduler.stop_at(request, kept)
        return changed

    def _on_worker_lost(self, worker: int, lost: WorkerLost) -> list[Request]:
        """Replay the dead worker's requests on the others; with restart_workers, begin a
        replacement, which starts while the step loop keeps serving the other workers."""
        if worker in self._restarting:
            self._restarting.discard(worker)
            self._failed_starts[worker] += 1
            log.error("the replacement of worker %d failed to start (%s)", worker, lost.reason)
        else:
            log.error("worker %d lost (%s); replaying its requests", worker, lost.reason)
        self._in_flight[worker] = 0  # its plans in flight will never return
        failed = self.scheduler.worker_lost(worker)
        if self.config.restart_workers and self._failed_starts[worker] < MAX_FAILED_STARTS:
            self.executor.begin_restart(worker)
            self._restarting.add(worker)
        elif not any(b.alive for b in self.scheduler.books) and not self._restarting:
            log.error("no worker left: every in-flight request ends with an error")
            self.is_dead = True
            failed += self.scheduler.fail_all("error")
        return failed

    def _on_worker_ready(self, worker: int, ready: WorkerReady) -> list[Request]:
        """A replacement is serving: the scheduler gets its (empty) KV pool back."""
        log.info("worker %d replaced (pid %d)", worker, ready.pid)
        self._restarting.discard(worker)
        self._failed_starts[worker] = 0
        self.num_worker_restarts += 1
        self.scheduler.worker_started(worker, KVManager(ready.num_blocks, self.config.block_size, ready.num_planes))
        return []

    def close(self) -> None:
        """Stop the workers; idempotent."""
        if not self._closed:
            self._closed = True
            self.executor.shutdown()

