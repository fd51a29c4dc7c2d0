"""The Triton prefill kernel (triton_prefill.prefill_attention) against torch_ref (SPEC §4, §7a).

On the CPU the kernel runs in Triton's interpreter, in a child process started with
TRITON_INTERPRET=1 (as in test_triton_attention.py): tiny shapes, ragged chunks, prefixes that
are not a multiple of the block size, chunks crossing blocks, reads of different planes, MHA and
GQA, head_dim not a power of two, float32 with ieee dots; and one engine run with the Triton
backend against the torch backend. Tests marked gpu run the compiled kernel at Ouro-1.4B and
Huginn shapes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import interp
import pytest
import torch

from rlt_worker.attention import torch_ref
from rlt_worker.attention import triton_backend as tb
from rlt_worker.attention import triton_prefill as tp

pytestmark = pytest.mark.skipif(tb.triton is None, reason="Triton is not installed")

gpu = pytest.mark.gpu
needs_cuda = interp.needs_cuda


def make_chunks(
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    planes: int,
    chunks: list[tuple[int, int]],
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    strided_pool: bool = False,
    poison: bool = False,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """A paged prefill batch like the runner builds: chunk s = (its first position p_s, its length n_s).

    Every chunk's sequence holds shuffled blocks in every plane and reads plane s % planes; its
    positions 0 … p_s + n_s − 1 hold K/V (the prefix and, written first, the chunk itself). The
    caches are layer 1 of a two-layer pool (block-major, so non-contiguous views, with
    strided_pool); the block table is a column slice of a wider one. With `poison`, every cache
    slot no chunk may read (spare blocks, slots past a sequence's end) holds NaN.
    """
    gen = torch.Generator().manual_seed(seed)
    dev_gen = torch.Generator(device=device).manual_seed(seed)
    max_blocks = max(-(-(p + n) // block_size) for p, n in chunks)
    blocks_per_plane = len(chunks) * max_blocks + 3
    num_blocks = planes * blocks_per_plane
    shape = (num_blocks, 2, 2, block_size, num_kv_heads, head_dim)
    pool = torch.randn(shape, generator=dev_gen, device=device, dtype=torch.float32).to(dtype)
    pool = pool.permute(1, 2, 0, 3, 4, 5) if strided_pool else pool.permute(1, 2, 0, 3, 4, 5).contiguous()
    k_cache, v_cache = pool[1, 0], pool[1, 1]

    perms = [torch.randperm(blocks_per_plane, generator=gen) + p * blocks_per_plane for p in range(planes)]
    tables = [perms[s % planes][s * max_blocks : (s + 1) * max_blocks] for s in range(len(chunks))]
    wide = torch.full((len(chunks), max_blocks + 5), -1, dtype=torch.int32)
    wide[:, 2 : 2 + max_blocks] = torch.stack(tables).to(torch.int32)
    block_tables = wide[:, 2 : 2 + max_blocks]
    if poison:
        readable = torch.zeros(num_blocks, block_size, dtype=torch.bool)
        for (p, n), table in zip(chunks, tables, strict=True):
            t = torch.arange(p + n)
            readable[table[t // block_size], t % block_size] = True
        for cache in (k_cache, v_cache):
            cache[~readable.to(device)] = float("nan")

    lens = torch.tensor([n for _, n in chunks])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).to(torch.int32)
    starts = torch.tensor([p for p, _ in chunks], dtype=torch.int32)
    q = torch.randn(int(lens.sum()), num_heads, head_dim, generator=gen, dtype=torch.float64).to(dtype)
    small = dict(q=q, block_tables=block_tables, cu_query_lens=cu, start_positions=starts)
    return {name: t.to(device) for name, t in small.items()} | dict(k_cache=k_cache, v_cache=v_cache)


def max_query_len(batch: dict[str, torch.Tensor]) -> int:
    return int(batch["cu_query_lens"].diff().max())


def reference(batch: dict[str, torch.Tensor], scale: float, chunk_group: int = 0) -> torch.Tensor:
    """torch_ref on NaN-free copies (contiguous: it views the caches flat); chunk by chunk
    (`chunk_group` at a time) when set, to bound its memory at real shapes."""
    dense = {name: torch.nan_to_num(t) if t.is_floating_point() else t for name, t in batch.items()}
    num_chunks = len(dense["start_positions"])
    step = chunk_group or num_chunks
    cu, parts = dense["cu_query_lens"].long(), []
    for s in range(0, num_chunks, step):
        e = min(s + step, num_chunks)
        rows = slice(int(cu[s]), int(cu[e]))
        parts.append(torch_ref.prefill_attention(
            dense["q"][rows], dense["k_cache"], dense["v_cache"], dense["block_tables"][s:e],
            cu[s : e + 1] - cu[s], dense["start_positions"][s:e], scale,
        ))
    return torch.cat(parts)


def check(batch: dict[str, torch.Tensor], atol: float, rtol: float, chunk_group: int = 0, **kwargs: int) -> None:
    """The kernel's output equals torch_ref's within tolerance (and is finite)."""
    scale = batch["q"].shape[-1] ** -0.5
    kwargs.setdefault("max_query_len", max_query_len(batch))
    got = tp.prefill_attention(**batch, scale=scale, **kwargs)
    want = reference(batch, scale, chunk_group)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


def test_chunk_rows_reads_the_layout() -> None:
    """chunk_rows: row r of chunk s is at start_positions[s] + r − cu_query_lens[s]."""
    chunks, positions = torch_ref.chunk_rows(torch.tensor([0, 3, 4, 6]), torch.tensor([0, 7, 30]), 6)
    assert chunks.tolist() == [0, 0, 0, 1, 2, 2]
    assert positions.tolist() == [0, 1, 2, 7, 30, 31]


def test_torch_prefill_is_the_per_row_definition() -> None:
    """torch_ref.prefill_attention equals paged_attention with each row's chunk table and context."""
    batch = make_chunks(num_heads=4, num_kv_heads=2, head_dim=8, block_size=4, planes=2,
                        chunks=[(0, 5), (3, 2), (9, 6)], dtype=torch.float64)
    got = torch_ref.prefill_attention(**batch, scale=0.3)
    for s, (lo, hi) in enumerate(zip(batch["cu_query_lens"][:-1].tolist(), batch["cu_query_lens"][1:].tolist(),
                                     strict=True)):
        n = hi - lo
        ctx = int(batch["start_positions"][s]) + torch.arange(n, dtype=torch.int32) + 1
        want = torch_ref.paged_attention(batch["q"][lo:hi], batch["k_cache"], batch["v_cache"],
                                         batch["block_tables"][s].expand(n, -1), ctx, 0.3)
        assert torch.equal(got[lo:hi], want)


def test_cpu_tensors_without_interpreter_raise(compiled: None) -> None:
    """A clear error, not a driver crash, when CPU tensors reach the compiled path."""
    batch = make_chunks(num_heads=2, num_kv_heads=2, head_dim=16, block_size=4, planes=1, chunks=[(0, 3)])
    with pytest.raises(ValueError, match="CUDA"):
        tp.prefill_attention(**batch, scale=0.25)


# ---- CPU, interpreter: tiny shapes, in a subprocess ------------------------------------------

# (Hq, Hkv, Dh, block, planes, chunks (first position, length)) and kernel overrides.
_SHAPES: list[tuple[str, tuple, dict]] = [
    # prefixes 3, 13 (not block multiples), chunks crossing blocks, two planes, MHA
    ("mha-d32-b4-2planes", (2, 2, 32, 4, 2, [(0, 5), (3, 9), (13, 17)]), {}),
    # GQA group 2; several query tiles and key tiles per chunk; a 1-position chunk
    ("gqa2-d16-b16", (4, 2, 16, 16, 3, [(0, 20), (7, 1), (40, 33)]), {}),
    # group 3 (padded to 4), head_dim 24 (padded to 32), 32-row tiles (8 positions each)
    ("gqa3-d24-b8", (6, 2, 24, 8, 2, [(5, 11), (0, 2), (17, 14)]), {"block_m": 32}),
    # Huginn's head_dim 96 (padded to 128), one plane
    ("mha-d96-b16", (2, 2, 96, 16, 1, [(16, 9), (0, 18)]), {"block_n": 32}),
    # no max_query_len: the grid falls back to N rows per chunk
    ("gqa4-d16-b4-no-max", (8, 2, 16, 4, 2, [(2, 6), (9, 3)]), {"max_query_len": None}),
]


def _interp_prefill(args: tuple, strided: bool, poison: bool, **overrides: int | None) -> None:
    hq, hkv, dh, bs, planes, chunks = args
    batch = make_chunks(num_heads=hq, num_kv_heads=hkv, head_dim=dh, block_size=bs, planes=planes,
                        chunks=chunks, strided_pool=strided, poison=poison)
    if overrides.get("max_query_len", 0) is None:
        scale = dh**-0.5
        got = tp.prefill_attention(**batch, scale=scale)
        torch.testing.assert_close(got, reference(batch, scale), atol=1e-5, rtol=1e-5)
        return
    check(batch, atol=1e-5, rtol=1e-5, **overrides)


def _interp_float64() -> None:
    """float64 goes row by row through the decode kernel (float64 accumulation): exact to 1e-12."""
    batch = make_chunks(num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, planes=2,
                        chunks=[(0, 7), (6, 5)], dtype=torch.float64)
    check(batch, atol=1e-12, rtol=1e-12)


def _record_logits(model: torch.nn.Module) -> list[torch.Tensor]:
    """Wrap the model's lm_head so that every call's logits are kept (workers=0: the model is in-process)."""
    seen: list[torch.Tensor] = []
    real_head = model.lm_head

    def head(hidden: torch.Tensor) -> torch.Tensor:
        seen.append(real_head(hidden))
        return seen[-1]

    object.__setattr__(model, "lm_head", head)
    return seen


def _interp_engine() -> None:
    """toy-ouro (GQA) and toy-huginn (outer plane too), float32, prompts chunked after prefixes that are not
    block multiples: with the Triton backend (prefill kernel) every CODA's logits equal the torch
    backend's within 1e-4, and the tokens and exit depths are equal (greedy top-2 gaps here are > 0.05)."""
    from protocol.messages import SamplingParams
    from rlt_engine import LLM

    prompts = [list(range(3, 3 + n)) for n in (21, 9, 2)]
    params = [SamplingParams(max_tokens=3, temperature=0.0, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=2, temperature=0.8, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=2, temperature=0.0, seed=9, ignore_eos=True)]
    real_prefill = tp.prefill_attention
    kernel_calls = []

    def counting_prefill(*args: object, **kwargs: object) -> torch.Tensor:
        kernel_calls.append(kwargs["max_query_len"])
        return real_prefill(*args, **kwargs)

    tp.prefill_attention = counting_prefill  # the child process's own module: nothing to restore
    for model in ("toy-ouro", "toy-huginn"):
        runs, logits = {}, {}
        for backend in ("torch", "triton"):
            llm = LLM(model, workers=0, device="cpu", dtype="float32", attention_backend=backend,
                      exit_mode="fixed", max_loops=2, prefill_chunk_size=6, num_blocks=64, block_size=4)
            seen = _record_logits(llm.engine.executor._worker.runner.model)
            try:
                runs[backend] = [(o.token_ids, o.exit_depths) for o in llm.generate(prompts, params, use_tqdm=False)]
            finally:
                llm.close()
            logits[backend] = seen
        assert len(logits["torch"]) == len(logits["triton"]) > 0
        for want, got in zip(logits["torch"], logits["triton"], strict=True):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        assert runs["triton"] == runs["torch"], (model, runs)
    assert kernel_calls and max(kernel_calls) == 6, kernel_calls


INTERP_CASES: dict[str, Callable[[], None]] = {
    f"{name}-{'strided' if strided else 'contig'}{'-poisoned' if poison else ''}": partial(
        _interp_prefill, args, strided, poison, **kw
    )
    for name, args, kw in _SHAPES
    for strided, poison in ((False, False), (True, True))
} | {
    # Huginn's 55 heads (odd) × 96 after a 16-position prefix; strided and poisoned only (55 heads are slow here)
    "huginn-55h-d96": partial(_interp_prefill, (55, 55, 96, 16, 2, [(16, 3)]), True, True),
    "float64": _interp_float64, "engine-triton-equals-torch": _interp_engine,
}


@pytest.mark.parametrize("case", list(INTERP_CASES))
def test_interpreter_matches_torch_ref(interp_verdicts: dict[str, str], case: str) -> None:
    """Each interpreter case (see INTERP_CASES) passed in the child."""
    verdict = interp_verdicts[case]
    assert verdict == "ok", verdict


def test_bench_script_smoke(tmp_path: Path) -> None:
    """scripts/bench_prefill_kernel.py runs end to end (--smoke: tiny shapes, CPU interpreter) and writes its JSON."""
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(root / "scripts" / "bench_prefill_kernel.py"), "--smoke", "--sweep", "--json", str(out)],
        cwd=root, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    results = json.loads(out.read_text())["results"]
    assert len(results) == 4 and all(r["max_abs_err"] < 1e-4 and r["kernel_ms"] > 0 for r in results)
    assert [("sdpa_ms" in r) for r in results] == [r["prefix"] == 0 for r in results]


# ---- GPU, compiled: Ouro-1.4B and Huginn shapes ----------------------------------------------

OURO = dict(num_heads=16, num_kv_heads=16, head_dim=128, block_size=16)
# Chunks of 512 after prefixes 0 and 512, a 1,024 chunk, and ragged ones after unaligned prefixes.
OURO_CHUNKS = [(0, 512), (512, 512), (0, 1024), (300, 77), (1001, 1), (17, 130)]


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype,atol,rtol", [(torch.bfloat16, 2e-2, 2e-2), (torch.float32, 2e-5, 2e-5)])
def test_gpu_ouro_shapes(compiled: None, dtype: torch.dtype, atol: float, rtol: float) -> None:
    """Ouro-1.4B heads over 3 planes, strided pool with NaN in every unreadable slot, default tiles."""
    batch = make_chunks(**OURO, planes=3, chunks=OURO_CHUNKS, dtype=dtype, device="cuda", strided_pool=True,
                        poison=True)
    check(batch, atol=atol, rtol=rtol, chunk_group=1)


@gpu
@needs_cuda
@pytest.mark.parametrize("tiles", [dict(block_m=64, block_n=32, num_warps=4), dict(block_m=128, block_n=128),
                                   dict(block_m=64, block_n=64, num_stages=3)], ids=["m64-n32", "m128-n128", "m64-s3"])
def test_gpu_ouro_tiles(compiled: None, tiles: dict) -> None:
    """bf16 at other tile sets (those the benchmark's sweep may pick), and a one-chunk batch (block_m 64 heuristic)."""
    batch = make_chunks(**OURO, planes=3, chunks=OURO_CHUNKS, dtype=torch.bfloat16, device="cuda", poison=True)
    check(batch, atol=2e-2, rtol=2e-2, chunk_group=1, **tiles)
    one = make_chunks(**OURO, planes=1, chunks=[(512, 512)], dtype=torch.bfloat16, device="cuda")
    check(one, atol=2e-2, rtol=2e-2)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype,atol,rtol", [(torch.bfloat16, 2e-2, 2e-2), (torch.float32, 2e-5, 2e-5)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (55, 55, 96), (12, 3, 96)],
                         ids=["gqa4-d128", "huginn-d96", "gqa4-d96"])
def test_gpu_gqa_and_huginn(
    compiled: None, dtype: torch.dtype, atol: float, rtol: float, heads: int, kv_heads: int, head_dim: int
) -> None:
    """GQA (group 4 folded into the tile) and Huginn's 55 heads × 96 (padded to 128) at real sizes."""
    batch = make_chunks(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, block_size=16, planes=2,
                        chunks=[(0, 512), (512, 256), (33, 95)], dtype=dtype, device="cuda", poison=True)
    check(batch, atol=atol, rtol=rtol, chunk_group=1)


@gpu
@needs_cuda
def test_gpu_float64(compiled: None) -> None:
    """float64 on the GPU goes row by row through the decode kernel's float64 path."""
    batch = make_chunks(num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, planes=2,
                        chunks=[(0, 40), (100, 33)], dtype=torch.float64, device="cuda")
    check(batch, atol=1e-12, rtol=1e-12)


@gpu
@needs_cuda
def test_gpu_cuda_graph_replay(compiled: None) -> None:
    """No host sync inside: the call captures in a CUDA graph and replays on new q, starts and chunk lengths."""
    batch = make_chunks(**OURO, planes=2, chunks=[(0, 256), (256, 256)], dtype=torch.bfloat16, device="cuda")
    scale = 128**-0.5
    tp.prefill_attention(**batch, scale=scale, max_query_len=256)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tp.prefill_attention(**batch, scale=scale, max_query_len=256)
    batch["q"].normal_()
    batch["start_positions"].copy_(torch.tensor([100, 7], device="cuda"))
    batch["cu_query_lens"].copy_(torch.tensor([0, 200, 450], device="cuda"))  # rows 450 … 511 unused
    graph.replay()
    used = batch | {"q": batch["q"][:450]}
    torch.testing.assert_close(out[:450], reference(used, scale, chunk_group=1), atol=2e-2, rtol=2e-2)


@gpu
@needs_cuda
def test_gpu_64bit_addresses(compiled: None) -> None:
    """Block ids whose offsets pass 2³¹ elements (a 4.5 GB cache) are addressed correctly."""
    block_size, head_dim = 16, 128
    per_block = block_size * head_dim  # one kv head
    num_blocks = 2**31 // per_block + 64
    big = torch.empty(num_blocks, block_size, 1, head_dim, dtype=torch.bfloat16, device="cuda")
    small = make_chunks(num_heads=8, num_kv_heads=1, head_dim=head_dim, block_size=block_size, planes=1,
                        chunks=[(0, 200), (150, 100)], dtype=torch.bfloat16, device="cuda")
    # Move the small pool's blocks to the top of the big cache: ids past 2³¹ / per_block.
    used = small["block_tables"].long()
    top = num_blocks - 1 - used
    big[top.reshape(-1)] = small["k_cache"][used.reshape(-1)]
    assert int(top.min()) * per_block >= 2**31
    scale = head_dim**-0.5
    got = tp.prefill_attention(small["q"], big, big, top.to(torch.int32), small["cu_query_lens"],
                               small["start_positions"], scale, max_query_len=200)
    want = torch_ref.prefill_attention(small["q"], small["k_cache"], small["k_cache"], small["block_tables"],
                                       small["cu_query_lens"], small["start_positions"], scale)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@gpu
@needs_cuda
@pytest.mark.parametrize("model,mode", [("toy-ouro", "trace"), ("toy-huginn", "fixed")])
def test_gpu_toy_chunked_prefill_matches_cpu_reference(model: str, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine on CUDA/Triton with prompts in chunks of 6 (prefixes off the 16-block grid, so the
    prefill kernel reads paged prefixes) equals the float64 CPU reference per SPEC §7a."""
    from test_gpu import check_toy_against_reference

    check_toy_against_reference(model, mode, "random", monkeypatch, device="cuda", backend="triton",
                                prefill_chunk_size=6)


if __name__ == "__main__":
    interp.main(INTERP_CASES)
