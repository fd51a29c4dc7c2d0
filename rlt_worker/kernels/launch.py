"""How the Triton kernels are launched: compiled or interpreted, and with programmatic dependent launch.

Programmatic dependent launch (PDL, sm_90+): a kernel launched with Triton's `launch_pdl` may start
while its predecessor in the stream drains (once every program of the predecessor has called
gdc_launch_dependents or exited). Such a kernel runs its prologue (index math, loads of weights,
which no kernel writes), then `gdc_wait()`, which returns once the predecessor has finished and its
writes are visible; every load of anything else and every store come after it. The store rule
matters as much as the load rule: the caching allocator may hand this kernel's output the memory of
a tensor the predecessor is still reading. A kernel calls gdc_launch_dependents right after its
wait, so a PDL successor may start its own prologue meanwhile. A kernel launched without the
attribute (a cuBLAS GEMM) still waits for the whole predecessor, and a wait in a kernel launched
without it returns at once, so the kernels are correct in any order of PDL and plain launches.

    plain:  |== A ==|·drain·launch·|== B ==|
    PDL:    |== A ==|·drain·|
                  |B prologue|wait|== B ==|

A launch may bound PDL by rows (`pdl_max_rows`): kernels of passes with more rows launch plainly.
PDL pays where a pass has no cuBLAS kernel, whose launch has no PDL edge: on the H200 a 1-row pass
of strip GEMVs took 1.121 ms with PDL and 1.335 without, while an 8-row pass (cuBLAS GEMMs) was 5%
slower with it (docs/benchmarks.md). So FusedOuroModel bounds it by the rows its Triton GEMVs take.

The gdc calls sit under a `PDL` constexpr: Triton's interpreter has no grid dependency control, so
it only ever sees PDL = False.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace

import torch

__all__ = ["PLAIN", "KernelLaunch", "interpreting"]

log = logging.getLogger("rlt.worker")

PDL_CAPABILITY = (9, 0)  # griddepcontrol: Hopper and newer


def interpreting() -> bool:
    """Whether Triton would build interpreter kernels now (TRITON_INTERPRET, read as Triton reads it)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes", "y")


@dataclass(frozen=True)
class KernelLaunch:
    """The launch options the decode pass's Triton wrappers take (`launch=`), chosen once by the worker.

    pdl: launch with programmatic dependent launch (module docstring).
    pdl_max_rows: PDL only for launches over at most this many rows (None: every launch).
    """

    pdl: bool = False
    pdl_max_rows: int | None = None

    def __post_init__(self) -> None:
        if self.pdl and interpreting():
            raise ValueError("programmatic dependent launch needs compiled kernels: unset TRITON_INTERPRET "
                             "or use KernelLaunch(pdl=False)")
        if self.pdl_max_rows is not None and self.pdl_max_rows < 0:
            raise ValueError(f"KernelLaunch.pdl_max_rows must be ≥ 0 or None, got {self.pdl_max_rows}")

    def kwargs(self, rows: int, **compile_options: object) -> dict[str, object]:
        """A launch's keywords for a kernel over `rows` rows: the kernel's PDL constexpr, and (compiled
        only: the interpreter takes no options) the compile options and Triton's launch_pdl flag."""
        if interpreting():
            return {"PDL": False}
        pdl = self.pdl and (self.pdl_max_rows is None or rows <= self.pdl_max_rows)
        return {**compile_options, "PDL": pdl, "launch_pdl": pdl}

    def bounded(self, max_rows: int) -> KernelLaunch:
        """This launch with PDL only for launches of at most max_rows rows (a tighter bound kept)."""
        if not self.pdl:
            return self
        bound = max_rows if self.pdl_max_rows is None else min(max_rows, self.pdl_max_rows)
        return replace(self, pdl_max_rows=bound)

    @classmethod
    def for_device(cls, pdl: bool, device: torch.device) -> KernelLaunch:
        """PDL if asked for and the device has it (CUDA, compute capability ≥ 9.0, compiled kernels)."""
        if not pdl:
            return PLAIN
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        if capability is None or capability < PDL_CAPABILITY or interpreting():
            log.info("launch_pdl: %s has no programmatic dependent launch (CUDA sm_90+, compiled kernels); "
                     "plain launches", device)
            return PLAIN
        return cls(pdl=True)


PLAIN = KernelLaunch()
