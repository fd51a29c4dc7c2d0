"""Huginn-0125's real shape on the GPU (synthetic-huginn-3.5b: 5,280 wide, 55 heads × 96, 2/4/2 blocks, D = 32).

- float32, the benchmark gate's rule (rlt_engine/bench/gate.py: tokens and exit depths equal to the
  torch path's — torch attention, eager, one loop per plan — up to a near-tie within 1e-4 nats): Triton
  eager (one loop per plan) and Triton with CUDA graphs (4·D passes per plan; kl: exits in the worker) for
  fixed, trace and kl (the bench's threshold), each in both layouts, random and zero state init (every
  mode and every layout meets both inits).
- bf16, kl at the bench's threshold, 8 concurrent requests with graphs: every request completes with
  finite logprobs, and the generated positions' exit depths are printed (the calibration's first look).

Sizes keep the file to a few minutes on an H200: 4 requests of 8–32 prompt tokens and 8 outputs (a
float32 loop pass reads 6.5 GB; SHARED prefill runs one position at a time). Skipped without CUDA.
Run on the device machine: python -m pytest -m gpu tests/test_gpu_huginn.py -s
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from test_gpu import GateWorkload, _check_float32, _free_cuda, _torch_reference

from protocol.messages import SamplingParams
from rlt_engine import LLM
from rlt_engine.bench.throughput import KL_THRESHOLD

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MODEL = "synthetic-huginn-3.5b"
HUGINN_GATE = GateWorkload(requests=4, first_prompt=8, prompt_step=8, max_tokens=8, trace_stride=9,
                           threshold=KL_THRESHOLD)
# (mode, layout, state init): each mode in both layouts, each mode and each layout with both inits.
CASES = [
    ("fixed", "last_exited", "random"), ("fixed", "shared", "zero"),
    ("trace", "last_exited", "zero"), ("trace", "shared", "random"),
    ("kl", "last_exited", "random"), ("kl", "shared", "zero"),
]
VARIANTS = {
    "triton eager": dict(cuda_graphs=False, loops_per_plan=1),
    "triton graphs": dict(cuda_graphs=True, loops_per_plan=0, cuda_graph_capture="lazy"),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("mode,layout,state_init", CASES, ids=["-".join(case) for case in CASES])
def test_float32_gate(mode: str, layout: str, state_init: str, variant: str) -> None:
    result, stats = _check_float32(MODEL, layout, mode, state_init, HUGINN_GATE, num_blocks=1024,
                                   **VARIANTS[variant])
    assert result.passed, result.summary()
    if variant == "triton graphs":  # kl too: the worker's exit test runs after the pass's graph
        assert stats is not None and stats["replays"] > 0, stats
    reference = _torch_reference(MODEL, layout, mode, state_init, HUGINN_GATE)
    generated = [d for out in reference.outputs for d in out.exit_depths[1:]]
    if mode == "kl":
        assert min(generated) < 32, f"the KL signal never exited early: {generated}"
    print(f"{MODEL} {mode} {layout} {state_init}: the torch path's generated exit depths {generated}")


def test_bf16_kl_completes_with_a_spread_of_depths() -> None:
    rng = random.Random(22)
    prompts = [[rng.randrange(65536) for _ in range(rng.randint(16, 128))] for _ in range(8)]
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, seed=i, exit_threshold=KL_THRESHOLD,
                             logprobs=1) for i in range(8)]
    with LLM(MODEL, workers=0, device="cuda", dtype="bfloat16", exit_mode="kl", max_num_seqs=8,
             num_blocks=2048, cuda_graph_capture="lazy") as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    _free_cuda()
    assert [o.finish_reason for o in outputs] == ["length"] * 8
    assert all(math.isfinite(lp) for o in outputs for lp in o.logprobs)
    generated = [d for o in outputs for d in o.exit_depths[1:]]
    print(f"\n{MODEL} bf16 kl < {KL_THRESHOLD}: mean {sum(generated) / len(generated):.2f} loops per generated "
          f"token, depths {sorted(generated)}")
    assert min(generated) < 32
