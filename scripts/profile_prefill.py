"""Where the time to first token of one request goes: wall time against GPU kernel time, by kernel.

Run on the GPU host (one command; about a minute per chunk size):

    python scripts/profile_prefill.py [--prompt-len 1024] [--chunk-sizes 512,1024] [--json $OUT/prefill.json]

For each prefill chunk size it builds an in-process engine (`workers=0`, bf16, the Triton
backend) on `synthetic-ouro-1.4b`, and for one request of `--prompt-len` random tokens with one
output token (PREFILL at D loops, then one CODA) it reports

- TTFT: wall time of `generate`, median of `--repeats` after two warm-ups;
- GPU time: the summed self time of every CUDA kernel of one more run under torch.profiler, and
  its share of that run's wall time (the rest is the host: the engine, the plan, launches);
- the `--top` kernels by GPU time, with their call counts.

`--device cpu --model toy-ouro` runs the same code without CUDA (a smoke test; times mean nothing).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from rlt_engine import LLM, SamplingParams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="synthetic-ouro-1.4b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="default: the engine's (bfloat16 on cuda)")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--chunk-sizes", default="512,1024", help="comma-separated prefill_chunk_size values")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def self_times(prof: profile, device: bool) -> dict[str, tuple[float, int]]:
    """Event name → (self seconds, calls): CUDA kernels' GPU time, or host events' CPU time."""
    out = {}
    for event in prof.key_averages():
        on_device = event.device_type == torch.autograd.DeviceType.CUDA
        seconds = (event.self_device_time_total if device else event.self_cpu_time_total) * 1e-6
        if seconds > 0 and on_device == device:
            out[event.key] = (seconds, event.count)
    return out


def ranked(times: dict[str, tuple[float, int]], top: int) -> list[dict]:
    order = sorted(times.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"name": name, "s": s, "calls": c} for name, (s, c) in order]


def profile_chunk_size(args: argparse.Namespace, chunk: int) -> dict:
    options = {"device": args.device, "workers": 0, "prefill_chunk_size": chunk,
               "max_num_batched_tokens": max(2048, chunk)}
    if args.dtype:
        options["dtype"] = args.dtype
    with LLM(args.model, **options) as llm:
        rng = random.Random(0)
        vocab = llm.engine.model_info.vocab_size
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

        def once() -> float:
            prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
            t0 = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            return time.perf_counter() - t0

        once(), once()
        walls = [once() for _ in range(args.repeats)]
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
        with profile(activities=activities) as prof:
            profiled_wall = once()
    kernels = self_times(prof, device=True)
    return {"chunk": chunk, "ttft_p50_s": statistics.median(walls), "ttft_s": walls,
            "profiled_wall_s": profiled_wall, "gpu_kernel_s": sum(s for s, _ in kernels.values()),
            "kernels": sum(c for _, c in kernels.values()), "top_kernels": ranked(kernels, args.top),
            "top_host": ranked(self_times(prof, device=False), args.top)}


def main(args: argparse.Namespace) -> list[dict]:
    reports = [profile_chunk_size(args, int(c)) for c in args.chunk_sizes.split(",")]
    for r in reports:
        share = r["gpu_kernel_s"] / r["profiled_wall_s"] if r["profiled_wall_s"] else 0.0
        print(f"chunk {r['chunk']}: TTFT p50 {r['ttft_p50_s'] * 1e3:.1f} ms "
              f"({args.prompt_len / r['ttft_p50_s']:,.0f} prompt tok/s); profiled run "
              f"{r['profiled_wall_s'] * 1e3:.1f} ms wall, {r['gpu_kernel_s'] * 1e3:.1f} ms in {r['kernels']} "
              f"kernels ({share:.0%} of the wall)")
        for title, rows in (("GPU kernels", r["top_kernels"]), ("host (self CPU time)", r["top_host"])):
            print(f"  {title}:")
            for k in rows:
                print(f"    {k['s'] * 1e3:8.2f} ms  {k['calls']:5d}×  {k['name'][:100]}")
    base = reports[0]["ttft_p50_s"]
    print("TTFT ratios to chunk", reports[0]["chunk"], ":",
          ", ".join(f"{r['chunk']}: {r['ttft_p50_s'] / base:.3f}" for r in reports))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"prompt_len": args.prompt_len, "model": args.model, "reports": reports}, f, indent=1)
    return reports


if __name__ == "__main__":
    main(parse_args())
