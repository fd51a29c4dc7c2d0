"""Registers, stack (spills) and shared memory of the decode attention's variants on sm_90, compiled
on this machine by Triton's own compiler: no GPU, no device time (rlt_worker/kernels/offline_compile.py).

    python scripts/kernel_resources.py [--modes plain,rotary,...] [--warps 4,8] [--tiles 64,128] [--prefill]
                                       [--json OUT]

Each row is one variant of triton_backend._attn_kernel at Ouro-1.4B's heads (16 q heads, 16 kv
heads, Dh 128, 16-token blocks, 8 splits, bf16, PDL on, as a 1-row pass launches it): the plain
attention, the fused rotary one with the register hand-off and with STORE_FIRST, each with tl.dot
and without (MHA's one q row on CUDA cores), at each warp count and tile. A stack over 0 B is
registers spilled to local memory on every program's critical path. Which variant is fastest only
the GPU says (scripts/gpu_time_off_paths.sh 1); this says which ones spill before any is timed.

--prefill adds triton_prefill._prefill_kernel at the same heads: its tuned launch (64 × 32 tiles, 4
warps, 2 stages, the fastest of 20 settings on the H200) and two larger tiles.
"""

from __future__ import annotations

import argparse
import itertools
import json

import triton

from rlt_worker.attention import triton_backend as tb
from rlt_worker.attention import triton_prefill as tp
from rlt_worker.kernels.launch import KernelLaunch
from rlt_worker.kernels.offline_compile import (
    OURO_ATTENTION_TYPES,
    compile_for,
    ouro_attention_constexprs,
    resource_usage,
)

MODES = {"plain": (False, False), "rotary": (True, False), "rotary-store-first": (True, True)}
PREFILL_TYPES = {"bt_ptr": "*i32", "cu_ptr": "*i32", "start_ptr": "*i32", "qk_scale": "fp32"}
PREFILL_LAUNCHES = ((64, 32, 4, 2), (64, 64, 4, 2), (128, 32, 8, 2))  # block_m, block_n, warps, stages


def variant_usage(mode: str, use_dot: bool, warps: int, tile: int) -> dict[str, object]:
    rotary, store_first = MODES[mode]
    constexprs = ouro_attention_constexprs(rotary=rotary, store_first=store_first, use_dot=use_dot, tile=tile)
    options = KernelLaunch(pdl=True).kwargs(1, num_warps=warps, num_stages=3, enable_fp_fusion=False)
    kernel = compile_for(tb._attn_kernel, {**constexprs, "PDL": options.pop("PDL")}, OURO_ATTENTION_TYPES, options)
    usage = resource_usage(kernel)
    return {"mode": mode, "dot": use_dot, "warps": warps, "tile": tile, "registers": usage.registers,
            "stack_bytes": usage.stack_bytes, "shared_bytes": usage.shared_bytes}


def prefill_usage(block_m: int, block_n: int, warps: int, stages: int) -> dict[str, object]:
    constexprs = dict(GROUP=1, GROUP_PAD=1, BLOCK_Q=block_m, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=128,
                      D_PAD=128, BLOCK_SIZE=16, DOT_PRECISION=None)
    usage = resource_usage(compile_for(tp._prefill_kernel, constexprs, PREFILL_TYPES,
                                       {"num_warps": warps, "num_stages": stages}))
    return {"block_m": block_m, "block_n": block_n, "warps": warps, "stages": stages, "registers": usage.registers,
            "stack_bytes": usage.stack_bytes, "shared_bytes": usage.shared_bytes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default=",".join(MODES), help=f"attention modes, comma-separated (of {', '.join(MODES)})")
    p.add_argument("--warps", default="4,8", help="warps a program, comma-separated")
    p.add_argument("--tiles", default="64", help="tokens a tile, comma-separated")
    p.add_argument("--prefill", action="store_true", help="also the prefill kernel's launches")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        p.error(f"unknown mode(s) {', '.join(unknown)}: choose from {', '.join(MODES)}")
    warps = [int(w) for w in args.warps.split(",")]
    tiles = [int(t) for t in args.tiles.split(",")]
    rows = [variant_usage(mode, dot, w, t)
            for mode, dot, w, t in itertools.product(modes, (True, False), warps, tiles)]
    print(f"triton {triton.__version__}, sm_90, triton_backend._attn_kernel at Ouro-1.4B's heads (bf16, PDL)")
    print("| mode | tl.dot | warps | tile | registers | stack B | shared B |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['mode']} | {'yes' if r['dot'] else 'no'} | {r['warps']} | {r['tile']} | {r['registers']} "
              f"| {r['stack_bytes']} | {r['shared_bytes']} |")
    report = {"triton": triton.__version__, "arch": "sm_90", "rows": rows}
    if args.prefill:
        report["prefill_rows"] = [prefill_usage(*launch) for launch in PREFILL_LAUNCHES]
        print("\ntriton_prefill._prefill_kernel at the same heads (bf16)")
        print("| block_m × block_n | warps | stages | registers | stack B | shared B |")
        print("|---|---:|---:|---:|---:|---:|")
        for r in report["prefill_rows"]:
            print(f"| {r['block_m']} × {r['block_n']} | {r['warps']} | {r['stages']} | {r['registers']} "
                  f"| {r['stack_bytes']} | {r['shared_bytes']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
