"""Collects a plan's result rows and packs them into one columnar StepResult.

On CUDA the device values of a plan's rows leave the GPU without stalling it:

    compute stream  … plan N's batches ─ snapshot (one cat) ─ plan N+1's batches …
                                              │ event
    copy stream                               └─ copy to pinned host memory ─ event ─► PendingResult ready

The snapshot (one cat on the compute stream) is memory only the copy reads: nothing plan N+1 does
on the compute stream can race the copy, and the result is one transfer, not one per column.

Deferred rows (`defer`: a device-refill plan's, whose rows and counts are on the device too) are
copied on the compute stream by their owner (`HostCopies`) and turned into rows when the result is
built; the copy stream waits for the compute stream, so the result's event covers their copies too.

Early results (`send_early`): when a request ends at a pass before the plan's last (its last output
sampled, or a stop token read back), its rows so far are snapshotted and copied the same way at that
point of the compute stream, so they reach the engine while the plan's later passes run (a row that
ends in a 16-pass plan's fourth pass is not delivered 12 passes late); the plan's result leaves them
out. A device-refill plan's ended rows are known on the device only: `defer_early` builds them from
a copy when it lands. `finish` returns the early results and then the plan's, in the order they are
sent.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from protocol.columns import F64, I32, I64, pack
from protocol.messages import Stage, StepResult


class PendingResult:
    """A plan's StepResult whose device values may still be on their way to the host."""

    def __init__(self, build: Callable[[], StepResult | None], copied: torch.cuda.Event | None = None) -> None:
        self._build = build
        self._copied = copied  # None: nothing left on the device

    @classmethod
    def done(cls, result: StepResult) -> PendingResult:
        return cls(lambda: result)

    def is_ready(self) -> bool:
        """Whether `result()` returns without waiting for the device."""
        return self._copied is None or self._copied.query()

    def result(self) -> StepResult | None:
        """The StepResult (waits for its copy if it has not landed); None: an early result that found
        nothing to carry (its ended rows went out in an earlier one), so there is nothing to send."""
        if self._copied is not None:
            self._copied.synchronize()
        return self._build()


class HostCopies:
    """Device values on their way into pinned host memory (CUDA: non-blocking copies and an event;
    the CPU: copied already)."""

    def __init__(self, hosts: list[torch.Tensor], event: torch.cuda.Event | None) -> None:
        self.hosts, self.event = hosts, event

    def wait(self) -> list[np.ndarray]:
        if self.event is not None:
            self.event.synchronize()
        return [host.numpy() for host in self.hosts]


class ResultBuilder:
    """Rows in plan order; device values are read back once, when the plan's rows are all in, except
    the rows of requests that ended mid-plan, which go ahead in an early result (`send_early`)."""

    def __init__(self, step_id: int, copy_stream: torch.cuda.Stream | None = None) -> None:
        self.step_id = step_id
        self._copy_stream = copy_stream  # None: the CPU, results are built at once
        self._parts: list[dict[str, object]] = []
        self._landings: list[torch.cuda.Event] = []  # the events of deferred rows' copies (CUDA)
        self._early: list[PendingResult] = []
        self._sent_keys: set[int] = set()  # requests whose rows an early result carries
        self._only_keys: set[int] | None = None  # an early result's builder: the requests it carries

    def defer(self, rows: Callable[[], list[dict[str, object]]], copied: torch.cuda.Event | None) -> None:
        """Rows known once device values land (`copied`): `rows()`, called when the result is built,
        returns their parts (host values only), which take this place in the plan's order."""
        self._parts.append({"deferred": rows})
        if copied is not None:
            self._landings.append(copied)

    def add(
        self,
        stage: Stage,
        keys: np.ndarray,
        generations: np.ndarray,
        *,
        depths: np.ndarray | None = None,
        exit_states: torch.Tensor | None = None,
        tokens: np.ndarray | torch.Tensor | None = None,
        logprobs: torch.Tensor | None = None,
    ) -> None:
        """Append one batch's rows (absent fields: depth 0, NaN exit state, token −1, NaN logprob)."""
        self._parts.append(
            {"stage": stage, "keys": keys, "generations": generations, "depths": depths,
             "exit_states": exit_states, "tokens": tokens, "logprobs": logprobs}
        )

    def send_early(self, keys: np.ndarray) -> None:
        """Every row added so far of these requests (which ended: nothing follows them in this plan)
        goes out in an early result, whose copy is queued behind the work queued so far, so it lands
        when that work has run, before the plan's end; the plan's result leaves those rows out. Only
        host rows: a deferred part's requests end where its plan lands."""
        new = set(keys.tolist()) - self._sent_keys
        if not new:
            return
        early = self._early_builder(new)
        early._only_keys = new
        self._sent_keys |= new
        if early._parts:  # a row that continued an ended request's slot has no rows at all
            self._early.append(early._pending(num_free_slots=0, early=True))

    def defer_early(self, rows: Callable[[], list[dict[str, object]]], copied: torch.cuda.Event | None) -> None:
        """An early result of rows known once `copied` lands (a device-refill plan's ended rows):
        `rows()`, called when it is built, returns their parts (host values); the result carries
        those and the host rows added so far of the same requests (a boundary before the passes),
        which it snapshots now, and their requests leave the plan's result from then on. Results are
        built in the order they are sent, so the plan's own is built after; one whose ended rows an
        earlier one carried builds None (nothing to send)."""
        early = self._early_builder()

        def ended_rows() -> list[dict[str, object]]:
            parts = rows()
            early._only_keys = {key for part in parts for key in np.asarray(part["keys"]).tolist()}
            self._sent_keys |= early._only_keys
            return parts

        early.defer(ended_rows, copied)
        self._early.append(early._pending(num_free_slots=0, early=True))

    def _early_builder(self, keys: set[int] | None = None) -> ResultBuilder:
        """A builder over copies of the host parts so far (those holding any of `keys`; None: all):
        building a result puts host values into its parts, and this plan's own result snapshots
        them again later (their other requests' rows)."""
        early = ResultBuilder(self.step_id, self._copy_stream)
        wanted = None if keys is None else list(keys)
        early._parts = [dict(part) for part in self._parts
                        if "deferred" not in part and (wanted is None or np.isin(part["keys"], wanted).any())]
        return early

    def finish(self, num_free_slots: int) -> list[PendingResult]:
        """Every row is in: the plan's results in order, the early ones and then its own, whose copy
        starts now (on the copy stream, behind the compute stream's work so far; the CPU: built now)."""
        return [*self._early, self._pending(num_free_slots)]

    def _pending(self, num_free_slots: int, early: bool = False) -> PendingResult:
        copy_stream = self._copy_stream
        device_fields = [(part, name) for part in self._parts if "deferred" not in part for name in _DEVICE_FIELDS
                         if isinstance(part[name], torch.Tensor)]
        if copy_stream is None or not (device_fields or self._landings):
            return PendingResult.done(self._sendable(num_free_slots, early))
        if not device_fields:  # only deferred rows: their copies' last event is the result's
            return PendingResult(lambda: self._sendable(num_free_slots, early), self._landings[-1])
        values = [part[name].reshape(-1) for part, name in device_fields]
        # One float64 buffer holds them all exactly (token ids, float32 or float64 values).
        snapshot = torch.cat([v.to(torch.float64) for v in values])
        host = torch.empty(snapshot.shape, dtype=torch.float64, pin_memory=True)
        copy_stream.wait_stream(torch.cuda.current_stream(snapshot.device))
        with torch.cuda.stream(copy_stream):
            host.copy_(snapshot, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(copy_stream)
        snapshot.record_stream(copy_stream)  # not reused by the compute stream before the copy ends
        sizes = [v.numel() for v in values]

        def build() -> StepResult:
            for (part, name), chunk in zip(device_fields, np.split(host.numpy(), np.cumsum(sizes)[:-1]), strict=True):
                part[name] = chunk
            return self._sendable(num_free_slots, early)

        return PendingResult(build, copied)

    def _sendable(self, num_free_slots: int, early: bool) -> StepResult | None:
        """build(), or None for an early result with no row."""
        result = self.build(num_free_slots, early)
        return None if early and not result.num_rows else result

    def build(self, num_free_slots: int, early: bool = False) -> StepResult:
        """The packed StepResult of every row added so far (less those sent early; an early result's
        builder: only its requests' rows)."""
        columns: dict[str, list[np.ndarray]] = {name: [] for name in ("k", "g", "s", "d", "x", "t", "lp")}
        for part in self._expanded():
            keys = np.asarray(part["keys"])
            n = len(keys)
            kept = self._kept(keys)
            columns["k"].append(keys[kept])
            columns["g"].append(np.asarray(part["generations"])[kept])
            columns["s"].append(np.full(n, int(part["stage"]))[kept])
            columns["d"].append(_host(part["depths"], n, 0)[kept])
            columns["x"].append(_host(part["exit_states"], n, math.nan)[kept])
            columns["t"].append(_host(part["tokens"], n, -1)[kept])
            columns["lp"].append(_host(part["logprobs"], n, math.nan)[kept])

        def joined(name: str, dtype: str) -> bytes:
            return pack(np.concatenate(columns[name]) if columns[name] else [], dtype)

        return StepResult(
            step_id=self.step_id,
            keys=joined("k", I64), generations=joined("g", I64), stages=joined("s", I32),
            depths=joined("d", I32), exit_states=joined("x", F64), tokens=joined("t", I32),
            logprobs=joined("lp", F64), num_free_slots=num_free_slots, early=early,
        )

    def _kept(self, keys: np.ndarray) -> np.ndarray:
        """bool [rows]: the rows this builder's result carries."""
        if self._only_keys is not None:
            return np.isin(keys, list(self._only_keys))
        if self._sent_keys:
            return ~np.isin(keys, list(self._sent_keys))
        return np.ones(len(keys), dtype=bool)

    def parts(self) -> list[dict[str, object]]:
        """The rows added so far (what a deferred `rows()` returns of a builder it filled)."""
        return self._parts

    def _expanded(self) -> list[dict[str, object]]:
        parts: list[dict[str, object]] = []
        for part in self._parts:
            parts.extend(part["deferred"]() if "deferred" in part else [part])
        return parts


_DEVICE_FIELDS = ("exit_states", "tokens", "logprobs")  # the fields a batch may leave on the device


def _host(values: np.ndarray | torch.Tensor | None, n: int, fill: float) -> np.ndarray:
    if values is None:
        return np.full(n, fill)
    if isinstance(values, torch.Tensor):
        return values.detach().cpu().numpy()
    return np.asarray(values)
