"""Mean loops per generated token of an adaptive exit policy at several exit thresholds.

rlt-bench throughput's adaptive workloads need thresholds at which the synthetic models exit at a
known mean depth: `--exit ouro` (Ouro's gate; `OURO_THRESHOLD`, about 2.5 of 4 loops) and `kl` /
`latent_diff` (Huginn's signals; `KL_THRESHOLD`, `LATENT_THRESHOLD`), all in
rlt_engine/bench/throughput.py. This script measures that mean for a list of thresholds on the
benchmark's workload (random prompts of the model family's benchmark length, greedy, ignore_eos)
and prints one line per threshold with the depth histogram.

    python scripts/calibrate_threshold.py --thresholds 0.4,0.5,0.6,0.7,0.8            # Ouro's gate
    python scripts/calibrate_threshold.py --model synthetic-huginn-3.5b --exit kl --json kl.json
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import time

from rlt_engine import LLM, SamplingParams
from rlt_engine.bench.throughput import FAMILY_DEFAULTS, model_config_dict

# The thresholds tried by default, by exit mode.
THRESHOLDS = {
    "ouro": "0.4,0.5,0.6,0.7,0.8",
    "ouro_delayed": "0.4,0.5,0.6,0.7,0.8",
    "kl": "0.003,0.005,0.01,0.02,0.03,0.05",
    "latent_diff": "0.03,0.04,0.05,0.07,0.1",
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="synthetic-ouro-1.4b")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--exit", default=None, choices=sorted(THRESHOLDS), help="default: ouro for Ouro, kl for Huginn")
    p.add_argument("--thresholds", default=None, help="comma-separated (default: THRESHOLDS[exit])")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=None, help="default: the benchmark's for the model family")
    p.add_argument("--output-len", type=int, default=128)  # the benchmark's
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    family = (model_config_dict(a.model) or {}).get("model_type", "ouro")
    exit_mode = a.exit or ("kl" if family == "huginn_raven" else "ouro")
    prompt_len = a.prompt_len or FAMILY_DEFAULTS.get(family, FAMILY_DEFAULTS["ouro"])["prompt_len"]
    rows = []
    with LLM(a.model, workers=0, device=a.device, dtype=a.dtype, exit_mode=exit_mode, max_num_seqs=a.requests) as llm:
        rng = random.Random(a.seed)
        vocab = llm.engine.model_info.vocab_size
        prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(a.requests)]
        for threshold in [float(t) for t in (a.thresholds or THRESHOLDS[exit_mode]).split(",")]:
            t0 = time.perf_counter()
            params = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True,
                                    exit_threshold=threshold)
            outputs = llm.generate(prompts, params, use_tqdm=False)
            depths = [d for o in outputs for d in o.exit_depths[1:]]  # output 0 always runs D loops
            histogram = dict(sorted(collections.Counter(depths).items()))
            row = {"threshold": threshold, "mean_loops": sum(depths) / len(depths), "histogram": histogram,
                   "seconds": time.perf_counter() - t0}
            rows.append(row)
            print(f"{exit_mode} threshold {threshold:g}: {row['mean_loops']:.3f} loops per generated token, depths "
                  f"{histogram} ({len(depths)} tokens, {row['seconds']:.1f} s)", flush=True)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"model": a.model, "exit_mode": exit_mode, "prompt_len": prompt_len,
                       "output_len": a.output_len, "requests": a.requests, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
