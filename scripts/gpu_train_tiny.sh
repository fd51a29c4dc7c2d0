#!/usr/bin/env bash
# Train tiny-ouro-py on one H200 in one device call: a probe that sizes the run, then two runs of the
# same seeded command side by side (the reproducibility check). From the repository root, with the
# data directory of `scripts/train_tiny.py prepare` carried (.train), after the GPU set-up line:
#
#     bash .gpu/setup.sh && export PYTHONPATH=/tmp/site:$PWD && bash scripts/gpu_train_tiny.sh
#
# Sizing: steps = min(⌊(train_s − first_s) / step_s⌋, ⌊EPOCHS_MAX · train_tokens / (batch · context)⌋):
# step_s is the probe's median step time with two probes running at once (as the runs will), first_s
# its first step (an uncached torch.compile: the runs compile from the cache, so this is an upper
# bound), train_s = DEADLINE_S − (seconds spent so far) − RESERVE_S (Python start-up, the final
# evaluation and greedy check, saving). Each run gets --max-seconds train_s + 10 (counted from its
# first step), so it stops and saves its checkpoint if it is slower than the probe said.
# Environment: DEADLINE_S (520: seconds from this script's start by which both runs have ended),
# RESERVE_S (45), EPOCHS_MAX (10: the first H200 run, on the stdlib alone, was best on held-out text
# near 12 epochs and overfit after), SEED (0), STEPS (set: skip the probe), PROBE_STEPS (40),
# DATA (.train/tiny-ouro-py), EXTRA (more train_tiny.py flags for every run, e.g. "--dropout 0").
#
# Back under $OUT (at most 8 files of 16 MiB): log.txt (everything printed), run-a.training.json,
# run-b.training.json, summary.json, run-a.tar.part-aa, run-a.tar.part-ab (run a's checkpoint:
# `cat run-a.tar.part-* | tar -x -C DIR` gives DIR/run-a/{config.json,model.safetensors,tokenizer.json,training.json}).
set -uo pipefail
export PYTHONUNBUFFERED=1
start=$(date +%s)
OUT=${OUT:-/tmp/out}
DATA=${DATA:-.train/tiny-ouro-py}
DEADLINE_S=${DEADLINE_S:-520}
RESERVE_S=${RESERVE_S:-45}
EPOCHS_MAX=${EPOCHS_MAX:-10}
SEED=${SEED:-0}
PROBE_STEPS=${PROBE_STEPS:-40}
EXTRA=${EXTRA:-}
DEVICE=${DEVICE:-cuda}  # cpu: a smoke test of this script with small EXTRA flags
work=/tmp/tiny-train
mkdir -p "$OUT" "$work"
exec > >(tee -a "$OUT/log.txt") 2>&1
elapsed() { echo $(( $(date +%s) - start )); }

nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv
python3 -c "import torch, numpy, safetensors; print('torch', torch.__version__, 'numpy', numpy.__version__, 'cuda', torch.cuda.is_available())"
[ -f "$DATA/prepared.json" ] || { echo "no $DATA/prepared.json: carry the prepared data directory"; exit 1; }

train() {  # train NAME STEPS [flags…]: one run in the background, its log in $work/NAME.log
    local name=$1 steps=$2; shift 2
    # shellcheck disable=SC2086
    python3 scripts/train_tiny.py train --data "$DATA" --out "$work/$name" --device "$DEVICE" --seed "$SEED" \
        --steps "$steps" $EXTRA "$@" > "$work/$name.log" 2>&1 &
    pids+=($!)
}
wait_runs() {  # the runs started since the last call (a bare `wait` would also wait for the log's tee)
    wait "${pids[@]}"
    pids=()
}
pids=()

if [ -z "${STEPS:-}" ]; then
    echo "=== probe: two runs of $PROBE_STEPS steps at once ($(elapsed) s)"
    train probe-a "$PROBE_STEPS" --log-every 5 --eval-every 0 --eval-windows 4 --greedy-tokens 0
    train probe-b "$PROBE_STEPS" --log-every 5 --eval-every 0 --eval-windows 4 --greedy-tokens 0
    wait_runs
    tail -n 4 "$work/probe-a.log" "$work/probe-b.log"
    sizing=$(python3 - "$work" "$DATA" "$DEADLINE_S" "$RESERVE_S" "$EPOCHS_MAX" "$(elapsed)" <<'PY'
import json, math, sys
work, data, deadline, reserve, epochs_max, elapsed = sys.argv[1], sys.argv[2], *map(float, sys.argv[3:])
probes = [json.load(open(f"{work}/{n}/training.json")) for n in ("probe-a", "probe-b")]
step_s = max(p["timing"]["step_s"] for p in probes)
first_s = max(p["timing"]["first_step_s"] for p in probes)
cfg = probes[0]["train_config"]
train_tokens = json.load(open(f"{data}/prepared.json"))["train_tokens"]
train_s = deadline - elapsed - reserve
by_time = math.floor((train_s - first_s) / step_s)
by_epochs = math.floor(epochs_max * train_tokens / (cfg["batch"] * cfg["context"]))
steps = min(by_time, by_epochs)
print(f"step_s {step_s:.4f} (probes: {[p['timing']['step_s'] for p in probes]}, first step "
      f"{[p['timing']['first_step_s'] for p in probes]} s incl. compile {[p['compile'] for p in probes]}); "
      f"train_s {train_s:.0f}; steps by time ({train_s:.0f} - {first_s:.0f}) / {step_s:.4f} = {by_time}, by {epochs_max:g} epochs {by_epochs} -> {steps} "
      f"({steps * cfg['batch'] * cfg['context'] / 1e6:.1f} M tokens, "
      f"{steps * cfg['batch'] * cfg['context'] / train_tokens:.1f} epochs)", file=sys.stderr)
print(steps, math.ceil(train_s + 10))
PY
    ) || { echo "probe failed"; tail -n 40 "$work"/probe-*.log; exit 1; }
    read -r STEPS MAX_S <<< "$sizing"
else
    MAX_S=$(( DEADLINE_S - $(elapsed) - RESERVE_S + 10 ))
fi

echo "=== runs a and b: --steps $STEPS --max-seconds $MAX_S --seed $SEED $EXTRA ($(elapsed) s)"
train run-a "$STEPS" --max-seconds "$MAX_S"
train run-b "$STEPS" --max-seconds "$MAX_S"
wait_runs
echo "=== runs done ($(elapsed) s)"
cat "$work/run-a.log"
echo "=== run b (last lines)"
tail -n 12 "$work/run-b.log"

python3 - "$work" "$OUT" <<'PY'
import json, sys
work, out = sys.argv[1:]
runs = {}
for name in ("run-a", "run-b"):
    try:
        runs[name] = json.load(open(f"{work}/{name}/training.json"))
    except OSError as exc:
        print(f"{name}: no training.json ({exc})")
summary = {}
for name, r in runs.items():
    e = r["held_out_eval"]
    summary[name] = {"bpb_per_loop": e["bpb_per_loop"], "bpb_expected": e["bpb_expected"],
                     "mean_exit_loops": e["mean_exit_loops"], "steps_run": r["steps_run"],
                     "stopped_early": r["stopped_early"], "timing": r["timing"], "compile": r["compile"],
                     "greedy_valid": r["greedy"]["valid"], "sha256": r["model_safetensors_sha256"]}
if len(runs) == 2:
    a, b = (runs[n]["held_out_eval"]["bpb_per_loop"][-1] for n in ("run-a", "run-b"))
    summary["full_depth_relative_difference"] = round(abs(a - b) / a, 5)
    print(f"reproducibility: loop-4 held-out bpb {a} vs {b}: {100 * abs(a - b) / a:.3f}% apart "
          f"({'within' if abs(a - b) <= 0.01 * a else 'NOT within'} 1%)")
print(json.dumps(summary, indent=1))
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
PY
for name in run-a run-b; do
    [ -f "$work/$name/training.json" ] && cp "$work/$name/training.json" "$OUT/$name.training.json"
done
if [ -f "$work/run-a/model.safetensors" ]; then
    tar -cf - -C "$work" run-a | split -b 15M - "$OUT/run-a.tar.part-"
fi
ls -la "$OUT"
echo "=== done ($(elapsed) s)"
