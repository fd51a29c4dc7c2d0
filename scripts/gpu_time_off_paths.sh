#!/usr/bin/env bash
# The decode paths left to time on the H200, and the new defaults there. Run from the repository root
# after the device set-up line (../shared/gpu/README.md), with RLT_COMMIT set to the tree's commit:
#
#   bash scripts/gpu_time_off_paths.sh first [BUDGET]   # a session's first call: as much as BUDGET s
#                                                       # (default 560) holds, most needed first
#   bash scripts/gpu_time_off_paths.sh 1                # the attention sweep, sampling, the pass variants
#   bash scripts/gpu_time_off_paths.sh 2                # c = 1 throughput of the default tree
#   bash scripts/gpu_time_off_paths.sh 3                # the GPU tests of the paths
#
# Parts 1-3 each stay under a call's 600 s. What the steps write under $OUT:
# - tests: the GPU tests of the paths changed since their last GPU run: the attention (more splits at
#   few rows: triton_backend._auto_splits), the gated head strip (on by default), PDL, the Philox noise
#   kernel and greedy sampling, device refill against the host loop. tests.log.
# - pass: one loop pass and device refill's CODA (scripts/profile_decode_pass.py, rows 1 and 32, PDL
#   on): the default path, `fused-rotary-attention` (a decode batch's RoPE, K/V write and attention in
#   one launch; off, slower on an H100) and `fused-cublas-head` (the LM head on cuBLAS, as before the
#   gated strip); float32 and bf16 parity against the default; CODA per sampling kind. pass.json, pass.log.
# - variants, each in a copy of the tree with triton_backend edited: `nodot8`, Ouro's MHA attention
#   (one q head a kv head) without tl.dot (scores and the weighted sum by tl.sum on CUDA cores, no
#   padding of the one q row to 16) at 8 warps (at 4 it spills 328 B), rows 1 and 32; `store-first`,
#   the rotary attention's writer storing before its loop (ROTARY_STORE_FIRST), one row.
#   pass-NAME.json and .log.
# - attn: the decode attention alone (scripts/bench_decode_attention.py, 24 layers' caches in one graph,
#   context 1,088 in a 2,048-token table, as a 1,024-token prompt's decode is graphed): the heuristics'
#   splits against plain and PDL launches × 4 warps × 4, 8, 16, 32 splits × 32- and 64-token tiles at
#   rows 1, 2, 8 and 32. attn.json, attn.log.
# - sampling: scripts/bench_sampling.py, the sampler's rules and kinds at 1 and 32 rows. sampling.json, .log.
# - c1: c = 1 fixed, trace, ouro and ouro_replay (median of 3, the float32 gate) of this tree.
#   c1.json, c1.log.
# Each step has its own timeout; a step that runs out leaves the others' files.
set -uo pipefail
part=${1:?"usage: gpu_time_off_paths.sh PART (first [BUDGET], 1: attention sweep and pass variants, 2: c = 1, 3: GPU tests)"}
out=${OUT:-/tmp}
root=$PWD
t0=$(date +%s)
budget=${2:-560}
step() { echo "$1 rc=$2 $(( $(date +%s) - t0 ))s"; }
left() { echo $(( budget - ($(date +%s) - t0) )); }
copy_tree() { rm -rf "$1" && mkdir -p "$1" && cp -r protocol rlt_engine rlt_worker scripts pyproject.toml "$1"/; }

gpu_tests() {  # SECONDS
  timeout "$1" python -m pytest -m gpu -q -p no:cacheprovider tests/test_triton_attention.py tests/test_strip_gemv.py \
    tests/test_pdl.py tests/test_gpu_exit_graphs.py tests/test_philox_kernel.py tests/test_greedy_kernel.py \
    tests/test_sampler.py tests/test_gpu_fused.py > "$out/tests.log" 2>&1
  step tests $?
  grep -E "^FAILED|^ERROR| passed| failed" "$out/tests.log" | cut -c1-200 | tail -20
}

pass_profile() {  # SECONDS
  timeout "$1" python scripts/profile_decode_pass.py --rows 1,32 --pdl on --rotary-attention --cublas-head --top 8 \
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
  timeout "$1" python scripts/bench_decode_attention.py --rows 1,2,8,32 --context 1088 --table-tokens 2048 \
    --launch plain,pdl --warps 4 --splits 4,8,16,32 --tiles 32,64 --json "$out/attn.json" > "$out/attn.log" 2>&1
  step attn $?
  grep -A3 "^rows" "$out/attn.log" | cut -c1-160
}

NODOT8=('s/^    use_dot = not f64 and head_dim >= 16$/    use_dot = not f64 and head_dim >= 16 and group > 1/'
        's/^        tile = 64 if use_dot else 16$/        tile = 64 if use_dot or not f64 else 16/'
        's/^ATTENTION_WARPS = 4$/ATTENTION_WARPS = 8/')

c1() {  # SECONDS: c = 1 fixed, trace, ouro and ouro_replay of this tree, gated
  timeout "$1" python -m rlt_engine.cli bench throughput --model synthetic-ouro-1.4b --workers 0 --concurrency 1 \
    --repeats 3 --max-seconds 12 --exit fixed,trace,ouro,ouro_replay --total-seconds $(( $1 - 10 )) \
    --json "$out/c1.json" > "$out/c1.log" 2>&1
  step c1 $?
  grep -hE "^\||ouro /|gate:" "$out/c1.log"
}

case $part in
first)
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.total --format=csv,noheader
  gpu_tests $(( $(left) > 205 ? 200 : $(left) - 5 ))  # a small budget cuts the tests, not the call
  [ "$(left)" -gt 160 ] && pass_profile 150
  [ "$(left)" -gt 100 ] && c1 $(( $(left) - 5 ))
  ;;
1)
  attention_sweep 150
  timeout 60 python scripts/bench_sampling.py --json "$out/sampling.json" > "$out/sampling.log" 2>&1
  step sampling $?
  variant store-first 80 1 's/^ROTARY_STORE_FIRST = False$/ROTARY_STORE_FIRST = True/'
  variant nodot8 80 1,32 "${NODOT8[@]}"
  ;;
2)
  c1 400
  ;;
3)
  gpu_tests 450
  ;;
*) echo "unknown part $part (first, 1-3)" >&2; exit 2 ;;
esac
exit 0
