"""rlt-bench throughput runs on the CPU with the toy model and tiny sizes (the GPU grid is a benchmark)."""

from __future__ import annotations

import json

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
