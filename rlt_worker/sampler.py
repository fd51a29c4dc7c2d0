"""Row-wise token sampling shared by the batched runner and the dense reference (SPEC §5).

Each row's result depends only on its own logits and parameters, never on the other rows,
so a request samples the same token whatever batch it is in. All arithmetic is float64 and
the noise is counter-based Philox, so CPU and CUDA agree.

Rules a caller must know:
- temperature <= 0 is greedy: argmax of the raw logits, lowest token id on ties, no noise.
- top_k <= 0 (e.g. -1) is off. Otherwise exactly the k highest scaled logits stay; on exact
  ties at the boundary the lower token ids stay.
- top_p >= 1 is off. Otherwise, over the top-k survivors renormalised, the smallest prefix in
  descending order (equal logits ordered by lower token id) whose cumulative probability is
  >= top_p stays; the first token always stays.
- The reported logprob is log_softmax of the raw logits (before temperature, top-k, top-p) at
  the sampled token, in float64.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from rlt_worker.philox import PURPOSE_SAMPLE, seed_to_int64, uniform


@dataclass
class SamplingTensors:
    """Per-row sampling parameters; every field is a 1-D tensor of length N."""

    temperature: Tensor  # float64; 0 = greedy
    top_k: Tensor  # int64; <= 0 = off
    top_p: Tensor  # float64; 1.0 = off
    seeds: Tensor  # int64 holding the uint64 seed's bits
    indices: Tensor  # int64; output index i, the Philox index of the draw

    @classmethod
    def build(
        cls,
        temperature: Sequence[float],
        top_k: Sequence[int],
        top_p: Sequence[float],
        seeds: Sequence[int],
        indices: Sequence[int],
        device: torch.device | str = "cpu",
    ) -> SamplingTensors:
        """Build from Python lists; seeds are uint64 values in [0, 2^64)."""
        return cls(
            temperature=torch.tensor(temperature, dtype=torch.float64, device=device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            top_p=torch.tensor(top_p, dtype=torch.float64, device=device),
            seeds=torch.tensor([seed_to_int64(s) for s in seeds], dtype=torch.int64, device=device),
            indices=torch.tensor(indices, dtype=torch.int64, device=device),
        )


def _allowed_mask(scaled: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Boolean [N, V] of tokens that survive top-k then top-p."""
    n, v = scaled.shape
    # One stable descending sort serves both filters: equal logits keep ascending token id.
    sorted_vals, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    rank = torch.arange(v, device=scaled.device).expand(n, v)
    k = torch.where(top_k > 0, top_k.clamp(max=v), v)[:, None]
    keep = rank < k
    probs = torch.softmax(sorted_vals.masked_fill(~keep, float("-inf")), dim=-1)
    # Exclusive prefix sum: a token stays while the mass strictly before it is below top_p,
    # which keeps the smallest prefix reaching top_p and always the first token.
    before = torch.cumsum(probs, dim=-1) - probs
    keep &= (before < top_p[:, None]) | (top_p[:, None] >= 1.0) | (rank == 0)
    return torch.zeros_like(keep).scatter(1, order, keep)


GreedyRule = Callable[[Tensor], tuple[Tensor, Tensor]]  # logits [N, V] -> (argmax int64, its logprob float64)


def torch_greedy(logits: Tensor) -> tuple[Tensor, Tensor]:
    """The greedy rule in torch: argmax of the logits (lowest id on ties) and log_softmax there, float64."""
    x = logits.double()
    tokens = torch.argmax(x, dim=-1)
    return tokens, _logprob_at(x, tokens)


def _logprob_at(x: Tensor, tokens: Tensor) -> Tensor:
    """log_softmax of float64 logits x [N, V] at each row's token [N]."""
    return torch.log_softmax(x, dim=-1).gather(1, tokens[:, None]).squeeze(1)


# (seeds int64 [N], purpose, Philox indices int64 [N], E) -> float64 [N, E] uniforms: philox.uniform's bits.
NoiseRule = Callable[[Tensor, int, Tensor, int], Tensor]


class SamplingKernels(NamedTuple):
    """How `sample` computes its two heavy parts; every choice gives the torch rules' tokens."""

    greedy: GreedyRule = torch_greedy  # an all-greedy batch's tokens and logprobs
    noise: NoiseRule = uniform  # the Gumbel noise's uniforms


TORCH_KERNELS = SamplingKernels()


class SamplingKind(enum.Enum):
    """Which of `sample`'s paths a batch takes; each gives every row what the general path gives it."""

    GREEDY = "greedy"  # every row's temperature <= 0: the greedy rule, no noise
    GUMBEL = "gumbel"  # no sampled row filters (top_k <= 0, top_p >= 1): the noise over the whole vocabulary
    FILTERED = "filtered"  # the general path: top-k / top-p masks from one sort of each row

    @classmethod
    def of(cls, greedy: Sequence[bool] | np.ndarray, filtered: Sequence[bool] | np.ndarray) -> SamplingKind:
        """The kind of a batch whose rows are greedy (temperature <= 0) or filter (top-k or top-p on)."""
        greedy, filtered = np.asarray(greedy, dtype=bool), np.asarray(filtered, dtype=bool)
        if greedy.shape != filtered.shape:
            raise ValueError(f"one filter flag a row: {filtered.shape} for {greedy.shape}")
        if greedy.all():
            return cls.GREEDY
        return cls.FILTERED if (filtered & ~greedy).any() else cls.GUMBEL


def sample(
    logits: Tensor, params: SamplingTensors, kind: SamplingKind | None = None, forced: Tensor | None = None,
    kernels: SamplingKernels = TORCH_KERNELS,
) -> tuple[Tensor, Tensor]:
    """Sample one token per row of logits [N, V]; returns (tokens int64 [N], logprobs float64 [N]).

    `kind`: the batch's SamplingKind, when the caller knows it on the host (the runner does); None
    reads it from `params`, a device→host sync on CUDA. A kind only skips work that would change no
    row: GUMBEL's mask would allow every token, GREEDY's rows take the argmax.
    `forced` (int64 [N], −1 = sample): rows whose token is given (teacher forcing); the logprob
    is that token's. `kernels`: how an all-greedy batch without forced tokens and the noise are
    computed (the runner's choice: the torch rules, or on CUDA the Triton ones).
    """
    if kind is None:
        kind = SamplingKind.of((params.temperature <= 0).tolist(),
                               ((params.top_k > 0) | (params.top_p < 1.0)).tolist())
    if kind is SamplingKind.GREEDY and forced is None:
        return kernels.greedy(logits)
    x = logits.double()
    dev = x.device
    temperature = params.temperature.to(dev, torch.float64)
    greedy_rows = temperature <= 0
    tokens = torch.argmax(x, dim=-1)
    if kind is not SamplingKind.GREEDY:
        scaled = x / torch.where(greedy_rows, 1.0, temperature)[:, None]
        # Gumbel-max: argmax(scaled + g), g = -log(-log u), samples softmax(scaled) over allowed.
        u = kernels.noise(params.seeds.to(dev), PURPOSE_SAMPLE, params.indices.to(dev), x.shape[1])
        noisy = scaled - torch.log(-torch.log(u))
        if kind is SamplingKind.FILTERED:
            allowed = _allowed_mask(scaled, params.top_k.to(dev), params.top_p.to(dev, torch.float64))
            noisy = noisy.masked_fill(~allowed, float("-inf"))
        tokens = torch.where(greedy_rows, tokens, torch.argmax(noisy, dim=-1))
    if forced is not None:
        forced = forced.to(dev)
        tokens = torch.where(forced >= 0, forced, tokens)
    return tokens, _logprob_at(x, tokens)
