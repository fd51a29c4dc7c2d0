#!/usr/bin/env bash
# The decode paths built and left off until timed, against the default, on the H200. Run from the
# repository root after the device set-up line (../shared/gpu/README.md), with RLT_COMMIT set to the
# tree's commit:
#
#   bash scripts/gpu_time_off_paths.sh first [BUDGET]   # a session's first call: as much as BUDGET s
#                                                       # (default 560) holds, most needed first
#   bash scripts/gpu_time_off_paths.sh 1                # pass profiles and variants
#   bash scripts/gpu_time_off_paths.sh 2                # c = 1 throughput, default against off paths
#   bash scripts/gpu_time_off_paths.sh 3                # c = 32 ITL against 748a734 (carry .bench)
#   bash scripts/gpu_time_off_paths.sh 4                # the GPU tests of the paths
#
# Parts 1-4 each stay under a call's 600 s. What the steps write under $OUT:
# - tests: the GPU tests of the paths never run on a GPU: the fused rotary attention, the default
#   attention's no-FMA rounding, the gated strip, PDL, early results (the side-stream copy with an
#   early result, the refill flags' kernel, device refill against the host loop), the Philox noise kernel. tests.log.
# - pass: one loop pass and device refill's CODA (scripts/profile_decode_pass.py, rows 1 and 32, PDL
#   on): the default path, `fused-rotary-attention` (a decode batch's RoPE, K/V write and attention in
#   one launch) and `fused-head-strip` (the LM head through a strip, gated by the rows that exited);
#   float32 and bf16 parity against the default. pass.json, pass.log.
# - variants, each in a copy of the tree with triton_backend edited: `nodot8`, Ouro's MHA attention
#   (one q head a kv head) without tl.dot (scores and the weighted sum by tl.sum on CUDA cores, no
#   padding of the one q row to 16) at 8 warps (at 4 it spills 328 B), rows 1 and 32; `store-first`,
#   the rotary attention's writer storing before its loop (ROTARY_STORE_FIRST), one row (16 splits
#   instead of 8, and 8 warps instead of 4: the attention sweep below; 8 warps alone lost 20% at 32
#   rows on an H100, docs/benchmarks.md). pass-NAME.json and .log.
# - attn: the decode attention alone (scripts/bench_decode_attention.py, 24 layers' caches in one graph,
#   context 1,024): plain and PDL launches × 4 and 8 warps × 4, 8, 16 splits × 32- and 64-token tiles
#   at rows 1, 8 and 32.
#   attn.json, attn.log.
# - c1: c = 1 trace, ouro and ouro_replay (median of 3, the float32 gate), the default tree and a copy
#   with --fused-rotary-attention and ouro_fused.HEAD_STRIP_SETTINGS set to the profile's candidate.
#   c1-default.json, c1-off-paths.json and their logs.
# - c32: c = 32 ITL p50 / p99 with early results (this tree; part 3: also 748a734, the tree before
#   them, unpacked from .bench/base-748a734.tgz, made here first since the device's copy has no git
#   history: git archive --format=tar.gz -o .bench/base-748a734.tgz 748a734 protocol \
#     rlt_engine/*.py rlt_engine/bench rlt_engine/executor rlt_engine/http_api rlt_worker scripts pyproject.toml)
#   --no-gate. c32-early.json, c32-base.json and their logs.
# Each step has its own timeout; a step that runs out leaves the others' files.
set -uo pipefail
part=${1:?"usage: gpu_time_off_paths.sh PART (first [BUDGET], 1: pass profiles, 2: c = 1, 3: c = 32 ITL, 4: GPU tests)"}
out=${OUT:-/tmp}
root=$PWD
t0=$(date +%s)
budget=${2:-560}
step() { echo "$1 rc=$2 $(( $(date +%s) - t0 ))s"; }
left() { echo $(( budget - ($(date +%s) - t0) )); }
copy_tree() { rm -rf "$1" && mkdir -p "$1" && cp -r protocol rlt_engine rlt_worker scripts pyproject.toml "$1"/; }

gpu_tests() {  # SECONDS
  timeout "$1" python -m pytest -m gpu -q -p no:cacheprovider tests/test_triton_attention.py tests/test_strip_gemv.py \
    tests/test_pdl.py tests/test_refill_columns.py tests/test_gpu_pipelined.py::test_side_stream_copy_reads_a_snapshot \
    tests/test_gpu_exit_graphs.py tests/test_philox_kernel.py tests/test_greedy_kernel.py > "$out/tests.log" 2>&1
  step tests $?
  grep -E "^FAILED|^ERROR| passed| failed" "$out/tests.log" | cut -c1-200 | tail -20
}

pass_profile() {  # SECONDS
  timeout "$1" python scripts/profile_decode_pass.py --rows 1,32 --pdl on --rotary-attention --head-strip --top 8 \
    --dtypes bfloat16,float32 --json "$out/pass.json" > "$out/pass.log" 2>&1
  step pass $?
  grep -E "^fused|vs|refill's CODA" "$out/pass.log" | cut -c1-220
}

variant() {  # NAME SECONDS ROWS SED-EXPRESSION...: the rotary pass profile in a copy with triton_backend edited
  local tree=/tmp/rlt-$1 name=$1 secs=$2 rows=$3; shift 3
  copy_tree "$tree"
  for e in "$@"; do sed -i "$e" "$tree/rlt_worker/attention/triton_backend.py"; done
  (cd "$tree" && PYTHONPATH="/tmp/site:$tree" timeout "$secs" python scripts/profile_decode_pass.py --rows "$rows" \
    --pdl on --rotary-attention --dtypes bfloat16 --json "$out/pass-$name.json" > "$out/pass-$name.log" 2>&1)
  step "$name" $?
  grep -E "^fused" "$out/pass-$name.log" | cut -c1-220
}
attention_sweep() {  # SECONDS
  timeout "$1" python scripts/bench_decode_attention.py --rows 1,8,32 --launch plain,pdl --warps 4,8 --splits 4,8,16 \
    --tiles 32,64 --json "$out/attn.json" > "$out/attn.log" 2>&1
  step attn $?
  grep -A3 "^rows" "$out/attn.log" | cut -c1-160
}

NODOT8=('s/^    use_dot = not f64 and head_dim >= 16$/    use_dot = not f64 and head_dim >= 16 and group > 1/'
        's/^        tile = 64 if use_dot else 16$/        tile = 64 if use_dot or not f64 else 16/'
        's/^ATTENTION_WARPS = 4$/ATTENTION_WARPS = 8/')

c32() {  # NAME SECONDS TREE [COMMIT]: c = 32 fixed, trace and ouro, 2 runs, ungated, in TREE
  (cd "$3" && PYTHONPATH="/tmp/site:$3" RLT_COMMIT=${4:-${RLT_COMMIT:-}} timeout "$2" python -m rlt_engine.cli bench \
    throughput --model synthetic-ouro-1.4b --workers 0 --concurrency 32 --repeats 2 --exit fixed,trace,ouro --no-gate \
    --total-seconds $(( $2 - 10 )) --json "$out/c32-$1.json" > "$out/c32-$1.log" 2>&1)
  step "c32-$1" $?
  grep -hE "^\|" "$out/c32-$1.log" | cut -c1-220
}

case $part in
first)
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.total --format=csv,noheader
  gpu_tests $(( $(left) > 205 ? 200 : $(left) - 5 ))  # a small budget cuts the tests, not the call
  [ "$(left)" -gt 130 ] && attention_sweep 120
  [ "$(left)" -gt 160 ] && pass_profile 150
  [ "$(left)" -gt 100 ] && c32 early $(( $(left) - 5 )) "$root"
  ;;
1)
  attention_sweep 120
  pass_profile 170
  variant store-first 80 1 's/^ROTARY_STORE_FIRST = False$/ROTARY_STORE_FIRST = True/'
  variant nodot8 80 1,32 "${NODOT8[@]}"
  ;;
2)
  offp=/tmp/rlt-off-paths
  copy_tree "$offp"
  sed -i 's/^HEAD_STRIP_SETTINGS: Mapping\[WeightKey, StripConfig\] = {}$/HEAD_STRIP_SETTINGS: Mapping[WeightKey, StripConfig] = {(49152, 2048, d): StripConfig(4, 4) for d in SUPPORTED_DTYPES}/' \
    "$offp/rlt_worker/models/ouro_fused.py"
  grep -q "^HEAD_STRIP_SETTINGS.*49152" "$offp/rlt_worker/models/ouro_fused.py" || { echo "head strip edit failed"; exit 1; }
  bench=(python -m rlt_engine.cli bench throughput --model synthetic-ouro-1.4b --workers 0 --concurrency 1 --repeats 3
         --max-seconds 12 --exit trace,ouro,ouro_replay --total-seconds 260)
  timeout 270 "${bench[@]}" --json "$out/c1-default.json" > "$out/c1-default.log" 2>&1
  step c1-default $?
  (cd "$offp" && PYTHONPATH="/tmp/site:$offp" timeout 270 "${bench[@]}" --fused-rotary-attention \
    --json "$out/c1-off-paths.json" > "$out/c1-off-paths.log" 2>&1)
  step c1-off-paths $?
  grep -hE "^\||ouro /|gate:" "$out/c1-default.log" "$out/c1-off-paths.log"
  ;;
3)
  base=/tmp/rlt-base
  rm -rf "$base" && mkdir -p "$base" && tar -xzf .bench/base-748a734.tgz -C "$base" \
    && ln -s "$root/rlt_engine/checkpoints" "$base/rlt_engine/checkpoints" || { echo "no base tree"; exit 1; }
  c32 early 250 "$root"
  c32 base 250 "$base" 748a734
  ;;
4)
  gpu_tests 450
  ;;
*) echo "unknown part $part (first, 1-4)" >&2; exit 2 ;;
esac
exit 0
