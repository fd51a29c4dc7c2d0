"""Mean loops per generated token of a model's Ouro gate at several exit thresholds.

rlt-bench throughput's `--exit ouro` needs a threshold at which the synthetic model's gate gives
about 2.5 loops per generated token (`OURO_THRESHOLD` in rlt_engine/bench/throughput.py): this
script measures that mean for a list of thresholds, on the benchmark's workload (random prompts,
greedy, ignore_eos), and prints one line per threshold with the depth histogram.

    python scripts/calibrate_ouro_threshold.py --thresholds 0.4,0.5,0.6,0.7,0.8
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import time

from rlt_engine import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="synthetic-ouro-1.4b")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--thresholds", default="0.4,0.5,0.6,0.7,0.8")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)  # the benchmark's
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    rows = []
    with LLM(a.model, workers=0, device=a.device, dtype=a.dtype, exit_mode="ouro", max_num_seqs=a.requests) as llm:
        rng = random.Random(a.seed)
        vocab = llm.engine.model_info.vocab_size
        prompts = [[rng.randrange(vocab) for _ in range(a.prompt_len)] for _ in range(a.requests)]
        for threshold in [float(t) for t in a.thresholds.split(",")]:
            t0 = time.perf_counter()
            params = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True,
                                    exit_threshold=threshold)
            outputs = llm.generate(prompts, params, use_tqdm=False)
            depths = [d for o in outputs for d in o.exit_depths[1:]]  # output 0 always runs D loops
            histogram = dict(sorted(collections.Counter(depths).items()))
            row = {"threshold": threshold, "mean_loops": sum(depths) / len(depths), "histogram": histogram,
                   "seconds": time.perf_counter() - t0}
            rows.append(row)
            print(f"threshold {threshold:.2f}: {row['mean_loops']:.3f} loops per generated token, depths "
                  f"{histogram} ({len(depths)} tokens, {row['seconds']:.1f} s)", flush=True)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"model": a.model, "prompt_len": a.prompt_len, "output_len": a.output_len, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
