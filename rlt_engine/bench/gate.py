"""The throughput benchmark's correctness gate: before an engine is timed, its first requests
must equal the torch path's (SPEC §7a).

The torch path (torch attention, no CUDA graphs, one loop per plan, in this process) generates
the gate requests once per exit mode. Each engine under test then generates the same requests.
A request passes when its exit depths are the reference's and its tokens are too, up to the
first divergence whose decision margin is within the dtype's tolerance: the engine's own
logprob gap between its token and the reference's, measured by teacher forcing the reference's
tokens (`forced_tokens`). Such a near-tie may flip with rounding; what follows it is not
compared.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from protocol.messages import SamplingParams

GATE_REQUESTS = 8
# Largest logprob gap (nats) a rounding difference may flip, per dtype.
TOLERANCE_NATS = {"float64": 1e-9, "float32": 1e-4, "float16": 5e-2, "bfloat16": 5e-2}


@dataclass(frozen=True)
class GateJob:
    prompt: list[int]
    params: SamplingParams


@dataclass
class GateResult:
    requests: int
    equal: int = 0
    near_ties: list[dict[str, float]] = field(default_factory=list)  # {"request", "index", "margin"}
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        text = f"{self.equal}/{self.requests} equal to the torch path"
        if self.near_ties:
            ties = ", ".join(f"request {t['request']} at token {t['index']} (gap {t['margin']:.2g})"
                             for t in self.near_ties)
            text += f"; near-ties within tolerance: {ties}"
        if self.failures:
            text += "; FAILED: " + "; ".join(self.failures)
        return text


def reference_run(
    model: str, engine_options: dict[str, Any], make: Callable[[int, int], list[GateJob]]
) -> tuple[list[GateJob], list[Any]]:
    """The gate's jobs (`make(vocab, depth)`, built once the model is known) and the torch path's outputs."""
    from rlt_engine.llm import LLM

    options = {**engine_options, "workers": 0, "attention_backend": "torch", "cuda_graphs": False,
               "loops_per_plan": 1}
    with LLM(model, **options) as llm:
        jobs = make(llm.engine.model_info.vocab_size, llm.engine.max_depth)
        return jobs, _generate(llm, jobs)


def check(
    llm: Any, jobs: Sequence[GateJob], reference: Sequence[Any], dtype: str, tolerance: float | None = None
) -> GateResult:
    """Run the jobs on `llm` and compare them with the reference outputs (tolerance: the dtype's by default)."""
    result = GateResult(requests=len(jobs))
    tolerance = TOLERANCE_NATS[dtype] if tolerance is None else tolerance
    for i, (job, got, want) in enumerate(zip(jobs, _generate(llm, jobs), reference, strict=True)):
        index = first_difference(got.token_ids, want.token_ids)
        if index is None:
            if got.exit_depths == want.exit_depths:
                result.equal += 1
            else:
                result.failures.append(f"request {i}: exit depths {got.exit_depths} vs {want.exit_depths}")
            continue
        if index >= min(len(got.token_ids), len(want.token_ids)):
            result.failures.append(f"request {i}: {len(got.token_ids)} tokens, the torch path {len(want.token_ids)}")
            continue
        if got.exit_depths[:index + 1] != want.exit_depths[:index + 1]:
            result.failures.append(f"request {i}: exit depths differ before token {index}")
            continue
        depths = job.params.exit_depths
        forced = msgspec.structs.replace(job.params, max_tokens=index + 1, forced_tokens=want.token_ids[: index + 1],
                                         exit_depths=None if depths is None else depths[: index + 1])
        (scored,) = _generate(llm, [GateJob(job.prompt, forced)])
        margin = got.logprobs[index] - scored.logprobs[index]
        if margin <= tolerance:
            result.near_ties.append({"request": i, "index": index, "margin": margin})
        else:
            result.failures.append(
                f"request {i}: token {index} is {got.token_ids[index]}, the torch path's {want.token_ids[index]}, "
                f"with a logprob gap of {margin:.3g} nats (tolerance {tolerance:g} for {dtype})"
            )
    return result


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where the sequences differ (a length difference counts), or None."""
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


def _generate(llm: Any, jobs: Sequence[GateJob]) -> list[Any]:
    params = [msgspec.structs.replace(j.params, logprobs=1) for j in jobs]
    return llm.generate([j.prompt for j in jobs], params, use_tqdm=False)
