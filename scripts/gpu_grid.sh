#!/usr/bin/env bash
# Issue 19's whole grid on the H200 (docs/benchmarks.md), in device calls that each stay under the
# 600 s a call may run, all into one JSON: part 1 writes it, later parts resume it. Carry the file a
# part brought back (e.g. copied to .bench/grid.json, which `carry` names) into the next part:
#
#   bash scripts/gpu_grid.sh 1                     # workers 0: fixed, trace, shallow, ouro, ouro_replay; c = 1, 32
#   bash scripts/gpu_grid.sh 2 .bench/grid.json    # workers 1: fixed, trace, ouro, ouro_replay; c = 1, 32
#   bash scripts/gpu_grid.sh 3 .bench/grid.json    # workers 0: fixed, trace; c = 128
#   bash scripts/gpu_grid.sh 4 .bench/grid.json    # workers 1: fixed, trace, ouro; c = 128
#   bash scripts/gpu_grid.sh 5 .bench/grid.json    # workers 0: ouro, ouro_replay; c = 128 (ouro's replay
#                                                  # needs ouro's depths from the same invocation, so ouro
#                                                  # at c = 128 is measured here, not in part 3)
#   bash scripts/gpu_grid.sh 6 .bench/grid.json    # workers 0: trace and fixed without mixed batches (on by default); c = 32, 128; the plot
#
# c = 128 has a part per worker count: on the H200 at 52845ec a c = 128 configuration's gate took 4-20 s,
# its warm-up (as long as a timed run) 12.2 s for trace and 14.8 s for fixed, and each run 11.5-14.5 s,
# so six configurations of three runs would not fit one part's 540 s.
#
# Arguments after the JSON (`-` for part 1) go to rlt-bench last, so they override: e.g. a CPU smoke
# run, `bash scripts/gpu_grid.sh 1 - --model toy-ouro --device cpu --prompt-len 16 --output-len 4`.
#
# Run from the repository root after the device set-up line (../shared/gpu/README.md); set RLT_COMMIT
# to the tree's commit (the device copy's git HEAD may be stale). Writes $OUT/h200-throughput.json,
# $OUT/grid-PART.log and, in part 6, $OUT/throughput_h200.png.
set -euo pipefail
part=${1:?"usage: gpu_grid.sh PART [JSON|- [RLT-BENCH ARGS...]]  (PART 1-6)"}
from=${2:--}
shift $(( $# < 2 ? $# : 2 ))
out=${OUT:-/tmp}
json=$out/h200-throughput.json
if [ "$part" != 1 ]; then
  [ "$from" != - ] || { echo "parts 2-6 resume the JSON an earlier part wrote" >&2; exit 2; }
  cp "$from" "$json"
fi
bench=(python -m rlt_engine.cli bench throughput --model synthetic-ouro-1.4b --repeats 3 --json "$json"
       --total-seconds 540)
case $part in
  1) args=(--workers 0 --exit fixed,trace,shallow,ouro,ouro_replay --concurrency 1,32 --max-seconds 12) ;;
  2) args=(--workers 1 --exit fixed,trace,ouro,ouro_replay --concurrency 1,32 --max-seconds 12 --resume) ;;
  3) args=(--workers 0 --exit fixed,trace --concurrency 128 --max-seconds 30 --resume) ;;
  4) args=(--workers 1 --exit fixed,trace,ouro --concurrency 128 --max-seconds 30 --resume) ;;
  5) args=(--workers 0 --exit ouro,ouro_replay --concurrency 128 --max-seconds 30 --resume) ;;
  6) args=(--workers 0 --exit trace_separate,fixed_separate --concurrency 32,128 --max-seconds 30 --resume
           --plot "$out/throughput_h200.png") ;;
  *) echo "unknown part $part (1-6)" >&2; exit 2 ;;
esac
"${bench[@]}" "${args[@]}" "$@" 2>&1 | tee "$out/grid-$part.log" | grep -E "^\||/ |floor" || true
