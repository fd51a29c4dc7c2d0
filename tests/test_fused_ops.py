"""The fused Ouro kernels (rlt_worker/kernels/fused_ops.py) and FusedOuroModel against the torch modules.

CPU: in Triton's interpreter, in one child process started with TRITON_INTERPRET=1 (the pattern of
test_triton_attention.py), float32 and float64 on tiny shapes. Tolerances: every elementwise step
rounds as torch's does, but the mean of squares in RMSNorm is summed in another order (and, for the
whole loop, the packed q|k|v and gate|up GEMMs block their sums differently), so float32 agrees to
a few ulps (rtol 1e-6 per kernel, 1e-5 after a whole loop), float64 to 1e-12; RoPE and SwiGLU have
no reduction and are held to the same bounds. bf16 is checked on the GPU only: the interpreter
truncates fp32→bf16 casts instead of rounding them.

The rotating K/V write (write_kv_rotary, both backends) must store and return exactly what rope_qk
then write_kv do (float32, bf16: the same kernel's rounding either way), and the fused loop through
paged contexts (their attend_rotary) must match the torch modules through attend.

The float64 engine run (fused loop + emulated pass graphs, toy-ouro) must give exactly the dense
reference's tokens and exit depths (SPEC §7a).

GPU (marked gpu): the compiled kernels at Ouro-1.4B widths in bf16 within one bf16 ulp of the torch
composition, and float32 within the CPU bounds; the rotating K/V write bit for bit.
"""

from __future__ import annotations

import functools
import random
import sys
from collections.abc import Callable
from pathlib import Path

import interp
import pytest
import torch
import torch.nn.functional as F

from rlt_worker.attention import triton_backend as tb

pytestmark = pytest.mark.skipif(tb.triton is None, reason="Triton is not installed")

TOL = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.float64: dict(rtol=1e-12, atol=1e-12)}
LOOP_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-12, atol=1e-12)}


def _rmsnorm(dim: int, dtype: torch.dtype, device: str, gen: torch.Generator):
    from rlt_worker.models.layers import RMSNorm

    norm = RMSNorm(dim, 1e-6).to(device=device, dtype=dtype)
    norm.weight.data = (1 + 0.1 * torch.randn(dim, generator=gen, dtype=torch.float64)).to(device, dtype)
    return norm


def check_add_rmsnorm(dtype: torch.dtype, hidden: int, rows: int = 5, device: str = "cpu", tol=None) -> None:
    """x' = x + norm_a(h), y = norm_b(x') (and y = norm_b(x) without h), as the RMSNorm modules compute."""
    from rlt_worker.kernels.fused_ops import add_rmsnorm

    gen = torch.Generator().manual_seed(hidden)
    norm_a, norm_b = _rmsnorm(hidden, dtype, device, gen), _rmsnorm(hidden, dtype, device, gen)
    # x is a row-strided view (a column slice of a wider buffer): the kernels read row strides.
    wide = torch.randn(rows, hidden + 7, generator=gen, dtype=torch.float64).to(device, dtype)
    x = wide[:, 3 : 3 + hidden]
    h = (3 * torch.randn(rows, hidden, generator=gen, dtype=torch.float64)).to(device, dtype)
    want_x = x + norm_a(h)
    got_x, got_y = add_rmsnorm(x, h, norm_a.weight, norm_b.weight, 1e-6)
    tol = tol or TOL[dtype]
    torch.testing.assert_close(got_x, want_x, **tol)
    torch.testing.assert_close(got_y, norm_b(want_x), **tol)
    same_x, plain = add_rmsnorm(x, None, None, norm_b.weight, 1e-6)
    assert same_x is x
    torch.testing.assert_close(plain, norm_b(x), **tol)


def check_rope(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, device: str = "cpu", tol=None) -> None:
    """q and k of packed q|k|v rows, rotated as layers.apply_split_half does with split_half_cos_sin."""
    from rlt_worker.kernels.fused_ops import rope_qk, rope_table
    from rlt_worker.models.layers import apply_split_half, split_half_cos_sin

    gen = torch.Generator().manual_seed(head_dim)
    positions = torch.tensor([0, 3, 17, 100, 5, 511, 1000]).to(device)
    n = len(positions)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=gen, dtype=torch.float64).to(device, dtype)
    cos_t, sin_t = rope_table(1024, head_dim, 1e6, dtype, device)
    q, k = rope_qk(qkv, positions, cos_t, sin_t, heads, kv_heads, head_dim)
    cos, sin = split_half_cos_sin(positions, head_dim, 1e6, dtype)
    want_q = apply_split_half(qkv[:, : heads * head_dim].view(n, heads, head_dim), cos, sin)
    want_k = apply_split_half(qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(n, kv_heads, head_dim),
                              cos, sin)
    tol = tol or TOL[dtype]
    torch.testing.assert_close(q, want_q, **tol)
    torch.testing.assert_close(k, want_k, **tol)


def check_write_kv_rotary(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, device: str = "cpu") -> None:
    """write_kv_rotary stores and returns, bit for bit, what rope_qk then the backend's write_kv do; the
    torch backend's rotation too (on the CPU in float32/float64, where the interpreter rounds as torch)."""
    from rlt_worker.attention import torch_ref
    from rlt_worker.kernels.fused_ops import rope_qk, rope_table, write_kv_rotary
    from rlt_worker.models.base import Rotary
    from rlt_worker.paged_context import PagedPlaneView

    gen = torch.Generator().manual_seed(heads * 100 + kv_heads)
    block_size, num_blocks, scratch = 4, 8, 7
    # Rows of two sequences at positions around block boundaries (3|4, 7|8), then a graph's padding
    # row: position 0 of a table that is the scratch block throughout.
    positions = torch.tensor([3, 4, 7, 8, 0, 5, 0]).to(device)
    tables = torch.tensor([[2, 0, 5], [2, 0, 5], [2, 0, 5], [2, 0, 5], [1, 6, 4], [1, 6, 4], [scratch] * 3],
                          dtype=torch.int32).to(device)
    slots = PagedPlaneView(tables, positions, block_size).slot_mapping
    n = len(positions)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=gen, dtype=torch.float64).to(device, dtype)
    cos, sin = rope_table(64, head_dim, 1e4, dtype, device)
    rope = Rotary(positions, cos, sin, heads, kv_heads, head_dim)
    # The caches start as noise, so a store to a wrong slot (or a missing one) shows.
    pool = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen, dtype=torch.float64)
    want_k, want_v = pool.to(device, dtype).unbind(0)
    q, k = rope_qk(qkv, positions, cos, sin, heads, kv_heads, head_dim)
    tb.write_kv(want_k, want_v, k, qkv[:, (heads + kv_heads) * head_dim :].view(n, kv_heads, head_dim), slots)
    backends = [write_kv_rotary] + ([torch_ref.write_kv_rotary] if dtype != torch.bfloat16 else [])
    for fused in backends:
        got_k, got_v = pool.to(device, dtype).unbind(0)
        got_q = fused(got_k, got_v, qkv, rope, slots)
        assert torch.equal(got_q, q), f"{fused.__module__}: q"
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v), f"{fused.__module__}: caches"


def check_swiglu(dtype: torch.dtype, inner: int, device: str = "cpu", tol=None) -> None:
    """silu(gate)·up of packed gate|up rows, as layers.SwiGLU computes it between its GEMMs."""
    from rlt_worker.kernels.fused_ops import swiglu

    gen = torch.Generator().manual_seed(inner)
    gate_up = (4 * torch.randn(3, 2 * inner, generator=gen, dtype=torch.float64)).to(device, dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(swiglu(gate_up), F.silu(gate) * up, **(tol or TOL[dtype]))


class CausalRowsContext:
    """Attention of a batch's rows as one causal sequence (row i reads rows 0 … i), in torch:
    enough to see q, k and v reach the attention as the torch modules produce them."""

    def attend(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("nhd,thd->hnt", q, k) * q.shape[-1] ** -0.5
        mask = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool, device=q.device).tril()
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        return torch.einsum("hnt,thd->nhd", probs, v)


def check_fused_loop(dtype: torch.dtype, model_name: str = "toy-ouro", device: str = "cpu", tol=None) -> None:
    """FusedOuroModel.loop equals OuroModel.loop over a few loops; packing kept the reference's weights."""
    from rlt_worker.models.loader import load_model
    from rlt_worker.models.ouro_fused import FusedOuroModel, with_fused_layers

    reference = load_model(model_name, dtype=dtype, device=device)
    before = {name: t.clone() for name, t in reference.state_dict().items()}
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 256, (9,), generator=gen).to(device)
    positions = torch.arange(9, device=device)
    ctx = CausalRowsContext()
    with torch.inference_mode():
        embedded = reference.embed(tokens, positions, ctx)
        want = [embedded]
        for _ in range(3):
            want.append(reference.loop(want[-1], embedded, positions, ctx))
        fused = with_fused_layers(reference)
        assert isinstance(fused, FusedOuroModel)
        after = fused.reference.state_dict()
        assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
        state = embedded
        for loop in range(1, 4):
            state = fused.loop(state, embedded, positions, ctx)
            torch.testing.assert_close(state, want[loop], **(tol or LOOP_TOL[dtype]),
                                       msg=lambda m, i=loop: f"loop {i}: {m}")
            # Packing re-pointed the modules at views: the torch loop still computes what it did.
            assert torch.equal(reference.loop(want[loop - 1], embedded, positions, ctx), want[loop])


def check_fused_loop_paged(dtype: torch.dtype, model_name: str = "toy-ouro") -> None:
    """FusedOuroModel.loop through the paged contexts' fused rotating K/V write (the Triton backend)
    equals OuroModel.loop through their attend: a mixed batch (StackedContext) of two sequences'
    rows, each part a PagedContext, over a few loops."""
    from rlt_worker.kv_storage import KVStorage
    from rlt_worker.models.loader import load_model
    from rlt_worker.models.ouro_fused import FusedOuroModel
    from rlt_worker.paged_context import PagedContext, PagedPlaneView, StackedContext

    reference = load_model(model_name, dtype=dtype, device="cpu")
    info, block_size = reference.info, 4
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, 256, (9,), generator=gen)
    positions = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 3])  # sequence A (5 rows), then B (4 rows)
    parts = [(slice(0, 5), [3, 0]), (slice(5, 9), [1, 5])]

    def context(storage: KVStorage) -> StackedContext:
        """Each sequence's rows over its own blocks: every row reads positions 0 … its own."""
        contexts = []
        for rows, blocks in parts:
            pos = positions[rows]
            view = PagedPlaneView(torch.tensor([blocks] * len(pos), dtype=torch.int32), pos, block_size)
            contexts.append((PagedContext(storage, tb, pos, view, None), len(pos)))
        return StackedContext(contexts)

    with torch.inference_mode():
        embedded = reference.embed(tokens, positions, context(KVStorage(info, 8, block_size, dtype, "cpu")))
        want = [embedded]
        for _ in range(3):
            want.append(reference.loop(want[-1], embedded, positions,
                                       context(KVStorage(info, 8, block_size, dtype, "cpu"))))
        fused = FusedOuroModel(reference)
        state = embedded
        for loop in range(1, 4):
            state = fused.loop(state, embedded, positions, context(KVStorage(info, 8, block_size, dtype, "cpu")))
            torch.testing.assert_close(state, want[loop], **LOOP_TOL[dtype], msg=lambda m, i=loop: f"loop {i}: {m}")


def check_fused_loop_decode_batch(dtype: torch.dtype) -> None:
    """A decode batch (three sequences, one row each, over caches of random K/V) through FusedOuroModel:
    with PagedContext's fused_rotary (paged_attention_rotary: RoPE, the K/V write and the attention in
    one launch) every state and cache bit for bit those of the two launches, over 3 loops, and within
    LOOP_TOL of OuroModel.loop through attend."""
    from rlt_worker.kv_storage import KVStorage
    from rlt_worker.models.loader import load_model
    from rlt_worker.models.ouro_fused import FusedOuroModel
    from rlt_worker.paged_context import PagedContext, PagedPlaneView

    reference = load_model("toy-ouro", dtype=dtype, device="cpu")
    fused = FusedOuroModel(reference)
    info, block_size = reference.info, 4
    gen = torch.Generator().manual_seed(13)
    positions = torch.tensor([6, 2, 9])
    tables = torch.tensor([[4, 0, 7], [2, 5, 6], [8, 1, 3]], dtype=torch.int32)  # each row its own blocks
    pool = torch.randn(KVStorage(info, 9, block_size, dtype, "cpu").pool.shape, generator=gen, dtype=dtype)

    def run(model, fused_rotary: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        storages = [KVStorage(info, 9, block_size, dtype, "cpu") for _ in range(3)]
        state = embedded = torch.randn(3, info.hidden_size, generator=torch.Generator().manual_seed(1), dtype=dtype)
        states = []
        for storage in storages:
            storage.pool.copy_(pool)
            ctx = PagedContext(storage, tb, positions, PagedPlaneView(tables, positions, block_size), None,
                               fused_rotary=fused_rotary)
            state = model.loop(state, embedded, positions, ctx)
            states.append(state)
        return states, [s.pool for s in storages]

    with torch.inference_mode():
        want_states, want_pools = run(fused, False)
        states, pools = run(fused, True)
        assert all(torch.equal(a, b) for a, b in zip(states, want_states, strict=True)), "states"
        assert all(torch.equal(a, b) for a, b in zip(pools, want_pools, strict=True)), "caches"
        ref_states, ref_pools = run(reference, True)  # OuroModel attends through attend: fused_rotary unused
        for got, want in zip(states + pools, ref_states + ref_pools, strict=True):
            torch.testing.assert_close(got, want, **LOOP_TOL[dtype])


def check_engine_float64(attention_backend: str = "torch", fused_rotary: bool = False) -> None:
    """toy-ouro, float64, trace: the fused loop under emulated pass graphs gives the dense reference's
    tokens and exit depths exactly (with the Triton backend's interpreter kernels and fused_rotary: the
    decode batches' RoPE, K/V write and attention in one launch)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from factories import assert_matches_reference, make_llm, make_workload, run_workload

    from rlt_worker.models.ouro_fused import FusedOuroModel, with_fused_layers

    torch.set_num_threads(1)
    jobs = make_workload(random.Random("fused-engine"), 5, depth=4, exit_mode="trace", max_prompt_len=10,
                         max_tokens=5, spread=1, sampling=("greedy", "temperature"))
    with make_llm("toy-ouro", exit_mode="trace", max_num_seqs=4, loops_per_plan=4,
                  attention_backend=attention_backend, fused_rotary_attention=fused_rotary) as llm:
        runner = llm.engine.executor._worker.runner
        assert runner.config.fused_rotary_attention is fused_rotary
        runner.model = with_fused_layers(runner.model)
        assert isinstance(runner.model, FusedOuroModel)
        runner.use_pass_graphs(emulate=True)
        run = run_workload(llm, jobs)
        assert_matches_reference(run, "toy-ouro", kv_layout="last_exited", exit_mode="trace")
        assert runner.graph_stats["replays"] > 0


INTERP_CASES: dict[str, Callable[[], None]] = {
    **{f"add_rmsnorm-{str(d)[6:]}-h{h}": functools.partial(check_add_rmsnorm, d, h)
       for d in (torch.float32, torch.float64) for h in (48, 64)},
    **{f"rope-{str(d)[6:]}": functools.partial(check_rope, d, 4, 2, 16) for d in (torch.float32, torch.float64)},
    **{f"write_kv_rotary-{str(d)[6:]}-{h}q{kv}kv": functools.partial(check_write_kv_rotary, d, h, kv, 16)
       for d in (torch.float32, torch.bfloat16) for h, kv in ((4, 4), (4, 2))},
    **{f"swiglu-{str(d)[6:]}-i{i}": functools.partial(check_swiglu, d, i)
       for d in (torch.float32, torch.float64) for i in (40, 1500)},
    **{f"loop-{str(d)[6:]}": functools.partial(check_fused_loop, d) for d in (torch.float32, torch.float64)},
    **{f"loop-paged-{str(d)[6:]}": functools.partial(check_fused_loop_paged, d)
       for d in (torch.float32, torch.float64)},
    **{f"loop-decode-batch-{str(d)[6:]}": functools.partial(check_fused_loop_decode_batch, d)
       for d in (torch.float32, torch.float64)},
    "engine-float64": check_engine_float64,
    "engine-float64-triton-fused-rotary": functools.partial(check_engine_float64, "triton", True),
}


@pytest.mark.parametrize("case", list(INTERP_CASES))
def test_interpreter_matches_torch(interp_verdicts: dict[str, str], case: str) -> None:
    """Each interpreter case (see INTERP_CASES) passed in the child."""
    verdict = interp_verdicts[case]
    assert verdict == "ok", verdict


def test_fused_layers_is_chosen_for_cuda_with_triton_only() -> None:
    from rlt_engine.config import EngineConfig

    assert EngineConfig(device="cpu").resolved().fused_layers is False
    assert EngineConfig(device="cpu", attention_backend="triton").resolved().fused_layers is False
    assert EngineConfig(device="cuda", attention_backend="torch").resolved().fused_layers is False
    cuda = EngineConfig(device="cuda").resolved()
    assert cuda.fused_layers is True and cuda.worker_config("cuda").fused_layers is True
    assert EngineConfig(device="cuda", fused_layers=False).resolved().fused_layers is False


def test_fused_rotary_attention_is_off_by_default_and_needs_triton() -> None:
    from rlt_engine.config import EngineConfig

    assert EngineConfig(device="cuda").resolved().fused_rotary_attention is False
    assert EngineConfig(device="cuda", attention_backend="torch", fused_rotary_attention=True).resolved() \
        .fused_rotary_attention is False
    on = EngineConfig(device="cuda", fused_rotary_attention=True).resolved()
    assert on.fused_rotary_attention is True and on.worker_config("cuda").fused_rotary_attention is True


def test_huginn_keeps_its_torch_modules() -> None:
    from rlt_worker.models.loader import load_model
    from rlt_worker.models.ouro_fused import with_fused_layers

    model = load_model("toy-huginn", dtype=torch.float32, device="cpu")
    assert with_fused_layers(model) is model


# ---- GPU, compiled: Ouro-1.4B widths -----------------------------------------------------------

gpu = pytest.mark.gpu
needs_cuda = interp.needs_cuda
# bf16: one ulp relative (2^-7 of the value); atol for the rare cancellation x ≈ −w·norm(h), where one ulp
# of the addend is many of the sum. float32: the CPU bounds.
BF16 = dict(rtol=2.0**-7, atol=1e-2)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 32])
def test_gpu_kernels_at_ouro_widths(dtype: torch.dtype, rows: int) -> None:
    """The compiled kernels at hidden 2048, 16 + 16 heads of 128, intermediate 5632."""
    tol = BF16 if dtype == torch.bfloat16 else TOL[torch.float32]
    check_add_rmsnorm(dtype, 2048, rows=rows, device="cuda", tol=tol)
    check_rope(dtype, 16, 16, 128, device="cuda", tol=tol)
    check_write_kv_rotary(dtype, 16, 16, 128, device="cuda")
    check_swiglu(dtype, 5632, device="cuda", tol=tol)


if __name__ == "__main__":
    interp.main(INTERP_CASES)
