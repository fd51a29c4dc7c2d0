"""The host's work in the worker's decode loop (rlt_worker/decode_loop.py), counted on the CPU.

Structure, never time: every host→device copy goes through the runner's `upload` / `upload_into`
and every readback of the decode loop through its `read_back`, so wrapping those three counts them.
Per loop pass one upload (into the graph's static inputs when a graph runs it) and one readback
(its exits, with the tokens the boundaries before it sampled); per boundary no readback and at most
three uploads (FINALIZE, CODA, PRELUDE; Huginn's random state init adds its seeds); per plan besides
at most two (the rows' exit-test columns, the exit states of the rows it reports). The outputs stay
the dense reference's.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest
import torch
from factories import DEPTH, assert_matches_reference, make_llm, make_workload, run_workload
from torch.utils._python_dispatch import TorchDispatchMode

from rlt_worker import cuda_graphs
from rlt_worker.decode_loop import DecodeLoop
from rlt_worker.model_runner import ModelRunner

pytestmark = pytest.mark.usefixtures("single_thread")


@dataclass
class Phase:
    """The copies one call of a decode loop phase made."""

    uploads: int = 0
    readbacks: int = 0


@dataclass
class HostWork:
    """Copies per phase of every DecodeBatch run: each pass, each boundary, and the rest of each plan
    (a copy counts in the innermost phase it happens in)."""

    passes: list[Phase] = field(default_factory=list)
    boundaries: list[Phase] = field(default_factory=list)
    plans: list[Phase] = field(default_factory=list)
    current: Phase | None = None  # where copies are counted now (None: outside decode loops)

    def counted(self, phases: list[Phase], method: Callable) -> Callable:
        """`method` of DecodeLoop, its copies counted into a new entry of `phases`."""
        def wrapper(loop: DecodeLoop, *args: object) -> object:
            outer, self.current = self.current, Phase()
            phases.append(self.current)
            try:
                return method(loop, *args)
            finally:
                self.current = outer
        return wrapper

    def counting(self, kind: str, method: Callable) -> Callable:
        def wrapper(*args: object) -> object:
            if self.current is not None:
                setattr(self.current, kind, getattr(self.current, kind) + 1)
            return method(*args)
        return wrapper


@contextmanager
def count_host_work(runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> Iterator[HostWork]:
    """Count the copies of every DecodeBatch the runner runs while the context is open."""
    work = HostWork()
    for name, kind in (("upload", "uploads"), ("upload_into", "uploads"), ("read_back", "readbacks")):
        monkeypatch.setattr(runner, name, work.counting(kind, getattr(runner, name)))
    # A boundary inside a boundary does not happen; _next_position's PRELUDE counts as its boundary's.
    monkeypatch.setattr(DecodeLoop, "run", work.counted(work.plans, DecodeLoop.run))
    monkeypatch.setattr(DecodeLoop, "_pass", work.counted(work.passes, DecodeLoop._pass))
    monkeypatch.setattr(DecodeLoop, "_boundary", work.counted(work.boundaries, DecodeLoop._boundary))
    yield work


CASES = [("toy-ouro", "ouro", "last_exited", True), ("toy-ouro", "ouro", "last_exited", False),
         ("toy-ouro", "ouro_delayed", "shared", True), ("toy-huginn", "latent_diff", "last_exited", False)]


@pytest.mark.parametrize("model,mode,kv_layout,graphs", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_one_upload_and_one_readback_per_pass(model: str, mode: str, kv_layout: str, graphs: bool,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Plans of 4·D passes, with (emulated) pass and CODA graphs or eagerly: every pass uploads once
    and reads back once, every boundary reads nothing back and uploads at most three times (two in
    the shared layout: no FINALIZE; one more for Huginn's random state init), and each plan adds at
    most two uploads."""
    depth = DEPTH[model]
    jobs = make_workload(random.Random(f"host-work-{mode}"), 6, depth=depth, exit_mode=mode, threshold=0.4,
                         sampling=("greedy", "top_p"), max_prompt_len=8, max_tokens=9, vary_limits=True, spread=1)
    with make_llm(model, exit_mode=mode, kv_layout=kv_layout, loops_per_plan=4 * depth, max_num_seqs=4) as llm:
        runner = llm.engine.executor._worker.runner
        if graphs:
            runner.use_pass_graphs(emulate=True)
        with count_host_work(runner, monkeypatch) as work:
            run = run_workload(llm, jobs)
        assert_matches_reference(run, model, kv_layout=kv_layout, exit_mode=mode)
    # CODA and PRELUDE, FINALIZE in the last_exited layout, Huginn's random state init its seeds
    assert_host_work(work, most_boundary_uploads=2 + (kv_layout == "last_exited") + (model == "toy-huginn"))


def assert_host_work(work: HostWork, most_boundary_uploads: int) -> None:
    assert len(work.passes) > len(work.plans) > 0
    assert all((p.uploads, p.readbacks) == (1, 1) for p in work.passes)
    assert all(b.readbacks == 0 and b.uploads <= most_boundary_uploads for b in work.boundaries)
    assert sum(1 for b in work.boundaries if b.uploads) >= len(work.plans)  # boundaries that sampled
    assert all(p.uploads <= 2 and not p.readbacks for p in work.plans)  # outside its passes and boundaries


@pytest.mark.parametrize(("mode", "kv_layout"), [("trace", "last_exited"), ("fixed", "shared")])
def test_planned_exits_read_nothing_back(mode: str, kv_layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """fixed / trace with 4·D passes per plan (ExitTest.PLANNED): the passes and boundaries upload as
    the device tests' do but read nothing back, so a plan's work queues without a sync; requests that
    stop on a token mid-plan (their later rows dropped as stale) still give the reference's outputs."""
    depth = DEPTH["toy-ouro"]
    jobs = make_workload(random.Random(f"host-work-{mode}"), 6, depth=depth, exit_mode=mode,
                         sampling=("greedy", "top_p"), max_prompt_len=8, max_tokens=9, spread=1)
    with make_llm("toy-ouro", exit_mode=mode, kv_layout=kv_layout, loops_per_plan=4 * depth, max_num_seqs=4) as llm:
        runner = llm.engine.executor._worker.runner
        runner.use_pass_graphs(emulate=True)
        with count_host_work(runner, monkeypatch) as work:
            run = run_workload(llm, jobs)
        assert_matches_reference(run, "toy-ouro", kv_layout=kv_layout, exit_mode=mode)
        run.assert_resources_returned()
        stopped_mid_plan = llm.engine.scheduler.stats.num_stale_rows
    assert len(work.passes) > len(work.plans) > 0
    assert all((p.uploads, p.readbacks) == (1, 0) for p in work.passes)
    assert all(b.readbacks == 0 and b.uploads <= 2 + (kv_layout == "last_exited") for b in work.boundaries)
    assert any(b.uploads for b in work.boundaries)
    assert all(p.uploads <= 2 and not p.readbacks for p in work.plans)
    assert stopped_mid_plan > 0  # a stop token's later outputs were sampled and dropped


def run_on_cuda_graphs(exit_mode: str, jobs: list, monkeypatch: pytest.MonkeyPatch) -> tuple[object, dict | None]:
    """The jobs on toy-ouro in float32 on CUDA (Triton, captured pass and CODA graphs, 4·D passes per
    plan, a fixed-size KV pool: an auto-sized one finds the memory of the file's earlier engines in
    use); the host work counted and the runner's graph counters."""
    with make_llm("toy-ouro", exit_mode=exit_mode, device="cuda", dtype="float32", attention_backend="triton",
                  num_blocks=256, cuda_graphs=True, loops_per_plan=4 * DEPTH["toy-ouro"], max_num_seqs=4,
                  device_refill=False) as llm:  # the host loop's counts (device refill: one readback a plan)
        runner = llm.engine.executor._worker.runner
        with count_host_work(runner, monkeypatch) as work:
            run_workload(llm, jobs)
        return work, runner.graph_stats


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_same_counts_on_cuda_with_captured_graphs(compiled: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """toy-ouro in float32 on CUDA (Triton, captured pass and CODA graphs, 4·D passes per plan, pinned
    asynchronous copies): the CPU's counts; every pass a graph replay. (Its tokens against the eager
    run: tests/test_gpu.py::test_toy_graphs_and_multi_loop_match_eager.)"""
    depth = DEPTH["toy-ouro"]
    jobs = make_workload(random.Random("host-work-cuda"), 6, depth=depth, exit_mode="ouro", threshold=0.4,
                         sampling=("greedy", "top_p"), max_prompt_len=8, max_tokens=9, spread=1)
    work, stats = run_on_cuda_graphs("ouro", jobs, monkeypatch)
    assert stats is not None and stats["replays"] == len(work.passes) and stats["eager_passes"] == 0
    assert_host_work(work, most_boundary_uploads=3)


def raising_at_syncs(method: Callable) -> Callable:
    """`method` under torch's sync debug mode "error": any synchronising CUDA call inside it raises."""
    def wrapped(self: object, *args: object) -> object:
        torch.cuda.set_sync_debug_mode("error")
        try:
            return method(self, *args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return wrapped


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_planned_plans_queue_without_a_sync_on_cuda(compiled: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """trace with 4·D passes per plan (ExitTest.PLANNED) on CUDA, captured pass and CODA graphs: no
    DecodeBatch waits for the device (torch's sync debug mode raises at any synchronising call inside
    DecodeLoop.run), none reads back, every pass is a graph replay (mixed passes a mixed graph's)."""
    depth = DEPTH["toy-ouro"]
    jobs = make_workload(random.Random("planned-cuda"), 6, depth=depth, exit_mode="trace",
                         sampling=("greedy", "top_p"), max_prompt_len=8, max_tokens=9, spread=1)
    monkeypatch.setattr(DecodeLoop, "run", raising_at_syncs(DecodeLoop.run))  # count_host_work wraps this one
    work, stats = run_on_cuda_graphs("trace", jobs, monkeypatch)
    # trace mixes prompt chunks into passes by default with graphs: those replay mixed graphs
    replayed = stats["replays"] + stats["mixed_replays"] if stats is not None else 0
    assert replayed == len(work.passes) > len(work.plans) and stats["eager_passes"] == stats["mixed_eager"] == 0
    assert not any(p.readbacks for p in work.passes + work.boundaries + work.plans)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_slot_ops_queue_without_a_sync_on_cuda(compiled: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan's slot ops (admits with their sampling options, block appends, releases) never wait for
    the device: a sync there drains the plans in flight at every arrival (torch's sync debug mode
    raises at any synchronising call). Admits with greedy, top-k and top-p options and stop tokens."""
    depth = DEPTH["toy-ouro"]
    jobs = make_workload(random.Random("slot-ops-cuda"), 6, depth=depth, exit_mode="trace",
                         sampling=("greedy", "top_p", "top_k"), max_prompt_len=8, max_tokens=9, spread=1)
    for name in ("_admit", "_append_blocks", "_release"):
        monkeypatch.setattr(ModelRunner, name, raising_at_syncs(getattr(ModelRunner, name)))
    work, _ = run_on_cuda_graphs("trace", jobs, monkeypatch)
    assert len(work.plans) > 0


# ------------------------------------------------------------------------------- exit tests from graphs


class PassOps(TorchDispatchMode):
    """The torch ops each DecodeLoop pass dispatches outside graph replays (emulated replays run their
    captured function eagerly: its ops are the graph's, not the host's), and its replays."""

    def __init__(self) -> None:
        super().__init__()
        self.passes: list[tuple[Counter[str], int]] = []  # per pass: ops outside replays, replays
        self._counting = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if self._counting:
            self.passes[-1][0][func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def pass_wrapper(self, method: Callable) -> Callable:
        def wrapper(loop: DecodeLoop, *args: object) -> object:
            self.passes.append((Counter(), 0))
            self._counting = True
            try:
                return method(loop, *args)
            finally:
                self._counting = False
        return wrapper

    def replay_wrapper(self, fn: Callable[[], None]) -> Callable[[], None]:
        def replay() -> None:
            counting, self._counting = self._counting, False
            if counting:
                ops, replays = self.passes[-1]
                self.passes[-1] = (ops, replays + 1)
            try:
                fn()
            finally:
                self._counting = counting
        return replay


# What a pass does outside its replays besides the test: the upload into the static inputs (from_numpy's
# lift_fresh and detach, copy_), views of them and of the exit flags (slice, unbind, alias), the readback
# (to, and .numpy()'s resolve_conj / resolve_neg).
DATA_MOVEMENT = {"lift_fresh", "detach", "copy_", "slice", "unbind", "alias", "to", "resolve_conj", "resolve_neg"}


def ouro_pass_ops(exit_graphs: bool, monkeypatch: pytest.MonkeyPatch) -> PassOps:
    """toy-ouro's 4·D-pass plans under emulated pass and exit-test graphs (`exit_graphs` False: their
    capture failed, so the test runs eagerly), each pass's ops counted; the reference's outputs."""
    depth = DEPTH["toy-ouro"]
    jobs = make_workload(random.Random("exit-graph-ops"), 5, depth=depth, exit_mode="ouro", threshold=0.4,
                         sampling=("greedy", "top_p"), max_prompt_len=8, max_tokens=8, vary_limits=True, spread=1)
    counter = PassOps()
    init = cuda_graphs._EagerReplay.__init__
    monkeypatch.setattr(cuda_graphs._EagerReplay, "__init__",
                        lambda replay, fn: init(replay, counter.replay_wrapper(fn)))
    monkeypatch.setattr(DecodeLoop, "_pass", counter.pass_wrapper(DecodeLoop._pass))
    with make_llm("toy-ouro", exit_mode="ouro", loops_per_plan=4 * depth, max_num_seqs=4) as llm:
        runner = llm.engine.executor._worker.runner
        runner.use_pass_graphs(emulate=True)
        if not exit_graphs:
            runner._graphs.exits.error = "off for the test"
        runner.capture_pass_graphs()  # as the worker does at start-up on CUDA: no capture inside a counted pass
        with counter:
            run = run_workload(llm, jobs)
        assert_matches_reference(run, "toy-ouro", kv_layout="last_exited", exit_mode="ouro")
        stats = runner.graph_stats
    assert stats["eager_passes"] == 0 and stats["replays"] == len(counter.passes) > 0
    assert stats["exit_replays"] == (len(counter.passes) if exit_graphs else 0)
    return counter


def test_an_ouro_pass_under_graphs_runs_its_exit_test_in_a_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """Emulated graphs, Ouro's test graphed: every pass is two replays (the pass, its exit test) and
    dispatches no compute op outside them (only its upload and views). With the test's capture
    failed, the same passes launch the eager test (gathers, the gate, the hazard math, index_put)."""
    graphed = ouro_pass_ops(True, monkeypatch)
    assert all(replays == 2 for _, replays in graphed.passes)
    outside = set().union(*(ops for ops, _ in graphed.passes))
    print(f"graphed: ops outside replays {sorted(outside)}")
    assert outside <= DATA_MOVEMENT, outside - DATA_MOVEMENT
    eager = ouro_pass_ops(False, monkeypatch)
    print(f"eager test: ops outside replays {sorted(set().union(*(ops for ops, _ in eager.passes)))}")
    assert all(replays == 1 for _, replays in eager.passes)
    assert all({"index", "index_put_", "sigmoid"} <= set(ops) for ops, _ in eager.passes)
    assert min(sum(ops.values()) for ops, _ in eager.passes) > max(sum(ops.values()) for ops, _ in graphed.passes)
