"""Huginn-0125 (recurrent-depth Raven): prelude → adapter + core blocks per loop → coda."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import AttentionContext, LayerId, LoopedModel, ModelInfo
from .config import HuginnConfig
from .layers import FusedGatedMLP, RMSNorm, adjacent_cos_sin, apply_adjacent, head_weight, register_head


class HuginnAttention(nn.Module):
    """Fused-QKV self-attention with `qk_bias` and adjacent-pair RoPE in fp32."""

    def __init__(self, cfg: HuginnConfig, layer: LayerId) -> None:
        super().__init__()
        self.layer = layer
        self.heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.Wqkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        if cfg.qk_bias:
            self.qk_bias = nn.Parameter(torch.zeros(2, 1, self.heads, self.head_dim))
        else:
            self.qk_bias = None
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """x [N, H] → attention output [N, H]."""
        n = x.shape[0]
        # Rows are q | k | v, each head-major.
        q, k, v = self.Wqkv(x).view(n, 3 * self.heads, self.head_dim).chunk(3, dim=1)
        if self.qk_bias is not None:
            q, k = q + self.qk_bias[0], k + self.qk_bias[1]
        q, k = apply_adjacent(q, freqs), apply_adjacent(k, freqs)
        out = ctx.attend(self.layer, q, k, v)
        return self.proj(out.reshape(n, self.heads * self.head_dim))


class SandwichBlock(nn.Module):
    """`x = norm_2(attn(norm_1(x)) + x)`, `x = norm_4(mlp(norm_3(x)) + x)`."""

    def __init__(self, cfg: HuginnConfig, layer: LayerId) -> None:
        super().__init__()
        h, eps = cfg.n_embd, cfg.norm_eps
        self.norm_1 = RMSNorm(h, eps)
        self.attn = HuginnAttention(cfg, layer)
        self.norm_2 = RMSNorm(h, eps)
        self.norm_3 = RMSNorm(h, eps)
        self.mlp = FusedGatedMLP(h, cfg.intermediate_size)
        self.norm_4 = RMSNorm(h, eps)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """One block on rows [N, H]."""
        x = self.norm_2(self.attn(self.norm_1(x), freqs, ctx) + x)
        return self.norm_4(self.mlp(self.norm_3(x)) + x)


class HuginnBody(nn.Module):
    """The `transformer.` prefix of the checkpoint."""

    def __init__(self, cfg: HuginnConfig) -> None:
        super().__init__()
        n_pre = cfg.n_layers_in_prelude
        self.wte = nn.Embedding(cfg.padded_vocab_size, cfg.n_embd)
        self.prelude = nn.ModuleList(SandwichBlock(cfg, LayerId(False, i)) for i in range(n_pre))
        self.adapter = nn.Linear(2 * cfg.n_embd, cfg.n_embd, bias=False)
        self.core_block = nn.ModuleList(
            SandwichBlock(cfg, LayerId(True, j)) for j in range(cfg.n_layers_in_recurrent_block)
        )
        self.coda = nn.ModuleList(SandwichBlock(cfg, LayerId(False, n_pre + j)) for j in range(cfg.n_layers_in_coda))
        self.ln_f = RMSNorm(cfg.n_embd, cfg.norm_eps)


class HuginnModel(LoopedModel):
    """Huginn's stage API over the original weight names (SPEC §9)."""

    def __init__(self, config: HuginnConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = HuginnBody(config)
        if not config.tie_embeddings:  # tied: the head reads wte, lm_head.weight may be absent
            register_head(self, nn.Linear(config.n_embd, config.padded_vocab_size, bias=False))
        self.info = ModelInfo(
            family="huginn",
            hidden_size=config.n_embd,
            vocab_size=config.padded_vocab_size,
            default_depth=config.mean_recurrence,
            num_loop_kv_layers=config.n_layers_in_recurrent_block,
            num_outer_kv_layers=config.n_layers_in_prelude + config.n_layers_in_coda,
            num_kv_heads=config.n_heads,
            head_dim=config.head_dim,
            max_model_len=config.block_size,
            eos_token_ids=config.eos_token_ids,
            has_exit_gate=False,
            has_coda_signal=True,
        )

    def _freqs(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        cfg = self.config
        return adjacent_cos_sin(positions, cfg.head_dim, cfg.rope_base, dtype)

    def _blocks(
        self, blocks: nn.ModuleList, x: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        freqs = self._freqs(positions, x.dtype)
        for block in blocks:
            x = block(x, freqs, ctx)
        return x

    def embed(self, token_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """Token ids [N] → prelude output `e` [N, H] (writes the prelude K/V)."""
        x = self.transformer.wte(token_ids) * self.config.embed_scale
        return self._blocks(self.transformer.prelude, x, positions, ctx)

    def init_state(self, embedded: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        """Zeros, or the given truncated-normal draws × σ × embed scale (scaled in float64)."""
        if noise is None:
            return torch.zeros_like(embedded)
        # Same order as the official code: the σ-scaled truncated normal, then × embed scale.
        draws = noise.to(device=embedded.device, dtype=torch.float64)
        return (draws * self.config.init_std * self.config.embed_scale).to(embedded.dtype)

    def loop(
        self, state: torch.Tensor, embedded: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """`adapter(cat[state, e])`, then the core blocks."""
        x = self.transformer.adapter(torch.cat([state, embedded], dim=-1))
        return self._blocks(self.transformer.core_block, x, positions, ctx)

    def exit_gate(self, state: torch.Tensor) -> torch.Tensor:
        """Huginn has no exit gate: use a coda-based signal (kl / latent_diff) instead."""
        raise NotImplementedError("Huginn has no exit gate (info.has_exit_gate is False); use kl or latent_diff")

    def coda(self, state: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """`ln_f` → coda blocks → `ln_f` (writes the coda K/V)."""
        x = self.transformer.ln_f(state)
        x = self._blocks(self.transformer.coda, x, positions, ctx)
        return self.transformer.ln_f(x)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, padded vocab]."""
        return F.linear(hidden, head_weight(self, self.transformer.wte.weight))
