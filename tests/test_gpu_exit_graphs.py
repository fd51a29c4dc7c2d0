"""Ouro's exit tests replayed from CUDA graphs (rlt_worker/exit_graphs.py) against the eager test, on CUDA.

- The test alone: toy-ouro in float32 (Triton, graphs captured at start-up), random slot states,
  limits, thresholds and exit states, 1 … 8 rows (padded buckets included): the graph's exit flags
  and exit states equal the eager `apply`'s bit for bit, and no other slot's exit state moves.
- The engine: 4·D passes per plan, ouro and ouro_delayed, graphed tests against the same engine
  with exit-test graphs off (the eager test after each replayed pass): the same tokens and exit
  depths, every pass's test a replay.

Skipped without CUDA. Run on the device machine: python -m pytest -m gpu tests/test_gpu_exit_graphs.py -s
"""

from __future__ import annotations

import random

import pytest
import torch

from protocol.messages import ExitTest, SamplingParams
from rlt_engine import LLM
from tests.test_exit_graphs import check_graphed_test_equals_eager

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.timeout(900),
]

MODES = ["ouro", "ouro_delayed"]


def _llm(mode: str, **options: object) -> LLM:
    # Mixed batches off: both sides of a comparison run the same passes (tests/test_gpu.py covers mixing).
    return LLM("toy-ouro", workers=0, device="cuda", dtype="float32", exit_mode=mode, attention_backend="triton",
               cuda_graphs=True, num_blocks=512, max_num_seqs=8, mixed_batches=False, **options)


@pytest.mark.parametrize("mode", MODES)
def test_graphed_test_equals_eager_bit_for_bit(mode: str, compiled: None) -> None:
    llm = _llm(mode)
    try:
        runner = llm.engine.executor._worker.runner
        assert runner.graph_stats["exit_error"] is None
        assert runner._graphs.exits.startup_tests == (ExitTest[mode.upper()],)  # captured at start-up
        check_graphed_test_equals_eager(runner, ExitTest[mode.upper()])
    finally:
        llm.close()


def _run(mode: str, exit_graphs: bool, device_refill: bool = False, temperatures: tuple[float, ...] = (0.0, 1.0),
         requests: int = 12, max_tokens: int | None = None) -> tuple[list, dict]:
    """The host loop's passes by default (device_refill off), whose exit test is what is compared."""
    llm = _llm(mode, loops_per_plan=16, device_refill=device_refill)
    try:
        runner = llm.engine.executor._worker.runner
        if not exit_graphs:
            runner._graphs.exits.error = "off for the comparison"
        rng = random.Random(f"gpu-exit-graphs-{mode}")
        prompts = [[rng.randrange(256) for _ in range(rng.randint(3, 30))] for _ in range(12)]
        params = [SamplingParams(max_tokens=max_tokens or rng.randint(8, 24), seed=i,
                                 temperature=rng.choice(temperatures), exit_threshold=rng.choice([0.3, 0.5, 0.7]),
                                 ignore_eos=True) for i in range(12)]
        outputs = llm.generate(prompts[:requests], params[:requests], use_tqdm=False)
        return [(o.token_ids, o.exit_depths) for o in outputs], runner.graph_stats
    finally:
        llm.close()


@pytest.mark.parametrize("mode", MODES)
def test_engine_with_graphed_tests_equals_eager_tests(mode: str, compiled: None) -> None:
    graphed, stats = _run(mode, exit_graphs=True)
    eager, eager_stats = _run(mode, exit_graphs=False)
    print(f"{mode}: graphed {stats}\n{mode}: eager tests {eager_stats}")
    assert graphed == eager
    assert stats["exit_replays"] == stats["replays"] > 0 and stats["lazy_captures"] == 0
    assert eager_stats["exit_replays"] == 0 and eager_stats["replays"] == stats["replays"]


@pytest.mark.parametrize("mode", MODES)
def test_device_refill_equals_the_host_loop(mode: str, compiled: None) -> None:
    """DeviceRefill's captured passes (rlt_worker/device_refill.py) against the host loop with graphed
    tests, greedy rows: the same tokens and exit depths, and the plans ran on the device with no
    failed capture."""
    on_device, stats = _run(mode, exit_graphs=True, device_refill=True, temperatures=(0.0,))
    host, host_stats = _run(mode, exit_graphs=True, temperatures=(0.0,))
    print(f"{mode}: device refill {stats}\n{mode}: host loop {host_stats}")
    assert on_device == host
    assert stats["device_refill_plans"] > 0 and stats["refill_error"] is None
    assert host_stats["device_refill_plans"] == 0


@pytest.mark.parametrize("mode", MODES)
def test_device_refill_resumes_a_lone_row(mode: str, compiled: None) -> None:
    """One greedy request, two plans in flight: later plans resume its row on the device with no
    readback between them, and its tokens and exit depths are the host loop's."""
    on_device, stats = _run(mode, exit_graphs=True, device_refill=True, temperatures=(0.0,), requests=1,
                          max_tokens=96)
    host, _ = _run(mode, exit_graphs=True, temperatures=(0.0,), requests=1, max_tokens=96)
    print(f"{mode}: lone row, device refill {stats}")
    assert on_device == host
    assert stats["device_refill_resumed"] > 0 and stats["refill_error"] is None
