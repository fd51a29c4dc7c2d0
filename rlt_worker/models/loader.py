"""Build a model from a toy name or a Hugging Face-layout directory, strictly; save one back."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Mapping
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .base import LoopedModel, ModelInfo
from .config import HuginnConfig, ModelConfig, OuroConfig, load_config
from .huginn import HuginnModel
from .ouro import OuroModel
from .synthetic import SYNTHETIC_MODELS, synthetic_model
from .toy import TOY_MODELS, toy_checkpoint

SUPPORTED_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
# Present in some Huginn files; rlt recomputes the RoPE table instead of trusting a stored one.
IGNORED_TENSORS = frozenset({"freqs_cis"})


class CheckpointError(ValueError):
    """A checkpoint's tensors do not match the architecture its config.json describes."""


def build_model(config: ModelConfig) -> LoopedModel:
    """An uninitialised model of `config` on the meta device (load weights with `assign=True`)."""
    with torch.device("meta"):
        return OuroModel(config) if isinstance(config, OuroConfig) else HuginnModel(config)


def _expected_shapes(model: LoopedModel) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _tied_head_name(config: ModelConfig) -> str | None:
    tied = config.tie_embeddings if isinstance(config, HuginnConfig) else config.tie_word_embeddings
    return "lm_head.weight" if tied else None


def _check_names_and_shapes(
    expected: Mapping[str, tuple[int, ...]], found: Mapping[str, tuple[int, ...]], optional: set[str]
) -> None:
    """Raise CheckpointError naming the first missing, unexpected or mis-shaped tensor."""
    missing = sorted(set(expected) - set(found))
    if missing:
        raise CheckpointError(
            f"checkpoint is missing tensor {missing[0]!r} (shape {expected[missing[0]]}); {len(missing)} missing in all"
        )
    unexpected = sorted(set(found) - set(expected) - optional - IGNORED_TENSORS)
    if unexpected:
        raise CheckpointError(
            f"checkpoint has unexpected tensor {unexpected[0]!r} (shape {found[unexpected[0]]}); "
            f"{len(unexpected)} unexpected in all"
        )
    for name, shape in expected.items():
        if tuple(found[name]) != shape:
            raise CheckpointError(f"tensor {name!r} has shape {tuple(found[name])}, expected {shape}")


def _check_tied_head(tied: str | None, found: Mapping[str, tuple[int, ...]], embed: tuple[int, ...]) -> None:
    # A tied head may still be stored (it is the embedding); it must at least have its shape.
    if tied is not None and tied in found and tuple(found[tied]) != embed:
        raise CheckpointError(f"tensor {tied!r} has shape {tuple(found[tied])}, expected {embed} (tied embedding)")


def model_from_state_dict(
    config: ModelConfig, state: Mapping[str, torch.Tensor], dtype: torch.dtype, device: str | torch.device
) -> LoopedModel:
    """Build `config`'s model from `state` (original names), checked strictly, cast to dtype on device."""
    model = build_model(config)
    expected = _expected_shapes(model)
    found = {name: tuple(t.shape) for name, t in state.items()}
    tied = _tied_head_name(config)
    _check_names_and_shapes(expected, found, optional={tied} if tied else set())
    embed_name = "transformer.wte.weight" if isinstance(config, HuginnConfig) else "model.embed_tokens.weight"
    _check_tied_head(tied, found, expected[embed_name])
    # Always copy: tensors read from a file can sit at unaligned addresses, and CPU BLAS then takes
    # another reduction path, so a saved-and-reloaded model would differ from the original in the
    # last bit. Fresh allocations are aligned, so every process gets bit-identical results.
    weights = {name: state[name].to(device=device, dtype=dtype, copy=True) for name in expected}
    model.load_state_dict(weights, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {dtype} (expected one of {[str(d) for d in SUPPORTED_DTYPES]})")


def _read_safetensors(directory: str) -> dict[str, torch.Tensor]:
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                if name in tensors:
                    raise CheckpointError(f"tensor {name!r} appears in more than one file ({path})")
                tensors[name] = f.get_tensor(name)
    return tensors


def load_model(model: str, dtype: torch.dtype, device: str | torch.device) -> LoopedModel:
    """Load "toy-ouro", "toy-huginn", a synthetic model ("synthetic-ouro-1.4b", "synthetic-huginn-3.5b":
    real shapes, random weights made on `device`) or an HF-layout directory (config.json + *.safetensors)."""
    _check_dtype(dtype)
    if model in TOY_MODELS:
        cfg_dict, state = toy_checkpoint(model)
        return model_from_state_dict(load_config(cfg_dict), state, dtype, device)
    if model in SYNTHETIC_MODELS:
        return synthetic_model(model, dtype, device)
    if not os.path.isdir(model):
        builtins = ", ".join([*TOY_MODELS, *SYNTHETIC_MODELS])
        raise ValueError(f"model {model!r} is neither a built-in ({builtins}) nor a directory")
    config_path = os.path.join(model, "config.json")
    if not os.path.isfile(config_path):
        raise CheckpointError(f"{model}: no config.json")
    config = load_config(config_path)
    return model_from_state_dict(config, _read_safetensors(model), dtype, device)


def save_checkpoint(
    model: LoopedModel, directory: str | os.PathLike[str], config: dict[str, Any] | None = None
) -> None:
    """Write config.json (default: the one the model was built from) and model.safetensors."""
    if config is None:
        config = model.config.raw
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    state = {name: t.detach().to("cpu").contiguous() for name, t in model.state_dict().items()}
    save_file(state, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})


def model_info(model: LoopedModel) -> ModelInfo:
    """The model's static facts."""
    return model.info
