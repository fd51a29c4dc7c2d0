"""PREFILL chunk passes from CUDA graphs (rlt_worker/prefill_graphs.py) on the GPU, at the Ouro-1.4B
shape (synthetic weights), float32 and bf16, exits decided by Ouro's gate in the worker:

- prompts whose chunks fill their token buckets exactly (1,024 = two chunks of 512 beside two of 256,
  chunk 512): the graphs run the eager pass's shapes, so graphed prefill equals eager prefill bit
  for bit — tokens, exit depths, logprobs and every K/V block (the decode graphs are on in both);
- ragged prompts (padded buckets): the captured graphs equal the same padded pass run eagerly
  (`emulate=True`, every graph's function without the capture) bit for bit, so the capture changes
  nothing; the padded pass against the unpadded one (other GEMM shapes, so other roundings) is the
  float32 gate's to judge (test_gpu.py) and, exactly in float64, test_prefill_graphs.py's.

Skipped without CUDA. Run on the device machine: python -m pytest -m gpu tests/test_gpu_prefill_graphs.py -s
"""

from __future__ import annotations

import random

import pytest
import torch
from test_gpu import _free_cuda

from protocol.messages import SamplingParams
from rlt_engine import LLM
from rlt_engine.bench.throughput import OURO_THRESHOLD

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MODEL = "synthetic-ouro-1.4b"
EXACT = [1024, 256, 256]  # step 1: 512 + 256 + 256 = a 1,024-token bucket; step 2: 512 alone
RAGGED = [300, 77, 650, 5]  # step 1: 300 + 77 + 512 + 5 in the 1,024 bucket; step 2: 138 in 256


Run = tuple[list, torch.Tensor, dict]  # outputs, the K/V pool without the scratch block, graph counters


def _run(dtype: str, lengths: list[int], prefill_graphs: bool, emulate: bool = False) -> Run:
    """One engine's run of prompts of these lengths (8 greedy tokens each, Ouro's exits)."""
    rng = random.Random(f"prefill-graphs-{lengths}")
    prompts = [[rng.randrange(49152) for _ in range(n)] for n in lengths]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1, exit_threshold=OURO_THRESHOLD)
    # Mixed batches off: a chunk that rode decode passes would take no prefill graph.
    with LLM(MODEL, workers=0, device="cuda", dtype=dtype, exit_mode="ouro", num_blocks=512, max_num_seqs=16,
             prefill_chunk_size=512, cuda_graph_capture="lazy", cuda_graph_prefill=prefill_graphs,
             mixed_batches=False) as llm:
        runner = llm.engine.executor._worker.runner
        if emulate:  # the same padded functions, run eagerly in place of every replay
            runner.use_pass_graphs(emulate=True, prefill=True)
        outputs = llm.generate(prompts, [params] * len(prompts), use_tqdm=False)
        pool = runner.storage.pool[:, :, : runner.config.scratch_block].clone()
        stats = runner.graph_stats
    _free_cuda()
    return outputs, pool, stats


def _assert_bit_equal(a: Run, b: Run, what: str) -> None:
    (outs_a, pool_a, _), (outs_b, pool_b, _) = a, b
    for i, (x, y) in enumerate(zip(outs_a, outs_b, strict=True)):
        assert (x.token_ids, x.exit_depths, x.logprobs) == (y.token_ids, y.exit_depths, y.logprobs), f"{what}, {i}"
    differ = int((pool_a != pool_b).sum())
    assert differ == 0, f"{what}: {differ} K/V elements differ"
    assert len({tuple(o.exit_depths) for o in outs_a}) > 1 or min(min(o.exit_depths) for o in outs_a) < 4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphed_prefill_equals_eager_at_exact_buckets(dtype: str) -> None:
    eager = _run(dtype, EXACT, prefill_graphs=False)
    graphed = _run(dtype, EXACT, prefill_graphs=True)
    stats = graphed[2]
    print(f"\n{MODEL} {dtype} exact buckets: graphs {stats}; exit depths {[o.exit_depths for o in graphed[0]]}")
    assert eager[2]["prefill_replays"] == 0
    assert stats["prefill_replays"] == 2 * 4 and stats["prefill_eager"] == 0, stats  # two batches × D
    assert stats["prefill_padded_rows"] == 0 and set(stats["prefill_buckets"]) == {"1024x4", "512x1"}, stats
    _assert_bit_equal(eager, graphed, f"{dtype} graphed vs eager")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_captured_prefill_equals_its_eager_emulation(dtype: str) -> None:
    emulated = _run(dtype, RAGGED, prefill_graphs=True, emulate=True)
    graphed = _run(dtype, RAGGED, prefill_graphs=True)
    stats = graphed[2]
    print(f"\n{MODEL} {dtype} ragged: graphs {stats}")
    assert stats["prefill_replays"] == 2 * 4 and stats["prefill_eager"] == 0 and stats["prefill_padded_rows"] > 0
    assert stats["prefill_buckets"] == emulated[2]["prefill_buckets"] == {"1024x4": 1, "256x1": 1}, stats
    _assert_bit_equal(emulated, graphed, f"{dtype} captured vs emulated")
