"""Native looped models (Ouro, Huginn), their configs, the strict loader and the toy models."""

from .base import AttentionContext, LayerId, LoopedModel, ModelInfo
from .loader import CheckpointError, load_model, model_info, save_checkpoint

__all__ = [
    "AttentionContext",
    "CheckpointError",
    "LayerId",
    "LoopedModel",
    "ModelInfo",
    "load_model",
    "model_info",
    "save_checkpoint",
]
