"""DeviceRefill (rlt_worker/device_refill.py): a DecodeBatch's exits, CODA and refill on the device, with
no readback between passes, against the host-driven loop and the dense reference (float64, CPU, graphs
emulated)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from factories import DEPTH, Driver, Job, assert_matches_reference, make_llm, make_workload, run_workload

from protocol.messages import ExitTest
from rlt_engine import SamplingParams
from rlt_engine.config import EngineConfig
from rlt_engine.executor.inproc import InprocExecutor
from rlt_worker import mixed_graphs
from rlt_worker.device_refill import DeviceRefill, RefillGraphs
from rlt_worker.step_results import PendingResult, ResultBuilder

pytestmark = pytest.mark.usefixtures("single_thread")


def _jobs(mode: str, n: int = 8, max_tokens: int = 9) -> list:
    """Greedy requests (every 5th with stop tokens on half the vocabulary), staggered, varied limits."""
    return make_workload(random.Random(f"device-refill-{mode}"), n, depth=DEPTH["toy-ouro"], exit_mode=mode,
                         threshold=0.5, sampling=("greedy",), max_prompt_len=10, max_tokens=max_tokens,
                         vary_limits=True, spread=1)


def _run(mode: str, layout: str, device_refill: bool, jobs: list, **options: object):
    settings = dict(exit_mode=mode, kv_layout=layout, loops_per_plan=4 * DEPTH["toy-ouro"], max_num_seqs=6)
    with make_llm("toy-ouro", **(settings | options)) as llm:
        runner = llm.engine.executor._worker.runner
        runner.config = dataclasses.replace(runner.config, device_refill=device_refill)
        runner.use_pass_graphs(emulate=True, mixed=bool(options.get("mixed_batches")))
        run = run_workload(llm, jobs)
        run.assert_resources_returned()
        run.graph_stats = runner.graph_stats
    return run


def _finals(run) -> list[tuple]:
    return [(life.job.request_id, life.final.token_ids, life.final.exit_depths, life.final.finish_reason)
            for life in run.lives]


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
@pytest.mark.parametrize("mode", ["ouro", "ouro_delayed"])
def test_device_refill_equals_the_host_loop_and_the_reference(mode: str, layout: str) -> None:
    """Tokens, exit depths, finish reasons (stop tokens and max_tokens inside plans) and logprobs are
    the host loop's and the reference's, each position runs loops 1 … its exit depth once, and the
    plans did run on the device."""
    jobs = _jobs(mode)
    on_device = _run(mode, layout, True, jobs)
    host = _run(mode, layout, False, jobs)
    assert _finals(on_device) == _finals(host)
    assert_matches_reference(on_device, "toy-ouro", kv_layout=layout, exit_mode=mode)
    assert on_device.graph_stats["device_refill_plans"] > 0
    assert 0 < on_device.graph_stats["refill_captures"] <= on_device.graph_stats["lazy_captures"]
    assert host.graph_stats["device_refill_plans"] == host.graph_stats["refill_captures"] == 0
    assert any(life.final.finish_reason == "stop" for life in on_device.lives)


def test_rows_that_did_not_exit_may_take_any_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Device refill's CODA asks the model's head for the exited rows' logits only (lm_head_needed): a
    head that gives the other rows the opposite logits (a gated head leaves them 0) changes no output."""
    from rlt_worker.models.base import LoopedModel

    asked: list[bool] = []  # per call: whether some row was not needed
    head = LoopedModel.lm_head_needed

    def adversarial(self: LoopedModel, hidden: torch.Tensor, needed: torch.Tensor) -> torch.Tensor:
        logits = head(self, hidden, needed)
        asked.append(not bool(needed.all()))
        return torch.where(needed[:, None], logits, -logits)

    monkeypatch.setattr(LoopedModel, "lm_head_needed", adversarial)
    jobs = _jobs("ouro")
    run = _run("ouro", "last_exited", True, jobs)
    assert_matches_reference(run, "toy-ouro", kv_layout="last_exited", exit_mode="ouro")
    assert run.graph_stats["device_refill_plans"] > 0 and any(asked), asked


def test_sampled_rows_keep_the_host_loop() -> None:
    """A batch with a sampling row is not greedy: it runs the host-driven loop, and still matches."""
    jobs = make_workload(random.Random("device-refill-sampled"), 6, depth=DEPTH["toy-ouro"], exit_mode="ouro",
                         threshold=0.5, sampling=("top_k",), max_prompt_len=10, max_tokens=6, spread=1)
    run = _run("ouro", "last_exited", True, jobs)
    assert_matches_reference(run, "toy-ouro", kv_layout="last_exited", exit_mode="ouro")
    assert run.graph_stats["device_refill_plans"] == 0


@pytest.mark.parametrize(("layout", "in_flight"), [("last_exited", 1), ("shared", 1), ("last_exited", 2)])
def test_riding_prompt_chunks_keep_device_refill(layout: str, in_flight: int) -> None:
    """Mixed batches under ouro: prompt chunks (up to four of 8 tokens) ride device-refill passes, from
    the mixed graphs' family, and a prompt's first token follows its last riding chunk in the same plan;
    the outputs are the host loop's (the same passes read back one by one) and the reference's, also with
    two plans in flight."""
    jobs = make_workload(random.Random(f"device-refill-mixed-{layout}"), 8, depth=DEPTH["toy-ouro"],
                         exit_mode="ouro", threshold=0.5, sampling=("greedy",), max_prompt_len=30, max_tokens=9,
                         vary_limits=True, spread=2)
    options = dict(mixed_batches=True, prefill_chunk_size=8, max_num_seqs=4, max_plans_in_flight=in_flight)
    on_device = _run("ouro", layout, True, jobs, **options)
    host = _run("ouro", layout, False, jobs, **options)
    assert _finals(on_device) == _finals(host)
    assert_matches_reference(on_device, "toy-ouro", kv_layout=layout, exit_mode="ouro")
    stats = on_device.graph_stats
    assert stats["refill_riding_passes"] > 0 and stats["device_refill_plans"] > 0, stats
    assert stats["mixed_eager"] == 0 and stats["mixed_replays"] == stats["mixed_passes"], stats
    assert host.graph_stats["refill_riding_passes"] == host.graph_stats["device_refill_plans"] == 0
    if in_flight > 1:
        assert stats["device_refill_carried"] > 0, stats


def test_riding_device_refill_graphs_are_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past mixed_graphs.MAX_GRAPHS riding keys, a plan of a new key takes the host loop (its mixed passes
    from mixed graphs, also capped); the key captured keeps replaying, and the outputs do not change."""
    monkeypatch.setattr(mixed_graphs, "MAX_GRAPHS", 1)
    jobs = make_workload(random.Random("device-refill-mixed-last_exited"), 8, depth=DEPTH["toy-ouro"],
                         exit_mode="ouro", threshold=0.5, sampling=("greedy",), max_prompt_len=30, max_tokens=9,
                         vary_limits=True, spread=2)
    options = dict(mixed_batches=True, prefill_chunk_size=8, max_num_seqs=4)
    riding_keys: list[int] = []
    real = RefillGraphs.riding_keys
    monkeypatch.setattr(RefillGraphs, "riding_keys", lambda self: riding_keys.append(real(self)) or riding_keys[-1])
    capped = _run("ouro", "last_exited", True, jobs, **options)
    assert _finals(capped) == _finals(_run("ouro", "last_exited", False, jobs, **options))
    assert max(riding_keys) == 1 and capped.graph_stats["refill_riding_passes"] > 0, capped.graph_stats
    assert capped.graph_stats["mixed_replays"] > capped.graph_stats["refill_riding_passes"], capped.graph_stats


def _results_land_late(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA's timing on the CPU: a plan's result is built when the engine reads it, and the engine reads
    only the oldest (on CUDA the newest plan's copies are still on their way), so a continuing row's
    next plan is built before its last one has landed, plan after plan."""
    def finish(self: ResultBuilder, num_free_slots: int) -> list[PendingResult]:
        return [*self._early, PendingResult(lambda: self.build(num_free_slots))]

    def collect(self: InprocExecutor, timeout: float | None = None) -> list:
        oldest, self._pending = self._pending[:1], self._pending[1:]
        built = [r.result() for r in oldest]  # None: an early result with nothing left to carry
        done, self._done = self._done + [(0, self._cross(r)) for r in built if r is not None], []
        return done

    monkeypatch.setattr(ResultBuilder, "finish", finish)
    monkeypatch.setattr(InprocExecutor, "collect", collect)


@pytest.mark.parametrize(("n", "max_tokens", "late"), [(1, 9, False), (8, 9, False), (8, 40, True)])
def test_pipelined_plans_continue_device_refill_rows(n: int, max_tokens: int, late: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Two plans in flight (rows that continue their slot's last row): the same outputs as one plan at
    a time; plans whose rows are the last plan's resume them on the device (no readback between), and
    a plan that adds or drops rows carries the continuing ones from the device (no drain), also when
    results land late (plans resumed one after another, across width buckets)."""
    jobs = _jobs("ouro", n=n, max_tokens=max_tokens)
    if late:
        _results_land_late(monkeypatch)
    pipelined = _run("ouro", "last_exited", True, jobs, max_plans_in_flight=2)
    synchronous = _run("ouro", "last_exited", True, jobs)
    assert _finals(pipelined) == _finals(synchronous)
    assert_matches_reference(pipelined, "toy-ouro", kv_layout="last_exited", exit_mode="ouro")
    assert pipelined.graph_stats["device_refill_resumed"] > 0
    assert (pipelined.graph_stats["device_refill_carried"] > 0) == (n > 1), pipelined.graph_stats
    assert synchronous.graph_stats["device_refill_resumed"] == synchronous.graph_stats["device_refill_carried"] == 0


class _UnlandedFlag:
    """A pass's "any row running" event as on CUDA when the host runs ahead: not landed when queried,
    landed once waited for (`waited` records the pass)."""

    def __init__(self, waited: list[int], index: int) -> None:
        self.waited, self.index = waited, index

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        self.waited.append(self.index)


@pytest.mark.parametrize("max_tokens", [3, 40])
def test_a_plan_ends_with_passes_queued(max_tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """One request, two plans in flight, CUDA's timing (results land late, a pass's flag only when waited
    for): every plan after the first resumes its row on the device, and the host waits for no flag of a
    full plan's last 4 passes, which stay queued on the GPU while the engine reads the last result and
    builds and submits the next plan (as a planned plan's passes do); the outputs are one plan at a
    time's and the reference's, also where the row ends inside passes the host did not wait for (3
    tokens: in a D-pass plan, all of whose passes are its last 4)."""
    plans: list[tuple[int, list[int]]] = []  # per device-refill plan: (its max_passes, the flags waited for)
    replayed: list[int] = []  # per plan: the passes replayed so far
    run_passes, running_flag = DeviceRefill.run_passes, DeviceRefill._running_flag

    def counted_run_passes(self: DeviceRefill, rows: object, results: object) -> None:
        plans.append((self.max_passes, []))
        replayed.append(0)
        run_passes(self, rows, results)

    def unlanded_flag(self: DeviceRefill, p: int) -> tuple[torch.Tensor, _UnlandedFlag]:
        flag, _ = running_flag(self, p)
        replayed[-1] += 1
        assert p == replayed[-1] - 1 and flag.data_ptr() == self.buffers.flags_host[p].data_ptr()  # no allocation
        return flag, _UnlandedFlag(plans[-1][1], p)

    params = SamplingParams(max_tokens=max_tokens, seed=11, exit_threshold=0.5, temperature=0.0)
    jobs = [Job("r", (5, 6, 7, 8), params)]
    synchronous = _run("ouro", "last_exited", True, jobs)
    _results_land_late(monkeypatch)
    monkeypatch.setattr(DeviceRefill, "run_passes", counted_run_passes)
    monkeypatch.setattr(DeviceRefill, "_running_flag", unlanded_flag)
    pipelined = _run("ouro", "last_exited", True, jobs, max_plans_in_flight=2)
    assert _finals(pipelined) == _finals(synchronous)
    assert_matches_reference(pipelined, "toy-ouro", kv_layout="last_exited", exit_mode="ouro")
    assert pipelined.graph_stats["device_refill_resumed"] == len(plans) - 1 > 0, pipelined.graph_stats
    full = [(n, waited) for (n, waited), ran in zip(plans, replayed, strict=True) if ran == n == 4 * DEPTH["toy-ouro"]]
    assert bool(full) == (max_tokens > 4 * DEPTH["toy-ouro"]), plans
    for n, waited in full:
        assert n - 1 - max(waited) >= 4, f"passes queued at the plan's end: {n - 1 - max(waited)} ({waited})"


@pytest.mark.parametrize("first", [0, 2])
def test_a_stop_token_ends_its_row_at_once(first: int) -> None:
    """A greedy row whose output k is a stop token runs no loop past that output's position (the host
    loop runs one more, dropped, until its next readback): k ≥ 2, sampled by a pass on the device, and
    k = 0, sampled by the host's boundary work before the plan and checked on the device."""
    params = dict(max_tokens=9, seed=3, exit_threshold=0.5, temperature=0.0)
    free = _run("ouro", "last_exited", True, [Job("r", (5, 6, 7), SamplingParams(**params))]).life("r").final
    k = next(i for i in range(first, 8) if free.token_ids[i] not in free.token_ids[:i])
    job = Job("r", (5, 6, 7), SamplingParams(**params, stop_token_ids=[free.token_ids[k]]))
    run = _run("ouro", "last_exited", True, [job])
    assert_matches_reference(run, "toy-ouro", kv_layout="last_exited", exit_mode="ouro")
    out = run.life("r").final
    assert out.token_ids == free.token_ids[: k + 1] and out.finish_reason == "stop"
    positions = {p for loop_pass in run.passes for _, _, p, _ in loop_pass.rows}
    assert max(positions, default=2) == 2 + k, "the row looped past its stop token's position"
    assert run.graph_stats["device_refill_plans"] > 0


@pytest.mark.parametrize("in_flight", [1, 2])
def test_rows_stop_where_their_blocks_end(in_flight: int) -> None:
    """KV blocks granted on demand from a small pool: a row stops when its next position has no block
    (and resumes in a later plan, on the device when pipelined), so no pass writes K/V past a row's
    blocks; the outputs are the reference's."""
    jobs = _jobs("ouro", n=10)
    outside: list[tuple[int, int]] = []
    settings = dict(exit_mode="ouro", loops_per_plan=4 * DEPTH["toy-ouro"], max_num_seqs=6, kv_growth="on_demand",
                    block_size=4, num_blocks=24, preemption="swap", max_plans_in_flight=in_flight)
    with make_llm("toy-ouro", **settings) as llm:
        runner = llm.engine.executor._worker.runner
        runner.config = dataclasses.replace(runner.config, device_refill=True)
        runner.use_pass_graphs(emulate=True)
        driver = Driver(llm)
        record = runner.pass_listener

        def check_blocks(slots, positions, depths):  # noqa: ANN001, ANN202 (the listener's signature)
            covered = runner.covered_positions(slots)
            outside.extend((s, p) for s, p, c in zip(slots.tolist(), positions.tolist(), covered.tolist(),
                                                     strict=True) if p >= c)
            record(slots, positions, depths)

        runner.pass_listener = check_blocks
        run = driver.run(jobs)
        run.assert_resources_returned()
        stats = runner.graph_stats
    assert_matches_reference(run, "toy-ouro", kv_layout="last_exited", exit_mode="ouro")
    assert not outside, f"passes at positions past their blocks (slot, position): {outside}"
    assert stats["device_refill_plans"] > 0


def test_a_capture_keeps_the_resident_rows_columns() -> None:
    """Capturing a new (rows, width) pass warms it up on the dummy slot, in the bucket's buffers; the
    columns of the rows a next plan may resume there are as they were."""
    with make_llm("toy-ouro", exit_mode="ouro", max_num_seqs=6) as llm:
        runner = llm.engine.executor._worker.runner
        runner.use_pass_graphs(emulate=True)
        refill = runner._graphs.refill
        columns = refill.buffers[1].columns
        columns.copy_(torch.arange(columns.numel()).reshape(columns.shape))
        before = columns.clone()
        for width in runner._graphs.widths()[:2]:
            assert refill.graph(1, width, ExitTest.OURO) is not None
        assert torch.equal(columns, before)


def test_device_refill_is_on_where_pass_graphs_are() -> None:
    """The default resolves on with CUDA graphs (CUDA + Triton) and off on the CPU; the worker is told."""
    cuda = EngineConfig(device="cuda").resolved()
    assert cuda.device_refill and cuda.worker_config("cuda").device_refill
    assert not EngineConfig(device="cuda", attention_backend="torch").resolved().device_refill
    assert not EngineConfig(device="cpu").resolved().device_refill
    assert not EngineConfig(device="cuda", device_refill=False).resolved().worker_config("cuda").device_refill


@pytest.mark.parametrize("in_flight", [1, 2])
def test_rows_that_end_on_the_device_go_out_early(in_flight: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A device-refill plan's rows that end at a pass whose flags the host reads (max_tokens, stop
    tokens) go out in early results ahead of the plan's, with CUDA's timing (results land late); no
    request's rows are in two of a plan's results, and the outputs are the host loop's and the
    reference's."""
    jobs = _jobs("ouro", n=16, max_tokens=24)
    host = _run("ouro", "last_exited", False, jobs, max_plans_in_flight=in_flight)
    _results_land_late(monkeypatch)
    seen: list = []
    late_collect = InprocExecutor.collect

    def recording(self: InprocExecutor, timeout: float | None = None) -> list:
        events = late_collect(self, timeout)
        seen.extend(event for _, event in events)
        return events

    monkeypatch.setattr(InprocExecutor, "collect", recording)
    on_device = _run("ouro", "last_exited", True, jobs, max_plans_in_flight=in_flight)
    assert _finals(on_device) == _finals(host)
    assert_matches_reference(on_device, "toy-ouro", kv_layout="last_exited", exit_mode="ouro")
    assert on_device.graph_stats["device_refill_plans"] > 0
    early = [(i, r) for i, r in enumerate(seen) if r.early]
    assert all(r.num_rows for _, r in early), "an empty early result was sent"
    assert len(early) >= 2, [(r.step_id, r.early, r.num_rows) for r in seen]
    reasons = {life.key: life.final.finish_reason for life in on_device.lives}
    carried: set[tuple[int, int]] = set()  # (plan, key) of every early row
    for i, result in early:
        keys = set(result.col("keys").tolist())
        assert not {(result.step_id, k) for k in keys} & carried, "a request in two early results of a plan"
        carried |= {(result.step_id, k) for k in keys}
        assert all(reasons[k] in ("length", "stop") for k in keys)
        (final,) = [r for r in seen[i + 1:] if r.step_id == result.step_id and not r.early]
        assert not keys & set(final.col("keys").tolist()), "a row in both an early result and its plan's"
