"""Few-row linear layers as a decode pass runs them: which BLAS path reads Ouro's weights fastest.

Run on the GPU host (~1 minute):

    python scripts/bench_linear.py [--rows 1,8,32] [--json $OUT/bench_linear.json]
    python scripts/bench_linear.py --sweep --rows 1,8 [--json $OUT/splitk.json]     (~1.5 minutes)

For each of an Ouro-1.4B layer's four packed weights (q|k|v, o, gate|up, down) and each row count,
`--layers` distinct weights (so each GEMM reads its weight from HBM, not L2, as in a pass) run back
to back inside one CUDA graph; the median of `--replays` replays, divided by the layer count, is the
time per GEMM, reported with the bandwidth it implies (weight bytes / time). Variants:

    cublas     F.linear, torch's default BLAS library
    cublaslt   F.linear with torch.backends.cuda.preferred_blas_library("cublaslt")
    mv         torch.mv on the 1-row input (cuBLAS's GEMV entry point; rows = 1 only)
    splitk     rlt_worker/kernels/splitk_gemv.py with the weight's SPLITK_SETTINGS entry
               (rlt_worker/models/ouro_fused.py), or SplitKConfig()'s defaults where it has none

`--sweep` times cuBLAS and then split-K at every setting of the grid (--block-n × --block-k ×
--splits × --warps × --stages × --dot) per shape and row count, the same way, and prints each
shape's five best settings and its winner: the one setting with the least time summed over the
row counts (one setting serves every row count, so a row's result does not depend on M). A
winner faster than cuBLAS at every row count is printed as a SPLITK_SETTINGS entry to switch on.

`--device cpu` runs the same code eagerly on tiny shapes (a smoke test; its times mean nothing;
split-K needs TRITON_INTERPRET=1 there).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rlt_worker.kernels.splitk_gemv import SplitKConfig, SplitKGemv  # noqa: E402
from rlt_worker.models.ouro_fused import SPLITK_MAX_ROWS, SPLITK_SETTINGS  # noqa: E402

# (name, out_features, in_features) of Ouro-1.4B's packed layer weights (hidden 2,048, MLP 5,632).
OURO_SHAPES = (("q|k|v", 6144, 2048), ("o", 2048, 2048), ("gate|up", 11264, 2048), ("down", 2048, 5632))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", default="1,8,32")
    p.add_argument("--layers", type=int, default=24, help="distinct weights per shape (Ouro-1.4B: 24 layers)")
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--variants", default="cublas,cublaslt,mv")
    p.add_argument("--shrink", type=int, default=1, help="divide every dimension by this (CPU smoke test)")
    p.add_argument("--json", default=None)
    p.add_argument("--sweep", action="store_true", help="cuBLAS and the split-K grid below, per shape")
    p.add_argument("--max-rows", type=int, default=SPLITK_MAX_ROWS, help="split-K's row bound (its BLOCK_M)")
    p.add_argument("--block-n", default="8,16,32,64")
    p.add_argument("--block-k", default="256,512")
    p.add_argument("--splits", default="1,2,4,8")
    p.add_argument("--warps", default="4")
    p.add_argument("--stages", default="1,3", help="1: no cp.async ring (a slice of 1-2 K blocks gains nothing "
                   "from one, and its shared memory costs programs per SM)")
    p.add_argument("--dot", default="1,0", help="1: tl.dot (tensor cores), 0: multiply-add")
    return p.parse_args(argv)


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def linear_fn(variant: str, n: int, k: int, dtype: torch.dtype, device: torch.device,
              max_rows: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if variant == "mv":
        return lambda x, w: torch.mv(w, x[0]).unsqueeze(0)
    if variant == "splitk":
        return SplitKGemv(n, k, SPLITK_SETTINGS.get((n, k, dtype), SplitKConfig()), max_rows, device)
    if device.type == "cuda":
        torch.backends.cuda.preferred_blas_library("cublaslt" if variant == "cublaslt" else "cublas")
    return F.linear


def time_per_gemm(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], weights: list[torch.Tensor],
                  x: torch.Tensor, replays: int) -> float:
    """Median µs per GEMM: the layers' GEMMs back to back, in a CUDA graph on CUDA, eager on the CPU."""

    def run() -> None:
        for w in weights:
            fn(x, w)

    if x.device.type != "cuda":
        run()
        return float("nan")
    return time_in_graph(run, len(weights), replays)


def time_in_graph(run: Callable[[], None], calls: int, replays: int) -> float:
    """Median µs per call: `run` makes `calls` calls back to back, captured once in a CUDA graph and replayed."""
    run()  # warm-up: cuBLAS handles and workspaces exist, Triton kernels are compiled, before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / calls)
    return statistics.median(times)


def gb_per_s(n: int, k: int, dtype: torch.dtype, us: float) -> float:
    return n * k * dtype.itemsize / (us * 1e3)


def sweep_grid(args: argparse.Namespace) -> list[SplitKConfig]:
    """Every valid setting of the grid. Multiply-add settings whose product tile passes 128 fp32 values
    a thread (BLOCK_M·BLOCK_N·BLOCK_K / threads) are left out: its reduction over K is a shuffle tree
    per (row, column), which at 8 rows already costs more than the load (PTX of N8 K512 at 8 warps:
    512 shuffles a thread), and larger tiles spill."""
    configs = []
    for dot, bn, bk, s, nw, ns in itertools.product(ints(args.dot), ints(args.block_n), ints(args.block_k),
                                                    ints(args.splits), ints(args.warps), ints(args.stages)):
        block_m = 16 if dot else 1 << (args.max_rows - 1).bit_length()
        if (dot and min(bn, bk) < 16) or (not dot and block_m * bn * bk > 128 * 32 * nw):
            continue
        configs.append(SplitKConfig(bn, bk, s, nw, ns, bool(dot)))
    return configs


def sweep_shape(args: argparse.Namespace, name: str, weights: list[torch.Tensor], configs: list[SplitKConfig],
                rows_list: list[int]) -> tuple[list[dict], dict]:
    """cuBLAS and every split-K setting at each row count on one shape: the rows of the JSON, the winner."""
    n, k = weights[0].shape
    device, dtype = weights[0].device, weights[0].dtype
    xs = {rows: torch.randn(rows, k, device=device, dtype=dtype) for rows in rows_list}
    cublas = {rows: time_per_gemm(linear_fn("cublas", n, k, dtype, device, args.max_rows), weights, x, args.replays)
              for rows, x in xs.items()}
    results = []
    for cfg in configs:
        try:
            gemv = SplitKGemv(n, k, cfg, args.max_rows, device)
            times = {rows: time_per_gemm(gemv, weights, x, args.replays) for rows, x in xs.items()}
        except Exception as exc:  # a setting the compiler cannot build (shared memory, registers): skip it
            print(f"{name:>9} {cfg}: skipped ({type(exc).__name__}: {str(exc)[:120]})")
            continue
        results.append({"shape": name, "out": n, "in": k, "config": vars(cfg), "splits_run": gemv.splits,
                        "programs": gemv.splits * math.ceil(n / cfg.block_n),
                        "us": times, "cublas_us": cublas})
    ranked = sorted(results, key=lambda r: sum(r["us"].values()))
    print(f"{name} {n}×{k}: cuBLAS " + ", ".join(f"{rows} rows {us:.2f} µs ({gb_per_s(n, k, dtype, us):.0f} GB/s)"
                                                  for rows, us in cublas.items()))
    for r in ranked[:5]:
        cfg = r["config"]
        cells = ", ".join(f"{rows} rows {us:.2f} µs ({gb_per_s(n, k, dtype, us):.0f} GB/s, ×{cublas[rows] / us:.2f})"
                          for rows, us in r["us"].items())
        print(f"    {'dot' if cfg['dot'] else 'fma'} N{cfg['block_n']} K{cfg['block_k']} S{r['splits_run']} "
              f"w{cfg['num_warps']} st{cfg['num_stages']} ({r['programs']} programs): {cells}")
    winner = ranked[0] if ranked else None
    return results, winner


def sweep(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    """--sweep: every shape's grid; prints the SPLITK_SETTINGS entries of the shapes split-K wins."""
    configs, rows_list = sweep_grid(args), ints(args.rows)
    print(f"split-K sweep: {len(configs)} settings × rows {rows_list}, {args.layers} weights a shape, "
          f"median of {args.replays} graph replays, max_rows {args.max_rows}")
    results, winners = [], {}
    for name, n, k in OURO_SHAPES:
        n, k = n // args.shrink, k // args.shrink
        weights = [torch.randn(n, k, device=device, dtype=dtype) * 0.02 for _ in range(args.layers)]
        shape_results, winner = sweep_shape(args, name, weights, configs, rows_list)
        results += shape_results
        if winner is not None:
            winners[name] = winner
        del weights
    print("winners (least µs summed over rows; switch on where faster than cuBLAS at every row count):")
    for name, w in winners.items():
        wins = all(w["us"][rows] < w["cublas_us"][rows] for rows in rows_list)
        entry = f"({w['out']}, {w['in']}, {dtype}): {SplitKConfig(**w['config'])!r},"
        print(f"    {name:>9} {'WINS ' if wins else 'loses'} {entry}  # splits run {w['splits_run']}, "
              + ", ".join(f"{rows} rows ×{w['cublas_us'][rows] / w['us'][rows]:.2f}" for rows in rows_list))
    return {"dtype": str(dtype), "sweep": results, "winners": winners}


def winning_settings(report: dict) -> dict:
    """A --sweep JSON's winners that beat cuBLAS at every row count, as SPLITK_SETTINGS entries."""
    dtype = getattr(torch, report["dtype"].removeprefix("torch."))
    return {(w["out"], w["in"], dtype): SplitKConfig(**w["config"]) for w in report["winners"].values()
            if all(us < w["cublas_us"][rows] for rows, us in w["us"].items())}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.sweep:
        report = sweep(args, device, dtype)
        if args.json:
            write_json(args.json, device, report)
        return
    variants = args.variants.split(",")
    results = []
    print(f"{'shape':>9} {'rows':>4} " + " ".join(f"{v + ' µs (GB/s)':>20}" for v in variants))
    for name, n, k in OURO_SHAPES:
        n, k = n // args.shrink, k // args.shrink
        weights = [torch.randn(n, k, device=device, dtype=dtype) * 0.02 for _ in range(args.layers)]
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, device=device, dtype=dtype)
            row = {"shape": name, "out": n, "in": k, "rows": rows, "layers": args.layers}
            cells = []
            for variant in variants:
                if variant == "mv" and rows != 1:
                    cells.append(f"{'—':>20}")
                    continue
                us = time_per_gemm(linear_fn(variant, n, k, dtype, device, args.max_rows), weights, x, args.replays)
                gbps = gb_per_s(n, k, dtype, us)
                row[variant] = {"us": us, "gb_per_s": gbps}
                cells.append(f"{us:>9.2f} ({gbps:>7.0f})")
            results.append(row)
            print(f"{name:>9} {rows:>4} " + " ".join(cells))
        del weights
    if device.type == "cuda":
        torch.backends.cuda.preferred_blas_library("cublas")
    if args.json:
        write_json(args.json, device, {"results": results})


def write_json(path: str, device: torch.device, report: dict) -> None:
    import triton

    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                   "torch": torch.__version__, "triton": triton.__version__, **report}, f, indent=1)


if __name__ == "__main__":
    main()
