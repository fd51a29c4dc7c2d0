"""Random-weight models of real shapes, for benchmarks and GPU tests: `synthetic-ouro-1.4b`, `-2.6b`
and `synthetic-huginn-3.5b`.

The shapes are Ouro's and Huginn-0125's (SPEC §9); the weights are seeded random numbers drawn
directly on the target device in the target dtype (no host copy, no checkpoint), a second or less
for a billion parameters on a GPU. The numbers are not a language model: they exercise the same
kernels, shapes and bytes as the real checkpoints.

Ouro. The scale keeps every activation finite in bf16:

    embeddings N(0, 1); projections N(0, 1/fan_in); norm weights 1 + N(0, 0.1²);
    the LM head N(0, (3/√H)²), so next-token distributions have clear top-2 gaps.

With Ouro's sandwich norms every sub-layer adds a normed vector to the residual stream, and
`model.norm` closes each loop, so nothing grows with depth or loops.

Huginn. Projections N(0, 1/fan_in), norm weights 1 + N(0, 0.1²), `qk_bias` N(0, 0.1²); the tied
embedding N(0, (WTE_GAIN/√H)²), so the logits ⟨wte, ln_f(…)⟩ have a spread of about WTE_GAIN = 3
nats (clear top-2 gaps over 65,536 rows); the adapter's columns that read the state are scaled by
ADAPTER_STATE_GAIN = 0.5 (those that read the prelude output are not).

- Bounded by construction: every block ends in `norm_4`, so the state after each loop has an RMS
  of about 1 (the norm weight's) whatever the loop count; inside a block every sub-layer reads a
  normed input. Measured (scripts/check_huginn_scale.py: one random prompt of 64 positions, all at
  every loop, dense; the real shape in bf16 on the CPU): the state's RMS stays in 1.006–1.008 over
  32 loops, no non-finite value.
- The exit signals need a recurrence that settles, and the state gain decides whether it does. In
  float32 at width 480 gain 0.6 converged (KL p50 1.6e-4 nats at loop 32), 0.7 barely (0.045) and
  0.8–1.0 not at all (0.6–3.8 nats at loop 32); at width 960 gain 0.6 was already slow (0.018).
  Gain 0.5 converged at every width tried, KL p50 at loop 16 4e-4, 7.6e-3, 4.5e-3 and 1.3e-3 nats
  at widths 480, 960, 1,920 and 5,280 (float32; 5,280 with 32 positions): a margin below the
  edge, which moves with the width.
- bf16 puts a floor under both signals: rounding alone moves the state by 2.2–2.9% per loop (KL
  0.003–0.008 nats) at widths 480, 1,920 and 5,280 alike, where float32 goes on converging (KL
  1e-7–1e-5 by loop 32). Thresholds must sit above that floor. At the bench's KL_THRESHOLD 0.01
  the real shape in bf16 exits after 15.1 loops on average (p10–p90 14–16; float32 at width
  1,920: 15.0, 14–16), at LATENT_THRESHOLD 0.05 after 13.8 (13–14; float32: 14.0, 13–15).
- The spread across the positions of one prompt is narrow (the ±1–2 loops above). Through the
  engine (decode, width 192, a 512-row vocabulary, float64), four requests' generated positions exited after 7–13 loops
  at 0.01. What decode gives on the GPU, in bf16 at the real shape, is what
  scripts/calibrate_threshold.py measures (docs/benchmarks.md).
"""

from __future__ import annotations

import copy
import math
import zlib
from typing import Any

import torch

from .base import LoopedModel
from .config import HuginnConfig, load_config
from .huginn import HuginnModel
from .ouro import OuroModel

SYNTHETIC_SEED = 20250101
HEAD_GAIN = 3.0
# Huginn (see the module docstring): the tied embedding's gain, and the adapter's gain on the state half.
WTE_GAIN = 3.0
ADAPTER_STATE_GAIN = 0.5

_OURO_1_4B: dict[str, Any] = {
    "model_type": "ouro",
    "architectures": ["OuroForCausalLM"],
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "head_dim": 128,
    "vocab_size": 49152,
    # Synthetic: 4,096 positions cover every benchmark here and keep the slot tables small.
    "max_position_embeddings": 4096,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "total_ut_steps": 4,
    "early_exit_threshold": 1.0,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "sliding_window": None,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "torch_dtype": "bfloat16",
}


_HUGINN_3_5B: dict[str, Any] = {
    "model_type": "huginn_raven",
    "architectures": ["RavenForCausalLM"],
    "n_embd": 5280,
    "n_heads": 55,
    "num_key_value_heads": 55,
    "n_layers_in_prelude": 2,
    "n_layers_in_recurrent_block": 4,
    "n_layers_in_coda": 2,
    "intermediate_size": 17920,
    "vocab_size": 65536,
    "padded_vocab_size": 65536,
    "block_size": 4096,
    "rope_base": 50000.0,
    "norm_eps": 1e-6,
    "qk_bias": True,
    "bias": False,
    "tie_embeddings": True,
    "mean_recurrence": 32,
    "injection_type": "linear",
    "state_init": "like-init",
    "init_values": {"embed_scale": math.sqrt(5280), "std": math.sqrt(2 / (5 * 5280))},
    "bos_token_id": 65504,
    "eos_token_id": 65505,
    "pad_token_id": 65509,
    "torch_dtype": "bfloat16",
}

SYNTHETIC_MODELS: dict[str, dict[str, Any]] = {
    "synthetic-ouro-1.4b": _OURO_1_4B,
    "synthetic-ouro-2.6b": {**_OURO_1_4B, "num_hidden_layers": 48},
    "synthetic-huginn-3.5b": _HUGINN_3_5B,
}


def synthetic_config(name: str) -> dict[str, Any]:
    """The config.json dict of a synthetic model."""
    if name not in SYNTHETIC_MODELS:
        raise ValueError(f"unknown synthetic model {name!r} (expected one of {sorted(SYNTHETIC_MODELS)})")
    return copy.deepcopy(SYNTHETIC_MODELS[name])


def _normal(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """N(0, 1) draws from a generator seeded by the tensor's name (adding tensors never changes others)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(SYNTHETIC_SEED + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=generator, dtype=dtype, device=device)


def _ouro_weight(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One Ouro tensor at the scale of the module docstring."""
    w = _normal(name, shape, dtype, device)
    if "norm" in name.split(".")[-2]:  # the four layer norms and model.norm
        return w.mul_(0.1).add_(1.0)
    if name == "model.embed_tokens.weight":
        return w
    if name == "model.early_exit_gate.bias":
        return w.mul_(0.1).sub_(0.3)
    gain = HEAD_GAIN if name == "lm_head.weight" else 1.0
    return w.mul_(gain / math.sqrt(shape[-1]))


def _huginn_weight(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One Huginn tensor at the scale of the module docstring."""
    w = _normal(name, shape, dtype, device)
    leaf = name.split(".")[-2] if name.endswith(".weight") else name.split(".")[-1]
    if leaf.startswith("norm_") or leaf == "ln_f":
        return w.mul_(0.1).add_(1.0)
    if leaf == "qk_bias":
        return w.mul_(0.1)
    if leaf == "wte":
        return w.mul_(WTE_GAIN / math.sqrt(shape[-1]))
    w.mul_(1.0 / math.sqrt(shape[-1]))
    if leaf == "adapter":  # columns 0 … H−1 read the state, H … 2H−1 the prelude output
        w[:, : shape[0]].mul_(ADAPTER_STATE_GAIN)
    return w


def synthetic_model_from_config(
    config: dict[str, Any], dtype: torch.dtype, device: str | torch.device
) -> LoopedModel:
    """A model of `config`'s family and shapes with seeded random weights made on `device` in `dtype`."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    cfg = load_config(config)
    huginn = isinstance(cfg, HuginnConfig)
    with torch.device("meta"):
        model = HuginnModel(cfg) if huginn else OuroModel(cfg)
    weight = _huginn_weight if huginn else _ouro_weight
    weights = {name: weight(name, tuple(t.shape), dtype, device) for name, t in model.state_dict().items()}
    model.load_state_dict(weights, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def synthetic_model(name: str, dtype: torch.dtype, device: str | torch.device) -> LoopedModel:
    """`load_model`'s path for a synthetic name."""
    return synthetic_model_from_config(synthetic_config(name), dtype, device)
