"""The dense reference: one request's generation computed straight from SPEC §3–§5.

No paging, no batching, no slots: every (position, loop) K/V is kept in a dict and every
query reads exactly the entries SPEC §4 names. It is the oracle of the batching tests, so
it stays short and literal. Positions run one at a time; loops of a position run in order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from protocol.messages import SamplingParams
from rlt_worker.models.base import LayerId, LoopedModel
from rlt_worker.philox import seed_to_int64, truncated_normal
from rlt_worker.sampler import SamplingTensors, sample


@dataclass
class ReferenceResult:
    token_ids: list[int] = field(default_factory=list)
    exit_depths: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "length"
    # (position, loop) → the (position, loop) K/V entries loop layer 0 read; loop 0 = outside the loop
    reads: dict[tuple[int, int], list[tuple[int, int]]] = field(default_factory=dict)


class DenseContext:
    """Attention over per-position per-loop K/V lists, for one query position at a time."""

    def __init__(self, kv_layout: str, record: dict | None) -> None:
        self.kv_layout = kv_layout
        self.loop_kv: dict[int, dict[int, dict[int, tuple]]] = {}  # layer → position → loop → (k, v)
        self.outer_kv: dict[int, dict[int, tuple]] = {}  # layer → position → (k, v)
        self.exit_depth: dict[int, int] = {}  # finished positions' e_s
        self.position = 0
        self.loop = 0
        self._record = record

    def at(self, position: int, loop: int) -> DenseContext:
        self.position, self.loop = position, loop
        return self

    def _loop_entries(self, layer: int) -> list[tuple[int, int]]:
        t, d = self.position, self.loop
        if self.kv_layout == "last_exited":
            earlier = [(s, min(d, self.exit_depth[s])) for s in range(t)]
        else:
            earlier = [(s, self.exit_depth[s]) for s in range(t)]
        return earlier + [(t, d)]

    def attend(self, layer: LayerId, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t = self.position
        if layer.in_loop:
            self.loop_kv.setdefault(layer.index, {}).setdefault(t, {})[self.loop] = (k[0], v[0])
            entries = self._loop_entries(layer.index)
            kvs = [self.loop_kv[layer.index][s][d] for s, d in entries]
            if self._record is not None and layer.index == 0:
                self._record[(t, self.loop)] = entries
        else:
            self.outer_kv.setdefault(layer.index, {})[t] = (k[0], v[0])
            kvs = [self.outer_kv[layer.index][s] for s in range(t + 1)]
        keys = torch.stack([kv[0] for kv in kvs])  # [T, Hkv, Dh]
        values = torch.stack([kv[1] for kv in kvs])
        group = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        compute = torch.float64 if q.dtype == torch.float64 else torch.float32
        scores = torch.einsum("hd,thd->ht", q[0].to(compute), keys.to(compute)) * q.shape[-1] ** -0.5
        out = torch.einsum("ht,thd->hd", torch.softmax(scores, dim=-1), values.to(compute))
        return out.to(q.dtype)[None]


@dataclass(frozen=True)
class ReferenceConfig:
    max_depth: int  # D
    kv_layout: str = "last_exited"
    exit_mode: str = "fixed"
    state_init: str = "random"
    eos_token_ids: tuple[int, ...] = ()


@torch.inference_mode()
def generate_reference(
    model: LoopedModel,
    prompt: list[int],
    params: SamplingParams,
    seed: int,
    config: ReferenceConfig,
    record_reads: bool = False,
) -> ReferenceResult:
    """Generate one request exactly as SPEC §3–§5 define it."""
    result = ReferenceResult()
    ctx = DenseContext(config.kv_layout, result.reads if record_reads else None)
    depth = config.max_depth
    for t, token in enumerate(prompt):
        state = _run_position(model, ctx, t, token, seed, config, params, exit_at=depth)
        _coda(model, ctx, t, state)  # Huginn keeps every prompt position's coda K/V
    for i in range(params.max_tokens):
        t = len(prompt) - 1 + i
        if i > 0:
            trace_depth = params.exit_depths[i] if config.exit_mode == "trace" else None
            state = _run_position(model, ctx, t, result.token_ids[-1], seed, config, params, exit_at=trace_depth)
        logits = _coda(model, ctx, t, state)
        token, logprob = _sample(logits, params, seed, i)
        if params.forced_tokens is not None:
            token, logprob = _forced(logits, params.forced_tokens[i])
        result.token_ids.append(token)
        result.exit_depths.append(ctx.exit_depth[t])
        result.logprobs.append(logprob)
        if token in params.stop_token_ids or (not params.ignore_eos and token in config.eos_token_ids):
            result.finish_reason = "stop"
            break
    return result


@torch.inference_mode()
def prompt_logits(model: LoopedModel, prompt: list[int], seed: int, config: ReferenceConfig) -> torch.Tensor:
    """Logits at the last prompt position after every prompt position ran D loops, [1, V]."""
    ctx = DenseContext(config.kv_layout, None)
    params = SamplingParams(max_tokens=1)
    for t, token in enumerate(prompt):
        state = _run_position(model, ctx, t, token, seed, config, params, exit_at=config.max_depth)
        logits = _coda(model, ctx, t, state)
    return logits


def _run_position(
    model: LoopedModel,
    ctx: DenseContext,
    t: int,
    token: int,
    seed: int,
    config: ReferenceConfig,
    params: SamplingParams,
    exit_at: int | None,
) -> torch.Tensor:
    """Embed `token` at position t and loop until the exit rule says stop; records e_t."""
    positions = torch.tensor([t])
    embedded = model.embed(torch.tensor([token]), positions, ctx.at(t, 0))
    noise = None
    if model.info.family == "huginn" and config.state_init == "random":
        noise = truncated_normal(torch.tensor([seed_to_int64(seed)]), positions, model.info.hidden_size)
    state = model.init_state(embedded, noise)
    max_loops = params.max_loops or config.max_depth
    threshold = params.exit_threshold
    remaining, prev_logp, delayed_exit = 1.0, None, None
    for d in range(1, config.max_depth + 1):
        previous = state
        state = model.loop(state, embedded, positions, ctx.at(t, d))
        if exit_at is not None:
            done = d == exit_at
        elif config.exit_mode == "fixed":
            done = d == max_loops
        elif config.exit_mode in ("ouro", "ouro_delayed"):
            remaining *= 1.0 - float(model.exit_gate(state)[0])
            thr = 1.0 if threshold is None else threshold
            passes = thr < 1.0 and d >= params.min_loops and 1.0 - remaining >= thr
            if config.exit_mode == "ouro_delayed" and passes and delayed_exit is None:
                delayed_exit = min(d + 1, max_loops)
            done = d >= max_loops or d == delayed_exit or (config.exit_mode == "ouro" and passes)
        else:  # kl / latent_diff
            thr = 0.0 if threshold is None else threshold
            if config.exit_mode == "kl":
                logp = torch.log_softmax(_coda(model, ctx, t, state).double(), dim=-1)[0]
                if prev_logp is None:
                    prev_logp = torch.full_like(logp, -math.log(logp.numel()))
                signal = float((prev_logp.exp() * (prev_logp - logp)).sum())
                prev_logp = logp
            else:
                signal = float((state - previous).double().norm() / state.double().norm())
            done = d >= max_loops or (d >= params.min_loops and signal < thr)
        if done:
            ctx.exit_depth[t] = d
            return state
    raise AssertionError("a position always exits by max_loops")


def _coda(model: LoopedModel, ctx: DenseContext, t: int, state: torch.Tensor) -> torch.Tensor:
    hidden = model.coda(state, torch.tensor([t]), ctx.at(t, 0))
    return model.lm_head(hidden)


def _forced(logits: torch.Tensor, token: int) -> tuple[int, float]:
    return token, float(torch.log_softmax(logits[0].double(), dim=-1)[token])


def _sample(logits: torch.Tensor, params: SamplingParams, seed: int, index: int) -> tuple[int, float]:
    tensors = SamplingTensors.build([params.temperature], [params.top_k], [params.top_p], [seed], [index])
    tokens, logprobs = sample(logits, tensors)
    return int(tokens[0]), float(logprobs[0])
