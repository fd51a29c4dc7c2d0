"""Pipelined plans on CUDA: the side-stream result copy and two plans in flight (SPEC §6).

- ResultBuilder.finish copies a plan's device values on a side stream from a snapshot taken on
  the compute stream: overwriting the source tensors afterwards (as the next plan's CODA graph
  replay does with its static outputs) does not change the result.
- toy-ouro in float32 on CUDA (Triton, graphs, 4·D passes per plan) with max_plans_in_flight = 2,
  in-process and with a worker process: the float64 CPU reference's tokens and exit depths up to
  each request's first small-margin decision (tests/test_gpu.py's rule), for fixed, trace and ouro.

Skipped without CUDA. Run on the device machine: python -m pytest -m gpu tests/test_gpu_pipelined.py -s
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from protocol.messages import Stage
from rlt_engine import LLM
from rlt_worker.step_results import ResultBuilder
from tests.test_gpu import _run_toy, compare_to_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.timeout(900),
]


def test_side_stream_copy_reads_a_snapshot() -> None:
    device = torch.device("cuda")
    tokens = torch.arange(5, device=device)
    logprobs = torch.linspace(-1, 0, 5, device=device, dtype=torch.float32)
    builder = ResultBuilder(step_id=3, copy_stream=torch.cuda.Stream(device))
    keys = np.arange(5, dtype=np.int64)
    builder.add(Stage.CODA, keys, keys, depths=np.full(5, 4), tokens=tokens, logprobs=logprobs)
    builder.add(Stage.RECURRENT, keys, keys, depths=np.zeros(5, dtype=np.int64),
                exit_states=torch.full((5,), 0.25, device=device, dtype=torch.float64))
    builder.send_early(np.array([1]))
    early, pending = builder.finish(num_free_slots=2)
    tokens.fill_(-7)  # the next plan's work on the compute stream
    logprobs.fill_(9.0)
    result = pending.result()
    assert pending.is_ready() and early.is_ready()
    assert early.result().col("tokens").tolist() == [1, -1] and early.result().early  # key 1's rows
    assert result.col("tokens").tolist() == [0, 2, 3, 4, -1, -1, -1, -1]
    np.testing.assert_allclose(result.col("logprobs")[:4], np.linspace(-1, 0, 5)[[0, 2, 3, 4]], rtol=1e-6)
    assert result.col("exit_states")[4:].tolist() == [0.25] * 4 and result.num_free_slots == 2


@pytest.mark.parametrize("mode", ["fixed", "trace", "ouro"])
def test_pipelined_toy_matches_the_reference_on_cuda(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two plans in flight, in-process and with a worker process (graphs, 4·D passes per plan): the
    float64 CPU reference's tokens and exit depths up to each request's first small-margin decision."""
    prompts, params, outputs, depth, _ = _run_toy("toy-ouro", mode, "random", "cuda", "triton", max_plans_in_flight=2)
    smalls = compare_to_reference("toy-ouro", mode, "random", prompts, params, outputs, depth, monkeypatch)
    with LLM("toy-ouro", workers=1, device="cuda", dtype="float32", exit_mode=mode, num_blocks=512,
             max_num_seqs=16, max_plans_in_flight=2) as llm:
        assert llm.engine.config.max_plans_in_flight == 2
        process = llm.generate(prompts, params, use_tqdm=False)
    for i, (a, b, small) in enumerate(zip(outputs, process, smalls, strict=True)):
        assert a.token_ids[:small] == b.token_ids[:small], f"request {i}: {a.token_ids} vs {b.token_ids}"
        assert a.exit_depths[:small] == b.exit_depths[:small], f"request {i}"

