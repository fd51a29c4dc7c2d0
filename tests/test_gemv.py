"""The Triton GEMV (rlt_worker/kernels/gemv.py), and FusedOuroModel with it, against float64 products.

CPU: in Triton's interpreter, in one child process started with TRITON_INTERPRET=1 (tests/interp.py).
Bounds: the GEMV sums K products in fp32 in its own order, so float32 is held to the classic
error bound of a K-term sum, K·2⁻²⁴·Σ|x_k·w_k| per output, against x.double() @ w.double().T
(a tf32 product alone would exceed it); bf16 adds the one rounding of the result to bf16, 2⁻⁷·|y|
(the interpreter truncates fp32→bf16 casts: one ulp, not a half). Shapes have N and K that no
block size divides, and row counts 1, 3 (multiply-add path), 8 and 16 (tl.dot path; on the CPU the
interpreter's bf16 tl.dot is fed fp32 copies, see the kernel).

GPU (marked gpu): the compiled kernel at Ouro-1.4B's four loop shapes, bf16 and float32, and
tests/test_gpu_fused.py runs the fused model with the GEMV on (see its module docstring).
"""

from __future__ import annotations

import functools
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import interp
import pytest
import torch
import torch.nn.functional as F

from rlt_worker.attention import triton_backend as tb

pytestmark = pytest.mark.skipif(tb.triton is None, reason="Triton is not installed")

ROOT = Path(__file__).resolve().parents[1]
ROWS = (1, 3, 8, 16)
# (N, K): N not a multiple of BLOCK_N 8, K not of BLOCK_K (and one K below the smallest BLOCK_K).
SHAPES = ((37, 300), (20, 1030), (9, 24))


def _operands(rows: int, n: int, k: int, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, k] as a row-strided view (a column slice of a wider buffer) and W [n, k], N(0, 1) values."""
    gen = torch.Generator().manual_seed(rows * 7919 + n * 31 + k)
    wide = torch.randn(rows, k + 5, generator=gen, dtype=torch.float64)
    return wide[:, 2 : 2 + k].to(device, dtype), torch.randn(n, k, generator=gen, dtype=torch.float64).to(device, dtype)


def assert_within_bound(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """|got − x·Wᵀ| ≤ K·2⁻²⁴·(|x|·|W|ᵀ) (+ 2⁻⁷·|x·Wᵀ| for bf16), the products taken in float64."""
    x64, w64 = x.double().cpu(), w.double().cpu()
    want = x64 @ w64.T
    bound = x.shape[1] * 2.0**-24 * (x64.abs() @ w64.abs().T)
    if got.dtype == torch.bfloat16:
        bound = bound + 2.0**-7 * want.abs()
    err = (got.double().cpu() - want).abs()
    assert got.dtype == x.dtype and got.shape == want.shape
    assert bool((err <= bound).all()), f"max excess {float((err - bound).max()):.3e}, max |Δ| {float(err.max()):.3e}"


def check_gemv(dtype: torch.dtype, rows: int, device: str = "cpu") -> None:
    """Default blocks, every SHAPES entry, at `rows` rows."""
    from rlt_worker.kernels.gemv import gemv

    for n, k in SHAPES:
        x, w = _operands(rows, n, k, dtype, device)
        assert_within_bound(gemv(x, w), x, w)


def check_row_tiles(dtype: torch.dtype) -> None:
    """More rows than one tile holds (a grid over row tiles), both paths, explicit configs: the same bound."""
    from rlt_worker.kernels.gemv import GemvConfig, gemv

    x, w = _operands(20, 37, 300, dtype, "cpu")
    assert_within_bound(gemv(x, w, GemvConfig(block_m=4, block_n=16, block_k=64)), x, w)
    assert_within_bound(gemv(x, w, GemvConfig(block_m=16, block_n=32, block_k=128, use_dot=True)), x, w)


def check_row_bound_linear() -> None:
    """RowBoundLinear runs gemv at or below its bound and F.linear above (bit-equal to each)."""
    from rlt_worker.kernels.gemv import RowBoundLinear, gemv

    x, w = _operands(3, 37, 300, torch.float32, "cpu")
    assert torch.equal(RowBoundLinear(3)(x, w), gemv(x, w))
    assert torch.equal(RowBoundLinear(2)(x, w), F.linear(x, w))
    assert torch.equal(RowBoundLinear(0)(x[:1], w), F.linear(x[:1], w))


def check_fused_loop_with_gemv(num_rows: int) -> None:
    """FusedOuroModel with the GEMV forced on (every pass of ≤ 16 rows), float32: loop() as the torch
    modules (2 rows: the multiply-add path; 9: tl.dot)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_fused_ops import LOOP_TOL, CausalRowsContext

    from rlt_worker.models.loader import load_model
    from rlt_worker.models.ouro_fused import FusedOuroModel

    reference = load_model("toy-ouro", dtype=torch.float32, device="cpu")
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 256, (num_rows,), generator=gen)
    positions = torch.arange(num_rows)
    ctx = CausalRowsContext()
    with torch.inference_mode():
        embedded = reference.embed(tokens, positions, ctx)
        want = reference.loop(reference.loop(embedded, embedded, positions, ctx), embedded, positions, ctx)
        fused = FusedOuroModel(reference, gemv_max_rows=16)
        state = fused.loop(fused.loop(embedded, embedded, positions, ctx), embedded, positions, ctx)
    torch.testing.assert_close(state, want, **LOOP_TOL[torch.float32])


INTERP_CASES: dict[str, Callable[[], None]] = {
    **{f"gemv-{str(d)[6:]}-m{m}": functools.partial(check_gemv, d, m)
       for d in (torch.float32, torch.bfloat16) for m in ROWS},
    **{f"row-tiles-{str(d)[6:]}": functools.partial(check_row_tiles, d) for d in (torch.float32, torch.bfloat16)},
    "row-bound-linear": check_row_bound_linear,
    **{f"fused-loop-gemv-float32-rows{n}": functools.partial(check_fused_loop_with_gemv, n) for n in (2, 9)},
}


@pytest.fixture(scope="module")
def interp_verdicts() -> dict[str, str]:
    """Run all interpreter cases once in a child with TRITON_INTERPRET=1."""
    return interp.verdicts(__file__)


@pytest.mark.parametrize("case", list(INTERP_CASES))
def test_interpreter_gemv(interp_verdicts: dict[str, str], case: str) -> None:
    """Each interpreter case (see INTERP_CASES) passed in the child."""
    verdict = interp_verdicts[case]
    assert verdict == "ok", verdict


def test_gemv_rejects_mismatched_shapes() -> None:
    from rlt_worker.kernels.gemv import GemvConfig, RowBoundLinear, gemv

    with pytest.raises(ValueError, match=r"x \[M, K\] and weight \[N, K\]"):
        gemv(torch.zeros(2, 8), torch.zeros(4, 9))
    with pytest.raises(ValueError, match="unit column strides"):
        gemv(torch.zeros(8, 2).T, torch.zeros(4, 8))
    with pytest.raises(ValueError, match="tl.dot needs blocks ≥ 16"):
        gemv(torch.zeros(2, 8), torch.zeros(4, 8), GemvConfig(block_m=16, block_n=8, block_k=32, use_dot=True))
    with pytest.raises(ValueError, match="max_rows must be ≥ 0"):
        RowBoundLinear(-1)


def test_bench_script_smoke(tmp_path: Path) -> None:
    """scripts/bench_gemv.py --device cpu --sweep (a tiny shape, interpreter) runs end to end and writes its JSON."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_gemv.py"), "--device", "cpu", "--sweep", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    import json

    results = json.loads(out.read_text())["results"]
    assert [r["rows"] for r in results] == [1, 3]
    assert all(r["gemv_us"] > 0 and r["best_us"] > 0 and r["max_abs_err"] < 0.1 for r in results)


# ---- GPU, compiled: Ouro-1.4B's loop shapes --------------------------------------------------

OURO_SHAPES = ((6144, 2048), (2048, 2048), (11264, 2048), (2048, 5632))


@pytest.mark.gpu
@interp.needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 3, 8, 16])
def test_gpu_gemv_at_ouro_shapes(dtype: torch.dtype, rows: int) -> None:
    """The compiled kernel, default blocks, within the CPU bounds at the four projection shapes."""
    from rlt_worker.kernels.gemv import gemv

    for n, k in OURO_SHAPES:
        x, w = _operands(rows, n, k, dtype, "cuda")
        assert_within_bound(gemv(x, w), x, w)


if __name__ == "__main__":
    interp.main(INTERP_CASES)
