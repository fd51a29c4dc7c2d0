"""The stage API every looped model exposes, and the attention seam it calls.

A model knows nothing about scheduling, paging or batching. It takes a batch of token
rows (ids or carried states, with their positions) and an attention context that decides
which K/V each row writes and reads (SPEC §4). The runner backs the context with paged
storage; the dense reference backs it with per-position per-loop lists.

One generated position, for either family:

    token ──embed──► embedded ──init_state──► state_0
    state_{d-1} ──loop(d)──► state_d            (d = 1 … exit depth; each loop may read
                                                 exit_gate(state_d) or coda logits as signal)
    state_e ──coda──► hidden ──lm_head──► logits
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

import torch

from protocol.messages import ModelInfo
from rlt_worker.kernels.launch import PLAIN, KernelLaunch

__all__ = ["AttentionContext", "LayerId", "LoopedModel", "ModelInfo", "RotaryAttentionContext", "Rotary"]


class LayerId(NamedTuple):
    """Names one attention layer's K/V: inside the loop (one plane per depth) or outside it."""

    in_loop: bool
    index: int


class AttentionContext(Protocol):
    """What a model's attention layer calls; the batch description lives behind it."""

    def attend(self, layer: LayerId, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store this batch's k/v [N, Hkv, Dh] for `layer`, then attend q [N, Hq, Dh] causally.

        Row i is the token at the batch's i-th position; it reads every earlier position of
        its own sequence and itself (K/V chosen per SPEC §4). Returns [N, Hq, Dh].
        """
        ...


class Rotary(NamedTuple):
    """Split-half RoPE of a batch's packed q|k|v rows: what a fused rotate-and-write needs.

    cos/sin are one table pair [max_positions, Dh/2] (kernels.fused_ops.rope_table), read at
    `positions` [N]; the rows hold num_heads q heads, then num_kv_heads k heads, then v heads.
    """

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def check_table(self) -> None:
        """cos/sin are one rope_table pair [max_positions, Dh/2]; a ValueError otherwise."""
        cos, sin, half = self.cos, self.sin, self.head_dim // 2
        if cos.shape != sin.shape or cos.shape[1:] != (half,) or cos.stride(1) != 1 or sin.stride() != cos.stride():
            raise ValueError(f"cos/sin must be one rope_table pair [max_positions, {half}]")

    def check_qkv(self, qkv: torch.Tensor) -> None:
        """qkv [N, (Hq + 2·Hkv)·Dh] holds q|k|v rows of these heads at these positions [N], and the
        table is one rope_table pair; a ValueError otherwise."""
        heads, dim = self.num_heads + 2 * self.num_kv_heads, self.head_dim
        if qkv.dim() != 2 or qkv.shape[1] != heads * dim or dim % 2 or self.positions.shape != qkv.shape[:1]:
            raise ValueError(f"qkv {tuple(qkv.shape)} is not q|k|v rows of {self.num_heads}+2×{self.num_kv_heads} "
                             f"heads of {dim} at positions {tuple(self.positions.shape)}")
        self.check_table()


@runtime_checkable
class RotaryAttentionContext(AttentionContext, Protocol):
    """A context that can also rotate q/k itself, in the launch that stores this batch's K/V."""

    def attend_rotary(self, layer: LayerId, qkv: torch.Tensor, rope: Rotary) -> torch.Tensor:
        """`attend` of packed q|k|v rows [N, (Hq + 2·Hkv)·Dh] with q and k rotated by `rope` first.

        Equals rotating with kernels.fused_ops.rope_qk, then attend(layer, q, k, v), bit for bit.
        """
        ...


class LoopedModel(torch.nn.Module):
    """Base class of the native models: the stage API the runner batches."""

    info: ModelInfo

    def embed(self, token_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """Token ids [N] → the loop's injected input [N, H] (Ouro: embedding; Huginn: prelude output)."""
        raise NotImplementedError

    def init_state(self, embedded: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        """The state loop 1 starts from. Ouro: the embedding (noise ignored). Huginn: zeros when
        `noise` is None, else `noise` (standard truncated-normal draws in [-3, 3], [N, H],
        float64) times the model's state-init σ and embedding scale, cast to the model dtype."""
        raise NotImplementedError

    def loop(
        self, state: torch.Tensor, embedded: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """One pass of the shared block: state [N, H] at loop d-1 → state at loop d.

        The context knows each row's depth d; the model only needs the rows' positions.
        """
        raise NotImplementedError

    def kernel_launch(self, requested: KernelLaunch) -> KernelLaunch:
        """How the Triton kernels of this model's passes (the attention backend's too) launch, given the
        launch the worker was asked for: plainly here, since every pass of the torch modules has cuBLAS
        GEMMs, and with those PDL measured no faster (kernels/launch.py)."""
        del requested
        return PLAIN

    def exit_gate(self, state: torch.Tensor) -> torch.Tensor:
        """Ouro's per-loop hazard λ = sigmoid(gate(state)), [N] (float64 on float64 models)."""
        raise NotImplementedError

    def coda(self, state: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """Exit state [N, H] → the hidden state the LM head reads (Huginn writes coda K/V here)."""
        raise NotImplementedError

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden [N, H] → logits [N, V]."""
        raise NotImplementedError

    def lm_head_needed(self, hidden: torch.Tensor, needed: torch.Tensor) -> torch.Tensor:
        """lm_head's logits where `needed` (bool [N], on the device) holds; the other rows' may be
        anything (a head that learns on the device that no row is needed may skip its weight)."""
        del needed
        return self.lm_head(hidden)
