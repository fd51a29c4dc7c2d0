"""Where a closed-loop run's time goes with mixed batches (or without): host Python against GPU work.

    python scripts/profile_mixed.py OUT_DIR [--exit trace] [--mixed | --no-mixed] [--concurrency 32]

On one in-process engine (workers = 0, CUDA defaults, `mixed_batches` as asked): a warm-up run, a
timed run (tok/s), a run under cProfile (the host's Python by own time and by cumulative time), and
a window of `--window` engine steps of a further run under torch.profiler: the GPU's busy time and
idle gaps over that window (profile_ouro_gap's timeline), its kernels and host ops by total time.
Each run is the benchmark's closed loop (2·c requests, 1,024-token prompts, 128 outputs; trace at
mean 2.5). Writes OUT_DIR/profile_mixed.json. `--model toy-ouro --device cpu --prompt-len 24
--output-len 4 --concurrency 4 --skip 2 --window 4` runs the same code on the CPU (a smoke test).
"""

from __future__ import annotations

import argparse
import json
import time

from profile_ouro_gap import (  # scripts/, this script's folder
    add_closed_loop_args,
    closed_loop_engine,
    cprofile_table,
    kernel_timeline,
)
from torch.profiler import ProfilerActivity, profile

from rlt_engine.bench.throughput import cold_closed_loop

TOP = 25


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir")
    add_closed_loop_args(p, mixed=True)
    p.add_argument("--window", type=int, default=60, help="engine steps under torch.profiler")
    p.add_argument("--skip", type=int, default=100, help="engine steps of that run before the window")
    args = p.parse_args()
    c = args.concurrency
    llm, jobs = closed_loop_engine(args)
    engine = llm.engine
    report: dict = {"exit": args.exit, "mixed": args.mixed, "concurrency": c}
    for name in ("warm_up", "timed"):
        run = cold_closed_loop(engine, jobs, c, time.perf_counter() + 60)
        report[f"{name}_tok_s"] = run.tokens_per_s
        print(name, f"{run.tokens_per_s:.1f} tok/s", flush=True)
    for sort in ("tottime", "cumulative"):
        report[f"cprofile_{sort}"] = cprofile_table(
            lambda: cold_closed_loop(engine, jobs, c, time.perf_counter() + 120), sort, 40)
    real_step, steps = engine.step, [0]
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])

    def step():  # the window: steps skip … skip + window of the run
        if steps[0] == args.skip:
            prof.start()
        out = real_step()
        steps[0] += 1
        if steps[0] == args.skip + args.window:
            prof.stop()
        return out

    engine.step = step
    cold_closed_loop(engine, jobs, c, time.perf_counter() + 120)
    engine.step = real_step
    report["window_steps"] = args.window
    if args.device.startswith("cuda"):
        report |= kernel_timeline(prof)
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:TOP]
    report["host_ops"] = [{"name": e.key[:80], "count": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 2)}
                          for e in ops]
    report["graph_stats"] = engine.executor._worker.runner.graph_stats
    llm.close()
    with open(f"{args.out_dir}/profile_mixed.json", "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: v for k, v in report.items() if not k.startswith("cprofile")}, indent=None)[:6000])
    print(report["cprofile_tottime"][:5000])


if __name__ == "__main__":
    main()
