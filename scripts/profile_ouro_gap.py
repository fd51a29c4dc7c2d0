"""Where one request's decode time goes at c = 1, ouro against trace: GPU busy against idle (the profiler's
kernel intervals: their union, and the gaps between them over 20 µs, with the activities on either side
of them), the kernels by total GPU time, and the host's Python (cProfile).

    python scripts/profile_ouro_gap.py OUT_DIR [MODES]   # CUDA; writes OUT_DIR/ouro_gap.json

MODES: exit modes, comma-separated (default ouro,trace; fixed too, say).

Each mode runs two warm-up requests, one timed, one under the profiler and one under cProfile
(1,024-token prompt, 128 outputs, greedy; ouro at the bench's default threshold).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import subprocess
import sys
import time

from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from rlt_engine.bench.throughput import OURO_THRESHOLD, Workload, make_jobs
from rlt_engine.llm import LLM

GAP_US = 20.0
TOP_KERNELS = 25  # kernels by total GPU time in the profiled request
TOP_GAP_PAIRS = 12  # (activity before, activity after) pairs of the gaps over GAP_US, by their total


def add_closed_loop_args(p: argparse.ArgumentParser, mixed: bool) -> None:
    """The options closed_loop_engine reads (`mixed`: --mixed's default)."""
    p.add_argument("--exit", default="trace")
    p.add_argument("--mixed", action=argparse.BooleanOptionalAction, default=mixed, help="--mixed-batches")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--model", default="synthetic-ouro-1.4b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)


def closed_loop_engine(args: argparse.Namespace) -> tuple[LLM, list]:
    """The in-process engine (workers = 0) and the 2·c jobs of the bench's closed loop for a profile
    script's args (add_closed_loop_args); trace at mean 2.5, ouro at the bench's threshold."""
    c = args.concurrency
    llm = LLM(args.model, device=args.device, exit_mode=args.exit, workers=0, mixed_batches=args.mixed,
              max_num_seqs=max(64, c))  # the default 64 would queue the rest (the bench's rule: max(concurrency))
    engine = llm.engine
    work = Workload(args.output_len, args.exit, engine.config.max_loops or 4,
                    trace_mean=2.5 if args.exit == "trace" else None,
                    threshold=OURO_THRESHOLD if args.exit == "ouro" else None)
    return llm, make_jobs(2 * c, args.prompt_len, engine.model_info.vocab_size, work, seed=7)


def run_request(engine, job, request_id: str) -> tuple[int, float]:
    """(tokens, ms from the first token to the last) of one request run alone."""
    engine.add_request(request_id, job.prompt, job.params)
    tokens, first = 0, None
    while engine.has_unfinished_requests():
        tokens = max([tokens] + [o.num_tokens for o in engine.step()])  # num_tokens: the request's so far
        if first is None and tokens:
            first = time.perf_counter()
    return tokens, (time.perf_counter() - first) * 1e3


def kernel_timeline(prof) -> dict[str, float]:
    """The union of the kernels' intervals and the gaps over GAP_US between them, in ms; and which
    device activities (kernels, copies) end and start the gaps over GAP_US, by pair."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == DeviceType.CUDA)
    busy, gaps = 0.0, []
    pairs: dict[tuple[str, str], list[float]] = {}
    start, end, last = spans[0]
    for s, e, name in spans[1:]:
        if s > end:
            busy, gaps = busy + end - start, gaps + [s - end]
            if s - end > GAP_US:
                pairs.setdefault((last[:60], name[:60]), []).append(s - end)
            start, end, last = s, e, name
        elif e >= end:
            end, last = e, name
    busy += end - start
    big = [g for g in gaps if g > GAP_US]
    by_name: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            by_name.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:TOP_KERNELS]
    return {"profiled_span_ms": (spans[-1][1] - spans[0][0]) / 1e3, "gpu_busy_ms": busy / 1e3,
            "gaps_over_20us": len(big), "gap_ms_over_20us": sum(big) / 1e3,
            "gap_median_us": statistics.median(big) if big else 0.0, "kernels": len(spans),
            "top_kernels": [{"name": name[:90], "count": len(d), "total_ms": round(sum(d) / 1e3, 3)}
                            for name, d in top],
            "gap_pairs": [{"before": b, "after": a, "count": len(g), "total_ms": round(sum(g) / 1e3, 3),
                           "median_us": round(statistics.median(g), 1)}
                          for (b, a), g in sorted(pairs.items(), key=lambda kv: -sum(kv[1]))[:TOP_GAP_PAIRS]]}


def cprofile_table(fn, sort: str, lines: int) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats(sort).print_stats(lines)
    return text.getvalue()


def profile_mode(mode: str) -> dict:
    llm = LLM("synthetic-ouro-1.4b", device="cuda", exit_mode=mode, workers=0)
    engine = llm.engine
    work = Workload(128, mode, 4, threshold=OURO_THRESHOLD if mode == "ouro" else None)
    jobs = make_jobs(5, 1024, engine.model_info.vocab_size, work, seed=3)
    run_request(engine, jobs[0], "warm-0")
    run_request(engine, jobs[1], "warm-1")
    tokens, ms = run_request(engine, jobs[2], "timed")
    report = {"tokens": tokens, "decode_ms": ms, "ms_per_token": ms / max(tokens - 1, 1)}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_request(engine, jobs[3], "profiled")
    report |= kernel_timeline(prof)
    report["cprofile"] = cprofile_table(lambda: run_request(engine, jobs[4], "cprofiled"), "cumulative", 45)
    llm.close()
    return report


def main(argv: list[str]) -> None:
    """OUT_DIR [MODES]: each mode in a child process (OUT_DIR --mode MODE prints its report as JSON), then
    OUT_DIR/ouro_gap.json. A child per mode, so that neither mode's profile sees the other's
    allocator state or compiled kernels (and, before Worker.close freed its runner itself, the second
    engine found the first's KV pool still taken: docs/benchmarks.md)."""
    if len(argv) == 3 and argv[1] == "--mode":
        print(json.dumps(profile_mode(argv[2])))
        return
    if not 1 <= len(argv) <= 2:
        raise SystemExit("usage: profile_ouro_gap.py OUT_DIR [MODES]")
    report = {}
    for mode in (argv[1] if len(argv) == 2 else "ouro,trace").split(","):
        child = subprocess.run([sys.executable, __file__, argv[0], "--mode", mode], check=True,
                               stdout=subprocess.PIPE, text=True)
        report[mode] = json.loads(child.stdout.strip().splitlines()[-1])
        print(mode, json.dumps({k: v for k, v in report[mode].items() if k != "cprofile"}), flush=True)
    with open(f"{argv[0]}/ouro_gap.json", "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
