"""The Worker: one device, its model replica, its KV storage and its runner.

`Worker` is the same object in every executor: the in-process executor calls it directly
(through encoded frames), a worker process wraps it in a socket loop (worker_process.py).
"""

from __future__ import annotations

import gc
import logging
import os

import torch

from protocol import PROTOCOL_VERSION, config_hash
from protocol.messages import ExecutionPlan, ExitTest, StepResult, WorkerHello, WorkerReady
from rlt_worker.kernels.launch import KernelLaunch
from rlt_worker.kv_storage import KVStorage, bytes_per_block, num_planes
from rlt_worker.model_runner import ModelRunner, RunnerConfig
from rlt_worker.models.loader import load_model
from rlt_worker.step_results import PendingResult

log = logging.getLogger("rlt.worker")

DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
CPU_DEFAULT_NUM_BLOCKS = 512


class HandshakeError(RuntimeError):
    """The engine and the worker disagree on protocol version or configuration."""


class KVPoolSizeError(RuntimeError):
    """The device's free memory leaves no room for a KV pool of even one block."""


ACTIVATION_RESERVE_BYTES = 2 * 1024**3  # kept out of the KV pool: activations and the runner's per-slot state


def kv_pool_blocks(free: int, total: int, utilization: float, block_bytes: int, device: str) -> int:
    """KV blocks that fit in `utilization` of the device once what is already used and the activation
    reserve are taken out."""
    used = total - free
    budget = total * utilization - used - ACTIVATION_RESERVE_BYTES
    blocks = int(budget // block_bytes)
    if blocks < 1:
        gib = 1024**3
        raise KVPoolSizeError(
            f"gpu_memory_utilization {utilization} of {total / gib:.1f} GiB on {device} leaves "
            f"{budget / gib:.2f} GiB for the KV pool once the {used / gib:.1f} GiB already in use (by this "
            f"process or others) and {ACTIVATION_RESERVE_BYTES / gib:.0f} GiB for activations are taken out: "
            f"not one block of {block_bytes / 2**20:.1f} MiB. Free the device, raise gpu_memory_utilization, "
            "or pass num_blocks.")
    return blocks


class Worker:
    """Builds the model, the KV pool and the runner from a WorkerHello; executes plans."""

    def __init__(self, hello: WorkerHello) -> None:
        if hello.protocol_version != PROTOCOL_VERSION:
            raise HandshakeError(
                f"engine speaks protocol version {hello.protocol_version}, worker speaks {PROTOCOL_VERSION}"
            )
        own_hash = config_hash(hello.config)
        if own_hash != hello.config_hash:
            raise HandshakeError(f"config hash mismatch: engine {hello.config_hash}, worker {own_hash}")
        self.index = hello.worker_index
        self.config = hello.config
        self.runner: ModelRunner | None = None

    def start(self) -> WorkerReady:
        """Load the model, size and allocate the KV pool, build the runner."""
        config = self.config
        if config.num_threads > 0:
            torch.set_num_threads(config.num_threads)
        device = torch.device(config.device)
        dtype = DTYPES[config.dtype]
        model = load_model(config.model, dtype=dtype, device=device)
        launch = KernelLaunch.for_device(config.launch_pdl, device)
        if config.fused_layers:  # the CUDA fast path: set only for CUDA with Triton attention (EngineConfig)
            from rlt_worker.models.ouro_fused import with_fused_layers  # imports Triton: only when used

            model = with_fused_layers(model, launch)
        launch = model.kernel_launch(launch)  # PDL only in the passes where it pays
        info = model.info
        max_depth = config.max_loops or info.default_depth  # D
        planes = num_planes(info, config.kv_layout, max_depth)
        num_blocks = config.num_blocks or self._auto_num_blocks(info, dtype, device)
        # One block beyond the engine's num_blocks: scratch for the padding rows of graph-captured passes.
        storage = KVStorage(info, num_blocks + 1, config.block_size, dtype, device)
        runner_config = RunnerConfig(
            kv_layout=config.kv_layout,
            max_depth=max_depth,
            num_planes=planes,
            max_slots=config.max_num_seqs,
            attention_backend=config.attention_backend,
            state_init=config.state_init,
            scratch_block=num_blocks,
            cuda_graphs=config.cuda_graphs,
            graph_capture=config.cuda_graph_capture,
            prefill_graphs=config.cuda_graph_prefill,
            max_batch_tokens=config.max_num_batched_tokens,
            exit_tests=tuple(ExitTest(t) for t in config.exit_tests),
            kernel_launch=launch,
            device_refill=config.device_refill,
            mixed_graphs=config.mixed_graphs,
            fused_rotary_attention=config.fused_rotary_attention,
        )
        self.runner = ModelRunner(model, storage, runner_config)
        log.info("worker %d ready on %s: %d KV blocks, %d planes", self.index, device, num_blocks, planes)
        return WorkerReady(
            protocol_version=PROTOCOL_VERSION,
            worker_index=self.index,
            config_hash=config_hash(config),
            device=str(device),
            num_blocks=num_blocks,
            num_planes=planes,
            max_depth=max_depth,
            model=info,
            pid=os.getpid(),
            prefill_token_buckets=self.runner.prefill_token_buckets,
        )

    def _auto_num_blocks(self, info, dtype: torch.dtype, device: torch.device) -> int:
        if device.type != "cuda":
            return CPU_DEFAULT_NUM_BLOCKS
        free, total = torch.cuda.mem_get_info(device)
        return kv_pool_blocks(free, total, self.config.gpu_memory_utilization,
                              bytes_per_block(info, self.config.block_size, dtype), str(device))

    def execute(self, plan: ExecutionPlan) -> list[StepResult]:
        """Run one plan and wait for its results (early ones first, then the plan's)."""
        return [r for r in (pending.result() for pending in self.submit(plan)) if r is not None]

    def submit(self, plan: ExecutionPlan) -> list[PendingResult]:
        """Queue one plan's work (on the CPU: run it); its results, in the order they are to be sent
        (ModelRunner.submit), are ready once their copies land. A failure becomes one error result
        instead of killing the worker (early results of the failed plan are not sent: the engine
        reconciles the whole plan)."""
        assert self.runner is not None, "start() first"
        try:
            return self.runner.submit(plan)
        except Exception as exc:  # the engine decides what a failed plan means
            log.exception("plan %d failed", plan.step_id)
            return [PendingResult.done(StepResult(
                step_id=plan.step_id, error=f"{type(exc).__name__}: {exc}", applied=self.runner.applied,
                num_free_slots=self.runner.num_free_slots))]

    def close(self) -> None:
        """Drop the runner and free its device memory now. The runner and its graphs, decode loop and
        pending results refer to one another, so dropping it frees nothing until the cyclic collector
        runs; an in-process engine made next would find the KV pool still taken (on CUDA, still
        reserved by the caching allocator as well)."""
        on_cuda = self.runner is not None and self.runner.device.type == "cuda"
        if on_cuda:  # plans still in flight read what is freed below (their copies run on a side stream)
            torch.cuda.synchronize(self.runner.device)
        self.runner = None
        gc.collect()
        if on_cuda:
            torch.cuda.empty_cache()
