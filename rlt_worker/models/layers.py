"""Shared building blocks: RMSNorm, the two RoPE styles, SwiGLU MLPs (SPEC §9 parity details)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The "fp32" of the official code: float32, or float64 when the model runs in float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class RMSNorm(nn.Module):
    """RMSNorm: normalise in fp32 (float64 on float64), cast back, then scale by the weight."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension."""
        h = x.to(compute_dtype(x.dtype))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _inv_freq(head_dim: int, base: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Same expression as both official codes: 1 / base^(2i/d).
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device).to(dtype) / head_dim))


def rope_angles(positions: torch.Tensor, head_dim: int, base: float, dtype: torch.dtype) -> torch.Tensor:
    """Angles [N, head_dim/2] = position × inverse frequency, computed in `dtype`."""
    inv = _inv_freq(head_dim, base, dtype, positions.device)
    return positions.to(dtype)[:, None] * inv[None, :]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Ouro/Llama split-half rotation: [x1, x2] → [-x2, x1]."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def split_half_cos_sin(
    positions: torch.Tensor, head_dim: int, base: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ouro cos/sin [N, 1, head_dim]: computed in fp32 (float64 on float64), cast to the activation dtype."""
    ang = rope_angles(positions, head_dim, base, compute_dtype(dtype))
    emb = torch.cat((ang, ang), dim=-1)[:, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_split_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply Ouro RoPE to x [N, H, Dh] in the activation dtype."""
    return x * cos + rotate_half(x) * sin


def adjacent_cos_sin(positions: torch.Tensor, head_dim: int, base: float, dtype: torch.dtype) -> torch.Tensor:
    """Huginn rotation table [N, 1, head_dim/2, 2] (cos, sin) in fp32 (float64 on float64)."""
    ang = rope_angles(positions, head_dim, base, compute_dtype(dtype))[:, None, :]
    return torch.stack((ang.cos(), ang.sin()), dim=-1)


def apply_adjacent(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Apply Huginn RoPE to x [N, H, Dh]: rotate pairs (x[2i], x[2i+1]) in fp32, cast back."""
    pairs = x.unflatten(-1, (-1, 2)).to(freqs.dtype)
    re, im = pairs[..., 0], pairs[..., 1]
    cos, sin = freqs[..., 0], freqs[..., 1]
    out = torch.stack((re * cos - im * sin, im * cos + re * sin), dim=-1).flatten(-2)
    return out.to(x.dtype)


class SwiGLU(nn.Module):
    """Ouro MLP: down(silu(gate(x)) · up(x))."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Gated MLP."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class FusedGatedMLP(nn.Module):
    """Huginn MLP: `fc` is 2×intermediate wide; silu(first half) gates the second half; then `proj`."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Gated MLP."""
        gate, up = self.fc(x).chunk(2, dim=-1)
        return self.proj(F.silu(gate) * up)


def register_head(model: nn.Module, head: nn.Linear) -> None:
    """Register `head` as submodule "lm_head" although the class has an `lm_head` method.

    The checkpoint calls the weight `lm_head.weight` and the stage API calls the method
    `lm_head`; `add_module` refuses the clash, so write the module table directly, which
    is all `nn.Module.__setattr__` does (state_dict, load_state_dict and .to() then see it).
    """
    model._modules["lm_head"] = head


def head_weight(model: nn.Module, tied: torch.Tensor) -> torch.Tensor:
    """The registered untied head's weight, else the tied embedding."""
    head = model._modules.get("lm_head")
    return tied if head is None else head.weight
