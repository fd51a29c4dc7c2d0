"""Executors: where the engine meets its workers."""

from __future__ import annotations

from rlt_engine.config import EngineConfig
from rlt_engine.executor.base import Executor, WorkerLost


def make_executor(config: EngineConfig) -> Executor:
    """`workers=0`: the in-process worker; otherwise one worker process per device."""
    if config.workers == 0:
        from rlt_engine.executor.inproc import InprocExecutor

        assert config.device is not None
        return InprocExecutor(config.worker_config(config.device))
    from rlt_engine.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config)


__all__ = ["Executor", "WorkerLost", "make_executor"]
