"""Engine steps of one request and of a burst, per exit mode: where a token's time goes between plans.

Run on the GPU host (one command; about a minute and a half for trace and ouro at the defaults):

    python scripts/profile_steps.py [--exits trace,ouro] [--burst 128] [--json $OUT/steps.json]

For each exit mode it builds an in-process engine (`workers=0`, the engine's CUDA defaults) on
`--model`, then

- one request of `--prompt-len` random tokens and `--output-len` outputs (greedy, after two
  warm-up requests): its TTFT, how many engine steps it took and each of the first steps' wall
  time with the tokens delivered so far (a multi-token plan shows as a long step with many);
- the same request once more under torch.profiler: the top host calls by self CPU time (blocking
  readbacks show as cudaMemcpyAsync / cudaStreamSynchronize) and the top kernels by GPU time;
- `--burst` requests added at once: the TTFT p50 of their first tokens and, per step, its wall
  time, the first tokens it delivered and the tokens delivered so far.

Trace runs the seeded depth mix of `rlt-bench throughput` (mean `--trace-mean`), ouro the gate at
`--ouro-threshold`. `--device cpu --model toy-ouro --prompt-len 40 --output-len 8 --burst 8`
runs the same code on the CPU (a smoke test; times mean nothing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from torch.profiler import ProfilerActivity, profile

from rlt_engine.bench.report import free_device
from rlt_engine.bench.throughput import OURO_THRESHOLD, Workload, make_jobs
from rlt_engine.llm import LLM


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="synthetic-ouro-1.4b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--exits", default="trace,ouro")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--burst", type=int, default=128, help="requests added at once after the single request")
    p.add_argument("--trace-mean", type=float, default=2.5)
    p.add_argument("--ouro-threshold", type=float, default=OURO_THRESHOLD)
    p.add_argument("--top", type=int, default=18, help="host calls and kernels listed")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def one_request(engine, job, request_id: str) -> tuple[float | None, list[tuple[float, int]]]:
    """TTFT (ms) of one request alone, and every step's (wall ms, tokens delivered so far)."""
    engine.add_request(request_id, job.prompt, job.params)
    t0, steps, first = time.perf_counter(), [], None
    while engine.has_unfinished_requests():
        s0 = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        delivered = sum(o.num_tokens for o in outputs)
        steps.append((round((now - s0) * 1e3, 2), delivered))
        if first is None and delivered:
            first = (now - t0) * 1e3
    return first, steps


def burst(engine, jobs, tag: str) -> dict:
    """Add every job at once; step until each has its first token (then abort them)."""
    t0 = time.perf_counter()
    ids = [f"{tag}-burst-{i}" for i in range(len(jobs))]
    for request_id, job in zip(ids, jobs, strict=True):
        engine.add_request(request_id, job.prompt, job.params)
    seen: set[str] = set()
    firsts, steps = [], []
    while engine.has_unfinished_requests() and len(seen) < len(jobs):
        s0 = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        new = {o.request_id for o in outputs if o.num_tokens and o.request_id not in seen}
        seen |= new
        firsts += [(now - t0) * 1e3] * len(new)
        steps.append((round((now - s0) * 1e3, 1), len(new), sum(o.num_tokens for o in outputs)))
    for request_id in ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():  # the aborts settle before the engine closes
        engine.step()
    return {"ttft_p50_ms": statistics.median(firsts) if firsts else None, "steps": steps}


def top(events, key, limit: int) -> list[tuple[str, int, float]]:
    ranked = sorted(events, key=lambda e: -getattr(e, key))[:limit]
    return [(e.key[:100], e.count, round(getattr(e, key) / 1e3, 2)) for e in ranked if getattr(e, key) > 0]


def profile_mode(args: argparse.Namespace, mode: str) -> dict:
    cuda = args.device.startswith("cuda")
    with LLM(args.model, device=args.device, exit_mode=mode, workers=0, max_num_seqs=max(args.burst, 1)) as llm:
        engine = llm.engine
        threshold = args.ouro_threshold if mode == "ouro" else None
        work = Workload(args.output_len, mode, engine.max_depth, args.trace_mean, threshold)
        jobs = make_jobs(4 + args.burst, args.prompt_len, engine.model_info.vocab_size, work, seed=3)
        one_request(engine, jobs[0], f"{mode}-warm-0")
        one_request(engine, jobs[1], f"{mode}-warm-1")
        ttft, steps = one_request(engine, jobs[2], f"{mode}-single")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            one_request(engine, jobs[3], f"{mode}-profiled")
        events = prof.key_averages()
        report = {"exit": mode, "ttft_ms": ttft, "steps": len(steps), "first_steps": steps[:12],
                  "step_ms_median": statistics.median(s for s, _ in steps),
                  "host_top": top(events, "self_cpu_time_total", args.top),
                  "gpu_top": top(events, "self_device_time_total", args.top) if cuda else [],
                  "burst": burst(engine, jobs[4:], mode) if args.burst else None}
    free_device(args.device)  # the next engine sizes its KV pool from the free memory
    return report


def print_report(r: dict) -> None:
    print(f"{r['exit']}: TTFT {r['ttft_ms']:.1f} ms, {r['steps']} steps (median {r['step_ms_median']:.2f} ms); "
          f"first steps (ms, tokens so far): {r['first_steps']}")
    for title, rows in (("host (self CPU ms)", r["host_top"]), ("GPU (self ms)", r["gpu_top"])):
        if rows:
            print(f"  {title}:")
            for name, count, ms in rows:
                print(f"    {ms:9.2f}  {count:6d}×  {name}")
    if r["burst"]:
        b = r["burst"]
        print(f"  burst: TTFT p50 {b['ttft_p50_ms']:.1f} ms over {len(b['steps'])} steps; "
              f"(ms, first tokens, tokens): {b['steps'][:40]}")


def main(args: argparse.Namespace) -> list[dict]:
    reports = []
    for mode in args.exits.split(","):
        reports.append(profile_mode(args, mode))
        print_report(reports[-1])
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"model": args.model, "prompt_len": args.prompt_len, "output_len": args.output_len,
                           "reports": reports}, f, indent=1)
    return reports


if __name__ == "__main__":
    main(parse_args())
