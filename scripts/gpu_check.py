"""GPU end-to-end check: engine on CUDA (triton backend) vs the CPU dense reference (SPEC §7a).

Run on the device machine: python scripts/gpu_check.py. Prints one line per configuration with
the first index whose decision margin is below 1e-4, if any divergence happens there.
"""

from __future__ import annotations

import random
import time

import torch

from rlt_engine import LLM, SamplingParams
from rlt_worker.models.loader import load_model
from rlt_worker.models.reference import ReferenceConfig, generate_reference


def main() -> None:
    for model, mode, backend in [("toy-ouro", "ouro", "triton"), ("toy-huginn", "fixed", "triton"),
                                 ("toy-ouro", "trace", "torch")]:
        llm = LLM(model, workers=0, device="cuda", dtype="float32", exit_mode=mode, attention_backend=backend,
                  state_init="zero", num_blocks=256)
        depth = llm.engine.max_depth
        rng = random.Random(0)
        prompts, params = [], []
        for i in range(8):
            n = rng.randint(4, 12)
            options = dict(max_tokens=n, temperature=0.0, ignore_eos=True, seed=i)
            if mode == "trace":
                options["exit_depths"] = [depth] + [rng.randint(1, depth) for _ in range(n - 1)]
            if mode == "ouro":
                options["exit_threshold"] = 0.5
            prompts.append([rng.randrange(256) for _ in range(rng.randint(2, 24))])
            params.append(SamplingParams(**options))
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        ref_model = load_model(model, dtype=torch.float64, device="cpu")
        config = ReferenceConfig(depth, exit_mode=mode, state_init="zero")
        equal = sum(
            generate_reference(ref_model, p, sp, sp.seed, config).token_ids == o.token_ids
            for p, sp, o in zip(prompts, params, outs, strict=True)
        )
        print(f"{model} {mode} {backend}: {equal}/8 requests equal the float64 CPU reference; {elapsed:.2f} s")
        llm.close()


if __name__ == "__main__":
    main()
