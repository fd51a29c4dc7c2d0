"""The split-K GEMV (rlt_worker/kernels/splitk_gemv.py), its choice in FusedOuroModel, and its sweep.

CPU: in Triton's interpreter, in one child process started with TRITON_INTERPRET=1 (tests/interp.py),
float32 on tiny shapes whose N and K are not multiples of the tiles, M = 1…8 and 1…4 K slices, both
inner products (tl.dot with input_precision "ieee", and multiply-add):
  - within fp32 accumulation tolerance of the float64 product, and EXACT where every product and
    partial sum is an integer fp32 holds (so no column, K block or slice is missed or counted twice);
  - bit-identical across runs and across M for the same row (batch invariance), the tile counters
    back at zero after every launch (what a graph replay needs);
  - FusedOuroModel with split-K settings for toy-ouro's shapes equals the torch loop; without
    settings, in float64, or for a shape not listed, it keeps F.linear;
  - the bench's --sweep runs end to end on shrunken shapes.
bf16 is checked on the GPU only: the interpreter truncates fp32→bf16 casts instead of rounding them.

GPU (marked gpu): Ouro-1.4B's four packed shapes in bf16 and fp16 within half-precision tolerance of
torch's fp32 product, float32 within fp32 tolerance (tf32 would miss it by far), bit-identical
across runs and across M, and the same bits when replayed from a CUDA graph; the same for every
setting SPLITK_SETTINGS switches on.
"""

from __future__ import annotations

import functools
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import interp
import pytest
import torch
import torch.nn.functional as F

from rlt_worker.attention import triton_backend as tb

pytestmark = pytest.mark.skipif(tb.triton is None, reason="Triton is not installed")

ROOT = Path(__file__).resolve().parents[1]
F32 = dict(rtol=1e-5, atol=1e-5)
# Tiny tiles, so that the shapes below have ragged column tiles, a ragged last K block and 1…4 slices.
TINY = [dict(block_n=16, block_k=16, dot=True), dict(block_n=8, block_k=32, dot=False)]
SHAPES = [(37, 75), (50, 130), (64, 64)]  # (N, K)


def _gemv(n: int, k: int, max_rows: int = 8, device: str = "cpu", **config):
    from rlt_worker.kernels.splitk_gemv import SplitKConfig, SplitKGemv

    return SplitKGemv(n, k, SplitKConfig(**config), max_rows, device)


def _inputs(n: int, k: int, rows: int, dtype: torch.dtype, device: str, integer: bool = False):
    gen = torch.Generator().manual_seed(n * 1000 + k)
    if integer:  # |products| ≤ 9, sums ≤ 9·K: every fp32 step exact
        draw = functools.partial(torch.randint, -3, 4, generator=gen, dtype=torch.float64)
    else:
        draw = functools.partial(torch.randn, generator=gen, dtype=torch.float64)
    return draw((rows, k)).to(device, dtype), draw((n, k)).to(device, dtype)


def check_matches_torch(config: dict, dtype: torch.dtype = torch.float32, device: str = "cpu", tol=None,
                        shapes=SHAPES, splits=(1, 2, 3, 4), rows=(1, 3, 8)) -> None:
    """Every shape × slice count × row count: close to the float64 product; integers exactly."""
    for (n, k), s in ((shape, s) for shape in shapes for s in splits):
        gemv = _gemv(n, k, splits=s, device=device, **config)
        assert gemv.splits <= s
        for m in rows:
            x, w = _inputs(n, k, m, dtype, device)
            want = (x.double() @ w.double().T).to(dtype)
            got = gemv(x, w)
            assert got.dtype == dtype and got.shape == (m, n)
            where = f"{n}×{k} S{s} M{m}"
            torch.testing.assert_close(got, want, **(tol or F32), msg=lambda e, where=where: f"{where}: {e}")
            xi, wi = _inputs(n, k, m, dtype, device, integer=True)
            assert torch.equal(gemv(xi, wi), (xi.double() @ wi.double().T).to(dtype)), where


def check_batch_invariant(config: dict, dtype: torch.dtype = torch.float32, device: str = "cpu",
                          shapes=SHAPES, splits=(1, 4), prefixes=range(1, 8)) -> None:
    """Row r's bits do not depend on M (1…8) or on the other rows, nor on the run; counters end at zero."""
    for (n, k), s in ((shape, s) for shape in shapes for s in splits):
        gemv = _gemv(n, k, splits=s, device=device, **config)
        x, w = _inputs(n, k, 8, dtype, device)
        full = gemv(x, w)
        assert torch.equal(gemv(x, w), full), f"{n}×{k} S{s}: two runs differ"
        assert int(gemv._counts.abs().sum()) == 0
        for m in prefixes:
            assert torch.equal(gemv(x[:m], w), full[:m]), f"{n}×{k} S{s}: the first {m} rows"
        assert torch.equal(gemv(x[6:7], w), full[6:7]), f"{n}×{k} S{s}: row 6 alone"
        other = torch.cat([x[3:6], torch.randn_like(x[:2])])  # rows 3…5 beside other rows, at other places
        assert torch.equal(gemv(other, w)[:3], full[3:6]), f"{n}×{k} S{s}: rows 3-5 in another batch"
        # x as a row-strided view (a column slice of a wider buffer): the kernel reads row strides.
        wide = torch.zeros(8, k + 5, dtype=dtype, device=device)
        wide[:, 2 : 2 + k] = x
        assert torch.equal(gemv(wide[:, 2 : 2 + k], w), full), f"{n}×{k} S{s}: strided x"


def check_rejects() -> None:
    """Typed errors: more rows than max_rows, another shape, float64, mixed dtypes, bad settings."""
    from rlt_worker.kernels.splitk_gemv import SplitKConfig

    gemv = _gemv(37, 75, max_rows=4, **TINY[0])
    w = torch.randn(37, 75)
    for x, weight in ((torch.randn(5, 75), w), (torch.randn(2, 75), torch.randn(36, 75)),
                      (torch.randn(2, 75, dtype=torch.float64), w.double()), (torch.randn(2, 75).half(), w)):
        with pytest.raises(ValueError):
            gemv(x, weight)
    for bad in (dict(block_n=24), dict(splits=0), dict(block_n=8, dot=True)):
        with pytest.raises(ValueError):
            SplitKConfig(**bad)


def _toy_settings(dot: bool) -> dict:
    """Split-K settings for three of toy-ouro's four weight shapes (down, 64×128, stays F.linear)."""
    from rlt_worker.kernels.splitk_gemv import SplitKConfig

    return {(*shape, dtype): SplitKConfig(block_n=16, block_k=16 if dot else 32, splits=s, dot=dot)
            for shape, s in (((128, 64), 2), ((64, 64), 4), ((256, 64), 3))
            for dtype in (torch.float32, torch.float64)}  # float64 is listed, and still keeps F.linear


def check_fused_loop(dot: bool, pass_rows: tuple[int, ...]) -> None:
    """FusedOuroModel with split-K on toy-ouro (float32, interpreter) equals OuroModel.loop over 3 loops,
    for passes of 5 rows (split-K) and of 9 rows (above max_rows: F.linear)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_fused_ops import LOOP_TOL, CausalRowsContext

    from rlt_worker.models.loader import load_model
    from rlt_worker.models.ouro_fused import FusedOuroModel, RowBoundLinear

    reference = load_model("toy-ouro", dtype=torch.float32, device="cpu")
    fused = FusedOuroModel(reference, splitk=_toy_settings(dot), splitk_max_rows=8)
    assert isinstance(fused._linear, RowBoundLinear) and len(fused._linear._gemvs) == 3
    gen = torch.Generator().manual_seed(3)
    for rows in pass_rows:
        tokens = torch.randint(0, 256, (rows,), generator=gen)
        positions = torch.arange(rows)
        ctx = CausalRowsContext()
        with torch.inference_mode():
            embedded = reference.embed(tokens, positions, ctx)
            want, got = embedded, embedded
            for loop in range(1, 4):
                want = reference.loop(want, embedded, positions, ctx)
                got = fused.loop(got, embedded, positions, ctx)
                torch.testing.assert_close(got, want, **LOOP_TOL[torch.float32],
                                           msg=lambda m, where=f"{rows} rows, loop {loop}": f"{where}: {m}")


def check_torch_path_kept() -> None:
    """No settings (the default), or float64 even with settings: F.linear, no workspace."""
    from rlt_worker.models.loader import load_model
    from rlt_worker.models.ouro_fused import FusedOuroModel

    assert FusedOuroModel(load_model("toy-ouro", dtype=torch.float32, device="cpu"))._linear is F.linear
    f64 = load_model("toy-ouro", dtype=torch.float64, device="cpu")
    assert FusedOuroModel(f64, splitk=_toy_settings(True))._linear is F.linear


def check_bench_sweep() -> None:
    """scripts/bench_linear.py --sweep on shapes shrunk 64× (CPU: times are NaN): every setting of the
    grid, both inner products, lands in the JSON with its slice count, and each shape has a winner."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_linear

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "sweep.json"
        bench_linear.main(["--device", "cpu", "--shrink", "64", "--layers", "2", "--rows", "1,3", "--sweep",
                           "--block-n", "16", "--block-k", "16", "--splits", "1,2", "--stages", "1",
                           "--json", str(out)])
        report = json.loads(out.read_text())
    assert len(report["sweep"]) == 4 * 2 * 2  # shapes × (dot, multiply-add) × splits
    assert {r["splits_run"] for r in report["sweep"]} == {1, 2}
    assert set(report["winners"]) == {"q|k|v", "o", "gate|up", "down"}


# The interpreter runs a trimmed grid (a ragged slice count, the fewest and most rows): it interprets
# every program of every launch, and the whole grid cost a minute of each CI run; the GPU runs all of it.
INTERP_CASES: dict[str, Callable[[], None]] = {
    **{f"matches-torch-{'dot' if c['dot'] else 'fma'}": functools.partial(check_matches_torch, c, splits=(1, 3),
                                                                          rows=(1, 8)) for c in TINY},
    **{f"batch-invariant-{'dot' if c['dot'] else 'fma'}": functools.partial(check_batch_invariant, c,
                                                                            shapes=SHAPES[:2], prefixes=(1, 2, 5, 7))
       for c in TINY},
    "rejects": check_rejects,
    "fused-loop-dot": functools.partial(check_fused_loop, True, (5, 9)),
    "fused-loop-fma": functools.partial(check_fused_loop, False, (5,)),
    "torch-path-kept": check_torch_path_kept,
    "bench-sweep": check_bench_sweep,
}


@pytest.mark.parametrize("case", list(INTERP_CASES))
def test_interpreter(interp_verdicts: dict[str, str], case: str) -> None:
    """Each interpreter case (see INTERP_CASES) passed in the child."""
    verdict = interp_verdicts[case]
    assert verdict == "ok", verdict


def test_float32_on_a_plain_cpu_keeps_torch() -> None:
    """Without the interpreter a CPU model never gets split-K, whatever the settings say."""
    if tb._interpreting():
        pytest.skip("TRITON_INTERPRET is set in this process")
    from rlt_worker.models.loader import load_model
    from rlt_worker.models.ouro_fused import FusedOuroModel

    model = load_model("toy-ouro", dtype=torch.float32, device="cpu")
    assert FusedOuroModel(model, splitk=_toy_settings(True))._linear is F.linear


def test_winning_settings_take_only_shapes_faster_at_every_row_count() -> None:
    """bench_linear.winning_settings reads a --sweep JSON (row counts as string keys) and keeps the
    winners that beat cuBLAS at every row count, keyed as SPLITK_SETTINGS is."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_linear

    from rlt_worker.kernels.splitk_gemv import SplitKConfig

    def winner(n: int, k: int, us: dict[str, float], cublas: dict[str, float]) -> dict:
        return {"out": n, "in": k, "config": {"block_n": 16, "block_k": 512, "splits": 2, "num_warps": 4,
                                               "num_stages": 1, "dot": False}, "us": us, "cublas_us": cublas}

    report = json.loads(json.dumps({"dtype": "torch.bfloat16", "winners": {
        "o": winner(2048, 2048, {1: 5.0, 8: 6.0}, {1: 6.2, 8: 6.5}),
        "down": winner(2048, 5632, {1: 9.0, 8: 11.0}, {1: 10.7, 8: 10.9}),  # loses at 8 rows
    }}))
    assert bench_linear.winning_settings(report) == {
        (2048, 2048, torch.bfloat16): SplitKConfig(16, 512, 2, 4, 1, False)}


# ---- GPU, compiled: Ouro-1.4B's packed shapes ----------------------------------------------------

OURO_SHAPES = [(6144, 2048), (2048, 2048), (11264, 2048), (2048, 5632)]
# Half precision: the fp32 sum rounded once, against torch's fp32 product rounded once: one ulp of the
# output (2^-8 of the value for bf16) plus cancellation near zero.
HALF = {torch.bfloat16: dict(rtol=2.0**-7, atol=2e-3), torch.float16: dict(rtol=2.0**-9, atol=5e-4)}
GPU_CONFIGS = [dict(block_n=32, block_k=256, splits=4, dot=True),
               dict(block_n=8, block_k=512, splits=2, num_warps=8, num_stages=1, dot=False)]


def check_gpu(n: int, k: int, dtype: torch.dtype, config) -> None:
    """One weight on the GPU: close to torch, bit-identical across runs and M, the same bits from a graph."""
    from rlt_worker.kernels.splitk_gemv import SplitKGemv

    gemv = SplitKGemv(n, k, config, 8, "cuda")
    x, w = _inputs(n, k, 8, dtype, "cuda")
    w = w * k**-0.5  # outputs of order 1, as a layer's
    want = (x.float() @ w.float().T).to(dtype)
    full = gemv(x, w)
    torch.testing.assert_close(full, want, **(HALF.get(dtype) or F32),
                               msg=lambda e, where=f"{n}×{k} {config}": f"{where}: {e}")
    assert torch.equal(gemv(x, w), full)
    for m in (1, 3, 8):
        assert torch.equal(gemv(x[:m], w), full[:m]), f"{n}×{k}: first {m} rows"
    assert torch.equal(gemv(x[5:6], w), full[5:6])
    static_x = x[:1].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = gemv(static_x, w)
    for r in (2, 7):
        static_x.copy_(x[r : r + 1])
        graph.replay()
        assert torch.equal(static_y, full[r : r + 1]), f"{n}×{k}: graph replay, row {r}"
    assert int(gemv._counts.abs().sum()) == 0


@pytest.mark.gpu
@interp.needs_cuda
@pytest.mark.parametrize("config", GPU_CONFIGS, ids=["dot", "fma"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_ouro_shapes(config: dict, dtype: torch.dtype) -> None:
    """Both inner products at Ouro-1.4B's four packed shapes, in each dtype (check_gpu)."""
    from rlt_worker.kernels.splitk_gemv import SplitKConfig

    for n, k in OURO_SHAPES:
        check_gpu(n, k, dtype, SplitKConfig(**config))


@pytest.mark.gpu
@interp.needs_cuda
def test_gpu_switched_on_settings() -> None:
    """Every setting SPLITK_SETTINGS switches on, at its own shape and dtype (check_gpu)."""
    from rlt_worker.models.ouro_fused import SPLITK_SETTINGS

    if not SPLITK_SETTINGS:
        pytest.skip("SPLITK_SETTINGS is empty: split-K is off")
    for (n, k, dtype), config in SPLITK_SETTINGS.items():
        check_gpu(n, k, dtype, config)


if __name__ == "__main__":
    interp.main(INTERP_CASES)
