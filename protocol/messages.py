"""Every message that crosses a process boundary (SPEC §6). No torch here.

Fields are append-only with defaults (schema evolution); per-row fields of hot-path messages
are packed columns (see columns.py), documented as `column: dtype [rows]`.
"""

from __future__ import annotations

import enum
import math
from typing import ClassVar

import msgspec

from protocol.columns import F64, I32, I64, U64, Columnar

# Bumped whenever a frame's layout changes, so mixed installs fail at the handshake, by name.
# 2: CodaBatch.forced_tokens and SamplingParams.forced_tokens (teacher forcing).
# 3: StepResult.applied (the slot ops a failed plan applied), WorkerHealth.responsive.
# 4: forced tokens travel with the admit (SamplingOptions.forced_tokens, no CodaBatch.forced_tokens);
#    CodaBatch.exit_depths, echoed by the result's CODA rows. Exits decided in the worker: DecodeBatch
#    (ExitTest, max_passes, refill), SamplingOptions.max_tokens / stop_token_ids, Stage.DECODE / EXITED,
#    StepResult.exit_states; RecurrentBatch.signal, StepResult.signals and Signal are gone.
# 5: prefix caching: RequestOutput.num_cached_tokens, WorkerHealth.kv_blocks_cached, HealthReport's
#    prefix_cache_queries and prefix_cache_hits.
# 6: pipelined plans: DecodeBatch.continues (a row picks up where its slot's last DecodeBatch row
#    stopped); RecurrentBatch rows are no longer reported (the engine planned them).
# 7: WorkerConfig.cuda_graph_prefill and max_num_batched_tokens (PREFILL chunk passes from CUDA graphs).
# 8: mixed batches: PrefillBatch.rides_loop_passes (the chunks' loops ride the plan's loop passes).
# 9: planned exits in the decode loop: ExitTest.PLANNED, DecodeBatch.num_planned / planned_depths (the
#    engine's exit depths of a row's next positions; the worker refills fixed/trace rows in the plan);
#    WorkerConfig.exit_tests (the DecodeBatch exit tests whose CUDA graphs the worker captures at start-up).
# 10: WorkerConfig.launch_pdl (the decode pass's Triton kernels with programmatic dependent launch).
# 11: WorkerConfig.device_refill (gate exits' passes with no readback between them).
# 12: WorkerReady.prefill_token_buckets (the engine sizes a step's prompt tokens to a captured bucket).
# 13: WorkerConfig.mixed_graphs (mixed batches' passes from CUDA graphs).
# 14: WorkerConfig.fused_rotary_attention (a decode batch's RoPE, K/V write and attention in one launch).
# 15: StepResult.early (the rows of requests that ended mid-plan, sent before the plan's last pass).
PROTOCOL_VERSION = 15


class Stage(enum.IntEnum):
    """The stages of SPEC §3, as they appear in plans and results."""

    PREFILL = 1
    PRELUDE = 2
    RECURRENT = 3
    FINALIZE = 4
    CODA = 5
    DECODE = 6  # result rows only: a token the worker's decode loop sampled (DecodeBatch)
    EXITED = 7  # result rows only: a DecodeBatch row that exited without refill; its boundary work waits


class ExitTest(enum.IntEnum):
    """The exit test a DecodeBatch's worker applies after each loop d of a row (SPEC §3), with the
    row's min_loops, max_loops and threshold. Every test exits at d = max_loops, except PLANNED, whose
    exit depths the engine decided (fixed, trace) and sends with the row."""

    OURO = 1  # remaining *= 1 − λ, λ = sigmoid(gate(state_d)); exit if d ≥ min_loops, 1 − remaining ≥ threshold < 1
    OURO_DELAYED = 2  # exit after loop d if the OURO test passed after loop d − 1 (it never un-passes)
    KL = 3  # exit if d ≥ min_loops and KL(p_{d−1} ‖ p_d) < threshold (next-token distributions, p_0 uniform)
    LATENT = 4  # exit if d ≥ min_loops and ‖s_d − s_{d−1}‖ / ‖s_d‖ < threshold (raw state before ln_f)
    PLANNED = 5  # exit after loop d = the row's planned depth of its output (DecodeBatch.planned_depths)


# --------------------------------------------------------------------------- model / config


class ModelInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Static facts about a loaded model that the engine and the runner plan with."""

    family: str  # "ouro" | "huginn"
    hidden_size: int
    vocab_size: int  # rows of the LM head
    default_depth: int  # D: Ouro total_ut_steps, Huginn mean_recurrence
    num_loop_kv_layers: int  # attention layers inside the loop (one K/V plane per depth)
    num_outer_kv_layers: int  # attention layers outside the loop (one K/V version per position)
    num_kv_heads: int
    head_dim: int
    max_model_len: int  # longest sequence (prompt + generated) the positions support
    eos_token_ids: tuple[int, ...]
    has_exit_gate: bool  # Ouro: sigmoid(Linear(h)) hazard per loop
    has_coda_signal: bool  # Huginn: KL / latent change between loops


class WorkerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a worker needs to build its model, KV storage and slot table."""

    model: str  # "toy-ouro" | "toy-huginn" | checkpoint directory
    device: str  # "cpu" | "cuda" | "cuda:N"
    dtype: str  # "float64" | "float32" | "bfloat16" | "float16"
    max_loops: int  # D, the number of loop planes (0 = the model's default)
    kv_layout: str  # "last_exited" | "shared"
    block_size: int
    num_blocks: int  # 0 = size from free memory (cuda) / 512 (cpu)
    gpu_memory_utilization: float
    max_num_seqs: int  # slot table capacity
    attention_backend: str  # "torch" | "triton"
    state_init: str  # Huginn: "random" | "zero"
    num_threads: int = 0  # torch intra-op threads (0 = leave torch's default)
    cuda_graphs: bool = False  # decode loop passes from CUDA graphs (CUDA with the Triton backend)
    fused_layers: bool = False  # Ouro's loop through fused Triton kernels over packed q|k|v, gate|up weights
    cuda_graph_capture: str = "lazy"  # "startup": every graph bucket before WorkerReady | "lazy": at first use
    cuda_graph_prefill: bool = False  # PREFILL chunk loop passes from CUDA graphs too (needs cuda_graphs)
    max_num_batched_tokens: int = 0  # token rows of a plan's largest batch (the prefill graphs' top bucket)
    # ExitTest values the engine's DecodeBatches may name: their graphs are captured with the passes'
    # (under the model's default exit mode: OURO, which a model without an exit gate never runs)
    exit_tests: tuple[int, ...] = ()
    launch_pdl: bool = False  # the decode pass's Triton kernels with programmatic dependent launch (sm_90+)
    device_refill: bool = False  # gate exits, CODA and refill of greedy rows on the device (needs cuda_graphs)
    mixed_graphs: bool = False  # mixed batches' passes from CUDA graphs, captured at first use (needs cuda_graphs)
    fused_rotary_attention: bool = False  # a decode batch's RoPE, K/V write and attention in one launch (Triton)


class WorkerHello(msgspec.Struct, tag=True, array_like=True, kw_only=True):
    """Engine → worker, first message: who you are and what to build."""

    protocol_version: int
    worker_index: int
    config: WorkerConfig
    config_hash: str  # the engine's hash of `config`; the worker must compute the same
    heartbeat_interval_s: float = 1.0


class WorkerReady(msgspec.Struct, tag=True, array_like=True, kw_only=True):
    """Worker → engine: the model is loaded and the KV pool exists."""

    protocol_version: int
    worker_index: int
    config_hash: str
    device: str
    num_blocks: int  # physical KV blocks the pool holds
    num_planes: int  # planes per slot block table (loop depth planes + outer plane)
    max_depth: int  # D, resolved from the model (ModelInfo.default_depth) when the config's max_loops was 0
    model: ModelInfo
    pid: int
    # Token counts of the PREFILL passes the worker replays from CUDA graphs, ascending; a batch is
    # padded up to the next one. Empty: prefill runs eagerly, so any count costs what it holds.
    prefill_token_buckets: tuple[int, ...] = ()


class Heartbeat(msgspec.Struct, tag=True, array_like=True):
    """Either direction: I am alive (sent when nothing else was sent for an interval)."""

    sent_at: float  # time.monotonic() of the sender


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    """Engine → worker: finish the plan in hand, release everything, exit."""

    reason: str = ""


# --------------------------------------------------------------------------- plans


class SamplingOptions(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """Per-slot sampling settings, sent once at admission (the RNG ticket rides on each row)."""

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    # Teacher forcing: output i is forced_tokens[i] instead of a sample (SamplingParams.forced_tokens).
    forced_tokens: tuple[int, ...] | None = None
    # What ends a request, so the worker's decode loop stops its row where the engine will end it:
    max_tokens: int = 16  # outputs in all; the worker samples none past output max_tokens − 1
    stop_token_ids: tuple[int, ...] = ()  # SamplingParams.stop_token_ids, plus the model's EOS unless ignore_eos


class Admit(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Open a slot for (key, generation)."""

    key: int
    generation: int
    sampling: SamplingOptions = SamplingOptions()


class BlockAppends(Columnar, msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Block-table deltas: each row appends `num_new` block ids to every plane of its slot.

    block_ids is row-major: row 0's plane 0 ids, row 0's plane 1 ids, …, then row 1.
    """

    COLUMNS: ClassVar = {"keys": I64, "generations": I64, "num_new": I32, "block_ids": I32}
    RAGGED: ClassVar = frozenset({"block_ids"})

    keys: bytes = b""  # i64 [rows]
    generations: bytes = b""  # i64 [rows]
    num_new: bytes = b""  # i32 [rows], blocks appended to each plane
    block_ids: bytes = b""  # i32 [sum(num_new) * num_planes]

    def __post_init__(self) -> None:
        self._check_columns()
        self._check_min("num_new", 0)
        self._check_min("block_ids", 0)


class SlotKeys(Columnar, msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A list of slots, for release."""

    COLUMNS: ClassVar = {"keys": I64, "generations": I64}

    keys: bytes = b""  # i64 [rows]
    generations: bytes = b""  # i64 [rows]

    def __post_init__(self) -> None:
        self._check_columns()


class PrefillBatch(Columnar, msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    """Prompt chunks through all D loops (Huginn: prelude before, coda blocks after).

    Row r covers positions start_positions[r] … + query_lens[r] − 1 of its slot; its tokens
    are the next query_lens[r] entries of token_ids. The last position's state stays in the slot.
    With `rides_loop_passes` (mixed batches) the chunks' loop d runs in the plan's d-th loop pass
    (RECURRENT, then DECODE), as extra rows of that pass; loops no pass runs follow alone, after the
    plan's batches at the latest. A DecodeBatch row that enters exited at a riding chunk's last
    position waits for the chunk's last loop, then samples output 0 and goes on in the same plan.
    """

    COLUMNS: ClassVar = {
        "keys": I64, "generations": I64, "start_positions": I32, "query_lens": I32,
        "seeds": U64, "token_ids": I32,
    }
    RAGGED: ClassVar = frozenset({"token_ids"})

    keys: bytes = b""  # i64 [rows]
    generations: bytes = b""  # i64 [rows]
    start_positions: bytes = b""  # i32 [rows]
    query_lens: bytes = b""  # i32 [rows], ≥ 1
    seeds: bytes = b""  # u64 [rows], Huginn random state init (purpose 2, index = position)
    token_ids: bytes = b""  # i32 [sum(query_lens)]
    rides_loop_passes: bool = False  # the chunks' loops share the plan's loop passes (see above)

    def __post_init__(self) -> None:
        self._check_columns()
        self._check_min("start_positions", 0)
        self._check_min("query_lens", 1)
        self._check_min("token_ids", 0)
        if len(self.token_ids) // 4 != int(self.col("query_lens").sum()):
            raise ValueError("token_ids length differs from sum(query_lens)")


class PreludeBatch(Columnar, msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    """Embed each row's input token at its position and start its state (loop depth 0)."""

    COLUMNS: ClassVar = {"keys": I64, "generations": I64, "positions": I32, "token_ids": I32, "seeds": U64}

    keys: bytes = b""  # i64 [rows]
    generations: bytes = b""  # i64 [rows]
    positions: bytes = b""  # i32 [rows]
    token_ids: bytes = b""  # i32 [rows]; −1 = the token the slot's last CODA sampled
    seeds: bytes = b""  # u64 [rows], Huginn random state init

    def __post_init__(self) -> None:
        self._check_columns()
        self._check_min("positions", 0)
        self._check_min("token_ids", -1)


class RecurrentBatch(Columnar, msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    """Loops first_depths[r] … first_depths[r] + num_loops[r] − 1 of each row's current position,
    whose exit depth the engine knows (fixed, trace, a replayed position).

    Rows at different depths share each pass; a row leaves the pass when its count ends and reports
    its last depth.
    """

    COLUMNS: ClassVar = {
        "keys": I64, "generations": I64, "positions": I32, "first_depths": I32, "num_loops": I32,
    }

    keys: bytes = b""  # i64 [rows]
    generations: bytes = b""  # i64 [rows]
    positions: bytes = b""  # i32 [rows]
    first_depths: bytes = b""  # i32 [rows], 1-based loop index of the first loop to run
    num_loops: bytes = b""  # i32 [rows], ≥ 1

    def __post_init__(self) -> None:
        self._check_columns()
        self._check_min("positions", 0)
        self._check_min("first_depths", 1)
        self._check_min("num_loops", 1)


class FinalizeBatch(Columnar, msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    """LAST_EXITED: copy each row's exit-plane K/V at its position into every deeper plane."""

    COLUMNS: ClassVar = {"keys": I64, "generations": I64, "positions": I32, "exit_depths": I32}

    keys: bytes = b""  # i64 [rows]
    generations: bytes = b""  # i64 [rows]
    positions: bytes = b""  # i32 [rows]
    exit_depths: bytes = b""  # i32 [rows], ≥ 1

    def __post_init__(self) -> None:
        self._check_columns()
        self._check_min("positions", 0)
        self._check_min("exit_depths", 1)


class CodaBatch(Columnar, msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    """Coda + LM head on each slot's state; sample with the ticket (seed, purpose 1, index), or emit
    the slot's forced token of that index (teacher forcing)."""

    COLUMNS: ClassVar = {
        "keys": I64, "generations": I64, "positions": I32, "seeds": U64, "sample_indices": I32,
        "exit_depths": I32,
    }

    keys: bytes = b""  # i64 [rows]
    generations: bytes = b""  # i64 [rows]
    positions: bytes = b""  # i32 [rows]
    seeds: bytes = b""  # u64 [rows]
    sample_indices: bytes = b""  # i32 [rows], output index i (Philox index); −1: coda K/V only, no sample
    exit_depths: bytes = b""  # i32 [rows], loops the position ran (echoed by the result's CODA row)

    def __post_init__(self) -> None:
        self._check_columns()
        self._check_min("positions", 0)
        self._check_min("sample_indices", -1)
        self._check_min("exit_depths", 1)


class DecodeBatch(Columnar, msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    """Rows whose exits the worker decides (SPEC §6): up to max_passes loop passes, `exit_test` after
    each, and for each row that exits its boundary work in the same plan: [finalize →] CODA (sample
    with the ticket (seed, purpose 1, output index)) → PRELUDE of the token at the next position,
    which joins the next pass (with `refill`; without it a row stops at its exit, reported EXITED).

    A row starts at its position after `depths` loops (0: embedded, no loop yet); `exited` 1: the
    position has exited after `depths` loops and its boundary work comes first. A row stops early
    when it samples one of its slot's stop tokens or its output max_tokens − 1, and before looping a
    position whose next position its blocks do not cover (unless it holds its last output): a plan
    never writes past a row's blocks and never runs a loop the policy would not run.

    `continues` 1 (pipelined plans): the engine has not read the slot's previous DecodeBatch row's
    result yet, so the row's positions, depths, exited, exit_states and output_indices are ignored
    and the row picks up where that row stopped (the slot table keeps it); a slot whose request
    that row ended does nothing and reports nothing.

    ExitTest.PLANNED (fixed, trace): row r's positions of outputs output_indices[r], + 1, …, +
    num_planned[r] − 1 exit after the next num_planned[r] entries of planned_depths (for a row that
    continues, output_indices is still where these start: the engine's lagging index). The worker
    loops only positions whose exit depth it was sent, decides these exits on the host and reads
    nothing back: a stop token does not end a row mid-plan (its later rows are stale to the engine).
    """

    COLUMNS: ClassVar = {
        "keys": I64, "generations": I64, "positions": I32, "depths": I32, "exited": I32, "exit_states": F64,
        "output_indices": I32, "seeds": U64, "min_loops": I32, "max_loops": I32, "thresholds": F64,
        "continues": I32, "num_planned": I32, "planned_depths": I32,
    }
    RAGGED: ClassVar = frozenset({"num_planned", "planned_depths"})

    keys: bytes = b""  # i64 [rows]
    generations: bytes = b""  # i64 [rows]
    positions: bytes = b""  # i32 [rows], the position each row is at
    depths: bytes = b""  # i32 [rows], loops run there so far
    exited: bytes = b""  # i32 [rows], 1: the position has exited (its boundary work first), 0: it loops on
    exit_states: bytes = b""  # f64 [rows], the exit test's state there (OURO*: ∏ (1 − λ) of its loops; 1.0 at 0)
    output_indices: bytes = b""  # i32 [rows], the output the position's CODA samples (its Philox index)
    seeds: bytes = b""  # u64 [rows], CODA sampling and Huginn's state init of the next positions
    min_loops: bytes = b""  # i32 [rows], ≥ 1
    max_loops: bytes = b""  # i32 [rows], ≥ min_loops
    thresholds: bytes = b""  # f64 [rows], the request's exit threshold (its never-early value if unset)
    exit_test: ExitTest = ExitTest.OURO
    max_passes: int = 1  # loop passes the plan runs at most (a row samples at most max_passes + 1 tokens)
    refill: bool = True  # an exited row's next token joins the next pass (False: scheduling="no_refill")
    continues: bytes = b""  # i32 [rows], 1: pick up where the slot's last DecodeBatch row stopped (see above)
    num_planned: bytes = b""  # i32 [rows] (other tests may leave it empty), planned depths of the row's next outputs
    planned_depths: bytes = b""  # i32 [sum(num_planned)], exit depths ≥ 1, row by row (see above)

    def __post_init__(self) -> None:
        self._check_columns()
        self._check_planned()
        self._check_min("positions", 0)
        self._check_min("depths", 0)
        self._check_min("exited", 0)
        self._check_min("continues", 0)
        self._check_min("output_indices", 0)
        self._check_min("min_loops", 1)
        if (self.col("max_loops") < self.col("min_loops")).any():
            raise ValueError("a DecodeBatch row has max_loops below its min_loops")
        if self.max_passes < 1:
            raise ValueError(f"DecodeBatch.max_passes must be ≥ 1, got {self.max_passes}")

    def _check_planned(self) -> None:
        num_planned = self.col("num_planned")
        if len(num_planned) != self.num_rows and (len(num_planned) or self.exit_test == ExitTest.PLANNED):
            raise ValueError(f"DecodeBatch.num_planned has {len(num_planned)} entries for {self.num_rows} rows "
                             f"(one per row; other tests than PLANNED may leave it empty)")
        self._check_min("num_planned", 0)
        self._check_min("planned_depths", 1)
        if len(self.planned_depths) // 4 != int(num_planned.sum()):
            raise ValueError("DecodeBatch.planned_depths length differs from sum(num_planned)")


StageBatch = PrefillBatch | PreludeBatch | RecurrentBatch | FinalizeBatch | CodaBatch | DecodeBatch


class ExecutionPlan(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, kw_only=True):
    """One step of one worker: slot ops around an ordered list of stage batches.

    Order of application: admits and imports (slots opened), block appends, imported pages
    restored, batches (in list order: the engine emits PREFILL → FINALIZE → CODA → PRELUDE →
    RECURRENT → DECODE), exports, releases, swap drops.
    """

    step_id: int
    admits: list[Admit] = []
    block_appends: BlockAppends = msgspec.field(default_factory=BlockAppends)
    batches: list[StageBatch] = []
    releases: SlotKeys = msgspec.field(default_factory=SlotKeys)
    # Swap preemption: a slot's state and K/V pages go to worker-owned host memory, named by
    # the request key (the opaque handle), and come back into a new slot and new blocks.
    exports: SlotKeys = msgspec.field(default_factory=SlotKeys)  # save to host, then free the slot
    imports: SlotKeys = msgspec.field(default_factory=SlotKeys)  # (key, new generation) ← host copy
    swap_drops: SlotKeys = msgspec.field(default_factory=SlotKeys)  # forget these keys' host copies


class AppliedOps(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """How many of a failed plan's slot ops the runner applied before it stopped.

    Each kind is applied in list order, so a count is a prefix of the plan's list of that kind.
    """

    admits: int = 0  # slots opened by admits[:admits]
    imports: int = 0  # slots opened by imports[:imports] (their host copies may be half restored)
    exports: int = 0  # exports[:exports] saved to host memory, their slots freed
    releases: int = 0  # releases[:releases] freed
    swap_drops: int = 0  # swap_drops[:swap_drops] forgotten


class StepResult(Columnar, msgspec.Struct, tag=True, array_like=True, omit_defaults=True, kw_only=True):
    """Worker → engine: what each row of a plan produced, stamped with key and generation.

    One row per sampling CodaBatch row (CODA: token, logprob, its position's exit depth); the
    engine planned every RecurrentBatch row's loops, so those are not reported. A DecodeBatch row
    gives one DECODE row per token it sampled, in order (token, logprob, exit depth), then, unless
    a token ended its request (or it continued a slot whose request had ended: no row at all), one
    row for where it stopped: RECURRENT (depth = loops run at its position, 0 just after its
    PRELUDE; exit_states) or EXITED (its position exited after `depth` loops; boundary work next).

    A plan may come back in several messages: `early` ones first, each with every row of the
    requests that ended (max_tokens, a stop token the worker read) at a pass before the plan's last,
    sent once that pass has run; then the plan's result (`early` False), with the other rows, which
    completes the plan. A request's rows are all in one of them, in order.
    """

    COLUMNS: ClassVar = {
        "keys": I64, "generations": I64, "stages": I32, "depths": I32,
        "exit_states": F64, "tokens": I32, "logprobs": F64,
    }

    step_id: int
    keys: bytes = b""  # i64 [rows]
    generations: bytes = b""  # i64 [rows]
    stages: bytes = b""  # i32 [rows], Stage
    depths: bytes = b""  # i32 [rows], RECURRENT / EXITED: loops run at the position; CODA / DECODE: its exit depth
    exit_states: bytes = b""  # f64 [rows], a DecodeBatch row's RECURRENT row: the exit test's state; NaN otherwise
    tokens: bytes = b""  # i32 [rows], CODA / DECODE: the token; −1 otherwise
    logprobs: bytes = b""  # f64 [rows], CODA / DECODE: log p(token) under the raw logits; NaN otherwise
    num_free_slots: int = 0
    error: str = ""  # non-empty: the plan failed; the engine ends the requests the plan reached with an error
    applied: AppliedOps | None = None  # with an error: the slot ops applied before the failure
    early: bool = False  # ended requests' rows ahead of the plan's result, which follows (num_free_slots: 0)

    def __post_init__(self) -> None:
        self._check_columns()


# --------------------------------------------------------------------------- client side


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """How to sample one request and how deep its positions may loop (SPEC §8)."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = -1  # −1 = off
    top_p: float = 1.0
    seed: int | None = None  # None = drawn at admission and reported back
    stop_token_ids: list[int] = []
    stop: list[str] = []
    ignore_eos: bool = False
    logprobs: int = 0  # 0 or 1: the logprob of each sampled token
    min_loops: int = 1
    max_loops: int | None = None  # None = the engine's D
    exit_threshold: float | None = None  # None = the policy's never-early value
    exit_depths: list[int] | None = None  # the `trace` policy's depths, one per output token
    # Teacher forcing, to score a text: output i is forced_tokens[i] instead of a sample (its
    # logprob is reported; exit rules, stop tokens and EOS apply to it as to a sampled token).
    forced_tokens: list[int] | None = None
    priority: int = 0  # lower runs first under scheduling_policy="priority"

    def __post_init__(self) -> None:
        _require(self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}")
        _require(
            math.isfinite(self.temperature) and self.temperature >= 0,
            f"temperature must be a finite number ≥ 0, got {self.temperature}",
        )
        _require(self.top_k == -1 or self.top_k >= 1, f"top_k must be −1 (off) or ≥ 1, got {self.top_k}")
        _require(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        _require(self.seed is None or 0 <= self.seed < 2**64, "seed must be in [0, 2^64)")
        _require(self.logprobs in (0, 1), f"logprobs must be 0 or 1, got {self.logprobs}")
        _require(self.min_loops >= 1, f"min_loops must be at least 1, got {self.min_loops}")
        if self.max_loops is not None:
            _require(
                self.max_loops >= self.min_loops,
                f"min_loops ({self.min_loops}) must not exceed max_loops ({self.max_loops})",
            )
        if self.exit_threshold is not None:
            _require(0 <= self.exit_threshold, f"exit_threshold must be ≥ 0, got {self.exit_threshold}")
        if self.exit_depths is not None:
            _require(
                len(self.exit_depths) == self.max_tokens,
                f"exit_depths has {len(self.exit_depths)} entries, max_tokens is {self.max_tokens}",
            )
        if self.forced_tokens is not None:
            _require(
                len(self.forced_tokens) == self.max_tokens,
                f"forced_tokens has {len(self.forced_tokens)} entries, max_tokens is {self.max_tokens}",
            )
            _require(min(self.forced_tokens) >= 0, "forced_tokens must be token ids ≥ 0")
        _require(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be ≥ 0")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


class GenerateRequest(msgspec.Struct, tag=True, kw_only=True, forbid_unknown_fields=True):
    """Client → engine: start a request (text prompt or token ids)."""

    request_id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)


class AbortRequest(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """Client → engine: stop a request; its stream ends with finish reason `abort`."""

    request_id: str


class HealthRequest(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """Client → engine: ask for a HealthReport."""

    nonce: int = 0


class Keepalive(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """Client → engine every second; the engine answers with KeepaliveAck."""

    sent_at: float = 0.0


class KeepaliveAck(msgspec.Struct, tag=True):
    """Engine → client: the answer to a Keepalive."""

    sent_at: float = 0.0


class RequestOutput(msgspec.Struct, tag=True, kw_only=True, omit_defaults=True):
    """Engine → client: a streamed delta of one request (or, offline, its cumulative state)."""

    request_id: str
    first_index: int = 0  # index of token_ids[0] in the request's output
    token_ids: list[int] = []
    exit_depths: list[int] = []
    logprobs: list[float] = []
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    seed: int | None = None
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache at the first admission


class EngineError(msgspec.Struct, tag=True, kw_only=True):
    """Engine → client: a request (or the message, when request_id is None) was refused."""

    request_id: str | None
    code: str  # "invalid_request" | "overload" | "protocol" | "internal"
    message: str


class WorkerHealth(msgspec.Struct, kw_only=True):
    """One worker's state in a HealthReport."""

    index: int
    alive: bool
    kv_blocks_total: int
    kv_blocks_used: int
    running: int
    # The worker's free slots as of its last result (max_num_seqs before its first, 0 once dead).
    free_slots: int = -1
    responsive: bool = True  # heard from within half of worker_timeout (new requests go elsewhere if not)
    kv_blocks_cached: int = 0  # blocks the prefix cache indexes, held by requests or idle (idle ones count as free)


class HealthReport(msgspec.Struct, tag=True, kw_only=True):
    """Engine → client: liveness and load."""

    nonce: int = 0
    workers: list[WorkerHealth] = []
    waiting: int = 0
    running: int = 0
    num_preemptions: int = 0  # since start, cumulative
    num_replays: int = 0  # requests re-admitted after a worker died, since start
    num_worker_restarts: int = 0  # replacement workers started (restart_workers), since start
    draining: bool = False  # a stop was requested: new requests are refused
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache (one lookup per admission), since start
    prefix_cache_hits: int = 0  # of those, tokens whose K/V came from the cache

    @property
    def prefix_cache_hit_ratio(self) -> float:
        """Share of the prompt tokens looked up that the prefix cache held (0 before any lookup)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


WorkerInbound = WorkerHello | ExecutionPlan | Heartbeat | Shutdown
WorkerOutbound = WorkerReady | StepResult | Heartbeat
ClientInbound = GenerateRequest | AbortRequest | HealthRequest | Keepalive
ClientOutbound = RequestOutput | EngineError | HealthReport | KeepaliveAck
