#!/usr/bin/env bash
# The Triton GEMV on the GPU machine, in one device call (issue 18): the kernel's GPU tests, the
# micro-benchmark with its sweep, the decode pass profile with the GEMV on for passes of ≤ 16 rows
# (rows 1 and 8 on it, 32 on cuBLAS), and the float32 gate of the fused engine (the GEMV on for
# every decode pass among its engines). From the repository root, .gpu carried:
#
#     bash .gpu/setup.sh && export PYTHONPATH=/tmp/site:$PWD && bash scripts/gpu_gemv_check.sh
#
# Environment: GEMV_MAX_ROWS (16), the bound profile_decode_pass builds the fused path with.
# Back under $OUT: gemv.log, bench_gemv.json, profile_decode_pass.json.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
GEMV_MAX_ROWS=${GEMV_MAX_ROWS:-16}
mkdir -p "$OUT"
{
  start=$SECONDS
  timeout 60 python -m pytest -m gpu -q tests/test_gemv.py 2>&1 | tail -n 5
  echo "== [$((SECONDS - start)) s] bench_gemv --sweep"
  timeout 150 python scripts/bench_gemv.py --sweep --json "$OUT/bench_gemv.json"
  echo "== [$((SECONDS - start)) s] profile_decode_pass --gemv-max-rows $GEMV_MAX_ROWS"
  timeout 180 python scripts/profile_decode_pass.py --dtypes bfloat16 --rows 1,8,32 --top 12 \
    --gemv-max-rows "$GEMV_MAX_ROWS" --json "$OUT/profile_decode_pass.json"
  echo "== [$((SECONDS - start)) s] test_gpu_fused -k float32 (engines: fused, fused + GEMV, torch modules)"
  timeout 300 python -m pytest -m gpu -q -s tests/test_gpu_fused.py -k float32 2>&1 | grep -E "fused_layers=|passed|failed|Error"
  echo "== [$((SECONDS - start)) s] done"
} 2>&1 | tee "$OUT/gemv.log"
