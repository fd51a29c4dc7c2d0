"""rlt-bench throughput runs on the CPU with the toy model and tiny sizes (the GPU grid is a benchmark)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from rlt_engine.bench.throughput import depth_weights, make_jobs, token_bytes
from rlt_engine.cli import main
from rlt_worker.models.synthetic import synthetic_config


@pytest.fixture
def one_thread():
    """The toy model's tensors are tiny: intra-op threads only add overhead on a small CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_cpu_toy_grid(tmp_path, capsys: pytest.CaptureFixture[str], one_thread: None) -> None:
    out = tmp_path / "bench.json"
    code = main(["bench", "throughput", "--model", "toy-ouro", "--device", "cpu", "--prompt-len", "16",
                 "--output-len", "8", "--concurrency", "1,4", "--workers", "0", "--repeats", "1",
                 "--json", str(out)])
    assert code == 0
    payload = json.loads(out.read_text())
    results = payload["results"]
    assert [(r["exit_mode"], r["concurrency"]) for r in results] == [
        ("fixed", 1), ("fixed", 4), ("trace", 1), ("trace", 4)
    ]
    for r in results:
        (run,) = r["runs"]
        assert r["error"] is None and not run["partial"]
        assert run["finished"] == run["requests"] == 2 * r["concurrency"]
        assert run["output_tokens"] == 8 * run["requests"]
        assert run["tokens_per_s"] > 0 and run["ttft_p50_s"] > 0 and run["itl_p99_s"] >= run["itl_p50_s"] > 0
        if r["exit_mode"] == "fixed":
            assert run["loops_per_token"] == 4.0
        else:
            assert 1.0 <= run["loops_per_generated_token"] < 4.0
        assert (r["floor"] is not None) == (r["concurrency"] == 1)
    assert "| workers | exit |" in capsys.readouterr().out
    assert {key: (g["equal"], g["failures"]) for key, g in payload["meta"]["gate"].items()} == {
        "workers=0,exit=fixed": (8, []), "workers=0,exit=trace": (8, []),
    }


def test_trace_mix_and_bytes() -> None:
    weights = depth_weights(4, 2.5)
    assert weights == pytest.approx([0.25] * 4)
    assert sum(k * w for k, w in zip(range(1, 5), depth_weights(4, 3.2), strict=True)) == pytest.approx(3.2)
    jobs = make_jobs(64, 4, 128, 1000, "trace", 4, 2.5, seed=1)
    depths = [d for j in jobs for d in j.params.exit_depths[1:]]
    assert all(j.params.exit_depths[0] == 4 and len(j.params.exit_depths) == 128 for j in jobs)
    assert sum(depths) / len(depths) == pytest.approx(2.5, abs=0.05)
    assert make_jobs(3, 4, 8, 1000, "trace", 4, 2.5, seed=1) == make_jobs(3, 4, 8, 1000, "trace", 4, 2.5, seed=1)
    # Ouro-1.4B in bf16: 2.47 GB per loop (24 layers), a 201 MB head, 196,608 B of K/V per position and loop.
    tb = token_bytes(synthetic_config("synthetic-ouro-1.4b"), 2)
    assert tb.loop_weights == 2 * (24 * (4 * 2048 * 2048 + 3 * 2048 * 5632 + 4 * 2048) + 2048)
    assert tb.head == 2 * 49152 * 2048
    assert tb.kv_per_position_loop == 24 * 2 * 16 * 128 * 2


def _gate_setup():
    from rlt_engine.bench import gate
    from rlt_engine.llm import LLM

    def make(vocab: int, depth: int) -> list[gate.GateJob]:
        return [gate.GateJob(j.prompt, j.params) for j in make_jobs(3, 6, 8, vocab, "trace", depth, 2.5, seed=5)]

    options = {"device": "cpu", "dtype": "float64"}
    jobs, reference = gate.reference_run("toy-ouro", {**options, "exit_mode": "trace"}, make)
    return gate, LLM("toy-ouro", workers=0, exit_mode="trace", loops_per_plan=4, **options), jobs, reference


def test_gate_passes_an_equal_engine_and_catches_a_wrong_token(one_thread: None) -> None:
    """The gate against real outputs: an engine with multi-loop plans equals the torch path; a
    reference whose token 2 was replaced fails with the engine's real logprob gap, unless the
    tolerance allows that gap (a near-tie)."""
    gate, llm, jobs, reference = _gate_setup()
    with llm:
        assert gate.check(llm, jobs, reference, "float64").equal == 3
        wrong = reference[0].token_ids[:]
        wrong[2] = (wrong[2] + 1) % 256
        altered = [SimpleNamespace(token_ids=wrong, exit_depths=reference[0].exit_depths), *reference[1:]]
        result = gate.check(llm, jobs, altered, "float64")
        assert not result.passed and result.equal == 2
        assert "request 0: token 2" in result.failures[0] and "logprob gap" in result.failures[0]
        lenient = gate.check(llm, jobs, altered, "float64", tolerance=1e9)
        assert lenient.passed and lenient.near_ties[0]["index"] == 2 and lenient.near_ties[0]["margin"] > 0
