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

The four GEMMs go through one linear strategy chosen at construction (`linear_choice`): tiers of
Triton GEMVs by row count, F.linear (cuBLAS) for whatever no tier takes. A tier is a row bound and
settings by weight (out, in, dtype):
  - `strip` (≤ `strip_max_rows` rows): StripGemv (rlt_worker/kernels/strip_gemv.py), each program
    whole rows of W loaded at once. STRIP_SETTINGS, the default, covers Ouro-1.4B's four packed
    shapes at one row, where on the H200 a 24-layer chain of them beats cuBLAS's (docs/benchmarks.md).
  - `splitk` (≤ `splitk_max_rows` rows): SplitKGemv (rlt_worker/kernels/splitk_gemv.py).
    SPLITK_SETTINGS, the default, is empty: on the H200 sweep (`scripts/bench_linear.py --sweep`)
    only `down` beat cuBLAS alone, and the pass was slower with it.
gate|up and SwiGLU go through a second strategy (`GateUpSwiGLU`): a strip with the SwiGLU epilogue
(≤ `strip_max_rows` rows; STRIP_SWIGLU_SETTINGS: Ouro-1.4B's gate|up), else the linear strategy's GEMM
and swiglu's launch. q|k|v goes through the linear strategy, then the context's attend_rotary (RoPE
in the K/V write's launch). The LM head goes through a third strategy (`StripHead`): a strip (≤
`strip_max_rows` rows whose head has a setting in HEAD_STRIP_SETTINGS), which `lm_head_needed` gates
by the rows whose logits are read, else the reference's head.

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
from rlt_worker.kernels.strip_gemv import Epilogue, StripConfig, StripGemv

from .base import AttentionContext, LayerId, LoopedModel, Rotary, RotaryAttentionContext
from .layers import head_weight
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
# Strip settings by weight: Ouro-1.4B's packed q|k|v, o, gate|up and down, the fastest of
# scripts/bench_gemv_chain.py's candidates at one row on one H200 (docs/benchmarks.md), for every
# dtype the kernel takes (float32: the benchmark's gate runs the same kernels).
_OURO_1_4B_STRIPS = {(6144, 2048): StripConfig(2, 4), (2048, 2048): StripConfig(4, 4),
                     (11264, 2048): StripConfig(4, 4), (2048, 5632): StripConfig(1, 4)}
STRIP_SETTINGS: Mapping[WeightKey, StripConfig] = {
    (*shape, dtype): config for shape, config in _OURO_1_4B_STRIPS.items() for dtype in SUPPORTED_DTYPES}
# Passes of at most this many rows use the strip settings: each further row re-reduces the strip.
STRIP_MAX_ROWS = 1
# Strips that also apply SwiGLU (gate|up weights only: each program the gate rows of its columns and
# the up rows below them, one launch for y·W_gate_upᵀ and swiglu), for passes of at most
# STRIP_MAX_ROWS rows: Ouro-1.4B's gate|up with StripConfig(2, 4) (2 gate and 2 up rows a program, the
# registers of the plain strip's N4 w4). A 1-row pass on the H200: 1.064 ms against 1.103 with swiglu's
# launch, the same bits (docs/benchmarks.md).
STRIP_SWIGLU_SETTINGS: Mapping[WeightKey, StripConfig] = {
    (11264, 2048, dtype): StripConfig(2, 4) for dtype in SUPPORTED_DTYPES}
# The LM head's strip for passes of at most STRIP_MAX_ROWS rows, gated by the rows whose logits are
# needed (lm_head_needed: device refill's CODA at every pass reads only the rows that exited, so a
# pass where none did reads no head weight). Ouro-1.4B's head (49152 × 2048), measured on an H100
# (docs/benchmarks.md, 2026-12-07, third): device refill's CODA of one row 0.110 ms with no row
# needed against 0.168 with cuBLAS, 0.161 against 0.167 with it needed; c = 1 ouro 276.6 tok/s against
# 268.8 (ouro / ouro_replay 0.950 against 0.925).
HEAD_STRIP_SETTINGS: Mapping[WeightKey, StripConfig] = {(49152, 2048, d): StripConfig(4, 4) for d in SUPPORTED_DTYPES}


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
                 splitk_max_rows: int = SPLITK_MAX_ROWS,
                 strip: Mapping[WeightKey, StripConfig] = STRIP_SETTINGS,
                 strip_max_rows: int = STRIP_MAX_ROWS,
                 strip_swiglu: Mapping[WeightKey, StripConfig] = STRIP_SWIGLU_SETTINGS,
                 head_strip: Mapping[WeightKey, StripConfig] = HEAD_STRIP_SETTINGS) -> None:
        super().__init__()
        self.reference = reference
        self.config = reference.config
        self.info = reference.info
        cfg = self.config
        self._heads, self._kv_heads, self._head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self._eps = cfg.rms_norm_eps
        self._layers = [pack_layer(layer) for layer in reference.model.layers]
        weights = [t for w in self._layers for t in (w.qkv, w.o, w.gate_up, w.down)]
        self._linear = linear_choice(weights, [(strip_max_rows, strip), (splitk_max_rows, splitk)], launch)
        # PDL only for the passes with no cuBLAS kernel, the rows every weight has a Triton GEMV for
        # (kernels/launch.py: with cuBLAS between them it measured slower).
        self.launch = launch.bounded(triton_rows(self._linear, weights))
        strips = EpilogueStrips(strip_max_rows, self.launch)
        self._gate_up_swiglu = GateUpSwiGLU(self._linear, strips.built([w.gate_up for w in self._layers],
                                                                       strip_swiglu, Epilogue.SWIGLU), strips)
        head = head_weight(reference, reference.model.embed_tokens.weight)
        self._head = StripHead(reference, head, strips.built([head], head_strip, Epilogue.STORE), strips)
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
        n, eps, launch, layers, linear = state.shape[0], self._eps, self.launch, self._layers, self._linear
        rope = Rotary(positions, self._cos, self._sin, self._heads, self._kv_heads, self._head_dim)
        attend = rotary_attention(ctx)  # once a pass: isinstance of a Protocol is slow
        x, y = add_rmsnorm(state, None, None, layers[0].input_norm, eps, launch=launch)
        for i, w in enumerate(layers):
            attn = attend(w.layer, linear(y, w.qkv), rope).reshape(n, -1)
            x, y = add_rmsnorm(x, linear(attn, w.o), w.input_norm_2, w.post_norm, eps, launch=launch)
            mlp = linear(self._gate_up_swiglu(y, w.gate_up), w.down)
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
        """The head's strip where it has one (StripHead), else the reference's head."""
        return self._head(hidden)

    def lm_head_needed(self, hidden: torch.Tensor, needed: torch.Tensor) -> torch.Tensor:
        """The head's strip gated by `needed` where it has one (StripHead), else the reference's head."""
        return self._head(hidden, needed)

    def kernel_launch(self, requested: KernelLaunch) -> KernelLaunch:
        """This model's launch: the one it was built with, PDL bounded to its all-Triton passes."""
        del requested
        return self.launch


Gemv = SplitKGemv | StripGemv
GemvSetting = SplitKConfig | StripConfig
Tier = tuple[int, Mapping[WeightKey, GemvSetting]]  # (max rows, settings by weight)


class RowBoundLinear:
    """x·Wᵀ through the first tier whose row bound x's rows fit and which has a GEMV for W's (out, in,
    dtype), else F.linear. Tiers ascend by bound.

    A CUDA graph fixes its row count at capture, so within one graph the choice is static."""

    def __init__(self, tiers: list[tuple[int, dict[WeightKey, Gemv]]]) -> None:
        self.tiers = sorted(((bound, dict(gemvs)) for bound, gemvs in tiers if gemvs), key=lambda t: t[0])

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows, key = x.shape[0], (*weight.shape, weight.dtype)
        for bound, gemvs in self.tiers:
            gemv = gemvs.get(key) if rows <= bound else None
            if gemv is not None:
                return gemv(x, weight)
        return F.linear(x, weight)

    def __repr__(self) -> str:
        return f"RowBoundLinear({[(bound, list(gemvs.values())) for bound, gemvs in self.tiers]})"


def build_gemv(shape: tuple[int, int], setting: GemvSetting, max_rows: int, device: torch.device,
               launch: KernelLaunch) -> Gemv:
    """The setting's kernel for one weight shape: a strip under the model's launch; split-K plainly
    (PDL gained it 0.5% in a chain: docs/benchmarks.md)."""
    if isinstance(setting, StripConfig):
        return StripGemv(*shape, setting, max_rows, launch)
    return SplitKGemv(*shape, setting, max_rows, device)


def triton_runs(weight: torch.Tensor) -> bool:
    """Whether a Triton GEMV runs for this weight: a supported dtype on CUDA, or on the CPU under
    TRITON_INTERPRET=1 (the tests); float64, and float32 on a plain CPU, keep torch's path."""
    return weight.dtype in SUPPORTED_DTYPES and (weight.is_cuda or _interpreting())


def linear_choice(weights: list[torch.Tensor], tiers: list[Tier], launch: KernelLaunch = PLAIN) -> Linear:
    """F.linear, or a RowBoundLinear with one GEMV per (out, in, dtype) that a tier lists and where a
    Triton GEMV runs (`triton_runs`; module docstring)."""
    built: list[tuple[int, dict[WeightKey, Gemv]]] = []
    for max_rows, settings in tiers:
        gemvs: dict[WeightKey, Gemv] = {}
        for w in weights:
            key = (*w.shape, w.dtype)
            if key in settings and key not in gemvs and triton_runs(w):
                gemvs[key] = build_gemv(tuple(w.shape), settings[key], max_rows, w.device, launch)
        built.append((max_rows, gemvs))
    if not any(gemvs for _, gemvs in built):
        return F.linear
    linear = RowBoundLinear(built)
    log.info("fused_layers: Triton GEMVs %s", linear)
    return linear


class EpilogueStrips:
    """What the epilogue strategies share: the row bound and launch of their strips."""

    def __init__(self, max_rows: int, launch: KernelLaunch) -> None:
        self.max_rows, self.launch = max_rows, launch

    def built(self, weights: list[torch.Tensor], settings: Mapping[WeightKey, StripConfig], epilogue: Epilogue
              ) -> dict[WeightKey, StripGemv]:
        """One strip per listed (out, in, dtype) of these weights where a Triton GEMV runs."""
        strips: dict[WeightKey, StripGemv] = {}
        for w in weights:
            key = (*w.shape, w.dtype)
            if key in settings and key not in strips and triton_runs(w):
                strips[key] = StripGemv(*w.shape, settings[key], self.max_rows, self.launch, epilogue)
        return strips

    def find(self, strips: dict[WeightKey, StripGemv], x: torch.Tensor, weight: torch.Tensor) -> StripGemv | None:
        """The strip for this weight at x's rows, if any."""
        return strips.get((*weight.shape, weight.dtype)) if x.shape[0] <= self.max_rows else None


class GateUpSwiGLU:
    """swiglu(x·W_gate_upᵀ): one strip launch with SwiGLU for passes of at most max_rows rows whose
    gate|up weight has a strip, else the linear strategy's GEMM then swiglu's launch (the same bits)."""

    def __init__(self, linear: Linear, strips: dict[WeightKey, StripGemv], shared: EpilogueStrips) -> None:
        self._linear, self.strips, self._shared = linear, strips, shared

    def __call__(self, x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
        strip = self._shared.find(self.strips, x, gate_up)
        if strip is not None:
            return strip(x, gate_up)
        return swiglu(self._linear(x, gate_up), launch=self._shared.launch)


class StripHead:
    """The LM head: for passes of at most max_rows rows whose head weight has a strip, one strip launch,
    gated by the rows `needed` when given (rows not needed come out 0; none needed reads no weight);
    else the reference's head. lm_head and lm_head_needed both take it, so the host loop's CODA and
    device refill's (gated) give the same logits where a row is needed."""

    def __init__(self, reference: OuroModel, head: torch.Tensor, strips: dict[WeightKey, StripGemv],
                 shared: EpilogueStrips) -> None:
        self._reference, self._head, self.strips, self._shared = reference, head, strips, shared

    def __call__(self, hidden: torch.Tensor, needed: torch.Tensor | None = None) -> torch.Tensor:
        strip = self._shared.find(self.strips, hidden, self._head)
        if strip is not None:
            return strip(hidden, self._head, needed)
        return self._reference.lm_head(hidden)


def triton_rows(linear: Linear, weights: list[torch.Tensor]) -> int:
    """The most rows for which every weight's GEMV is a Triton kernel (0: some weight always has cuBLAS)."""
    if not isinstance(linear, RowBoundLinear):
        return 0
    return min(max((bound for bound, gemvs in linear.tiers if (*w.shape, w.dtype) in gemvs), default=0)
               for w in weights)


def rotary_attention(ctx: AttentionContext) -> Callable[[LayerId, torch.Tensor, Rotary], torch.Tensor]:
    """How ctx attends q|k|v rows with q and k rotated: its own attend_rotary where it has one (RoPE in
    the K/V write's launch), else rope_then_attend over it."""
    if isinstance(ctx, RotaryAttentionContext):
        return ctx.attend_rotary
    return functools.partial(rope_then_attend, ctx)


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
