"""The split-K GEMV (rlt_worker/kernels/splitk_gemv.py), its choice in FusedOuroModel, and its sweep.

CPU: in Triton's interpreter, in one child process started with TRITON_INTERPRET=1 (tests/interp.py),
float32 on tiny shapes whose N and K are not multiples of the tiles, M = 1…8 and 1…4 K slices, both
inner products (tl.dot with input_precision "ieee", and multiply-add):
  - within fp32 accumulation tolerance of the float64 product, and EXACT where every product and
    partial sum is an integer fp32 holds (so no column, K block or slice is missed or counted twice);
  - bit-identical across runs and across M for the same row (batch invariance), the tile counters
    back at zero after every launch (what a graph replay needs); also for slices of 3-9 K blocks
    (the loop-carried W tile and its masked load past each slice's end);
  - FusedOuroModel with split-K settings for toy-ouro's shapes equals the torch loop; without
    settings, in float64, or for a shape not listed, it keeps F.linear;
  - the bench's --sweep runs end to end on shrunken shapes; bench_gemv_chain's chain through
    split-K equals its chain through F.linear.
CPU, plain: bench_gemv_chain's helpers (a layer's bytes, the chain's column slices, its candidate
settings) and its refusal to run without CUDA.
bf16 is checked on the GPU only: the interpreter truncates fp32→bf16 casts instead of rounding them.

GPU (marked gpu): Ouro-1.4B's four packed shapes in bf16 and fp16 within half-precision tolerance of
torch's fp32 product, float32 within fp32 tolerance (tf32 would miss it by far), bit-identical
across runs and across M, and the same bits when replayed from a CUDA graph; the same for every
setting SPLITK_SETTINGS switches on. Two chained GEMVs captured with PDL launches and with plain
ones: every replay the eager plain chain's bits.
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


def _interpreted_dot(config: dict, device: str) -> bool:
    """Under the interpreter a tl.dot is numpy's matmul, whose summation order may depend on where a
    row sits in the block (OpenBLAS 0.3.31 on an AMD EPYC VM: row 6 alone ≠ row 6 of 8). That
    order is the BLAS's, not the kernel's, so there the bitwise checks take integer inputs (exact in
    any order): they still catch a row reading another row's products, a block missed or counted
    twice. The order itself is checked where it is the kernel's: on the GPU."""
    return config["dot"] and device == "cpu"


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
        x, w = _inputs(n, k, 8, dtype, device, integer=_interpreted_dot(config, device))
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


def assert_fused_loops_equal(reference, fused, pass_rows: tuple[int, ...]) -> None:
    """fused.loop equals reference.loop (OuroModel, float32) over 3 loops, for passes of each row count."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_fused_ops import LOOP_TOL, CausalRowsContext

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


def check_fused_loop(dot: bool, pass_rows: tuple[int, ...]) -> None:
    """FusedOuroModel with split-K on toy-ouro (float32, interpreter) equals OuroModel.loop over 3 loops,
    for passes of 5 rows (split-K) and of 9 rows (above max_rows: F.linear)."""
    from rlt_worker.models.loader import load_model
    from rlt_worker.models.ouro_fused import FusedOuroModel, RowBoundLinear

    reference = load_model("toy-ouro", dtype=torch.float32, device="cpu")
    fused = FusedOuroModel(reference, splitk=_toy_settings(dot), splitk_max_rows=8)
    assert isinstance(fused._linear, RowBoundLinear) and [len(g) for _, g in fused._linear.tiers] == [3]
    assert_fused_loops_equal(reference, fused, pass_rows)


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


def check_slices_of_many_blocks(config: dict) -> None:
    """K = 130 in 9 blocks of 16, as 1, 2 and 3 slices (9, 5 + 4, 3 + 3 + 3 blocks): the loop-carried
    W tile and its masked load past each slice's end. Integers exactly (no block missed or counted
    twice), and row r's bits the same alone, at every M and across runs."""
    n, k = 50, 130
    for s in (1, 2, 3):
        gemv = _gemv(n, k, splits=s, **config)
        assert gemv.splits == s
        xi, wi = _inputs(n, k, 8, torch.float32, "cpu", integer=True)
        assert torch.equal(gemv(xi, wi), (xi.double() @ wi.double().T).float()), f"S{s}: integers"
        x, w = _inputs(n, k, 8, torch.float32, "cpu", integer=_interpreted_dot(config, "cpu"))
        full = gemv(x, w)
        torch.testing.assert_close(full, (x.double() @ w.double().T).float(), **F32)
        assert torch.equal(gemv(x, w), full), f"S{s}: two runs differ"
        for m in (1, 4):
            assert torch.equal(gemv(x[:m], w), full[:m]), f"S{s}: the first {m} rows"
        assert torch.equal(gemv(x[7:8], w), full[7:8]), f"S{s}: row 7 alone"


def assert_bench_chain_equals_torch(family: str, configs_of: Callable[[str], object], max_rows: int,
                                    pass_rows: tuple[int, ...]) -> None:
    """scripts/bench_gemv_chain.py's chain through `family`'s GEMVs (Ouro's shapes shrunk 64×, 2 layers,
    float32, the setting configs_of(shape name)) equals its chain through F.linear at each row count:
    each GEMV reads a column slice of the last one's output, as F.linear's chain does."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_gemv_chain as bench

    from rlt_worker.kernels.launch import PLAIN

    shrunk = tuple((name, n // 64, k // 64) for name, n, k in bench.LAYER)
    gen = torch.Generator().manual_seed(1)
    layers = [[torch.randn(n, k, generator=gen) * k**-0.5 for _, n, k in shrunk] for _ in range(2)]
    configs = {name: configs_of(name) for name, _, _ in shrunk}
    gemvs = bench.make_gemvs(configs, PLAIN, max_rows, torch.device("cpu"), shrunk, family=family)
    for rows in pass_rows:
        x = torch.randn(rows, shrunk[0][2], generator=gen)
        got = bench.run_chain(bench.gemv_linear(gemvs), layers, x)
        torch.testing.assert_close(got, bench.run_chain(F.linear, layers, x), **F32)


def check_bench_chain() -> None:
    """The bench's chain through split-K equals its chain through F.linear (assert_bench_chain_equals_torch)."""
    from rlt_worker.kernels.splitk_gemv import SplitKConfig

    assert_bench_chain_equals_torch("splitk", lambda name: SplitKConfig(block_n=16, block_k=16, splits=2), 8, (1, 5))


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
    **{f"slices-of-many-blocks-{'dot' if c['dot'] else 'fma'}": functools.partial(check_slices_of_many_blocks, c)
       for c in TINY},
    "bench-chain": check_bench_chain,
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


def test_bench_gemv_chain_slices_columns_and_lists_valid_candidates() -> None:
    """bench_gemv_chain's pure parts: a layer is 102.76 MB of bf16; each GEMV reads the first K columns
    of its predecessor's output as a view (and refuses a narrower one); the chain over F.linear is
    that composition; every candidate is a tl.dot SplitKConfig that runs the slices it asks for, at
    most 6 distinct ones a shape."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_gemv_chain as bench

    from rlt_worker.kernels.splitk_gemv import SplitKConfig, SplitKGemv

    assert bench.layer_bytes() == 102_760_448
    assert [(n, k) for _, n, k in bench.LAYER] == [(6144, 2048), (2048, 2048), (11264, 2048), (2048, 5632)]
    y = torch.arange(3 * 12.0).view(3, 12)
    view = bench.chain_input(y, 5)
    assert view.shape == (3, 5) and view.data_ptr() == y.data_ptr() and view.stride() == (12, 1)
    assert torch.equal(view, y[:, :5])
    with pytest.raises(ValueError):
        bench.chain_input(y, 13)
    gen = torch.Generator().manual_seed(0)
    shapes = [(12, 4), (4, 4), (10, 4), (4, 5)]  # q|k|v, o, gate|up, down in miniature
    layers = [[torch.randn(n, k, generator=gen) for n, k in shapes] for _ in range(2)]
    x = torch.randn(2, 4, generator=gen)
    want = x
    for weights in layers:
        for w in weights:
            want = want[:, : w.shape[1]] @ w.T
    torch.testing.assert_close(bench.run_chain(F.linear, layers, x), want)
    assert set(bench.CANDIDATES) == {name for name, _, _ in bench.LAYER}
    for name, n, k in bench.LAYER:
        configs = bench.candidates(name)
        assert 1 <= len(configs) <= 6 and len(set(configs)) == len(configs), name
        for cfg in configs:
            assert isinstance(cfg, SplitKConfig) and cfg.dot
            assert SplitKGemv(n, k, cfg, bench.SPLITK_MAX_ROWS, "cpu").splits == cfg.splits, (name, cfg)


def test_bench_gemv_chain_refuses_to_run_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_gemv_chain as bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="CUDA GPU"):
        bench.main([])


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


@pytest.mark.gpu
@interp.needs_cuda
def test_gpu_pdl_chain_of_two_gemvs_equals_plain_in_a_graph() -> None:
    """q|k|v then o on q's columns (both split over K, several K blocks a slice), captured in a CUDA
    graph with PDL launches and with plain ones: every replay gives the eager plain chain's bits."""
    from rlt_worker.kernels.launch import PLAIN, KernelLaunch
    from rlt_worker.kernels.splitk_gemv import SplitKConfig, SplitKGemv

    pdl = KernelLaunch.for_device(True, torch.device("cuda"))
    assert pdl.pdl, f"{torch.cuda.get_device_name()} has no PDL (sm_90+)"
    (n1, k1), (n2, k2) = OURO_SHAPES[0], OURO_SHAPES[1]
    cfg = SplitKConfig(block_n=32, block_k=256, splits=2)  # 4 K blocks a slice
    gen = torch.Generator(device="cuda").manual_seed(0)
    w1 = (torch.randn(n1, k1, device="cuda", generator=gen) * k1**-0.5).bfloat16()
    w2 = (torch.randn(n2, k2, device="cuda", generator=gen) * k2**-0.5).bfloat16()
    xs = torch.randn(3, 8, k1, device="cuda", generator=gen).bfloat16()

    def chain(launch: KernelLaunch) -> tuple[Callable[[torch.Tensor], torch.Tensor], list[SplitKGemv]]:
        g1, g2 = (SplitKGemv(n, k, cfg, 8, "cuda", launch) for n, k in ((n1, k1), (n2, k2)))
        return (lambda x: g2(g1(x, w1)[:, :k2], w2)), [g1, g2]

    run_plain, _ = chain(PLAIN)
    want = [run_plain(x) for x in xs]
    torch.testing.assert_close(want[0], (xs[0].float() @ w1.float().T).bfloat16()[:, :k2].float()
                               .matmul(w2.float().T).bfloat16(), **HALF[torch.bfloat16])
    for launch in (PLAIN, pdl):
        run, gemvs = chain(launch)
        static_x = xs[0].clone()
        run(static_x)  # compiled before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = run(static_x)
        for i in (1, 2, 0, 1):
            static_x.copy_(xs[i])
            graph.replay()
            assert torch.equal(static_y, want[i]), f"{launch}: replay of input {i}"
        assert all(int(g._counts.abs().sum()) == 0 for g in gemvs)


if __name__ == "__main__":
    interp.main(INTERP_CASES)
