"""Micro-benchmark of the paged prefill kernel at Ouro-1.4B attention shapes (H200 or any CUDA GPU).

    python scripts/bench_prefill_kernel.py [--sweep] [--json out.json]

One attention call of one layer (16 heads × 128, block 16, bf16, shuffled blocks), for 1, 32 and
128 sequences, each a prompt of 1,024 tokens: its first chunk of 512 (no prefix), its second
chunk of 512 (after a 512 prefix) and one chunk of 1,024. Per shape, first a correctness check of
the kernel against torch_ref (bf16 tolerance, a few chunks), then the median time
(triton.testing.do_bench) of:

    kernel   triton_prefill.prefill_attention (one block-table row per chunk)
    decode   the old path: triton_backend.paged_attention, one row per prompt token
    sdpa     torch SDPA, dense causal over the chunk alone (only a chunk with no prefix)

and TFLOP/s (causal: 4 · Dh · Hq · Σ over rows of its context length). --sweep also times a few
tile configurations of the kernel per shape and reports the best. --smoke runs tiny shapes on the
CPU under TRITON_INTERPRET=1 (a check of the script, not a benchmark).
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HEADS, HEAD_DIM, BLOCK_SIZE = 16, 128, 16
SHAPES = [(512, 0), (512, 512), (1024, 0)]  # (chunk length, prefix)
SEQS = [1, 32, 128]
SWEEP = [dict(block_m=m, block_n=n, num_warps=w, num_stages=s)
         for m, n, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))
         if not (m == 64 and w == 8)]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--sweep", action="store_true", help="time tile configurations and report the best")
    parser.add_argument("--seqs", type=int, nargs="*", default=SEQS, help="sequence counts (default 1 32 128)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    return parser.parse_args(argv)


def make_case(seqs: int, chunk: int, prefix: int, heads: int, head_dim: int, block_size: int, device: str,
              dtype):
    """q of `seqs` chunks, a one-layer cache with every sequence's prompt in shuffled blocks, and the metadata."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seqs * 7919 + chunk + prefix)
    blocks_per_seq = -(-(prefix + chunk) // block_size)
    num_blocks = seqs * blocks_per_seq + 1
    k_cache = torch.randn(num_blocks, block_size, heads, head_dim, generator=gen, device=device).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, heads, head_dim, generator=gen, device=device).to(dtype)
    perm = torch.randperm(num_blocks - 1, generator=gen, device=device) + 1
    tables = perm.view(seqs, blocks_per_seq).to(torch.int32)
    q = torch.randn(seqs * chunk, heads, head_dim, generator=gen, device=device).to(dtype)
    cu = torch.arange(seqs + 1, device=device, dtype=torch.int32) * chunk
    starts = torch.full((seqs,), prefix, device=device, dtype=torch.int32)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables, cu_query_lens=cu, start_positions=starts)


def causal_flops(seqs: int, chunk: int, prefix: int, heads: int, head_dim: int) -> float:
    """QKᵀ and PV over each row's context (prefix + its index + 1): 4 · Dh FLOPs per (row, key, head)."""
    keys = chunk * prefix + chunk * (chunk + 1) // 2
    return 4.0 * head_dim * heads * seqs * keys


def check(case: dict, scale: float, tp, torch_ref, max_chunks: int = 3) -> float:
    """Max |kernel − torch_ref| over the first and last chunks; raises past bf16 tolerance."""
    import torch

    got = tp.prefill_attention(**case, scale=scale, max_query_len=int(case["cu_query_lens"][1]))
    seqs = len(case["start_positions"])
    worst = 0.0
    for s in sorted({0, seqs // 2, seqs - 1})[:max_chunks]:
        lo, hi = int(case["cu_query_lens"][s]), int(case["cu_query_lens"][s + 1])
        want = torch_ref.prefill_attention(
            case["q"][lo:hi], case["k_cache"], case["v_cache"], case["block_tables"][s : s + 1],
            torch.tensor([0, hi - lo], device=got.device), case["start_positions"][s : s + 1], scale,
        )
        torch.testing.assert_close(got[lo:hi], want, atol=2e-2, rtol=2e-2)
        worst = max(worst, float((got[lo:hi].float() - want.float()).abs().max()))
    return worst


def timer(smoke: bool) -> Callable[[Callable[[], object]], float]:
    """Median milliseconds of fn: triton.testing.do_bench on CUDA, wall time of 3 runs in the smoke test."""
    if not smoke:
        import triton

        return lambda fn: float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))

    def wall(fn: Callable[[], object]) -> float:
        runs = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            runs.append((time.perf_counter() - start) * 1e3)
        return statistics.median(runs)

    return wall


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton's first import
    import torch

    from rlt_worker.attention import triton_backend as tb

    if args.smoke:
        # float32: the interpreter computes in numpy, which has no bfloat16.
        device, heads, head_dim, block_size, dtype = "cpu", 2, 16, 4, torch.float32
        shapes, seq_counts, sweep = [(8, 0), (8, 8)], [1, 2], SWEEP[:1]
    else:
        if not torch.cuda.is_available():
            print("needs CUDA (or --smoke)", file=sys.stderr)
            return 2
        device, heads, head_dim, block_size, dtype = "cuda", HEADS, HEAD_DIM, BLOCK_SIZE, torch.bfloat16
        shapes, seq_counts, sweep = SHAPES, args.seqs, SWEEP
    bench = timer(args.smoke)
    rows_out = []
    for seqs, (chunk, prefix) in itertools.product(seq_counts, shapes):
        case = make_case(seqs, chunk, prefix, heads, head_dim, block_size, device, dtype)
        rows_out.append(bench_shape(case, seqs, chunk, prefix, bench, sweep if args.sweep else []))
        del case
        if device == "cuda":
            torch.cuda.empty_cache()

    print_table(rows_out, args.sweep)
    if args.json:
        meta = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter smoke test)",
                    torch=torch.__version__, triton=getattr(tb.triton, "__version__", None),
                    heads=heads, head_dim=head_dim, block_size=block_size, dtype=str(dtype).removeprefix("torch."))
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, results=rows_out), f, indent=1)
    return 0


def bench_shape(case: dict, seqs: int, chunk: int, prefix: int, bench: Callable, sweep: list[dict]) -> dict:
    """Check, then time the kernel, the per-row decode path and (no prefix) SDPA on one shape."""
    import torch
    import torch.nn.functional as F

    from rlt_worker.attention import torch_ref
    from rlt_worker.attention import triton_backend as tb
    from rlt_worker.attention import triton_prefill as tp

    _, heads, head_dim = case["q"].shape
    scale = head_dim**-0.5
    flops = causal_flops(seqs, chunk, prefix, heads, head_dim)
    row = dict(seqs=seqs, chunk=chunk, prefix=prefix, rows=seqs * chunk, gflop=flops / 1e9)
    row["max_abs_err"] = check(case, scale, tp, torch_ref)

    def kernel(**tiles: int) -> torch.Tensor:
        return tp.prefill_attention(**case, scale=scale, max_query_len=chunk, **tiles)

    chunks, positions = torch_ref.chunk_rows(case["cu_query_lens"], case["start_positions"], seqs * chunk)
    row_tables, context_lens = case["block_tables"][chunks], (positions + 1).to(torch.int32)

    def decode() -> torch.Tensor:
        return tb.paged_attention(case["q"], case["k_cache"], case["v_cache"], row_tables, context_lens, scale)

    row["kernel_ms"] = bench(kernel)
    row["decode_ms"] = bench(decode)
    if prefix == 0:
        dense = case["q"].view(seqs, chunk, heads, head_dim).transpose(1, 2)  # k = v = q's shape: timing only
        row["sdpa_ms"] = bench(lambda: F.scaled_dot_product_attention(dense, dense, dense, is_causal=True))
    if sweep:
        timed = []
        for tiles in sweep:
            try:
                timed.append((bench(lambda t=tiles: kernel(**t)), tiles))
            except Exception as error:  # a tile set past the shared-memory limit: skip it, say so
                print(f"skipped {tiles}: {type(error).__name__}: {str(error)[:120]}", file=sys.stderr)
        row["best_ms"], row["best_tiles"] = min(timed, key=lambda x: x[0])
    for name in ("kernel", "decode", "sdpa", "best"):
        if f"{name}_ms" in row:
            row[f"{name}_tflops"] = flops / (row[f"{name}_ms"] * 1e-3) / 1e12
    return row


def print_table(rows: list[dict], sweep: bool) -> None:
    def cell(row: dict, name: str) -> str:
        if f"{name}_ms" not in row:
            return f"{'—':>9} {'':>7}"
        return f"{row[f'{name}_ms']:9.3f} {row[f'{name}_tflops']:7.1f}"

    head = (f"{'seqs':>5} {'chunk':>6} {'prefix':>6} {'max err':>8} | {'kernel ms':>9} {'TFLOP/s':>7} | "
            f"{'decode ms':>9} {'TFLOP/s':>7} {'×':>6} | {'sdpa ms':>9} {'TFLOP/s':>7}")
    if sweep:
        head += f" | {'best ms':>9} {'TFLOP/s':>7}  tiles"
    print(head)
    for r in rows:
        line = (f"{r['seqs']:5d} {r['chunk']:6d} {r['prefix']:6d} {r['max_abs_err']:8.4f} | {cell(r, 'kernel')} | "
                f"{cell(r, 'decode')} {r['decode_ms'] / r['kernel_ms']:6.1f} | {cell(r, 'sdpa')}")
        if sweep:
            t = r["best_tiles"]
            line += f" | {cell(r, 'best')}  m{t['block_m']} n{t['block_n']} w{t['num_warps']} s{t['num_stages']}"
        print(line)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
