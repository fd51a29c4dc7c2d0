"""Philox uniforms on CUDA in one launch: the sampler's Gumbel noise, bit for bit `philox.uniform`.

`rlt_worker.philox.uniform` runs Philox4x32-10 as int64 torch ops (16-bit limbs for the 32×32→64
multiply, a mask after each add), about 180 elementwise launches for one [N, V] draw. In the
sampling CODA graph of one row at V = 49,152 that was most of 0.72 ms of GPU time (docs/benchmarks.md,
"Fused decoder layers"). Here one program computes BLOCK Philox blocks of one row in uint32 registers:

    program (row, j)    blocks b in [j·BLOCK, (j + 1)·BLOCK), each four words:
        key     = (seed mod 2^32, seed div 2^32)                 (the row's uint64 seed)
        counter = (b, index mod 2^32, purpose, 0)                 (the row's Philox index)
        words   = Philox4x32-10(counter, key)                     (umulhi and a wrapping multiply)
        out[row, 4·b + w] = (words[w] + 0.5) / 2^32   for 4·b + w < num_elements, float64

Integer arithmetic is exact and (word + 0.5) / 2^32 rounds nowhere in float64, so the result is the
torch path's bit for bit on any device (tests/test_philox_kernel.py).
"""

from __future__ import annotations

import torch

from rlt_worker.attention.triton_backend import _kernel, tl, triton
from rlt_worker.philox import _M0, _M1, _ROUNDS, _W0, _W1

__all__ = ["triton_uniform"]

BLOCK = 512  # Philox blocks a program: 2,048 uniforms; V = 49,152 gives 24 programs a row


def _uniform_kernel(seed_ptr, index_ptr, out_ptr, stride_out, num_elements, PURPOSE: tl.constexpr,
                    M0: tl.constexpr, M1: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr,
                    ROUNDS: tl.constexpr, BLOCK: tl.constexpr):
    """Row, j: BLOCK Philox blocks of the row's draw, stored as uniforms (module docstring)."""
    row = tl.program_id(0).to(tl.int64)
    blocks = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    seed = tl.load(seed_ptr + row)
    # The arithmetic shift then mask reads the high word of a uint64 stored as int64 correctly.
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    m0 = tl.full([BLOCK], M0, tl.uint32)  # the multipliers as uint32 vectors: a wrapping low product
    m1 = tl.full([BLOCK], M1, tl.uint32)
    c0 = blocks.to(tl.uint32)
    c1 = tl.full([BLOCK], 0, tl.uint32) + (tl.load(index_ptr + row) & 0xFFFFFFFF).to(tl.uint32)
    c2 = tl.full([BLOCK], PURPOSE, tl.uint32)
    c3 = tl.full([BLOCK], 0, tl.uint32)
    for r in tl.static_range(ROUNDS):
        if r > 0:
            k0 = k0 + W0
            k1 = k1 + W1
        hi0, lo0 = tl.umulhi(c0, m0), c0 * m0
        hi1, lo1 = tl.umulhi(c2, m1), c2 * m1
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    # The four words of block b are the draw's elements 4·b … 4·b + 3: interleaved, then stored at once.
    words = tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), [4 * BLOCK])
    cols = tl.program_id(1).to(tl.int64) * (4 * BLOCK) + tl.arange(0, 4 * BLOCK)
    uniforms = (words.to(tl.float64) + 0.5) / 4294967296.0
    tl.store(out_ptr + row * stride_out + cols, uniforms, mask=cols < num_elements)


def triton_uniform(seeds: torch.Tensor, purpose: int, index: torch.Tensor, num_elements: int) -> torch.Tensor:
    """Float64 [N, E] uniforms in (0, 1): [n, e] is draw (seeds[n], purpose, index[n], e), as
    `philox.uniform` (seeds and index: int64 [N] on one device, seeds holding the uint64 bits)."""
    seeds = seeds.long().reshape(-1)
    index = index.long().reshape(-1).to(seeds.device)
    if index.shape != seeds.shape:
        raise ValueError(f"one Philox index a seed: got {index.shape[0]} indices for {seeds.shape[0]} seeds")
    rows, blocks = seeds.shape[0], triton.cdiv(num_elements, 4)
    out = torch.empty(rows, num_elements, dtype=torch.float64, device=seeds.device)
    if rows == 0 or num_elements == 0:
        return out
    grid = (rows, triton.cdiv(blocks, BLOCK))
    _kernel(_uniform_kernel)[grid](seeds, index.contiguous(), out, out.stride(0), num_elements,
                                   PURPOSE=purpose & 0xFFFFFFFF, M0=_M0, M1=_M1, W0=_W0, W1=_W1, ROUNDS=_ROUNDS,
                                   BLOCK=BLOCK, num_warps=4)
    return out
