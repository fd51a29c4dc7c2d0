"""Engine configuration: one frozen dataclass, validated once, with clear errors (SPEC §8)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from protocol.messages import WorkerConfig
from rlt_engine.checkpoints import DEFAULT_MODEL, resolve_model
from rlt_engine.exit_policy import worker_exit_tests

EXIT_MODES = ("fixed", "trace", "ouro", "ouro_delayed", "kl", "latent_diff")
PLANNED_MODES = ("fixed", "trace")  # every exit depth known before the loop runs
DEVICE_REFILL_MODES = ("ouro", "ouro_delayed")  # gate exits whose greedy rows' passes run on the device


def default_device() -> str:
    """cuda when a GPU is visible, else cpu (imports torch only to ask)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _opt(default: object, help_text: str) -> Any:
    """A config field whose help text the CLI shows for its flag."""
    return dataclasses.field(default=default, metadata={"help": help_text})


@dataclass(frozen=True)
class EngineConfig:
    """Every `LLM(...)` option; CLI flags are the same names with dashes."""

    model: str = _opt(DEFAULT_MODEL, "tiny-ouro-py (shipped, trained), toy-ouro, toy-huginn, synthetic-ouro-1.4b, "
                      "synthetic-ouro-2.6b, synthetic-huginn-3.5b, or a Hugging Face checkpoint directory")
    workers: int = _opt(1, "worker processes, one per device (0: run the model in the engine process)")
    cpu_threads: int = _opt(0, "torch threads of each CPU worker process (0: this host's cores split among "
                               "its workers; 1 where other busy processes share the cores)")
    device: str | None = _opt(None, "cuda or cpu (default: cuda when a GPU is visible)")
    dtype: str | None = _opt(None, "float32, bfloat16, float16 or float64 (default: bfloat16 on cuda, float32 on cpu)")
    max_loops: int | None = _opt(None, "loops D of the shared block per token (default: the model's)")
    state_init: str = _opt("random", "Huginn's loop-state init: random (seeded per position) or zero")
    exit_mode: str | None = _opt(None, "fixed, trace, ouro, ouro_delayed, kl or latent_diff "
                                       "(default: ouro for Ouro, fixed for Huginn)")
    # KV
    num_blocks: int | None = _opt(None, "KV blocks per worker (default: from free GPU memory; 512 on cpu)")
    block_size: int = _opt(16, "positions per KV block")
    kv_layout: str = _opt("last_exited", "last_exited (a plane per loop depth) or shared (one plane)")
    kv_growth: str = _opt("on_demand", "on_demand (blocks as positions need them) or reserve (the whole "
                                       "request's at admission)")
    gpu_memory_utilization: float = _opt(0.9, "share of GPU memory the worker may use (weights + KV)")
    # Scheduling
    scheduling: str = _opt("refill", "refill (a free row takes new work at once) or no_refill (static batches)")
    scheduling_policy: str = _opt("fcfs", "fcfs or priority (SamplingParams.priority, lower first)")
    max_num_seqs: int = _opt(64, "requests running at once per worker")
    max_num_batched_tokens: int = _opt(2048, "token rows per step, prefill and decode together")
    prefill_chunk_size: int = _opt(512, "prompt positions per prefill chunk")
    # 512: on one H200 (synthetic-ouro-1.4b, bf16, c = 32, 1,024-token prompts) prefill runs at ~49,000
    # prompt tokens/s, so a step of 512 prompt tokens costs ~10 ms, about one decode step (ITL p50
    # 10.7-12.3 ms), where one of the full 2,048 costs ~42 ms, the ITL p99 measured without a cap.
    # 512 is also prefill_chunk_size and a prefill graph bucket: a capped step is one exact chunk.
    max_prefill_tokens_while_decoding: int = _opt(512, "prompt tokens one step may carry while a request on the "
                                                       "worker is decoding, so a prompt step stalls running "
                                                       "decodes about as long as one decode step; with nothing "
                                                       "decoding a step takes max_num_batched_tokens (0 = no "
                                                       "cap: always max_num_batched_tokens)")
    # 16 from the H200 (c = 128, fixed, 1 run each at 1e74ae4): 2,087.6 tok/s against 1,891.8 with the
    # fixed cap alone and 2,280.1 with none; at c = 32 (512 either way) throughput and ITL held.
    prefill_tokens_per_decoding_row: int = _opt(16, "raise the cap of max_prefill_tokens_while_decoding to this many "
                                                    "prompt tokens per decoding request when that is more (0 = a "
                                                    "fixed cap)")
    preemption: str = _opt("swap", "when KV runs out: swap (K/V to host memory) or recompute (replay later)")
    max_bypasses: int = _opt(8, "times a waiting request may be passed over by later ones under priority")
    # Execution
    attention_backend: str | None = _opt(None, "torch or triton (default: triton on cuda, torch on cpu)")
    max_plans_in_flight: int = _opt(0, "plans a worker may have in flight: 2 builds and sends plan N+1 "
                                       "before plan N's result is read (pipelined), 1 waits for each result "
                                       "(0 = auto: 2 on cuda, 1 on cpu)")
    cuda_graphs: bool = _opt(True, "replay decode loop passes from CUDA graphs bucketed by row count "
                                   "(CUDA with Triton attention only)")
    fused_layers: bool = _opt(True, "Ouro's decoder layers through fused Triton kernels (residual add + "
                                    "RMSNorm, RoPE, SwiGLU) over packed q|k|v and gate|up weights (CUDA with "
                                    "Triton attention only; --no-fused-layers runs the torch modules, for A/B)")
    # On: at one row, where every GEMV is a Triton strip, the H200 at c = 1 gave 201.1 against 175.1 tok/s
    # fixed and 308.9 against 268.2 trace (docs/benchmarks.md); passes with cuBLAS GEMMs launch plainly.
    launch_pdl: bool = _opt(True, "launch the decode pass's Triton kernels (add + RMSNorm, the rotating K/V "
                                  "write, attention, split merge, SwiGLU, strip GEMVs) with programmatic "
                                  "dependent launch, so each may start while its predecessor drains, in the "
                                  "passes where it pays: Ouro's fused passes whose GEMVs are all Triton (1 row); "
                                  "CUDA sm_90+ with Triton attention, elsewhere plain launches")
    # On: ouro on the H200 at c1868c1 gave 217.4 against 172.5 tok/s at c = 1 and 1,694.3 against 1,387.0 at
    # c = 32 (gated 8/8 float32; docs/benchmarks.md).
    device_refill: bool = _opt(True, "gate exits (ouro) of greedy rows: the exit test, CODA, sampling and the "
                                      "next token's PRELUDE run on the device for every row at every pass, so a "
                                      "plan's passes queue with no readback between them (needs cuda_graphs)")
    # Off until timed on the H200: built and tested on the CPU (bit for bit the two launches it replaces).
    fused_rotary_attention: bool = _opt(False, "decode batches rotate q and k, write k and v and attend in one "
                                               "Triton launch (the attention's) instead of the RoPE launch then "
                                               "the attention's (Triton attention only; the same results)")
    cuda_graph_capture: str = _opt("startup", "when decode-pass graphs are captured: startup (every row × width "
                                              "bucket before the worker reports ready, so no capture lands in a "
                                              "request) or lazy (a bucket at its first use)")
    cuda_graph_prefill: bool = _opt(True, "replay PREFILL chunk loop passes from CUDA graphs too, bucketed by "
                                          "token and chunk count up to max_num_batched_tokens and captured with "
                                          "the decode graphs (needs cuda_graphs; --no-cuda-graph-prefill for A/B)")
    loops_per_plan: int = _opt(0, "most loop passes one plan runs: a replayed position runs up to this many "
                                  "of its loops; the worker's decode loop (exits decided there, or fixed/trace "
                                  "depths when > 1) samples up to this many + 1 tokens per row "
                                  "(0 = auto: 4·D on cuda, 1 on cpu)")
    loops_while_prompt_pending: int = _opt(0, "most loop passes one plan runs while a prompt or a first token "
                                              "is pending (a request waits to be placed, has prompt chunks "
                                              "left, or has no output yet): fewer bring the next chunk and the "
                                              "first token sooner, more spread a step's prompt tokens over more "
                                              "decode tokens (0 = D; at most loops_per_plan)")
    mixed_batches: bool | None = _opt(None, "prompt chunks ride the loop passes of running decode rows (a chunk's D "
                                            "loops in the plan's first D passes, one pass over both within "
                                            "max_num_batched_tokens, from a CUDA graph captured at first use "
                                            "where graphs are on), so a new prompt does not stall decodes "
                                            "(default: on with CUDA graphs for exit modes fixed and trace, "
                                            "and for ouro, ouro_delayed and the model's default with "
                                            "device_refill, whose passes chunks ride; off otherwise)")
    enable_prefix_caching: bool = _opt(True, "share the K/V of full prompt blocks between requests on a worker "
                                             "(keyed by a hash chain of their tokens), kept after their last "
                                             "user finishes and evicted least recently used when blocks run short")
    # Processes
    restart_workers: bool = _opt(False, "start a replacement when a worker dies (its requests replay)")
    worker_timeout: float = _opt(10.0, "seconds without a heartbeat before a worker counts as lost")

    def __post_init__(self) -> None:
        _choice("kv_layout", self.kv_layout, ("last_exited", "shared"))
        _choice("kv_growth", self.kv_growth, ("reserve", "on_demand"))
        _choice("scheduling", self.scheduling, ("refill", "no_refill"))
        _choice("scheduling_policy", self.scheduling_policy, ("fcfs", "priority"))
        _choice("state_init", self.state_init, ("random", "zero"))
        _choice("preemption", self.preemption, ("swap", "recompute"))
        _choice("cuda_graph_capture", self.cuda_graph_capture, ("startup", "lazy"))
        if self.exit_mode is not None:
            _choice("exit_mode", self.exit_mode, EXIT_MODES)
        if self.attention_backend is not None:
            _choice("attention_backend", self.attention_backend, ("torch", "triton"))
        if self.dtype is not None:
            _choice("dtype", self.dtype, ("float64", "float32", "bfloat16", "float16"))
        if self.device is not None and not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be cpu, cuda or cuda:N; got {self.device!r}")
        _positive("workers", self.workers, minimum=0)
        _positive("block_size", self.block_size)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("cpu_threads", self.cpu_threads, minimum=0)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("prefill_chunk_size", self.prefill_chunk_size)
        _positive("max_prefill_tokens_while_decoding", self.max_prefill_tokens_while_decoding, minimum=0)
        _positive("prefill_tokens_per_decoding_row", self.prefill_tokens_per_decoding_row, minimum=0)
        if self.max_plans_in_flight not in (0, 1, 2):
            raise ValueError(f"max_plans_in_flight must be 0 (auto), 1 (synchronous) or 2 (pipelined), "
                             f"got {self.max_plans_in_flight!r}")
        _positive("loops_per_plan", self.loops_per_plan, minimum=0)
        _positive("loops_while_prompt_pending", self.loops_while_prompt_pending, minimum=0)
        if self.num_blocks is not None:
            _positive("num_blocks", self.num_blocks)
        if self.max_loops is not None:
            _positive("max_loops", self.max_loops)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({self.max_num_seqs}) so every running request fits in a step"
            )

    def resolved(self) -> EngineConfig:
        """The same config with the model's directory and the device, dtype and backend defaults filled in."""
        device = self.device or default_device()
        on_cuda = device.startswith("cuda")
        dtype = self.dtype or ("bfloat16" if on_cuda else "float32")
        if dtype == "float64" and on_cuda:
            raise ValueError("dtype float64 is only supported on the CPU")
        backend = self.attention_backend or ("triton" if on_cuda else "torch")
        # Graph capture needs a sync-free attention path: the Triton backend on CUDA.
        graphs = self.cuda_graphs and on_cuda and backend == "triton"
        fused = self.fused_layers and on_cuda and backend == "triton"  # the kernels are Triton's, on CUDA
        pdl = self.launch_pdl and on_cuda and backend == "triton"
        loops_per_plan = self.loops_per_plan or (0 if on_cuda else 1)  # 0 stays: 4·D, known once workers are up
        # The CPU computes a plan as it is submitted: nothing would overlap, and the float64 suites
        # keep their one-plan-at-a-time reading of a step.
        in_flight = self.max_plans_in_flight or (2 if on_cuda else 1)
        # Mixed batches pay where exits are planned (H200, c = 32, two calls: trace 1.06-1.07×, fixed 1.07×) and
        # where device refill runs the gate (ouro 1.087× at c = 32, 1.021× at c = 128; design.md, "Mixed batches").
        # kl and latent_diff were not measured with them.
        # exit_mode None is the model's default, ouro (a gate) or fixed: both mix while device refill is on.
        mixing_modes = PLANNED_MODES + (DEVICE_REFILL_MODES + (None,) if self.device_refill else ())
        mixed = self.mixed_batches if self.mixed_batches is not None else graphs and self.exit_mode in mixing_modes
        return dataclasses.replace(
            self, model=resolve_model(self.model), device=device, dtype=dtype, attention_backend=backend,
            cuda_graphs=graphs, cuda_graph_prefill=self.cuda_graph_prefill and graphs, fused_layers=fused,
            launch_pdl=pdl, loops_per_plan=loops_per_plan, max_plans_in_flight=in_flight,
            device_refill=self.device_refill and graphs, mixed_batches=mixed,
            fused_rotary_attention=self.fused_rotary_attention and backend == "triton",
        )

    def worker_config(self, device: str) -> WorkerConfig:
        """What every worker builds (the device string is per worker)."""
        assert self.dtype is not None and self.attention_backend is not None, "resolve() first"
        return WorkerConfig(
            model=self.model,
            device=device,
            dtype=self.dtype,
            max_loops=self.max_loops or 0,
            kv_layout=self.kv_layout,
            block_size=self.block_size,
            num_blocks=self.num_blocks or 0,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_num_seqs=self.max_num_seqs,
            attention_backend=self.attention_backend,
            state_init=self.state_init,
            cuda_graphs=self.cuda_graphs,
            fused_layers=self.fused_layers,
            cuda_graph_capture=self.cuda_graph_capture,
            cuda_graph_prefill=self.cuda_graph_prefill,
            max_num_batched_tokens=self.max_num_batched_tokens,
            exit_tests=worker_exit_tests(self.exit_mode),
            launch_pdl=self.launch_pdl,
            device_refill=self.device_refill,
            mixed_graphs=self.mixed_batches and self.cuda_graphs,
            fused_rotary_attention=self.fused_rotary_attention,
        )


def check_device_visible(device: str) -> None:
    """Raise ValueError if `device` is a GPU this process cannot see (the command lines check it
    before starting workers; a remote worker's GPU is not this host's to judge)."""
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: no GPU is visible to torch here; use --device cpu")


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


def _positive(name: str, value: int, minimum: int = 1) -> None:
    if not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer ≥ {minimum}, got {value!r}")
