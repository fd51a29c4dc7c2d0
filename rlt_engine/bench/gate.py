"""The throughput benchmark's correctness gate: before an engine is timed, its outputs must equal
the torch path's in float32 (SPEC §7a), so the gate catches bugs and not rounding.

    reference   the torch path (torch attention, no CUDA graphs, one loop per plan, in this
                process) runs the gate requests once per exit mode, in the gate dtype (float32)
    check       an engine of the configuration under test, built in the gate dtype, runs the same
                requests: exit depths must be the reference's, and tokens too, up to the first
                decision whose margin is below the dtype's tolerance (1e-4 nats in float32; such a
                near-tie may flip with rounding, and what follows it is not compared); a decision's
                margin is the reference's own gap between its top two logits (SPEC §7a), so it does
                not depend on the engine under test. At real shapes float32 rounding alone moves a
                logprob by more than 1e-4: where the engine's own two runs (see below) order the two
                tokens the other way, their disagreement is measured rounding, and a flip whose
                reference margin is within it is a near-tie too
    divergence  the timed engine (bf16) runs them as well; where it parts from the reference is
                reported, never failed: the output index and the gap there, in nats and in units
                in the last place (ulps) of the bf16 logit, since in bf16 the paths part at
                decisions one to a few ulps apart

Where the tokens part, the engine's own logprob gap between its token and the reference's is
reported too, measured by teacher forcing the reference's tokens (`forced_tokens`). It comes from
two runs of the engine with different batches, so rounding can make it negative. A negative gap
is the engine disagreeing with itself by that much about the two tokens; a positive one never
excuses a flip.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from protocol.messages import SamplingParams

GATE_REQUESTS = 8
GATE_DTYPE = "float32"
# Largest logprob gap (nats) a rounding difference may flip (SPEC §7a: 1e-4 below float64).
TOLERANCE_NATS = {"float64": 1e-9, "float32": 1e-4}
# Explicit mantissa bits: one ulp of x is 2^(floor(log2 |x|) − bits).
MANTISSA_BITS = {"bfloat16": 7, "float16": 10, "float32": 23, "float64": 52}


@dataclass(frozen=True)
class GateJob:
    prompt: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class Reference:
    """The torch path's outputs of the gate jobs and, for each of its CODA rows, the largest logit and
    the gap from it to the second largest (the decision's margin)."""

    jobs: list[GateJob]
    outputs: list[Any]
    top_logits: list[list[float]]  # [request][output index]
    top_gaps: list[list[float]]  # [request][output index]


@dataclass
class GateResult:
    requests: int
    dtype: str = GATE_DTYPE
    equal: int = 0
    # {"request", "index", "margin" (the reference's top-two gap), "engine_gap"}
    near_ties: list[dict[str, float]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        text = f"{self.dtype}: {self.equal}/{self.requests} equal to the torch path"
        if self.near_ties:
            ties = ", ".join(f"request {t['request']} at token {t['index']} (top-two gap {t['margin']:.2g}, "
                             f"engine's gap {t['engine_gap']:.2g})"
                             for t in self.near_ties)
            text += f"; near-ties within tolerance: {ties}"
        if self.failures:
            text += "; FAILED: " + "; ".join(self.failures)
        return text


@dataclass
class Divergence:
    """Where an engine of another dtype parts from the float32 reference (reported, not judged)."""

    requests: int
    dtype: str
    equal: int = 0
    # {"request", "index", "gap_nats", "gap_ulps", "top_logit"}, or {"request", "index", "exit_depths"}
    first: list[dict[str, Any]] = field(default_factory=list)

    def summary(self) -> str:
        text = f"{self.dtype}: {self.equal}/{self.requests} equal to the float32 torch path"
        parts = []
        for d in self.first:
            if "gap_ulps" in d:
                parts.append(f"request {d['request']} at token {d['index']} ({d['gap_nats']:.3g} nats = "
                             f"{d['gap_ulps']:.2g} ulps at |logit| {abs(d['top_logit']):.3g})")
            else:
                parts.append(f"request {d['request']} at token {d['index']} ({d['reason']})")
        return text + ("; first divergences: " + ", ".join(parts) if parts else "")


def torch_path_options(engine_options: dict[str, Any], dtype: str = GATE_DTYPE) -> dict[str, Any]:
    """The reference configuration: `engine_options` on the torch path, in-process, in `dtype`."""
    return {**engine_options, "dtype": dtype, "workers": 0, "attention_backend": "torch", "cuda_graphs": False,
            "loops_per_plan": 1}


def reference_run(
    model: str, engine_options: dict[str, Any], make: Callable[[int, int], list[GateJob]], dtype: str = GATE_DTYPE
) -> Reference:
    """The gate's jobs (`make(vocab, depth)`, built once the model is known) run on the torch path."""
    from rlt_engine.llm import LLM

    with LLM(model, **torch_path_options(engine_options, dtype)) as llm:
        jobs = make(llm.engine.model_info.vocab_size, llm.engine.max_depth)
        recorded = record_coda_logits(llm, _top_two)
        outputs = _generate(llm, jobs)
    keys = sorted({key for key, _ in recorded})  # request keys count up in submission order
    rows = [[recorded[(key, i)] for i in range(len(out.token_ids))] for key, out in zip(keys, outputs, strict=True)]
    return Reference(jobs, outputs, [[top for top, _ in r] for r in rows], [[gap for _, gap in r] for r in rows])


def _top_two(row: Any) -> tuple[float, float]:
    """(largest logit, its gap to the second largest) of one logits row."""
    first, second = row.double().topk(2).values.tolist()
    return first, first - second


def record_coda_logits(llm: Any, keep: Callable[[Any], Any]) -> dict[tuple[int, int], Any]:
    """`keep(logits row)` of every sampled CODA row, by (request key, output index).

    In-process engines only (workers=0): it wraps the runner's sampling stage (CodaBatch rows and
    the decode loop's exits alike) and the model's LM head, and keeps the head's logits while a
    sampling call runs (a `kl` exit test calls the head as well).
    """
    recorded: dict[tuple[int, int], Any] = {}
    sampled_rows: list[tuple[list[int], list[int]]] = []  # the running call's rows

    runner = llm.engine.executor._worker.runner
    if runner._graphs is not None:  # a CODA graph calls lm_head only while it is captured: run CODA eagerly
        runner._graphs.coda = None
    real_sample, model = runner.sample_rows, runner.model
    real_head = model.lm_head

    def sample_rows(row_slots: Any, positions: Any, seeds: Any, indices: Any) -> Any:
        keys = [runner.identity(slot)[0] for slot in row_slots.tolist()]
        sampled_rows.append((keys, indices.tolist()))
        try:
            return real_sample(row_slots, positions, seeds, indices)
        finally:
            sampled_rows.clear()

    def head(hidden: Any) -> Any:
        logits = real_head(hidden)
        if sampled_rows:  # the runner calls the head once per sampling call, for its rows
            keys, indices = sampled_rows.pop()
            for row, (key, index) in enumerate(zip(keys, indices, strict=True)):
                recorded[(key, index)] = keep(logits[row])
        return logits

    runner.sample_rows = sample_rows  # an instance attribute shadows the method
    object.__setattr__(model, "lm_head", head)
    return recorded


def check(llm: Any, reference: Reference, dtype: str = GATE_DTYPE, tolerance: float | None = None) -> GateResult:
    """Run the jobs on `llm` (built in `dtype`) and judge its outputs against the reference."""
    result = GateResult(requests=len(reference.jobs), dtype=dtype)
    tolerance = TOLERANCE_NATS[dtype] if tolerance is None else tolerance
    for i, got, want, parted in _compare(llm, reference):
        if parted is None:
            result.equal += 1
        elif isinstance(parted, str):
            result.failures.append(f"request {i}: {parted}")
        else:
            index, engine_gap = parted
            margin = reference.top_gaps[i][index]
            if is_near_tie(margin, engine_gap, tolerance):
                result.near_ties.append({"request": i, "index": index, "margin": margin, "engine_gap": engine_gap})
            else:
                result.failures.append(
                    f"request {i}: token {index} is {got.token_ids[index]}, the torch path's {want.token_ids[index]}, "
                    f"whose top-two logit gap is {margin:.3g} nats (tolerance {tolerance:g} for {dtype}); "
                    f"the engine's logprob gap {engine_gap:.3g}")
    return result


def divergence(llm: Any, reference: Reference, dtype: str) -> Divergence:
    """Run the jobs on `llm` (built in `dtype`) and report where each request first parts from the reference."""
    report = Divergence(requests=len(reference.jobs), dtype=dtype)
    for i, got, want, parted in _compare(llm, reference):
        if parted is None:
            report.equal += 1
        elif isinstance(parted, str):
            index = first_difference(got.exit_depths, want.exit_depths)
            report.first.append({"request": i, "index": index, "reason": parted})
        else:
            index, gap = parted
            top = reference.top_logits[i][index]
            report.first.append({"request": i, "index": index, "gap_nats": gap, "top_logit": top,
                                 "gap_ulps": gap / ulp(top, dtype)})
    return report


def is_near_tie(margin: float, engine_gap: float, tolerance: float) -> bool:
    """Whether a flipped decision is rounding: its reference margin is within the dtype's tolerance or
    within the engine's measured disagreement with itself (a negative two-run gap)."""
    return margin <= max(tolerance, -engine_gap)


def _compare(llm: Any, reference: Reference) -> Iterator[tuple[int, Any, Any, tuple[int, float] | str | None]]:
    """(request, its output on `llm`, the reference's, where they part) for every gate job."""
    outputs = _generate(llm, reference.jobs)
    for i, (job, got, want) in enumerate(zip(reference.jobs, outputs, reference.outputs, strict=True)):
        yield i, got, want, _first_divergence(llm, job, got, want)


def ulp(x: float, dtype: str) -> float:
    """One unit in the last place of `dtype` at |x|."""
    return 2.0 ** (math.floor(math.log2(max(abs(x), 2.0**-126))) - MANTISSA_BITS[dtype])


def _first_divergence(llm: Any, job: GateJob, got: Any, want: Any) -> tuple[int, float] | str | None:
    """None if `got` equals `want`; else (first differing token, its margin), or why it cannot be judged."""
    index = first_difference(got.token_ids, want.token_ids)
    if index is None:
        return None if got.exit_depths == want.exit_depths else (
            f"exit depths {got.exit_depths} vs {want.exit_depths}")
    if index >= min(len(got.token_ids), len(want.token_ids)):
        return f"{len(got.token_ids)} tokens, the torch path {len(want.token_ids)}"
    if got.exit_depths[: index + 1] != want.exit_depths[: index + 1]:
        return f"exit depths differ before token {index}"
    depths = job.params.exit_depths
    forced = msgspec.structs.replace(job.params, max_tokens=index + 1, forced_tokens=want.token_ids[: index + 1],
                                     exit_depths=None if depths is None else depths[: index + 1])
    (scored,) = _generate(llm, [GateJob(job.prompt, forced)])
    return index, got.logprobs[index] - scored.logprobs[index]


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where the sequences differ (a length difference counts), or None."""
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


def _generate(llm: Any, jobs: Sequence[GateJob]) -> list[Any]:
    params = [msgspec.structs.replace(j.params, logprobs=1) for j in jobs]
    return llm.generate([j.prompt for j in jobs], params, use_tqdm=False)
