"""Built-in tiny models `toy-ouro` and `toy-huginn`: byte vocabulary, seeded random weights.

Weights are drawn on the CPU in float64 from a generator seeded per tensor name, then cast,
so every process (and every dtype) starts from the same numbers.
"""

from __future__ import annotations

import copy
import math
import zlib
from typing import Any

import torch

BOS, EOS, PAD = 256, 257, 258
TOY_VOCAB = 264  # bytes 0..255, specials 256..258, rows 259..263 unused
TOY_SEED = 20240229
GATE_GAIN, WTE_GAIN, ADAPTER_STATE_GAIN = 1.2, 2.5, 0.5

TOY_OURO_CONFIG: dict[str, Any] = {
    "model_type": "ouro",
    "architectures": ["OuroForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": TOY_VOCAB,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "total_ut_steps": 4,
    "early_exit_threshold": 1.0,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "sliding_window": None,
    "layer_types": ["full_attention", "full_attention"],
    "bos_token_id": BOS,
    "eos_token_id": EOS,
    "pad_token_id": PAD,
    "torch_dtype": "float32",
}

TOY_HUGINN_CONFIG: dict[str, Any] = {
    "model_type": "huginn_raven",
    "architectures": ["RavenForCausalLM"],
    "n_embd": 64,
    "n_heads": 4,
    "num_key_value_heads": 4,
    "n_layers_in_prelude": 1,
    "n_layers_in_recurrent_block": 2,
    "n_layers_in_coda": 1,
    "intermediate_size": 128,
    "vocab_size": TOY_VOCAB,
    "padded_vocab_size": TOY_VOCAB,
    "block_size": 512,
    "rope_base": 50000.0,
    "norm_eps": 1e-6,
    "qk_bias": True,
    "bias": False,
    "tie_embeddings": True,
    "mean_recurrence": 6,
    "injection_type": "linear",
    "state_init": "like-init",
    "init_values": {"embed_scale": math.sqrt(64), "std": math.sqrt(2 / (5 * 64))},
    "bos_token_id": BOS,
    "eos_token_id": [EOS],
    "pad_token_id": PAD,
    "torch_dtype": "float32",
}

TOY_MODELS: dict[str, dict[str, Any]] = {"toy-ouro": TOY_OURO_CONFIG, "toy-huginn": TOY_HUGINN_CONFIG}


def _gen(name: str) -> torch.Generator:
    # Seed per tensor name so adding or reordering tensors never changes the others.
    return torch.Generator(device="cpu").manual_seed(TOY_SEED + zlib.crc32(name.encode()))


def _normal(name: str, shape: tuple[int, ...], std: float, mean: float = 0.0) -> torch.Tensor:
    return mean + std * torch.randn(shape, generator=_gen(name), dtype=torch.float64)


def _linear(name: str, out_dim: int, in_dim: int, gain: float = 1.0) -> torch.Tensor:
    return _normal(name, (out_dim, in_dim), gain / math.sqrt(in_dim))


def _norm(name: str, dim: int) -> torch.Tensor:
    return _normal(name, (dim,), 0.1, mean=1.0)


def _ouro_weights(cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    sd = {"model.embed_tokens.weight": _normal("model.embed_tokens.weight", (v, h), 1.0)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for proj, (o, n) in {"q": (nq * hd, h), "k": (nkv * hd, h), "v": (nkv * hd, h), "o": (h, nq * hd)}.items():
            sd[f"{p}self_attn.{proj}_proj.weight"] = _linear(f"{p}self_attn.{proj}_proj.weight", o, n)
        for proj, (o, n) in {"gate": (inter, h), "up": (inter, h), "down": (h, inter)}.items():
            sd[f"{p}mlp.{proj}_proj.weight"] = _linear(f"{p}mlp.{proj}_proj.weight", o, n)
        for norm in ("input_layernorm", "input_layernorm_2", "post_attention_layernorm", "post_attention_layernorm_2"):
            sd[f"{p}{norm}.weight"] = _norm(f"{p}{norm}.weight", h)
    sd["model.norm.weight"] = _norm("model.norm.weight", h)
    # The gate reads a normed state (|h| ≈ √H): a small weight keeps λ = sigmoid(w·h + b) mostly in 0.1..0.9.
    sd["model.early_exit_gate.weight"] = _linear("model.early_exit_gate.weight", 1, h, gain=GATE_GAIN)
    sd["model.early_exit_gate.bias"] = torch.tensor([-0.3], dtype=torch.float64)
    # A gain > 1 on the head gives peaked next-token distributions with clear top-2 gaps.
    sd["lm_head.weight"] = _linear("lm_head.weight", v, h, gain=3.0)
    return sd


def _huginn_block(sd: dict[str, torch.Tensor], p: str, cfg: dict[str, Any]) -> None:
    h, inter, heads = cfg["n_embd"], cfg["intermediate_size"], cfg["n_heads"]
    sd[f"{p}attn.Wqkv.weight"] = _linear(f"{p}attn.Wqkv.weight", 3 * h, h)
    sd[f"{p}attn.qk_bias"] = _normal(f"{p}attn.qk_bias", (2, 1, heads, h // heads), 0.1)
    sd[f"{p}attn.proj.weight"] = _linear(f"{p}attn.proj.weight", h, h)
    sd[f"{p}mlp.fc.weight"] = _linear(f"{p}mlp.fc.weight", 2 * inter, h)
    sd[f"{p}mlp.proj.weight"] = _linear(f"{p}mlp.proj.weight", h, inter)
    for k in range(1, 5):
        sd[f"{p}norm_{k}.weight"] = _norm(f"{p}norm_{k}.weight", h)


def _huginn_weights(cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    h, v = cfg["n_embd"], cfg["padded_vocab_size"]
    # The tied head reads wte: rows of norm > 1 give peaked next-token distributions.
    sd = {"transformer.wte.weight": _normal("transformer.wte.weight", (v, h), WTE_GAIN / math.sqrt(h))}
    n_pre = cfg["n_layers_in_prelude"]
    for i in range(n_pre):
        _huginn_block(sd, f"transformer.prelude.{i}.", cfg)
    for j in range(cfg["n_layers_in_recurrent_block"]):
        _huginn_block(sd, f"transformer.core_block.{j}.", cfg)
    for j in range(cfg["n_layers_in_coda"]):
        _huginn_block(sd, f"transformer.coda.{j}.", cfg)
    # A smaller gain on the state half makes the recurrence settle over the loops, so the
    # latent-change and KL exit signals shrink with depth as they do in the real model.
    adapter = _linear("transformer.adapter.weight", h, 2 * h)
    adapter[:, :h] *= ADAPTER_STATE_GAIN
    sd["transformer.adapter.weight"] = adapter
    sd["transformer.ln_f.weight"] = _norm("transformer.ln_f.weight", h)
    return sd  # tied embeddings: no lm_head.weight


def toy_checkpoint(name: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json dict, float64 CPU state dict with the original weight names) of a toy model."""
    if name not in TOY_MODELS:
        raise ValueError(f"unknown toy model {name!r} (expected one of {sorted(TOY_MODELS)})")
    cfg = copy.deepcopy(TOY_MODELS[name])
    weights = _ouro_weights(cfg) if cfg["model_type"] == "ouro" else _huginn_weights(cfg)
    return cfg, weights
