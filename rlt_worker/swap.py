"""Swap preemption on the worker: a slot's state and K/V pages held in host memory.

The engine names a host copy by the request key (its opaque handle). Export copies the
slot's per-slot state and every page of its block table (all planes) to the host and frees
the slot; import opens a new slot (new generation), restores the state, and — once the plan's
block appends gave the slot new blocks — writes the pages back into them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from protocol.messages import SamplingOptions, SlotKeys

if TYPE_CHECKING:
    from rlt_worker.model_runner import ModelRunner

_SLOT_TENSORS = ("state", "embedded", "tokens", "prev_logp")  # the sampling options travel as the admit's


@dataclass
class HostCopy:
    """One exported slot: its per-slot rows and its pages, [layers, 2, planes, blocks, …]."""

    rows: dict[str, torch.Tensor]
    pages: torch.Tensor
    options: SamplingOptions


class SwapStore:
    """Host copies of exported slots, keyed by request key."""

    def __init__(self) -> None:
        self._copies: dict[int, HostCopy] = {}

    def __len__(self) -> int:
        return len(self._copies)

    def export(self, runner: ModelRunner, exports: SlotKeys) -> None:
        """Copy each slot's state and pages to host memory, then free the slot."""
        pin = runner.device.type == "cuda"
        for key, generation in zip(exports.col("keys").tolist(), exports.col("generations").tolist(), strict=True):
            runner.fault_point("export")
            if key in self._copies:
                raise KeyError(f"request key {key} already has a host copy")
            slot = runner.slot_of(key, generation)
            blocks = torch.as_tensor(runner.slot_blocks(slot), dtype=torch.long, device=runner.device)
            rows = {
                name: getattr(runner, name)[slot].to("cpu", copy=True)
                for name in _SLOT_TENSORS if getattr(runner, name) is not None
            }
            pages = runner.storage.pool[:, :, blocks].to("cpu", copy=True)
            options = runner.slot_options[slot]
            self._copies[key] = HostCopy(rows, pages.pin_memory() if pin else pages, options)
            runner.close_slot(key, generation)
            runner.applied.exports += 1

    def open_imports(self, runner: ModelRunner, imports: SlotKeys) -> list[tuple[int, int]]:
        """Open a slot for each (key, new generation) and restore its state; returns (key, slot)."""
        opened = []
        for key, generation in zip(imports.col("keys").tolist(), imports.col("generations").tolist(), strict=True):
            runner.fault_point("import")
            if key not in self._copies:
                raise KeyError(f"no host copy for request key {key}")
            slot = runner.open_slot(key, generation)
            runner.applied.imports += 1
            for name, row in self._copies[key].rows.items():
                getattr(runner, name)[slot] = row.to(runner.device)
            runner.set_options(slot, self._copies[key].options)
            opened.append((key, slot))
        return opened

    def restore_pages(self, runner: ModelRunner, opened: list[tuple[int, int]]) -> None:
        """Write each imported slot's pages into the blocks its block appends gave it."""
        for key, slot in opened:
            copy = self._copies.pop(key)
            num_pages = copy.pages.shape[3]  # later appends of this plan may already have grown the table
            blocks = torch.as_tensor(runner.slot_blocks(slot)[:, :num_pages], dtype=torch.long, device=runner.device)
            if blocks.shape[1] != num_pages:
                raise ValueError(f"import of key {key}: {blocks.shape[1]} blocks per plane for {num_pages} pages")
            runner.storage.pool[:, :, blocks] = copy.pages.to(runner.device, non_blocking=True)

    def drop(self, runner: ModelRunner, drops: SlotKeys) -> None:
        """Forget host copies (their requests were aborted while swapped out); a missing one is no error."""
        for key in drops.col("keys").tolist():
            runner.fault_point("swap_drop")
            self._copies.pop(key, None)
            runner.applied.swap_drops += 1
