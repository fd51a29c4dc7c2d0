"""The strip GEMV (rlt_worker/kernels/strip_gemv.py) and its tier in FusedOuroModel.

CPU: in Triton's interpreter, in one child process started with TRITON_INTERPRET=1 (tests/interp.py),
float32 on tiny shapes whose N is not a multiple of the strip and whose K is a power of two, one more,
or neither (the masked low part of K), M = 1…4:
  - within fp32 accumulation tolerance of the float64 product, and EXACT where every product and
    partial sum is an integer fp32 holds (no column or element of K missed or counted twice);
  - bit-identical across runs and across M for the same row (batch invariance), also for x as a
    row-strided view;
  - FusedOuroModel with strip settings for toy-ouro's shapes equals the torch loop at one row, and
    a pass of more rows than the tier's bound keeps F.linear; typed errors for bad calls;
  - a swiglu strip (gate|up and SwiGLU in one launch) is bit for bit the strip then fused_ops.swiglu,
    and the loop with one equals the torch loop.
CPU, plain: split_k's parts of K; the default STRIP_SETTINGS cover Ouro-1.4B's packed shapes in
every supported dtype, and a plain CPU model never gets a strip.
bf16 is checked on the GPU only: the interpreter truncates fp32→bf16 casts instead of rounding them.

GPU (marked gpu): Ouro-1.4B's four packed shapes with their STRIP_SETTINGS, in bf16 and fp16 within
half-precision tolerance of torch's fp32 product and float32 within fp32 tolerance; bit-identical
across runs and M and from a CUDA graph; the swiglu strip at gate|up's shape the plain strip's bits
through fused_ops.swiglu; a q|k|v → o chain captured with PDL launches gives the plain eager chain's
bits at every replay.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import interp
import pytest
import torch
import torch.nn.functional as F
from test_splitk_gemv import F32, HALF, _inputs  # the same draws and tolerances as split-K's

from rlt_worker.attention import triton_backend as tb

pytestmark = pytest.mark.skipif(tb.triton is None, reason="Triton is not installed")

SHAPES = [(37, 64), (50, 65), (24, 100), (9, 1)]  # (N, K): K a power of two, 2^6 + 1, 64 + 36, one
CONFIGS = [dict(block_n=4, num_warps=4), dict(block_n=8, num_warps=2), dict(block_n=1, num_warps=1)]


def _gemv(n: int, k: int, max_rows: int = 4, launch=None, **config):
    from rlt_worker.kernels.launch import PLAIN
    from rlt_worker.kernels.strip_gemv import StripConfig, StripGemv

    return StripGemv(n, k, StripConfig(**config), max_rows, launch or PLAIN)


def check_matches_torch(config: dict) -> None:
    """Every shape × row count: close to the float64 product; integers exactly."""
    for n, k in SHAPES:
        gemv = _gemv(n, k, **config)
        for m in (1, 2, 4):
            x, w = _inputs(n, k, m, torch.float32, "cpu")
            got = gemv(x, w)
            assert got.dtype == torch.float32 and got.shape == (m, n)
            where = f"{n}×{k} M{m} {config}"
            torch.testing.assert_close(got, (x.double() @ w.double().T).float(), **F32,
                                       msg=lambda e, where=where: f"{where}: {e}")
            xi, wi = _inputs(n, k, m, torch.float32, "cpu", integer=True)
            assert torch.equal(gemv(xi, wi), (xi.double() @ wi.double().T).float()), where


def check_batch_invariant(config: dict) -> None:
    """Row r's bits do not depend on M or on the other rows, nor on the run, nor on x's row stride."""
    for n, k in SHAPES:
        gemv = _gemv(n, k, **config)
        x, w = _inputs(n, k, 4, torch.float32, "cpu")
        full = gemv(x, w)
        assert torch.equal(gemv(x, w), full), f"{n}×{k}: two runs differ"
        for m in (1, 3):
            assert torch.equal(gemv(x[:m], w), full[:m]), f"{n}×{k}: the first {m} rows"
        assert torch.equal(gemv(x[2:3], w), full[2:3]), f"{n}×{k}: row 2 alone"
        wide = torch.zeros(4, k + 5)
        wide[:, 2 : 2 + k] = x
        assert torch.equal(gemv(wide[:, 2 : 2 + k], w), full), f"{n}×{k}: strided x"


def check_rejects() -> None:
    """Typed errors: more rows than max_rows, another shape, float64, mixed dtypes, bad settings."""
    from rlt_worker.kernels.strip_gemv import StripConfig

    gemv = _gemv(37, 65, max_rows=2, block_n=4, num_warps=4)
    w = torch.randn(37, 65)
    for x, weight in ((torch.randn(3, 65), w), (torch.randn(2, 65), torch.randn(36, 65)),
                      (torch.randn(2, 65, dtype=torch.float64), w.double()), (torch.randn(2, 65).half(), w),
                      (torch.randn(65, 2).T, w)):
        with pytest.raises(ValueError):
            gemv(x, weight)
    for bad in (dict(block_n=3), dict(num_warps=6), dict(block_n=0)):
        with pytest.raises(ValueError):
            StripConfig(**bad)
    assert gemv(torch.randn(0, 65), w).shape == (0, 37)


def check_swiglu_equals_the_strip_then_swiglu() -> None:
    """A swiglu strip: bit for bit the plain strip's output through fused_ops.swiglu (float32), for K a
    power of two or not and M = 1…3, row r's bits the same alone; an odd gate|up height refused."""
    from rlt_worker.kernels.fused_ops import swiglu
    from rlt_worker.kernels.strip_gemv import Epilogue, StripConfig, StripGemv

    for (n, k), cfg in zip([(48, 64), (40, 100), (34, 65)], [StripConfig(4, 4), StripConfig(2, 2), StripConfig(1, 1)],
                           strict=True):
        plain, fused = StripGemv(n, k, cfg, 3), StripGemv(n, k, cfg, 3, epilogue=Epilogue.SWIGLU)
        x, w = _inputs(n, k, 3, torch.float32, "cpu")
        got = fused(x, w)
        assert got.shape == (3, n // 2)
        assert torch.equal(got, swiglu(plain(x, w))), f"{n}×{k} {cfg}"
        assert torch.equal(fused(x[1:2], w), got[1:2]), f"{n}×{k}: row 1 alone"
    with pytest.raises(ValueError, match="even"):
        StripGemv(35, 64, StripConfig(), 1, epilogue=Epilogue.SWIGLU)


def check_gated_strip() -> None:
    """A gated call (`needed`): with any row needed every row's bits are the ungated call's, with none
    every row is 0 (plain and swiglu strips, K a power of two or not, M = 1…3); a needed that is not
    bool [M] refused."""
    from rlt_worker.kernels.strip_gemv import Epilogue, StripConfig, StripGemv

    for (n, k), epilogue in zip([(37, 64), (48, 65), (24, 100)], [Epilogue.STORE, Epilogue.SWIGLU, Epilogue.STORE],
                                strict=True):
        strip = StripGemv(n, k, StripConfig(4, 2), 3, epilogue=epilogue)
        for m in (1, 2, 3):
            x, w = _inputs(n, k, m, torch.float32, "cpu")
            want = strip(x, w)
            for needed in ([True] + [False] * (m - 1), [False] * (m - 1) + [True], [True] * m):
                assert torch.equal(strip(x, w, torch.tensor(needed)), want), f"{n}×{k} {epilogue} {needed}"
            none = strip(x, w, torch.zeros(m, dtype=torch.bool))
            assert none.shape == want.shape and not none.any(), f"{n}×{k} {epilogue} M{m}: none needed"
    for bad in (torch.ones(2, dtype=torch.bool), torch.ones(3, dtype=torch.int32)):
        with pytest.raises(ValueError, match="needed"):
            strip(x, w, bad)


def check_strip_head() -> None:
    """FusedOuroModel's head through a strip (toy-ouro's 264×64): lm_head close to the reference's
    head; lm_head_needed bit for bit lm_head where a row is needed, 0 where none is; past
    strip_max_rows both are the reference's head."""
    from test_fused_ops import LOOP_TOL

    from rlt_worker.kernels.strip_gemv import StripConfig
    from rlt_worker.models.loader import load_model
    from rlt_worker.models.ouro_fused import FusedOuroModel

    reference = load_model("toy-ouro", dtype=torch.float32, device="cpu")
    model = FusedOuroModel(reference, head_strip={(264, 64, torch.float32): StripConfig(8, 2)})
    assert list(model._head.strips) == [(264, 64, torch.float32)]
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        one = model.lm_head(hidden[:1])
        torch.testing.assert_close(one, reference.lm_head(hidden[:1]), **LOOP_TOL[torch.float32])
        assert torch.equal(model.lm_head_needed(hidden[:1], torch.ones(1, dtype=torch.bool)), one)
        assert not model.lm_head_needed(hidden[:1], torch.zeros(1, dtype=torch.bool)).any()
        three = model.lm_head_needed(hidden, torch.zeros(3, dtype=torch.bool))
        assert torch.equal(three, reference.lm_head(hidden)) and torch.equal(model.lm_head(hidden), three)


def check_fused_loop_with_epilogue_strips() -> None:
    """FusedOuroModel on toy-ouro (float32) with a swiglu strip, over a paged context one row a pass (a
    sequence's positions 0…4, 3 loops, each loop its own pool): every state and both caches bit for
    bit those of the same model without it (the strip, then swiglu's launch), and within LOOP_TOL of
    OuroModel.loop; at 3 rows a pass (above strip_max_rows) the composition runs, with the same bits."""
    from test_fused_ops import LOOP_TOL

    from rlt_worker.kernels.strip_gemv import StripConfig
    from rlt_worker.kv_storage import KVStorage
    from rlt_worker.models.loader import load_model
    from rlt_worker.models.ouro_fused import FusedOuroModel
    from rlt_worker.paged_context import PagedContext, PagedPlaneView

    reference = load_model("toy-ouro", dtype=torch.float32, device="cpu")
    models = {"composed": FusedOuroModel(reference, strip=_toy_strips()),
              "fused": FusedOuroModel(reference, strip=_toy_strips(),
                                      strip_swiglu={(256, 64, torch.float32): StripConfig(4, 2)})}
    assert list(models["fused"]._gate_up_swiglu.strips) == [(256, 64, torch.float32)]
    info, block_size = reference.info, 4
    tokens = torch.randint(0, 256, (5,), generator=torch.Generator().manual_seed(5))
    table = torch.tensor([[3, 0]], dtype=torch.int32)

    def run(model, rows_per_pass: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        pools = [KVStorage(info, 4, block_size, torch.float32, "cpu") for _ in range(3)]
        states = []
        for start in range(0, 5, rows_per_pass):
            positions = torch.arange(start, min(5, start + rows_per_pass))
            ctx = PagedContext(pools[0], tb, positions,
                               PagedPlaneView(table.expand(len(positions), -1), positions, block_size), None)
            embedded = state = reference.embed(tokens[positions], positions, ctx)
            for loop in range(3):
                ctx = PagedContext(pools[loop], tb, positions,
                                   PagedPlaneView(table.expand(len(positions), -1), positions, block_size), None)
                state = model.loop(state, embedded, positions, ctx)
                states.append(state)
        return states, [p.pool for p in pools]

    with torch.inference_mode():
        want_states, want_pools = run(models["composed"], 1)
        ref_states, _ = run(reference, 1)
        states, pools = run(models["fused"], 1)
        assert all(torch.equal(a, b) for a, b in zip(states, want_states, strict=True)), "states"
        assert all(torch.equal(a, b) for a, b in zip(pools, want_pools, strict=True)), "caches"
        for got, want in zip(want_states, ref_states, strict=True):
            torch.testing.assert_close(got, want, **LOOP_TOL[torch.float32])
        wide, _ = run(models["fused"], 3)
        composed, _ = run(models["composed"], 3)
        assert all(torch.equal(a, b) for a, b in zip(wide, composed, strict=True)), "3 rows a pass"


def _toy_strips() -> dict:
    """Strip settings for three of toy-ouro's four weight shapes (down, 64×128, stays F.linear)."""
    from rlt_worker.kernels.strip_gemv import StripConfig

    return {(*shape, dtype): StripConfig(block_n=bn, num_warps=2)
            for shape, bn in (((128, 64), 4), ((64, 64), 8), ((256, 64), 16))
            for dtype in (torch.float32, torch.float64)}  # float64 is listed, and still keeps F.linear


def check_fused_loop() -> None:
    """FusedOuroModel with strips on toy-ouro (float32, interpreter) equals OuroModel.loop over 3 loops,
    for a pass of 1 row (strips) and of 3 rows (above strip_max_rows: F.linear)."""
    from test_splitk_gemv import assert_fused_loops_equal

    from rlt_worker.models.loader import load_model
    from rlt_worker.models.ouro_fused import FusedOuroModel, RowBoundLinear

    reference = load_model("toy-ouro", dtype=torch.float32, device="cpu")
    fused = FusedOuroModel(reference, strip=_toy_strips(), strip_max_rows=1)
    assert isinstance(fused._linear, RowBoundLinear) and [(b, len(g)) for b, g in fused._linear.tiers] == [(1, 3)]
    assert_fused_loops_equal(reference, fused, (1, 3))
    f64 = load_model("toy-ouro", dtype=torch.float64, device="cpu")
    assert FusedOuroModel(f64, strip=_toy_strips())._linear is F.linear


def check_fused_loop_with_swiglu_strips() -> None:
    """The same with swiglu strips on toy-ouro's gate|up (256×64) as well: the loop equals the torch loop
    at 1 row (the swiglu strip) and at 3 (the GEMM, then swiglu's launch)."""
    from test_splitk_gemv import assert_fused_loops_equal

    from rlt_worker.kernels.strip_gemv import StripConfig
    from rlt_worker.models.loader import load_model
    from rlt_worker.models.ouro_fused import FusedOuroModel

    reference = load_model("toy-ouro", dtype=torch.float32, device="cpu")
    fused = FusedOuroModel(reference, strip=_toy_strips(), strip_max_rows=1,
                           strip_swiglu={(256, 64, torch.float32): StripConfig(4, 2)})
    assert list(fused._gate_up_swiglu.strips) == [(256, 64, torch.float32)]
    assert_fused_loops_equal(reference, fused, (1, 3))


def check_bench_chain() -> None:
    """scripts/bench_gemv_chain.py's strip candidates start with the model's settings, and its chain
    through strips equals its chain through F.linear (assert_bench_chain_equals_torch)."""
    import sys

    from test_splitk_gemv import assert_bench_chain_equals_torch

    sys.path.insert(0, str(interp.ROOT / "scripts"))
    import bench_gemv_chain as bench

    from rlt_worker.models.ouro_fused import STRIP_SETTINGS

    for name, n, k in bench.LAYER:
        assert bench.strip_candidates(name)[0] == STRIP_SETTINGS[(n, k, torch.bfloat16)]
    assert_bench_chain_equals_torch("strip", lambda name: bench.strip_candidates(name)[0], 4, (1, 3))


INTERP_CASES: dict[str, Callable[[], None]] = {
    **{f"matches-torch-N{c['block_n']}w{c['num_warps']}": functools.partial(check_matches_torch, c) for c in CONFIGS},
    **{f"batch-invariant-N{c['block_n']}w{c['num_warps']}": functools.partial(check_batch_invariant, c)
       for c in CONFIGS[:2]},
    "rejects": check_rejects,
    "gated": check_gated_strip,
    "strip-head": check_strip_head,
    "fused-loop": check_fused_loop,
    "swiglu-strip": check_swiglu_equals_the_strip_then_swiglu,
    "fused-loop-swiglu": check_fused_loop_with_swiglu_strips,
    "bench-chain": check_bench_chain,
    "fused-loop-epilogues": check_fused_loop_with_epilogue_strips,
}


@pytest.mark.parametrize("case", list(INTERP_CASES))
def test_interpreter(interp_verdicts: dict[str, str], case: str) -> None:
    """Each interpreter case (see INTERP_CASES) passed in the child."""
    verdict = interp_verdicts[case]
    assert verdict == "ok", verdict


def test_split_k_is_the_largest_power_of_two_and_the_padded_rest() -> None:
    from rlt_worker.kernels.strip_gemv import split_k

    assert split_k(2048) == (2048, 0, 1)
    assert split_k(5632) == (4096, 1536, 2048)
    assert split_k(65) == (64, 1, 1)
    assert split_k(100) == (64, 36, 64)
    assert split_k(1) == (1, 0, 1)


def test_default_strips_cover_ouro_1_4b_in_every_supported_dtype_and_a_plain_cpu_keeps_torch() -> None:
    from rlt_worker.kernels.strip_gemv import SUPPORTED_DTYPES
    from rlt_worker.models.ouro_fused import STRIP_MAX_ROWS, STRIP_SETTINGS, STRIP_SWIGLU_SETTINGS, FusedOuroModel

    shapes = {(6144, 2048), (2048, 2048), (11264, 2048), (2048, 5632)}
    assert set(STRIP_SETTINGS) == {(*s, d) for s in shapes for d in SUPPORTED_DTYPES}
    assert set(STRIP_SWIGLU_SETTINGS) == {(11264, 2048, d) for d in SUPPORTED_DTYPES}  # gate|up
    assert STRIP_MAX_ROWS >= 1
    if tb._interpreting():
        pytest.skip("TRITON_INTERPRET is set in this process")
    from rlt_worker.models.loader import load_model

    model = load_model("toy-ouro", dtype=torch.float32, device="cpu")
    assert FusedOuroModel(model, strip=_toy_strips())._linear is F.linear


# ---- GPU, compiled: Ouro-1.4B's packed shapes ----------------------------------------------------

def check_gpu(n: int, k: int, dtype: torch.dtype, config, max_rows: int = 4) -> None:
    """One weight on the GPU: close to torch, bit-identical across runs and M, the same bits from a graph."""
    from rlt_worker.kernels.strip_gemv import StripGemv

    gemv = StripGemv(n, k, config, max_rows)
    x, w = _inputs(n, k, max_rows, dtype, "cuda")
    w = w * k**-0.5  # outputs of order 1, as a layer's
    want = (x.float() @ w.float().T).to(dtype)
    full = gemv(x, w)
    torch.testing.assert_close(full, want, **(HALF.get(dtype) or F32),
                               msg=lambda e, where=f"{n}×{k} {dtype} {config}": f"{where}: {e}")
    assert torch.equal(gemv(x, w), full)
    for m in range(1, max_rows):
        assert torch.equal(gemv(x[:m], w), full[:m]), f"{n}×{k}: first {m} rows"
    assert torch.equal(gemv(x[max_rows - 1 :], w), full[max_rows - 1 :])
    static_x = x[:1].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = gemv(static_x, w)
    for r in (max_rows - 1, 0):
        static_x.copy_(x[r : r + 1])
        graph.replay()
        assert torch.equal(static_y, full[r : r + 1]), f"{n}×{k}: graph replay, row {r}"


@pytest.mark.gpu
@interp.needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_ouro_shapes(dtype: torch.dtype) -> None:
    """STRIP_SETTINGS at Ouro-1.4B's four packed shapes, in each dtype (check_gpu)."""
    from rlt_worker.models.ouro_fused import STRIP_SETTINGS

    for (n, k, key_dtype), config in STRIP_SETTINGS.items():
        if key_dtype == dtype:
            check_gpu(n, k, dtype, config)


@pytest.mark.gpu
@interp.needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_gated_head_strip(dtype: torch.dtype) -> None:
    """Ouro-1.4B's LM head (49152×2048) through the gated strip of the profile's candidate, under PDL
    and from a CUDA graph whose needed row flips between replays: the ungated bits where it is
    needed, zeros where not."""
    from rlt_worker.kernels.launch import KernelLaunch
    from rlt_worker.kernels.strip_gemv import StripConfig, StripGemv

    n, k = 49152, 2048
    strip = StripGemv(n, k, StripConfig(4, 4), 1, KernelLaunch.for_device(True, torch.device("cuda")))
    x, w = _inputs(n, k, 1, dtype, "cuda")
    want = strip(x, w)
    needed = torch.ones(1, dtype=torch.bool, device="cuda")
    assert torch.equal(strip(x, w, needed), want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = strip(x, w, needed)
    for flag in (False, True, False):
        needed.fill_(flag)
        graph.replay()
        assert torch.equal(got, want) if flag else not got.any(), f"needed {flag}"


@pytest.mark.gpu
@interp.needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_swiglu_strip_equals_the_strip_then_swiglu(dtype: torch.dtype) -> None:
    """Ouro-1.4B's gate|up (11264×2048) with the SwiGLU epilogue: the plain strip's bits through
    fused_ops.swiglu, eagerly and from a CUDA graph."""
    from rlt_worker.kernels.fused_ops import swiglu
    from rlt_worker.kernels.strip_gemv import Epilogue, StripConfig, StripGemv

    n, k = 11264, 2048
    x, w = _inputs(n, k, 1, dtype, "cuda")
    w = w * k**-0.5
    want = swiglu(StripGemv(n, k, StripConfig(4, 4), 1)(x, w))
    fused = StripGemv(n, k, StripConfig(2, 4), 1, epilogue=Epilogue.SWIGLU)
    assert torch.equal(fused(x, w), want)
    static_x = torch.zeros_like(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = fused(static_x, w)
    static_x.copy_(x)
    graph.replay()
    assert torch.equal(static_y, want)


@pytest.mark.gpu
@interp.needs_cuda
def test_gpu_pdl_chain_equals_plain_in_a_graph() -> None:
    """q|k|v then o on q's columns, captured in a CUDA graph with PDL launches and with plain ones:
    every replay gives the eager plain chain's bits."""
    from rlt_worker.kernels.launch import PLAIN, KernelLaunch
    from rlt_worker.kernels.strip_gemv import StripConfig, StripGemv

    pdl = KernelLaunch.for_device(True, torch.device("cuda"))
    assert pdl.pdl, f"{torch.cuda.get_device_name()} has no PDL (sm_90+)"
    (n1, k1), (n2, k2) = (6144, 2048), (2048, 2048)
    gen = torch.Generator(device="cuda").manual_seed(0)
    w1 = (torch.randn(n1, k1, device="cuda", generator=gen) * k1**-0.5).bfloat16()
    w2 = (torch.randn(n2, k2, device="cuda", generator=gen) * k2**-0.5).bfloat16()
    xs = torch.randn(3, 1, k1, device="cuda", generator=gen).bfloat16()

    def chain(launch: KernelLaunch) -> Callable[[torch.Tensor], torch.Tensor]:
        g1, g2 = StripGemv(n1, k1, StripConfig(2, 4), 1, launch), StripGemv(n2, k2, StripConfig(4, 4), 1, launch)
        return lambda x: g2(g1(x, w1)[:, :k2], w2)

    run_plain = chain(PLAIN)
    want = [run_plain(x) for x in xs]
    for launch in (PLAIN, pdl):
        run = chain(launch)
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


if __name__ == "__main__":
    interp.main(INTERP_CASES)
