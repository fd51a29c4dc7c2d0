"""Weights pulled into L2 ahead of their GEMV, while the GPU's memory is idle (issue 18).

A 1-row decode pass is a chain of GEMVs and small kernels. The GEMVs read HBM near its bandwidth;
the kernels between them (RoPE and the K/V write, attention, add+RMSNorm, SwiGLU) read little, so
for about a third of a pass HBM idles while the next GEMV's weight waits to be read. `L2Prefetch`
asks the L2 to fetch the first bytes of the next GEMV's weight as soon as the previous GEMV is
done, from a kernel on a side stream that overlaps the small kernels; the GEMV then finds those
lines in L2.

    main:  |= qkv GEMV =|rope|== attention ==|merge|= o GEMV (hits L2) =|
    side:               |prefetch o → L2|

The kernel issues `cp.async.bulk.prefetch.L2` (sm_90+): a hint, so results are unchanged whether
or not it runs, and nothing waits for its bytes. Each of its `programs` × 128 threads asks for one
16-byte-aligned piece of the range. The side stream forks from the pass's stream after the GEMV
and joins it at the end of the pass (`join`), which a CUDA graph capture needs; inside a graph the
prefetch is a branch of its own.

`NO_PREFETCH` (the default, and the CPU and interpreter path: the instruction is PTX) does nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlt_worker.attention.triton_backend import _kernel, tl, triton

__all__ = ["NO_PREFETCH", "PREFETCH_SITES", "L2Prefetch", "WeightPrefetch"]

LANES = 128  # threads per program (4 warps), one bulk prefetch each
ALIGN = 16  # cp.async.bulk.prefetch: 16-byte-aligned address, size a multiple of 16
# Where the fused loop may prefetch: the weight whose GEMV comes next after the one just issued.
PREFETCH_SITES = ("o", "gate_up", "down", "qkv")


def _l2_prefetch_kernel(base_ptr, nbytes, piece, LANES: tl.constexpr):
    """Lane i of program p asks for bytes [(p·LANES + i)·piece, … + piece) of [base, base + nbytes)."""
    lane = tl.program_id(0).to(tl.int64) * LANES + tl.arange(0, LANES)
    start = lane * piece
    size = tl.minimum(tl.maximum(nbytes - start, 0), piece).to(tl.int32)
    addr = base_ptr.to(tl.pointer_type(tl.int8)) + tl.where(size > 0, start, 0)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1,
    )


def l2_prefetch(weight: torch.Tensor, nbytes: int, programs: int) -> None:
    """Ask the L2 for the first nbytes of weight's storage (rounded down to 16), from `programs` programs."""
    nbytes = min(nbytes, weight.numel() * weight.element_size()) // ALIGN * ALIGN
    if weight.data_ptr() % ALIGN:
        raise ValueError(f"L2 prefetch needs a {ALIGN}-byte-aligned weight, got address {weight.data_ptr():#x}")
    if nbytes == 0:
        return
    piece = triton.cdiv(triton.cdiv(nbytes, programs * LANES), ALIGN) * ALIGN
    _kernel(_l2_prefetch_kernel)[(programs,)](weight, nbytes, piece, LANES=LANES, num_warps=LANES // 32)


class WeightPrefetch:
    """How the fused loop prefetches weights (chosen once, at construction): `ahead` after a GEMV is
    issued, naming the site and the next GEMV's weight; `join` once the pass's work is issued."""

    def ahead(self, site: str, weight: torch.Tensor, rows: int) -> None:
        """Nothing: the plain strategy."""

    def join(self) -> None:
        """Nothing: the plain strategy."""


@dataclass
class L2Prefetch(WeightPrefetch):
    """The first `budget_bytes` of the next weight at each of `sites`, for passes of at most `max_rows`
    rows (more rows make the GEMVs compute-bound), from a side stream (module docstring)."""

    budget_bytes: int
    sites: frozenset[str] = frozenset(PREFETCH_SITES)
    max_rows: int = 32
    programs: int = 16
    _side: dict[torch.device, torch.cuda.Stream] = field(default_factory=dict, repr=False)
    _forked: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        unknown = set(self.sites) - set(PREFETCH_SITES)
        if unknown or self.budget_bytes < 0 or self.programs < 1:
            raise ValueError(f"L2Prefetch: sites must be among {PREFETCH_SITES} (got {sorted(self.sites)}), "
                             f"budget_bytes >= 0 and programs >= 1")

    def ahead(self, site: str, weight: torch.Tensor, rows: int) -> None:
        if site not in self.sites or rows > self.max_rows or not weight.is_cuda:
            return
        side = self._side.setdefault(weight.device, torch.cuda.Stream(weight.device))
        side.wait_stream(torch.cuda.current_stream(weight.device))
        with torch.cuda.stream(side):
            l2_prefetch(weight, self.budget_bytes, self.programs)
        self._forked = True

    def join(self) -> None:
        if self._forked:
            for device, side in self._side.items():
                torch.cuda.current_stream(device).wait_stream(side)
            self._forked = False


NO_PREFETCH = WeightPrefetch()
