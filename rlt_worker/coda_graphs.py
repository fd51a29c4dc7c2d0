"""CODA (LM head + sampling) of models whose coda has no attention (Ouro), replayed from CUDA graphs.

Eager, a CODA batch is the head GEMM plus the sampler's small kernels, each paying its launch: ~40
greedy; sampling, the Philox noise (one Triton launch on CUDA, ~180 torch launches on the torch
path), the Gumbel argmax, and top-k/top-p's sort and masks. A graph
per (rows bucket, SamplingKind) captures: the gather of the rows' state and sampling
parameters from the runner's per-slot tensors, `coda` (Ouro: identity), `lm_head` and
`sampler.sample`, into static token and logprob buffers. Its inputs are one static [3, rows]
index buffer (slots, seeds, sample indices) written by one host→device copy per batch; after the
replay the real rows' tokens go to the slot table (`runner.tokens`) and their copies to the result.

    rows bucket  the loop passes' buckets (1, 2, 4, … ≤ the slot count's); padding rows read slot
                 0's state and parameters (only read: sampling is row-wise, so they change no real
                 row) and their outputs are dropped
    kind         SamplingKind, which the host knows from the rows' options: greedy (every row's
                 temperature ≤ 0), gumbel (no sampled row uses top-k or top-p: no sort) or filtered
                 (the general path, exact for every row)

Eager instead: batches with forced tokens, with rows that only replay (sample index −1), and
with more rows than the largest bucket (`coda_eager` counts them). Graphs share the loop passes'
memory pool and side stream, and are captured with them at start-up (`LoopPassGraphs.capture_all`).
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rlt_worker.sampler import SamplingKind, SamplingTensors

if TYPE_CHECKING:
    from rlt_worker.cuda_graphs import LoopPassGraphs

log = logging.getLogger("rlt.worker")


class CodaGraphs:
    """Captures and replays CODA batches (module docstring); owned by the runner's LoopPassGraphs."""

    def __init__(self, passes: LoopPassGraphs) -> None:
        self.passes = passes
        self.runner = passes.runner
        device = self.runner.device
        self._index = {b: torch.zeros(3, b, dtype=torch.long, device=device) for b in passes.row_buckets}
        self._graphs: dict[tuple[int, SamplingKind], Any] = {}
        self._outputs: dict[tuple[int, SamplingKind], tuple[torch.Tensor, torch.Tensor]] = {}
        self.error: str | None = None  # a capture failed: every later CODA runs eagerly

    def capture_all(self) -> int:
        """Capture every (rows bucket, kind) not captured yet, largest first; the number captured."""
        keys = [(rows, kind) for rows in reversed(self.passes.row_buckets) for kind in SamplingKind]
        return sum(self._graph(key) is not None for key in keys if key not in self._graphs)

    def _graph(self, key: tuple[int, SamplingKind]) -> Any:
        """The key's graph, captured now if it is not yet; None when capturing failed (now or before).

        A failed CODA capture (e.g. the sampler's [rows, vocab] float64 buffers not fitting beside a
        full KV pool) turns off CODA graphs only: the loop passes keep theirs."""
        if key not in self._graphs and self.error is None and self.passes.stats.error is None:
            rows, kind = key
            try:
                self._graphs[key] = self.passes._capture(functools.partial(self._coda, rows, kind),
                                                         self._warm_up(rows))
            except Exception as exc:  # keep serving: CODA runs eagerly from now on
                log.exception("CUDA graph capture of CODA of %d rows failed; CODA runs eagerly", rows)
                self.error = self.passes.stats.coda_error = f"{type(exc).__name__}: {exc}"
        return self._graphs.get(key)

    def run(
        self, slots: np.ndarray, seeds: np.ndarray, indices: np.ndarray, kind: SamplingKind
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(tokens, logprobs) of these rows from a graph, the tokens also stored in their slots; None
        (nothing run) when no bucket fits or capturing failed."""
        stats = self.passes.stats
        n = len(slots)
        rows = next((b for b in self.passes.row_buckets if b >= n), None)
        if rows is None or stats.error is not None or self.error is not None:
            stats.coda_eager += 1
            return None
        key = (rows, kind)
        lazy = key not in self._graphs
        graph = self._graph(key)
        if graph is None:
            stats.coda_eager += 1
            return None
        stats.lazy_captures += lazy
        host = np.zeros((3, rows), dtype=np.int64)  # padding rows: slot 0, seed 0, index 0
        host[0, :n], host[1, :n], host[2, :n] = slots, seeds, indices
        index = self._index[rows]
        self.runner.upload_into(index, host)
        graph.replay()
        tokens, logprobs = self._outputs[key]
        self.runner.tokens[index[0, :n]] = tokens[:n]
        stats.coda_replays += 1
        return tokens[:n].clone(), logprobs[:n].clone()  # the next replay overwrites the static buffers

    def _warm_up(self, rows: int) -> functools.partial:
        return functools.partial(self._index[rows].zero_)  # slot 0, seed 0, index 0: reads only

    def _coda(self, rows: int, kind: SamplingKind) -> None:
        """The captured function: head and sampler over the bucket's static rows."""
        runner = self.runner
        slots, seeds, indices = self._index[rows]
        params = SamplingTensors(temperature=runner.temperature[slots], top_k=runner.top_k[slots],
                                 top_p=runner.top_p[slots], seeds=seeds, indices=indices)
        self._outputs[(rows, kind)] = runner.sample_on_device(slots, params, kind)
