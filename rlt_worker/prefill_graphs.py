"""PREFILL chunk loop passes replayed from CUDA graphs, bucketed by token count and chunk count.

Eager, one prefill loop pass of the Ouro-1.4B shape is ~280 launches from Python (per layer: q|k|v,
RoPE, the K/V write, the prefill kernel, o, two add + RMSNorm, gate|up, SwiGLU, down), so a
1,024-token chunk's D = 4 passes spend more time on the host than on the GPU (docs/benchmarks.md,
"One prompt's TTFT, split"). A captured pass is one graph launch.

What a graph captures: one loop pass of a bucket's T token rows at the depth its static `depths`
hold — the block-table gather of the context, the model's loop with its K/V writes and the paged
prefill kernel (attention/triton_prefill.py, grid sized by T), and the copy of the new state into
the static state buffer. The runner replays it D times per batch, filling `depths` on the device
before each replay. Everything it touches lives at a fixed address: one int64 metadata buffer laid
out as below, the static state and embedded buffers [T, hidden], the block tables, the KV pool and
the weights. The rest of PREFILL stays eager on the real rows (PrefillRows, rlt_worker/prefill_rows.py,
which a batch whose loops ride the plan's passes takes instead of a graph): embedding (Huginn: its
prelude), the state's start, Huginn's coda K/V, and each chunk's last row into its slot (a few launches).

    bucket (T tokens, S chunks), s real chunks of n rows in all (s ≤ S, n ≤ T):
        rows            | chunk 0 | … | chunk s−1 | padding rows n … T−1 |
        chunks            0 … s−1 real · s … S−1 empty · S the padding chunk      S + 1 entries
        cu_query_lens     [0, n0, n0 + n1, …, n, n, …, n, T]                         S + 2
        start_positions   real chunks' first positions | 0 …                         S + 1
        slots             real chunks' slots | the dummy slot …                     S + 1
        depths            the pass's depth in every entry (written before each replay)
        positions         real rows' positions | 0, 1, …, T − n − 1                  T
        table_rows        real rows' chunks | S                                      T
        token_ids         real rows' tokens | 0                                      T (read eagerly)

Padding rows are the padding chunk: consecutive positions 0 … T − n − 1 of the dummy slot, whose
every block-table column (every plane) is the scratch block the engine never allocates. So they
write K/V only into that block (positions alias modulo the block size; no real row reads it) and
attend only to it, and every other op of a layer is row-wise: no real row's output changes.
Empty chunks hold no rows (their kernel programs return at once).

Buckets (pure functions below, tested on the CPU):
    tokens  16, 32, …, 512, then multiples of 512, then max_num_batched_tokens, none above the
            model's max_model_len (a padding position must stay inside every table). Below 512
            rows a pass is launch- and latency-bound, so doubling costs little GPU time; above,
            the GEMMs grow with T, so steps of 512 bound the padding to under half at 1,024
            and under a third beyond, and chunks of 512, 1,024 and k × 512 (k chunks of 512 in one
            step) are exact buckets. Each is a multiple of the kernel's 64-row query tile from 64 on.
    chunks  1, 2, 4, … up to the power of two ≥ min(T, slot count): a PrefillBatch holds one chunk
            per sequence, and the kernel grid's chunk dimension is S + 1, so an empty chunk costs
            one program per query tile and kv head.

Capture: with the decode graphs, largest bucket first (`LoopPassGraphs.capture_all`: the shared
pool grows once, to the largest prefill pass), two warm-up passes on padding rows only, then the
capture. A failed capture turns off prefill graphs only (`prefill_error`). Eager instead, counted in
`prefill_eager` (passes): batches of more tokens than the largest bucket, and every prefill after a
failed capture. A batch whose chunks are all single positions (SHARED always; a one-token last chunk)
is graphed too, through the prefill kernel where its eager pass takes the decode kernel: the same
attention, rounded differently on the GPU (on the CPU both are torch_ref's per-row definition).
`emulate=True` (CPU tests) runs the same padded, static-buffer pass eagerly.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rlt_worker.paged_context import PagedContext, PrefillChunks
from rlt_worker.prefill_rows import DeviceChunks, HostChunks, PrefillRows

if TYPE_CHECKING:
    from rlt_worker.cuda_graphs import LoopPassGraphs
    from rlt_worker.model_runner import ModelRunner

log = logging.getLogger("rlt.worker")

MIN_TOKENS = 16  # the smallest token bucket
TOKEN_STEP = 512  # token buckets double up to this, then grow by it


def next_pow2(n: int) -> int:
    """The smallest power of two ≥ n (1 for n ≤ 1)."""
    return 1 << max(0, n - 1).bit_length()


def token_buckets(max_tokens: int, max_positions: int) -> tuple[int, ...]:
    """Token buckets: MIN_TOKENS, doubling to TOKEN_STEP, then steps of TOKEN_STEP, ending at
    min(max_tokens, max_positions) itself."""
    top = min(max_tokens, max_positions)
    buckets, size = [], MIN_TOKENS
    while size < top:
        buckets.append(size)
        size = size * 2 if size < TOKEN_STEP else size + TOKEN_STEP
    return (*buckets, top)


def chunk_buckets(tokens: int, max_slots: int) -> tuple[int, ...]:
    """Chunk-count buckets of a token bucket: 1, 2, 4, … up to next_pow2(min(tokens, max_slots))."""
    top = next_pow2(min(tokens, max_slots))
    return tuple(1 << i for i in range(top.bit_length()))


def prefill_bucket(
    num_tokens: int, num_chunks: int, buckets: tuple[int, ...], max_slots: int
) -> tuple[int, int] | None:
    """The (tokens, chunks) bucket of a batch, or None when it has more tokens than the largest."""
    tokens = next((b for b in buckets if b >= num_tokens), None)
    if tokens is None or next_pow2(num_chunks) > chunk_buckets(tokens, max_slots)[-1]:
        return None
    return tokens, next_pow2(num_chunks)


@dataclass(frozen=True)
class PrefillLayout:
    """The static metadata of one bucket (module docstring), on the host; `packed()` is the order of
    the device buffer."""

    positions: np.ndarray  # [T]
    table_rows: np.ndarray  # [T]
    token_ids: np.ndarray  # [T]
    slots: np.ndarray  # [S + 1]
    start_positions: np.ndarray  # [S + 1]
    depths: np.ndarray  # [S + 1]
    cu_query_lens: np.ndarray  # [S + 2]

    def packed(self) -> np.ndarray:
        return np.concatenate([self.positions, self.table_rows, self.token_ids, self.slots, self.start_positions,
                               self.depths, self.cu_query_lens]).astype(np.int64)


def pad_chunks(chunks: HostChunks, tokens: int, num_chunks: int, dummy_slot: int, depth: int = 1) -> PrefillLayout:
    """The layout of `chunks` in bucket (tokens, num_chunks): real rows first, then the padding chunk;
    the real chunks at loop `depth`, the other entries at loop 1 (a prefill graph rewrites every depth
    before each replay, a mixed graph reads them as laid out)."""
    n, s = chunks.num_rows, len(chunks.slots)
    if n > tokens or s > num_chunks:
        raise ValueError(f"{s} chunks of {n} rows do not fit the bucket of {num_chunks} chunks, {tokens} tokens")
    pad = tokens - n

    def entries(real: np.ndarray, fill: int) -> np.ndarray:  # S + 1 per-chunk entries
        return np.concatenate([real, np.full(num_chunks + 1 - s, fill)]).astype(np.int64)

    return PrefillLayout(
        positions=np.concatenate([chunks.positions(), np.arange(pad)]).astype(np.int64),
        table_rows=np.concatenate([chunks.table_rows(), np.full(pad, num_chunks)]).astype(np.int64),
        token_ids=np.concatenate([chunks.token_ids, np.zeros(pad)]).astype(np.int64),
        slots=entries(chunks.slots, dummy_slot),
        start_positions=entries(chunks.start_positions, 0),
        depths=entries(np.full(s, depth), 1),
        cu_query_lens=np.concatenate([chunks.cu_query_lens(), np.full(num_chunks - s, n), [tokens]]).astype(np.int64),
    )


@dataclass(frozen=True)
class StaticChunks:
    """One bucket's device views of the static buffers (fixed addresses: what its graph reads)."""

    positions: torch.Tensor
    table_rows: torch.Tensor
    token_ids: torch.Tensor
    slots: torch.Tensor
    start_positions: torch.Tensor
    depths: torch.Tensor
    cu_query_lens: torch.Tensor
    metadata: torch.Tensor  # all of the above, in PrefillLayout.packed() order
    state: torch.Tensor  # [T, hidden]
    embedded: torch.Tensor  # [T, hidden]


class ChunkBuffers:
    """The (tokens, chunks) buckets of batches of up to `max_tokens` rows, and their static chunk
    buffers: one metadata buffer, the state and the embedded rows, each bucket a view of their start
    (fixed addresses)."""

    def __init__(self, runner: ModelRunner, max_tokens: int) -> None:
        self.runner = runner
        self.max_slots = runner.config.max_slots
        self.token_buckets = token_buckets(max_tokens, runner.model.info.max_model_len)
        tokens = self.token_buckets[-1]
        chunks = chunk_buckets(tokens, self.max_slots)[-1]
        device, hidden = runner.device, runner.state.shape[1]
        self._metadata = torch.zeros(3 * tokens + 4 * chunks + 5, dtype=torch.long, device=device)
        self._state = torch.zeros(tokens, hidden, dtype=runner.state.dtype, device=device)
        self._embedded = torch.zeros_like(self._state)
        self._static: dict[tuple[int, int], StaticChunks] = {}

    def keys(self) -> list[tuple[int, int]]:
        """Every (tokens, chunks) bucket, largest first."""
        return [(t, s) for t in reversed(self.token_buckets) for s in reversed(chunk_buckets(t, self.max_slots))]

    def bucket(self, chunks: HostChunks) -> tuple[int, int] | None:
        """The (tokens, chunks) bucket of these chunks, or None when they have more tokens than the largest."""
        return prefill_bucket(chunks.num_rows, len(chunks.slots), self.token_buckets, self.max_slots)

    def views(self, key: tuple[int, int]) -> StaticChunks:
        """The bucket's views of the static buffers, in PrefillLayout.packed() order."""
        if key not in self._static:
            tokens, chunks = key
            sizes = [tokens] * 3 + [chunks + 1] * 3 + [chunks + 2]
            metadata = self._metadata[: sum(sizes)]
            fields = torch.split(metadata, sizes)
            self._static[key] = StaticChunks(*fields, metadata=metadata, state=self._state[:tokens],
                                             embedded=self._embedded[:tokens])
        return self._static[key]

    def upload(self, key: tuple[int, int], layout: PrefillLayout) -> StaticChunks:
        """Write a layout into the bucket's static metadata (one host→device copy); its views."""
        static = self.views(key)
        self.runner.upload_into(static.metadata, layout.packed())
        return static


class PrefillGraphs:
    """Captures and replays PREFILL chunk loop passes (module docstring); owned by the runner's LoopPassGraphs."""

    def __init__(self, passes: LoopPassGraphs, max_tokens: int) -> None:
        runner = passes.runner
        self.passes = passes
        self.runner = runner
        self.buffers = ChunkBuffers(runner, max_tokens)
        self._graphs: dict[tuple[int, int], Any] = {}
        self.error: str | None = None  # a capture failed: every later prefill runs eagerly

    @property
    def token_buckets(self) -> tuple[int, ...]:
        return self.buffers.token_buckets

    def capture_all(self) -> int:
        """Capture every bucket not captured yet, largest first; the number captured."""
        return sum(self._graph(key) is not None for key in self.buffers.keys() if key not in self._graphs)

    def run(self, chunks: HostChunks) -> bool:
        """PREFILL of these chunks with their D loop passes replayed from a graph; False (nothing run)
        when no bucket takes them (then the runner runs them eagerly)."""
        stats, depth = self.passes.stats, self.runner.config.max_depth
        key = self.buffers.bucket(chunks)
        if key is None:
            stats.prefill_eager += depth
            return False
        lazy = key not in self._graphs
        graph = self._graph(key)
        if graph is None:
            stats.prefill_eager += depth
            return False
        stats.lazy_captures += lazy
        static = self.buffers.upload(key, pad_chunks(chunks, *key, self.passes.dummy_slot))
        n, s = chunks.num_rows, len(chunks.slots)
        cu = static.cu_query_lens[: s + 1]
        kernel = PrefillChunks(cu, static.start_positions[:s], static.table_rows[:n], chunks.max_query_len)
        device = DeviceChunks(static.slots[:s], static.positions[:n], static.token_ids[:n], cu, kernel)

        def loops(state: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
            static.state[:n] = state
            static.embedded[:n] = embedded
            for d in range(1, depth + 1):
                static.depths.fill_(d)
                graph.replay()
            return static.state[:n]

        PrefillRows(self.runner, chunks, device).finish(loops)
        stats.prefill_replays += depth
        stats.prefill_rows += depth * n
        stats.prefill_padded_rows += depth * (key[0] - n)
        name = f"{key[0]}x{key[1]}"
        stats.prefill_buckets[name] = stats.prefill_buckets.get(name, 0) + 1
        return True

    def _graph(self, key: tuple[int, int]) -> Any:
        """The bucket's graph, captured now if it is not yet; None when capturing failed (now or before)."""
        if key not in self._graphs and self.error is None and self.passes.stats.error is None:
            try:
                self._graphs[key] = self.passes._capture(functools.partial(self._pass, key),
                                                         functools.partial(self._warm_up, key))
            except Exception as exc:  # keep serving: prefill runs eagerly from now on
                log.exception("CUDA graph capture of a prefill pass of %d tokens × %d chunks failed; "
                              "prefill runs eagerly", *key)
                self.error = self.passes.stats.prefill_error = f"{type(exc).__name__}: {exc}"
        return self._graphs.get(key)

    def _warm_up(self, key: tuple[int, int]) -> None:
        """Point the bucket at padding rows only (the dummy slot and the scratch block)."""
        self.buffers.upload(key, pad_chunks(HostChunks.empty(), *key, self.passes.dummy_slot))

    def _pass(self, key: tuple[int, int]) -> None:
        """The captured function: one loop pass of the bucket's static rows at its static depths."""
        static = self.buffers.views(key)
        static.state.copy_(self.runner.model.loop(static.state, static.embedded, static.positions,
                                                  chunk_context(self.runner, static, key[0])))


def chunk_context(runner: ModelRunner, static: StaticChunks, tokens: int) -> PagedContext:
    """The loop-plane context of a bucket's static chunks, at their static depths (the prefill kernel's
    grid sized by the bucket's `tokens`)."""
    chunks = PrefillChunks(static.cu_query_lens, static.start_positions, static.table_rows, max_query_len=tokens)
    return runner.context(static.slots, static.positions, static.depths, runner.block_tables.shape[2],
                          outer=False, chunks=chunks)
