"""What every benchmark shares for reporting: progress lines on stderr and an optional pyplot."""

from __future__ import annotations

import gc
import sys
from types import ModuleType


def log(message: str) -> None:
    """A progress line on stderr (stdout keeps the tables)."""
    print(message, file=sys.stderr, flush=True)


def free_device(device: str) -> None:
    """Return a closed engine's cached device memory, so the next engine sizes its KV pool from all of it."""
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def pyplot() -> ModuleType | None:
    """matplotlib.pyplot on the file-only Agg backend, or None (logged) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no plot (pip install 'rlt[bench]')")
        return None
    return plt
