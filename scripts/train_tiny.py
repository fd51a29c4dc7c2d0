"""Train `tiny-ouro-py`: a small Ouro-architecture looped model on the Python standard library.

Two steps, so that the GPU machine needs only torch, numpy and safetensors:

    python scripts/train_tiny.py prepare [--data .train/tiny-ouro-py] [--vocab-size 4096]   # needs tokenizers
    python scripts/train_tiny.py train --data .train/tiny-ouro-py --out DIR [--device cuda] [--steps N]

`prepare` (rlt_engine/bench/prepared.py) reads this interpreter's standard library (tests,
encoding tables and pydoc data left out; files whose path hashes to 0 mod 50 held out) and, for
the training split only, the .py files of the installed distributions pyproject.toml names (each
up to 10 MB, no tests, no copy of a stdlib file; --stdlib-only leaves them out; see
rlt_engine/bench/corpus.py), cuts the training files' docstrings to their first paragraph
(--docstrings keep leaves them whole), with --documents definition splits them into documents at
their top-level definitions (rlt_engine/bench/training_text.py says why for both), trains a
byte-level BPE tokenizer on the training files only and writes the token ids, the tokenizer and
prepared.json (corpus SHA-256s, file lists, the distributions and their versions) into --data. The held-out
split is the stdlib's held-out files alone, so held-out numbers stay comparable across corpora.
`train` reads only that directory and writes config.json, model.safetensors (bfloat16),
tokenizer.json and training.json into --out.

The model is Ouro's (SPEC §9 names, so the ordinary loader reads it), D = 4 loops of one shared
block. At every loop the LM head gives a loss L_d and the exit gate a hazard λ_d; the exit
distribution is p_d = λ_d ∏_{j<d} (1 − λ_j) (the last loop takes the rest). Ouro's stage-1
objective is

    loss = Σ_d p_d L_d − β H(p)          (--exit-floor 0 --detach-gate 0)

whose entropy bonus is a KL to the uniform prior over exits. Trained that way the exit
distribution collapses onto loop 1 and loops 2–4 stay untrained (issue 20's first H200 run; see
ouro_objective and docs/benchmarks.md). The recipe here keeps the gate's part of that objective
and lets the uniform prior weigh the LM losses, at α = 1:

    loss = (1/D) Σ_d L_d  +  [Σ_d p_d sg(L_d) − β H(p)]    (--exit-floor 1 --detach-gate 1)

(sg: stop-gradient); --exit-floor α in between mixes the LM weights (1 − α) p_d + α / D
(--floor-shape depth: + α d / Σ d instead, square: + α d² / Σ d², cube: + α d³ / Σ d³, so deeper loops
get more of the floor). The default is α = 0.5, which beat α = 1 at loops 2–4 on the H200 (run 2,
docs/benchmarks.md).

Training windows start at line starts (--window-starts line, the default; `any`: at any token, as
runs 1 to 6 did; line_starts says why). Residual dropout (--dropout, train mode only) regularises
the many epochs the small corpus takes.
On CUDA: bf16 autocast, fused AdamW, torch.compile (falls back to eager if it fails), --max-seconds
as a safety stop that still evaluates and saves (--stop-after N repeats such a cut at step N).
Everything is seeded: on the CPU the same command
reproduces the loss bit for bit. On CUDA --deterministic 1 (the default) asks for deterministic
kernels, strictly in the loss step (flash attention's backward is deterministic only so); without
it, two seeded H200 runs ended 1.1% apart (run 3), and under warn_only alone 1.05% (run 6).
To size a GPU run, probe it: `train ... --steps 30 --log-every 5`
prints the time per step, tokens/s and ETA; scripts/gpu_train_tiny.sh probes and then runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from rlt_engine.bench.corpus import held_out_windows, read_site_packages, read_stdlib
from rlt_engine.bench.greedy import meets_target, report
from rlt_engine.bench.prepared import BOS, DOCSTRING_RULES, DOCUMENT_RULES, EOS, PAD, Prepared, load_prepared, prepare
from rlt_worker.models.config import load_config
from rlt_worker.models.loader import model_from_state_dict, save_checkpoint
from rlt_worker.models.toy import TOY_OURO_CONFIG

sys.path.insert(0, str(Path(__file__).resolve().parent))  # train_tiny_model.py, beside this script
from train_tiny_model import (  # noqa: E402
    FLOOR_SHAPES,
    add_residual_dropout,
    evaluate,
    exit_distribution,
    gate_stage_step,
    greedy_continuations,
    initial_weights,
    ouro_objective,
    per_loop_losses,
)

__all__ = ["exit_distribution", "greedy_continuations", "main", "ouro_objective", "per_loop_losses", "train"]

DEFAULT_DATA = ".train/tiny-ouro-py"


@dataclass(frozen=True)
class TrainConfig:
    hidden: int = 512
    layers: int = 3
    intermediate: int = 1024
    loops: int = 4
    context: int = 1024
    batch: int = 32
    steps: int = 2000
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.1
    dropout: float = 0.1
    beta: float = 0.05
    exit_floor: float = 0.5  # α: every loop gets ≥ α q_d of the LM loss weight (ouro_objective)
    floor_shape: str = "uniform"  # q: "uniform" (1/D), "depth" (d / Σ d), "square" (d²), "cube" (d³) (floor_prior)
    window_starts: str = "line"  # "line": each training window starts a line (WINDOW_STARTS); "any": any token
    detach_gate: bool = True  # the gate learns from detached losses; the LM weights are held constant
    seed: int = 0
    deterministic: bool = True  # CUDA: ask for deterministic kernels (runs 3 a and b, without, ended 1.1% apart)
    eval_windows: int = 40
    eval_every: int = 250
    greedy_tokens: int = 96
    gate_steps: int = 0  # the gate-only stage after training (0: none)
    gate_lr: float = 1e-3
    gate_sharpness: float = 50.0  # 1/nats
    gate_margin: float = 0.005  # nats


def model_config(cfg: TrainConfig, vocab_size: int) -> dict:
    """config.json of the trained model: toy-ouro's keys resized, 64-wide heads, half as many KV heads."""
    heads = cfg.hidden // 64
    return {
        **TOY_OURO_CONFIG,
        "hidden_size": cfg.hidden,
        "intermediate_size": cfg.intermediate,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "head_dim": 64,
        "vocab_size": vocab_size,
        "max_position_embeddings": cfg.context,
        "total_ut_steps": cfg.loops,
        "layer_types": ["full_attention"] * cfg.layers,
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "pad_token_id": PAD,
        "torch_dtype": "bfloat16",
    }


# --------------------------------------------------------------------------- training


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


class LossStep:
    """Forward and backward of one batch under the Ouro objective, through torch.compile when asked
    (auto: on CUDA). A compiler failure is reported (`compile` records it) and the same batch is run
    again eagerly, as is every later one."""

    def __init__(self, model, cfg: TrainConfig, device: str, compile_mode: str) -> None:
        self.model, self.beta, self.floor, self.detach_gate = model, cfg.beta, cfg.exit_floor, cfg.detach_gate
        self.floor_shape = cfg.floor_shape
        self.on_cuda = device.startswith("cuda")
        self.dtype = torch.bfloat16 if self.on_cuda else torch.float32
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if self.on_cuda
                         else torch.autocast("cpu", enabled=False))
        use = compile_mode == "on" or (compile_mode == "auto" and self.on_cuda)
        self.fn = torch.compile(self.eager, dynamic=False) if use else self.eager
        self.compile = {"asked": compile_mode, "used": use, "error": None}
        self.determinism = {"strict": cfg.deterministic and self.on_cuda, "relaxed_by": None}

    def eager(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        losses, hazards = per_loop_losses(self.model, tokens, self.dtype)
        return ouro_objective(losses, hazards, self.beta, self.floor, self.detach_gate, self.floor_shape)

    def __call__(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, expected loss) of the batch, its gradients accumulated into the parameters."""
        try:
            with self.strict_kernels(), self.autocast:
                loss, expected = self.fn(tokens)
                loss.backward()
        except Exception as exc:
            if self.relax(exc):
                return self(tokens)
            if self.fn == self.eager:
                raise
            self.compile.update(used=False, error=f"{type(exc).__name__}: {str(exc)[:500]}")
            print(f"torch.compile failed, continuing eagerly: {self.compile['error']}", flush=True)
            torch._dynamo.reset()
            self.fn = self.eager
            self.model.zero_grad(set_to_none=True)
            return self(tokens)
        return loss, expected

    @contextmanager
    def strict_kernels(self) -> Iterator[None]:
        """Determinism without warn_only while the step runs, when asked: flash attention's backward
        takes its deterministic variant only then (under warn_only it warns and keeps adding dq
        atomically, and run 6's pair differed at step 40 already). Evaluation and the optimizer stay
        under use_deterministic_kernels' warn_only."""
        if not self.determinism["strict"]:
            yield
            return
        torch.use_deterministic_algorithms(True)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(True, warn_only=True)

    def relax(self, exc: Exception) -> bool:
        """Whether `exc` is the strict step refusing an op with no deterministic variant; if so the
        steps run under warn_only from here on, the refusal is recorded in `determinism`, and the
        batch's partial gradients are dropped."""
        if not self.determinism["strict"] or "does not have a deterministic implementation" not in str(exc):
            return False
        self.determinism.update(strict=False, relaxed_by=str(exc)[:500])
        print(f"strict determinism refused an op; warn_only from here on: {self.determinism['relaxed_by']}",
              flush=True)
        self.model.zero_grad(set_to_none=True)
        return True


class Progress:
    """The log: a JSON row every `every` steps (loss, lr, step time, tokens/s, ETA), and the run's
    timing. The step time is the median over the intervals between log rows after the first step
    (which compiles), so neither the compile nor a slow warm-up interval skews it."""

    def __init__(self, cfg: TrainConfig, every: int) -> None:
        self.cfg, self.every = cfg, every
        self.marks = {"start": time.monotonic()}
        self.intervals: list[float] = []  # seconds per step of each interval
        self.history: list[dict] = []
        self._last = (0, 0.0)  # (step, time) of the last row

    def mark(self, name: str) -> None:
        self.marks[name] = time.monotonic()

    def elapsed(self) -> float:
        """Seconds since the first step began."""
        return time.monotonic() - self.marks["first_step"]

    def step_s(self) -> float | None:
        return float(np.median(self.intervals)) if self.intervals else None

    def due(self, done: int) -> bool:
        return done == 1 or done % self.every == 0 or done == self.cfg.steps

    def log(self, done: int, loss: torch.Tensor, expected: torch.Tensor, lr: float) -> None:
        row = {"step": done, "loss": round(loss.item(), 4), "expected_nats": round(expected.item(), 4),
               "lr": round(lr, 6)}  # .item() waits for the step, so the times below are the device's
        now = time.monotonic()
        if done == 1:
            self.marks["first_step_done"] = now
        else:
            self.intervals.append((now - self._last[1]) / (done - self._last[0]))
        self._last = (done, now)
        row["elapsed_s"] = round(now - self.marks["first_step"], 1)
        step_s = self.step_s()
        if step_s:
            row |= {"ms_per_step": round(step_s * 1e3, 1), "tokens_per_s": round(self.tokens_per_step / step_s),
                    "eta_s": round((self.cfg.steps - done) * step_s, 1)}
        self.history.append(row)
        print(json.dumps(row), flush=True)

    def paused(self) -> None:
        """Time since the last row (an evaluation) is not step time."""
        self._last = (self._last[0], time.monotonic())

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.batch * self.cfg.context

    def timing(self) -> dict:
        m, step_s = self.marks, self.step_s()
        return {"setup_s": round(m["first_step"] - m["start"], 1),
                "first_step_s": round(m.get("first_step_done", m["train_done"]) - m["first_step"], 1),
                "step_s": round(step_s, 5) if step_s else None,
                "tokens_per_s": round(self.tokens_per_step / step_s) if step_s else None,
                "train_s": round(m["train_done"] - m["first_step"], 1),
                "eval_s": round(m["eval_done"] - m["train_done"], 1)}


def new_model(cfg: TrainConfig, vocab_size: int, device: str):
    """(model, optimizer, config.json dict): seeded initial weights in float32, residual dropout, fused
    AdamW on CUDA (weight decay on matrices only)."""
    config = model_config(cfg, vocab_size)
    model = model_from_state_dict(load_config(config), initial_weights(config, cfg.seed), torch.float32, device)
    model.train().requires_grad_(True)
    add_residual_dropout(model, cfg.dropout)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.startswith("cuda"),
    )
    return model, optimizer, config


def early_stop(done: int, elapsed_s: float, max_seconds: float, stop_after: int | None) -> str | None:
    """Why the run ends before its schedule does, if it does. --stop-after ends it at a fixed step of the
    same cosine, so a run that --max-seconds cut (its step depends on the machine's speed) can be
    repeated exactly: the shipped checkpoint was cut by time at step 2,047 of 2,442."""
    if elapsed_s >= max_seconds:
        return f"--max-seconds {max_seconds:g} reached"
    if stop_after is not None and done >= stop_after:
        return f"--stop-after {stop_after} reached"
    return None


def train(cfg: TrainConfig, data: Prepared, device: str, compile_mode: str, max_seconds: float, log_every: int,
          stop_after: int | None = None):
    """(model, record): AdamW on windows drawn by a generator seeded with cfg.seed, bf16 autocast on CUDA."""
    progress = Progress(cfg, log_every)
    torch.manual_seed(cfg.seed)
    if cfg.deterministic and device.startswith("cuda"):
        use_deterministic_kernels()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    model, optimizer, config = new_model(cfg, data.vocab_size, device)
    step = LossStep(model, cfg, device, compile_mode)
    train_ids = torch.from_numpy(data.train.astype(np.int64)).to(device)
    offsets = torch.arange(cfg.context + 1, device=device)
    windows = torch.from_numpy(held_out_windows(data.held_out, cfg.context, cfg.eval_windows)).to(device)
    byte_counts = torch.from_numpy(data.byte_counts()).to(device)
    draw_starts = WINDOW_STARTS[cfg.window_starts](data, cfg.context, np.random.default_rng(cfg.seed))

    def next_batch() -> torch.Tensor:
        starts = torch.from_numpy(draw_starts(cfg.batch)).to(device)
        return train_ids[starts[:, None] + offsets]

    curve, stopped, done = [], None, 0
    progress.mark("first_step")
    for done in range(1, cfg.steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(done - 1, cfg)
        loss, expected = step(next_batch())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=step.on_cuda)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        reason = early_stop(done, progress.elapsed(), max_seconds, stop_after) if done < cfg.steps else None
        if progress.due(done) or reason:
            progress.log(done, loss, expected, lr_at(done - 1, cfg))
        if reason:
            stopped = {"at_step": done, "of_steps": cfg.steps, "reason": reason}
            print(f"stopping early: {stopped['reason']} after {done} of {cfg.steps} steps", flush=True)
            break
        if cfg.eval_every and done % cfg.eval_every == 0 and done < cfg.steps:
            with step.autocast:
                point = evaluate(model, windows, byte_counts, step.dtype, cfg.beta)
            curve.append({"step": done, "bpb_per_loop": point["bpb_per_loop"], "bpb_expected": point["bpb_expected"]})
            print(json.dumps({"held_out": curve[-1]}), flush=True)
            progress.paused()
    progress.mark("train_done")
    round_to_bf16(model)  # evaluate exactly the weights that ship
    gate_stage = train_gate(model, cfg, next_batch, step) if cfg.gate_steps else None
    round_to_bf16(model)
    with step.autocast:
        final = evaluate(model, windows, byte_counts, step.dtype, cfg.beta)
        greedy = greedy_continuations(model, data, cfg.greedy_tokens, device, step.dtype) if cfg.greedy_tokens else []
    progress.mark("eval_done")
    print(json.dumps({"held_out_eval": final}), flush=True)
    if greedy:
        print(report(greedy), flush=True)
    record = {
        "train_config": asdict(cfg), "model_config": config, "compile": step.compile,
        "determinism": step.determinism,
        "max_seconds": None if math.isinf(max_seconds) else max_seconds, "stop_after": stop_after,
        "stopped_early": stopped,
        "parameters": sum(p.numel() for p in model.parameters()),
        "steps_run": done, "tokens_seen": done * progress.tokens_per_step,
        "epochs": round(done * progress.tokens_per_step / len(data.train), 2),
        "timing": progress.timing(), "gate_stage": gate_stage, "held_out_eval": final, "held_out_curve": curve,
        "history": progress.history,
        "greedy": {"verdicts": [asdict(v) for v in greedy], "valid": sum(v.is_valid for v in greedy),
                   "target_met": meets_target(greedy) if greedy else None},
    }
    return model, record


def any_token_starts(data: Prepared, context: int, sampler: np.random.Generator) -> Callable[[int], np.ndarray]:
    """Window starts drawn uniformly over every token that leaves room for a whole window."""
    last = len(data.train) - context - 1
    return lambda count: sampler.integers(0, last, count)


def line_starts(data: Prepared, context: int, sampler: np.random.Generator) -> Callable[[int], np.ndarray]:
    """Window starts drawn uniformly over the tokens that start a line: those after a token whose text
    has a newline, or after a file's <eos>. Why: a prompt is the start of its text, and at a window's
    first token the model cannot see how deep the line is indented. From any token, the greedy `for`
    prompt at column 0 was continued at the indentation of a method body in runs 3 to 6; from line
    starts, a first token without leading whitespace means column 0 (the GPT-2 split keeps an indented
    line's last space on its first word)."""
    ends_line = np.array([piece is None or b"\n" in piece for piece in data.pieces])
    starts = np.flatnonzero(ends_line[data.train[: len(data.train) - context - 2]]) + 1
    return lambda count: starts[sampler.integers(0, len(starts), count)]


WINDOW_STARTS = {"line": line_starts, "any": any_token_starts}


def round_to_bf16(model) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())


def train_gate(model, cfg: TrainConfig, next_batch, step: LossStep) -> dict:
    """The gate-only stage: the language model frozen (and without dropout), AdamW on the exit gate
    alone for cfg.gate_steps batches of `gate_stage_loss`. It changes when tokens exit, not what
    any loop predicts."""
    gate = model.model.early_exit_gate
    model.eval().requires_grad_(False)
    gate.requires_grad_(True)
    optimizer = torch.optim.AdamW(gate.parameters(), lr=cfg.gate_lr, betas=(0.9, 0.95), weight_decay=0.0)
    losses = []
    for _ in range(cfg.gate_steps):
        with step.autocast:
            loss = gate_stage_step(model, next_batch(), step.dtype, cfg.gate_sharpness, cfg.gate_margin)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    model.train().requires_grad_(True)
    first, last = float(losses[0]), float(torch.stack(losses[-10:]).mean())
    print(json.dumps({"gate_stage": {"steps": cfg.gate_steps, "loss_first": round(first, 4),
                                     "loss_last10": round(last, 4)}}), flush=True)
    return {"steps": cfg.gate_steps, "loss_first": round(first, 4), "loss_last10": round(last, 4)}


def use_deterministic_kernels() -> None:
    """Deterministic CUDA kernels: eager ops take their deterministic variants (the embedding's backward
    sorts instead of adding atomically), Inductor falls back to them and skips autotuning, cuBLAS gets a
    fixed workspace. Runs 3 a and b, seeded alike without this, ended 1.1% apart (docs/benchmarks.md).
    warn_only: an op without a deterministic variant warns rather than ends the run. The loss step
    itself runs strict (LossStep.strict_kernels)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when the cuBLAS handle is made
    torch.use_deterministic_algorithms(True, warn_only=True)


def write_checkpoint(model, record: dict, data: Prepared, out: Path, device: str, argv: list[str]) -> None:
    """config.json, model.safetensors (bfloat16), the data's tokenizer.json and training.json."""
    save_checkpoint(model.to("cpu", torch.bfloat16), out, record["model_config"])
    shutil.copyfile(data.tokenizer_path, out / "tokenizer.json")
    weights = (out / "model.safetensors").read_bytes()
    meta = data.meta
    record = {
        **record,
        "command": ["scripts/train_tiny.py", *argv],
        "device": device, "device_name": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "torch": torch.__version__, "python": sys.version.split()[0],
        "corpus": meta["corpus"], "tokenizer": meta["tokenizer"],
        "data": {"train_tokens": meta["train_tokens"], "held_out_tokens": meta["held_out_tokens"]},
        "model_safetensors_sha256": hashlib.sha256(weights).hexdigest(),
        "model_safetensors_bytes": len(weights),
    }
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out} ({len(weights) / 1e6:.1f} MB of weights, {record['parameters'] / 1e6:.2f} M parameters)",
          flush=True)


def _flag(text: str) -> bool:
    if text.lower() not in ("0", "1", "false", "true", "no", "yes"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected 0/1, true/false or yes/no")
    return text.lower() in ("1", "true", "yes")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="corpus, tokenizer and token ids into --data (needs tokenizers)")
    prep.add_argument("--data", default=DEFAULT_DATA)
    prep.add_argument("--vocab-size", type=int, default=4096)
    prep.add_argument("--stdlib-only", action="store_true",
                      help="train on the standard library alone (no installed distributions' sources)")
    prep.add_argument("--docstrings", choices=tuple(DOCSTRING_RULES), default="summary",
                      help="the training split's docstrings: cut to their first paragraph, or kept whole "
                           "(rlt_engine/bench/training_text.py says why; held-out text is never cut)")
    prep.add_argument("--documents", choices=tuple(DOCUMENT_RULES), default="file",
                      help="the training split's documents, each ended by <eos>: whole files, or split at "
                           "top-level definitions (rlt_engine/bench/training_text.py)")
    run = commands.add_parser("train", help="train from --data, write the checkpoint into --out")
    run.add_argument("--data", default=DEFAULT_DATA)
    run.add_argument("--out", required=True, help="checkpoint directory to write")
    run.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    run.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    run.add_argument("--log-every", type=int, default=50)
    run.add_argument("--compile", choices=("auto", "on", "off"), default="auto", help="torch.compile (auto: on CUDA)")
    run.add_argument("--max-seconds", type=float, default=math.inf,
                     help="stop and save once training (from the first step) has run this long")
    run.add_argument("--stop-after", type=int, default=None,
                     help="stop and save after this many steps of the --steps schedule (repeats a time-cut run)")
    for field, default in asdict(TrainConfig()).items():
        kind = _flag if isinstance(default, bool) else type(default)
        choices = {"floor_shape": FLOOR_SHAPES, "window_starts": tuple(WINDOW_STARTS)}.get(field)
        run.add_argument(f"--{field.replace('_', '-')}", type=kind, default=default, choices=choices)
    args = parser.parse_args(argv)
    if args.command == "prepare":
        stdlib = read_stdlib()
        data = prepare(args.data, args.vocab_size, stdlib, None if args.stdlib_only else read_site_packages(stdlib),
                       args.docstrings, args.documents)
        print(f"wrote {args.data}: {len(data.train):,} training tokens, {len(data.held_out):,} held out, "
              f"vocab {data.vocab_size}, corpus sha256 {data.meta['corpus']['sha256']}")
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = TrainConfig(**{f: getattr(args, f) for f in asdict(TrainConfig())})
    data = load_prepared(args.data)
    print(f"data: {len(data.train):,} training tokens, {len(data.held_out):,} held out, vocab {data.vocab_size}, "
          f"corpus sha256 {data.meta['corpus']['sha256'][:16]}…; {cfg.steps} steps × {cfg.batch} × {cfg.context} "
          f"= {cfg.steps * cfg.batch * cfg.context / len(data.train):.1f} epochs", flush=True)
    if args.stop_after is not None and not 1 <= args.stop_after <= cfg.steps:
        parser.error(f"--stop-after {args.stop_after}: expected a step from 1 to --steps ({cfg.steps})")
    model, record = train(cfg, data, args.device, args.compile, args.max_seconds, args.log_every, args.stop_after)
    write_checkpoint(model, record, data, Path(args.out), args.device, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
