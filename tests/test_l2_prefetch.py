"""L2Prefetch (rlt_worker/kernels/l2_prefetch.py): its checks, and that it does nothing off CUDA.

The prefetch kernel is PTX (cp.async.bulk.prefetch.L2), which Triton's interpreter cannot run: that
it changes no bit on the GPU is tests/test_gpu_fused.py's test_l2_prefetch_changes_no_bit."""

from __future__ import annotations

import pytest
import torch

from rlt_engine.config import EngineConfig
from rlt_worker.kernels.l2_prefetch import NO_PREFETCH, PREFETCH_SITES, L2Prefetch, l2_prefetch

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("kwargs", [dict(sites=frozenset({"lm_head"})), dict(budget_bytes=-1), dict(programs=0)])
def test_bad_settings_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="L2Prefetch"):
        L2Prefetch(**{"budget_bytes": 2**20, **kwargs})


def test_a_misaligned_weight_is_refused() -> None:
    storage = torch.zeros(64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="16-byte-aligned"):
        l2_prefetch(storage[1:], 64, programs=1)


def test_cpu_weights_and_the_plain_strategy_launch_nothing() -> None:
    """Off CUDA `ahead` returns before any stream or kernel (a launch here would fail: no CUDA)."""
    weight = torch.zeros(16, 16)
    for strategy in (NO_PREFETCH, L2Prefetch(budget_bytes=2**20)):
        for site in PREFETCH_SITES:
            strategy.ahead(site, weight, rows=1)
        strategy.join()


def test_the_option_is_checked_and_reaches_the_worker_only_with_fused_layers() -> None:
    with pytest.raises(ValueError, match="l2_prefetch_mb"):
        EngineConfig(l2_prefetch_mb=-1)
    config = EngineConfig(model="toy-ouro", device="cpu", l2_prefetch_mb=8).resolved()
    assert config.l2_prefetch_mb == 0  # no fused layers on the CPU
    assert config.worker_config("cpu").l2_prefetch_mb == 0
