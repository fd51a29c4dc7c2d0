"""A request's life inside the engine (SPEC §3). Only the scheduler writes these fields (its seed
is the RngRegistry's, its text the OutputProcessor's).

Positions of a request with a prompt of P tokens that has delivered k outputs:

    prompt  0 … P−1          every position runs D loops; CODA at P−1 gives output 0
    gen     P−1+i (i ≥ 1)    holds output i−1 as its input token; its CODA gives output i
                             after exit_depths[i] loops
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from protocol.messages import SamplingParams
from rlt_engine.kv_manager import KVAllocation


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Phase(enum.Enum):
    """What the next work of a running request is."""

    PREFILL = "prefill"  # prompt chunks remain
    BOUNDARY = "boundary"  # the current position's state is final: [finalize] → CODA next
    LOOP = "loop"  # the current position is looping: `depth` loops scheduled (or, when the worker
    # decides its exit, run) so far; a worker-decided position may be at depth 0 (embedded only)
    LAST_CODA = "last_coda"  # the final CODA is in flight; nothing follows it

    # A replayed request (after preemption or a worker crash) walks the same phases: its
    # prompt, then every position holding a delivered output at that output's recorded exit
    # depth, with the delivered token as input and nothing sampled (SPEC §7 depth-faithful replay).


@dataclass(frozen=True)
class LoopLimits:
    """A request's depth limits, resolved against the engine's D and exit mode."""

    min_loops: int
    max_loops: int
    threshold: float
    trace: tuple[int, ...] | None


@dataclass(eq=False)
class Request:
    """Engine-side state of one request life."""

    request_id: str
    key: int
    prompt_token_ids: list[int]
    params: SamplingParams
    limits: LoopLimits
    arrival: int  # admission order among all requests (FCFS)
    status: RequestStatus = RequestStatus.WAITING
    phase: Phase = Phase.PREFILL
    generation: int = 0  # the current slot incarnation; 0 = none yet
    worker: int = -1
    allocation: KVAllocation | None = None
    num_prefilled: int = 0
    position: int = 0  # the generated position being computed (P−1 once the prompt is done)
    depth: int = 0  # loops scheduled at the current position
    exit_depth: int | None = None  # known or decided exit depth of the current position
    exit_state: float = 1.0  # the worker's exit test state at the current position (Ouro: ∏ (1 − λ))
    stop_token_ids: frozenset[int] = frozenset()  # tokens that end it: its stop_token_ids, EOS unless ignore_eos
    last_step_id: int = -1  # the last step whose plan named this request
    decode_step_id: int = -1  # the last step whose plan carried a DecodeBatch row of this life
    block_hashes: tuple[bytes, ...] = ()  # prefix-cache keys of its prompt's shareable blocks
    num_cached_tokens: int = -1  # prompt tokens its first admission found in the prefix cache (−1: not admitted)
    num_workers_lost: int = 0  # workers that died while holding this request
    num_bypasses: int = 0  # later arrivals admitted before it (priority scheduling)
    output_token_ids: list[int] = field(default_factory=list)
    exit_depths: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_outputs(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_positions(self) -> int:
        """Positions the request can ever occupy: the prompt plus every fed-back output."""
        return self.prompt_len + self.params.max_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
