"""Ouro (ByteDance LoopLM): all L decoder layers + final norm form one loop; a gate gives the exit hazard."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import AttentionContext, LayerId, LoopedModel, ModelInfo
from .config import OuroConfig
from .layers import (
    RMSNorm,
    SwiGLU,
    apply_split_half,
    compute_dtype,
    head_weight,
    register_head,
    split_half_cos_sin,
)

Rope = tuple[torch.Tensor, torch.Tensor]


class OuroAttention(nn.Module):
    """GQA self-attention with split-half RoPE; K/V storage and the causal read are the context's."""

    def __init__(self, cfg: OuroConfig, layer_index: int) -> None:
        super().__init__()
        self.layer = LayerId(True, layer_index)
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, rope: Rope, ctx: AttentionContext) -> torch.Tensor:
        """x [N, H] → attention output [N, H]."""
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.heads, self.head_dim)
        k = self.k_proj(x).view(n, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.kv_heads, self.head_dim)
        cos, sin = rope
        q, k = apply_split_half(q, cos, sin), apply_split_half(k, cos, sin)
        out = ctx.attend(self.layer, q, k, v)
        return self.o_proj(out.reshape(n, self.heads * self.head_dim))


class OuroDecoderLayer(nn.Module):
    """Sandwich-norm decoder layer (four RMSNorms)."""

    def __init__(self, cfg: OuroConfig, layer_index: int) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = OuroAttention(cfg, layer_index)
        self.mlp = SwiGLU(h, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(h, eps)
        self.input_layernorm_2 = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm_2 = RMSNorm(h, eps)

    def forward(self, x: torch.Tensor, rope: Rope, ctx: AttentionContext) -> torch.Tensor:
        """One decoder layer on rows [N, H]."""
        x = x + self.input_layernorm_2(self.self_attn(self.input_layernorm(x), rope, ctx))
        return x + self.post_attention_layernorm_2(self.mlp(self.post_attention_layernorm(x)))


class OuroBody(nn.Module):
    """The `model.` prefix of the checkpoint."""

    def __init__(self, cfg: OuroConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(OuroDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.early_exit_gate = nn.Linear(cfg.hidden_size, 1, bias=True)


class OuroModel(LoopedModel):
    """Ouro's stage API over the original weight names (SPEC §9)."""

    def __init__(self, config: OuroConfig) -> None:
        super().__init__()
        self.config = config
        self.model = OuroBody(config)
        if not config.tie_word_embeddings:  # tied: the head reads embed_tokens, no lm_head.weight
            register_head(self, nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        self.info = ModelInfo(
            family="ouro",
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            default_depth=config.total_ut_steps,
            num_loop_kv_layers=config.num_hidden_layers,
            num_outer_kv_layers=0,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            max_model_len=config.max_position_embeddings,
            eos_token_ids=config.eos_token_ids,
            has_exit_gate=True,
            has_coda_signal=False,
        )

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        cfg = self.config
        return split_half_cos_sin(positions, cfg.head_dim, cfg.rope_theta, dtype)

    def embed(self, token_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """Token ids [N] → embeddings [N, H] (Ouro does not scale them)."""
        return self.model.embed_tokens(token_ids)

    def init_state(self, embedded: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        """Loop 1 starts from the embedding; noise is ignored."""
        return embedded

    def loop(
        self, state: torch.Tensor, embedded: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """All L decoder layers then `model.norm`."""
        rope = self._rope(positions, state.dtype)
        x = state
        for layer in self.model.layers:
            x = layer(x, rope, ctx)
        return self.model.norm(x)

    def exit_gate(self, state: torch.Tensor) -> torch.Tensor:
        """λ = sigmoid(early_exit_gate(state)) [N], in fp32 (float64 on float64 models)."""
        logit = self.model.early_exit_gate(state).squeeze(-1)
        return torch.sigmoid(logit.to(compute_dtype(state.dtype)))

    def coda(self, state: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """Identity: the loop's normed state is the head's input."""
        return state

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, V]."""
        return F.linear(hidden, head_weight(self, self.model.embed_tokens.weight))
