"""Micro-benchmark of the Triton GEMV (rlt_worker/kernels/gemv.py) against F.linear at Ouro-1.4B's loop shapes.

    python scripts/bench_gemv.py [--sweep] [--json out.json]

The four weights of a decoder layer as FusedOuroModel packs them (bf16): q|k|v [6144, 2048],
o [2048, 2048], gate|up [11264, 2048], down [2048, 5632], at M ∈ {1, 2, 4, 8, 16, 32} rows. Per
shape, first a correctness check of the kernel against F.linear (bf16 tolerance), then the median
time (triton.testing.do_bench) of F.linear (cuBLAS) and of the kernel with its default blocks, in
µs, with GB/s (W + x + y bytes) and the ratio. --sweep also times a handful of BLOCK_N / BLOCK_K /
num_warps / num_stages settings per shape and prints the best. --device cpu runs tiny shapes
under TRITON_INTERPRET=1 (a check of the script; its times mean nothing).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

SHAPES = {"qkv": (6144, 2048), "o": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632)}
ROWS = [1, 2, 4, 8, 16, 32]
SMOKE_SHAPES = {"tiny": (40, 72)}
SMOKE_ROWS = [1, 3]
# (use_dot, BLOCK_N, BLOCK_K, num_warps, num_stages). Multiply-add: BLOCK_M holds all rows up to 16;
# tl.dot: BLOCK_M = max(16, rows) up to 64.
SWEEP = [(False, 4, 512, 4, 2), (False, 8, 256, 4, 2), (False, 8, 512, 4, 2), (False, 8, 1024, 8, 2),
         (False, 8, 2048, 8, 1), (False, 16, 256, 4, 2),
         (True, 16, 256, 4, 2), (True, 16, 512, 4, 3), (True, 32, 256, 4, 3), (True, 16, 128, 4, 4),
         (True, 32, 512, 8, 3), (True, 64, 256, 8, 3)]
# Largest multiply-add accumulator (BLOCK_M·BLOCK_N·BLOCK_K fp32) a setting may ask for: beyond it registers spill.
MAX_ACC = 32768


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--sweep", action="store_true", help="time block/warp settings per shape and print the best")
    p.add_argument("--json", help="also write the results to this file")
    return p.parse_args(argv)


ARGS = parse() if __name__ == "__main__" else None
if ARGS is not None and ARGS.device == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from rlt_worker.kernels.gemv import GemvConfig, default_config, gemv  # noqa: E402


def timer(cuda: bool) -> Callable[[Callable[[], object]], float]:
    """Median ms of fn: do_bench on the GPU, a few wall-clock calls under the interpreter."""
    if cuda:
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=10, rep=40, return_mode="median")

    def wall(fn: Callable[[], object]) -> float:
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return wall


def check(x: torch.Tensor, w: torch.Tensor, config: GemvConfig | None = None) -> float:
    """Max |gemv − F.linear|; raises past bf16 tolerance (two bf16 ulps of the result, plus the sums' rounding)."""
    got, want = gemv(x, w, config).double(), F.linear(x, w).double()
    err = (got - want).abs()
    bound = 2.0**-7 * want.abs() + 1e-2
    if not bool((err <= bound).all()):
        raise AssertionError(f"gemv {tuple(x.shape)}·{tuple(w.shape)}ᵀ {config}: max |Δ| {float(err.max()):.3e} "
                             "past bf16 tolerance")
    return float(err.max())


def sweep(x: torch.Tensor, w: torch.Tensor, ms: Callable) -> tuple[GemvConfig, float]:
    """The fastest SWEEP setting for this shape (each checked first) and its median ms."""
    rows = x.shape[0]
    best: tuple[GemvConfig, float] | None = None
    for use_dot, block_n, block_k, warps, stages in SWEEP:
        block_m = max(16, min(triton.next_power_of_2(rows), 64)) if use_dot else min(triton.next_power_of_2(rows), 16)
        if not use_dot and block_m * block_n * block_k > MAX_ACC:
            continue
        cfg = GemvConfig(block_m, block_n, block_k, warps, stages, use_dot)
        check(x, w, cfg)
        t = ms(lambda c=cfg: gemv(x, w, c))
        if best is None or t < best[1]:
            best = (cfg, t)
    assert best is not None, "no sweep setting fits MAX_ACC"
    return best


def run(args: argparse.Namespace) -> list[dict]:
    cuda = args.device.startswith("cuda")
    ms = timer(cuda)
    shapes, rows_list = (SHAPES, ROWS) if cuda else (SMOKE_SHAPES, SMOKE_ROWS)
    gen = torch.Generator(device=args.device).manual_seed(0)
    results = []
    for (name, (n, k)), rows in itertools.product(shapes.items(), rows_list):
        w = (torch.randn(n, k, generator=gen, device=args.device) * k**-0.5).to(torch.bfloat16)
        x = torch.randn(rows, k, generator=gen, device=args.device).to(torch.bfloat16)
        err = check(x, w)
        gb = (n * k + rows * k + rows * n) * 2 / 1e9
        t_lin, t_gemv = ms(lambda x=x, w=w: F.linear(x, w)), ms(lambda x=x, w=w: gemv(x, w))
        r = {"shape": name, "n": n, "k": k, "rows": rows, "max_abs_err": err,
             "linear_us": t_lin * 1e3, "gemv_us": t_gemv * 1e3, "linear_gbps": gb / t_lin * 1e3,
             "gemv_gbps": gb / t_gemv * 1e3, "speedup": t_lin / t_gemv,
             "default": default_config(rows, k, x.dtype)._asdict()}
        if args.sweep:
            cfg, t = sweep(x, w, ms)
            r.update(best=cfg._asdict(), best_us=t * 1e3, best_gbps=gb / t * 1e3)
        results.append(r)
        print_row(r)
    return results


def print_row(r: dict) -> None:
    line = (f"{r['shape']:8} {r['n']:>6}x{r['k']:<5} M={r['rows']:<3} F.linear {r['linear_us']:8.1f} µs "
            f"{r['linear_gbps']:7.0f} GB/s | gemv {r['gemv_us']:8.1f} µs {r['gemv_gbps']:7.0f} GB/s | "
            f"×{r['speedup']:.2f}")
    if "best" in r:
        b = r["best"]
        line += (f" | best {'dot' if b['use_dot'] else 'fma'} BM{b['block_m']} BN{b['block_n']} BK{b['block_k']} "
                 f"w{b['num_warps']} s{b['num_stages']} "
                 f"{r['best_us']:.1f} µs {r['best_gbps']:.0f} GB/s")
    print(line, flush=True)


def main(args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu (interpreter)"
    print(f"gemv vs F.linear, bf16, on {device} (torch {torch.__version__})")
    results = run(args)
    print(f"total {time.perf_counter() - t0:.1f} s")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"device": device, "torch": torch.__version__, "results": results}, f, indent=2)


if __name__ == "__main__":
    main(ARGS)
