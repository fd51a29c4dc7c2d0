"""The sampler's GPU time per call: its torch rules against the Triton kernels, and each SamplingKind.

    python scripts/bench_sampling.py [--rows 1,32] [--vocab 49152] [--json FILE]

On bf16 logits (temperature 0.8, no top-k or top-p, so every kind gives the same tokens), each case is
captured once in a CUDA graph and replayed; the median of --replays replays, in µs:

    greedy torch / triton        an all-greedy batch: sampler.torch_greedy, kernels/greedy.py
    noise torch / triton         the Philox uniforms: philox.uniform, kernels/philox_uniform.py
    filtered, torch noise        sample's general path as before the Philox kernel (top-k/top-p sort)
    filtered / gumbel / greedy   sample with the runner's CUDA kernels, per SamplingKind

Before timing, the Triton noise is checked bit for bit against the torch Philox, and the gumbel
kind's tokens against the filtered path's.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
from bench_linear import time_in_graph  # scripts/, this script's folder

from rlt_worker.kernels.greedy import triton_greedy
from rlt_worker.kernels.philox_uniform import triton_uniform
from rlt_worker.philox import PURPOSE_SAMPLE, uniform
from rlt_worker.sampler import SamplingKernels, SamplingKind, SamplingTensors, sample, torch_greedy


def cases(rows: int, vocab: int) -> dict[str, Callable[[], object]]:
    logits = torch.randn(rows, vocab, device="cuda").mul(3).to(torch.bfloat16)
    p = SamplingTensors.build([0.8] * rows, [-1] * rows, [1.0] * rows, list(range(rows)), list(range(rows)),
                              device="cuda")
    cuda = SamplingKernels(triton_greedy, triton_uniform)
    torch_noise = SamplingKernels(triton_greedy, uniform)
    if not torch.equal(triton_uniform(p.seeds, PURPOSE_SAMPLE, p.indices, vocab),
                       uniform(p.seeds, PURPOSE_SAMPLE, p.indices, vocab)):
        raise SystemExit("triton_uniform differs from philox.uniform")
    if not torch.equal(sample(logits, p, SamplingKind.GUMBEL, kernels=cuda)[0],
                       sample(logits, p, SamplingKind.FILTERED, kernels=cuda)[0]):
        raise SystemExit("the gumbel kind's tokens differ from the filtered path's")
    return {
        "greedy torch": lambda: torch_greedy(logits),
        "greedy triton": lambda: triton_greedy(logits),
        "noise torch": lambda: uniform(p.seeds, PURPOSE_SAMPLE, p.indices, vocab),
        "noise triton": lambda: triton_uniform(p.seeds, PURPOSE_SAMPLE, p.indices, vocab),
        "filtered, torch noise": lambda: sample(logits, p, SamplingKind.FILTERED, kernels=torch_noise),
        **{kind.value: lambda k=kind: sample(logits, p, k, kernels=cuda) for kind in SamplingKind},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,32")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_sampling times CUDA graphs: run it on a CUDA GPU")
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        for name, fn in cases(rows, args.vocab).items():
            us = time_in_graph(fn, 1, args.replays)
            results.append({"rows": rows, "case": name, "us": us})
            print(f"rows {rows:3d}  {name:24s} {us:9.1f} µs")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                               "vocab": args.vocab, "results": results}, indent=1))


if __name__ == "__main__":
    main()
