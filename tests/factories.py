"""Factories and helpers of the engine tests: engines, workloads, a step-loop driver, plan
analysis, and the comparison against the dense reference (SPEC §4, §7a).

The engine tests all follow one shape:

    llm = make_llm("toy-ouro", kv_layout="shared", scheduling="no_refill", ...)
    run = run_workload(llm, make_workload(random.Random("name"), 8, depth=D, ...))
    assert_matches_reference(run, "toy-ouro", kv_layout="shared", exit_mode="fixed")
    run.assert_resources_returned()

Every request carries an explicit seed, so a workload is a pure function of its random source
and the dense reference of each request can be cached across engine configurations.
"""

from __future__ import annotations

import functools
import itertools
import math
import random
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import msgspec
import torch

from protocol.columns import F64, I32, I64, pack
from protocol.messages import (
    CodaBatch,
    DecodeBatch,
    ExecutionPlan,
    FinalizeBatch,
    RecurrentBatch,
    SamplingParams,
    Stage,
    StepResult,
)
from rlt_engine import LLM, GenerationOutput, LLMEngine
from rlt_engine.exit_policy import ExitPolicy, FixedExit
from rlt_engine.kv_manager import KVManager
from rlt_engine.request import Request
from rlt_engine.rng import RngRegistry
from rlt_engine.scheduler import Scheduler, SchedulerConfig
from rlt_worker.models.base import LoopedModel
from rlt_worker.models.loader import load_model
from rlt_worker.models.reference import ReferenceConfig, ReferenceResult, generate_reference

MODELS = ("toy-ouro", "toy-huginn")
DEPTH = {"toy-ouro": 4, "toy-huginn": 6}  # D of each toy model
MAX_MODEL_LEN = 512  # positions the toy models support
VOCAB = 256  # prompts use the byte range of the toy vocabulary

ENGINE_DEFAULTS: dict[str, object] = dict(
    workers=0,
    cpu_threads=1,  # worker processes: the suite's two test processes share two cores
    device="cpu",
    dtype="float64",
    state_init="random",
    kv_layout="last_exited",
    scheduling="refill",
    max_num_seqs=8,
    prefill_chunk_size=128,
    exit_mode="fixed",
)

SAMPLING: dict[str, dict[str, object]] = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=1.0),
    "top_k": dict(temperature=0.8, top_k=5),
    "top_p": dict(temperature=1.2, top_p=0.7),
}


def make_llm(model: str = "toy-ouro", **overrides: object) -> LLM:
    """An in-process float64 CPU engine (the configuration of exact-equality tests)."""
    return LLM(model, **{**ENGINE_DEFAULTS, **overrides})


# --------------------------------------------------------------------------------- workloads


@dataclass(frozen=True)
class Job:
    """One request life of a workload: added before step `arrival` (once its id is free),
    aborted `abort_after` steps after it was added (None: runs to the end)."""

    request_id: str
    prompt: tuple[int, ...]
    params: SamplingParams
    arrival: int = 0
    abort_after: int | None = None

    def describe(self) -> str:
        return f"{self.request_id} (prompt {len(self.prompt)} tokens, {msgspec.json.encode(self.params).decode()})"


def make_params(
    rng: random.Random,
    *,
    depth: int,
    exit_mode: str = "fixed",
    sampling: str = "greedy",
    max_tokens: int = 8,
    threshold: float | None = None,
    **extra: object,
) -> SamplingParams:
    """Seeded SamplingParams of one request: a `trace` gets random depths, gates get `threshold`."""
    kwargs: dict[str, object] = dict(
        max_tokens=max_tokens, seed=rng.randrange(2**64), ignore_eos=rng.random() < 0.7, **SAMPLING[sampling]
    )
    if exit_mode == "trace":
        kwargs["exit_depths"] = [depth] + [rng.randint(1, depth) for _ in range(max_tokens - 1)]
    elif exit_mode != "fixed":
        kwargs["exit_threshold"] = threshold
    kwargs.update(extra)
    return SamplingParams(**kwargs)


def make_prompt(rng: random.Random, length: int) -> tuple[int, ...]:
    return tuple(rng.randrange(VOCAB) for _ in range(length))


def make_workload(
    rng: random.Random,
    n: int,
    *,
    depth: int,
    exit_mode: str = "fixed",
    sampling: Sequence[str] = ("greedy",),
    threshold: float | None = None,
    max_prompt_len: int = 32,
    max_tokens: int = 8,
    spread: int = 2,
    vary_limits: bool = False,
    prefix: str = "req",
) -> list[Job]:
    """`n` requests in arrival order: prompts of 1 … max_prompt_len tokens (both extremes
    present), 1 … max_tokens outputs, sampling kinds in turn, two arrivals at step 0 and the
    rest staggered over about `spread * n` steps; every 5th request stops on half of the byte
    values. `vary_limits` gives every 4th request max_loops D − 1 and every 4th (offset)
    min_loops D − 1 (adaptive modes)."""
    lengths = [max_prompt_len, 1] + [rng.randint(1, max_prompt_len) for _ in range(n - 2)]
    jobs = []
    for i, length in enumerate(lengths[:n]):
        extra: dict[str, object] = {}
        if vary_limits and exit_mode != "trace" and depth > 2:
            if i % 4 == 2:
                extra["max_loops"] = depth - 1
            elif i % 4 == 3 and exit_mode != "fixed":
                extra["min_loops"] = depth - 1
        if i % 5 == 4:
            extra["stop_token_ids"] = sorted(rng.sample(range(VOCAB), VOCAB // 2))
        params = make_params(
            rng,
            depth=depth,
            exit_mode=exit_mode,
            sampling=sampling[i % len(sampling)],
            max_tokens=max_tokens if i % 5 in (0, 4) else rng.randint(1, max_tokens),
            threshold=threshold,
            **extra,
        )
        arrival = 0 if i < 2 else rng.randint(0, spread * n)
        jobs.append(Job(f"{prefix}{i}", make_prompt(rng, length), params, arrival))
    return sorted(jobs, key=lambda job: job.arrival)


# --------------------------------------------------------------------------------- driver


@dataclass(frozen=True)
class Resources:
    free_kv_blocks: int
    free_slots: int
    registry_seeds: int
    text_states: int  # lives the output processor still tracks


def resources(engine: LLMEngine) -> Resources:
    """The pooled resources a finished workload must give back."""
    return Resources(
        free_kv_blocks=sum(kv.num_free_blocks for kv in engine.kv_managers),
        free_slots=engine.executor._worker.runner.num_free_slots,
        registry_seeds=len(engine.rng),
        text_states=len(engine.outputs),
    )


@dataclass
class Life:
    """What the stream of step() outputs delivered for one added Job."""

    job: Job
    key: int  # the engine's internal key of this life (rows of plans carry it)
    added_at: int
    outputs: list[GenerationOutput] = field(default_factory=list)
    abort_requested: bool = False
    aborted_at: int | None = None  # the step count when abort_request accepted it

    @property
    def closed(self) -> bool:
        return bool(self.outputs) and self.outputs[-1].finished

    @property
    def final(self) -> GenerationOutput:
        assert self.closed, f"{self.job.request_id} never finished"
        return self.outputs[-1]

    @property
    def aborted(self) -> bool:
        return self.final.finish_reason == "abort"


def find_request(engine: LLMEngine, request_id: str) -> Request | None:
    """The live Request object with this id (waiting or running), if any."""
    scheduler = engine.scheduler
    for request in itertools.chain(scheduler.waiting, *scheduler.running):
        if request.request_id == request_id:
            return request
    return None


class Driver:
    """Feeds an engine through `add_request` / `step()` / `abort_request` and records every
    plan and every output, attributing each output to the life (Job) it belongs to.

    An output for an id goes to the oldest life of that id that has not delivered its finished
    output yet; an abort closes its life with abort_request's answer. So if an old life delivered
    anything after its end, a life's stream check fails."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.engine = llm.engine
        self.initial = resources(self.engine)
        self.plans: list[ExecutionPlan] = []
        self.passes: list[LoopPass] = []  # every loop pass the worker ran, planned or decided there
        self.stream: list[GenerationOutput] = []
        self.lives: list[Life] = []
        self.steps = 0
        self._open: dict[str, deque[Life]] = defaultdict(deque)
        self.engine.add_plan_listener(lambda worker, plan: self.plans.append(plan))
        runner = self.engine.executor._worker.runner
        runner.pass_listener = lambda slots, positions, depths: self.passes.append(LoopPass(
            self.plans[-1].step_id,
            tuple((*runner.identity(s), p, d) for s, p, d in zip(slots.tolist(), positions.tolist(), depths.tolist(),
                                                                  strict=True)),
        ))

    # -------------------------------------------------------------- actions

    def add(self, job: Job) -> Life:
        self.engine.add_request(job.request_id, list(job.prompt), job.params)
        request = find_request(self.engine, job.request_id)
        assert request is not None, f"{job.request_id} is not live right after add_request"
        life = Life(job, request.key, self.steps)
        self.lives.append(life)
        self._open[job.request_id].append(life)
        return life

    def abort(self, request_id: str) -> GenerationOutput | None:
        """Abort the id's open life; its final output (abort_request's answer) closes the life at once,
        so any later step() output of that life would land on the next life and fail its stream check."""
        final = self.engine.abort_request(request_id)
        if final is not None:
            life = self._open[request_id].popleft()
            life.abort_requested, life.aborted_at = True, self.steps
            assert final.finished and final.finish_reason == "abort", final
            life.outputs.append(final)
        return final

    def step(self) -> list[GenerationOutput]:
        outputs = self.engine.step()
        self.steps += 1
        for output in outputs:
            lives = self._open.get(output.request_id)
            assert lives, f"step {self.steps}: output for {output.request_id!r}, which has no open life: {output}"
            lives[0].outputs.append(output)
            if output.finished:
                lives.popleft()
        self.stream.extend(outputs)
        return outputs

    def step_until(self, condition: Callable[[], bool], max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if condition():
                return
            self.step()
        raise AssertionError(f"condition not reached within {max_steps} steps")

    @property
    def all_closed(self) -> bool:
        return not any(self._open.values())

    def run(
        self,
        jobs: Iterable[Job],
        before_step: Callable[[int, Driver], None] | None = None,
        max_steps: int = 50_000,
    ) -> Driver:
        """Add each job at its arrival step once its id is free (ids of one workload may be
        reused), abort the ones that ask for it, step until every life has ended, drain."""
        pending = list(jobs)
        for _ in range(max_steps):
            for life in self.lives:  # aborts first: a reused id may be added at once
                if (
                    life.job.abort_after is not None
                    and self.steps >= life.added_at + life.job.abort_after
                    and not life.closed
                    and not life.abort_requested
                ):
                    self.abort(life.job.request_id)
            pending = self._add_arrivals(pending)
            if before_step is not None:
                before_step(self.steps, self)
            if not pending and self.all_closed and not self.engine.has_unfinished_requests():
                return self.finish()
            self.step()
        raise AssertionError(f"workload not finished after {max_steps} steps")

    def _add_arrivals(self, pending: list[Job]) -> list[Job]:
        left, blocked = [], set()
        for job in pending:
            rid = job.request_id
            if job.arrival <= self.steps and rid not in blocked and not self.engine.scheduler.is_live(rid):
                self.add(job)
            else:
                blocked.add(rid)  # a later life of this id waits for this one
                left.append(job)
        return left

    def finish(self) -> Driver:
        """Step until every life has ended, then once more to collect what is in flight (slot
        releases); nothing may be delivered then. Checks every life's stream."""
        self.step_until(lambda: self.all_closed and not self.engine.has_unfinished_requests())
        assert self.step() == [], "outputs delivered after every request had finished"
        while self.engine.has_work_in_flight:  # pipelined: plans built before the last finish was read
            assert self.step() == [], "outputs delivered after every request had finished"
        for life in self.lives:
            assert_stream_consistent(life)
        return self

    def assert_resources_returned(self) -> None:
        assert resources(self.engine) == self.initial, (
            f"after the workload: {resources(self.engine)}, before: {self.initial}"
        )

    # -------------------------------------------------------------- lookups

    def life(self, request_id: str) -> Life:
        """The only life of a request id (workloads without reuse)."""
        (life,) = [life for life in self.lives if life.job.request_id == request_id]
        return life


def run_workload(llm: LLM, jobs: Iterable[Job], **kwargs: object) -> Driver:
    return Driver(llm).run(jobs, **kwargs)


def assert_stream_consistent(life: Life) -> None:
    """A life's outputs grow by at least one token each (several when a plan sampled several), from
    an empty list, and only the last one is finished; an abort or error output repeats the tokens
    delivered so far."""
    name = life.job.request_id
    assert life.closed, f"{name}: no finished output was delivered"
    assert not any(o.finished for o in life.outputs[:-1]), f"{name}: outputs after a finished one"
    previous: list[int] = []
    for output in life.outputs:
        tokens = output.token_ids
        if output.finish_reason in ("abort", "error"):
            assert tokens == previous, f"{name}: {output.finish_reason} output {tokens} differs from {previous}"
            continue
        assert len(tokens) > len(previous) and tokens[: len(previous)] == previous, (
            f"{name}: stream went from {previous} to {tokens}"
        )
        assert len(output.exit_depths) == len(tokens), f"{name}: {len(tokens)} tokens, exit depths {output.exit_depths}"
        previous = tokens


# --------------------------------------------------------------------------------- reference


@functools.cache
def reference_model(name: str) -> LoopedModel:
    return load_model(name, dtype=torch.float64, device="cpu")


def reference_config(name: str, kv_layout: str, exit_mode: str, state_init: str = "random") -> ReferenceConfig:
    info = reference_model(name).info
    return ReferenceConfig(
        max_depth=info.default_depth,
        kv_layout=kv_layout,
        exit_mode=exit_mode,
        state_init=state_init,
        eos_token_ids=tuple(info.eos_token_ids),
    )


_REFERENCES: dict[tuple, ReferenceResult] = {}


def reference(
    name: str, job: Job, *, kv_layout: str, exit_mode: str, state_init: str = "random"
) -> ReferenceResult:
    """The dense reference of one request (cached: workloads repeat across configurations)."""
    assert job.params.seed is not None, "workload requests carry explicit seeds"
    cache_key = (name, kv_layout, exit_mode, state_init, job.prompt, msgspec.json.encode(job.params))
    if cache_key not in _REFERENCES:
        config = reference_config(name, kv_layout, exit_mode, state_init)
        _REFERENCES[cache_key] = generate_reference(
            reference_model(name), list(job.prompt), job.params, job.params.seed, config
        )
    return _REFERENCES[cache_key]


def assert_matches_reference(
    driver: Driver, name: str, *, kv_layout: str, exit_mode: str, state_init: str = "random"
) -> None:
    """Every life that was not aborted delivered exactly the dense reference's tokens, exit
    depths, finish reason, seed and (to float64 rounding) logprobs; and the plans ran every
    generated position through exactly loops 1 … its exit depth, each once (see loops_problem)."""
    problems = []
    loops = loops_per_position(driver.passes)
    completed = [life for life in driver.lives if not life.aborted]
    for life in completed:
        job, out = life.job, life.final
        assert not life.abort_requested, f"{job.request_id}: abort accepted, but it finished {out.finish_reason!r}"
        ref = reference(name, job, kv_layout=kv_layout, exit_mode=exit_mode, state_init=state_init)
        got = (out.token_ids, out.exit_depths, out.finish_reason)
        want = (ref.token_ids, ref.exit_depths, ref.finish_reason)
        if got != want:
            problems.append(f"{job.describe()}\n    engine    {got}\n    reference {want}")
            continue
        if out.seed != job.params.seed:
            problems.append(f"{job.describe()}: seed reported {out.seed}")
        pairs = zip(out.logprobs, ref.logprobs, strict=True)
        if not all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9) for a, b in pairs):
            problems.append(f"{job.describe()}: logprobs {out.logprobs} vs reference {ref.logprobs}")
        first = len(job.prompt) - 1
        for i, depth in enumerate(out.exit_depths[1:], start=1):
            if problem := loops_problem(loops.get((life.key, first + i), []), depth):
                problems.append(f"{job.describe()}: position of output {i} {problem}")
    assert not problems, (
        f"{len(problems)} of {len(completed)} requests differ from the dense reference "
        f"({name}, {kv_layout}, {exit_mode}):\n" + "\n".join(problems)
    )


# --------------------------------------------------------------------------------- plans


@dataclass(frozen=True)
class LoopRow:
    """One row of a RecurrentBatch: loops first_depth … last_depth of (key, position)."""

    key: int
    generation: int
    position: int
    first_depth: int
    num_loops: int

    @property
    def last_depth(self) -> int:
        return self.first_depth + self.num_loops - 1


def _rows(plan: ExecutionPlan, kind: type, columns: tuple[str, ...]) -> list[tuple]:
    """The named columns of every `kind` batch of the plan, row by row."""
    return [row for batch in plan.batches if isinstance(batch, kind)
            for row in zip(*(batch.col(c).tolist() for c in columns), strict=True)]


def loop_rows(plan: ExecutionPlan) -> list[LoopRow]:
    columns = ("keys", "generations", "positions", "first_depths", "num_loops")
    return [LoopRow(*row) for row in _rows(plan, RecurrentBatch, columns)]


def coda_rows(plan: ExecutionPlan) -> list[tuple[int, int, int]]:
    """(key, position, sample index) of every CODA row."""
    return _rows(plan, CodaBatch, ("keys", "positions", "sample_indices"))


def decode_rows(plan: ExecutionPlan) -> list[tuple[int, int, int, int, int]]:
    """(key, position, depth, exited, output index) of every DecodeBatch row."""
    return _rows(plan, DecodeBatch, ("keys", "positions", "depths", "exited", "output_indices"))


def record_sampling(llm: LLM) -> list[set[int]]:
    """The request keys of every sampling call of the in-process runner from now on (CodaBatch rows
    and the decode loop's exits alike)."""
    runner = llm.engine.executor._worker.runner
    calls: list[set[int]] = []
    real = runner.sample_rows

    def sample_rows(row_slots, *args):  # noqa: ANN001, ANN202 (the runner's signature)
        calls.append({runner.identity(slot)[0] for slot in row_slots.tolist()})
        return real(row_slots, *args)

    runner.sample_rows = sample_rows  # an instance attribute shadows the method
    return calls


def finalize_rows(plan: ExecutionPlan) -> list[tuple[int, int, int]]:
    """(key, position, exit depth) of every FINALIZE row."""
    return _rows(plan, FinalizeBatch, ("keys", "positions", "exit_depths"))


@dataclass(frozen=True)
class LoopPass:
    """One loop pass the worker ran (ModelRunner.pass_listener): (key, generation, position, depth)
    of each row, in the plan of `step_id`."""

    step_id: int
    rows: tuple[tuple[int, int, int, int], ...]


def loops_per_position(passes: Iterable[LoopPass]) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """(key, position) → (slot generation, loop depth) of every loop run there, in order."""
    loops: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for loop_pass in passes:
        for key, generation, position, depth in loop_pass.rows:
            loops[(key, position)].append((generation, depth))
    return loops


def loops_problem(ran: list[tuple[int, int]], exit_depth: int) -> str | None:
    """Why the loops run at a position do not fit its exit depth, or None. In one slot
    generation they must be exactly 1 … exit depth, each once (no loop thrown away, none
    repeated). A position whose slot changed generation (preemption: a swap resumes it
    mid-position, a recompute replays it) must still never run past its exit depth, and end on it."""
    depths = [d for _, d in ran]
    if len({g for g, _ in ran}) <= 1:
        return None if depths == list(range(1, exit_depth + 1)) else f"ran loops {depths}, exit depth {exit_depth}"
    if max(depths) != exit_depth or depths[-1] != exit_depth:
        return f"ran (generation, loop) {ran}, exit depth {exit_depth}"
    return None


def early_exit_batches(passes: Sequence[LoopPass], depth: int) -> list[int]:
    """Step ids of plans with a loop pass that runs the last loop of some position at a depth
    below D (an early exit) alongside a row of another request."""
    last = {position: max(d for _, d in ran) for position, ran in loops_per_position(passes).items()}
    steps = []
    for loop_pass in passes:
        exiting = {key for key, _, position, d in loop_pass.rows if d == last[(key, position)] < depth}
        if exiting and len({key for key, *_ in loop_pass.rows}) >= 2:
            steps.append(loop_pass.step_id)
    return steps


def in_plan_refills(passes: Sequence[LoopPass]) -> list[tuple[int, int]]:
    """(step id, key) of every refill inside a plan: a pass runs a request's position t + 1 at loop 1
    right after the previous pass of the same plan ran its position t (which exited there)."""
    events = []
    for before, after in itertools.pairwise(passes):
        if before.step_id != after.step_id:
            continue
        ran = {(key, position) for key, _, position, _ in before.rows}
        events += [(after.step_id, key) for key, _, position, d in after.rows if d == 1 and (key, position - 1) in ran]
    return events


def depth_mix(plans: Iterable[ExecutionPlan]) -> list[set[int]]:
    """For each plan with a RecurrentBatch, the set of first depths of its rows."""
    return [{row.first_depth for row in rows} for plan in plans if (rows := loop_rows(plan))]


def compositions(plans: Iterable[ExecutionPlan]) -> list[tuple[tuple[int, int, int], ...]]:
    """Each RecurrentBatch as the sorted (key, position, first depth) of its rows."""
    return [
        tuple(sorted((r.key, r.position, r.first_depth) for r in rows)) for plan in plans if (rows := loop_rows(plan))
    ]


@dataclass(frozen=True)
class Refill:
    step_id: int
    exited: frozenset[int]  # keys whose position exited after its loop in the previous plan
    started: frozenset[int]  # keys with a row at loop 1 in this plan
    continuing: frozenset[int]  # keys mid-loop in both plans


def refills(plans: Sequence[ExecutionPlan]) -> list[Refill]:
    """Refill events, read from consecutive plans p, q of one (synchronous) worker.

    A position of key A *exited* at p if p ran A's loop at position t and q runs A's CODA at t.
    q *refills* if, besides such an exit, q's RecurrentBatch holds a row starting at loop 1
    (A's next position, or another request's first generated position) together with a row of
    a key B that is mid-loop: B ran loops … d at position t' in p and runs loop d + 1 at t' in
    q. The freed row was taken by new work while B's loop batch kept going, instead of waiting
    for B to exit (which is what no_refill does)."""
    events = []
    for p, q in itertools.pairwise(plans):
        p_rows = {(r.key, r.position): r for r in loop_rows(p)}
        q_rows = loop_rows(q)
        coda_at = {(key, position) for key, position, _ in coda_rows(q)}
        exited = frozenset(key for key, position in p_rows if (key, position) in coda_at)
        started = frozenset(r.key for r in q_rows if r.first_depth == 1)
        continuing = frozenset(
            r.key
            for r in q_rows
            if (prev := p_rows.get((r.key, r.position))) is not None and r.first_depth == prev.last_depth + 1
        )
        if exited and started and continuing - started:
            events.append(Refill(q.step_id, exited, started, continuing))
    return events


# --------------------------------------------------------------------------------- all-pairs


def all_pairs(factors: dict[str, Sequence[object]]) -> list[dict[str, object]]:
    """A deterministic greedy pairwise cover: every pair of values of every two factors
    appears in at least one row. Each row starts from the first uncovered pair, then fixes the
    remaining factors one by one, choosing the value that covers most new pairs (ties: first)."""
    names = list(factors)
    sizes = [len(factors[n]) for n in names]

    def pairs_of(row: dict[int, int]) -> set[tuple[tuple[int, int], tuple[int, int]]]:
        fixed = sorted(row.items())
        return {(a, b) for a, b in itertools.combinations(fixed, 2)}

    uncovered = {
        ((i, a), (j, b))
        for i, j in itertools.combinations(range(len(names)), 2)
        for a in range(sizes[i])
        for b in range(sizes[j])
    }
    rows = []
    while uncovered:
        (i, a), (j, b) = min(uncovered)
        row = {i: a, j: b}
        for k in range(len(names)):
            if k not in row:
                row[k] = max(
                    range(sizes[k]), key=lambda v: (len(pairs_of({**row, k: v}) & uncovered), -v)
                )
        uncovered -= pairs_of(row)
        rows.append({names[k]: factors[names[k]][v] for k, v in sorted(row.items())})
    return rows


# --------------------------------------------------------------------------------- scheduler units


def make_scheduler(
    *, num_workers: int = 1, num_blocks: int = 64, block_size: int = 4, num_planes: int = 4,
    policy: ExitPolicy | None = None, **overrides: object
) -> Scheduler:
    """A Scheduler with toy-ouro's depth (D = 4, LAST_EXITED planes) and the fixed exit policy (or
    `policy`), driven without any worker: tests feed it hand-built StepResults (see `result_for`)."""
    options: dict[str, object] = dict(
        max_depth=DEPTH["toy-ouro"], kv_layout="last_exited", refill=True, max_num_seqs=4,
        max_num_batched_tokens=64, prefill_chunk_size=8, eos_token_ids=frozenset({257}), coda_has_kv=False,
        on_demand_kv=True,
    )
    config = SchedulerConfig(**{**options, **overrides})
    kv = [KVManager(num_blocks, block_size, num_planes) for _ in range(num_workers)]
    return Scheduler(config, policy or FixedExit(), kv, RngRegistry())


def add_requests(scheduler: Scheduler, n: int, *, prompt_len: int = 3, prefix: str = "r",
                 **params: object) -> list[Request]:
    """`n` requests (seeded, ignore_eos) queued in order."""
    fields: dict[str, object] = {"max_tokens": 4, "seed": 1, "ignore_eos": True, **params}
    return [scheduler.add(f"{prefix}{i}", list(range(1, prompt_len + 1)), SamplingParams(**fields))[0]
            for i in range(n)]


def result_for(plan: ExecutionPlan, token: int = 7, error: str = "", applied: object = None) -> StepResult:
    """The StepResult a worker would send for `plan`: each sampling CODA row with `token` (planned
    loops report nothing), each DecodeBatch row one DECODE token (`token`, its position exiting at its
    depth, at least 1), then at depth 0 of its next position (dropped as stale when the token ended
    the request). With `error`, no rows: the plan failed (`applied` says how far)."""
    if error:
        return StepResult(step_id=plan.step_id, error=error, applied=applied)
    keys, generations, stages, depths, tokens = [], [], [], [], []
    for key, gen, index, exit_depth in _rows(plan, CodaBatch, ("keys", "generations", "sample_indices",
                                                                "exit_depths")):
        if index >= 0:
            keys.append(key), generations.append(gen), stages.append(Stage.CODA), depths.append(exit_depth)
            tokens.append(token)
    exit_states = [math.nan] * len(keys)
    for key, gen, depth in _rows(plan, DecodeBatch, ("keys", "generations", "depths")):
        keys += [key, key]
        generations += [gen, gen]
        stages += [Stage.DECODE, Stage.RECURRENT]
        depths += [max(depth, 1), 0]
        tokens += [token, -1]
        exit_states += [math.nan, 1.0]
    n = len(keys)
    return StepResult(
        step_id=plan.step_id, keys=pack(keys, I64), generations=pack(generations, I64), stages=pack(stages, I32),
        depths=pack(depths, I32), exit_states=pack(exit_states, F64), tokens=pack(tokens, I32),
        logprobs=pack([0.0] * n, F64),
    )


def run_step(scheduler: Scheduler, worker: int = 0, **result: object) -> ExecutionPlan | None:
    """schedule → build → (hand-built) result → update; returns the plan (None: nothing to do)."""
    builder = scheduler.schedule(worker)
    if builder is None:
        return None
    plan = builder.build()
    outcome = result_for(plan, **result)
    if outcome.error:
        scheduler.step_failed(worker, outcome)
    else:
        scheduler.update(worker, outcome)
    return plan
