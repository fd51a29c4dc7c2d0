"""Model configs parsed from a Hugging Face `config.json` (SPEC §9). Pure Python: no torch import."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# Huginn's tokenizer: generation stops on <|begin_text|>, <|end_text|> and <|end_turn|> (SPEC §9).
HUGINN_DEFAULT_EOS: tuple[int, ...] = (65504, 65505, 65508)


def _require(cfg: Mapping[str, Any], key: str, family: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ValueError(f"{family} config.json: missing required key {key!r}")
    return cfg[key]


def _eos_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


@dataclass(frozen=True)
class OuroConfig:
    """Ouro (`model_type: "ouro"`) hyper-parameters."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    total_ut_steps: int = 4
    early_exit_threshold: float = 1.0
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    model_type = "ouro"

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> OuroConfig:
        """Parse an Ouro config.json dict; reject features rlt does not implement."""
        fam = "Ouro"
        hidden = int(_require(cfg, "hidden_size", fam))
        heads = int(_require(cfg, "num_attention_heads", fam))
        layers = int(_require(cfg, "num_hidden_layers", fam))
        kv_heads = cfg.get("num_key_value_heads")
        kv_heads = heads if kv_heads is None else int(kv_heads)
        head_dim = cfg.get("head_dim")
        head_dim = hidden // heads if head_dim is None else int(head_dim)
        if heads % kv_heads:
            raise ValueError(
                f"Ouro config.json: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
            )
        _check_ouro_attention(cfg, layers)
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"Ouro config.json: hidden_act {act!r} is not supported (only 'silu')")
        return cls(
            hidden_size=hidden,
            intermediate_size=int(_require(cfg, "intermediate_size", fam)),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=int(_require(cfg, "vocab_size", fam)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            total_ut_steps=int(cfg.get("total_ut_steps", 4)),
            early_exit_threshold=float(cfg.get("early_exit_threshold", 1.0)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_ids=_eos_tuple(cfg.get("eos_token_id")),
            bos_token_id=cfg.get("bos_token_id"),
            pad_token_id=cfg.get("pad_token_id"),
            raw=dict(cfg),
        )


def _check_ouro_attention(cfg: Mapping[str, Any], layers: int) -> None:
    """Only full causal attention is implemented: name the first layer that would need more."""
    rope_scaling = cfg.get("rope_scaling")
    if rope_scaling:
        kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
        if kind not in (None, "default"):
            raise ValueError(f"Ouro config.json: rope_scaling type {kind!r} is not supported")
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        # The official config derives them: a window applies only when use_sliding_window is set,
        # and then to the layers from max_window_layers on.
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
        first_swa = int(cfg.get("max_window_layers", 28))
        layer_types = [
            "sliding_attention" if window is not None and i >= first_swa else "full_attention" for i in range(layers)
        ]
    if len(layer_types) != layers:
        raise ValueError(f"Ouro config.json: layer_types has {len(layer_types)} entries for {layers} layers")
    for i, kind in enumerate(layer_types):
        if kind != "full_attention":
            raise ValueError(
                f"Ouro config.json: layer {i} has attention type {kind!r} "
                f"(sliding_window={cfg.get('sliding_window')!r}); only 'full_attention' is supported"
            )


@dataclass(frozen=True)
class HuginnConfig:
    """Huginn-0125 (`model_type: "huginn_raven"`) hyper-parameters."""

    n_embd: int
    n_heads: int
    n_layers_in_prelude: int
    n_layers_in_recurrent_block: int
    n_layers_in_coda: int
    intermediate_size: int
    padded_vocab_size: int
    vocab_size: int
    block_size: int
    rope_base: float = 50000.0
    norm_eps: float = 1e-6
    qk_bias: bool = True
    tie_embeddings: bool = True
    mean_recurrence: int = 32
    state_init: str = "like-init"
    embed_scale: float = 1.0
    init_std: float = 0.0
    eos_token_ids: tuple[int, ...] = HUGINN_DEFAULT_EOS
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    model_type = "huginn_raven"

    @property
    def head_dim(self) -> int:
        """Per-head width: n_embd / n_heads."""
        return self.n_embd // self.n_heads

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> HuginnConfig:
        """Parse a Huginn config.json dict; reject features rlt does not implement."""
        fam = "Huginn"
        n_embd = int(_require(cfg, "n_embd", fam))
        heads = int(_require(cfg, "n_heads", fam))
        if n_embd % heads:
            raise ValueError(f"Huginn config.json: n_embd {n_embd} is not a multiple of n_heads {heads}")
        kv_heads = cfg.get("num_key_value_heads")
        if kv_heads is not None and int(kv_heads) != heads:
            # The official attention views Wqkv as 3 × n_kv_heads, so it only works with MHA.
            raise ValueError(f"Huginn config.json: num_key_value_heads {kv_heads} != n_heads {heads}")
        injection = cfg.get("injection_type", "linear")
        if injection != "linear":
            raise ValueError(f"Huginn config.json: injection_type {injection!r} is not supported (only 'linear')")
        if cfg.get("bias", False):
            raise ValueError("Huginn config.json: bias=true (linear biases) is not supported")
        init_values = cfg.get("init_values") or {}
        vocab = int(_require(cfg, "vocab_size", fam))
        padded = int(cfg.get("padded_vocab_size") or vocab)
        return cls(
            n_embd=n_embd,
            n_heads=heads,
            n_layers_in_prelude=int(_require(cfg, "n_layers_in_prelude", fam)),
            n_layers_in_recurrent_block=int(_require(cfg, "n_layers_in_recurrent_block", fam)),
            n_layers_in_coda=int(_require(cfg, "n_layers_in_coda", fam)),
            intermediate_size=int(_require(cfg, "intermediate_size", fam)),
            padded_vocab_size=padded,
            vocab_size=vocab,
            block_size=int(_require(cfg, "block_size", fam)),
            rope_base=float(cfg.get("rope_base", 50000.0)),
            norm_eps=float(cfg.get("norm_eps", 1e-6)),
            qk_bias=bool(cfg.get("qk_bias", True)),
            tie_embeddings=bool(cfg.get("tie_embeddings", True)),
            mean_recurrence=int(cfg.get("mean_recurrence", 32)),
            state_init=str(cfg.get("state_init", "like-init")),
            embed_scale=float(init_values.get("embed_scale", math.sqrt(n_embd))),
            init_std=float(init_values.get("std", math.sqrt(2 / (5 * n_embd)))),
            eos_token_ids=_huginn_eos(cfg.get("eos_token_id"), padded),
            bos_token_id=cfg.get("bos_token_id"),
            pad_token_id=cfg.get("pad_token_id"),
            raw=dict(cfg),
        )


def _huginn_eos(value: Any, vocab_rows: int) -> tuple[int, ...]:
    """A list is taken as the full stop set; an int (the release has 65505) joins the tokenizer's defaults."""
    if isinstance(value, list | tuple):
        return _eos_tuple(value)
    ids = set(HUGINN_DEFAULT_EOS) | set(_eos_tuple(value))
    return tuple(sorted(i for i in ids if 0 <= i < vocab_rows))


ModelConfig = OuroConfig | HuginnConfig

_FAMILIES: dict[str, type[OuroConfig] | type[HuginnConfig]] = {
    "ouro": OuroConfig,
    "huginn_raven": HuginnConfig,
}


def load_config(path_or_dict: str | os.PathLike[str] | Mapping[str, Any]) -> ModelConfig:
    """Parse a config.json (a path to the file or its directory, or the dict) by its `model_type`."""
    if isinstance(path_or_dict, Mapping):
        cfg, where = path_or_dict, "config dict"
    else:
        path = os.fspath(path_or_dict)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path, encoding="utf-8") as f:
            cfg, where = json.load(f), path
    model_type = cfg.get("model_type")
    if model_type is None:
        raise ValueError(f"{where}: no 'model_type' (expected one of {sorted(_FAMILIES)})")
    if model_type not in _FAMILIES:
        raise ValueError(f"{where}: unknown model_type {model_type!r} (expected one of {sorted(_FAMILIES)})")
    return _FAMILIES[model_type].from_dict(cfg)
