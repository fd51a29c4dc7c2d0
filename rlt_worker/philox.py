"""Philox4x32-10 (Random123) in integer torch ops, so CPU and CUDA produce the same bits.

Every value is an int64 tensor holding a uint32. The 32x32->64 multiply is split into
16-bit limbs of one operand so no intermediate exceeds 2^49 and nothing overflows int64.
Randomness is counter based (SPEC §5): a draw is a pure function of (seed, purpose, index,
element), never of a generator's state.
"""

from __future__ import annotations

import torch
from torch import Tensor

PURPOSE_SAMPLE = 1
PURPOSE_STATE_INIT = 2

_MASK32 = 0xFFFFFFFF
_M0 = 0xD2511F53
_M1 = 0xCD9E8D57
_W0 = 0x9E3779B9
_W1 = 0xBB67AE85
_ROUNDS = 10


def seed_to_int64(seed: int) -> int:
    """Map a uint64 seed (0 <= seed < 2^64) to the int64 with the same bits."""
    if not 0 <= seed < 1 << 64:
        raise ValueError(f"seed must be in [0, 2^64), got {seed}")
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def _mulhilo(a: Tensor, m: int) -> tuple[Tensor, Tensor]:
    # a * m = a*m_hi*2^16 + a*m_lo; both partial products are < 2^48.
    p_lo = a * (m & 0xFFFF)
    p_hi = a * (m >> 16)
    t = p_lo + ((p_hi & 0xFFFF) << 16)  # < 2^49
    return (p_hi >> 16) + (t >> 32), t & _MASK32


def philox4x32(counter: Tensor, key: Tensor) -> Tensor:
    """Philox4x32-10 of counter [..., 4] under key [..., 2] (int64 holding uint32) -> [..., 4]."""
    counter, key = counter.long() & _MASK32, key.long() & _MASK32
    shape = torch.broadcast_shapes(counter.shape[:-1], key.shape[:-1])
    c0, c1, c2, c3 = counter.expand(*shape, 4).unbind(-1)
    k0, k1 = key.expand(*shape, 2).unbind(-1)
    for r in range(_ROUNDS):
        if r:
            k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
        hi0, lo0 = _mulhilo(c0, _M0)
        hi1, lo1 = _mulhilo(c2, _M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return torch.stack((c0, c1, c2, c3), dim=-1)


def uniform(seeds: Tensor, purpose: int, index: Tensor, num_elements: int) -> Tensor:
    """Float64 [N, E] uniforms in (0, 1); [n, e] is draw (seeds[n], purpose, index[n], e)."""
    seeds = seeds.long().reshape(-1)
    index = index.long().reshape(-1).to(seeds.device)
    n, blocks = seeds.shape[0], (num_elements + 3) // 4
    # key = (seed mod 2^32, seed div 2^32); the arithmetic shift plus mask reads the high word
    # of a uint64 stored as two's-complement int64 correctly.
    key = torch.stack((seeds & _MASK32, (seeds >> 32) & _MASK32), dim=-1)[:, None, :]
    counter = torch.zeros(n, blocks, 4, dtype=torch.int64, device=seeds.device)
    counter[..., 0] = torch.arange(blocks, device=seeds.device)
    counter[..., 1] = (index & _MASK32)[:, None]
    counter[..., 2] = purpose & _MASK32
    words = philox4x32(counter, key).reshape(n, blocks * 4)[:, :num_elements]
    return (words.double() + 0.5) / 2.0**32


def truncated_normal(seeds: Tensor, index: Tensor, num_elements: int) -> Tensor:
    """Standard normal truncated to [-3, 3], float64 [N, E], by inverse CDF of PURPOSE_STATE_INIT uniforms."""
    u = uniform(seeds, PURPOSE_STATE_INIT, index, num_elements)
    bounds = torch.tensor([-3.0, 3.0], dtype=torch.float64, device=u.device)
    lo, hi = torch.special.ndtr(bounds).unbind()
    return torch.special.ndtri(lo + u * (hi - lo)).clamp(-3.0, 3.0)
