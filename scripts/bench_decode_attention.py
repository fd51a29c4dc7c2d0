"""The decode attention kernel at Ouro-1.4B's shapes: its time per layer against the K/V bytes it reads.

Run on the GPU host (~1 minute):

    python scripts/bench_decode_attention.py [--rows 1,8,32] [--context 1024] [--table-tokens 2048]
                                             [--json $OUT/attn.json]

For each row count, `--layers` layers' caches (16 kv heads × 128, block 16, bf16, each row's
blocks shuffled through the pool) are read back to back inside one CUDA graph, as a pass does,
so each layer's K/V comes from HBM, not L2: the median of `--replays` replays divided by the
layers is the time per layer, printed with the bandwidth it implies (K/V bytes of the rows'
contexts / time). Variants: the heuristics' choice (`auto`: triton_backend._auto_splits and the
default tile) and every (num_splits, tile) of --splits × --tiles, each at every warp count of --warps
(triton_backend.ATTENTION_WARPS, set for the variant; `auto` at the module's own) and every launch of
--launch (`plain`, or `pdl`: programmatic dependent launch, as a decode pass of few rows launches it,
so each layer's program asks the L2 for its first tile before waiting for the layer before; `auto`
at the first listed). Each variant's output is checked against `auto`'s (bf16 tolerance) before it is
timed. `--table-tokens` sets the block table's width (default: the context), which the split
heuristics read: a graphed decode pass's table is a power-of-two bucket, 2,048 tokens for contexts of
1,025 to 2,048, so `--context 1088 --table-tokens 2048` is a 1,024-token prompt's decode midway.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_linear import time_in_graph  # noqa: E402  (scripts/, this script's folder)

from rlt_worker.attention import triton_backend as tb  # noqa: E402
from rlt_worker.kernels.launch import PLAIN, KernelLaunch  # noqa: E402

HEADS, HEAD_DIM, BLOCK_SIZE = 16, 128, 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,8,32")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--table-tokens", type=int, default=None,
                   help="the block table's width in tokens, ≥ --context (default: the context)")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--splits", default="2,4,8,16,32")
    p.add_argument("--tiles", default="16,32,64,128")
    p.add_argument("--warps", default=str(tb.ATTENTION_WARPS), help="warps per attention program, e.g. 4,8")
    p.add_argument("--launch", default="plain", help="plain, pdl or both (plain,pdl)")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def launches(text: str) -> list[tuple[str, KernelLaunch]]:
    known = {"plain": lambda: PLAIN, "pdl": lambda: KernelLaunch(pdl=True)}
    names = text.split(",")
    if unknown := [n for n in names if n not in known]:
        raise SystemExit(f"--launch: unknown {unknown}; choose from {sorted(known)}")
    return [(n, known[n]()) for n in names]


def bench_rows(args: argparse.Namespace, rows: int) -> list[dict]:
    device, dtype = torch.device("cuda"), torch.bfloat16
    blocks = -(-max(args.context, args.table_tokens or 0) // BLOCK_SIZE)  # the table's width
    gen = torch.Generator(device=device).manual_seed(rows)
    pool = torch.randn(args.layers, 2, rows * blocks, BLOCK_SIZE, HEADS, HEAD_DIM, device=device, dtype=dtype,
                       generator=gen)
    tables = torch.randperm(rows * blocks, device=device, generator=gen).to(torch.int32).view(rows, blocks)
    lens = torch.full((rows,), args.context, dtype=torch.int32, device=device)
    q = torch.randn(rows, HEADS, HEAD_DIM, device=device, dtype=dtype, generator=gen)
    scale = HEAD_DIM ** -0.5
    kv_bytes = 2 * rows * args.context * HEADS * HEAD_DIM * dtype.itemsize

    def attend(layer: int, **overrides) -> torch.Tensor:
        return tb.paged_attention(q, pool[layer, 0], pool[layer, 1], tables, lens, scale, **overrides)

    default_warps = tb.ATTENTION_WARPS
    launch_list = launches(args.launch)
    want = attend(0)
    auto_splits = tb._auto_splits(rows, HEADS, blocks * BLOCK_SIZE, device)
    variants = [(f"auto {launch_list[0][0]}", default_warps, dict(launch=launch_list[0][1]))] + [
        (f"{name} w{w} splits {s} tile {t}", w, dict(num_splits=s, tile=t, launch=launch))
        for (name, launch), w, s, t in itertools.product(launch_list, ints(args.warps), ints(args.splits),
                                                         ints(args.tiles))]
    results = []
    try:
        for name, warps, overrides in variants:
            tb.ATTENTION_WARPS = warps  # read at each launch: the variant's kernels compile and run at it
            got = attend(0, **overrides)
            torch.testing.assert_close(got, want, rtol=2.0**-7, atol=2e-3)
            def run(o: dict = overrides) -> None:
                for layer in range(args.layers):
                    attend(layer, **o)

            us = time_in_graph(run, args.layers, args.replays)
            settings = {k: v for k, v in overrides.items() if k != "launch"}
            results.append({"rows": rows, "variant": name, "warps": warps, "pdl": overrides["launch"].pdl,
                            **settings, "us": us, "gb_per_s": kv_bytes / (us * 1e3)})
    finally:
        tb.ATTENTION_WARPS = default_warps
    best = min(results, key=lambda r: r["us"])
    auto = results[0]
    print(f"rows {rows}, context {args.context}: {auto['variant']} (splits {auto_splits}) {auto['us']:.2f} µs "
          f"({auto['gb_per_s']:.0f} GB/s); best {best['variant']} {best['us']:.2f} µs ({best['gb_per_s']:.0f} GB/s)")
    for r in sorted(results, key=lambda r: r["us"])[:6]:
        print(f"    {r['variant']:>28}: {r['us']:7.2f} µs  {r['gb_per_s']:6.0f} GB/s")
    return results


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode_attention times CUDA graphs: run it on a CUDA GPU")
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "context": args.context,
              "table_tokens": max(args.context, args.table_tokens or 0),
              "layers": args.layers, "results": [r for rows in ints(args.rows) for r in bench_rows(args, rows)]}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
