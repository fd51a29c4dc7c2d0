"""rlt-bench throughput runs on the CPU with the toy model and tiny sizes (the GPU grid is a benchmark)."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from rlt_engine.bench.throughput import Workload, depth_weights, make_jobs, token_bytes
from rlt_engine.cli import main
from rlt_worker.models.synthetic import synthetic_config


@pytest.fixture
def one_thread():
    """The toy model's tensors are tiny: intra-op threads only add overhead on a small CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


TOY_GRID = ["bench", "throughput", "--model", "toy-ouro", "--device", "cpu", "--prompt-len", "16",
            "--output-len", "8", "--workers", "0", "--repeats", "1"]


def test_cpu_toy_grid(tmp_path, capsys: pytest.CaptureFixture[str], one_thread: None) -> None:
    out = tmp_path / "bench.json"
    assert main([*TOY_GRID, "--concurrency", "1,4", "--json", str(out)]) == 0
    payload = json.loads(out.read_text())
    results = payload["results"]
    assert [(r["exit_mode"], r["concurrency"]) for r in results] == [
        ("fixed", 1), ("fixed", 4), ("trace", 1), ("trace", 4), ("ouro", 1), ("ouro", 4)
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
    # The bench runs in float32 here, so the gate judged the timed configuration itself (no divergence report).
    assert {key: (g["dtype"], g["equal"], g["failures"], "divergence" in g)
            for key, g in payload["meta"]["gate"].items()} == {
        f"workers=0,exit={mode}": ("float32", 8, [], False) for mode in ("fixed", "trace", "ouro")
    }


def test_resume_runs_only_what_is_missing(tmp_path, one_thread: None) -> None:
    """--resume keeps the measured configurations of the --json file and adds the rest, gate included."""
    out = tmp_path / "bench.json"
    assert main([*TOY_GRID, "--concurrency", "1", "--exit", "trace", "--json", str(out)]) == 0
    first = json.loads(out.read_text())["results"]
    assert main([*TOY_GRID, "--concurrency", "1,2", "--exit", "trace,fixed", "--json", str(out), "--resume"]) == 0
    payload = json.loads(out.read_text())
    results = payload["results"]
    assert [(r["exit_mode"], r["concurrency"]) for r in results] == [
        ("trace", 1), ("trace", 2), ("fixed", 1), ("fixed", 2)
    ]
    assert results[0] == first[0]  # kept as measured, not run again
    assert set(payload["meta"]["gate"]) == {"workers=0,exit=trace", "workers=0,exit=fixed"}
    assert [i["exit"] for i in payload["meta"]["invocations"]] == [["trace"], ["trace", "fixed"]]
    # The prefill workload joins the same file: one output token per request, prompt tokens/s.
    assert main([*TOY_GRID, "--concurrency", "2", "--exit", "prefill", "--json", str(out), "--resume"]) == 0
    prefill = json.loads(out.read_text())["results"][-1]
    (run,) = prefill["runs"]
    assert prefill["exit_mode"] == "prefill" and run["output_tokens"] == run["requests"] == 4
    assert run["prompt_tokens"] == 16 * 4 and prefill["median"]["prompt_tokens_per_s"] > 0


def test_trace_mix_and_bytes() -> None:
    weights = depth_weights(4, 2.5)
    assert weights == pytest.approx([0.25] * 4)
    assert sum(k * w for k, w in zip(range(1, 5), depth_weights(4, 3.2), strict=True)) == pytest.approx(3.2)
    trace = Workload(128, "trace", 4, 2.5)
    jobs = make_jobs(64, 4, 1000, trace, seed=1)
    depths = [d for j in jobs for d in j.params.exit_depths[1:]]
    assert all(j.params.exit_depths[0] == 4 and len(j.params.exit_depths) == 128 for j in jobs)
    assert sum(depths) / len(depths) == pytest.approx(2.5, abs=0.05)
    short = Workload(8, "trace", 4, 2.5)
    assert make_jobs(3, 4, 1000, short, seed=1) == make_jobs(3, 4, 1000, short, seed=1)
    assert [len(j.prompt) for j in make_jobs(3, [5, 1, 9], 1000, short, seed=1)] == [5, 1, 9]
    (ouro,) = make_jobs(1, 4, 1000, Workload(8, "ouro", 4, ouro_threshold=0.6), seed=1)
    assert ouro.params.exit_threshold == 0.6 and ouro.params.exit_depths is None
    # Ouro-1.4B in bf16: 2.47 GB per loop (24 layers), a 201 MB head, 196,608 B of K/V per position and loop.
    tb = token_bytes(synthetic_config("synthetic-ouro-1.4b"), 2)
    assert tb.loop_weights == 2 * (24 * (4 * 2048 * 2048 + 3 * 2048 * 5632 + 4 * 2048) + 2048)
    assert tb.head == 2 * 49152 * 2048
    assert tb.kv_per_position_loop == 24 * 2 * 16 * 128 * 2


def _gate_setup():
    from rlt_engine.bench import gate
    from rlt_engine.llm import LLM

    def make(vocab: int, depth: int) -> list[gate.GateJob]:
        jobs = make_jobs(3, 6, vocab, Workload(8, "trace", depth, 2.5), seed=5)
        return [gate.GateJob(j.prompt, j.params) for j in jobs]

    options = {"device": "cpu", "dtype": "float64"}
    reference = gate.reference_run("toy-ouro", {**options, "exit_mode": "trace"}, make, dtype="float64")
    return gate, LLM("toy-ouro", workers=0, exit_mode="trace", loops_per_plan=4, **options), reference


def test_gate_passes_an_equal_engine_and_catches_a_wrong_token(one_thread: None) -> None:
    """The gate against real outputs: an engine with multi-loop plans equals the torch path; a
    reference whose token 2 was replaced fails with the engine's real logprob gap, unless the
    tolerance allows that gap (a near-tie)."""
    gate, llm, reference = _gate_setup()
    with llm:
        assert gate.check(llm, reference, "float64").equal == 3
        wrong = reference.outputs[0].token_ids[:]
        wrong[2] = (wrong[2] + 1) % 256
        # A GenerationOutput's cumulative fields are read-only: the gate reads only these two.
        first = SimpleNamespace(token_ids=wrong, exit_depths=reference.outputs[0].exit_depths)
        altered = dataclasses.replace(reference, outputs=[first, *reference.outputs[1:]])
        result = gate.check(llm, altered, "float64")
        assert not result.passed and result.equal == 2
        assert "request 0: token 2" in result.failures[0] and "logprob gap" in result.failures[0]
        lenient = gate.check(llm, altered, "float64", tolerance=1e9)
        assert lenient.passed and lenient.near_ties[0]["index"] == 2 and lenient.near_ties[0]["margin"] > 0
        # The same difference, reported (never failed) for another dtype: its gap in ulps of the top logit.
        report = gate.divergence(llm, altered, "bfloat16")
        (first,) = report.first
        assert report.equal == 2 and first["request"] == 0 and first["index"] == 2
        top = reference.top_logits[0][2]
        assert first["top_logit"] == top
        assert first["gap_ulps"] == pytest.approx(first["gap_nats"] / gate.ulp(top, "bfloat16"))


def test_ulp() -> None:
    from rlt_engine.bench import gate

    assert gate.ulp(16.0, "bfloat16") == gate.ulp(31.9, "bfloat16") == 0.125  # one ulp at |logit| 16–32
    assert gate.ulp(-1.5, "bfloat16") == 2.0**-7 and gate.ulp(1.0, "float32") == 2.0**-23
