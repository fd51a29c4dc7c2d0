"""Profile one decode loop pass: the torch modules against the fused path, both replayed from CUDA graphs.

Run on the GPU host (one command; ~1–2 minutes):

    python scripts/profile_decode_pass.py [--json $OUT/profile_decode_pass.json]

Defaults: synthetic-ouro-1.4b, rows 1 and 32, every row at position context−1 (context 1,024, so
64 blocks of 16: width bucket 64), loop depth 1, Triton attention, LAST_EXITED. For each path
(`torch`: OuroModel's modules, today's graphs; `fused`: FusedOuroModel) and row count it reports

- kernels per pass: CUDA kernels of one eager pass under torch.profiler (the kernels the graph
  holds), and per decoder layer;
- GPU time per pass: CUDA events around each of `--replays` graph replays, median (p10, p90);
- host time per launch: `graph.replay()`'s wall time with the GPU idle before it, median (the
  bubble a pass costs after a readback, as in ouro's decode loop, before its kernels start);
- CODA (LM head + sampling, per SamplingKind: greedy, gumbel and filtered) per row count: graph replay GPU time,
  the same function's eager wall time, its kernels;
- parity: one pass of both paths from the same state over the same KV pool, per dtype
  (bfloat16 is timed; float32 is compared only): max |Δ| / max |torch|, worst row cosine.

`--pdl on` times the fused path with programmatic dependent launch (`fused-pdl`: its Triton kernels
launched with launch_pdl, rlt_worker/kernels/launch.py) instead of plain launches; `--pdl both` times
both in the same run and compares them (bit-equal expected: PDL changes timing, not arithmetic).
The PDL path packs its own copy of the q|k|v and gate|up weights (a second FusedOuroModel).
`--splitk FILE` adds `fused-splitk`: the fused path with plain launches and the split-K settings
that won in a `scripts/bench_linear.py --sweep --json FILE` run, compared with `fused` the same way.
`--cublas-path` adds `fused-cublas`: the fused path with plain launches and no Triton GEMV tier
(every GEMM on cuBLAS, as before the strip GEMVs), compared with `fused` the same way.
`--rotary-attention` adds `fused-rotary-attention`: the last --pdl path with the runner's decode
batches rotating q and k and writing k and v in the attention's launch (triton_backend's
paged_attention_rotary, RunnerConfig.fused_rotary_attention): one launch a layer fewer, compared
with that path (bit-equal expected: the same arithmetic).
`--cublas-head` adds `fused-cublas-head`: the last --pdl path with the LM head on cuBLAS instead of
ouro_fused.HEAD_STRIP_SETTINGS' gated strip (its pass is that path's), compared with it, and times
device refill's CODA of the rows (runner.sample_on_device with `needed`, greedy, one graph each) on
both paths with every row needed and with none: the gated strip reads no weight when no row exited.

Both paths share one KV pool of random K/V (only values read by attention; both write their own
K/V of the pass at the same slots). The bytes a pass must read (loop weights + the context's K/V)
are printed with the time they take at `--hbm-tbps`.

`--device cpu --model toy-ouro --dtypes float32` runs the same code under Triton's interpreter with
emulated graphs (a smoke test of the script; its times mean nothing).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="synthetic-ouro-1.4b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtypes", default="bfloat16,float32", help="first is timed and profiled; all are compared")
    p.add_argument("--rows", default="1,32")
    p.add_argument("--context", type=int, default=1024, help="context length of every row (positions 0 … context−1)")
    p.add_argument("--replays", type=int, default=200)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--hbm-tbps", type=float, default=4.8, help="HBM bandwidth for the bytes floor (H200: 4.8 TB/s)")
    p.add_argument("--pdl", choices=("off", "on", "both"), default="off",
                   help="the fused path with plain launches, with programmatic dependent launch, or both")
    p.add_argument("--splitk", default=None, metavar="FILE",
                   help="also time the fused path with the winning split-K settings of this bench_linear sweep JSON")
    p.add_argument("--cublas-path", action="store_true",
                   help="also time the fused path with every GEMM on cuBLAS (no strip or split-K GEMVs)")
    p.add_argument("--rotary-attention", action="store_true",
                   help="add fused-rotary-attention (RoPE and the K/V write in the attention's launch)")
    p.add_argument("--cublas-head", action="store_true",
                   help="add fused-cublas-head and time device refill's CODA against it (see the docstring)")
    p.add_argument("--top", type=int, default=0, help="print the N kernel names with the most GPU time per path")
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.device == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from bench_linear import winning_settings  # noqa: E402  (scripts/, this script's folder)

from protocol.columns import I32, I64, pack  # noqa: E402
from protocol.messages import Admit, BlockAppends, ExecutionPlan  # noqa: E402
from rlt_worker.device_refill import RefillBuffers  # noqa: E402
from rlt_worker.kernels.launch import PLAIN, KernelLaunch  # noqa: E402
from rlt_worker.kv_storage import KVStorage, num_planes  # noqa: E402
from rlt_worker.model_runner import ModelRunner, RunnerConfig  # noqa: E402
from rlt_worker.models.loader import load_model  # noqa: E402
from rlt_worker.models.ouro_fused import FusedOuroModel  # noqa: E402
from rlt_worker.sampler import SamplingKind  # noqa: E402
from rlt_worker.worker import DTYPES  # noqa: E402


class Setup:
    """One dtype: the reference model, its fused wrappers, one KV pool, and a runner per path."""

    def __init__(self, args: argparse.Namespace, dtype: torch.dtype, max_rows: int) -> None:
        device = torch.device(args.device)
        self.device, self.dtype = device, dtype
        self.reference = load_model(args.model, dtype=dtype, device=device)
        info = self.reference.info
        self.info = info
        self.depth = info.default_depth
        self.blocks_per_row = math.ceil(args.context / args.block_size)
        num_blocks = max_rows * self.blocks_per_row
        self.storage = KVStorage(info, num_blocks + 1, args.block_size, dtype, device)
        gen = torch.Generator(device=device).manual_seed(0)
        self.storage.pool.normal_(generator=gen)
        self.pdl = KernelLaunch.for_device(True, device)  # plain where the device has no PDL
        fused = {"off": [("fused", PLAIN)], "on": [("fused-pdl", self.pdl)],
                 "both": [("fused", PLAIN), ("fused-pdl", self.pdl)]}[args.pdl]
        # Each FusedOuroModel packs the reference's weights in place (views): a second one packs a copy.
        paths = [("torch", self.reference, PLAIN)] + [(name, FusedOuroModel(self.reference, launch), launch)
                                                      for name, launch in fused]
        if args.splitk:
            settings = winning_settings(json.loads(Path(args.splitk).read_text()))
            print(f"fused-splitk: {len(settings)} weights on split-K: {settings}")
            paths.append(("fused-splitk", FusedOuroModel(self.reference, PLAIN, splitk=settings), PLAIN))
        fused_rotary = {ROTARY_ATTENTION_PATH} if args.rotary_attention else set()
        if args.rotary_attention:
            _, launch = fused[-1]
            paths.append((ROTARY_ATTENTION_PATH, FusedOuroModel(self.reference, launch), launch))
        if args.cublas_head:
            _, launch = fused[-1]
            paths.append((CUBLAS_HEAD_PATH, FusedOuroModel(self.reference, launch, head_strip={}), launch))
        if args.cublas_path:
            paths.append(("fused-cublas", FusedOuroModel(self.reference, PLAIN, splitk={}, strip={}), PLAIN))
        planes = num_planes(info, "last_exited", self.depth)
        # The attention backend launches as the worker's does: a fused model's row-bounded launch.
        self.runners = {name: self._runner(model, model.kernel_launch(launch), planes, max_rows, num_blocks,
                                           fused_rotary=name in fused_rotary)
                        for name, model, launch in paths}
        state = torch.randn(max_rows, info.hidden_size, generator=gen, device=device, dtype=torch.float32)
        with torch.inference_mode():
            self.state0 = self.reference.model.norm(state.to(dtype))  # a loop's input is a normed state

    def _runner(self, model, launch: KernelLaunch, planes: int, max_rows: int, num_blocks: int,
                fused_rotary: bool) -> ModelRunner:
        cuda = self.device.type == "cuda"
        config = RunnerConfig(kv_layout="last_exited", max_depth=self.depth, num_planes=planes, max_slots=max_rows,
                              attention_backend="triton", state_init="random", scratch_block=num_blocks,
                              cuda_graphs=cuda, graph_capture="lazy", kernel_launch=launch,
                              fused_rotary_attention=fused_rotary)
        runner = ModelRunner(model, self.storage, config)
        if not cuda:
            runner.use_pass_graphs(emulate=True)
        # Row r: slot r, blocks r·B … r·B + B − 1 in every plane (only plane 0 is read: depth 1).
        b = self.blocks_per_row
        ids = np.concatenate([np.tile(np.arange(r * b, (r + 1) * b), planes) for r in range(max_rows)])
        runner.execute(ExecutionPlan(
            step_id=0, admits=[Admit(key=r, generation=0) for r in range(max_rows)],
            block_appends=BlockAppends(keys=pack(range(max_rows), I64), generations=pack([0] * max_rows, I64),
                                       num_new=pack([b] * max_rows, I32), block_ids=pack(ids, I32)),
        ))
        return runner

    def run_pass(self, name: str, rows: int, context: int) -> torch.Tensor:
        """One pass of `rows` rows from state0 (graph replay; captured on first use); the new states."""
        runner = self.runners[name]
        runner.state[:rows] = self.state0[:rows]
        slots = np.arange(rows)
        assert runner._graphs.run(slots, np.full(rows, context - 1), np.ones(rows, dtype=np.int64))
        return runner.state[:rows].clone()

    def graph(self, name: str, rows: int, context: int):
        graphs = self.runners[name]._graphs
        key = graphs.bucket(rows, context - 1)
        return key, graphs._graphs[key]


ROTARY_ATTENTION_PATH = "fused-rotary-attention"
CUBLAS_HEAD_PATH = "fused-cublas-head"


def time_replays(graph, replays: int, cuda: bool) -> list[float]:
    """Milliseconds of each replay (CUDA events on the GPU, wall time otherwise)."""
    if not cuda:
        times = []
        for _ in range(replays):
            t0 = time.perf_counter()
            graph.replay()
            times.append((time.perf_counter() - t0) * 1e3)
        return times
    for _ in range(5):
        graph.replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    for s, e in zip(starts, ends, strict=True):
        s.record()
        graph.replay()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]


def launch_host_ms(graph, replays: int, cuda: bool) -> float | None:
    """Median host milliseconds of one `graph.replay()` call started on an idle GPU: what a pass costs
    the host after a readback (ouro's decode loop) before the GPU has work again."""
    if not cuda:
        return None
    times = []
    for _ in range(replays):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def count_kernels(fn, cuda: bool) -> tuple[int | None, dict[str, list[float]]]:
    """CUDA kernels one call of fn launches (torch.profiler): per name, [count, summed GPU µs]."""
    if not cuda:
        return None, {}
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if event.name.startswith(("Memcpy", "Memset", "cudaMemcpy", "cudaMemset")):
            continue
        entry = names.setdefault(event.name, [0, 0.0])
        entry[0] += 1
        entry[1] += event.device_time_total
    return int(sum(c for c, _ in names.values())), names


def pass_bytes(setup: Setup, rows: int, context: int) -> int:
    """Bytes one pass must read at least: the loop's weights once, and every row's context K/V."""
    weights = sum(t.numel() * t.element_size() for t in setup.reference.model.layers.parameters())
    info = setup.info
    per_position = info.num_loop_kv_layers * 2 * info.num_kv_heads * info.head_dim * setup.storage.pool.element_size()
    kv = rows * context * per_position
    return weights + kv


def profile_coda(setup: Setup, rows: int, replays: int, cuda: bool) -> list[dict]:
    """CODA (LM head + sampling) of `rows` rows, each SamplingKind: graph replay GPU time and the
    same function's eager wall time."""
    coda = setup.runners[_fused_path(setup)]._graphs.coda
    out = []
    for kind in SamplingKind:
        slots = np.arange(rows)
        assert coda.run(slots, slots, slots, kind) is not None  # captures the bucket on first use
        bucket = next(b for b in coda.passes.row_buckets if b >= rows)
        times = time_replays(coda._graphs[(bucket, kind)], replays, cuda)
        eager = []
        for _ in range(max(3, replays // 10)):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            coda._coda(bucket, kind)
            if cuda:
                torch.cuda.synchronize()
            eager.append((time.perf_counter() - t0) * 1e3)
        kernels, _ = count_kernels(lambda b=bucket, k=kind: coda._coda(b, k), cuda)
        out.append({"rows": rows, "kind": kind.value, "kernels": kernels,
                    "graph_gpu_ms_median": statistics.median(times), "eager_wall_ms_median": statistics.median(eager)})
    return out


def profile_needed_head(setup: Setup, paths: tuple[str, str], rows: int, replays: int, cuda: bool) -> list[dict]:
    """Device refill's CODA of `rows` rows (greedy; runner.sample_on_device with `needed`, one graph
    each) on each path, with every row needed and with none; and the head's logits of both paths
    compared (every row needed)."""
    out, logits = [], {}
    slots = torch.arange(rows, device=setup.device)
    params = RefillBuffers(rows, setup.device).params
    for name in paths:
        runner = setup.runners[name]
        runner.state[:rows] = setup.state0[:rows]
        for label, needed in (("all", torch.ones(rows, dtype=torch.bool, device=setup.device)),
                              ("none", torch.zeros(rows, dtype=torch.bool, device=setup.device))):
            coda = functools.partial(runner.sample_on_device, slots, params, SamplingKind.GREEDY, needed)
            times = time_replays(_graph_of(coda, cuda), replays, cuda)
            # Its kernels, eagerly: on an H100 this CODA took 0.167 ms where CodaGraphs' greedy one,
            # the same sample_on_device, took 0.096 (docs/benchmarks.md); which kernels differ?
            with torch.inference_mode():
                kernels, names = count_kernels(coda, cuda)
            top = sorted(([n, c, round(us, 1)] for n, (c, us) in names.items()), key=lambda row: -row[2])[:8]
            out.append({"path": name, "rows": rows, "needed": label, "graph_gpu_ms_median": statistics.median(times),
                        "kernels": kernels, "top_kernels": top})
        with torch.inference_mode():
            logits[name] = runner.model.lm_head_needed(runner.state[:rows], torch.ones(rows, dtype=torch.bool,
                                                                                       device=setup.device))
    out.append({"pair": f"{paths[1]} vs {paths[0]}", "rows": rows, **parity(logits[paths[1]], logits[paths[0]])})
    return out


class _Eager:
    """A function with a CUDA graph's replay(), where there are no graphs (the CPU smoke run)."""

    def __init__(self, fn) -> None:
        self.replay = fn


def _graph_of(fn, cuda: bool):
    """fn captured in a CUDA graph after a warm-up on a side stream (CPU: fn itself)."""
    if not cuda:
        return _Eager(fn)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.inference_mode():
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.inference_mode():
        fn()
    return graph


def _fused_path(setup: Setup) -> str:
    """The fused path the torch one is compared with: plain launches when it runs."""
    return "fused" if "fused" in setup.runners else "fused-pdl"


def parity(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    a, b = a.double(), b.double()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1).min()
    return {"max_abs_diff": float((a - b).abs().max()), "rel_diff": float((a - b).abs().max() / a.abs().max()),
            "worst_row_cosine": float(cos), "bit_equal_fraction": float((a == b).double().mean())}


def main(args: argparse.Namespace) -> dict:
    rows_list = [int(r) for r in args.rows.split(",")]
    dtype_names = args.dtypes.split(",")
    cuda = args.device.startswith("cuda")
    report: dict = {"model": args.model, "device": torch.cuda.get_device_name() if cuda else "cpu",
                    "torch": torch.__version__, "context": args.context, "pdl": args.pdl, "passes": [], "parity": [],
                    "coda": [], "needed_head": []}
    try:
        import triton

        report["triton"] = triton.__version__
    except ImportError:
        pass
    for d, dtype_name in enumerate(dtype_names):
        setup = Setup(args, DTYPES[dtype_name], max(rows_list))
        report["pdl_launches"] = setup.pdl.pdl  # False: this device has no PDL, fused-pdl launches plainly
        layers = setup.info.num_loop_kv_layers
        comparisons = [("torch", _fused_path(setup))] + ([("fused", "fused-pdl")] if args.pdl == "both" else [])
        comparisons += [(_fused_path(setup), "fused-splitk")] if args.splitk else []
        comparisons += [(_fused_path(setup), "fused-cublas")] if args.cublas_path else []
        last_fused = {"off": "fused", "on": "fused-pdl", "both": "fused-pdl"}[args.pdl]
        comparisons += [(last_fused, ROTARY_ATTENTION_PATH)] if args.rotary_attention else []
        comparisons += [(last_fused, CUBLAS_HEAD_PATH)] if args.cublas_head else []
        for rows in rows_list:
            outs = {name: setup.run_pass(name, rows, args.context) for name in setup.runners}
            report["parity"].extend({"pair": f"{b} vs {a}", "dtype": dtype_name, "rows": rows,
                                     **parity(outs[a], outs[b])} for a, b in comparisons)
            if d:  # only the first dtype is timed
                continue
            floor_ms = pass_bytes(setup, rows, args.context) / (args.hbm_tbps * 1e12) * 1e3
            for name, runner in setup.runners.items():
                (bucket_rows, width), graph = setup.graph(name, rows, args.context)
                kernels, names = count_kernels(lambda r=runner, br=bucket_rows, w=width: r._graphs._pass(br, w), cuda)
                times = time_replays(graph, args.replays, cuda)
                launch_ms = launch_host_ms(graph, max(10, args.replays // 4), cuda)
                q = statistics.quantiles(times, n=10) if len(times) >= 10 else [min(times)] * 9
                report["passes"].append({
                    "path": name, "dtype": dtype_name, "rows": rows, "bucket": f"{bucket_rows}x{width}",
                    "kernels": kernels, "kernels_per_layer": None if kernels is None else round(kernels / layers, 2),
                    "gpu_ms_median": statistics.median(times), "gpu_ms_p10": q[0], "gpu_ms_p90": q[-1],
                    "replays": len(times), "bytes_floor_ms": floor_ms, "launch_host_ms_median": launch_ms,
                    "kernel_us_sum": round(sum(us for _, us in names.values()), 1),
                    "top_kernels": sorted(([n, c, round(us, 1)] for n, (c, us) in names.items()),
                                          key=lambda row: -row[2])[: args.top] if args.top else [],
                })
            if cuda or setup.runners[_fused_path(setup)]._graphs.coda is not None:
                report["coda"].extend(profile_coda(setup, rows, args.replays, cuda))
            if args.cublas_head:
                report["needed_head"].extend(profile_needed_head(setup, (last_fused, CUBLAS_HEAD_PATH), rows,
                                                                 args.replays, cuda))
        del setup
        if cuda:
            torch.cuda.empty_cache()
    return report


def print_report(report: dict, hbm_tbps: float) -> None:
    print(f"{report['model']} on {report['device']} (torch {report['torch']}, triton {report.get('triton')}), "
          f"context {report['context']}, one loop pass per replay")
    if report["pdl"] != "off":
        state = "on" if report["pdl_launches"] else "unavailable here: plain launches"
        print(f"fused-pdl: programmatic dependent launch {state}")
    print(f"{'path':12} {'dtype':9} {'rows':>4} {'bucket':>7} {'kernels':>8} {'/layer':>7} {'GPU ms p50':>10} "
          f"{'p10':>7} {'p90':>7} {'bytes floor ms':>15}")
    for p in report["passes"]:
        kernels = "-" if p["kernels"] is None else str(p["kernels"])
        per_layer = "-" if p["kernels_per_layer"] is None else f"{p['kernels_per_layer']:.1f}"
        print(f"{p['path']:12} {p['dtype']:9} {p['rows']:>4} {p['bucket']:>7} {kernels:>8} {per_layer:>7} "
              f"{p['gpu_ms_median']:>10.3f} {p['gpu_ms_p10']:>7.3f} {p['gpu_ms_p90']:>7.3f} "
              f"{p['bytes_floor_ms']:>15.3f}")
        if p.get("kernel_us_sum") is not None and p["kernels"]:
            print(f"        eager kernels' own GPU time: {p['kernel_us_sum'] / 1e3:.3f} ms")
        if p.get("launch_host_ms_median") is not None:
            print(f"        host time of one replay() on an idle GPU: {p['launch_host_ms_median']:.3f} ms")
        for name, count, us in p["top_kernels"]:
            print(f"        {count:5d} {us:9.1f} µs  {name[:100]}")
    print(f"(bytes floor: loop weights + context K/V at {hbm_tbps} TB/s)")
    for c in report["coda"]:
        kernels = "-" if c["kernels"] is None else c["kernels"]
        print(f"CODA {c['kind']:8} rows {c['rows']:>3}: {kernels} kernels, graph {c['graph_gpu_ms_median']:.3f} ms "
              f"GPU, eager {c['eager_wall_ms_median']:.3f} ms wall")
    for h in report.get("needed_head", []):
        if "pair" in h:
            print(f"  head logits {h['pair']} rows {h['rows']}: max|Δ|/max|B| {h['rel_diff']:.3e}, "
                  f"worst row cosine {h['worst_row_cosine']:.7f}")
        else:
            print(f"device refill's CODA {h['path']:18} rows {h['rows']:>3}, needed {h['needed']:4}: graph "
                  f"{h['graph_gpu_ms_median']:.3f} ms GPU, {h['kernels'] if h['kernels'] is not None else '-'} kernels")
            for kernel, count, us in h["top_kernels"]:
                print(f"        {count:5d} {us:9.1f} µs  {kernel[:100]}")
    print("parity, one pass from the same state (graph replays); A vs B: max|Δ| relative to max|B|:")
    for q in report["parity"]:
        print(f"  {q['pair']:24} {q['dtype']:9} rows {q['rows']:>3}: max|Δ| {q['max_abs_diff']:.3e}, max|Δ|/max|B| "
              f"{q['rel_diff']:.3e}, worst row cosine {q['worst_row_cosine']:.7f}, "
              f"bit-equal {100 * q['bit_equal_fraction']:.1f}%")


if __name__ == "__main__":
    report = main(ARGS)
    print_report(report, ARGS.hbm_tbps)
    if ARGS.json:
        with open(ARGS.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
