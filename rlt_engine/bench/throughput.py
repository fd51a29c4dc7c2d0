"""rlt-bench throughput: closed-loop generation throughput and latency of one engine configuration grid.

For every (workers, exit mode) an engine is built once; for every concurrency c a closed loop keeps
c requests in flight until 2·c (`--requests-factor`) have been submitted, each with a
`--prompt-len`-token random prompt and exactly `--output-len` output tokens (`ignore_eos`, greedy).

    exit fixed   every generated position runs D loops
    exit trace   a fixed seeded mix of depths 1 … D after the first token, mean `--trace-mean`
                 (default: uniform, (D + 1) / 2)
    exit ouro    Ouro's gate decides, at `--ouro-threshold` (the synthetic model's gate gives a
                 mean near 2.5 loops per generated token at the default; the measured mean is
                 reported)
    exit kl      Huginn: the KL between successive loops' next-token distributions decides, at
                 `--kl-threshold` (the CODA runs after every loop: its bytes count in the floor)
    exit latent_diff  Huginn: the relative change of the state decides, at `--latent-threshold`
    exit prefill one output token per request (exit fixed): prompt tokens/s and time to first
                 token (not in the default list; `--exit prefill --resume` adds it to a grid's JSON)
    exit shared_prefix_cached, shared_prefix_uncached
                 every prompt starts with the same `--shared-prefix-len` tokens (the rest of
                 `--prompt-len` is its own), exit fixed, with prefix caching on or off; each run
                 starts with a cold cache and reports its hit ratio (not in the default list)
    exit fixed_mixed, trace_mixed, ouro_mixed, kl_mixed, latent_diff_mixed
    exit fixed_separate, trace_separate, ouro_separate, kl_separate, latent_diff_separate
                 the workload without the suffix on an engine with `mixed_batches` on (prompt chunks
                 ride the decode rows' loop passes) or off (they run passes of their own), so one grid
                 compares tokens/s and ITL p50/p99 with mixing on and off; without a suffix the
                 engine's default holds (on with CUDA graphs for fixed, trace, ouro and ouro_delayed)
                 (not in the default list)
    exit fixed_uncapped, trace_uncapped, ouro_uncapped, kl_uncapped, latent_diff_uncapped
                 the workload without the suffix on an engine with max_prefill_tokens_while_decoding
                 = 0 (a step carries prompt tokens up to max_num_batched_tokens while others decode),
                 so one grid compares ITL p50/p99, tokens/s and TTFT with the cap
                 (`--max-prefill-tokens-while-decoding`, default the engine's) and without (not in
                 the default list; the end of the run prints each pair side by side)
    exit shallow every generated position at depth 1 (exit trace): with fixed beside it, the
                 per-loop cost at each (workers, c), from which the end of the run prints how much of
                 the ideal speed-up over fixed the trace run reached (not in the default list)
    exit ouro_replay, kl_replay, latent_diff_replay
                 exit trace, each request replaying the exit depths that the workload without the
                 suffix gave it earlier in the same invocation (same workers, c and prompts): the
                 gate's decisions' cost is the ratio of the two, printed at the end (list the gate
                 workload first; not in the default list)

Before an engine is timed, the configuration is gated (`--gate`, see rlt_engine/bench/gate.py):
the same engine configuration built in float32 must give the torch path's tokens and exit depths
on 8 requests of mixed prompt lengths (an engine that fails is reported, not timed); the timed
engine (bf16) then runs them too, and where it parts from the float32 reference is reported.

Reported per configuration (median over `--repeats` timed runs after an untimed warm-up):
output tokens/s, TTFT p50, ITL p50/p99, mean loops per output token, peak GPU memory, and at
concurrency 1 the ratio of the time per token (ITL p50) to the HBM floor: the bytes one token
must read (loop weights × loops, K/V of the context × loops, LM head) ÷ `--hbm-tbps`.

Each configuration's timed runs stop at `--max-seconds` (a run cut short is aborted and reported
as partial; medians use the complete runs when there is one), and the whole grid shares
`--total-seconds`: each configuration gets a share of what is left, weighted 1 + log2(c)/7.

    rlt-bench throughput                                 # Ouro-1.4B shape, bf16 on CUDA, the full grid
    rlt-bench throughput --model synthetic-huginn-3.5b   # Huginn-0125 shape: its own defaults (see FAMILY_DEFAULTS)
    rlt-bench throughput --json grid.json --resume       # finish a grid an earlier call left unfinished
    rlt-bench throughput --model toy-ouro --device cpu --prompt-len 16 --output-len 8 --concurrency 1,4
    rlt-bench throughput --exit shared_prefix_cached,shared_prefix_uncached --prompt-len 1024 \
        --shared-prefix-len 960 --output-len 32 --concurrency 64 --requests-factor 1   # issue 21's workload
    rlt-bench throughput --exit trace_separate,trace,ouro_separate,ouro --concurrency 32 --workers 0   # mixing off / on
    rlt-bench throughput --exit trace,trace_uncapped --concurrency 32 --workers 0   # prefill cap on / off
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import random
import statistics
import sys
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from protocol.messages import SamplingParams
from rlt_engine.bench import gate
from rlt_engine.bench.report import free_device, log, pyplot

HBM_TBPS = 4.3  # H200 device-to-device copy rate measured here (KINDS.md), bytes read + written
DECODE_WORKLOADS = ("fixed", "trace", "ouro", "kl", "latent_diff")
MIXED = "_mixed"  # a decode workload's name + this: the same with mixed_batches on (ouro_mixed, …)
SEPARATE = "_separate"  # … the same with mixed_batches off (trace_separate, …)
UNCAPPED = "_uncapped"  # … the same with max_prefill_tokens_while_decoding = 0 (trace_uncapped, …)
GATE_WORKLOADS = ("ouro", "kl", "latent_diff")  # exits decided by a signal of the model
# A gate workload's name + this: trace, each request replaying the exit depths the gate workload gave
# it in the same invocation (same workers, concurrency and prompts): what the gate's decisions cost.
REPLAY = "_replay"
SHALLOW = "shallow"  # trace at depth 1 after output 0: with fixed, the per-loop cost of a grid's (workers, c)
WORKLOADS = (*DECODE_WORKLOADS, SHALLOW, "prefill", "shared_prefix_cached", "shared_prefix_uncached",
             *(mode + suffix for suffix in (MIXED, SEPARATE, UNCAPPED) for mode in DECODE_WORKLOADS),
             *(mode + REPLAY for mode in GATE_WORKLOADS))
SHARED_PREFIX = ("shared_prefix_cached", "shared_prefix_uncached")  # exit fixed, prefix caching on / off
OURO_THRESHOLD = 0.63  # see --ouro-threshold: 0.6 gave 2.36 and 0.7 2.80 loops (docs/benchmarks.md)
# synthetic-huginn-3.5b: about 15 and 14 loops per position in the CPU check of
# rlt_worker/models/synthetic.py (bf16, dense); to be calibrated on the GPU (docs/benchmarks.md).
KL_THRESHOLD = 1e-2
LATENT_THRESHOLD = 0.05
# What the flags left unset mean, by model family: the grids the issues ask for.
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "ouro": {"exit": ["fixed", "trace", "ouro"], "prompt_len": 1024, "concurrency": [1, 32, 128]},
    "huginn_raven": {"exit": ["fixed", "trace", "kl"], "prompt_len": 512, "concurrency": [1, 8, 32]},
}

# ---------------------------------------------------------------------------- workload


def _csv_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def depth_weights(depth: int, mean: float) -> list[float]:
    """Probabilities of depths 1 … D with the given mean: p_k ∝ exp(β·k), β found by bisection (β = 0: uniform)."""
    if not 1 <= mean <= depth:
        raise ValueError(f"trace mean {mean} is outside 1 … {depth}")

    def weights(beta: float) -> list[float]:
        top = depth if beta >= 0 else 1  # the most likely depth: every exponent is ≤ 0
        raw = [math.exp(beta * (k - top)) for k in range(1, depth + 1)]
        total = sum(raw)
        return [w / total for w in raw]

    def mean_of(beta: float) -> float:
        return sum(k * w for k, w in zip(range(1, depth + 1), weights(beta), strict=True))

    lo, hi = -50.0, 50.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean_of(mid) < mean else (lo, mid)
    return weights((lo + hi) / 2)


@dataclass(frozen=True)
class Job:
    prompt: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class Workload:
    """What every request of a run asks for, besides its prompt."""

    output_len: int
    exit_mode: str  # fixed | trace | ouro | kl | latent_diff
    depth: int  # D
    trace_mean: float | None = None  # None: uniform over 1 … D
    threshold: float | None = None  # every request's exit_threshold (ouro, kl, latent_diff)
    shared_prefix_len: int = 0  # leading prompt tokens every request has in common
    replayed_depths: Sequence[Sequence[int]] | None = None  # trace: request i's exit depths (else the seeded mix)


def make_jobs(n: int, prompt_lens: int | Sequence[int], vocab: int, work: Workload, seed: int) -> list[Job]:
    """n requests of `prompt_lens` tokens (one length, or one per request); the same seed gives the
    same prompts, trace depths and request seeds (Huginn's random state init) in every run."""
    rng = random.Random(seed)
    lens = [prompt_lens] * n if isinstance(prompt_lens, int) else list(prompt_lens)
    weights = None
    if work.exit_mode == "trace":
        mean = (work.depth + 1) / 2 if work.trace_mean is None else work.trace_mean
        weights = depth_weights(work.depth, mean)
    shared = [rng.randrange(vocab) for _ in range(work.shared_prefix_len)]
    jobs = []
    for i, prompt_len in enumerate(lens):
        prompt = shared[:prompt_len] + [rng.randrange(vocab) for _ in range(prompt_len - len(shared))]
        # An explicit seed, so that every engine draws the same state-init noise for the request.
        options: dict[str, Any] = dict(max_tokens=work.output_len, temperature=0.0, ignore_eos=True,
                                       seed=zlib.crc32(f"{seed}/{i}".encode()))
        if weights is not None:
            tail = rng.choices(range(1, work.depth + 1), weights, k=work.output_len - 1)
            options["exit_depths"] = [work.depth, *tail]
            if work.replayed_depths is not None:  # the same draws above keep the prompts those of the gate run
                options["exit_depths"] = list(work.replayed_depths[i])
        if work.threshold is not None:
            options["exit_threshold"] = work.threshold
        jobs.append(Job(prompt, SamplingParams(**options)))
    return jobs


# ---------------------------------------------------------------------------- model bytes (HBM floor)


def model_config_dict(model: str) -> dict[str, Any] | None:
    """The config.json dict of a built-in, shipped or directory model (None if unknown)."""
    from rlt_engine.checkpoints import resolve_model
    from rlt_worker.models.synthetic import SYNTHETIC_MODELS
    from rlt_worker.models.toy import TOY_MODELS

    for registry in (SYNTHETIC_MODELS, TOY_MODELS):
        if model in registry:
            return dict(registry[model])
    path = os.path.join(resolve_model(model), "config.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    return None


def model_depth(cfg: dict[str, Any] | None) -> int:
    """The default D of a config.json dict (0 if unknown)."""
    if cfg is None:
        return 0
    return int(cfg.get("mean_recurrence" if cfg.get("model_type") == "huginn_raven" else "total_ut_steps", 4))


@dataclass(frozen=True)
class TokenBytes:
    """Bytes one generated token must read from HBM, split by the stage that reads them.

    Weights are read once per run of their stage, K/V once per run per context position. A
    token runs PRELUDE once, its loops, and CODA once, or, under `kl`, once after every loop
    as well (the signal is the coda's next-token distribution): loops + 1 CODAs.
    """

    loop_weights: int  # one pass of the shared block (Huginn: adapter + core blocks)
    kv_per_position_loop: int  # K/V of one context position, all loop layers of one plane
    coda_weights: int  # one CODA: the LM head (Huginn: ln_f, coda blocks, tied head)
    prelude_weights: int = 0  # Huginn: the prelude blocks (the embedding row is negligible)
    kv_per_position_prelude: int = 0  # Huginn: K/V of one context position, prelude layers
    kv_per_position_coda: int = 0  # Huginn: K/V of one context position, coda layers

    def per_token(self, loops: float, context: float, codas: float = 1.0) -> float:
        return (loops * (self.loop_weights + context * self.kv_per_position_loop)
                + self.prelude_weights + context * self.kv_per_position_prelude
                + codas * (self.coda_weights + context * self.kv_per_position_coda))


def codas_per_token(exit_mode: str, loops: float) -> float:
    """CODA runs of one generated token: one, or under `kl` one per loop and the sampling one."""
    return loops + 1 if exit_mode == "kl" else 1.0


def token_bytes(cfg: dict[str, Any], itemsize: int) -> TokenBytes:
    """Weights and K/V bytes of an Ouro or Huginn config (norm weights included; no activations)."""
    if cfg.get("model_type") == "huginn_raven":
        h, inter = cfg["n_embd"], cfg["intermediate_size"]
        qk_bias = 2 * h if cfg.get("qk_bias", True) else 0  # [2, 1, heads, head_dim]
        block = 3 * h * h + qk_bias + h * h + 2 * inter * h + inter * h + 4 * h  # Wqkv, proj, fc, proj, norms
        kv_heads = cfg.get("num_key_value_heads", cfg["n_heads"])
        kv_layer = 2 * kv_heads * (h // cfg["n_heads"])
        n_pre, n_core, n_coda = (cfg[f"n_layers_in_{part}"] for part in ("prelude", "recurrent_block", "coda"))
        return TokenBytes(
            loop_weights=(n_core * block + 2 * h * h) * itemsize,  # + adapter
            kv_per_position_loop=n_core * kv_layer * itemsize,
            coda_weights=(n_coda * block + h + cfg["padded_vocab_size"] * h) * itemsize,  # + ln_f, tied head
            prelude_weights=n_pre * block * itemsize,
            kv_per_position_prelude=n_pre * kv_layer * itemsize,
            kv_per_position_coda=n_coda * kv_layer * itemsize,
        )
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or h // heads
    attn = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2
    layer = attn + 3 * h * inter + 4 * h
    loop = layers * layer + h
    return TokenBytes(loop * itemsize, layers * 2 * kv_heads * head_dim * itemsize, cfg["vocab_size"] * h * itemsize)


# ---------------------------------------------------------------------------- one timed run


@dataclass
class RunResult:
    requests: int = 0  # submitted
    finished: int = 0
    output_tokens: int = 0
    prompt_tokens: int = 0  # of the requests whose first token arrived
    loops: int = 0  # sum of exit depths of every delivered token
    generated_loops: int = 0  # the same without output 0 (always D)
    generated_tokens: int = 0
    elapsed_s: float = 0.0
    partial: bool = False
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    exit_depths: dict[int, list[int]] = field(default_factory=dict)  # job → every delivered token's depth

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def prompt_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "requests": self.requests, "finished": self.finished, "output_tokens": self.output_tokens,
            "elapsed_s": self.elapsed_s, "partial": self.partial, "tokens_per_s": self.tokens_per_s,
            "prompt_tokens": self.prompt_tokens, "prompt_tokens_per_s": self.prompt_tokens_per_s,
            "ttft_p50_s": percentile(self.ttft_s, 50), "ttft_p99_s": percentile(self.ttft_s, 99),
            "itl_p50_s": percentile(self.itl_s, 50), "itl_p99_s": percentile(self.itl_s, 99),
            "loops_per_token": self.loops / self.output_tokens if self.output_tokens else None,
            "loops_per_generated_token": (self.generated_loops / self.generated_tokens
                                          if self.generated_tokens else None),
        }


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(rank), math.ceil(rank)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


@dataclass
class _Live:
    added: float
    prompt_len: int
    job: int
    last: float | None = None
    tokens: int = 0
    loops: int = 0


_run_ids = iter(range(1, 1 << 62))


def closed_loop(engine: Any, jobs: Sequence[Job], concurrency: int, deadline: float) -> RunResult:
    """Keep `concurrency` requests in flight until every job was submitted and finished (or the deadline)."""
    run = next(_run_ids)
    result = RunResult()
    live: dict[str, _Live] = {}
    next_job = 0
    start = time.perf_counter()
    last_token = start
    while live or next_job < len(jobs):
        while len(live) < concurrency and next_job < len(jobs):
            request_id = f"bench-{run}-{next_job}"
            job = jobs[next_job]
            live[request_id] = _Live(added=time.perf_counter(), prompt_len=len(job.prompt), job=next_job)
            engine.add_request(request_id, job.prompt, job.params)
            next_job += 1
            result.requests += 1
        if time.perf_counter() > deadline:
            result.partial = True
            for request_id in list(live):
                engine.abort_request(request_id)
            break
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            state = live.get(out.request_id)
            if state is None:
                continue
            n = out.num_tokens
            if n > state.tokens:
                if state.tokens == 0:
                    result.ttft_s.append(now - state.added)
                    result.prompt_tokens += state.prompt_len
                    first_new = 1
                else:
                    first_new = 0
                    result.itl_s.extend([(now - state.last) / (n - state.tokens)] * (n - state.tokens))
                depths = out.new_exit_depths
                result.exit_depths.setdefault(state.job, []).extend(depths)
                result.output_tokens += n - state.tokens
                result.loops += sum(depths)
                result.generated_tokens += len(depths) - first_new
                result.generated_loops += sum(depths[first_new:])
                state.tokens, state.last, last_token = n, now, now
            if out.finished:
                if out.finish_reason not in ("length", "abort"):
                    raise RuntimeError(f"request {out.request_id} finished with {out.finish_reason}")
                result.finished += out.finish_reason == "length"
                del live[out.request_id]
    result.elapsed_s = (time.perf_counter() if result.partial else last_token) - start
    _drain(engine)
    return result


def cold_closed_loop(engine: Any, jobs: Sequence[Job], concurrency: int, deadline: float) -> RunResult:
    """closed_loop from an empty prefix cache, so that hits come from the run's own requests only
    (jobs that repeat an earlier run's prompts would find them cached)."""
    engine.reset_prefix_cache()
    return closed_loop(engine, jobs, concurrency, deadline)


def _drain(engine: Any) -> None:
    """Let aborted requests' slots and plans settle so the next run starts from an idle engine."""
    for _ in range(1000):
        if not engine.has_unfinished_requests() and not engine.has_work_in_flight:
            break
        engine.step()
    engine.step()  # pending slot releases go out with this (possibly empty) step


# ---------------------------------------------------------------------------- the grid


@dataclass
class ConfigResult:
    workers: int
    exit_mode: str
    concurrency: int
    runs: list[dict[str, Any]] = field(default_factory=list)
    median: dict[str, Any] = field(default_factory=dict)
    memory: dict[str, Any] = field(default_factory=dict)
    floor: dict[str, Any] | None = None
    error: str | None = None
    graphs: dict[str, Any] | None = None  # workers=0: the runner's graph counters over the timed runs


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    """Median over the complete runs (over the partial ones only when no run completed)."""
    complete = [r for r in runs if not r["partial"]] or runs
    values = [r[key] for r in complete if r.get(key) is not None]
    return statistics.median(values) if values else None


def _cuda_memory(device: str, workers: int) -> dict[str, Any]:
    """Peak memory of this process (workers=0: the worker is here) and device memory in use now."""
    if not device.startswith("cuda"):
        return {}
    import torch

    free, total = torch.cuda.mem_get_info()
    info: dict[str, Any] = {"device_used_gib": (total - free) / 2**30, "device_total_gib": total / 2**30}
    if workers == 0:
        info["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        info["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    return info


class Grid:
    """Runs the (workers × exit × concurrency) grid within its time budgets and collects results."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.results: list[ConfigResult] = []
        self.meta: dict[str, Any] = {}
        self.deadline = time.perf_counter() + args.total_seconds
        self.references: dict[str, gate.Reference] = {}  # exit mode → the torch path's gate outputs
        # (workers, gate workload, c) → each request's exit depths in its first whole run (for *_replay).
        self.gate_depths: dict[tuple[int, str, int], list[list[int]]] = {}
        # D: the config's default, and the engine's once the first one (the gate's reference) is up.
        self.depth = model_depth(model_config_dict(args.model))

    @property
    def gate_dtype(self) -> str:
        return "float64" if self.args.dtype == "float64" else gate.GATE_DTYPE

    def resume(self, path: str) -> None:
        """Keep an earlier run's finished configurations (from its --json file); the rest run again."""
        meta, results = results_from_json(path)
        self.meta.update({k: v for k, v in meta.items() if k in ("gate", "engine", "invocations")})
        self.results = [r for r in results if r.runs and not r.error]
        log(f"== resuming {path}: {len(self.results)} configuration(s) already measured")

    def _pending(self, workers: int, exit_mode: str) -> list[int]:
        done = {(r.workers, r.exit_mode, r.concurrency) for r in self.results}
        return [c for c in self.args.concurrency if (workers, exit_mode, c) not in done]

    @staticmethod
    def weight(concurrency: int) -> float:
        """A configuration's share of the time left grows slowly with its concurrency (bigger runs)."""
        return 1.0 + math.log2(concurrency) / 7

    def budget(self, concurrency: int) -> float:
        """Seconds for the next configuration's timed runs: its weighted share of what is left, ≤ max-seconds."""
        a = self.args
        todo = [c for w in a.workers for e in a.exit for c in self._pending(w, e)]
        left = max(0.0, self.deadline - time.perf_counter())
        share = self.weight(concurrency) / sum(self.weight(c) for c in todo)
        return min(a.max_seconds, left * share)

    def _options(self, exit_mode: str) -> dict[str, Any]:
        a = self.args
        return dict(
            device=a.device, dtype=a.dtype, exit_mode=exit_mode, max_num_seqs=max(a.concurrency),
            max_num_batched_tokens=a.max_num_batched_tokens or max(2048, max(a.concurrency)),
            prefill_chunk_size=a.prefill_chunk_size, num_blocks=a.num_blocks, block_size=a.block_size,
            gpu_memory_utilization=a.gpu_memory_utilization, kv_layout=a.kv_layout,
        )

    def _engine_options(self, workers: int, mode: str) -> dict[str, Any]:
        a = self.args
        options = dict(self._options(_engine_exit(mode)), workers=workers, attention_backend=a.attention_backend,
                       loops_per_plan=a.loops_per_plan, enable_prefix_caching=mode != "shared_prefix_uncached",
                       max_plans_in_flight=a.max_plans_in_flight, mixed_batches=_mixed_batches(mode))
        for flag in ("cuda_graphs", "cuda_graph_prefill", "fused_layers", "launch_pdl", "device_refill",
                     "fused_rotary_attention",
                     "max_prefill_tokens_while_decoding", "prefill_tokens_per_decoding_row",
                     "loops_while_prompt_pending"):  # None: the engine's
            if getattr(a, flag) is not None:
                options[flag] = getattr(a, flag)
        if mode.endswith(UNCAPPED):
            options["max_prefill_tokens_while_decoding"] = 0
        return options

    def workload(self, mode: str, output_len: int) -> Workload:
        a = self.args
        if mode == "prefill":
            return Workload(1, "fixed", self.depth)
        if mode in SHARED_PREFIX:
            return Workload(output_len, "fixed", self.depth, shared_prefix_len=a.shared_prefix_len)
        if mode == SHALLOW:
            return Workload(output_len, "trace", self.depth, trace_mean=1.0)
        mode = _engine_exit(mode)
        thresholds = {"ouro": a.ouro_threshold, "kl": a.kl_threshold, "latent_diff": a.latent_threshold}
        return Workload(output_len, mode, self.depth, a.trace_mean, thresholds.get(mode))

    def _gate_pool(self) -> int:
        """KV blocks for the gate requests alone, every plane (Huginn's outer one too; up to 16 loop
        planes while D is unknown): the torch path's attention gathers whole contexts into fresh memory."""
        a = self.args
        planes = self.depth + 1 if self.depth else 17
        return a.num_blocks or gate.GATE_REQUESTS * math.ceil((a.prompt_len + a.output_len) / a.block_size) * planes + 1

    def _gate_references(self) -> None:
        """The torch path's outputs of the gate requests, once per exit mode (before any engine under test)."""
        a = self.args
        pending = [m for m in a.exit if any(self._pending(w, m) for w in a.workers)]
        for exit_mode in dict.fromkeys(_engine_exit(m) for m in pending):  # prefill is gated as fixed
            t0 = time.perf_counter()

            def make(vocab: int, depth: int, mode: str = exit_mode) -> list[gate.GateJob]:
                self.depth = depth
                # Mixed lengths up to the benchmark's prompt length: ragged rows, every split count.
                lens = [max(1, a.prompt_len * (i + 1) // gate.GATE_REQUESTS) for i in range(gate.GATE_REQUESTS)]
                jobs = make_jobs(len(lens), lens, vocab, self.workload(mode, min(a.output_len, a.gate_output_len)),
                                 a.seed + 7919)
                return [gate.GateJob(j.prompt, j.params) for j in jobs]

            options = dict(self._options(exit_mode), num_blocks=self._gate_pool())
            self.references[exit_mode] = gate.reference_run(a.model, options, make, self.gate_dtype)
            free_device(a.device)
            log(f"== gate reference (torch path, {self.gate_dtype}) for exit={exit_mode}: "
                f"{time.perf_counter() - t0:.1f} s")

    def run(self) -> None:
        a = self.args
        if a.gate:
            self._gate_references()
        for workers in a.workers:
            for exit_mode in a.exit:
                pending = self._pending(workers, exit_mode)
                if not pending:
                    continue
                key = f"workers={workers},exit={exit_mode}"
                options = self._engine_options(workers, exit_mode)
                if a.gate and not self._gate(key, options, exit_mode):
                    self._fail(workers, exit_mode, pending, "correctness gate failed (see meta.gate)")
                    continue
                self._timed_engine(key, options, workers, exit_mode, pending)

    def _start(self, options: dict[str, Any]) -> tuple[Any, float] | str:
        """An engine of `options` and its start-up time, or why it did not start."""
        from rlt_engine.llm import LLM

        t0 = time.perf_counter()
        try:
            return LLM(self.args.model, **options), time.perf_counter() - t0
        except Exception as exc:  # e.g. workers=1 not available: report and go on
            log(f"   engine failed to start: {type(exc).__name__}: {exc}")
            return f"{type(exc).__name__}: {exc}"

    def _close(self, llm: Any) -> None:
        llm.close()
        del llm
        free_device(self.args.device)

    def _fail(self, workers: int, exit_mode: str, pending: list[int], error: str) -> None:
        for c in pending:
            self.results.append(ConfigResult(workers, exit_mode, c, error=error))
        self.save()

    def _gate(self, key: str, options: dict[str, Any], exit_mode: str) -> bool:
        """The configuration built in the gate dtype must equal the torch path (the verdict goes to meta.gate)."""
        log(f"== {key}: gate ({self.gate_dtype}, {gate.GATE_REQUESTS} requests)")
        t0 = time.perf_counter()
        # Lazy graph capture: the gate engine serves 8 requests, a start-up capture of every bucket would cost more.
        started = self._start(dict(options, dtype=self.gate_dtype, num_blocks=self._gate_pool(),
                                   cuda_graph_capture="lazy"))
        if isinstance(started, str):
            self.meta.setdefault("gate", {})[key] = {"error": started}
            return False
        llm, _ = started
        try:
            result = gate.check(llm, self.references[_engine_exit(exit_mode)], self.gate_dtype)
        finally:
            self._close(llm)
        self.meta.setdefault("gate", {})[key] = dataclasses.asdict(result)
        log(f"   gate: {result.summary()} ({time.perf_counter() - t0:.1f} s)")
        return result.passed

    def _timed_engine(self, key: str, options: dict[str, Any], workers: int, exit_mode: str,
                      pending: list[int]) -> None:
        a = self.args
        log(f"== {key}: starting the engine")
        started = self._start(options)
        if isinstance(started, str):
            self._fail(workers, exit_mode, pending, started)
            return
        llm, startup_s = started
        try:
            engine = llm.engine
            self.depth = engine.max_depth
            kv = engine.kv_managers[0]
            log(f"   ready in {startup_s:.1f} s: {kv.num_blocks} KV blocks of {a.block_size} positions × "
                f"{kv.num_planes} planes, D = {self.depth}")
            self.meta.setdefault("engine", {})[key] = {
                "startup_s": startup_s, "num_blocks": kv.num_blocks, "num_planes": kv.num_planes, "depth": self.depth,
                "mixed_batches": engine.config.mixed_batches,
                "max_prefill_tokens_while_decoding": engine.config.max_prefill_tokens_while_decoding,
                "prefill_tokens_per_decoding_row": engine.config.prefill_tokens_per_decoding_row,
            }
            reference = self.references.get(_engine_exit(exit_mode))
            if reference is not None and a.dtype != self.gate_dtype:
                report = gate.divergence(llm, reference, a.dtype)
                self.meta["gate"][key]["divergence"] = dataclasses.asdict(report)
                log(f"   against the float32 reference: {report.summary()}")
            if a.warmup:
                self._warm_up(engine, exit_mode)
            for c in pending:
                self.results.append(self._measure(engine, workers, exit_mode, c))
                self.save()
        finally:
            self._close(llm)

    def _warm_up(self, engine: Any, exit_mode: str) -> None:
        a = self.args
        t0 = time.perf_counter()
        vocab = engine.model_info.vocab_size
        # One request at full length (every split count the c = 1 decode uses), then many short
        # ones (the single-split kernels of wide decode batches): Triton compiles outside the timing.
        warm = make_jobs(1, a.prompt_len, vocab, self.workload(exit_mode, a.output_len), a.seed + 999)
        closed_loop(engine, warm, 1, time.perf_counter() + 120)
        short = make_jobs(24, min(a.prompt_len, 40), vocab, self.workload(exit_mode, min(a.output_len, 8)),
                          a.seed + 998)
        closed_loop(engine, short, 24, time.perf_counter() + 120)
        log(f"   warm-up {time.perf_counter() - t0:.1f} s")

    def _warm_up_at(self, engine: Any, exit_mode: str, c: int) -> None:
        """A closed loop as long as a timed run, other prompts: the graphs captured at first use (mixed
        passes', device refill's) for this concurrency's keys are captured here, not in a timed run,
        where each capture stalls every decoding row (a server captures each once). The keys follow how
        many rows decode while a chunk rides, so the outputs are a timed run's too: with 32 outputs
        (918500e) the H200's c = 128 trace runs still captured 14 mixed keys (1.3 s) after it."""
        a = self.args
        t0, before = time.perf_counter(), (_graph_stats(engine) or {}).get("lazy_captures", 0)
        jobs = make_jobs(a.requests_factor * c, a.prompt_len, engine.model_info.vocab_size,
                         self.workload(exit_mode, a.output_len), a.seed + 997 + c)
        cold_closed_loop(engine, jobs, c, time.perf_counter() + 120)
        captured = (_graph_stats(engine) or {}).get("lazy_captures", 0) - before
        log(f"   c={c:<4} warm-up {time.perf_counter() - t0:.1f} s, {captured} graphs captured at first use")

    def _measure(self, engine: Any, workers: int, exit_mode: str, c: int) -> ConfigResult:
        """Up to --repeats timed closed-loop runs at concurrency c within the configuration's budget."""
        a = self.args
        config = ConfigResult(workers, exit_mode, c)
        if a.warmup:
            self._warm_up_at(engine, exit_mode, c)
        graphs_before = _graph_stats(engine)
        budget = self.budget(c)
        deadline = time.perf_counter() + budget
        _reset_peak(a.device, workers)
        try:
            for repeat in range(a.repeats):
                # Start another run only if one as long as the last still fits the budget.
                if repeat and time.perf_counter() + config.runs[-1]["elapsed_s"] > deadline:
                    break
                jobs = make_jobs(a.requests_factor * c, a.prompt_len, engine.model_info.vocab_size,
                                 self._timed_workload(workers, exit_mode, c), a.seed + c)
                before, early = engine.health(), engine.scheduler.stats.num_early_results
                run = cold_closed_loop(engine, jobs, c, deadline)
                if exit_mode in GATE_WORKLOADS and not repeat and run.finished == len(jobs):
                    self.gate_depths[(workers, exit_mode, c)] = [run.exit_depths[i] for i in range(len(jobs))]
                config.runs.append(dict(run.summary(), prefix_cache_hit_ratio=_hit_ratio(before, engine.health()),
                                        early_results=engine.scheduler.stats.num_early_results - early))
                s = config.runs[-1]
                log(f"   c={c:<4} run {repeat + 1}: {s['tokens_per_s']:9.1f} tok/s  "
                    f"{s['output_tokens']} tokens in {s['elapsed_s']:.1f} s"
                    + ("  (partial: budget reached)" if s["partial"] else ""))
                if run.partial:
                    break
        except Exception as exc:
            config.error = f"{type(exc).__name__}: {exc}"
            log(f"   c={c}: failed: {config.error}")
        config.memory = _cuda_memory(a.device, workers)
        graphs_after = _graph_stats(engine)
        if graphs_after is not None:
            config.graphs = {k: graphs_after[k] - (graphs_before or {}).get(k, 0)
                             for k in ("replays", "eager_passes", "mixed_passes", "captures", "lazy_captures",
                                       "refill_captures", "capture_s", "rows",
                                       "padded_rows", "prefill_replays", "prefill_eager", "prefill_rows",
                                       "prefill_padded_rows", "exit_replays", "exit_eager", "device_refill_plans",
                                       "device_refill_resumed", "device_refill_carried", "mixed_replays", "mixed_eager",
                                       "mixed_captures", "mixed_rows", "mixed_padded_rows")}
            log(f"   c={c} graph counters: {config.graphs}")
        kv = engine.kv_managers[0]
        config.memory["kv_pool_gib"] = _kv_pool_bytes(engine.model_info, kv.num_blocks, a.block_size,
                                                      engine.config.dtype) / 2**30
        keys = ("tokens_per_s", "prompt_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s",
                "loops_per_token", "loops_per_generated_token", "elapsed_s", "prefix_cache_hit_ratio")
        config.median = {k: _median(config.runs, k) for k in keys}
        config.median["runs"] = sum(not r["partial"] for r in config.runs) or len(config.runs)
        config.median["partial"] = all(r["partial"] for r in config.runs)
        config.median["budget_s"] = budget
        if c == 1:
            config.floor = self._floor(config, engine.config.dtype)
        return config

    def _timed_workload(self, workers: int, mode: str, c: int) -> Workload:
        """The workload of a timed run; a *_replay one takes its gate workload's recorded depths."""
        work = self.workload(mode, self.args.output_len)
        if not mode.endswith(REPLAY):
            return work
        base = mode.removesuffix(REPLAY)
        depths = self.gate_depths.get((workers, base, c))
        if depths is None:
            raise ReplayError(f"{mode} replays the exit depths {base} gave at workers={workers} c={c}, and this "
                              f"invocation has not measured {base} there in full: list {base} before {mode} in "
                              "--exit (a resumed grid keeps no depths)")
        return dataclasses.replace(work, replayed_depths=depths)

    def _floor(self, config: ConfigResult, dtype: str) -> dict[str, Any] | None:
        a = self.args
        cfg = model_config_dict(a.model)
        measured = config.median.get("itl_p50_s")
        if cfg is None or measured is None:
            return None
        itemsize = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}[dtype]
        tb = token_bytes(cfg, itemsize)
        loops = config.median.get("loops_per_generated_token") or 0.0
        codas = codas_per_token(_engine_exit(config.exit_mode), loops)
        context = a.prompt_len + a.output_len / 2  # mean context over the decode
        per_token = tb.per_token(loops, context, codas)
        floor_s = per_token / (a.hbm_tbps * 1e12)
        outside = tb.prelude_weights + context * tb.kv_per_position_prelude
        return {
            "loop_weight_bytes": tb.loop_weights, "kv_bytes_per_position_loop": tb.kv_per_position_loop,
            "coda_weight_bytes": tb.coda_weights, "prelude_weight_bytes": tb.prelude_weights,
            "kv_bytes_per_position_prelude": tb.kv_per_position_prelude,
            "kv_bytes_per_position_coda": tb.kv_per_position_coda, "loops_per_token": loops,
            "codas_per_token": codas, "mean_context": context, "bytes_per_token": per_token,
            "hbm_tbps": a.hbm_tbps, "floor_s": floor_s, "measured_itl_p50_s": measured, "ratio": measured / floor_s,
            "arithmetic": (
                f"{loops:.3g} loops × ({tb.loop_weights / 1e9:.4g} GB loop weights + {context:.0f} positions × "
                f"{tb.kv_per_position_loop / 1e3:.4g} kB K/V)"
                + (f" + {outside / 1e9:.4g} GB prelude (weights + K/V)" if outside else "")
                + f" + {codas:.3g} × ({tb.coda_weights / 1e9:.4g} GB coda weights"
                + (f" + {context:.0f} × {tb.kv_per_position_coda / 1e3:.4g} kB K/V" if tb.kv_per_position_coda else "")
                + f") = {per_token / 1e9:.4g} GB per token; ÷ {a.hbm_tbps} TB/s = {floor_s * 1e3:.4g} ms; measured "
                f"ITL p50 {measured * 1e3:.3f} ms = {measured / floor_s:.1f}× the floor"
            ),
        }

    def save(self) -> None:
        if not self.args.json:
            return
        payload = {"meta": self.meta, "results": [dataclasses.asdict(r) for r in self.results]}
        tmp = self.args.json + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=1)
        os.replace(tmp, self.args.json)


class ReplayError(RuntimeError):
    """A *_replay workload without its gate workload's depths."""


def _engine_exit(mode: str) -> str:
    """The engine's exit_mode for a workload (prefill: one token per request, fixed; shared prefix: fixed;
    a mixed, separate or uncapped one: its base workload's; a replay and shallow: trace)."""
    if mode.endswith(REPLAY) or mode == SHALLOW:
        return "trace"
    if mode == "prefill" or mode in SHARED_PREFIX:
        return "fixed"
    return mode.removesuffix(MIXED).removesuffix(SEPARATE).removesuffix(UNCAPPED)


def _mixed_batches(mode: str) -> bool | None:
    """The workload's mixed_batches: on (…_mixed), off (…_separate), else None (the engine's default)."""
    return True if mode.endswith(MIXED) else False if mode.endswith(SEPARATE) else None


def _hit_ratio(before: Any, after: Any) -> float | None:
    """The prefix cache's hit ratio between two HealthReports (None: no prompt was looked up)."""
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    return (after.prefix_cache_hits - before.prefix_cache_hits) / queries if queries else None


def _graph_stats(engine: Any) -> dict[str, Any] | None:
    """The in-process runner's graph counters (workers=0 with graphs on), else None."""
    worker = getattr(engine.executor, "_worker", None)
    runner = getattr(worker, "runner", None)
    return None if runner is None else runner.graph_stats


def _kv_pool_bytes(info: Any, num_blocks: int, block_size: int, dtype: str) -> int:
    itemsize = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}[dtype]
    layers = max(info.num_loop_kv_layers, info.num_outer_kv_layers)
    return num_blocks * layers * 2 * block_size * info.num_kv_heads * info.head_dim * itemsize


def _reset_peak(device: str, workers: int) -> None:
    if device.startswith("cuda") and workers == 0:
        import torch

        torch.cuda.reset_peak_memory_stats()


def environment(device: str) -> dict[str, Any]:
    """Versions and device of this run (the commit from RLT_COMMIT or git, when there is one)."""
    import torch

    env: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__, "host": platform.node(),
        "device": device, "commit": os.environ.get("RLT_COMMIT") or _git_commit(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = props.name
        env["gpu_memory_gib"] = props.total_memory / 2**30
        env["sms"] = props.multi_processor_count
    return env


def _git_commit(cwd: str | None = None) -> str | None:
    """HEAD's short hash, with "-dirty" when tracked files differ from it: a copy of a work tree (the
    device machine's) can carry an older HEAD than the code it runs."""
    import subprocess

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=5, cwd=cwd)

    try:
        head = git("rev-parse", "--short", "HEAD").stdout.strip()
        dirty = head and git("diff", "--quiet", "HEAD").returncode == 1
    except (OSError, subprocess.SubprocessError):
        return None
    return (f"{head}-dirty" if dirty else head) or None


# ---------------------------------------------------------------------------- output


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value * 1e3:.1f}"


def _num(value: float | None) -> str:
    return "—" if value is None else f"{value:.0f}"


def table(results: Sequence[ConfigResult]) -> str:
    """The results as a Markdown table."""
    lines = [
        "| workers | exit | conc. | output tok/s | prompt tok/s | TTFT p50 ms | ITL p50 ms | ITL p99 ms | "
        "loops/token | prefix hits | peak GPU GiB | runs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        m = r.median
        if r.error and not r.runs:
            lines.append(f"| {r.workers} | {r.exit_mode} | {r.concurrency} | error: {r.error} | | | | | | | | |")
            continue
        loops = m.get("loops_per_token")
        peak = r.memory.get("peak_allocated_gib", r.memory.get("device_used_gib"))
        hits = m.get("prefix_cache_hit_ratio")
        lines.append(
            f"| {r.workers} | {r.exit_mode} | {r.concurrency} | {m['tokens_per_s']:.1f} | "
            f"{_num(m.get('prompt_tokens_per_s'))} | {_ms(m['ttft_p50_s'])} | "
            f"{_ms(m['itl_p50_s'])} | {_ms(m['itl_p99_s'])} | {'—' if loops is None else f'{loops:.3f}'} | "
            f"{'—' if hits is None else f'{hits:.1%}'} | "
            f"{'—' if peak is None else f'{peak:.1f}'} | {m['runs']}{' (partial)' if m['partial'] else ''} |"
        )
    return "\n".join(lines)


def plot(results: Sequence[ConfigResult], path: str, title: str) -> bool:
    """Throughput and ITL p50 against concurrency, one line per (workers, exit), and prompt tokens/s
    of the prefill workload in a third panel when there is one; False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    series: dict[tuple[int, str], list[ConfigResult]] = {}
    for r in results:
        if r.runs:
            series.setdefault((r.workers, r.exit_mode), []).append(r)
    prefill = {key: rows for key, rows in series.items() if key[1] == "prefill"}
    panels = 3 if prefill else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.2))
    ax1, ax2 = axes[0], axes[1]
    for (workers, exit_mode), rows in sorted(series.items()):
        xs = [r.concurrency for r in rows]
        label = f"workers={workers}, exit={exit_mode}"
        style = "-" if exit_mode == "fixed" else "--"
        if exit_mode == "prefill":
            axes[2].plot(xs, [r.median["prompt_tokens_per_s"] for r in rows], style, marker="o", label=label)
            continue
        ax1.plot(xs, [r.median["tokens_per_s"] for r in rows], style, marker="o", label=label)
        ax2.plot(xs, [(r.median["itl_p50_s"] or 0) * 1e3 for r in rows], style, marker="o", label=label)
    labels = ["output tokens/s", "ITL p50 (ms)", "prompt tokens/s (1 output token)"][:panels]
    for ax, ylabel in zip(axes, labels, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def results_from_json(path: str) -> tuple[dict[str, Any], list[ConfigResult]]:
    """Read back a --json file (to plot or tabulate it elsewhere)."""
    with open(path, encoding="utf-8") as f:
        payload = json.load(f)
    return payload["meta"], [ConfigResult(**r) for r in payload["results"]]


# ---------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rlt-bench throughput", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="synthetic-ouro-1.4b")
    p.add_argument("--device", default=None, help="cuda if available, else cpu")
    p.add_argument("--dtype", default=None, help="bfloat16 on cuda, float32 on cpu")
    p.add_argument("--prompt-len", type=int, default=None, help="default: the model family's (FAMILY_DEFAULTS)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", type=_csv_ints, default=None, help="default: the model family's")
    p.add_argument("--requests-factor", type=int, default=2, help="requests per run = factor × concurrency")
    p.add_argument("--exit", type=_csv, default=None,
                   help="any of fixed, trace, ouro, kl, latent_diff, prefill (one output token: prompt tokens/s "
                        "and TTFT), shared_prefix_cached, shared_prefix_uncached (prompts sharing "
                        "--shared-prefix-len tokens, prefix caching on / off); default: the model family's "
                        "(Ouro fixed,trace,ouro; Huginn fixed,trace,kl)")
    p.add_argument("--shared-prefix-len", type=int, default=960,
                   help="leading prompt tokens every request of a shared_prefix workload has in common")
    p.add_argument("--trace-mean", type=float, default=None,
                   help="mean depth of generated positions under trace (default: uniform over 1 … D)")
    p.add_argument("--ouro-threshold", type=float, default=OURO_THRESHOLD,
                   help="exit threshold of every request under ouro (the synthetic model's gate gives a mean "
                        "near 2.5 loops per generated token at the default)")
    p.add_argument("--kl-threshold", type=float, default=KL_THRESHOLD,
                   help="exit threshold (nats) of every request under kl (Huginn)")
    p.add_argument("--latent-threshold", type=float, default=LATENT_THRESHOLD,
                   help="exit threshold of every request under latent_diff (Huginn)")
    p.add_argument("--workers", type=_csv_ints, default=[0, 1])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-seconds", type=float, default=45.0, help="timed seconds per configuration")
    p.add_argument("--total-seconds", type=float, default=480.0, help="seconds for the whole grid, warm-ups included")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="before timing, per engine one full-length request and 24 short ones (Triton compiles), "
                        "and per concurrency a closed loop as long as a timed run (graphs captured at first use)")
    p.add_argument("--gate", action=argparse.BooleanOptionalAction, default=True,
                   help="before timing a configuration, its float32 build must equal the torch path on 8 requests")
    p.add_argument("--gate-output-len", type=int, default=48, help="output tokens of each gate request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: auto on cuda, 512 on cpu)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-layout", default="last_exited", choices=("last_exited", "shared"),
                   help="shared: one K/V plane, prefill serial in positions (SPEC §4); the gate's reference too")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--prefill-chunk-size", type=int, default=512)
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="decode loop passes from CUDA graphs (default: the engine's, on for CUDA + Triton)")
    p.add_argument("--cuda-graph-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="PREFILL chunk passes from CUDA graphs too (default: the engine's, on with --cuda-graphs)")
    p.add_argument("--fused-layers", action=argparse.BooleanOptionalAction, default=None,
                   help="Ouro's layers through the fused Triton kernels (default: the engine's, on for CUDA + Triton)")
    p.add_argument("--launch-pdl", action=argparse.BooleanOptionalAction, default=None,
                   help="the decode pass's Triton kernels with programmatic dependent launch (default: the engine's)")
    p.add_argument("--device-refill", action=argparse.BooleanOptionalAction, default=None,
                   help="gate exits, CODA and refill of greedy rows on the device, no readback between a plan's "
                        "passes (default: the engine's)")
    p.add_argument("--fused-rotary-attention", action=argparse.BooleanOptionalAction, default=None,
                   help="decode batches' RoPE, K/V write and attention in one launch (default: the engine's)")
    p.add_argument("--max-prefill-tokens-while-decoding", type=int, default=None,
                   help="prompt tokens per step while a request decodes (default: the engine's; the *_uncapped "
                        "workloads run with 0, no cap)")
    p.add_argument("--prefill-tokens-per-decoding-row", type=int, default=None,
                   help="raise the prefill cap to this many prompt tokens per decoding request (default: the "
                        "engine's, 16)")
    p.add_argument("--loops-per-plan", type=int, default=0, help="0 = the engine's default (4·D on CUDA, 1 on CPU)")
    p.add_argument("--loops-while-prompt-pending", type=int, default=None,
                   help="most loop passes of a plan while a prompt or a first token is pending (default: the "
                        "engine's, D)")
    p.add_argument("--max-plans-in-flight", type=int, default=0, choices=(0, 1, 2),
                   help="2: pipelined plans, 1: synchronous, 0 = the engine's default (2 on CUDA, 1 on CPU)")
    p.add_argument("--hbm-tbps", type=float, default=HBM_TBPS, help="HBM bandwidth of the floor, TB/s")
    p.add_argument("--json", default=None, help="write the raw numbers here (rewritten after every configuration)")
    p.add_argument("--resume", action="store_true",
                   help="keep the configurations already measured in the --json file and run only the rest")
    p.add_argument("--plot", default=None, help="write a PNG plot here (needs matplotlib)")
    p.add_argument("--from-json", default=None, help="only tabulate/plot an earlier --json file")
    args = p.parse_args(argv)
    config = model_config_dict(args.model) or {}
    for flag, value in FAMILY_DEFAULTS.get(config.get("model_type"), FAMILY_DEFAULTS["ouro"]).items():
        if getattr(args, flag) is None:
            setattr(args, flag, value)
    for mode in args.exit:
        if mode not in WORKLOADS:
            p.error(f"--exit takes any of {', '.join(WORKLOADS)}, not {mode!r}")
    if args.resume and not args.json:
        p.error("--resume needs --json FILE (the grid to continue)")
    if args.output_len < 1 or args.prompt_len < 1 or min(args.concurrency) < 1:
        p.error("--prompt-len, --output-len and every concurrency must be ≥ 1")
    if set(args.exit) & set(SHARED_PREFIX) and not 0 <= args.shared_prefix_len < args.prompt_len:
        p.error(f"--shared-prefix-len must be in 0 … --prompt-len − 1 ({args.prompt_len - 1}), "
                f"got {args.shared_prefix_len}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """`rlt-bench throughput …`; prints the Markdown table last."""
    args = parse_args(argv)
    if args.from_json:
        meta, results = results_from_json(args.from_json)
        if args.plot:
            plot(results, args.plot, _title(meta))
        print(table(results))
        return 0
    from rlt_engine.config import EngineConfig

    resolved = EngineConfig(model=args.model, device=args.device, dtype=args.dtype, workers=0).resolved()
    args.device, args.dtype = resolved.device, resolved.dtype
    grid = Grid(args)
    if args.resume and os.path.exists(args.json):
        grid.resume(args.json)
    grid.meta.update(environment(args.device))
    grid.meta["conditions"] = {
        "model": args.model, "dtype": args.dtype, "prompt_len": args.prompt_len, "output_len": args.output_len,
        "requests_factor": args.requests_factor, "trace_mean": args.trace_mean, "repeats": args.repeats,
        "max_seconds": args.max_seconds, "total_seconds": args.total_seconds, "block_size": args.block_size,
        "kv_layout": args.kv_layout, "prefill_chunk_size": args.prefill_chunk_size,
        "attention_backend": resolved.attention_backend,
        "shared_prefix_len": args.shared_prefix_len,
        "ouro_threshold": args.ouro_threshold, "kl_threshold": args.kl_threshold,
        "latent_threshold": args.latent_threshold, "gate_dtype": grid.gate_dtype,
        "gate_output_len": args.gate_output_len,
        "cuda_graphs": args.cuda_graphs, "cuda_graph_prefill": args.cuda_graph_prefill,
        "fused_layers": args.fused_layers, "launch_pdl": args.launch_pdl, "device_refill": args.device_refill,
        "fused_rotary_attention": args.fused_rotary_attention,
        "loops_per_plan": args.loops_per_plan,
        "loops_while_prompt_pending": args.loops_while_prompt_pending,
        "max_plans_in_flight": EngineConfig(device=args.device, max_plans_in_flight=args.max_plans_in_flight)
        .resolved().max_plans_in_flight,
        "sampling": "greedy, ignore_eos",
    }
    # A resumed grid keeps every invocation's conditions: "conditions" holds only the last one's.
    grid.meta.setdefault("invocations", []).append({
        "commit": grid.meta.get("commit"), "exit": args.exit, "workers": args.workers,
        "concurrency": args.concurrency, "conditions": grid.meta["conditions"],
    })
    log(f"rlt-bench throughput: {args.model} {args.dtype} on {grid.meta.get('gpu', args.device)}, "
        f"prompt {args.prompt_len}, output {args.output_len}, concurrency {args.concurrency}, "
        f"exit {args.exit}, workers {args.workers}")
    grid.run()
    grid.save()
    for r in grid.results:
        if r.floor:
            log(f"HBM floor, workers={r.workers} exit={r.exit_mode} c=1: {r.floor['arithmetic']}")
    if args.plot:
        plot(grid.results, args.plot, _title(grid.meta))
    print(table(grid.results))
    for line in (worker_ratios(grid.results) + replay_ratios(grid.results) + loop_speedups(grid.results)
                 + cap_effects(grid.results)):
        log(line)
    return 0


def loop_speedups(results: Sequence[ConfigResult]) -> list[str]:
    """trace's speed-up over fixed against the ideal one, per (workers, c) measured with fixed, trace and
    shallow: a token's time is linear in its loops, t(L) = t(L₁) + (L − L₁)·(t(D) − t(L₁)) / (D − L₁),
    with t = 1 / output tokens/s and L the loops per generated token of each run."""
    by_key = {(r.workers, r.exit_mode, r.concurrency): r.median for r in results if r.runs}
    lines = []
    for (workers, mode, c), trace in by_key.items():
        fixed, shallow = by_key.get((workers, "fixed", c)), by_key.get((workers, SHALLOW, c))
        if mode != "trace" or fixed is None or shallow is None:
            continue
        t_d, t_1, t_l = (1 / m["tokens_per_s"] for m in (fixed, shallow, trace))
        l_d, l_1, l_l = (m["loops_per_generated_token"] for m in (fixed, shallow, trace))
        ideal = t_d / (t_1 + (l_l - l_1) * (t_d - t_1) / (l_d - l_1))
        measured = t_d / t_l
        lines.append(f"trace speed-up over fixed at {l_l:.2f} loops, workers={workers} c={c}: {measured:.3f}× of "
                     f"an ideal {ideal:.3f}× (per-loop cost from fixed and shallow): {measured / ideal:.1%}")
    return lines


def replay_ratios(results: Sequence[ConfigResult]) -> list[str]:
    """A gate workload's output tokens/s ÷ its *_replay's (trace over the same exit depths): what deciding costs."""
    by_key = {(r.workers, r.exit_mode, r.concurrency): r.median["tokens_per_s"] for r in results if r.runs}
    lines = []
    for (workers, mode, c), replay_tps in by_key.items():
        base = mode.removesuffix(REPLAY)
        if mode.endswith(REPLAY) and (workers, base, c) in by_key:
            tps = by_key[(workers, base, c)]
            lines.append(f"{base} / {mode} (trace over {base}'s exit depths), workers={workers} c={c}: "
                         f"{tps / replay_tps:.3f} ({tps:.1f} / {replay_tps:.1f} tok/s)")
    return lines


def cap_effects(results: Sequence[ConfigResult]) -> list[str]:
    """Each workload beside its *_uncapped one (same workers and c): ITL p99 / p50, output tokens/s, TTFT p50."""
    by_key = {(r.workers, r.exit_mode, r.concurrency): r.median for r in results if r.runs}
    lines = []
    for (workers, mode, c), capped in by_key.items():
        uncapped = by_key.get((workers, mode + UNCAPPED, c))
        if uncapped is None:
            continue
        spread = ["—" if m["itl_p50_s"] is None or m["itl_p99_s"] is None else f"{m['itl_p99_s'] / m['itl_p50_s']:.2f}"
                  for m in (capped, uncapped)]
        lines.append(f"{mode} / {mode}{UNCAPPED} (prefill cap on / off), workers={workers} c={c}: ITL p99/p50 "
                     f"{spread[0]} / {spread[1]}, ITL p99 {_ms(capped['itl_p99_s'])} / {_ms(uncapped['itl_p99_s'])} "
                     f"ms, output tok/s {capped['tokens_per_s'] / uncapped['tokens_per_s']:.3f}× "
                     f"({capped['tokens_per_s']:.1f} / {uncapped['tokens_per_s']:.1f}), TTFT p50 "
                     f"{_ms(capped['ttft_p50_s'])} / {_ms(uncapped['ttft_p50_s'])} ms")
    return lines


def worker_ratios(results: Sequence[ConfigResult]) -> list[str]:
    """workers=1 / workers=0 output tokens/s of every (exit, concurrency) measured with both."""
    by_key = {(r.workers, r.exit_mode, r.concurrency): r.median["tokens_per_s"] for r in results if r.runs}
    return [f"workers=1 / workers=0, exit={exit_mode} c={c}: {tps / by_key[(0, exit_mode, c)]:.3f} "
            f"({tps:.1f} / {by_key[(0, exit_mode, c)]:.1f} tok/s)"
            for (workers, exit_mode, c), tps in sorted(by_key.items()) if workers == 1 and (0, exit_mode, c) in by_key]


def _title(meta: dict[str, Any]) -> str:
    c = meta.get("conditions", {})
    return (f"rlt {c.get('model')} {c.get('dtype')} on {meta.get('gpu', meta.get('device'))}: prompt "
            f"{c.get('prompt_len')}, output {c.get('output_len')} (commit {meta.get('commit')})")


if __name__ == "__main__":
    sys.exit(main())
