"""Request lives at the engine's edges (SPEC §6, §7): an abort ends a life at once and for good,
and a failed step leaves the engine's books and the worker's slot table in step."""

from __future__ import annotations

import gc
import weakref

import msgspec
import pytest
from factories import make_llm, resources

from protocol.messages import SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")

LONG = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, seed=1)


def drain(engine, max_steps: int = 500) -> list:
    """Step until nothing is live or in flight; every output on the way."""
    outputs = []
    for _ in range(max_steps):
        if not engine.has_unfinished_requests() and not engine.has_work_in_flight:
            outputs += engine.step()  # the last releases
            return outputs
        outputs += engine.step()
    raise AssertionError("the engine did not drain")


def test_abort_returns_the_final_output_and_a_reused_id_sees_only_its_new_life():
    """The issue's reproduction: abort "x" mid-generation, add "x" again at once. abort_request
    answers with the old life's final output; every later step() output of "x" belongs to the new
    life, which equals a fresh engine's run; resources come back."""
    with make_llm("toy-ouro") as llm:
        engine = llm.engine
        before = resources(engine)
        engine.add_request("x", [5, 6, 7], LONG)
        delivered: list[int] = []
        while len(delivered) < 2:
            delivered = next((o.token_ids for o in engine.step() if o.request_id == "x"), delivered)
        final = engine.abort_request("x")
        assert final is not None and final.finished and final.finish_reason == "abort"
        assert final.token_ids == delivered and final.request_id == "x"
        assert engine.abort_request("x") is None  # no longer live
        new_params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, seed=2)
        engine.add_request("x", [1, 2], new_params)
        stream = [o for o in drain(engine) if o.request_id == "x"]
        assert all(o.finish_reason != "abort" for o in stream), stream
        assert [len(o.token_ids) for o in stream] == [1, 2, 3, 4], [o.token_ids for o in stream]
        assert stream[-1].finished and stream[-1].finish_reason == "length"
        assert resources(engine) == before
    with make_llm("toy-ouro") as fresh:
        want = fresh.generate([[1, 2]], new_params, use_tqdm=False)[0]
    assert (stream[-1].token_ids, stream[-1].exit_depths) == (want.token_ids, want.exit_depths)


def test_abort_of_a_waiting_request_returns_an_empty_final_output():
    with make_llm("toy-ouro") as llm:
        engine = llm.engine
        engine.add_request("w", [1], LONG)
        final = engine.abort_request("w")
        assert final is not None and final.token_ids == [] and final.finish_reason == "abort"
        assert drain(engine) == []


# --------------------------------------------------------------------------- a failed step


class FailAt:
    """A runner fault hook: raise at the first time the plan reaches `point`, once."""

    def __init__(self, point: str) -> None:
        self.point, self.fired = point, False

    def __call__(self, point: str) -> None:
        if point == self.point and not self.fired:
            self.fired = True
            raise RuntimeError(f"injected failure at {point}")


def books_agree(engine) -> None:
    """The engine's books name exactly the slots and host copies the worker's runner holds.

    In-process, a plan runs as it is submitted: the books are read as they stand after the plan in
    flight (if any) has applied its slot ops, which is what the runner has done."""
    book, runner = engine.scheduler.books[0], engine.executor._worker.runner
    unsent = set(book.to_admit) | set(book.swap.imports)
    expected = {(r.key, r.generation) for r in book.running if r not in unsent}
    expected |= set(book.to_release)
    expected |= {(r.key, g) for r, g, _ in book.swap.exports}
    assert set(runner._slot_of) == expected, (runner._slot_of, expected)
    exported = {key for key, copy in book.swap.copies.items() if copy.exported_at is not None}
    assert exported <= set(runner._swap._copies), (exported, runner._swap._copies)


@pytest.mark.parametrize("point", ["admit", "batch", "export", "release"])
def test_a_failed_step_keeps_engine_and_worker_in_step(point):
    """One plan carries a release (an aborted request), an admit (a new request), a swap export
    (a preempted one) and batches; the runner fails it at `point`. The request it admitted ends
    with an error; the release that did not run is sent again; the victim whose export did not run
    replays instead of importing a copy that does not exist. Afterwards the books and the slot
    table agree, the victim and a later request equal a fresh engine's outputs, nothing leaks."""
    params = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True, seed=4)
    low = msgspec.structs.replace(params, priority=1)  # the victim waits behind "admitted"
    options = dict(preemption="swap", max_num_seqs=4, scheduling_policy="priority")
    with make_llm("toy-ouro", **options) as llm:
        engine = llm.engine
        runner = engine.executor._worker.runner
        before = resources(engine)
        engine.add_request("victim", [3, 1, 4], low)
        engine.add_request("aborted", [1, 5], params)
        victim = engine.scheduler._live["victim"]
        while victim.num_outputs < 2:
            engine.step()
        # The next plan: release("aborted"), admit("admitted"), export("victim"), its prefill batch.
        assert engine.abort_request("aborted")
        engine.add_request("admitted", [9, 2, 6], params)
        engine.scheduler.preempt(victim)
        runner.fault_hook = hook = FailAt(point)
        outputs = engine.step()  # collects the plan in flight, sends the one that fails
        assert hook.fired and not any(o.finish_reason == "error" for o in outputs)
        outputs = engine.step()  # collects the failure
        failed = {o.request_id for o in outputs if o.finish_reason == "error"}
        assert failed == {"admitted"}, outputs
        books_agree(engine)
        engine.add_request("later", [2, 7, 1, 8], params)
        outputs += drain(engine)
        books_agree(engine)
        finals = {o.request_id: o for o in outputs if o.finished}
        assert finals["victim"].finish_reason == finals["later"].finish_reason == "length", finals
        assert resources(engine) == before
        assert not runner._swap._copies
    with make_llm("toy-ouro", **options) as fresh:
        want = fresh.generate([[3, 1, 4], [2, 7, 1, 8]], params, use_tqdm=False)
    for name, w in zip(["victim", "later"], want, strict=True):
        assert (finals[name].token_ids, finals[name].exit_depths) == (w.token_ids, w.exit_depths), name


def test_kv_pool_sizing_refuses_a_device_with_no_room() -> None:
    """Auto-sizing takes what is in use and the activation reserve out of the budget; a budget below
    one block is an error that says what to do (before: a silent 1-block pool that refused every request)."""
    from rlt_worker.worker import ACTIVATION_RESERVE_BYTES, KVPoolSizeError, kv_pool_blocks

    gib = 1024**3
    assert kv_pool_blocks(free=100 * gib, total=100 * gib, utilization=0.5, block_bytes=gib,
                          device="cuda:0") == 50 - ACTIVATION_RESERVE_BYTES // gib
    with pytest.raises(KVPoolSizeError, match="raise gpu_memory_utilization, or pass num_blocks"):
        kv_pool_blocks(free=15 * gib, total=140 * gib, utilization=0.9, block_bytes=3 * 2**20, device="cuda:0")


def test_closing_an_in_process_engine_frees_its_runner_without_waiting_for_the_collector() -> None:
    """The runner's parts refer to one another; close() must free them (and the KV pool) itself, or
    an engine made next in the same process finds the device still taken."""
    gc.disable()
    try:
        with make_llm("toy-ouro", exit_mode="ouro", max_num_seqs=2) as llm:
            llm.generate([[5, 6, 7]], LONG, use_tqdm=False)
            runner = llm.engine.executor._worker.runner
            freed = weakref.ref(runner), weakref.ref(runner.storage.pool)
            del runner
        assert [ref() is None for ref in freed] == [True, True]
    finally:
        gc.enable()


def test_closing_an_engine_drops_its_uncollected_results_before_the_worker_frees_memory() -> None:
    """A plan still in flight at close (two plans in flight) holds the worker's device tensors: close()
    drops it before the worker's gc and empty_cache, though the caller still holds the LLM. Measured
    on the H200 before: the benchmark's float32 gate engine of ouro left 23 GiB reserved, so the
    timed engine after it sized its KV pool to 95.7 GiB instead of 118 and preempted at c = 128."""
    from rlt_worker.step_results import PendingResult

    llm = make_llm("toy-ouro", exit_mode="ouro", max_num_seqs=2, max_plans_in_flight=2)
    try:
        llm.generate([[5, 6, 7]], LONG, use_tqdm=False)
        pending = llm.engine.executor._pending
        assert pending and all(isinstance(p, PendingResult) for p in pending)  # the case under test
        held = [weakref.ref(p) for p in pending]
        del pending
    finally:
        llm.close()
    gc.collect()
    assert [ref() is None for ref in held] == [True] * len(held)
    del llm
