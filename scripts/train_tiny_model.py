"""The model side of `scripts/train_tiny.py`: dense causal attention for training, per-loop losses,
the Ouro objective, seeded initial weights, residual dropout, the held-out evaluation and the
greedy check run by the model itself (so the GPU machine needs neither the engine nor `tokenizers`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from rlt_engine.bench.greedy import judge
from rlt_engine.bench.prepared import Prepared
from rlt_worker.models.base import LayerId
from rlt_worker.models.config import load_config
from rlt_worker.models.loader import build_model


class CausalContext:
    """Dense causal attention over [batch, length] rows, for training: every loop attends to the
    same loop's K/V of earlier positions, which is what both KV layouts read when every
    position runs all D loops. q, k, v go to the attention kernel in `dtype` (bf16 on CUDA)."""

    def __init__(self, batch: int, length: int, dtype: torch.dtype) -> None:
        self.batch, self.length, self.dtype = batch, length, dtype

    def attend(self, layer: LayerId, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, t = self.batch, self.length
        q, k, v = (x.to(self.dtype).view(b, t, x.shape[1], x.shape[2]).transpose(1, 2) for x in (q, k, v))
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).reshape(b * t, q.shape[1], q.shape[3])


def loop_states(model, inputs: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    """The normed state after each of the D loops, [B·T, H] each, for token ids [B, T]."""
    b, t = inputs.shape
    ctx = CausalContext(b, t, dtype)
    positions = torch.arange(t, device=inputs.device).repeat(b)
    embedded = model.embed(inputs.reshape(-1), positions, ctx)
    state, states = model.init_state(embedded, None), []
    for _ in range(model.info.default_depth):
        state = model.loop(state, embedded, positions, ctx)
        states.append(state)
    return states


def per_loop_losses(model, tokens: torch.Tensor, dtype: torch.dtype = torch.float32):
    """Cross-entropy per loop [D, B, T] (nats) and exit hazards λ [D, B, T] for next-token targets."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    b, t = inputs.shape
    losses, hazards = [], []
    for state in loop_states(model, inputs, dtype):
        logits = model.lm_head(state).float()
        losses.append(F.cross_entropy(logits, targets.reshape(-1), reduction="none").view(b, t))
        hazards.append(model.exit_gate(state).float().view(b, t))
    return torch.stack(losses), torch.stack(hazards)


def exit_distribution(hazards: torch.Tensor) -> torch.Tensor:
    """p_d = λ_d ∏_{j<d} (1 − λ_j) for d < D; the last loop takes what remains. [D, B, T]."""
    survive = torch.cumprod(1.0 - hazards, dim=0)
    before = torch.cat([torch.ones_like(survive[:1]), survive[:-1]])
    exits = before * hazards
    return torch.cat([exits[:-1], before[-1:]])


FLOOR_SHAPES = ("uniform", "depth", "square", "cube")  # d to the power of the index


def floor_prior(depth: int, shape: str, like: torch.Tensor) -> torch.Tensor:
    """The floor's share per loop, [D, 1, 1], summing to 1: uniform 1/D, depth d / Σ d, square d² / Σ d²
    or cube d³ / Σ d³ (a deeper loop gets more of the LM weight, so the last loop, which the exit
    distribution weighs least when the gate exits early, still gets the most: runs 2 and 3 ended with
    loop 4 0.1–0.5% above loop 3 under uniform, run 4 0.07% above under depth, run 7 0.34% above under
    square)."""
    if shape not in FLOOR_SHAPES:
        raise ValueError(f"floor shape {shape!r}: expected one of {', '.join(FLOOR_SHAPES)}")
    d = torch.arange(1, depth + 1, dtype=like.dtype, device=like.device)
    share = d ** FLOOR_SHAPES.index(shape)
    return (share / share.sum()).view(depth, *([1] * (like.dim() - 1)))


def ouro_objective(losses: torch.Tensor, hazards: torch.Tensor, beta: float, floor: float = 0.0,
                   detach_gate: bool = False, floor_shape: str = "uniform") -> tuple[torch.Tensor, torch.Tensor]:
    """(training loss, expected loss Σ p_d L_d under the exit distribution) — both means over tokens.

    floor = 0, detach_gate = False is Ouro's stage-1 objective Σ_d p_d L_d − β H(p) (H(p) = log D −
    KL(p ‖ uniform): the entropy bonus is the paper's uniform prior over exits). Its one p does two
    jobs: it weighs the LM losses and it is what the gate learns. At the optimum p_d ∝ exp(−L_d / β)
    per token, so with β = 0.05 a loop that leads by 0.1 nat takes e² ≈ 7× the weight of the next; the
    gate starts near λ = 0.5, i.e. p = (½, ¼, ⅛, ⅛), so loop 1 leads from step 0, the deeper loops get
    little gradient, fall behind and get less still: the exit distribution collapses onto loop 1 and
    loops 2–D stay untrained (issue 20's first H200 run: mean exit 1.15 loops, loop 4 worst).

    floor = α gives every loop at least α q_d of the LM weight: w_d = (1 − α) p_d + α q_d, q the
    floor's prior (floor_prior: uniform 1/D, so α = 1 trains every exit equally, or ∝ d). detach_gate = True
    separates the two jobs: the LM is trained on Σ w_d L_d with w held constant, and the gate on
    Ouro's objective over the detached losses, Σ p_d sg(L_d) − β H(p), so the gate learns where the
    loss is low without steering which loops the LM trains. The returned training loss is the sum
    of both parts (its gradient is what each part's parameters receive)."""
    p = exit_distribution(hazards)
    depth = losses.shape[0]
    expected = (p * losses).sum(0).mean()
    entropy = -(p * torch.log(p.clamp_min(1e-9))).sum(0).mean()
    if not detach_gate:
        weights = p if floor == 0 else (1 - floor) * p + floor * floor_prior(depth, floor_shape, losses)
        return (weights * losses).sum(0).mean() - beta * entropy, expected
    weights = (1 - floor) * p.detach() + floor * floor_prior(depth, floor_shape, losses)
    lm = (weights * losses).sum(0).mean()
    gate = (p * losses.detach()).sum(0).mean() - beta * entropy
    return lm + gate, expected


def initial_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Seeded initial weights: normal(0, 1/√fan_in) matrices, unit norms, a gate that starts near λ = 0.5."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in build_model(load_config(config)).state_dict().items():
        if name.endswith("norm.weight") or "layernorm" in name:
            state[name] = torch.ones(tensor.shape)
        elif name == "model.early_exit_gate.bias":
            state[name] = torch.zeros(tensor.shape)
        elif name == "model.embed_tokens.weight":
            state[name] = torch.randn(tensor.shape, generator=generator)
        else:
            std = 1.0 / math.sqrt(tensor.shape[-1])
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                std /= math.sqrt(2 * config["num_hidden_layers"] * config["total_ut_steps"])
            state[name] = torch.randn(tensor.shape, generator=generator) * std
    return state


def add_residual_dropout(model, p: float) -> None:
    """Dropout on each residual branch (the outputs of input_layernorm_2 and post_attention_layernorm_2,
    just before their add), active only in train mode; the saved weights are unchanged by it."""
    if p <= 0:
        return
    for layer in model.model.layers:
        for norm in (layer.input_layernorm_2, layer.post_attention_layernorm_2):
            norm.register_forward_hook(lambda module, args, out: F.dropout(out, p, module.training))


# --------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, byte_counts: torch.Tensor, dtype: torch.dtype, beta: float) -> dict:
    """Held-out bits per byte (nats / (ln 2 · bytes of the target tokens)) at each fixed depth and
    under the exit distribution, and nats per token."""
    was_training = model.training
    model.eval()
    losses, hazards = [], []
    for chunk in windows.split(8):
        loss, hazard = per_loop_losses(model, chunk, dtype)
        losses.append(loss)
        hazards.append(hazard)
    model.train(was_training)
    loss, hazard = torch.cat(losses, 1), torch.cat(hazards, 1)
    _, expected = ouro_objective(loss, hazard, beta)
    p = exit_distribution(hazard)
    depths = torch.arange(1, loss.shape[0] + 1, dtype=p.dtype, device=p.device)[:, None, None]
    num_bytes = int(byte_counts[windows[:, 1:]].sum())
    num_tokens = loss.shape[1] * loss.shape[2]
    to_bpb = num_tokens / (math.log(2) * num_bytes)
    return {
        "bpb_per_loop": [round(float(x) * to_bpb, 4) for x in loss.mean((1, 2))],
        "bpb_expected": round(float(expected) * to_bpb, 4),
        "nats_per_token_per_loop": [round(float(x), 4) for x in loss.mean((1, 2))],
        "mean_exit_loops": round(float((p * depths).sum(0).mean()), 3),
        "gate_sweep": [{"threshold": t, **threshold_exit(loss, p, t, to_bpb)} for t in SWEEP_THRESHOLDS],
        "windows": int(windows.shape[0]), "scored_tokens": num_tokens, "scored_bytes": num_bytes,
    }


SWEEP_THRESHOLDS = (0.3, 0.5, 0.7, 0.8, 0.9, 0.95)


def threshold_exit(losses: torch.Tensor, p: torch.Tensor, threshold: float, to_bpb: float) -> dict:
    """Bits per byte and mean loops when each token exits at the first loop whose exit CDF reaches
    `threshold` (the engine's `ouro` rule), read off the dense all-loops pass: a preview of
    `rlt-bench quality`, whose exited tokens' deeper K/V are copies (LAST_EXITED), not recomputed."""
    exit_index = (p.cumsum(0) < threshold).sum(0).clamp_max(losses.shape[0] - 1)  # [B, T], loop − 1
    chosen = losses.gather(0, exit_index[None]).squeeze(0)
    return {"bpb": round(float(chosen.mean()) * to_bpb, 4),
            "mean_loops": round(float(exit_index.float().mean()) + 1, 3)}


def gate_stage_step(model, tokens: torch.Tensor, dtype: torch.dtype, sharpness: float, margin: float) -> torch.Tensor:
    """`gate_stage_loss` of one batch: the loops and LM head without gradients, the gate with them."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:].reshape(-1)
    with torch.no_grad():
        states = loop_states(model, inputs, dtype)
        losses = torch.stack([F.cross_entropy(model.lm_head(s).float(), targets, reduction="none") for s in states])
    hazards = torch.stack([model.exit_gate(s).float() for s in states])
    return gate_stage_loss(losses, hazards, sharpness, margin)


def gate_stage_loss(losses: torch.Tensor, hazards: torch.Tensor, sharpness: float, margin: float) -> torch.Tensor:
    """The gate-only stage's loss (after the Ouro paper's second stage): at each loop d < D the gate
    should exit when loop d + 1 would improve the token's loss by less than `margin` nats. Target
    exit probability y_d = σ(sharpness · (margin − (L_d − L_{d+1}))), losses detached; binary
    cross-entropy of λ_d against y_d, mean over loops d < D and tokens."""
    improvement = (losses[:-1] - losses[1:]).detach()
    target = torch.sigmoid(sharpness * (margin - improvement))
    exit_p = hazards[:-1].float().clamp(1e-6, 1 - 1e-6)  # written out: F.binary_cross_entropy refuses autocast
    return -(target * exit_p.log() + (1 - target) * (1 - exit_p).log()).mean()


@torch.no_grad()
def greedy_continuations(model, data: Prepared, max_tokens: int, device: str, dtype: torch.dtype) -> list:
    """The greedy check's prompts continued at full depth by this model directly (no engine, no
    `tokenizers`: the prompts' ids come from prepared.json, the text from the tokenizer's pieces)."""
    model.eval()
    verdicts = []
    for prompt in data.meta["greedy_prompts"]:
        ids, new, ended = list(prompt["ids"]), [], False
        while len(new) < max_tokens and len(ids) < model.info.max_model_len:
            state = loop_states(model, torch.tensor([ids], device=device), dtype)[-1]
            token = int(model.lm_head(state[-1:]).float().argmax())
            if token in model.info.eos_token_ids:
                ended = True
                break
            ids.append(token)
            new.append(token)
        verdicts.append(judge(prompt["text"], data.decode(new), ended))
    return verdicts
