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


@pytest.fixture(scope="module")
def interp_verdicts(request: pytest.FixtureRequest) -> dict[str, str]:
    """The test module's interpreter cases (its INTERP_CASES), run once in a child with TRITON_INTERPRET=1
    (tests/interp.py): each case's verdict, "ok" or its traceback."""
    import interp

    return interp.verdicts(request.module.__file__)


@pytest.fixture
def compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the compiled Triton kernels, whatever the caller's environment says (TRITON_INTERPRET)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture
def register_synthetic(monkeypatch: pytest.MonkeyPatch):
    """`register_synthetic(name, config)`: a synthetic model of `config` (a config.json dict) that
    in-process engines and the dense reference load by `name`, for this test only. It joins the
    worker's synthetic models and the engine's built-in names, which the engine checks first."""
    from rlt_engine import checkpoints
    from rlt_worker.models import synthetic

    def register(name: str, config: dict) -> None:
        monkeypatch.setattr(checkpoints, "BUILT_IN", (*checkpoints.BUILT_IN, name))
        monkeypatch.setitem(synthetic.SYNTHETIC_MODELS, name, config)

    return register
