"""Loop passes over rows no decode graph holds, replayed from CUDA graph pieces around eager attention.

A mixed pass (docs/design.md, "Mixed batches") stacks a plan's slot rows and the rows of its riding
prompt chunks, and each part attends through its own kernel. How many rows of each kind a pass holds
changes from pass to pass, and a decode or prefill graph fixes that, so these passes ran eagerly:
about 280 launches from Python for the fused Ouro-1.4B loop, more host time than GPU time. Yet
everything in a loop but attention is row-wise (GEMMs, norms, RoPE tables, SwiGLU, residual adds):
only the attention calls need to know which row is which. So the loop is captured once per token
bucket T, cut at each of its L attention calls:

    piece 0 | attention 0 | piece 1 | … | attention L−1 | piece L

    piece i      a CUDA graph: the loop from the previous cut to the next attention call, over the T
                 static rows of the bucket (state, embedded, positions at fixed addresses), ending
                 with a copy of the call's inputs (q|k|v, or q, k, v) into static buffers; piece L
                 copies the loop's result into the static output instead
    attention i  eager, on the pass's own context: its attend_rotary (or attend) over the n real rows
                 of those buffers, the result copied into rows 0 … n−1 of the static attention
                 output that piece i + 1 reads

A pass is then L + 1 graph launches plus the attention calls' own launches (per part: the K/V write,
the kernel, the split merge; StackedContext) instead of every launch of the loop. The attention
calls see the real rows only, so their kernels are the eager pass's, and the pieces' GEMMs have T
rows where the eager pass's have n: the cuBLAS kernel may differ, and with it the rounding (the
decode graphs' row padding has the same effect; SPEC §7a). Padding rows n … T−1 hold what the
static buffers held (zeros at first, then older rows): every op on them is row-wise, they never
reach attention, and nothing reads their results.

Memory. The pieces share the decode graphs' pool. The residual crosses every cut: allocated inside
piece i, read by piece i + 1. The capture holds it (model.loop's own reference) until piece i + 1 is
done with it, so no later allocation of that capture takes its memory; after the capture only other
graphs' captures may reuse it, and those never run between a bucket's pieces. Attention's inputs are
copied out of the pool instead (for Ouro-1.4B at 576 rows, 7 MB of bf16 q|k|v a layer), since holding
them for the worker's life would take 24 tensors of every bucket from the pool. The static inputs,
the attention output and the result are allocated outside the pool, once, for the largest bucket.

Buckets: MIN_TOKENS doubling to 512, then steps of PIECE_STEP up to the plan's token budget. A mixed
pass is a prompt chunk (512 tokens at c = 32) plus the decode rows, so steps of 512 would nearly
double it; a GEMM over more than 512 rows costs in proportion to its rows, and 64 is cuBLAS's row
tile there. Captured at start-up with the other graphs (`mixed_graphs`), largest first; a pass of
more rows, or every pass after a failed capture (`piece_error`), runs eagerly (`piece_eager`).
`emulate=True` (CPU tests) runs the same static, padded, cut function eagerly: attention i runs on
the pass's context where the capture would end piece i.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from rlt_worker.models.base import AttentionContext, LayerId, Rotary
from rlt_worker.prefill_graphs import MIN_TOKENS, TOKEN_STEP

if TYPE_CHECKING:
    from rlt_worker.cuda_graphs import LoopPassGraphs

log = logging.getLogger("rlt.worker")

PIECE_STEP = 64  # token buckets above TOKEN_STEP grow by this


def piece_buckets(max_tokens: int) -> tuple[int, ...]:
    """Token buckets: MIN_TOKENS, doubling to TOKEN_STEP, then steps of PIECE_STEP, ending at max_tokens."""
    buckets, size = [], MIN_TOKENS
    while size < max_tokens:
        buckets.append(size)
        size = size * 2 if size < TOKEN_STEP else size + PIECE_STEP
    return (*buckets, max_tokens)


@dataclass(frozen=True)
class AttentionCall:
    """One attention call of the loop, as the model made it over a bucket's static rows."""

    layer: LayerId
    tensors: tuple[torch.Tensor, ...]  # (qkv,) for attend_rotary, (q, k, v) for attend
    rope: Rotary | None  # attend_rotary's; None: attend

    @property
    def output_shape(self) -> tuple[int, ...]:
        """[T, Hq, Dh]: what the call returns."""
        first = self.tensors[0]
        if self.rope is None:
            return tuple(first.shape)
        return (first.shape[0], self.rope.num_heads, self.rope.head_dim)

    def into(self, buffers: tuple[torch.Tensor, ...]) -> AttentionCall:
        """This call over `buffers` (static, at least as many rows), its tensors copied into them."""
        views = tuple(b[: len(t)].view(t.shape) for b, t in zip(buffers, self.tensors, strict=True))
        for view, tensor in zip(views, self.tensors, strict=True):
            view.copy_(tensor)
        return AttentionCall(self.layer, views, self.rope)

    def run(self, context: AttentionContext, num_rows: int, out: torch.Tensor) -> torch.Tensor:
        """The call on the pass's context over the first `num_rows` rows; written into out[:num_rows]."""
        if self.rope is None:
            q, k, v = (t[:num_rows] for t in self.tensors)
            result = context.attend(self.layer, q, k, v)
        else:
            rope = self.rope._replace(positions=self.rope.positions[:num_rows])
            result = context.attend_rotary(self.layer, self.tensors[0][:num_rows], rope)
        out[:num_rows].copy_(result.reshape(out[:num_rows].shape))
        return out


class CutContext:
    """The context model.loop sees in a bucket's function: each attention call goes to `on_call`,
    which returns the [T, Hq, Dh] tensor the loop reads as that call's output."""

    def __init__(self, on_call: Callable[[AttentionCall], torch.Tensor]) -> None:
        self._on_call = on_call

    def attend(self, layer: LayerId, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self._on_call(AttentionCall(layer, (q, k, v), None))

    def attend_rotary(self, layer: LayerId, qkv: torch.Tensor, rope: Rotary) -> torch.Tensor:
        return self._on_call(AttentionCall(layer, (qkv,), rope))


@dataclass
class PiecewisePass:
    """One bucket's capture: L + 1 graphs and the L attention calls between them."""

    pieces: list[Any]
    calls: list[AttentionCall]


class PiecewiseGraphs:
    """Captures and replays loop passes as graph pieces around eager attention (module docstring);
    owned by the runner's LoopPassGraphs, whose pool, stream and counters it shares."""

    def __init__(self, passes: LoopPassGraphs, max_tokens: int) -> None:
        runner = passes.runner
        self.passes = passes
        self.model = runner.model
        self.buckets = piece_buckets(max_tokens)
        top, hidden = self.buckets[-1], runner.state.shape[1]
        self._state = torch.zeros(top, hidden, dtype=runner.state.dtype, device=runner.device)
        self._embedded = torch.zeros_like(self._state)
        self._out = torch.zeros_like(self._state)
        self._positions = torch.zeros(top, dtype=torch.long, device=runner.device)
        # Allocated at the first call, outside the pool: the attention output [top, Hq, Dh] and the
        # call's inputs (q|k|v, or q, k, v), into which each piece copies the tensors its cut hands over.
        self._attention: torch.Tensor | None = None
        self._inputs: tuple[torch.Tensor, ...] | None = None
        self._passes: dict[int, PiecewisePass] = {}

    def capture_all(self) -> int:
        """Capture every bucket not captured yet, largest first; the number captured."""
        return sum(self._capture(tokens) is not None for tokens in reversed(self.buckets)
                   if tokens not in self._passes)

    def loop(self, state: torch.Tensor, embedded: torch.Tensor, positions: torch.Tensor,
             context: AttentionContext) -> torch.Tensor | None:
        """model.loop over these rows from a bucket's pieces (a new tensor, like model.loop's); None
        (nothing run) when no bucket holds them or capturing failed."""
        stats, n = self.passes.stats, len(state)
        tokens = next((b for b in self.buckets if b >= n), None)
        lazy = tokens is not None and tokens not in self._passes
        captured = None if tokens is None else self._capture(tokens)
        if captured is None:
            stats.piece_eager += 1
            return None
        stats.lazy_captures += lazy
        self._state[:n] = state
        self._embedded[:n] = embedded
        self._positions[:n] = positions
        if self.passes.emulate:
            self._run(tokens, lambda call: self._staged(call).run(context, n, self._attention_out(call)))
        else:
            for piece, call in zip(captured.pieces, [*captured.calls, None], strict=True):
                piece.replay()
                if call is not None:
                    call.run(context, n, self._attention_out(call))
        stats.piece_replays += 1
        stats.piece_rows += n
        stats.piece_padded_rows += tokens - n
        return self._out[:n].clone()

    def _attention_out(self, call: AttentionCall) -> torch.Tensor:
        """The static attention output, viewed as the call's [T, Hq, Dh]."""
        shape = call.output_shape
        if self._attention is None:
            self._attention = torch.zeros(len(self._state), *shape[1:], dtype=call.tensors[0].dtype,
                                          device=self._state.device)
        return self._attention[: shape[0]]

    def _staged(self, call: AttentionCall) -> AttentionCall:
        """The call over the static inputs, its tensors copied there. A piece that ended at the call
        would otherwise hand attention tensors of the pool, which only a reference held for the
        worker's life would keep from other captures: 24 of them per bucket."""
        if self._inputs is None:
            self._inputs = tuple(torch.zeros(len(self._state), *t.shape[1:], dtype=t.dtype, device=t.device)
                                 for t in call.tensors)
        return call.into(self._inputs)

    def _run(self, tokens: int, on_call: Callable[[AttentionCall], torch.Tensor]) -> None:
        """The bucket's function: the loop over its static rows, its result into the static output."""
        out = self.model.loop(self._state[:tokens], self._embedded[:tokens], self._positions[:tokens],
                              CutContext(on_call))
        self._out[:tokens].copy_(out)

    def _capture(self, tokens: int) -> PiecewisePass | None:
        """The bucket's pieces, captured now if they are not yet; None when capturing failed (now or before)."""
        passes, stats = self.passes, self.passes.stats
        if tokens not in self._passes and stats.piece_error is None and stats.error is None:
            try:
                captured = PiecewisePass([], [])

                def cut(call: AttentionCall) -> torch.Tensor:
                    captured.calls.append(self._staged(call))  # the copy ends this piece
                    passes.next_piece()
                    return self._attention_out(call)

                def warm_up(call: AttentionCall) -> torch.Tensor:  # allocates the static buffers
                    self._staged(call)
                    return self._attention_out(call)

                captured.pieces = passes.capture_pieces(lambda: self._run(tokens, warm_up),
                                                        lambda: self._run(tokens, cut))
                self._passes[tokens] = captured
            except Exception as exc:  # keep serving: these passes run eagerly from now on
                log.exception("CUDA graph capture of a %d-token loop pass in pieces failed; mixed passes "
                              "run eagerly", tokens)
                stats.piece_error = f"{type(exc).__name__}: {exc}"
        return self._passes.get(tokens)
