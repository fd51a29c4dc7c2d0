"""rlt-bench throughput runs on the CPU with the toy model and tiny sizes (the GPU grid is a benchmark)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from protocol.messages import PrefillBatch
from rlt_engine.bench.throughput import (
    KL_THRESHOLD,
    Workload,
    codas_per_token,
    depth_weights,
    make_jobs,
    parse_args,
    token_bytes,
)
from rlt_engine.cli import main
from rlt_worker.models.config import load_config
from rlt_worker.models.loader import build_model
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
        assert run["early_results"] == 0  # one pass a plan on the CPU: these requests end in their plan's last
    assert "| workers | exit |" in capsys.readouterr().out
    # The bench runs in float32 here, so the gate judged the timed configuration itself (no divergence report).
    assert {key: (g["dtype"], g["equal"], g["failures"], "divergence" in g)
            for key, g in payload["meta"]["gate"].items()} == {
        f"workers=0,exit={mode}": ("float32", 8, [], False) for mode in ("fixed", "trace", "ouro")
    }


def test_runs_count_early_results(tmp_path, one_thread: None) -> None:
    """Several passes a plan: requests that end while others loop on come back in early results, which
    each run counts."""
    out = tmp_path / "bench.json"
    assert main([*TOY_GRID, "--concurrency", "4", "--exit", "trace", "--loops-per-plan", "16", "--no-gate",
                 "--json", str(out)]) == 0
    (result,) = json.loads(out.read_text())["results"]
    assert result["runs"][0]["early_results"] > 0


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


def test_shared_prefix_workloads_with_and_without_caching(tmp_path, one_thread: None) -> None:
    """Four requests whose 24-token prompts share 16 tokens (one 16-position block): with caching
    the three that follow the first find its block (48 of 96 prompt tokens), without it none do."""
    out = tmp_path / "bench.json"
    argv = [*TOY_GRID, "--prompt-len", "24", "--shared-prefix-len", "16", "--output-len", "2", "--concurrency", "4",
            "--requests-factor", "1", "--exit", "shared_prefix_cached,shared_prefix_uncached", "--no-gate",
            "--no-warmup", "--json", str(out)]
    assert main(argv) == 0
    results = {r["exit_mode"]: r for r in json.loads(out.read_text())["results"]}
    for r in results.values():
        (run,) = r["runs"]
        assert r["error"] is None and run["finished"] == 4 and run["output_tokens"] == 8
        assert run["loops_per_token"] == 4.0  # exit fixed
    assert results["shared_prefix_cached"]["median"]["prefix_cache_hit_ratio"] == 0.5
    assert results["shared_prefix_uncached"]["median"]["prefix_cache_hit_ratio"] == 0.0
    jobs = make_jobs(3, 24, 1000, Workload(2, "fixed", 4, shared_prefix_len=16), seed=1)
    assert jobs[0].prompt[:16] == jobs[1].prompt[:16] == jobs[2].prompt[:16] and jobs[0].prompt != jobs[1].prompt
    with pytest.raises(SystemExit):
        parse_args(["--exit", "shared_prefix_cached", "--prompt-len", "16", "--shared-prefix-len", "16"])


def test_mixed_workloads_run_an_engine_with_mixed_batches(tmp_path, one_thread: None) -> None:
    """`ouro_mixed` is `ouro` on an engine with mixed_batches and `ouro_separate` one without (here, on
    the CPU, the default too): gated against the same torch-path reference (8 equal), measured side by
    side in one grid."""
    out = tmp_path / "bench.json"
    argv = [*TOY_GRID, "--prompt-len", "40", "--prefill-chunk-size", "8", "--concurrency", "4", "--exit",
            "ouro,ouro_mixed,ouro_separate", "--no-warmup", "--json", str(out)]
    assert main(argv) == 0
    payload = json.loads(out.read_text())
    assert [r["exit_mode"] for r in payload["results"]] == ["ouro", "ouro_mixed", "ouro_separate"]
    assert {key: e["mixed_batches"] for key, e in payload["meta"]["engine"].items()} == {
        "workers=0,exit=ouro": False, "workers=0,exit=ouro_mixed": True, "workers=0,exit=ouro_separate": False}
    assert {key: g["equal"] for key, g in payload["meta"]["gate"].items()} == {
        "workers=0,exit=ouro": 8, "workers=0,exit=ouro_mixed": 8, "workers=0,exit=ouro_separate": 8}
    for r in payload["results"]:
        (run,) = r["runs"]
        assert run["finished"] == 8 and 1.0 <= run["loops_per_generated_token"] < 4.0


def test_uncapped_workloads_run_an_engine_without_the_prefill_cap(tmp_path, capsys: pytest.CaptureFixture[str],
                                                                  one_thread: None) -> None:
    """`trace_uncapped` is `trace` on an engine with max_prefill_tokens_while_decoding = 0, beside one
    with the flag's cap, gated against the same reference; the end of the run prints the pair."""
    out = tmp_path / "bench.json"
    argv = [*TOY_GRID, "--prompt-len", "40", "--prefill-chunk-size", "8", "--concurrency", "4", "--exit",
            "trace,trace_uncapped", "--max-prefill-tokens-while-decoding", "8", "--no-warmup", "--json", str(out)]
    assert main(argv) == 0
    payload = json.loads(out.read_text())
    assert [r["exit_mode"] for r in payload["results"]] == ["trace", "trace_uncapped"]
    assert {key: e["max_prefill_tokens_while_decoding"] for key, e in payload["meta"]["engine"].items()} == {
        "workers=0,exit=trace": 8, "workers=0,exit=trace_uncapped": 0}
    assert {key: g["equal"] for key, g in payload["meta"]["gate"].items()} == {
        "workers=0,exit=trace": 8, "workers=0,exit=trace_uncapped": 8}
    for r in payload["results"]:
        (run,) = r["runs"]
        assert run["finished"] == 8 and 1.0 <= run["loops_per_generated_token"] < 4.0
    assert "trace / trace_uncapped (prefill cap on / off), workers=0 c=4: ITL p99/p50" in capsys.readouterr().err


def test_kv_layout_reaches_the_engines_and_the_gate(tmp_path, one_thread: None) -> None:
    """`--kv-layout shared` builds one-plane engines, gated against a SHARED torch-path reference."""
    out = tmp_path / "bench.json"
    argv = [*TOY_GRID, "--concurrency", "2", "--exit", "prefill,trace", "--kv-layout", "shared", "--no-warmup",
            "--json", str(out)]
    assert main(argv) == 0
    payload = json.loads(out.read_text())
    assert payload["meta"]["conditions"]["kv_layout"] == "shared"
    assert {e["num_planes"] for e in payload["meta"]["engine"].values()} == {1}
    assert {key: g["equal"] for key, g in payload["meta"]["gate"].items()} == {
        "workers=0,exit=prefill": 8, "workers=0,exit=trace": 8}
    assert [r["runs"][0]["finished"] for r in payload["results"]] == [4, 4]


def test_replay_runs_trace_over_the_gate_workloads_depths(tmp_path, one_thread: None, capsys) -> None:
    """`ouro_replay` is trace over the exit depths ouro gave each request: the same loops per token
    (so the throughput ratio is the gate's cost alone); without ouro before it, it fails and says why."""
    out = tmp_path / "bench.json"
    argv = [*TOY_GRID, "--concurrency", "2", "--exit", "ouro,ouro_replay", "--no-warmup", "--json", str(out)]
    assert main(argv) == 0
    ouro, replay = json.loads(out.read_text())["results"]
    assert replay["exit_mode"] == "ouro_replay" and replay["error"] is None
    for key in ("loops_per_token", "loops_per_generated_token"):
        assert replay["runs"][0][key] == ouro["runs"][0][key]
    assert 1.0 < ouro["runs"][0]["loops_per_generated_token"] < 4.0  # the gate chose: not trivially D
    assert "ouro / ouro_replay (trace over ouro's exit depths), workers=0 c=2:" in capsys.readouterr().err
    alone = tmp_path / "alone.json"
    assert main([*TOY_GRID, "--concurrency", "2", "--exit", "ouro_replay", "--no-warmup", "--json", str(alone)]) == 0
    (result,) = json.loads(alone.read_text())["results"]
    assert result["runs"] == [] and "list ouro before ouro_replay" in result["error"]


def test_shallow_gives_the_per_loop_cost_and_trace_its_share_of_the_ideal(tmp_path, one_thread: None,
                                                                          capsys) -> None:
    out = tmp_path / "bench.json"
    argv = [*TOY_GRID, "--concurrency", "2", "--exit", "fixed,trace,shallow", "--no-warmup", "--json", str(out)]
    assert main(argv) == 0
    by_mode = {r["exit_mode"]: r["median"] for r in json.loads(out.read_text())["results"]}
    assert by_mode["shallow"]["loops_per_generated_token"] == 1.0
    assert by_mode["fixed"]["loops_per_generated_token"] == 4.0
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("trace speed-up over fixed")]
    assert "workers=0 c=2" in line and "of an ideal" in line


def test_loop_speedups_arithmetic() -> None:
    """A run exactly on the line through fixed and shallow reaches 100% of the ideal; 0.9× its speed, 90%."""
    from rlt_engine.bench.throughput import ConfigResult, loop_speedups

    def result(mode: str, tps: float, loops: float) -> ConfigResult:
        r = ConfigResult(0, mode, 32, runs=[{}])
        r.median = {"tokens_per_s": tps, "loops_per_generated_token": loops}
        return r

    t_d, t_1 = 1 / 100, 1 / 250  # s per token at 4 loops and at 1
    t_ideal = t_1 + 1.5 * (t_d - t_1) / 3  # at 2.5 loops
    for speed, share in ((1.0, "100.0%"), (0.9, "90.0%")):
        (line,) = loop_speedups([result("fixed", 100, 4.0), result("shallow", 250, 1.0),
                                 result("trace", speed / t_ideal, 2.5)])
        assert line.endswith(share), line


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
    (ouro,) = make_jobs(1, 4, 1000, Workload(8, "ouro", 4, threshold=0.6), seed=1)
    assert ouro.params.exit_threshold == 0.6 and ouro.params.exit_depths is None
    # D = 32 and no --trace-mean: uniform over 1 … 32.
    deep = [d for j in make_jobs(64, 4, 1000, Workload(128, "trace", 32), seed=1) for d in j.params.exit_depths[1:]]
    assert set(deep) == set(range(1, 33)) and sum(deep) / len(deep) == pytest.approx(16.5, abs=0.3)
    # Ouro-1.4B in bf16: 2.47 GB per loop (24 layers), a 201 MB head, 196,608 B of K/V per position and loop.
    tb = token_bytes(synthetic_config("synthetic-ouro-1.4b"), 2)
    assert tb.loop_weights == 2 * (24 * (4 * 2048 * 2048 + 3 * 2048 * 5632 + 4 * 2048) + 2048)
    assert tb.coda_weights == 2 * 49152 * 2048
    assert tb.kv_per_position_loop == 24 * 2 * 16 * 128 * 2
    assert tb.prelude_weights == tb.kv_per_position_prelude == tb.kv_per_position_coda == 0


def test_huginn_bytes() -> None:
    """Huginn-0125 (SPEC §9) in bf16: the core blocks and adapter once per loop; the prelude once per
    token; ln_f, the coda blocks and the tied head once per CODA; K/V of 4 loop layers per loop, of
    the 2 prelude layers per token and of the 2 coda layers per CODA. Every weight is counted once."""
    cfg = synthetic_config("synthetic-huginn-3.5b")
    tb = token_bytes(cfg, 2)
    h, inter = 5280, 17920
    block = 3 * h * h + 2 * 55 * 96 + h * h + 2 * inter * h + inter * h + 4 * h
    assert tb.loop_weights == 2 * (4 * block + h * 2 * h)
    assert tb.prelude_weights == 2 * 2 * block
    assert tb.coda_weights == 2 * (2 * block + h + 65536 * h)
    assert tb.kv_per_position_loop == 2 * 4 * 2 * 55 * 96
    assert tb.kv_per_position_prelude == tb.kv_per_position_coda == 2 * 2 * 2 * 55 * 96
    params = sum(t.numel() for t in build_model(load_config(cfg)).state_dict().values())
    assert tb.prelude_weights + tb.loop_weights + tb.coda_weights == 2 * params  # the tied head is wte
    # Fixed 32 loops at a mean context of 576: 110.25 GB per token, 3.27 GB of it per loop.
    assert tb.per_token(32, 576) == pytest.approx(110.25e9, rel=1e-3)
    # kl runs the coda after every loop and once more to sample: 15 loops cost 88.2 GB.
    assert codas_per_token("kl", 15) == 16 and codas_per_token("latent_diff", 15) == 1
    assert tb.per_token(15, 576, codas_per_token("kl", 15)) == pytest.approx(88.2e9, rel=1e-3)


def test_family_defaults() -> None:
    """Flags left unset take the model family's grid: Ouro's, or Huginn's (512-token prompts, c 1/8/32, kl)."""
    huginn = parse_args(["--model", "synthetic-huginn-3.5b"])
    assert (huginn.exit, huginn.prompt_len, huginn.concurrency) == (["fixed", "trace", "kl"], 512, [1, 8, 32])
    assert huginn.kl_threshold == KL_THRESHOLD and huginn.trace_mean is None
    ouro = parse_args([])
    assert (ouro.exit, ouro.prompt_len, ouro.concurrency) == (["fixed", "trace", "ouro"], 1024, [1, 32, 128])
    given = parse_args(["--model", "toy-huginn", "--exit", "latent_diff", "--prompt-len", "7"])
    assert (given.exit, given.prompt_len, given.concurrency) == (["latent_diff"], 7, [1, 8, 32])


def test_cpu_toy_huginn_signal_grid(tmp_path, one_thread: None) -> None:
    """kl and latent_diff workloads on toy-huginn: every run completes, the signals exit early, the gate
    passes, and the c = 1 floor counts a CODA per loop under kl."""
    out = tmp_path / "bench.json"
    argv = [*TOY_GRID, "--model", "toy-huginn", "--concurrency", "1", "--exit", "kl,latent_diff", "--no-warmup",
            "--kl-threshold", "0.3", "--latent-threshold", "0.3", "--json", str(out)]
    assert main(argv) == 0
    payload = json.loads(out.read_text())
    results = payload["results"]
    assert [(r["exit_mode"], r["concurrency"]) for r in results] == [("kl", 1), ("latent_diff", 1)]
    for r in results:
        (run,) = r["runs"]
        assert r["error"] is None and run["finished"] == run["requests"] and run["output_tokens"] == 8 * run["requests"]
        assert 1.0 <= run["loops_per_generated_token"] < 6.0
    floors = {r["exit_mode"]: r["floor"] for r in results}
    assert floors["kl"]["codas_per_token"] == floors["kl"]["loops_per_token"] + 1
    assert floors["latent_diff"]["codas_per_token"] == 1
    assert {key: (g["equal"], g["failures"]) for key, g in payload["meta"]["gate"].items()} == {
        f"workers=0,exit={mode}": (8, []) for mode in ("kl", "latent_diff")
    }


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
    reference whose token 2 was replaced fails, with the reference's top-two gap there and the
    engine's real logprob gap, unless that top-two gap is within the tolerance (a near-tie)."""
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
        assert "request 0: token 2" in result.failures[0] and "top-two logit gap" in result.failures[0]
        assert reference.top_gaps[0][2] > 1e-9  # the decision was clear in the reference
        lenient = gate.check(llm, altered, "float64", tolerance=1e9)
        (tie,) = lenient.near_ties
        assert lenient.passed and tie["index"] == 2 and tie["margin"] == reference.top_gaps[0][2]
        assert tie["engine_gap"] > 0  # the engine's token beats the altered one under the engine
        # A near-tie is the reference's to declare: the same flip passes at the default tolerance
        # only where the reference's own top two were within it.
        gaps = [row[:] for row in reference.top_gaps]
        gaps[0][2] = 0.0
        assert gate.check(llm, dataclasses.replace(altered, top_gaps=gaps), "float64").passed
        # The same difference, reported (never failed) for another dtype: its gap in ulps of the top logit.
        report = gate.divergence(llm, altered, "bfloat16")
        (first,) = report.first
        assert report.equal == 2 and first["request"] == 0 and first["index"] == 2
        top = reference.top_logits[0][2]
        assert first["top_logit"] == top
        assert first["gap_ulps"] == pytest.approx(first["gap_nats"] / gate.ulp(top, "bfloat16"))


def test_near_tie_is_the_reference_margin_or_the_engines_measured_disagreement() -> None:
    """A flip is excused by a reference margin within the tolerance, or within the engine's own
    disagreement between two runs (a negative gap: the H200 float32 case at the 1.4B shape had
    margin 1.77e-4 and engine gap −4.29e-4); an engine that prefers its token never excuses it."""
    from rlt_engine.bench.gate import is_near_tie

    assert is_near_tie(5e-5, 0.3, 1e-4)
    assert is_near_tie(1.77e-4, -4.29e-4, 1e-4)
    assert not is_near_tie(1.77e-4, -1e-4, 1e-4)
    assert not is_near_tie(1.77e-4, 2e-3, 1e-4)


def test_ulp() -> None:
    from rlt_engine.bench import gate

    assert gate.ulp(16.0, "bfloat16") == gate.ulp(31.9, "bfloat16") == 0.125  # one ulp at |logit| 16–32
    assert gate.ulp(-1.5, "bfloat16") == 2.0**-7 and gate.ulp(1.0, "float32") == 2.0**-23


def run_script(name: str, *args: str, timeout: float) -> None:
    """Run scripts/<name> with this interpreter from the repository root; it must exit 0."""
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "scripts" / name), *args], cwd=root, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr


def test_calibrate_threshold_script(tmp_path) -> None:
    """scripts/calibrate_threshold.py measures mean loops per generated token per threshold (toy-huginn, kl)."""
    out = tmp_path / "kl.json"
    run_script("calibrate_threshold.py", "--model", "toy-huginn", "--device", "cpu", "--requests", "2",
               "--prompt-len", "6", "--output-len", "5", "--thresholds", "0.3,0.05", "--json", str(out), timeout=120)
    payload = json.loads(out.read_text())
    assert payload["exit_mode"] == "kl" and [r["threshold"] for r in payload["rows"]] == [0.3, 0.05]
    low, high = (r["mean_loops"] for r in payload["rows"])
    assert 1 <= low <= high <= 6 and sum(payload["rows"][0]["histogram"].values()) == 2 * 4


def test_profile_steps_script(tmp_path) -> None:
    """scripts/profile_steps.py: one request's steps and a burst's first tokens per exit mode (toy-ouro, CPU)."""
    out = tmp_path / "steps.json"
    run_script("profile_steps.py", "--device", "cpu", "--model", "toy-ouro", "--exits", "trace,ouro",
               "--prompt-len", "24", "--output-len", "6", "--burst", "4", "--json", str(out), timeout=180)
    reports = json.loads(out.read_text())["reports"]
    assert [r["exit"] for r in reports] == ["trace", "ouro"]
    for r in reports:
        assert r["ttft_ms"] > 0 and r["steps"] >= 1 and r["host_top"]
        assert r["burst"]["ttft_p50_ms"] > 0 and sum(new for _, new, _ in r["burst"]["steps"]) == 4


def test_profile_mixed_script(tmp_path) -> None:
    """scripts/profile_mixed.py: a closed loop's tok/s and host profile with mixed batches (toy-ouro, CPU)."""
    run_script("profile_mixed.py", str(tmp_path), "--model", "toy-ouro", "--device", "cpu", "--prompt-len", "24",
               "--output-len", "4", "--concurrency", "4", "--skip", "2", "--window", "4", timeout=180)
    report = json.loads((tmp_path / "profile_mixed.json").read_text())
    assert report["mixed"] and report["timed_tok_s"] > 0 and report["host_ops"], report.keys()
    assert "closed_loop" in report["cprofile_cumulative"]


def test_warm_up_per_concurrency_rides_chunks(tmp_path, monkeypatch: pytest.MonkeyPatch, one_thread: None) -> None:
    """The per-concurrency warm-up sends prompts while others decode, as a timed run does, so mixed passes
    (whose graphs are captured at first use on CUDA) run there before any timed run."""
    from rlt_engine.bench.throughput import Grid

    riding: dict[int, int] = {}
    warm_up_at = Grid._warm_up_at

    def counting(self, engine, exit_mode: str, c: int) -> None:
        def listener(worker: int, plan) -> None:
            riding[c] = riding.get(c, 0) + sum(isinstance(b, PrefillBatch) and b.rides_loop_passes
                                                for b in plan.batches)
        engine.add_plan_listener(listener)
        try:
            warm_up_at(self, engine, exit_mode, c)
        finally:
            engine._plan_listeners.remove(listener)

    monkeypatch.setattr(Grid, "_warm_up_at", counting)
    out = tmp_path / "bench.json"
    assert main([*TOY_GRID, "--concurrency", "4", "--exit", "trace_mixed", "--no-gate", "--json", str(out)]) == 0
    assert riding.get(4, 0) > 0, riding
    (result,) = json.loads(out.read_text())["results"]
    assert result["runs"][0]["finished"] == 8


def test_profile_itl_script(tmp_path) -> None:
    """scripts/profile_itl.py: the steps inside a closed loop's slow and typical gaps (toy-ouro, CPU)."""
    run_script("profile_itl.py", str(tmp_path), "--model", "toy-ouro", "--device", "cpu", "--prompt-len", "24",
               "--output-len", "6", "--concurrency", "4", "--variants", "plain,gc_frozen", timeout=180)
    variants = json.loads((tmp_path / "profile_itl.json").read_text())["variants"]
    assert set(variants) == {"plain", "gc_frozen"}
    for v in variants.values():
        assert v["tok_s"] > 0 and v["itl_p99_ms"] >= v["itl_p50_ms"] > 0
        assert abs(v["recomputed_p99_ms"] - v["itl_p99_ms"]) <= 0.05 * v["itl_p99_ms"]  # the same gaps
        assert v["slow_gaps"]["gaps"] >= 1 and v["slow_gaps"]["steps"] >= 1 and v["slowest"][0]["steps"]
    plain = variants["plain"]
    assert plain["slow_gaps"]["riding_tokens"] == 0
    assert any("prefill" in kind for kind in plain["step_table"]["by_kind"])
    assert sum(v["steps"] for v in plain["step_table"]["by_kind"].values()) == plain["steps"]


def test_recorded_commit_says_when_the_tree_is_not_head(tmp_path: Path) -> None:
    """The bench's commit is HEAD's short hash, with -dirty once a tracked file differs from HEAD (as on
    a device copy whose git HEAD is older than its files); untracked files do not count; no repo: None."""
    from rlt_engine.bench.throughput import _git_commit

    def git(*args: str) -> str:
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                              check=True, capture_output=True, text=True).stdout.strip()

    assert _git_commit(str(tmp_path)) is None
    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("commit", "-qm", "a")
    head = git("rev-parse", "--short", "HEAD")
    (tmp_path / "notes.txt").write_text("untracked\n")
    assert _git_commit(str(tmp_path)) == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert _git_commit(str(tmp_path)) == f"{head}-dirty"
