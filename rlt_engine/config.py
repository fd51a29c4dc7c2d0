"""Engine configuration: one frozen dataclass, validated once, with clear errors (SPEC §8)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from protocol.messages import WorkerConfig

EXIT_MODES = ("fixed", "trace", "ouro", "ouro_delayed", "kl", "latent_diff")


def default_device() -> str:
    """cuda when a GPU is visible, else cpu (imports torch only to ask)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class EngineConfig:
    """Every `LLM(...)` option; CLI flags are the same names with dashes."""

    model: str = "toy-ouro"
    workers: int = 1
    device: str | None = None  # None = cuda if available, else cpu
    dtype: str | None = None  # None = bfloat16 on cuda, float32 on cpu
    max_loops: int | None = None  # None = the model's D
    state_init: str = "random"
    exit_mode: str | None = None  # None = ouro for Ouro, fixed for Huginn
    # KV
    num_blocks: int | None = None  # None = auto on cuda, 512 on cpu
    block_size: int = 16
    kv_layout: str = "last_exited"
    kv_growth: str = "on_demand"
    gpu_memory_utilization: float = 0.9
    # Scheduling
    scheduling: str = "refill"
    scheduling_policy: str = "fcfs"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    prefill_chunk_size: int = 512
    preemption: str = "swap"
    max_bypasses: int = 8
    # Execution
    attention_backend: str | None = None  # None = triton on cuda, torch on cpu
    max_plans_in_flight: int = 1
    # Decode loop passes (RecurrentBatch rows without a signal) replayed from CUDA graphs bucketed
    # by row count and block-table width. Takes effect on CUDA with Triton attention only.
    cuda_graphs: bool = True
    # Most loops one plan runs for a row that cannot exit in between (fixed, trace);
    # 0 = auto: D on CUDA, 1 on the CPU (where tests read one loop per plan).
    loops_per_plan: int = 0
    mixed_batches: bool = False
    # Processes
    restart_workers: bool = False
    worker_timeout: float = 10.0

    def __post_init__(self) -> None:
        _choice("kv_layout", self.kv_layout, ("last_exited", "shared"))
        _choice("kv_growth", self.kv_growth, ("reserve", "on_demand"))
        _choice("scheduling", self.scheduling, ("refill", "no_refill"))
        _choice("scheduling_policy", self.scheduling_policy, ("fcfs", "priority"))
        _choice("state_init", self.state_init, ("random", "zero"))
        _choice("preemption", self.preemption, ("swap", "recompute"))
        if self.exit_mode is not None:
            _choice("exit_mode", self.exit_mode, EXIT_MODES)
        if self.attention_backend is not None:
            _choice("attention_backend", self.attention_backend, ("torch", "triton"))
        if self.dtype is not None:
            _choice("dtype", self.dtype, ("float64", "float32", "bfloat16", "float16"))
        _positive("workers", self.workers, minimum=0)
        _positive("block_size", self.block_size)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("prefill_chunk_size", self.prefill_chunk_size)
        _positive("max_plans_in_flight", self.max_plans_in_flight)
        _positive("loops_per_plan", self.loops_per_plan, minimum=0)
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
        """The same config with device, dtype and backend defaults filled in."""
        device = self.device or default_device()
        on_cuda = device.startswith("cuda")
        dtype = self.dtype or ("bfloat16" if on_cuda else "float32")
        if dtype == "float64" and on_cuda:
            raise ValueError("dtype float64 is only supported on the CPU")
        backend = self.attention_backend or ("triton" if on_cuda else "torch")
        # Graph capture needs a sync-free attention path: the Triton backend on CUDA.
        graphs = self.cuda_graphs and on_cuda and backend == "triton"
        loops_per_plan = self.loops_per_plan or (0 if on_cuda else 1)  # 0 stays: D, known once workers are up
        return dataclasses.replace(
            self, device=device, dtype=dtype, attention_backend=backend, cuda_graphs=graphs,
            loops_per_plan=loops_per_plan,
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
        )


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


def _positive(name: str, value: int, minimum: int = 1) -> None:
    if not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer ≥ {minimum}, got {value!r}")
