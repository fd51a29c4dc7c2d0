"""Attention backends: `torch` (CPU path and oracle) and `triton` (CUDA default).

A backend module provides write_kv, write_kv_rotary, paged_attention, paged_attention_rotary,
prefill_attention and finalize_kv with the signatures of torch_ref (the Triton prefill kernel lives
in triton_prefill, the Triton write_kv_rotary in kernels/fused_ops, beside the RoPE kernel it
shares). The Triton backend
under a PDL launch (kernels/launch.py) is a namespace of the same six, its decode pass's kernels
(the rotating K/V write, the attentions, the split merge) bound to that launch.
"""

from __future__ import annotations

import functools
from types import ModuleType, SimpleNamespace

from rlt_worker.kernels.launch import PLAIN, KernelLaunch


def get_backend(name: str, launch: KernelLaunch = PLAIN) -> ModuleType | SimpleNamespace:
    """The backend called `name`, its kernels launched under `launch` (PDL: Triton only)."""
    if name == "torch":
        if launch.pdl:
            raise ValueError("programmatic dependent launch is for Triton kernels: use attention_backend 'triton'")
        from rlt_worker.attention import torch_ref

        return torch_ref
    if name == "triton":
        from rlt_worker.attention import triton_backend

        return _launched(triton_backend, launch) if launch.pdl else triton_backend
    raise ValueError(f"unknown attention_backend {name!r}; choose 'torch' or 'triton'")


def _launched(backend: ModuleType, launch: KernelLaunch) -> SimpleNamespace:
    """The Triton backend with its decode-pass entry points bound to `launch`."""
    return SimpleNamespace(
        write_kv=backend.write_kv,
        write_kv_rotary=functools.partial(backend.write_kv_rotary, launch=launch),
        paged_attention=functools.partial(backend.paged_attention, launch=launch),
        paged_attention_rotary=functools.partial(backend.paged_attention_rotary, launch=launch),
        prefill_attention=backend.prefill_attention,
        finalize_kv=backend.finalize_kv,
    )
