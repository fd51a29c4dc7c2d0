"""Collects one worker's step (slot ops and stage rows) and packs it into an ExecutionPlan.

Batches are emitted in a fixed order, so a request can flow through several stages in one
step without the engine seeing any device value in between:

    PREFILL → FINALIZE → CODA → PRELUDE → RECURRENT → DECODE
    (a position that exited: finalize, sample output k, embed it at the next position,
     run that position's loop 1 — the sampled token never leaves the worker; a DECODE row
     does all of this in the worker, as often as its exits and the plan's passes allow)

With mixed batches (`ride_prefill`) the PREFILL batch is only set up first: its loops ride the
RECURRENT and DECODE passes, as extra rows of each (rlt_worker/prefill_rows.py).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from protocol.columns import I32, I64, pack
from protocol.messages import (
    Admit,
    BlockAppends,
    CodaBatch,
    DecodeBatch,
    ExecutionPlan,
    ExitTest,
    FinalizeBatch,
    PrefillBatch,
    PreludeBatch,
    RecurrentBatch,
    SamplingOptions,
    SlotKeys,
    StageBatch,
)
from rlt_engine.kv_manager import KVAllocation
from rlt_engine.request import Request


@dataclass(frozen=True)
class SlotOps:
    """A plan's slot ops as (key, generation) pairs, in the order the worker applies each kind."""

    admits: list[tuple[int, int]]
    imports: list[tuple[int, int]]
    exports: list[tuple[int, int]]
    releases: list[tuple[int, int]]
    swap_drops: list[int]


@dataclass(frozen=True)
class DecodeSettings:
    """What every DecodeBatch of an engine carries: the policy's exit test, the most loop passes one
    plan runs, and whether an exited row's next token joins the next pass (refill)."""

    exit_test: ExitTest
    max_passes: int
    refill: bool


class PlanBuilder:
    """Rows of one plan, appended by the scheduler in any order, packed in stage order.

    It only emits: it reads requests (key, generation, params) and never changes one; the
    scheduler marks the requests it named (`named`) as used by this step."""

    def __init__(self, step_id: int, seed_of: Callable[[int], int], decode: DecodeSettings | None = None) -> None:
        self.step_id = step_id
        self._seed_of = seed_of  # request key → its seed (the RngRegistry's)
        self._decode = decode  # None: the engine's policy plans every exit (no DecodeBatch)
        self.named: set[int] = set()  # keys of the requests this plan names (rows or slot ops)
        self._admits: list[Admit] = []
        self._appends: list[tuple[int, int, list[list[int]]]] = []
        self._releases: list[tuple[int, int]] = []
        self._exports: list[tuple[int, int]] = []
        self._imports: list[tuple[int, int]] = []
        self._swap_drops: list[tuple[int, int]] = []
        self._rows: dict[type, dict[str, list]] = defaultdict(lambda: defaultdict(list))
        self._prefill_rides = False  # the prompt chunks ride the loop passes (mixed batches)

    @property
    def is_empty(self) -> bool:
        return not (
            self._admits or self._appends or self._releases or self._rows
            or self._exports or self._imports or self._swap_drops
        )

    @property
    def has_loop_rows(self) -> bool:
        """Whether the plan runs loop passes over slot rows (RECURRENT or DECODE rows)."""
        return RecurrentBatch in self._rows or DecodeBatch in self._rows

    def ride_prefill(self) -> None:
        """Mixed batches: the plan's prompt chunks (if it gets any) ride its loop passes."""
        self._prefill_rides = True

    def _row(self, kind: type, request: Request, **fields: object) -> None:
        self.named.add(request.key)
        rows = self._rows[kind]
        rows["keys"].append(request.key)
        rows["generations"].append(request.generation)
        for name, value in fields.items():
            rows[name].append(value)

    # ---------------------------------------------------------------- slot ops

    def admit(self, request: Request, allocation: KVAllocation) -> None:
        params = request.params
        forced = None if params.forced_tokens is None else tuple(params.forced_tokens)
        sampling = SamplingOptions(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                   forced_tokens=forced, max_tokens=params.max_tokens,
                                   stop_token_ids=tuple(sorted(request.stop_token_ids)))
        self._admits.append(Admit(request.key, request.generation, sampling))
        self.append_blocks(request, allocation.planes)

    def append_blocks(self, request: Request, planes: list[list[int]]) -> None:
        # A copy: the allocation's lists may grow again later in this step.
        self._appends.append((request.key, request.generation, [list(plane) for plane in planes]))
        self.named.add(request.key)  # its blocks are in use from this step on

    def release(self, key: int, generation: int) -> None:
        self._releases.append((key, generation))

    def export(self, key: int, generation: int) -> None:
        """Swap out: the slot's state and pages to host memory (handle = key), slot freed."""
        self._exports.append((key, generation))

    def import_(self, request: Request, allocation: KVAllocation) -> None:
        """Swap in: a new slot (the request's new generation) from its host copy, into new blocks."""
        self._imports.append((request.key, request.generation))
        self.append_blocks(request, allocation.planes)

    def drop_swapped(self, key: int) -> None:
        self._swap_drops.append((key, 0))

    # ---------------------------------------------------------------- stages

    def prefill(self, request: Request, start: int, token_ids: list[int]) -> None:
        rows = self._rows[PrefillBatch]
        rows["token_ids"].extend(token_ids)
        seed = self._seed_of(request.key)
        self._row(PrefillBatch, request, start_positions=start, query_lens=len(token_ids), seeds=seed)

    def prelude(self, request: Request, position: int, token_id: int = -1) -> None:
        self._row(PreludeBatch, request, positions=position, token_ids=token_id, seeds=self._seed_of(request.key))

    def recurrent(self, request: Request, position: int, first_depth: int, num_loops: int = 1) -> None:
        self._row(RecurrentBatch, request, positions=position, first_depths=first_depth, num_loops=num_loops)

    def finalize(self, request: Request, position: int, exit_depth: int) -> None:
        self._row(FinalizeBatch, request, positions=position, exit_depths=exit_depth)

    def coda(self, request: Request, position: int, output_index: int, exit_depth: int) -> None:
        """Sample output `output_index` at `position`, which ran `exit_depth` loops; −1 runs the coda for
        its K/V only."""
        self._row(
            CodaBatch, request, positions=position, seeds=self._seed_of(request.key), sample_indices=output_index,
            exit_depths=exit_depth,
        )

    def decode(self, request: Request, exited: bool, continues: bool = False, planned: list[int] | None = None) -> None:
        """The request's current position to the worker's decode loop, with `depth` loops run there
        (`exited`: it has exited after them, its boundary work first; `continues`: from where the
        slot's row in a plan still in flight stops, the other columns ignored; `planned`: under
        ExitTest.PLANNED, the exit depths of its outputs from its position's on)."""
        limits, position = request.limits, request.position
        planned = planned or []
        self._rows[DecodeBatch]["planned_depths"].extend(planned)
        self._row(
            DecodeBatch, request, positions=position, depths=request.depth, exited=int(exited),
            exit_states=request.exit_state, output_indices=position - (request.prompt_len - 1),
            seeds=self._seed_of(request.key), min_loops=limits.min_loops, max_loops=limits.max_loops,
            thresholds=limits.threshold, continues=int(continues), num_planned=len(planned),
        )

    @property
    def slot_ops(self) -> SlotOps:
        """What the plan asks of the slot table (kept by the scheduler until its result arrives)."""
        return SlotOps(
            admits=[(a.key, a.generation) for a in self._admits], imports=list(self._imports),
            exports=list(self._exports), releases=list(self._releases), swap_drops=[k for k, _ in self._swap_drops],
        )

    # ---------------------------------------------------------------- packing

    def build(self) -> ExecutionPlan:
        """The packed plan."""
        return ExecutionPlan(
            step_id=self.step_id,
            admits=self._admits,
            block_appends=self._pack_appends(),
            batches=self._pack_batches(),
            releases=_slot_keys(self._releases),
            exports=_slot_keys(self._exports),
            imports=_slot_keys(self._imports),
            swap_drops=_slot_keys(self._swap_drops),
        )

    def _pack_appends(self) -> BlockAppends:
        ids = [b for _, _, planes in self._appends for plane in planes for b in plane]
        return BlockAppends(
            keys=pack([k for k, _, _ in self._appends], I64),
            generations=pack([g for _, g, _ in self._appends], I64),
            num_new=pack([len(planes[0]) if planes else 0 for _, _, planes in self._appends], I32),
            block_ids=pack(ids, I32),
        )

    def _pack_batches(self) -> list[StageBatch]:
        batches: list[StageBatch] = []
        for kind in (PrefillBatch, FinalizeBatch, CodaBatch, PreludeBatch, RecurrentBatch, DecodeBatch):
            rows = self._rows.get(kind)
            if not rows:
                continue
            fields: dict[str, object] = {name: pack(values, kind.COLUMNS[name]) for name, values in rows.items()}
            if kind is PrefillBatch and self._prefill_rides:
                fields.update(rides_loop_passes=True)
            if kind is DecodeBatch:
                assert self._decode is not None, "decode rows under a policy that plans every exit"
                fields.update(exit_test=self._decode.exit_test, max_passes=self._decode.max_passes,
                              refill=self._decode.refill)
            batches.append(kind(**fields))
        return batches



def _slot_keys(pairs: list[tuple[int, int]]) -> SlotKeys:
    return SlotKeys(keys=pack([k for k, _ in pairs], I64), generations=pack([g for _, g in pairs], I64))
