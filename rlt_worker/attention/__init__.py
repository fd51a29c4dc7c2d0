"""Attention backends: `torch` (CPU path and oracle) and `triton` (CUDA default).

A backend module provides write_kv, write_kv_rotary, paged_attention, prefill_attention and
finalize_kv with the signatures of torch_ref (the Triton prefill kernel lives in triton_prefill, the
Triton write_kv_rotary in kernels/fused_ops, beside the RoPE kernel it shares).
"""

from __future__ import annotations

from types import ModuleType


def get_backend(name: str) -> ModuleType:
    """The backend module called `name`."""
    if name == "torch":
        from rlt_worker.attention import torch_ref

        return torch_ref
    if name == "triton":
        from rlt_worker.attention import triton_backend

        return triton_backend
    raise ValueError(f"unknown attention_backend {name!r}; choose 'torch' or 'triton'")
