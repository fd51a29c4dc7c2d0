"""Collects a plan's result rows and packs them into one columnar StepResult."""

from __future__ import annotations

import math

import numpy as np
import torch

from protocol.columns import F64, I32, I64, pack
from protocol.messages import Stage, StepResult


class ResultBuilder:
    """Rows in plan order; device values are read back once, when the result is built."""

    def __init__(self, step_id: int) -> None:
        self.step_id = step_id
        self._parts: list[dict[str, object]] = []

    def add(
        self,
        stage: Stage,
        keys: np.ndarray,
        generations: np.ndarray,
        *,
        depths: np.ndarray | None = None,
        exit_states: torch.Tensor | None = None,
        tokens: np.ndarray | torch.Tensor | None = None,
        logprobs: torch.Tensor | None = None,
    ) -> None:
        """Append one batch's rows (absent fields: depth 0, NaN exit state, token −1, NaN logprob)."""
        self._parts.append(
            {"stage": stage, "keys": keys, "generations": generations, "depths": depths,
             "exit_states": exit_states, "tokens": tokens, "logprobs": logprobs}
        )

    def build(self, num_free_slots: int) -> StepResult:
        """The packed StepResult of every row added so far."""
        columns: dict[str, list[np.ndarray]] = {name: [] for name in ("k", "g", "s", "d", "x", "t", "lp")}
        for part in self._parts:
            n = len(part["keys"])
            columns["k"].append(part["keys"])
            columns["g"].append(part["generations"])
            columns["s"].append(np.full(n, int(part["stage"])))
            columns["d"].append(_host(part["depths"], n, 0))
            columns["x"].append(_host(part["exit_states"], n, math.nan))
            columns["t"].append(_host(part["tokens"], n, -1))
            columns["lp"].append(_host(part["logprobs"], n, math.nan))

        def joined(name: str, dtype: str) -> bytes:
            return pack(np.concatenate(columns[name]) if columns[name] else [], dtype)

        return StepResult(
            step_id=self.step_id,
            keys=joined("k", I64), generations=joined("g", I64), stages=joined("s", I32),
            depths=joined("d", I32), exit_states=joined("x", F64), tokens=joined("t", I32),
            logprobs=joined("lp", F64), num_free_slots=num_free_slots,
        )


def _host(values: np.ndarray | torch.Tensor | None, n: int, fill: float) -> np.ndarray:
    if values is None:
        return np.full(n, fill)
    if isinstance(values, torch.Tensor):
        return values.detach().cpu().numpy()
    return np.asarray(values)
