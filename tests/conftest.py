"""Shared fixtures of the test suite."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def single_thread():
    """The toy models' tensors are tiny: intra-op threads only add overhead on a 2-core box."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the compiled Triton kernels, whatever the caller's environment says (TRITON_INTERPRET)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
