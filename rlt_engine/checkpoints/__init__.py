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


def resolve_model(model: str) -> str:
    """A shipped checkpoint's directory for its name; any other model string unchanged."""
    return str(Path(__file__).parent / model) if model in SHIPPED else model
