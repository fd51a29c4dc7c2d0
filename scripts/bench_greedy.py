"""Greedy sampling's GPU time per call: the sampler's torch rule against the Triton kernel (one H200).

    python scripts/bench_greedy.py [--rows 1,32] [--vocab 49152]

Each rule runs 20 times inside one CUDA graph on bf16 logits; the median of 30 replays, per call.
"""

from __future__ import annotations

import argparse
import functools

import torch
from bench_linear import time_in_graph  # scripts/, this script's folder

from rlt_worker.kernels.greedy import triton_greedy
from rlt_worker.sampler import torch_greedy

CALLS_PER_GRAPH = 20
REPLAYS = 30


def calls(rule, logits: torch.Tensor) -> None:
    for _ in range(CALLS_PER_GRAPH):
        rule(logits)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,32")
    p.add_argument("--vocab", type=int, default=49152)
    args = p.parse_args()
    for rows in (int(r) for r in args.rows.split(",")):
        logits = torch.randn(rows, args.vocab, device="cuda").to(torch.bfloat16)
        torch_us, triton_us = (time_in_graph(functools.partial(calls, rule, logits), CALLS_PER_GRAPH, REPLAYS)
                               for rule in (torch_greedy, triton_greedy))
        print(f"greedy rows {rows}: torch {torch_us:.1f} µs, triton {triton_us:.1f} µs per call "
              f"(graph, median of {REPLAYS} × {CALLS_PER_GRAPH})")


if __name__ == "__main__":
    main()
