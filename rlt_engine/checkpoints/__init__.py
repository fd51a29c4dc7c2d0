"""Checkpoints shipped inside the package, in Hugging Face layout, found by name.

`tiny-ouro-py` (the default model) is an Ouro-architecture looped model trained by
`scripts/train_tiny.py` on the Python standard library; `training.json` beside its weights
records how. The engine turns the name into the directory before any worker sees it, so a
worker loads it like any other checkpoint directory.
"""

from __future__ import annotations

from pathlib import Path

SHIPPED = ("tiny-ouro-py",)
DEFAULT_MODEL = "tiny-ouro-py"
# Every model name a worker knows (rlt_worker.models.loader: toy and synthetic models; a test checks they agree).
BUILT_IN = (*SHIPPED, "toy-ouro", "toy-huginn", "synthetic-ouro-1.4b", "synthetic-ouro-2.6b", "synthetic-huginn-3.5b")


def resolve_model(model: str) -> str:
    """A shipped checkpoint's directory for its name; another built-in name or a checkpoint
    directory unchanged; anything else a ValueError naming every built-in model."""
    if model in SHIPPED:
        return str(Path(__file__).parent / model)
    if model in BUILT_IN:
        return model
    if not Path(model).is_dir():
        raise ValueError(f"model {model!r} is neither a built-in model ({', '.join(BUILT_IN)}) "
                         "nor a checkpoint directory")
    if not (Path(model) / "config.json").is_file():
        raise ValueError(f"model directory {model!r} has no config.json (a Hugging Face checkpoint has one)")
    return model
