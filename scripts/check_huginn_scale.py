"""The weight scale of `synthetic-huginn-3.5b` on the CPU: does the state stay bounded over D loops,
and do the exit signals converge, and where do positions cross the thresholds?

A dense forward of one random prompt, every position at every loop (at full depth this is what
PREFILL computes, LAST_EXITED: loop d attends to loop d of the context), with the KL signal
(coda + LM head after each loop, against the previous loop's distribution, p_0 uniform, as
ModelRunner._signal computes it) and the relative latent change of every position. Prints the
state's RMS, the signals' p10 / p50 / p90 over positions at a few loops, and for each threshold
the exit depth each position would take (the first loop whose signal is below it; D if none).

    python scripts/check_huginn_scale.py                                  # the real shape, bf16: ~2 min, 7 GB
    python scripts/check_huginn_scale.py --heads 20 --dtype float32      # width 1,920 (heads × 96)
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F

from rlt_worker.models.base import LayerId
from rlt_worker.models.layers import compute_dtype
from rlt_worker.models.synthetic import synthetic_config, synthetic_model_from_config
from rlt_worker.philox import truncated_normal

KL_THRESHOLDS = (1e-4, 1e-3, 3e-3, 1e-2, 3e-2)
LATENT_THRESHOLDS = (0.01, 0.03, 0.05, 0.1)


class CausalContext:
    """Row i is position i of one sequence, all rows at one loop: each attends to the rows before it."""

    def attend(self, layer: LayerId, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        heads_first = (t.transpose(0, 1).to(compute_dtype(q.dtype)) for t in (q, k, v))  # [heads, N, Dh]
        return F.scaled_dot_product_attention(*heads_first, is_causal=True).transpose(0, 1).to(q.dtype)


def config_of_width(heads: int) -> dict:
    """synthetic-huginn-3.5b with `heads` heads of 96 (the intermediate size scaled with the width)."""
    cfg = synthetic_config("synthetic-huginn-3.5b")
    if heads != cfg["n_heads"]:
        width = heads * 96
        cfg.update(n_embd=width, n_heads=heads, num_key_value_heads=heads,
                   intermediate_size=round(width * 17920 / 5280 / 64) * 64,
                   init_values={"embed_scale": math.sqrt(width), "std": math.sqrt(2 / (5 * width))})
    return cfg


@torch.inference_mode()
def signals(heads: int, dtype: torch.dtype, positions: int, loops: int, seed: int) -> tuple[torch.Tensor, ...]:
    """KL [loops, N], latent change [loops, N] and the state's RMS [loops] of one random prompt."""
    model = synthetic_model_from_config(config_of_width(heads), dtype, "cpu")
    vocab, width = model.info.vocab_size, model.info.hidden_size
    ids = torch.randint(0, vocab, (positions,), generator=torch.Generator().manual_seed(seed))
    pos = torch.arange(positions)
    ctx = CausalContext()
    embedded = model.embed(ids, pos, ctx)
    state = model.init_state(embedded, truncated_normal(torch.full((positions,), seed), pos, width))
    prev = torch.full((positions, vocab), -math.log(vocab))
    kl, latent, rms = [], [], []
    for _ in range(loops):
        new = model.loop(state, embedded, pos, ctx)
        assert torch.isfinite(new).all(), "the state overflowed"
        logp = torch.log_softmax(model.lm_head(model.coda(new, pos, ctx)).float(), dim=-1)
        kl.append((prev.exp() * (prev - logp)).sum(-1).double())
        latent.append((new - state).double().norm(dim=-1) / new.double().norm(dim=-1))
        rms.append(new.double().pow(2).mean().sqrt())
        prev, state = logp, new
    return torch.stack(kl), torch.stack(latent), torch.stack(rms)


def exit_depths(signal: torch.Tensor, threshold: float) -> torch.Tensor:
    """Per position, the first loop whose signal is below the threshold (the last loop if none)."""
    below = signal < threshold
    below[-1] = True
    return below.double().argmax(0).double() + 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, default=55, help="width = heads × 96 (55: the real shape)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float64"])
    p.add_argument("--positions", type=int, default=64)
    p.add_argument("--loops", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    t0 = time.perf_counter()
    kl, latent, rms = signals(a.heads, getattr(torch, a.dtype), a.positions, a.loops, a.seed)
    print(f"width {a.heads * 96}, {a.dtype}, {a.positions} positions, {a.loops} loops "
          f"({time.perf_counter() - t0:.0f} s); state RMS {float(rms.min()):.3f} … {float(rms.max()):.3f}")
    quantiles = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
    for d in sorted({1, 2, 4, 8, 12, 16, 24, a.loops} & set(range(1, a.loops + 1))):
        k, lat = (", ".join(f"{float(v):.2e}" for v in x[d - 1].quantile(quantiles)) for x in (kl, latent))
        print(f"  loop {d:2}: KL p10/50/90 {k}   latent change {lat}")
    for name, signal, thresholds in (("kl", kl, KL_THRESHOLDS), ("latent_diff", latent, LATENT_THRESHOLDS)):
        for threshold in thresholds:
            depths = exit_depths(signal, threshold)
            p10, p50, p90 = (int(v) for v in depths.quantile(quantiles))
            print(f"  {name} < {threshold:g}: mean exit {float(depths.mean()):.1f}, p10/50/90 {p10}/{p50}/{p90}")


if __name__ == "__main__":
    main()
