"""Where the time to first token of one request goes: wall time against GPU kernel time, by kernel.

Run on the GPU host (one command; about half a minute per configuration):

    python scripts/profile_prefill.py [--prompt-len 1024] [--chunk-sizes 512,1024] [--prefill-graphs on,off]
                                      [--json $OUT/prefill.json]

For each prefill chunk size and each prefill-graph setting (`cuda_graph_prefill`: PREFILL chunk
passes replayed from CUDA graphs, rlt_worker/prefill_graphs.py; the decode graphs stay on) it builds
an in-process engine (`workers=0`, bf16, the Triton backend, graphs captured at start-up) on
`synthetic-ouro-1.4b`, and for one request of `--prompt-len` random tokens with one output token
(PREFILL at D loops, then one CODA) it reports

- TTFT: wall time of `generate`, median of `--repeats` after two warm-ups, and prompt tok/s
  (prompt length / TTFT), against issue 17's one-prompt targets (TTFT ≤ 50 ms, ≥ 20,000 tok/s);
- GPU time: the summed self time of every CUDA kernel of one more run under torch.profiler, and
  its share of that run's wall time (the rest is the host: the engine, the plan, launches);
- the `--top` kernels by GPU time, with their call counts;
- the runner's graph counters (prefill replays and eager passes, start-up capture time and memory);

then, per chunk size, the ratios graphs on / off of TTFT and prompt tok/s.

`--device cpu --model toy-ouro` runs the same code without CUDA (a smoke test; times mean nothing).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from rlt_engine import LLM, SamplingParams
from rlt_engine.bench.report import free_device


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="synthetic-ouro-1.4b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="default: the engine's (bfloat16 on cuda)")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--chunk-sizes", default="512,1024", help="comma-separated prefill_chunk_size values")
    p.add_argument("--prefill-graphs", default="on,off", help="comma-separated cuda_graph_prefill settings (on, off)")
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


TARGET_TTFT_S = 0.050  # issue 17, one prompt
TARGET_TOK_S = 20_000


def profile_config(args: argparse.Namespace, chunk: int, graphs: bool) -> dict:
    options = {"device": args.device, "workers": 0, "prefill_chunk_size": chunk,
               "max_num_batched_tokens": max(2048, chunk), "cuda_graph_prefill": graphs}
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
        graph_stats = llm.engine.executor._worker.runner.graph_stats
    kernels = self_times(prof, device=True)
    return {"chunk": chunk, "prefill_graphs": graphs, "graph_stats": graph_stats,
            "ttft_p50_s": statistics.median(walls), "ttft_s": walls,
            "profiled_wall_s": profiled_wall, "gpu_kernel_s": sum(s for s, _ in kernels.values()),
            "kernels": sum(c for _, c in kernels.values()), "top_kernels": ranked(kernels, args.top),
            "top_host": ranked(self_times(prof, device=False), args.top)}


def _label(r: dict) -> str:
    return f"chunk {r['chunk']}, prefill graphs {'on' if r['prefill_graphs'] else 'off'}"


def print_report(r: dict, prompt_len: int) -> None:
    share = r["gpu_kernel_s"] / r["profiled_wall_s"] if r["profiled_wall_s"] else 0.0
    rate = prompt_len / r["ttft_p50_s"]
    met = r["ttft_p50_s"] <= TARGET_TTFT_S and rate >= TARGET_TOK_S
    print(f"{_label(r)}: TTFT p50 {r['ttft_p50_s'] * 1e3:.1f} ms ({rate:,.0f} prompt tok/s; targets "
          f"{'met' if met else 'not met'}); profiled run {r['profiled_wall_s'] * 1e3:.1f} ms wall, "
          f"{r['gpu_kernel_s'] * 1e3:.1f} ms in {r['kernels']} kernels ({share:.0%} of the wall)")
    print(f"  graphs: {r['graph_stats']}")
    for title, rows in (("GPU kernels", r["top_kernels"]), ("host (self CPU time)", r["top_host"])):
        print(f"  {title}:")
        for k in rows:
            print(f"    {k['s'] * 1e3:8.2f} ms  {k['calls']:5d}×  {k['name'][:100]}")


def main(args: argparse.Namespace) -> list[dict]:
    settings = [{"on": True, "off": False}[g] for g in args.prefill_graphs.split(",")]
    reports = []
    for chunk in args.chunk_sizes.split(","):
        for graphs in settings:  # each printed (and the JSON rewritten) as soon as it is measured
            reports.append(profile_config(args, int(chunk), graphs))
            free_device(args.device)  # the next engine sizes its KV pool from the free memory
            print_report(reports[-1], args.prompt_len)
            sys.stdout.flush()
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"prompt_len": args.prompt_len, "model": args.model, "reports": reports}, f, indent=1)
    base = reports[0]["ttft_p50_s"]
    print(f"TTFT ratios to {_label(reports[0])}:", ", ".join(f"{_label(r)}: {r['ttft_p50_s'] / base:.3f}"
                                                          for r in reports))
    by_key = {(r["chunk"], r["prefill_graphs"]): r for r in reports}
    for chunk in dict.fromkeys(r["chunk"] for r in reports):
        on, off = by_key.get((chunk, True)), by_key.get((chunk, False))
        if on and off:
            print(f"chunk {chunk}: prefill graphs on / off: TTFT {on['ttft_p50_s'] / off['ttft_p50_s']:.3f}×, "
                  f"prompt tok/s {off['ttft_p50_s'] / on['ttft_p50_s']:.3f}×")
    return reports


if __name__ == "__main__":
    main(parse_args())
