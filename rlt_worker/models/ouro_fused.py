"""Ouro's loop through fused Triton kernels over packed weights: the CUDA fast path.

`FusedOuroModel` wraps a loaded `OuroModel` (the reference, which keeps serving every other stage)
and runs `loop` as, per decoder layer,

    qkv = y·W_qkv                      one GEMM (q|k|v packed at load time)
    a = ctx.attend_rotary(qkv, rope)   one launch rotates q and k and writes k, v into the paged
                                       cache (the context's backend: write_kv_rotary), then the
                                       context's paged attention
    x, y = add_rmsnorm(x, a·W_o)       x + input_layernorm_2(·), then post_attention_layernorm
    m = swiglu(y·W_gate_up)·W_down     one GEMM (gate|up packed), one launch, one GEMM
    x, y = add_rmsnorm(x, m)           x + post_attention_layernorm_2(·), then the next layer's
                                       input_layernorm (model.norm after the last layer)

plus one plain RMSNorm at the loop's start: per layer 4 GEMMs, 3 elementwise launches and the
context's (the rotating K/V write, the attention, a split merge) instead of ~58 kernels. A context
without attend_rotary (a test's or a script's own) gets the same numbers by composition: rope_qk,
then its attend (`rope_then_attend`).

Packing concatenates q|k|v and gate|up into one weight each and re-points the reference modules'
weights at views of it, so no weight is held twice and the checkpoint's names (the reference's
state_dict, under `reference.`) are unchanged.

The four GEMMs go through one linear strategy chosen at construction (`linear_choice`): F.linear
(cuBLAS) for every weight, unless `splitk` names a tile setting for a weight's (out, in, dtype), in
which case a SplitKGemv (rlt_worker/kernels/splitk_gemv.py) serves those weights for passes of at
most `splitk_max_rows` rows, F.linear the rest. SPLITK_SETTINGS, the default, is empty: on the
H200 sweep (`scripts/bench_linear.py --sweep`, docs/benchmarks.md) only `down` beat cuBLAS alone,
and the pass was slower with it.

The kernels round as the torch modules do (rlt_worker/kernels/fused_ops.py), but the mean of
squares and the packed GEMMs reduce in other orders, so results equal the reference's up to the
last bit of fp32 (SPEC §7a), not bit for bit. Chosen once, by the worker (`fused_layers`), with
the kernels' launch (`launch_pdl`: kernels/launch.py), which changes timing, not results.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from rlt_worker.attention.triton_backend import _interpreting
from rlt_worker.kernels.fused_ops import add_rmsnorm, rope_qk, rope_table, swiglu
from rlt_worker.kernels.launch import PLAIN, KernelLaunch
from rlt_worker.kernels.splitk_gemv import SUPPORTED_DTYPES, SplitKConfig, SplitKGemv

from .base import AttentionContext, LayerId, LoopedModel, Rotary, RotaryAttentionContext
from .ouro import OuroDecoderLayer, OuroModel

log = logging.getLogger("rlt.worker")

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x [M, K], weight [N, K]) -> x·weightᵀ
WeightKey = tuple[int, int, torch.dtype]  # (out_features, in_features, dtype) of a weight

# Split-K tile settings by weight, as measured on one H200 (scripts/bench_linear.py --sweep, which
# prints these entries); a weight not listed keeps cuBLAS. Empty: split-K is off (no setting made a
# pass faster at 7d64e4e: docs/benchmarks.md).
SPLITK_SETTINGS: Mapping[WeightKey, SplitKConfig] = {}
# Passes of at most this many rows use the split-K settings (the kernel's rows per program).
SPLITK_MAX_ROWS = 8


class PackedLayer(NamedTuple):
    """One decoder layer's weights as the fused loop reads them."""

    layer: LayerId
    qkv: torch.Tensor  # [(Hq + 2·Hkv)·Dh, H]: q_proj | k_proj | v_proj rows
    o: torch.Tensor  # [H, Hq·Dh]
    gate_up: torch.Tensor  # [2·I, H]: gate_proj | up_proj rows
    down: torch.Tensor  # [H, I]
    input_norm: torch.Tensor
    input_norm_2: torch.Tensor
    post_norm: torch.Tensor
    post_norm_2: torch.Tensor


def _pack(linears: list[nn.Linear]) -> torch.Tensor:
    """Concatenate the linears' weights by rows; each module's weight becomes a view of the result."""
    packed = torch.cat([m.weight for m in linears])
    start = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight = nn.Parameter(packed[start : start + rows], requires_grad=False)
        start += rows
    return packed


def pack_layer(layer: OuroDecoderLayer) -> PackedLayer:
    """Pack one layer's q|k|v and gate|up (in place: the modules then hold views)."""
    attn, mlp = layer.self_attn, layer.mlp
    return PackedLayer(
        layer=attn.layer,
        qkv=_pack([attn.q_proj, attn.k_proj, attn.v_proj]),
        o=attn.o_proj.weight,
        gate_up=_pack([mlp.gate_proj, mlp.up_proj]),
        down=mlp.down_proj.weight,
        input_norm=layer.input_layernorm.weight,
        input_norm_2=layer.input_layernorm_2.weight,
        post_norm=layer.post_attention_layernorm.weight,
        post_norm_2=layer.post_attention_layernorm_2.weight,
    )


class FusedOuroModel(LoopedModel):
    """The stage API of a loaded OuroModel, with `loop` through the fused kernels (module docstring)."""

    def __init__(self, reference: OuroModel, launch: KernelLaunch = PLAIN,
                 splitk: Mapping[WeightKey, SplitKConfig] = SPLITK_SETTINGS,
                 splitk_max_rows: int = SPLITK_MAX_ROWS) -> None:
        super().__init__()
        self.reference = reference
        self.launch = launch  # how add_rmsnorm and swiglu launch (the context's backend has its own)
        self.config = reference.config
        self.info = reference.info
        cfg = self.config
        self._heads, self._kv_heads, self._head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self._eps = cfg.rms_norm_eps
        self._layers = [pack_layer(layer) for layer in reference.model.layers]
        self._linear = linear_choice([t for w in self._layers for t in (w.qkv, w.o, w.gate_up, w.down)],
                                     splitk, splitk_max_rows)
        self._final_norm = reference.model.norm.weight.detach()  # a plain tensor: not a parameter of this module
        weight = self._final_norm
        # Every position the model supports, as split_half_cos_sin computes it (fp32, then cast).
        self._cos, self._sin = rope_table(cfg.max_position_embeddings, cfg.head_dim, cfg.rope_theta, weight.dtype,
                                          weight.device)

    def embed(self, token_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """The reference's embedding."""
        return self.reference.embed(token_ids, positions, ctx)

    def init_state(self, embedded: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        """The reference's (the embedding)."""
        return self.reference.init_state(embedded, noise)

    def loop(
        self, state: torch.Tensor, embedded: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """All L decoder layers then `model.norm`, through the fused kernels."""
        n = state.shape[0]
        heads, kv_heads, head_dim, eps, launch = self._heads, self._kv_heads, self._head_dim, self._eps, self.launch
        layers, linear = self._layers, self._linear
        rope = Rotary(positions, self._cos, self._sin, heads, kv_heads, head_dim)
        attend_rotary = (ctx.attend_rotary if isinstance(ctx, RotaryAttentionContext)
                         else functools.partial(rope_then_attend, ctx))
        x, y = add_rmsnorm(state, None, None, layers[0].input_norm, eps, launch=launch)
        for i, w in enumerate(layers):
            attn = attend_rotary(w.layer, linear(y, w.qkv), rope).reshape(n, heads * head_dim)
            x, y = add_rmsnorm(x, linear(attn, w.o), w.input_norm_2, w.post_norm, eps, launch=launch)
            mlp = linear(swiglu(linear(y, w.gate_up), launch=launch), w.down)
            closing = layers[i + 1].input_norm if i + 1 < len(layers) else self._final_norm
            x, y = add_rmsnorm(x, mlp, w.post_norm_2, closing, eps, launch=launch)
        return y

    def exit_gate(self, state: torch.Tensor) -> torch.Tensor:
        """The reference's gate."""
        return self.reference.exit_gate(state)

    def coda(self, state: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """The reference's (identity)."""
        return self.reference.coda(state, positions, ctx)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The reference's head."""
        return self.reference.lm_head(hidden)


class RowBoundLinear:
    """x·Wᵀ through the SplitKGemv of W's (out, in, dtype) when x has at most max_rows rows, else F.linear.

    A CUDA graph fixes its row count at capture, so within one graph the choice is static."""

    def __init__(self, gemvs: Mapping[WeightKey, SplitKGemv], max_rows: int) -> None:
        self._gemvs, self.max_rows = dict(gemvs), max_rows

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        gemv = self._gemvs.get((*weight.shape, weight.dtype)) if x.shape[0] <= self.max_rows else None
        return F.linear(x, weight) if gemv is None else gemv(x, weight)

    def __repr__(self) -> str:
        return f"RowBoundLinear(max_rows={self.max_rows}, {list(self._gemvs.values())})"


def linear_choice(weights: list[torch.Tensor], splitk: Mapping[WeightKey, SplitKConfig], max_rows: int) -> Linear:
    """F.linear, or a RowBoundLinear with one SplitKGemv (and workspace) per (out, in, dtype) in `splitk`.

    Split-K runs where its kernel does: weights of a supported dtype on CUDA (or on the CPU under
    TRITON_INTERPRET=1, the tests); float64, and float32 on a plain CPU, keep torch's path."""
    gemvs = {}
    for w in weights:
        key = (*w.shape, w.dtype)
        runs_here = w.dtype in SUPPORTED_DTYPES and (w.is_cuda or _interpreting())
        if key in splitk and key not in gemvs and runs_here:
            gemvs[key] = SplitKGemv(*w.shape, splitk[key], max_rows, w.device)
    if not gemvs:
        return F.linear
    log.info("fused_layers: split-K GEMV for ≤ %d rows on weights %s", max_rows, list(gemvs))
    return RowBoundLinear(gemvs, max_rows)


def rope_then_attend(ctx: AttentionContext, layer: LayerId, qkv: torch.Tensor, rope: Rotary) -> torch.Tensor:
    """attend_rotary for a context that has only `attend`: rope_qk's launch, then ctx.attend."""
    q, k = rope_qk(qkv, *rope)
    v = qkv[:, (rope.num_heads + rope.num_kv_heads) * rope.head_dim :].view(-1, rope.num_kv_heads, rope.head_dim)
    return ctx.attend(layer, q, k, v)


def with_fused_layers(model: LoopedModel, launch: KernelLaunch = PLAIN) -> LoopedModel:
    """The worker's seam: Ouro gets FusedOuroModel (its kernels launched under `launch`); other
    families (Huginn) keep their torch modules."""
    if isinstance(model, OuroModel):
        return FusedOuroModel(model, launch)
    log.info("fused_layers: no fused path for the %s family; its torch modules run", model.info.family)
    return model
