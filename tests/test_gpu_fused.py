"""The fused CUDA path (FusedOuroModel + start-up captured graphs) against the torch path, at real shapes.

- float32, synthetic-ouro-1.4b, fixed / trace / ouro (threshold 0.5): the benchmark's correctness
  gate (rlt_engine/bench/gate.py: tokens and exit depths equal to the torch path's — torch attention,
  torch modules, eager, one loop per plan — up to a near-tie within 1e-4 nats, found by teacher
  forcing) passes for the fused engine, and for the torch-modules engine with graphs beside it.
- bf16, the same model, 32 requests: every CODA's logits of the fused path against the torch
  modules' (both Triton attention + graphs; CODA eager there, since the logits are recorded from
  lm_head calls) within bf16 tolerance; no capture while serving but mixed passes' (first use).

Skipped without CUDA. Run on the device machine: python -m pytest -m gpu tests/test_gpu_fused.py -s
"""

from __future__ import annotations

import random

import pytest
import torch
from test_gpu import _free_cuda, _record_logits

from protocol.messages import SamplingParams
from rlt_engine import LLM
from rlt_engine.bench import gate
from rlt_worker.models.ouro_fused import FusedOuroModel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MODEL = "synthetic-ouro-1.4b"


def _gate_jobs(mode: str) -> object:
    def make(vocab: int, depth: int) -> list[gate.GateJob]:
        rng = random.Random(f"fused-{mode}")
        jobs = []
        for _ in range(gate.GATE_REQUESTS):
            options: dict[str, object] = dict(max_tokens=16, temperature=0.0, ignore_eos=True)
            if mode == "trace":
                options["exit_depths"] = [depth] + [rng.randint(1, depth) for _ in range(15)]
            if mode == "ouro":
                options["exit_threshold"] = 0.5
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(16, 200))]
            jobs.append(gate.GateJob(prompt, SamplingParams(**options)))
        return jobs

    return make


@pytest.mark.parametrize("mode", ["fixed", "trace", "ouro"])
def test_float32_gate_fused_and_torch_modules(mode: str) -> None:
    options = dict(device="cuda", dtype="float32", exit_mode=mode, max_num_seqs=8, num_blocks=1024)
    reference = gate.reference_run(MODEL, options, _gate_jobs(mode))
    _free_cuda()
    for fused in (True, False):
        with LLM(MODEL, workers=0, fused_layers=fused, **options) as llm:
            runner = llm.engine.executor._worker.runner
            assert isinstance(runner.model, FusedOuroModel) == fused
            result = gate.check(llm, reference, "float32")
            stats = runner.graph_stats
        _free_cuda()
        print(f"\n{MODEL} float32 {mode}, fused_layers={fused}: {result.summary()}; graphs {stats}")
        assert result.passed, result.summary()
        # Only device refill's and mixed passes' graphs are captured at first use (rlt_worker/device_refill.py,
        # rlt_worker/mixed_graphs.py: mixed batches are on by default for these modes).
        assert stats["lazy_captures"] == stats["refill_captures"] + stats["mixed_captures"], stats
        assert stats["eager_passes"] == 0, stats
        assert stats["coda_replays"] > 0, stats  # CODA (head + sampling) from graphs, gate or not
        # ouro's greedy rows take device refill's graphs; the others the pass graphs
        assert stats["replays"] + stats["device_refill_plans"] > 0, stats


def _bf16_run(fused: bool, prompts: list[list[int]], params: SamplingParams) -> tuple[dict, list, dict]:
    with LLM(MODEL, workers=0, device="cuda", dtype="bfloat16", exit_mode="fixed", fused_layers=fused,
             max_num_seqs=32, num_blocks=2048) as llm:
        assert isinstance(llm.engine.executor._worker.runner.model, FusedOuroModel) == fused
        recorded = _record_logits(llm)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.engine.executor._worker.runner.graph_stats
    _free_cuda()
    return recorded, outputs, stats


def test_bf16_logits_fused_vs_torch_modules() -> None:
    rng = random.Random(32)
    prompts = [[rng.randrange(49152) for _ in range(rng.randint(8, 300))] for _ in range(32)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want, want_out, _ = _bf16_run(False, prompts, params)
    got, got_out, stats = _bf16_run(True, prompts, params)
    print(f"\nfused bf16 graph counters: {stats}")
    # Mixed passes' graphs are captured at first use (rlt_worker/mixed_graphs.py), no other graph.
    assert stats["lazy_captures"] == stats["mixed_captures"] and stats["eager_passes"] == 0, stats
    assert stats["replays"] > 0, stats
    assert set(want) == set(got) and len(want) == 32 * 6
    # Compare where both paths fed the same tokens back.
    first_diff = {key: next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y),
                            len(a.token_ids))
                  for key, (a, b) in enumerate(zip(want_out, got_out, strict=True), start=1)}
    worst_cos, worst_rel, compared, clear, equal = 1.0, 0.0, 0, 0, 0
    for (key, index), ref in want.items():
        if index > first_diff[key]:
            continue
        logits = got[(key, index)]
        assert torch.isfinite(logits).all()
        compared += 1
        worst_cos = min(worst_cos, float(torch.nn.functional.cosine_similarity(ref, logits, dim=0)))
        worst_rel = max(worst_rel, float((ref - logits).abs().max() / ref.abs().max()))
        top = ref.topk(2).values
        if float(top[0] - top[1]) > 0.5:
            clear += 1
            equal += int(ref.argmax() == logits.argmax())
    diverged = sorted(i for i in first_diff.values() if i < params.max_tokens)
    print(f"fused vs torch modules, bf16, 32 × 6: {compared} CODA rows, worst cosine {worst_cos:.5f}, worst "
          f"max|Δ|/max|logit| {worst_rel:.4f}, argmax equal on {equal}/{clear} clear rows; diverged at {diverged}")
    assert compared >= 32
    assert worst_cos > 0.99 and worst_rel < 0.1
    assert equal == clear
