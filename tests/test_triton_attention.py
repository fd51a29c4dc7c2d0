"""Triton paged attention and KV writes against torch_ref (SPEC §4, §7a).

On the CPU the kernels run in Triton's interpreter, in a child process started with
TRITON_INTERPRET=1 (tests/interp.py). Tests marked gpu run
the compiled kernels at Ouro-1.4B shapes against torch_ref on the same CUDA tensors.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import interp
import pytest
import torch

from rlt_worker.attention import torch_ref
from rlt_worker.attention import triton_backend as tb

pytestmark = pytest.mark.skipif(tb.triton is None, reason="Triton is not installed")

gpu = pytest.mark.gpu
needs_cuda = interp.needs_cuda


def make_batch(
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    planes: int,
    seq_lens: list[int],
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    strided_pool: bool = False,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """A paged batch like the runner builds: every sequence holds shuffled blocks in every depth plane.

    Rows: for each sequence, its decode row (context = its whole length) at a depth chosen
    round-robin, then a prefill-chunk run of its last 3 positions (contexts pos + 1) at another
    depth: 4 rows per sequence of length ≥ 3. A row at depth p reads plane p through its own
    block-table row (LAST_EXITED); with planes=1 every row reads the one plane (SHARED). The
    caches are layer 1 of a two-layer pool;
    with strided_pool the pool is laid out block-major so the cache views are non-contiguous.
    The block table is a column slice of a wider table, so its row stride is not max_blocks.
    """
    gen = torch.Generator().manual_seed(seed)
    dev_gen = torch.Generator(device=device).manual_seed(seed)  # big tensors are drawn where they live
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    blocks_per_plane = len(seq_lens) * max_blocks + 3  # spare blocks hold garbage nobody may read
    num_blocks = planes * blocks_per_plane
    # [blocks, layers, K/V, block, Hkv, Dh]; the cache views are layer 1 of the [layers, K/V, …] pool.
    shape = (num_blocks, 2, 2, block_size, num_kv_heads, head_dim)
    pool = torch.randn(shape, generator=dev_gen, device=device, dtype=torch.float32).to(dtype)
    pool = pool.permute(1, 2, 0, 3, 4, 5) if strided_pool else pool.permute(1, 2, 0, 3, 4, 5).contiguous()
    k_cache, v_cache = pool[1, 0], pool[1, 1]
    assert k_cache.is_contiguous() != strided_pool

    # seq_tables[s][p]: sequence s's blocks in plane p, shuffled within the plane.
    seq_tables = []
    perms = [torch.randperm(blocks_per_plane, generator=gen) + p * blocks_per_plane for p in range(planes)]
    for s in range(len(seq_lens)):
        seq_tables.append([perms[p][s * max_blocks : (s + 1) * max_blocks] for p in range(planes)])

    rows_bt, rows_ctx = [], []
    for s, n in enumerate(seq_lens):
        rows_bt.append(seq_tables[s][s % planes])
        rows_ctx.append(n)
        for pos in range(max(0, n - 3), n):  # a prefill chunk of the last 3 positions
            rows_bt.append(seq_tables[s][(s + 1) % planes])
            rows_ctx.append(pos + 1)
    wide = torch.full((len(rows_bt), max_blocks + 5), -1, dtype=torch.int32)
    wide[:, 2 : 2 + max_blocks] = torch.stack(rows_bt).to(torch.int32)
    block_tables = wide[:, 2 : 2 + max_blocks]
    assert not block_tables.is_contiguous()
    context_lens = torch.tensor(rows_ctx, dtype=torch.int32)
    q = torch.randn(len(rows_ctx), num_heads, head_dim, generator=gen, dtype=torch.float64).to(dtype)
    small = dict(q=q, block_tables=block_tables, context_lens=context_lens)
    return {name: t.to(device) for name, t in small.items()} | dict(k_cache=k_cache, v_cache=v_cache)


def check(batch: dict[str, torch.Tensor], atol: float, rtol: float, **kwargs: int) -> None:
    """Triton output equals torch_ref's on the same tensors within tolerance."""
    scale = batch["q"].shape[-1] ** -0.5
    got = tb.paged_attention(**batch, scale=scale, **kwargs)
    # torch_ref views the caches flat, so it reads contiguous copies; Triton reads the strided views.
    dense = {name: t.contiguous() for name, t in batch.items()}
    want = torch_ref.paged_attention(**dense, scale=scale)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


def make_decode_batch(
    *, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, seq_lens: list[int],
    dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0,
) -> dict:
    """A decode batch for paged_attention_rotary: one row a sequence (its token at its last position,
    context its length), each over its own shuffled blocks of a strided cache view pre-filled with
    random K/V, and packed q|k|v rows with a rope table."""
    from rlt_worker.kernels.fused_ops import rope_table
    from rlt_worker.models.base import Rotary

    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in seq_lens) + 1  # a spare column: tables wider than any row
    num_blocks = len(seq_lens) * max_blocks + 3
    pool = torch.randn(num_blocks, 2, 2, block_size, num_kv_heads, head_dim, generator=gen, dtype=torch.float64)
    pool = pool.to(dtype).to(device).permute(1, 2, 0, 3, 4, 5)  # block-major: strided cache views
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.stack([perm[i * max_blocks : (i + 1) * max_blocks] for i in range(len(seq_lens))])
    context_lens = torch.tensor(seq_lens, dtype=torch.int32)
    qkv = torch.randn(len(seq_lens), (num_heads + 2 * num_kv_heads) * head_dim, generator=gen, dtype=torch.float64)
    cos, sin = rope_table(max(seq_lens) + 8, head_dim, 10000.0, dtype, device)
    positions = (context_lens - 1).long().to(device)
    return dict(qkv=qkv.to(dtype).to(device), rope=Rotary(positions, cos, sin, num_heads, num_kv_heads, head_dim),
                k_cache=pool[1, 0], v_cache=pool[1, 1], block_tables=tables.to(torch.int32).to(device),
                context_lens=context_lens.to(device))


def check_rotary(batch: dict, atol: float, rtol: float, **kwargs: int) -> None:
    """paged_attention_rotary equals write_kv_rotary then paged_attention bit for bit (output and both
    caches), and torch_ref's composition within tolerance."""
    from rlt_worker.kernels.fused_ops import write_kv_rotary

    scale = batch["rope"].head_dim ** -0.5
    rows = torch.arange(len(batch["context_lens"]), device=batch["qkv"].device)
    pos, block_size = batch["rope"].positions, batch["k_cache"].shape[1]
    slots = batch["block_tables"].long()[rows, pos // block_size] * block_size + pos % block_size
    caches = {name: (batch["k_cache"].clone(), batch["v_cache"].clone()) for name in ("two", "one", "ref")}
    q = write_kv_rotary(*caches["two"], batch["qkv"], batch["rope"], slots)
    want = tb.paged_attention(q, *caches["two"], batch["block_tables"], batch["context_lens"], scale, **kwargs)
    args = (batch["block_tables"], batch["context_lens"], scale)
    got = tb.paged_attention_rotary(batch["qkv"], batch["rope"], *caches["one"], *args, **kwargs)
    assert torch.equal(got, want), (got.double() - want.double()).abs().max()
    assert all(torch.equal(a, b) for a, b in zip(caches["one"], caches["two"], strict=True)), "caches"
    ref = torch_ref.paged_attention_rotary(batch["qkv"], batch["rope"], *(c.contiguous() for c in caches["ref"]),
                                           *args)
    torch.testing.assert_close(got, ref, atol=atol, rtol=rtol)


# ---- CPU, interpreter: tiny shapes, in a subprocess ------------------------------------------
# Triton's interpreter only works when TRITON_INTERPRET=1 is set before triton is imported (the
# tl.* helpers are jitted at import), and pytest may have imported it already: so these cases run
# in one child process started with the variable set, and each test reads its case's verdict.


def _interp_attention(hq: int, hkv: int, dh: int, bs: int, planes: int, lens: list[int], strided: bool,
                      **kwargs: int) -> None:
    """float32, ieee dots: ragged contexts, shuffled blocks, depth planes, GQA and MHA, strided views."""
    batch = make_batch(
        num_heads=hq, num_kv_heads=hkv, head_dim=dh, block_size=bs, planes=planes, seq_lens=lens,
        strided_pool=strided,
    )
    check(batch, atol=1e-5, rtol=1e-5, **kwargs)


def _interp_float64() -> None:
    """float64 inputs accumulate in float64 (tl.sum path), single and split."""
    batch = make_batch(
        num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, planes=2, seq_lens=[9, 21], dtype=torch.float64
    )
    check(batch, atol=1e-12, rtol=1e-12)
    check(batch, atol=1e-12, rtol=1e-12, num_splits=2)


def _interp_out_rows() -> None:
    """Written into `out` (rows of a bigger tensor, as StackedContext passes them): the same values as
    a new tensor, single and split, and the rows around it untouched."""
    batch = make_batch(num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, planes=2, seq_lens=[9, 21])
    scale = batch["q"].shape[-1] ** -0.5
    n = batch["q"].shape[0]
    for splits in (1, 3):
        want = tb.paged_attention(**batch, scale=scale, num_splits=splits)
        around = torch.full((n + 4, *want.shape[1:]), float("nan"))
        got = tb.paged_attention(**batch, scale=scale, num_splits=splits, out=around[2 : 2 + n])
        assert got.data_ptr() == around[2].data_ptr() and torch.equal(got, want)
        assert around[:2].isnan().all() and around[2 + n :].isnan().all()


def _interp_rotary(hq: int, hkv: int, dh: int, bs: int, lens: list[int], dtype: torch.dtype = torch.float32,
                   **kwargs: int) -> None:
    """paged_attention_rotary: the two launches' bits (check_rotary), single and split."""
    atol = 1e-12 if dtype == torch.float64 else 1e-5
    check_rotary(make_decode_batch(num_heads=hq, num_kv_heads=hkv, head_dim=dh, block_size=bs, seq_lens=lens,
                                   dtype=dtype), atol=atol, rtol=atol, **kwargs)


def _interp_rotary_store_first() -> None:
    """The same with the writer's k and v stored before its loop (ROTARY_STORE_FIRST)."""
    tb.ROTARY_STORE_FIRST = True
    try:
        _interp_rotary(4, 2, 16, 4, [1, 7, 40, 13])
        _interp_rotary(4, 4, 32, 16, [5, 38, 17], num_splits=3, tile=16)
    finally:
        tb.ROTARY_STORE_FIRST = False


def _interp_write_kv() -> None:
    """write_kv stores K and V at the given slots of strided cache views, like torch_ref.write_kv."""
    gen = torch.Generator().manual_seed(1)
    store = torch.zeros(6, 2, 2, 4, 2, 16)  # [blocks, layers, K/V, block, Hkv, Dh]: block-major
    k_cache, v_cache = store[:, 1, 0], store[:, 1, 1]
    ref = torch.zeros(2, 6, 4, 2, 16)
    k = torch.randn(5, 2, 16, generator=gen)
    v = torch.randn(5, 2, 16, generator=gen)
    slots = torch.tensor([0, 7, 13, 22, 23])
    tb.write_kv(k_cache, v_cache, k, v, slots)
    torch_ref.write_kv(ref[0], ref[1], k, v, slots)
    assert torch.equal(k_cache, ref[0]) and torch.equal(v_cache, ref[1])
    assert torch.count_nonzero(store[:, 0]) == 0  # the other layer is untouched


def finalize_case(
    *, layers: int, num_kv_heads: int, head_dim: int, block_size: int, planes: int, rows: int,
    dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0,
) -> tuple[torch.Tensor, ...]:
    """A random pool, per-slot block tables (distinct blocks per plane) and finalize rows with
    every exit depth 1 … planes (the deepest copies nothing)."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = 3
    num_slots = rows  # one row per slot: rows of one finalize batch are distinct requests
    num_blocks = num_slots * planes * max_blocks + 2
    pool = torch.randn(layers, 2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[: num_slots * planes * max_blocks]
    tables = tables.view(num_slots, planes, max_blocks).to(torch.int32)
    slots = torch.randperm(num_slots, generator=gen)
    positions = torch.randint(0, max_blocks * block_size, (rows,), generator=gen)
    depths = torch.arange(rows) % planes + 1
    return tuple(t.to(device) for t in (pool, tables, slots, positions, depths))


def finalize_by_hand(pool: torch.Tensor, tables: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                     depths: torch.Tensor) -> torch.Tensor:
    """SPEC §4 read literally, one (row, plane) at a time."""
    want = pool.clone()
    block_size = pool.shape[3]
    for slot, pos, depth in zip(slots.tolist(), positions.tolist(), depths.tolist(), strict=True):
        table = tables[slot, :, pos // block_size].tolist()
        for plane in range(depth, tables.shape[1]):
            want[:, :, table[plane], pos % block_size] = pool[:, :, table[depth - 1], pos % block_size]
    return want


def _interp_finalize_kv() -> None:
    """The Triton finalize copy equals the literal loop, for every exit depth and GQA-odd head counts."""
    pool, tables, slots, positions, depths = finalize_case(layers=2, num_kv_heads=3, head_dim=16, block_size=4,
                                                           planes=4, rows=9)
    want = finalize_by_hand(pool, tables, slots, positions, depths)
    tb.finalize_kv(pool, tables, slots, positions, depths)
    assert torch.equal(pool, want)


INTERP_CASES: dict[str, Callable[[], None]] = {
    # (Hq, Hkv, Dh, block, planes, context lengths, strided pool, overrides)
    f"{name}-{'strided' if strided else 'contig'}": functools.partial(_interp_attention, *args, strided, **kw)
    for name, args, kw in [
        ("gqa-d16-b4-3planes", (4, 2, 16, 4, 3, [1, 7, 40, 13]), {}),
        ("mha-d32-b16-shared", (4, 4, 32, 16, 1, [5, 38, 17]), {}),
        ("gqa-split3", (4, 2, 32, 16, 2, [33, 2]), {"num_splits": 3, "tile": 16}),
    ]
    for strided in (False, True)
} | {
    # Huginn's 55 heads (odd) × 96 (padded to 128), contiguous only: 55 heads make the interpreter slow
    "huginn-55h-d96": functools.partial(_interp_attention, 55, 55, 96, 16, 2, [18], False),
    "rotary-gqa-d16-b4": functools.partial(_interp_rotary, 4, 2, 16, 4, [1, 7, 40, 13]),
    "rotary-mha-split3": functools.partial(_interp_rotary, 4, 4, 32, 16, [5, 38, 17], num_splits=3, tile=16),
    "rotary-float64-split2": functools.partial(_interp_rotary, 4, 2, 16, 4, [9, 21], torch.float64, num_splits=2),
    "rotary-store-first": _interp_rotary_store_first,
    "float64": _interp_float64, "out-rows": _interp_out_rows, "write_kv": _interp_write_kv,
    "finalize_kv": _interp_finalize_kv,
}


# ---- CPU, interpreter: offsets past 2^31 elements ----------------------------------------------
# The pools are torch.empty: the OS maps only the pages a case touches, so a pool of several
# gigabytes costs a few megabytes here. A wrapped 32-bit offset addresses memory outside the pool,
# which may crash the process, so each case runs in a child of its own.

WIDE_HEADS, WIDE_DIM, WIDE_BLOCK = 2, 16, 16
WIDE_BLOCK_ELEMENTS = WIDE_BLOCK * WIDE_HEADS * WIDE_DIM


def _wide_finalize_layer_stride() -> None:
    """finalize_kv when a layer's stride is below 2^31 elements but layer × stride is above it
    (Ouro-1.4B's pools of 1,425–32,767 blocks): every layer's copy lands in its own layer."""
    layers, planes = 24, 4
    num_blocks = (2**31 // 20) // (2 * WIDE_BLOCK_ELEMENTS)  # stride ≈ 2^31 / 20: layers 20–23 pass 2^31
    pool = torch.empty(layers, 2, num_blocks, WIDE_BLOCK, WIDE_HEADS, WIDE_DIM, dtype=torch.float16)
    assert pool.stride(0) < 2**31 < (layers - 1) * pool.stride(0)
    tables = torch.tensor([[[p * 8 + 1 + c for c in range(2)] for p in range(planes)]], dtype=torch.int32)
    slots, positions, depths = torch.tensor([0]), torch.tensor([5]), torch.tensor([1])
    offset = 5 % WIDE_BLOCK
    for plane in range(planes):
        pool[:, :, tables[0, plane, 0], offset] = 0.0
    values = torch.arange(1, layers * 2 + 1, dtype=torch.float16).view(layers, 2, 1, 1)
    pool[:, :, tables[0, 0, 0], offset] = values
    tb.finalize_kv(pool, tables, slots, positions, depths)
    for plane in range(1, planes):
        got = pool[:, :, tables[0, plane, 0], offset]
        assert torch.equal(got, values.expand_as(got)), f"plane {plane} did not receive every layer's K/V"


def _wide_layer_view() -> None:
    """write_kv and paged_attention on blocks past 2^31 elements inside one layer's cache view."""
    num_blocks = 2**31 // WIDE_BLOCK_ELEMENTS + 64
    pool = torch.empty(1, 2, num_blocks, WIDE_BLOCK, WIDE_HEADS, WIDE_DIM, dtype=torch.float16)
    k_cache, v_cache = pool[0, 0], pool[0, 1]
    assert k_cache.stride(0) * (num_blocks - 1) > 2**31
    gen = torch.Generator().manual_seed(3)
    top = torch.arange(num_blocks - 8, num_blocks)  # only blocks past the 2^31 mark
    for cache in (k_cache, v_cache):
        cache[top] = torch.randn(len(top), WIDE_BLOCK, WIDE_HEADS, WIDE_DIM, generator=gen).half()
    block_tables = top[torch.randperm(8, generator=gen)].view(2, 4).to(torch.int32)
    context_lens = torch.tensor([50, 9], dtype=torch.int32)
    slots = (block_tables[:, 0].long() * WIDE_BLOCK + torch.tensor([3, 8])).contiguous()
    k = torch.randn(2, WIDE_HEADS, WIDE_DIM, generator=gen).half()
    v = torch.randn(2, WIDE_HEADS, WIDE_DIM, generator=gen).half()
    tb.write_kv(k_cache, v_cache, k, v, slots)
    flat_k, flat_v = k_cache.view(-1, WIDE_HEADS, WIDE_DIM), v_cache.view(-1, WIDE_HEADS, WIDE_DIM)
    assert torch.equal(flat_k[slots], k) and torch.equal(flat_v[slots], v)
    q = torch.randn(2, 2 * WIDE_HEADS, WIDE_DIM, generator=gen).half()
    got = tb.paged_attention(q, k_cache, v_cache, block_tables, context_lens, scale=0.25)
    want = torch_ref.paged_attention(q, k_cache, v_cache, block_tables, context_lens, scale=0.25)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


WIDE_CASES: dict[str, Callable[[], None]] = {
    "finalize-layer-stride": _wide_finalize_layer_stride,
    "write-and-attend-past-2^31": _wide_layer_view,
}


@pytest.mark.parametrize("case", list(WIDE_CASES))
def test_interpreter_offsets_past_2_31(case: str) -> None:
    """Each WIDE_CASES case passes in a child of its own (a wrapped offset may crash it)."""
    proc = interp.child(__file__, "--case", case, timeout=240)
    assert proc.returncode == 0, (
        f"{case}: the child ended with {proc.returncode} (a negative code is a signal: a 32-bit offset "
        f"wrapped and the kernel addressed memory outside the pool)\n{proc.stdout}\n{proc.stderr}"
    )


@pytest.mark.parametrize("case", list(INTERP_CASES))
def test_interpreter_matches_torch_ref(interp_verdicts: dict[str, str], case: str) -> None:
    """Each interpreter case (see INTERP_CASES) passed in the child."""
    verdict = interp_verdicts[case]
    assert verdict == "ok", verdict


@pytest.mark.parametrize("planes,block_size", [(4, 4), (6, 16), (1, 4)])
def test_torch_finalize_kv_equals_the_literal_loop(planes: int, block_size: int) -> None:
    """torch_ref.finalize_kv (static shapes, no host sync) equals the one-(row, plane)-at-a-time loop."""
    pool, tables, slots, positions, depths = finalize_case(layers=2, num_kv_heads=2, head_dim=8,
                                                           block_size=block_size, planes=planes, rows=7, seed=planes)
    want = finalize_by_hand(pool, tables, slots, positions, depths)
    torch_ref.finalize_kv(pool, tables, slots, positions, depths)
    assert torch.equal(pool, want)


def test_an_out_that_does_not_fit_q_raises() -> None:
    """torch_ref (and through check_out the Triton backends) refuse an `out` of another shape or dtype."""
    batch = make_batch(num_heads=2, num_kv_heads=2, head_dim=8, block_size=4, planes=1, seq_lens=[5])
    q = batch["q"]
    torch_ref.paged_attention(**batch, scale=1.0, out=torch.empty_like(q))
    for bad in (torch.empty(q.shape[0] + 1, *q.shape[1:]), torch.empty_like(q, dtype=torch.float64)):
        with pytest.raises(ValueError, match="does not fit q"):
            torch_ref.paged_attention(**batch, scale=1.0, out=bad)


def test_cpu_tensors_without_interpreter_raise(compiled: None) -> None:
    """A clear error, not a driver crash, when CPU tensors reach the compiled path."""
    batch = make_batch(num_heads=2, num_kv_heads=2, head_dim=16, block_size=4, planes=1, seq_lens=[3])
    with pytest.raises(ValueError, match="CUDA"):
        tb.paged_attention(**batch, scale=0.25)


@pytest.mark.parametrize("rows,table_tokens,splits", [
    (1, 1024, 16),  # one row in a full 1,024-token table: 16 one-tile splits (measured best, H100)
    (1, 2048, 32),  # a 1,024-token prompt's decode: a 2,048-token table, half filled
    (1, 256, 4),  # short tables: 64 tokens a split at least
    (2, 2048, 18), (8, 2048, 6), (16, 2048, 4),  # the occupancy bound, counted twice
    (17, 2048, 1), (32, 1024, 1),  # 272+ programs fill 132 SMs twice: one split
])
def test_auto_splits_fill_the_gpu_twice_over_for_a_half_filled_table(
    monkeypatch: pytest.MonkeyPatch, rows: int, table_tokens: int, splits: int
) -> None:
    """triton_backend._auto_splits at Ouro-1.4B's 16 kv heads on a 132-SM device (an H100's or H200's):
    twice the splits that would give 2 programs an SM, at most 32 and at least 64 tokens each; 1 on
    the CPU."""
    monkeypatch.setattr(tb, "_sm_count", lambda index: 132)
    assert tb._auto_splits(rows, 16, table_tokens, torch.device("cuda", 0)) == splits
    assert tb._auto_splits(rows, 16, table_tokens, torch.device("cpu")) == 1


# ---- GPU, compiled: Ouro-1.4B shapes -----------------------------------------------------------

OURO = dict(num_heads=16, num_kv_heads=16, head_dim=128, block_size=16)


def ouro_lens(rows: int, seed: int) -> list[int]:
    """Sequence lengths up to 1,100, with a few short ones, for rows // 4 sequences (make_batch: 4 rows each)."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(900, 1101, (rows // 4,), generator=gen)
    if len(lens) >= 8:
        lens[:3] = torch.tensor([1, 17, 250])
    return lens.tolist()


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype,atol,rtol", [(torch.bfloat16, 2e-2, 2e-2), (torch.float32, 2e-5, 2e-5)])
@pytest.mark.parametrize("rows", [64, 8])
@pytest.mark.parametrize("strided", [False, True], ids=["contig-pool", "strided-pool"])
def test_gpu_ouro_shapes(
    compiled: None, dtype: torch.dtype, atol: float, rtol: float, rows: int, strided: bool
) -> None:
    """Decode plus prefill-chunk rows over 3 depth planes; 8 sequences exercise the split path."""
    batch = make_batch(
        **OURO, planes=3, seq_lens=ouro_lens(rows, seed=rows), dtype=dtype, device="cuda", strided_pool=strided
    )
    check(batch, atol=atol, rtol=rtol)
    check(batch, atol=atol, rtol=rtol, num_splits=4)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype,atol,rtol", [(torch.bfloat16, 2e-2, 2e-2), (torch.float32, 2e-5, 2e-5)])
@pytest.mark.parametrize("strided", [False, True], ids=["contig-pool", "strided-pool"])
def test_gpu_huginn_shapes(compiled: None, dtype: torch.dtype, atol: float, rtol: float, strided: bool) -> None:
    """Huginn-0125's 55 heads × 96 (padded to 128) over 2 depth planes, single and split."""
    batch = make_batch(num_heads=55, num_kv_heads=55, head_dim=96, block_size=16, planes=2,
                       seq_lens=ouro_lens(64, seed=55), dtype=dtype, device="cuda", strided_pool=strided)
    check(batch, atol=atol, rtol=rtol)
    check(batch, atol=atol, rtol=rtol, num_splits=4)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype,atol,rtol", [(torch.bfloat16, 2e-2, 2e-2), (torch.float32, 2e-5, 2e-5)])
def test_gpu_gqa(compiled: None, dtype: torch.dtype, atol: float, rtol: float) -> None:
    """GQA (group 4, padded to the 16-row dot) and a shared plane at real head_dim."""
    batch = make_batch(
        num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, planes=1, seq_lens=ouro_lens(64, seed=3),
        dtype=dtype, device="cuda",
    )
    check(batch, atol=atol, rtol=rtol)


@gpu
@needs_cuda
def test_gpu_float64(compiled: None) -> None:
    """float64 on the GPU takes the tl.sum path with float64 accumulation."""
    batch = make_batch(
        num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, planes=2, seq_lens=[300, 5],
        dtype=torch.float64, device="cuda",
    )
    check(batch, atol=1e-12, rtol=1e-12)


@gpu
@needs_cuda
def test_gpu_cuda_graph_replay(compiled: None) -> None:
    """No host sync inside: the call captures in a CUDA graph and replays on new q and context lengths."""
    batch = make_batch(**OURO, planes=2, seq_lens=[600, 700], dtype=torch.bfloat16, device="cuda")
    scale = 128**-0.5
    tb.paged_attention(**batch, scale=scale)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tb.paged_attention(**batch, scale=scale)
    batch["q"].normal_()
    batch["context_lens"].sub_(7).clamp_(min=1)
    graph.replay()
    want = torch_ref.paged_attention(**batch, scale=scale)
    torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype,atol,rtol", [(torch.bfloat16, 2e-2, 2e-2), (torch.float32, 2e-5, 2e-5)])
@pytest.mark.parametrize("rows", [1, 32])
@pytest.mark.parametrize("store_first", [False, True])
def test_gpu_rotary_ouro_shapes(compiled: None, dtype: torch.dtype, atol: float, rtol: float, rows: int,
                                store_first: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """paged_attention_rotary at Ouro-1.4B's heads, 1 row (the split path) and 32, either hand-off of the
    writer's k and v: bit for bit the RoPE launch then paged_attention, auto and 4 splits."""
    monkeypatch.setattr(tb, "ROTARY_STORE_FIRST", store_first)
    batch = make_decode_batch(**OURO, seq_lens=ouro_lens(4 * rows, seed=rows), dtype=dtype, device="cuda")
    check_rotary(batch, atol=atol, rtol=rtol)
    check_rotary(batch, atol=atol, rtol=rtol, num_splits=4)


@gpu
@needs_cuda
def test_gpu_write_kv(compiled: None) -> None:
    """write_kv on CUDA equals torch_ref.write_kv, bf16."""
    pool = torch.zeros(2, 2, 64, 16, 16, 128, device="cuda", dtype=torch.bfloat16)
    ref = pool.clone()
    k = torch.randn(40, 16, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(40, 16, 128, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(64 * 16, device="cuda")[:40]
    tb.write_kv(pool[1, 0], pool[1, 1], k, v, slots)
    torch_ref.write_kv(ref[1, 0], ref[1, 1], k, v, slots)
    assert torch.equal(pool, ref)


@gpu
@needs_cuda
def test_gpu_finalize_kv(compiled: None) -> None:
    """finalize_kv on CUDA equals the literal loop at Ouro-1.4B head shapes (16 kv heads, Dh 128, block 16), bf16."""
    pool, tables, slots, positions, depths = finalize_case(layers=2, num_kv_heads=16, head_dim=128, block_size=16,
                                                           planes=4, rows=64, dtype=torch.bfloat16, device="cuda")
    want = finalize_by_hand(pool, tables, slots, positions, depths)
    tb.finalize_kv(pool, tables, slots, positions, depths)
    assert torch.equal(pool, want)


if __name__ == "__main__":
    interp.main(INTERP_CASES, WIDE_CASES)
