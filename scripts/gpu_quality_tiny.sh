#!/usr/bin/env bash
# The engine's checks of a trained tiny-ouro-py on the GPU machine, in one device call: the greedy
# check (`rlt-bench greedy`) and the held-out quality table (`rlt-bench quality` on the prepared
# held-out ids, so the corpus is the one the model was trained beside, not the GPU machine's own
# standard library). The engine needs `tokenizers`: the image's, or the wheel carried in
# .train/wheels. From the repository root, with the checkpoint in rlt_engine/checkpoints/tiny-ouro-py
# (or MODEL=DIR) and .train carried:
#
#     bash .gpu/setup.sh && export PYTHONPATH=/tmp/site:$PWD && bash scripts/gpu_quality_tiny.sh
#
# Environment: MODEL (tiny-ouro-py), DATA (.train/tiny-ouro-py), DEVICE (cuda), DTYPE (bfloat16 on
# cuda), QUALITY_FLAGS (more rlt-bench quality flags). Back under $OUT: log.txt, greedy.txt,
# quality.json, quality.png.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
MODEL=${MODEL:-tiny-ouro-py}
DATA=${DATA:-.train/tiny-ouro-py}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-}
QUALITY_FLAGS=${QUALITY_FLAGS:-}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
start=$(date +%s)

if ! python3 -c "import tokenizers" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .train/wheels/*.whl \
        || { echo "no tokenizers and no wheel in .train/wheels"; exit 1; }
fi
python3 -c "import tokenizers, torch; print('tokenizers', tokenizers.__version__, 'torch', torch.__version__)"
dtype_flag=()
[ -n "$DTYPE" ] && dtype_flag=(--dtype "$DTYPE")

echo "=== rlt-bench greedy ($(( $(date +%s) - start )) s)"
python3 -m rlt_engine.cli bench greedy --model "$MODEL" --device "$DEVICE" "${dtype_flag[@]}" | tee "$OUT/greedy.txt"
echo "=== rlt-bench quality ($(( $(date +%s) - start )) s)"
# shellcheck disable=SC2086
python3 -m rlt_engine.cli bench quality --model "$MODEL" --device "$DEVICE" "${dtype_flag[@]}" --data "$DATA" \
    --json "$OUT/quality.json" --plot "$OUT/quality.png" $QUALITY_FLAGS
echo "=== done ($(( $(date +%s) - start )) s)"
