"""Train `tiny-ouro-py`: a small Ouro-architecture looped model on the Python standard library.

    python scripts/train_tiny.py --out rlt_engine/checkpoints/tiny-ouro-py [--device cuda]

The text is the standard library of the interpreter that runs this script (tests, encoding
tables and pydoc data left out); the file list, its SHA-256 and the Python version go into
`training.json` beside the checkpoint. Files whose path hashes to 0 mod 50 are held out.

The model is Ouro's (SPEC §9 names, so the ordinary loader reads it): byte vocabulary with
<bos> <eos> <pad> above it, D = 4 loops of one shared block. Training is Ouro's stage-1
objective: at every loop the LM head gives a loss L_d and the exit gate a hazard λ_d; the exit
distribution p_d = λ_d ∏_{j<d} (1 − λ_j) (the last loop takes the rest) weighs the losses, and
an entropy bonus keeps the gate from collapsing onto one depth:

    loss = Σ_d p_d L_d − β H(p)

Everything is seeded: the same command on the same device class reproduces the loss.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from rlt_engine.bench.corpus import Corpus, held_out_windows, load_corpus
from rlt_worker.models.base import LayerId
from rlt_worker.models.config import load_config
from rlt_worker.models.loader import build_model, model_from_state_dict, save_checkpoint
from rlt_worker.models.toy import TOY_OURO_CONFIG


def model_config(hidden: int, layers: int, loops: int, context: int) -> dict:
    """config.json of the trained model: toy-ouro's (byte vocabulary, special ids, Ouro keys) resized."""
    heads = hidden // 64
    return {
        **TOY_OURO_CONFIG,
        "hidden_size": hidden,
        "intermediate_size": 3 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "head_dim": 64,
        "max_position_embeddings": context,
        "total_ut_steps": loops,
        "layer_types": ["full_attention"] * layers,
    }


# --------------------------------------------------------------------------- model


class CausalContext:
    """Dense causal attention over [batch, length] rows, for training: every loop attends to the
    same loop's K/V of earlier positions, which is what both KV layouts read when every
    position runs all D loops."""

    def __init__(self, batch: int, length: int) -> None:
        self.batch, self.length = batch, length

    def attend(self, layer: LayerId, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, t = self.batch, self.length
        q, k, v = (x.view(b, t, x.shape[1], x.shape[2]).transpose(1, 2) for x in (q, k, v))
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).reshape(b * t, q.shape[1], q.shape[3])


def per_loop_losses(model, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy per loop [D, B, T] (nats) and exit hazards λ [D, B, T] for next-token targets."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    b, t = inputs.shape
    ctx = CausalContext(b, t)
    positions = torch.arange(t, device=tokens.device).repeat(b)
    embedded = model.embed(inputs.reshape(-1), positions, ctx)
    state = model.init_state(embedded, None)
    losses, hazards = [], []
    for _ in range(model.info.default_depth):
        state = model.loop(state, embedded, positions, ctx)
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


def ouro_objective(losses: torch.Tensor, hazards: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(training loss, expected loss under the exit distribution) — both means over tokens."""
    p = exit_distribution(hazards)
    expected = (p * losses).sum(0).mean()
    entropy = -(p * torch.log(p.clamp_min(1e-9))).sum(0).mean()
    return expected - beta * entropy, expected


# --------------------------------------------------------------------------- training


@dataclass(frozen=True)
class TrainConfig:
    hidden: int = 256
    layers: int = 4
    loops: int = 4
    context: int = 256
    batch: int = 16
    steps: int = 500
    lr: float = 3e-3
    warmup: int = 50
    weight_decay: float = 0.1
    beta: float = 0.05
    seed: int = 0
    eval_windows: int = 64


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


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


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, beta: float) -> dict:
    """Bits per byte at each fixed depth and under the exit distribution, on the held-out windows."""
    model.eval()
    losses, hazards = [], []
    for chunk in windows.split(16):
        loss, hazard = per_loop_losses(model, chunk)
        losses.append(loss)
        hazards.append(hazard)
    model.train()
    loss, hazard = torch.cat(losses, 1), torch.cat(hazards, 1)
    _, expected = ouro_objective(loss, hazard, beta)
    p = exit_distribution(hazard)
    depths = torch.arange(1, loss.shape[0] + 1, dtype=p.dtype, device=p.device)[:, None, None]
    to_bits = 1 / math.log(2)
    return {
        "bpb_per_loop": [round(float(x) * to_bits, 4) for x in loss.mean((1, 2))],
        "bpb_expected": round(float(expected) * to_bits, 4),
        "mean_exit_loops": round(float((p * depths).sum(0).mean()), 3),
    }


def train(cfg: TrainConfig, device: str, corpus: Corpus, log_every: int) -> tuple[torch.nn.Module, dict, list]:
    """(trained model, held-out evaluation, logged history): AdamW on random training windows
    drawn by a generator seeded with cfg.seed, bf16 autocast on CUDA, float32 on the CPU."""
    torch.manual_seed(cfg.seed)
    config = model_config(cfg.hidden, cfg.layers, cfg.loops, cfg.context)
    model = model_from_state_dict(load_config(config), initial_weights(config, cfg.seed), torch.float32, device)
    model.train().requires_grad_(True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    sampler = np.random.default_rng(cfg.seed)
    windows = torch.from_numpy(held_out_windows(corpus.held_out, cfg.context, cfg.eval_windows)).to(device)
    history = []
    start = time.monotonic()
    on_cuda = device.startswith("cuda")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if on_cuda else torch.autocast("cpu", enabled=False)
    for step in range(cfg.steps):
        starts = sampler.integers(0, len(corpus.train) - cfg.context - 1, cfg.batch)
        batch = np.stack([corpus.train[s : s + cfg.context + 1] for s in starts]).astype(np.int64)
        tokens = torch.from_numpy(batch).to(device)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        with autocast:
            losses, hazards = per_loop_losses(model, tokens)
            loss, expected = ouro_objective(losses, hazards, cfg.beta)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % log_every == 0 or step == cfg.steps - 1:
            row = {"step": step, "loss": round(loss.item(), 4), "expected_bpb": round(expected.item() / math.log(2), 4),
                   "elapsed_s": round(time.monotonic() - start, 1)}
            history.append(row)
            print(json.dumps(row), flush=True)
    with autocast:
        final = evaluate(model, windows, cfg.beta)
    final["train_seconds"] = round(time.monotonic() - start, 1)
    return model, final, history


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="checkpoint directory to write")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    parser.add_argument("--log-every", type=int, default=50)
    for field, default in asdict(TrainConfig()).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(default), default=default)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = TrainConfig(**{f: getattr(args, f) for f in asdict(TrainConfig())})
    corpus = load_corpus()
    print(f"corpus: {len(corpus.files)} files, {len(corpus.train):,} train bytes, {len(corpus.held_out):,} held out, "
          f"sha256 {corpus.sha256[:16]}…", flush=True)
    model, final, history = train(cfg, args.device, corpus, args.log_every)
    print(json.dumps(final), flush=True)
    out = Path(args.out)
    save_checkpoint(model.to("cpu"), out)
    write_tokenizer(out / "tokenizer.json")
    weights = (out / "model.safetensors").read_bytes()
    record = {
        "train_config": asdict(cfg),
        "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "corpus": {"files": corpus.files, "sha256": corpus.sha256, "train_bytes": int(len(corpus.train)),
                   "held_out_bytes": int(len(corpus.held_out)), "held_out_rule": corpus.held_out_rule},
        "held_out_eval": final,
        "history": history,
        "model_safetensors_sha256": hashlib.sha256(weights).hexdigest(),
    }
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out} ({len(weights) / 1e6:.1f} MB of weights)")
    return 0


def write_tokenizer(path: Path) -> None:
    """A `tokenizers` tokenizer.json whose ids are the bytes themselves, with <bos> <eos> <pad> at 256–258."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = _bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in ("<bos>", "<eos>", "<pad>")])
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for every byte (what the ByteLevel pre-tokenizer emits)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


if __name__ == "__main__":
    sys.exit(main())
