"""Few-row linear layers as a decode pass runs them: which BLAS path reads Ouro's weights fastest.

Run on the GPU host (~1 minute):

    python scripts/bench_linear.py [--rows 1,8,32] [--json $OUT/bench_linear.json]

For each of an Ouro-1.4B layer's four packed weights (q|k|v, o, gate|up, down) and each row count,
`--layers` distinct weights (so each GEMM reads its weight from HBM, not L2, as in a pass) run back
to back inside one CUDA graph; the median of `--replays` replays, divided by the layer count, is the
time per GEMM, reported with the bandwidth it implies (weight bytes / time). Variants:

    cublas     F.linear, torch's default BLAS library
    cublaslt   F.linear with torch.backends.cuda.preferred_blas_library("cublaslt")
    mv         torch.mv on the 1-row input (cuBLAS's GEMV entry point; rows = 1 only)

`--device cpu` runs the same code eagerly on tiny shapes (a smoke test; its times mean nothing).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

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
    return p.parse_args(argv)


def linear_fn(variant: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if variant == "mv":
        return lambda x, w: torch.mv(w, x[0]).unsqueeze(0)
    return F.linear


def time_per_gemm(variant: str, weights: list[torch.Tensor], x: torch.Tensor, replays: int) -> float:
    """Median µs per GEMM: the layers' GEMMs back to back, in a CUDA graph on CUDA, eager on the CPU."""
    fn = linear_fn(variant)
    if variant != "mv" and x.device.type == "cuda":
        torch.backends.cuda.preferred_blas_library("cublaslt" if variant == "cublaslt" else "cublas")

    def run() -> None:
        for w in weights:
            fn(x, w)

    if x.device.type != "cuda":
        run()
        return float("nan")
    run()  # warm-up: cuBLAS handles and workspaces exist before capture
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
        times.append(start.elapsed_time(end) * 1000.0 / len(weights))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
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
                us = time_per_gemm(variant, weights, x, args.replays)
                gbps = n * k * weights[0].element_size() / (us * 1e3)
                row[variant] = {"us": us, "gb_per_s": gbps}
                cells.append(f"{us:>9.2f} ({gbps:>7.0f})")
            results.append(row)
            print(f"{name:>9} {rows:>4} " + " ".join(cells))
        del weights
    if device.type == "cuda":
        torch.backends.cuda.preferred_blas_library("cublas")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                       "torch": torch.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
