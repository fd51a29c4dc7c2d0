"""Random-weight models of real shapes, for benchmarks and GPU tests: `synthetic-ouro-1.4b`, `-2.6b`.

The shapes are Ouro's (SPEC §9); the weights are seeded random numbers drawn directly on the
target device in the target dtype (no host copy, no checkpoint), a second or less for 1.4B
parameters on a GPU. The scale keeps every activation finite in bf16:

    embeddings N(0, 1); projections N(0, 1/fan_in); norm weights 1 + N(0, 0.1²);
    the LM head N(0, (3/√H)²), so next-token distributions have clear top-2 gaps.

With Ouro's sandwich norms every sub-layer adds a normed vector to the residual stream, and
`model.norm` closes each loop, so nothing grows with depth or loops. The numbers are not a
language model: they exercise the same kernels, shapes and bytes as the real checkpoint.
"""

from __future__ import annotations

import copy
import math
import zlib
from typing import Any

import torch

from .base import LoopedModel
from .config import OuroConfig
from .ouro import OuroModel

SYNTHETIC_SEED = 20250101
HEAD_GAIN = 3.0

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

SYNTHETIC_MODELS: dict[str, dict[str, Any]] = {
    "synthetic-ouro-1.4b": _OURO_1_4B,
    "synthetic-ouro-2.6b": {**_OURO_1_4B, "num_hidden_layers": 48},
}


def synthetic_config(name: str) -> dict[str, Any]:
    """The config.json dict of a synthetic model."""
    if name not in SYNTHETIC_MODELS:
        raise ValueError(f"unknown synthetic model {name!r} (expected one of {sorted(SYNTHETIC_MODELS)})")
    return copy.deepcopy(SYNTHETIC_MODELS[name])


def _weight(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One tensor, drawn from a generator seeded by its name (adding tensors never changes others)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(SYNTHETIC_SEED + zlib.crc32(name.encode()))
    w = torch.randn(shape, generator=generator, dtype=dtype, device=device)
    if "norm" in name.split(".")[-2]:  # the four layer norms and model.norm
        return w.mul_(0.1).add_(1.0)
    if name == "model.embed_tokens.weight":
        return w
    if name == "model.early_exit_gate.bias":
        return w.mul_(0.1).sub_(0.3)
    gain = HEAD_GAIN if name == "lm_head.weight" else 1.0
    return w.mul_(gain / math.sqrt(shape[-1]))


def synthetic_model_from_config(
    config: dict[str, Any], dtype: torch.dtype, device: str | torch.device
) -> LoopedModel:
    """An Ouro model of `config`'s shapes with seeded random weights made on `device` in `dtype`."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    cfg = OuroConfig.from_dict(config)
    with torch.device("meta"):
        model = OuroModel(cfg)
    weights = {
        name: _weight(name, tuple(t.shape), dtype, device) for name, t in model.state_dict().items()
    }
    model.load_state_dict(weights, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def synthetic_model(name: str, dtype: torch.dtype, device: str | torch.device) -> LoopedModel:
    """`load_model`'s path for a synthetic name."""
    return synthetic_model_from_config(synthetic_config(name), dtype, device)
