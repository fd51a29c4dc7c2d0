"""Programmatic dependent launch of the decode pass's Triton kernels (rlt_worker/kernels/launch.py).

CPU: the switch resolves to plain launches wherever PDL cannot run (the CPU, the interpreter, the
torch backend, a config that asks for none), and each of the seven kernels compiled for sm_90 by
Triton's own compiler (no GPU needed: PTX through the bundled ptxas) orders its PTX as the PDL
contract says: one griddepcontrol.wait, launch_dependents right after it, every store after it,
and before it no global load but add + RMSNorm's norm weights and the attention's context length and
block table, from which it asks the L2 for its first tile's K/V lines (prefetch.global.L2, nothing
after the wait); with PDL off, no griddepcontrol and no prefetch at all. The split-K GEMV (tl.dot
with split-K, multiply-add without) loads its slice's first weight
tile before the wait and calls launch_dependents after its K loop, before any store or atomic; the
strip GEMV loads its whole weight strip before the wait and nothing else. A row-bounded launch
(`pdl_max_rows`) launches larger passes plainly.
The interpreter has no grid dependency control, so it only ever runs the kernels with PDL off
(the rest of the suite).

GPU (marked gpu): one fused loop pass of synthetic-ouro-1.4b (bf16, context 1,024) captured in a
CUDA graph with PDL on and with it off, rows 1 (split attention + merge) and 32 (no split): every
replay's output bit for bit the same. And the engine with `launch_pdl` (synthetic-ouro-1.4b, bf16,
one request at a time): its worker's fused model and attention backend launch with PDL bounded to
one row, and greedy tokens equal the plain engine's.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch

from rlt_engine.config import EngineConfig
from rlt_worker.attention import get_backend
from rlt_worker.attention import triton_backend as tb
from rlt_worker.kernels import fused_ops
from rlt_worker.kernels.launch import PLAIN, KernelLaunch
from rlt_worker.kernels.offline_compile import OURO_ATTENTION_TYPES, compile_for, ouro_attention_constexprs

pytestmark = pytest.mark.skipif(tb.triton is None, reason="Triton is not installed")


def test_pdl_is_chosen_for_cuda_with_triton_only_and_on_by_default() -> None:
    assert EngineConfig(device="cuda").resolved().launch_pdl is True
    assert EngineConfig(device="cuda", launch_pdl=False).resolved().launch_pdl is False
    assert EngineConfig(device="cpu", launch_pdl=True).resolved().launch_pdl is False
    assert EngineConfig(device="cuda", attention_backend="torch", launch_pdl=True).resolved().launch_pdl is False
    cuda = EngineConfig(device="cuda", launch_pdl=True).resolved()
    assert cuda.launch_pdl is True and cuda.worker_config("cuda").launch_pdl is True


def test_launch_for_a_device_without_pdl_is_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert KernelLaunch.for_device(False, torch.device("cpu")) is PLAIN
    assert KernelLaunch.for_device(True, torch.device("cpu")) is PLAIN
    assert KernelLaunch(pdl=True).kwargs(32, num_warps=4) == {"num_warps": 4, "PDL": True, "launch_pdl": True}
    assert PLAIN.kwargs(1, num_warps=4) == {"num_warps": 4, "PDL": False, "launch_pdl": False}


def test_a_row_bound_launches_larger_passes_plainly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    bounded = KernelLaunch(pdl=True).bounded(1)
    assert bounded.pdl_max_rows == 1 and bounded.bounded(4).pdl_max_rows == 1 and bounded.bounded(0).pdl_max_rows == 0
    assert bounded.kwargs(1)["launch_pdl"] is True and bounded.kwargs(2) == {"PDL": False, "launch_pdl": False}
    assert KernelLaunch(pdl=True).bounded(0).kwargs(1)["PDL"] is False
    assert PLAIN.bounded(8) is PLAIN
    with pytest.raises(ValueError, match="pdl_max_rows"):
        KernelLaunch(pdl=True, pdl_max_rows=-1)


def test_the_interpreter_never_launches_with_pdl(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="compiled kernels"):
        KernelLaunch(pdl=True)
    assert PLAIN.kwargs(1, num_warps=4) == {"PDL": False}  # the interpreter takes no compile options


def test_backends_under_pdl(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    pdl = KernelLaunch(pdl=True)
    assert get_backend("triton") is tb
    with pytest.raises(ValueError, match="Triton kernels"):
        get_backend("torch", pdl)
    launched = get_backend("triton", pdl)
    assert launched.paged_attention.keywords == {"launch": pdl}
    assert launched.write_kv_rotary.keywords == {"launch": pdl}
    # The kernels PDL does not cover run as the plain backend's.
    assert (launched.write_kv, launched.finalize_kv, launched.prefill_attention) == (
        tb.write_kv, tb.finalize_kv, tb.prefill_attention)


# ---- PTX order, compiled for sm_90 on the CPU ---------------------------------------------------

# Each kernel at Ouro-1.4B widths (bf16): constexprs, pointer/scalar types that differ from the
# default (*bf16 for a pointer, i32 for a scalar), compile options.
KERNELS: dict[str, tuple[Callable[..., object], dict, dict, dict]] = {
    "add_rmsnorm": (fused_ops._add_rmsnorm_kernel,
                    dict(HAS_RESIDUAL=True, BLOCK=2048, F64=False, LIBDEVICE=True),
                    {"eps_ptr": "*fp64", "inv_n": "fp32", "eps": "fp32"}, dict(num_warps=8, enable_fp_fusion=False)),
    "rope": (fused_ops._rope_qk_kernel,
             dict(NUM_HEADS=32, NUM_OUT=16, HEADS_PAD=32, HALF=64, HALF_PAD=64, KV_HEADS=16, KV_PAD=16,
                  BLOCK_SIZE=16, TO_CACHE=True, F64=False),
             {"pos_ptr": "*i64", "slot_ptr": "*i64"}, dict(num_warps=4, enable_fp_fusion=False)),
    "swiglu": (fused_ops._swiglu_kernel, dict(BLOCK=1024, F64=False, LIBDEVICE=True), {},
               dict(num_warps=4, enable_fp_fusion=False)),
    **{name: (tb._attn_kernel, ouro_attention_constexprs(rotary=rotary, store_first=first), OURO_ATTENTION_TYPES,
              dict(num_warps=tb.ATTENTION_WARPS, num_stages=3, enable_fp_fusion=False))
       for name, rotary, first in (("attention", False, False), ("attention_rotary", True, False),
                                   ("attention_rotary_store_first", True, True))},
    "merge": (tb._merge_kernel, dict(HEAD_DIM=128, D_PAD=128, NUM_SPLITS=8, S_PAD=8, ACC_F64=False),
              {"m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32"}, {}),
}
_MEMORY_OP = re.compile(r"\b(griddepcontrol\.\w+|ld\.global|st\.global|cp\.async|atom\.global|red\.global"
                        r"|prefetch\.global\.L2)")


# The split-K GEMV (kernels/splitk_gemv.py) at Ouro-1.4B's o shape in bf16, with the divisibility the
# JIT sees there (every pointer, N, K, the strides and k_per_split are multiples of 16): tl.dot with
# x's cp.async ring and split-K's partials and counters, and multiply-add without slices.
SPLITK_KERNELS: dict[str, tuple[dict, dict]] = {
    "splitk_dot": (dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, EVEN_K=True, SPLIT=True, DOT=True, PRECISION=None),
                   dict(num_warps=4, num_stages=3)),
    "splitk_fma": (dict(BLOCK_M=8, BLOCK_N=8, BLOCK_K=512, EVEN_K=True, SPLIT=False, DOT=False, PRECISION=None),
                   dict(num_warps=4, num_stages=1)),
}
SPLITK_TYPES = {"part_ptr": "*fp32", "count_ptr": "*i32"}
# The strip GEMV (kernels/strip_gemv.py) at q|k|v's K (a power of two) and down's (4096 + 1536 lanes),
# its SwiGLU epilogue (gate|up's) and its gated form (the LM head's).
_PLAIN_STRIP = dict(SWIGLU=False, GROUP=1, LIBDEVICE=True, GATED=False, ROWS_PAD=1)
STRIP_KERNELS: dict[str, tuple[dict, dict]] = {
    "strip_pow2": (dict(_PLAIN_STRIP, BLOCK_N=2, K_HI=2048, K_LO=0, K_LO_PAD=1), dict(num_warps=4, num_stages=1)),
    "strip_rest": (dict(_PLAIN_STRIP, BLOCK_N=1, K_HI=4096, K_LO=1536, K_LO_PAD=2048),
                   dict(num_warps=4, num_stages=1)),
    "strip_swiglu": (dict(_PLAIN_STRIP, BLOCK_N=2, K_HI=2048, K_LO=0, K_LO_PAD=1, SWIGLU=True, GROUP=5632),
                     dict(num_warps=4, num_stages=1)),
    "strip_gated": (dict(_PLAIN_STRIP, BLOCK_N=4, K_HI=2048, K_LO=0, K_LO_PAD=1, GATED=True),
                    dict(num_warps=4, num_stages=1)),
}
STRIP_TYPES = {"needed_ptr": "*i1"}
SPLITK_DIVISIBLE = ("N", "K", "stride_xm", "stride_wn", "stride_ym", "k_per_split")


def _ptx_memory_ops(name: str, pdl: bool) -> tuple[list[str], bool]:
    """The kernel's griddepcontrol and global memory instructions in PTX order, and its launch_pdl."""
    from rlt_worker.kernels import splitk_gemv, strip_gemv

    if name in SPLITK_KERNELS:
        fn, (constexprs, options), types = splitk_gemv._splitk_kernel, SPLITK_KERNELS[name], SPLITK_TYPES
        divisible = SPLITK_DIVISIBLE
    elif name in STRIP_KERNELS:
        fn, (constexprs, options), types = strip_gemv._strip_kernel, STRIP_KERNELS[name], STRIP_TYPES
        divisible = SPLITK_DIVISIBLE[:-1]
    else:
        (fn, constexprs, types, options), divisible = KERNELS[name], ()
    options = KernelLaunch(pdl=pdl).kwargs(1, **options)  # what a wrapper passes: the PDL constexpr is one of them
    kernel = compile_for(fn, {**constexprs, "PDL": options.pop("PDL")}, types, options, divisible)
    ops = [m.group(1) for line in kernel.asm["ptx"].splitlines() if (m := _MEMORY_OP.search(line))]
    return ops, kernel.metadata.launch_pdl


def _around_the_wait(name: str) -> tuple[list[str], list[str]]:
    """A PDL kernel's memory ops before its one wait and after its launch_dependents, which follows the
    wait at once; before the wait plain loads only (no store, no async copy), a store after."""
    ops, launch_pdl = _ptx_memory_ops(name, pdl=True)
    assert launch_pdl is True
    assert ops.count("griddepcontrol.wait") == 1 and ops.count("griddepcontrol.launch_dependents") == 1, ops
    wait = ops.index("griddepcontrol.wait")
    assert ops[wait + 1] == "griddepcontrol.launch_dependents", ops
    before, after = ops[:wait], ops[wait + 2 :]
    assert all(op in ("ld.global", "prefetch.global.L2") for op in before), before
    assert "st.global" in after and "prefetch.global.L2" not in after, after
    return before, after


@pytest.mark.parametrize("name", list(KERNELS))
def test_pdl_kernels_wait_before_reading_activations_and_before_storing(compiled: None, name: str) -> None:
    before, after = _around_the_wait(name)
    if name == "add_rmsnorm":
        # w_a and w_b before the wait, x and h (as wide) after it.
        assert len(before) == after.count("ld.global") > 0, (before, after)
    elif name.startswith("attention"):
        # The context length and the block table (addresses only), then the first tile's K and V lines
        # asked of the L2; q (or q|k|v, the positions and the rope table), K and V themselves after the wait.
        assert before == ["ld.global"] * 2 + ["prefetch.global.L2"] * 2, before
    else:
        assert before == [], before


@pytest.mark.parametrize("name", list(SPLITK_KERNELS))
def test_pdl_splitk_gemv_loads_only_its_first_weight_tile_before_the_wait(compiled: None, name: str) -> None:
    """Before the wait only the slice's first W tile (plain loads: no x, no async copy, no store); the
    K loop's loads between the wait and launch_dependents; every store and atomic after them."""
    ops, launch_pdl = _ptx_memory_ops(name, pdl=True)
    assert launch_pdl is True
    assert ops.count("griddepcontrol.wait") == 1 and ops.count("griddepcontrol.launch_dependents") == 1, ops
    wait, launch = ops.index("griddepcontrol.wait"), ops.index("griddepcontrol.launch_dependents")
    before, loop, after = ops[:wait], ops[wait + 1 : launch], ops[launch + 1 :]
    assert before and all(op == "ld.global" for op in before), before
    assert loop and all(op == "ld.global" or op.startswith("cp.async") for op in loop), loop
    assert "st.global" in after
    if SPLITK_KERNELS[name][0]["SPLIT"]:
        assert "atom.global" in after  # the tile counter, after the partial stores
        assert not any(op.startswith(("st.", "atom.", "red.")) for op in before + loop), ops


@pytest.mark.parametrize("name", list(STRIP_KERNELS))
def test_pdl_strip_gemv_loads_its_whole_strip_before_the_wait(compiled: None, name: str) -> None:
    """Before the wait the weight strip's loads only; launch_dependents right after it; x's loads and
    every store after them. A gated strip (the LM head's) reads nothing before the wait: its needed
    rows decide whether it reads its weight."""
    before, after = _around_the_wait(name)
    gated = STRIP_KERNELS[name][0]["GATED"]
    assert (before == []) == gated and "ld.global" in after, (before, after)


@pytest.mark.parametrize("name", [*KERNELS, *SPLITK_KERNELS, *STRIP_KERNELS])
def test_plain_kernels_have_no_grid_dependency_control(compiled: None, name: str) -> None:
    ops, launch_pdl = _ptx_memory_ops(name, pdl=False)
    assert launch_pdl is False
    assert not any(op.startswith(("griddepcontrol", "prefetch")) for op in ops), ops


# ---- GPU: a captured fused pass, PDL on against off ---------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or tb._interpreting(),
                                reason="needs CUDA and TRITON_INTERPRET unset")


def _captured_pass(model, backend, storage, tables, positions, state) -> tuple[torch.cuda.CUDAGraph, torch.Tensor,
                                                                            object]:
    """One fused loop pass over the paged pool, warmed up (kernels compiled) and captured; with the
    context, which the caller keeps alive as long as the graph (the graph reads its tensors)."""
    from rlt_worker.paged_context import PagedContext, PagedPlaneView

    view = PagedPlaneView(tables, positions, storage.block_size)
    ctx = PagedContext(storage, backend, positions, view, None)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.inference_mode():
        model.loop(state, state, positions, ctx)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.inference_mode():
        out = model.loop(state, state, positions, ctx)
    return graph, out, ctx


@pytest.fixture(scope="module")
def synthetic_ouro() -> object:
    """synthetic-ouro-1.4b in bf16 on the GPU, loaded once for the module."""
    from rlt_worker.models.loader import load_model

    return load_model("synthetic-ouro-1.4b", dtype=torch.bfloat16, device=torch.device("cuda"))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 32])
def test_gpu_pdl_pass_equals_plain_bit_for_bit_in_a_graph(synthetic_ouro, rows: int) -> None:
    from rlt_worker.kv_storage import KVStorage
    from rlt_worker.models.ouro_fused import FusedOuroModel

    reference = synthetic_ouro
    device, dtype, context, block_size = torch.device("cuda"), torch.bfloat16, 1024, 16
    pdl = KernelLaunch.for_device(True, device)
    assert pdl.pdl, f"{torch.cuda.get_device_name()} has no PDL (sm_90+)"
    blocks = context // block_size
    storage = KVStorage(reference.info, rows * blocks, block_size, dtype, device)
    gen = torch.Generator(device=device).manual_seed(0)
    storage.pool.normal_(generator=gen)
    tables = torch.arange(rows * blocks, dtype=torch.int32, device=device).view(rows, blocks)
    positions = torch.full((rows,), context - 1, device=device)
    with torch.inference_mode():
        state = reference.model.norm(torch.randn(rows, reference.info.hidden_size, generator=gen, device=device,
                                                 dtype=torch.float32).to(dtype))
    # Both passes write the same K/V at the rows' last position: neither changes what the other reads.
    # The models and contexts stay referenced while their graphs replay: each graph holds raw pointers
    # to their tensors (packed weights, RoPE tables, slot mappings), not references.
    models = [FusedOuroModel(reference, launch) for launch in (PLAIN, pdl)]
    captured = [_captured_pass(model, get_backend("triton", model.launch), storage, tables, positions, state)
                for model in models]
    (plain_graph, plain_out, plain_ctx), (pdl_graph, pdl_out, pdl_ctx) = captured
    plain_graph.replay()
    want = plain_out.clone()
    assert torch.isfinite(want).all()
    for replay in range(50):  # a missing wait would race: give it many chances to show
        pdl_graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(pdl_out, want), f"replay {replay}: max |Δ| {(pdl_out - want).abs().max().item()}"


@pytest.mark.gpu
@needs_cuda
def test_gpu_engine_with_launch_pdl_gives_the_plain_engines_tokens() -> None:
    """synthetic-ouro-1.4b (bf16) one request at a time, so its decode passes have one row, where the
    strips make every GEMV Triton's and PDL applies: the same greedy tokens as with launch_pdl off."""
    import random

    from protocol.messages import SamplingParams
    from rlt_engine import LLM

    rng = random.Random("pdl")
    prompts = [[rng.randrange(49152) for _ in range(rng.randint(4, 40))] for _ in range(3)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens = {}
    for pdl in (False, True):
        with LLM("synthetic-ouro-1.4b", workers=0, device="cuda", dtype="bfloat16", exit_mode="fixed",
                 launch_pdl=pdl, max_num_seqs=1, num_blocks=256) as llm:
            runner = llm.engine.executor._worker.runner
            launch = runner.model.launch
            assert launch.pdl is pdl and (runner._backend is tb) is not pdl
            assert launch.pdl_max_rows == (1 if pdl else None), launch
            tokens[pdl] = [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
            stats = runner.graph_stats
        assert stats["replays"] > 0 and any(bucket.startswith("1x") for bucket in stats["buckets"]), stats
    assert tokens[True] == tokens[False]
