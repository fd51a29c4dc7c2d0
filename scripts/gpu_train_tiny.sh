#!/usr/bin/env bash
# Train tiny-ouro-py on one H200 in one device call: a probe that sizes the runs, then every
# configuration twice side by side with the same seed (the reproducibility check). From the
# repository root, with the data directory of `scripts/train_tiny.py prepare` carried (.train),
# after the GPU set-up line:
#
#     bash .gpu/setup.sh && export PYTHONPATH=/tmp/site:$PWD && bash scripts/gpu_train_tiny.sh
#     … && CONFIGS="--exit-floor 1;--exit-floor 0.5" bash scripts/gpu_train_tiny.sh   # two configurations, four runs
#
# Sizing: steps = min(⌊(train_s − RUN_FIRST_S) / step_s⌋, ⌊EPOCHS_MAX · train_tokens / (batch · context)⌋):
# step_s is the slowest probe's median step time with as many probes running at once as there will
# be runs, RUN_FIRST_S an allowance for the runs' first step (they compile from the probes' cache:
# 4.8–6.6 s on the H200 in runs 2 and 3, where the probes' uncached compile took 51–62 s), train_s = DEADLINE_S − (seconds spent so far) − RESERVE_S (Python
# start-up, the gate stage if any, the final evaluation and greedy check, saving). Each run gets
# --max-seconds train_s + 10 (counted from its first step), so it stops and saves its checkpoint if
# it is slower than the probe said.
# Environment: CONFIGS (";"-separated train_tiny.py flag sets, at most 2; default: one, the script's
# defaults), DEADLINE_S (520: seconds from this script's start by which the runs have ended),
# RESERVE_S (50), RUN_FIRST_S (15), STEP_MARGIN (1.0: the runs' step time over the probes'. Measured
# 1.12 in run 4 (0.0773-0.0778 s against 0.0694: --max-seconds cut the pair at 5,294 and 5,242 of
# 5,634 steps, still 0.13% apart) and 0.99 in run 5 (0.0771-0.0782 against 0.0788, where 1.15 left
# 76 s of the deadline unused); a run cut short only misses the cosine's tail, near its floor), EPOCHS_MAX (15: the first H200 run, on the stdlib alone, was best on
# held-out text near 12 epochs and overfit after; run 3, on the 5x larger corpus, still improved at 7.2), SEED (0), STEPS (set: skip the probe), PROBE_STEPS (40),
# DATA (.train/tiny-ouro-py), EXTRA (flags for every run), DEVICE (cuda; cpu for a smoke test with
# small EXTRA flags).
#
# Back under $OUT (at most 8 files of 16 MiB): log.txt (everything printed), summary.json, c0a.training.json,
# c0b.training.json (c1a, c1b with a second configuration), best.tar.part-aa, best.tar.part-ab: the
# checkpoint of the run whose held-out bits per byte falls from loop 1 to loop 4 and is lowest at loop 4
# (the lowest at loop 4 if none falls), as `cat best.tar.part-* | tar -x -C DIR` → DIR/<run>/….
set -uo pipefail
export PYTHONUNBUFFERED=1
start=$(date +%s)
OUT=${OUT:-/tmp/out}
DATA=${DATA:-.train/tiny-ouro-py}
DEADLINE_S=${DEADLINE_S:-520}
RESERVE_S=${RESERVE_S:-50}
EPOCHS_MAX=${EPOCHS_MAX:-15}
RUN_FIRST_S=${RUN_FIRST_S:-15}
STEP_MARGIN=${STEP_MARGIN:-1.0}
SEED=${SEED:-0}
PROBE_STEPS=${PROBE_STEPS:-40}
EXTRA=${EXTRA:-}
DEVICE=${DEVICE:-cuda}
IFS=';' read -r -a configs <<< "${CONFIGS:-}"
[ ${#configs[@]} -eq 0 ] && configs=("")
[ ${#configs[@]} -le 2 ] || { echo "at most 2 CONFIGS (the files that come back)"; exit 1; }
work=/tmp/tiny-train
mkdir -p "$OUT" "$work"
exec > >(tee -a "$OUT/log.txt") 2>&1
elapsed() { echo $(( $(date +%s) - start )); }

nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv
python3 -c "import torch, numpy, safetensors; print('torch', torch.__version__, 'numpy', numpy.__version__, 'cuda', torch.cuda.is_available())"
[ -f "$DATA/prepared.json" ] || { echo "no $DATA/prepared.json: carry the prepared data directory"; exit 1; }

pids=()
train() {  # train NAME CONFIG STEPS [flags…]: one run in the background, its log in $work/NAME.log
    local name=$1 config=$2 steps=$3; shift 3
    # shellcheck disable=SC2086
    python3 scripts/train_tiny.py train --data "$DATA" --out "$work/$name" --device "$DEVICE" --seed "$SEED" \
        --steps "$steps" $EXTRA $config "$@" > "$work/$name.log" 2>&1 &
    pids+=($!)
}
wait_runs() {  # the runs started since the last call (a bare `wait` would also wait for the log's tee)
    wait "${pids[@]}"
    pids=()
}
runs=()
for i in "${!configs[@]}"; do runs+=("c${i}a" "c${i}b"); done
echo "configurations: $(for i in "${!configs[@]}"; do printf 'c%s="%s" ' "$i" "${configs[$i]}"; done)"

steps=()
if [ -z "${STEPS:-}" ]; then
    echo "=== probe: ${#runs[@]} runs of $PROBE_STEPS steps at once ($(elapsed) s)"
    for run in "${runs[@]}"; do
        train "probe-$run" "${configs[${run:1:1}]}" "$PROBE_STEPS" --log-every 5 --eval-every 0 --eval-windows 4 \
            --greedy-tokens 0 --gate-steps 0
    done
    wait_runs
    for run in "${runs[@]}"; do tail -n 3 "$work/probe-$run.log"; done
    sizing=$(python3 - "$work" "$DATA" "$DEADLINE_S" "$RESERVE_S" "$EPOCHS_MAX" "$(elapsed)" "$RUN_FIRST_S" "$STEP_MARGIN" "${runs[@]}" <<'PY'
import json, math, sys
work, data = sys.argv[1:3]
deadline, reserve, epochs_max, elapsed, run_first_s, margin = map(float, sys.argv[3:9])
runs = sys.argv[9:]
probes = {r: json.load(open(f"{work}/probe-{r}/training.json")) for r in runs}
step_s = margin * max(p["timing"]["step_s"] for p in probes.values())
first_s = max(p["timing"]["first_step_s"] for p in probes.values())
train_tokens = json.load(open(f"{data}/prepared.json"))["train_tokens"]
train_s = deadline - elapsed - reserve
by_time = math.floor((train_s - run_first_s) / step_s)
print(f"step_s {step_s:.4f} = {margin:g} x the slowest probe (probes {[p['timing']['step_s'] for p in probes.values()]}), probe first step {first_s:.1f} s "
      f"(compile {[p['compile']['used'] for p in probes.values()]}), train_s {train_s:.0f}: steps by time "
      f"({train_s:.0f} - {run_first_s:.0f}) / {step_s:.4f} = {by_time}", file=sys.stderr)
for r in runs[::2]:
    cfg = probes[r]["train_config"]
    per_step = cfg["batch"] * cfg["context"]
    steps = min(by_time, math.floor(epochs_max * train_tokens / per_step))
    print(f"  {r[:2]}: by {epochs_max:g} epochs {math.floor(epochs_max * train_tokens / per_step)} -> {steps} steps "
          f"({steps * per_step / 1e6:.1f} M tokens, {steps * per_step / train_tokens:.1f} epochs)", file=sys.stderr)
    print(steps)
print(math.ceil(train_s + 10))
PY
    ) || { echo "probe failed"; for run in "${runs[@]}"; do tail -n 30 "$work/probe-$run.log"; done; exit 1; }
    mapfile -t sized <<< "$sizing"
    MAX_S=${sized[-1]}
    steps=("${sized[@]:0:${#configs[@]}}")
else
    MAX_S=$(( DEADLINE_S - $(elapsed) - RESERVE_S + 10 ))
    for _ in "${configs[@]}"; do steps+=("$STEPS"); done
fi

echo "=== runs ${runs[*]}: steps ${steps[*]}, --max-seconds $MAX_S, --seed $SEED, EXTRA '$EXTRA' ($(elapsed) s)"
for run in "${runs[@]}"; do
    i=${run:1:1}
    train "$run" "${configs[$i]}" "${steps[$i]}" --max-seconds "$MAX_S"
done
wait_runs
echo "=== runs done ($(elapsed) s)"
for run in "${runs[@]}"; do echo "--- $run"; tail -n 20 "$work/$run.log"; done

best=$(python3 - "$work" "$OUT" "${runs[@]}" <<'PY'
import json, sys
work, out, *names = sys.argv[1:]
runs, summary = {}, {}
for name in names:
    try:
        runs[name] = json.load(open(f"{work}/{name}/training.json"))
    except OSError as exc:
        print(f"{name}: no training.json ({exc})", file=sys.stderr)
for name, r in runs.items():
    e = r["held_out_eval"]
    falls = all(b < a for a, b in zip(e["bpb_per_loop"], e["bpb_per_loop"][1:]))
    summary[name] = {"flags": r["command"], "bpb_per_loop": e["bpb_per_loop"], "deeper_is_better": falls,
                     "bpb_expected": e["bpb_expected"], "mean_exit_loops": e["mean_exit_loops"],
                     "gate_sweep": e["gate_sweep"], "steps_run": r["steps_run"], "epochs": r["epochs"],
                     "stopped_early": r["stopped_early"], "timing": r["timing"], "compile": r["compile"],
                     "greedy_valid": r["greedy"]["valid"], "sha256": r["model_safetensors_sha256"]}
for a in names[::2]:
    b = a[:-1] + "b"
    if a in runs and b in runs:
        x, y = (runs[n]["held_out_eval"]["bpb_per_loop"][-1] for n in (a, b))
        summary[f"{a[:-1]}_loop4_relative_difference"] = round(abs(x - y) / x, 5)
        print(f"reproducibility {a[:-1]}: loop-4 held-out bpb {x} vs {y}: {100 * abs(x - y) / x:.3f}% apart "
              f"({'within' if abs(x - y) <= 0.01 * x else 'NOT within'} 1%)", file=sys.stderr)
if runs:
    pick = min(runs, key=lambda n: (not summary[n]["deeper_is_better"], summary[n]["bpb_per_loop"][-1]))
    summary["checkpoint_returned"] = pick
    print(json.dumps(summary, indent=1), file=sys.stderr)
    json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
    print(pick)
PY
)
for run in "${runs[@]}"; do
    [ -f "$work/$run/training.json" ] && cp "$work/$run/training.json" "$OUT/$run.training.json"
done
if [ -n "$best" ] && [ -f "$work/$best/model.safetensors" ]; then
    echo "=== returning $best's checkpoint"
    tar -cf - -C "$work" "$best" | split -b 15M - "$OUT/best.tar.part-"
fi
ls -la "$OUT"
echo "=== done ($(elapsed) s)"
