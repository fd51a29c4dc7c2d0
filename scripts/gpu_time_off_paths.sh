#!/usr/bin/env bash
# The decode paths built and left off until timed, against the default, on the H200, in four device
# calls of < 600 s each. Run from the repository root after the device set-up line
# (../shared/gpu/README.md), with RLT_COMMIT set to the tree's commit:
#
#   bash scripts/gpu_time_off_paths.sh 1      # step 1
#   bash scripts/gpu_time_off_paths.sh 2      # step 3
#   bash scripts/gpu_time_off_paths.sh 3      # step 5 (needs .bench/base-748a734.tgz: carry .bench)
#   bash scripts/gpu_time_off_paths.sh 4      # steps 2 and 4
#
# 1. One loop pass and device refill's CODA (scripts/profile_decode_pass.py, rows 1 and 32, PDL on):
#    the default path, `fused-rotary-attention` (a decode batch's RoPE, K/V write and attention in one
#    launch) and `fused-head-strip` (the LM head through a strip, gated by the rows that exited);
#    float32 and bf16 parity against the default. $OUT/pass.json, $OUT/pass.log.
#    And at one row, each in a copy of the tree: 16 attention splits instead of 8
#    (triton_backend._MIN_SPLIT_TOKENS 64), $OUT/pass-splits16.json; the rotary attention's writer
#    storing before its loop (triton_backend.ROTARY_STORE_FIRST), $OUT/pass-store-first.json;
#    8 warps an attention program instead of 4 (no register spills), rows 1 and 32, $OUT/pass-warps8.json;
#    and, at rows 1 and 32, Ouro's MHA attention (one q head a kv head) without tl.dot (scores and the
#    weighted sum by tl.sum on CUDA cores, 64-token tiles, no padding of the one q row to 16) at 8
#    warps, $OUT/pass-nodot8.json. (A 128-token tile, tried in the plan before, is left out: it spills
#    up to 4,000 B a thread in the rotary attention on Triton 3.6: scripts/kernel_resources.py --tiles 128.)
# 2. The GPU tests of those kernels. $OUT/tests.log.
# 3. c = 1 throughput (trace, ouro, ouro_replay; median of 3, the float32 gate), the default tree and
#    a copy of it with --fused-rotary-attention and ouro_fused.HEAD_STRIP_SETTINGS set to the
#    profile's candidate: $OUT/c1-default.json, $OUT/c1-off-paths.json and their logs.
# 4. The GPU tests of early results (the side-stream copy with an early result, the refill flags'
#    kernel, device refill against the host loop). $OUT/tests-early.log.
# 5. c = 32 ITL p50 / p99 with early results (this tree) against 748a734, the tree before them
#    (unpacked from .bench/base-748a734.tgz): fixed, trace, ouro, 2 runs, --no-gate.
#    $OUT/c32-early.json, $OUT/c32-base.json and their logs. Make the archive here first (the device's
#    copy has no git history): git archive --format=tar.gz -o .bench/base-748a734.tgz 748a734 protocol \
#      rlt_engine/*.py rlt_engine/bench rlt_engine/executor rlt_engine/http_api rlt_worker scripts pyproject.toml
# Each step has its own timeout; a step that runs out leaves the others' files.
set -uo pipefail
part=${1:?"usage: gpu_time_off_paths.sh PART (1: pass profiles, 2: c = 1 throughput, 3: c = 32 ITL, 4: GPU tests)"}
out=${OUT:-/tmp}
root=$PWD
t0=$(date +%s)
step() { echo "$1 rc=$2 $(( $(date +%s) - t0 ))s"; }

if [ "$part" = 1 ]; then
timeout 170 python scripts/profile_decode_pass.py --rows 1,32 --pdl on --rotary-attention --head-strip --top 8 \
  --dtypes bfloat16,float32 --json "$out/pass.json" > "$out/pass.log" 2>&1
step pass $?
grep -E "^fused|vs|refill's CODA" "$out/pass.log"

# Two one-line variants of triton_backend, each in a copy of the tree, at one row: 16 attention splits
# instead of 8 (_MIN_SPLIT_TOKENS 64: one 64-token tile a program, all of it asked of the L2 before
# the wait), and the rotary attention's writer storing before its loop (ROTARY_STORE_FIRST).
variant() {  # NAME ROWS SED-EXPRESSION...
  local tree=/tmp/rlt-$1 name=$1 rows=$2; shift 2
  rm -rf "$tree" && mkdir -p "$tree" && cp -r protocol rlt_engine rlt_worker scripts pyproject.toml "$tree"/
  for e in "$@"; do sed -i "$e" "$tree/rlt_worker/attention/triton_backend.py"; done
  (cd "$tree" && PYTHONPATH="/tmp/site:$tree" timeout 80 python scripts/profile_decode_pass.py --rows "$rows" --pdl on \
    --rotary-attention --dtypes bfloat16 --json "$out/pass-$name.json" > "$out/pass-$name.log" 2>&1)
  step "$name" $?
  grep -E "^fused" "$out/pass-$name.log"
}
# 8 warps an attention program instead of 4: at 4 its threads spill (255 registers and a 40-B stack,
# 408 B with the rotary register hand-off, Triton 3.6 for sm_90: scripts/kernel_resources.py); at 8
# none, but an SM then holds fewer programs, which the 32-row pass may feel.
variant warps8 1,32 's/^ATTENTION_WARPS = 4$/ATTENTION_WARPS = 8/'
variant store-first 1 's/^ROTARY_STORE_FIRST = False$/ROTARY_STORE_FIRST = True/'
variant splits16 1 's/^_MIN_SPLIT_TOKENS = 128$/_MIN_SPLIT_TOKENS = 64/'
# Ouro-1.4B is MHA: tl.dot pads each program's one q row to 16 and takes K and V through shared
# memory; tl.sum keeps them in registers (bit-different sums, the same as the fp64 path's layout). At 8
# warps: at 4 it spills 328 B (Triton 3.6).
variant nodot8 1,32 's/^    use_dot = not f64 and head_dim >= 16$/    use_dot = not f64 and head_dim >= 16 and group > 1/' \
  's/^        tile = 64 if use_dot else 16$/        tile = 64 if use_dot or not f64 else 16/' \
  's/^ATTENTION_WARPS = 4$/ATTENTION_WARPS = 8/'

exit 0
fi

if [ "$part" = 4 ]; then
timeout 250 python -m pytest -m gpu -q tests/test_triton_attention.py tests/test_strip_gemv.py tests/test_pdl.py \
  > "$out/tests.log" 2>&1
step tests $?
tail -3 "$out/tests.log"
timeout 200 python -m pytest -m gpu -q tests/test_gpu_pipelined.py::test_side_stream_copy_reads_a_snapshot \
  tests/test_refill_columns.py tests/test_gpu_exit_graphs.py > "$out/tests-early.log" 2>&1
step tests-early $?
tail -3 "$out/tests-early.log"
exit 0
fi

if [ "$part" = 3 ]; then
base=/tmp/rlt-base
rm -rf "$base" && mkdir -p "$base" && tar -xzf .bench/base-748a734.tgz -C "$base" \
  && ln -s "$root/rlt_engine/checkpoints" "$base/rlt_engine/checkpoints" || { echo "no base tree"; exit 1; }
bench=(python -m rlt_engine.cli bench throughput --model synthetic-ouro-1.4b --workers 0 --concurrency 32 --repeats 2
       --exit fixed,trace,ouro --no-gate --total-seconds 240)
timeout 250 "${bench[@]}" --json "$out/c32-early.json" > "$out/c32-early.log" 2>&1
step c32-early $?
(cd "$base" && PYTHONPATH="/tmp/site:$base" RLT_COMMIT=748a734 timeout 250 "${bench[@]}" \
  --json "$out/c32-base.json" > "$out/c32-base.log" 2>&1)
step c32-base $?
cd "$root"
grep -hE "^\|" "$out/c32-early.log" "$out/c32-base.log"
exit 0
fi

variant=/tmp/rlt-off-paths
rm -rf "$variant" && mkdir -p "$variant"
cp -r protocol rlt_engine rlt_worker scripts pyproject.toml "$variant"/
sed -i 's/^HEAD_STRIP_SETTINGS: Mapping\[WeightKey, StripConfig\] = {}$/HEAD_STRIP_SETTINGS: Mapping[WeightKey, StripConfig] = {(49152, 2048, d): StripConfig(4, 4) for d in SUPPORTED_DTYPES}/' \
  "$variant/rlt_worker/models/ouro_fused.py"
grep -q "^HEAD_STRIP_SETTINGS.*49152" "$variant/rlt_worker/models/ouro_fused.py" || { echo "head strip edit failed"; exit 1; }

bench=(python -m rlt_engine.cli bench throughput --model synthetic-ouro-1.4b --workers 0 --concurrency 1 --repeats 3
       --max-seconds 12 --exit trace,ouro,ouro_replay --total-seconds 260)
timeout 270 "${bench[@]}" --json "$out/c1-default.json" > "$out/c1-default.log" 2>&1
step c1-default $?
(cd "$variant" && PYTHONPATH="/tmp/site:$variant" timeout 270 "${bench[@]}" --fused-rotary-attention \
  --json "$out/c1-off-paths.json" > "$out/c1-off-paths.log" 2>&1)
step c1-off-paths $?
cd "$root"
grep -hE "^\||ouro /|gate:" "$out/c1-default.log" "$out/c1-off-paths.log"
