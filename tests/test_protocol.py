"""protocol/: round trips of every message, strict decoding, no pickling, no torch (SPEC §6)."""

from __future__ import annotations

import math
import re
import struct
import subprocess
import sys
from typing import Any, get_args

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import (
    PROTOCOL_VERSION,
    Codec,
    ProtocolError,
    client_codec,
    engine_worker_codec,
    frontend_codec,
    pack,
    worker_side_codec,
)
from protocol.codec import CLIENT_MAX_FRAME_BYTES, DEFAULT_MAX_FRAME_BYTES
from protocol.columns import F64, I32, I64, U64
from protocol.messages import (
    AbortRequest,
    Admit,
    AppliedOps,
    BlockAppends,
    ClientInbound,
    ClientOutbound,
    CodaBatch,
    DecodeBatch,
    EngineError,
    ExecutionPlan,
    ExitTest,
    FinalizeBatch,
    GenerateRequest,
    HealthReport,
    HealthRequest,
    Heartbeat,
    Keepalive,
    KeepaliveAck,
    ModelInfo,
    PrefillBatch,
    PreludeBatch,
    RecurrentBatch,
    RequestOutput,
    SamplingOptions,
    SamplingParams,
    Shutdown,
    SlotKeys,
    StepResult,
    WorkerConfig,
    WorkerHealth,
    WorkerHello,
    WorkerInbound,
    WorkerOutbound,
    WorkerReady,
)

FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

HEADER = struct.pack("<2sH", b"RL", PROTOCOL_VERSION)

# --------------------------------------------------------------------------- strategies

INT64 = st.integers(-(2**63), 2**63 - 1)
UINT64 = st.integers(0, 2**64 - 1)
I32_MAX = 2**31 - 1
I32_MIN = -(2**31)
TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=20)
FLOAT = st.floats(allow_nan=False)  # NaN ≠ NaN would break the equality check (not the protocol)
ANY_FLOAT = st.floats()  # inside packed columns NaN is fine: bytes compare
ROWS = st.integers(0, 8)


def col(elements: st.SearchStrategy[int] | st.SearchStrategy[float], n: int) -> st.SearchStrategy:
    return st.lists(elements, min_size=n, max_size=n)


@st.composite
def block_appends(draw: Any) -> BlockAppends:
    n = draw(ROWS)
    num_new = draw(col(st.integers(0, 4), n))
    planes = draw(st.integers(1, 3))
    ids = draw(col(st.integers(0, I32_MAX), sum(num_new) * planes))
    return BlockAppends(
        keys=pack(draw(col(INT64, n)), I64),
        generations=pack(draw(col(INT64, n)), I64),
        num_new=pack(num_new, I32),
        block_ids=pack(ids, I32),
    )


@st.composite
def slot_keys(draw: Any) -> SlotKeys:
    n = draw(ROWS)
    return SlotKeys(keys=pack(draw(col(INT64, n)), I64), generations=pack(draw(col(INT64, n)), I64))


@st.composite
def prefill_batches(draw: Any) -> PrefillBatch:
    n = draw(ROWS)
    query_lens = draw(col(st.integers(1, 6), n))
    return PrefillBatch(
        keys=pack(draw(col(INT64, n)), I64),
        generations=pack(draw(col(INT64, n)), I64),
        start_positions=pack(draw(col(st.integers(0, I32_MAX), n)), I32),
        query_lens=pack(query_lens, I32),
        seeds=pack(draw(col(UINT64, n)), U64),
        token_ids=pack(draw(col(st.integers(0, I32_MAX), sum(query_lens))), I32),
        rides_loop_passes=draw(st.booleans()),
    )


@st.composite
def prelude_batches(draw: Any) -> PreludeBatch:
    n = draw(ROWS)
    return PreludeBatch(
        keys=pack(draw(col(INT64, n)), I64),
        generations=pack(draw(col(INT64, n)), I64),
        positions=pack(draw(col(st.integers(0, I32_MAX), n)), I32),
        token_ids=pack(draw(col(st.integers(-1, I32_MAX), n)), I32),
        seeds=pack(draw(col(UINT64, n)), U64),
    )


@st.composite
def recurrent_batches(draw: Any) -> RecurrentBatch:
    n = draw(ROWS)
    return RecurrentBatch(
        keys=pack(draw(col(INT64, n)), I64),
        generations=pack(draw(col(INT64, n)), I64),
        positions=pack(draw(col(st.integers(0, I32_MAX), n)), I32),
        first_depths=pack(draw(col(st.integers(1, 64), n)), I32),
        num_loops=pack(draw(col(st.integers(1, 64), n)), I32),
    )


@st.composite
def finalize_batches(draw: Any) -> FinalizeBatch:
    n = draw(ROWS)
    return FinalizeBatch(
        keys=pack(draw(col(INT64, n)), I64),
        generations=pack(draw(col(INT64, n)), I64),
        positions=pack(draw(col(st.integers(0, I32_MAX), n)), I32),
        exit_depths=pack(draw(col(st.integers(1, 64), n)), I32),
    )


@st.composite
def coda_batches(draw: Any) -> CodaBatch:
    n = draw(ROWS)
    return CodaBatch(
        keys=pack(draw(col(INT64, n)), I64),
        generations=pack(draw(col(INT64, n)), I64),
        positions=pack(draw(col(st.integers(0, I32_MAX), n)), I32),
        seeds=pack(draw(col(UINT64, n)), U64),
        sample_indices=pack(draw(col(st.integers(-1, I32_MAX), n)), I32),
        exit_depths=pack(draw(col(st.integers(1, 64), n)), I32),
    )


@st.composite
def decode_batches(draw: Any) -> DecodeBatch:
    n = draw(ROWS)
    min_loops = draw(col(st.integers(1, 32), n))
    exit_test = draw(st.sampled_from(ExitTest))
    # Planned exit depths: one count per row under PLANNED; other tests may send them or not.
    num_planned = draw(col(st.integers(0, 8), n)) if exit_test == ExitTest.PLANNED or draw(st.booleans()) else []
    return DecodeBatch(
        keys=pack(draw(col(INT64, n)), I64),
        generations=pack(draw(col(INT64, n)), I64),
        positions=pack(draw(col(st.integers(0, I32_MAX), n)), I32),
        depths=pack(draw(col(st.integers(0, 64), n)), I32),
        exited=pack(draw(col(st.integers(0, 1), n)), I32),
        exit_states=pack(draw(col(ANY_FLOAT, n)), F64),
        output_indices=pack(draw(col(st.integers(0, I32_MAX), n)), I32),
        seeds=pack(draw(col(UINT64, n)), U64),
        min_loops=pack(min_loops, I32),
        max_loops=pack([m + draw(st.integers(0, 32)) for m in min_loops], I32),
        thresholds=pack(draw(col(ANY_FLOAT, n)), F64),
        continues=pack(draw(col(st.integers(0, 1), n)), I32),
        exit_test=exit_test,
        max_passes=draw(st.integers(1, 1024)),
        refill=draw(st.booleans()),
        num_planned=pack(num_planned, I32),
        planned_depths=pack(draw(col(st.integers(1, 64), sum(num_planned))), I32),
    )


STAGE_BATCHES = {
    PrefillBatch: prefill_batches(),
    PreludeBatch: prelude_batches(),
    RecurrentBatch: recurrent_batches(),
    FinalizeBatch: finalize_batches(),
    CodaBatch: coda_batches(),
    DecodeBatch: decode_batches(),
}
stage_batches = st.one_of(*STAGE_BATCHES.values())

sampling_options = st.builds(
    SamplingOptions,
    temperature=st.floats(0, 10),
    top_k=st.one_of(st.just(-1), st.integers(1, 1000)),
    top_p=st.floats(0, 1, exclude_min=True),
    forced_tokens=st.one_of(st.none(), st.lists(st.integers(0, I32_MAX), min_size=1, max_size=8).map(tuple)),
    max_tokens=st.integers(1, 4096),
    stop_token_ids=st.lists(st.integers(0, I32_MAX), max_size=8).map(tuple),
)
admits = st.builds(Admit, key=INT64, generation=INT64, sampling=sampling_options)


@st.composite
def execution_plans(draw: Any) -> ExecutionPlan:
    return ExecutionPlan(
        step_id=draw(INT64),
        admits=draw(st.lists(admits, max_size=4)),
        block_appends=draw(block_appends()),
        batches=draw(st.lists(stage_batches, max_size=6)),
        releases=draw(slot_keys()),
    )


worker_configs = st.builds(
    WorkerConfig,
    model=TEXT,
    device=st.sampled_from(["cpu", "cuda", "cuda:1"]),
    dtype=st.sampled_from(["float64", "float32", "bfloat16", "float16"]),
    max_loops=st.integers(0, 64),
    kv_layout=st.sampled_from(["last_exited", "shared"]),
    block_size=st.integers(1, 256),
    num_blocks=st.integers(0, 2**40),
    gpu_memory_utilization=st.floats(0, 1),
    max_num_seqs=st.integers(1, 4096),
    attention_backend=st.sampled_from(["torch", "triton"]),
    state_init=st.sampled_from(["random", "zero"]),
    num_threads=st.integers(0, 64),
    cuda_graphs=st.booleans(),
    fused_layers=st.booleans(),
    cuda_graph_capture=st.sampled_from(["startup", "lazy"]),
    cuda_graph_prefill=st.booleans(),
    max_num_batched_tokens=st.integers(0, 2**20),
)
model_infos = st.builds(
    ModelInfo,
    family=st.sampled_from(["ouro", "huginn"]),
    hidden_size=st.integers(1, 2**20),
    vocab_size=st.integers(1, 2**20),
    default_depth=st.integers(1, 64),
    num_loop_kv_layers=st.integers(0, 64),
    num_outer_kv_layers=st.integers(0, 64),
    num_kv_heads=st.integers(1, 128),
    head_dim=st.integers(1, 512),
    max_model_len=st.integers(1, 2**24),
    eos_token_ids=st.lists(st.integers(0, I32_MAX), max_size=3).map(tuple),
    has_exit_gate=st.booleans(),
    has_coda_signal=st.booleans(),
)
worker_hellos = st.builds(
    WorkerHello,
    protocol_version=st.just(PROTOCOL_VERSION),
    worker_index=st.integers(0, 1024),
    config=worker_configs,
    config_hash=TEXT,
    heartbeat_interval_s=st.floats(0, 1e6),
)
worker_readies = st.builds(
    WorkerReady,
    protocol_version=st.just(PROTOCOL_VERSION),
    worker_index=st.integers(0, 1024),
    config_hash=TEXT,
    device=TEXT,
    num_blocks=st.integers(0, 2**40),
    num_planes=st.integers(1, 65),
    max_depth=st.integers(1, 64),
    model=model_infos,
    pid=st.integers(1, 2**31),
)
heartbeats = st.builds(Heartbeat, sent_at=FLOAT)
shutdowns = st.builds(Shutdown, reason=TEXT)


@st.composite
def step_results(draw: Any) -> StepResult:
    n = draw(ROWS)
    return StepResult(
        step_id=draw(INT64),
        keys=pack(draw(col(INT64, n)), I64),
        generations=pack(draw(col(INT64, n)), I64),
        stages=pack(draw(col(st.integers(1, 7), n)), I32),
        depths=pack(draw(col(st.integers(0, 64), n)), I32),
        exit_states=pack(draw(col(ANY_FLOAT, n)), F64),
        tokens=pack(draw(col(st.integers(-1, I32_MAX), n)), I32),
        logprobs=pack(draw(col(ANY_FLOAT, n)), F64),
        num_free_slots=draw(st.integers(0, 4096)),
        error=draw(TEXT),
        applied=draw(st.none() | st.builds(AppliedOps, *[st.integers(0, 4096)] * 5)),
    )


@st.composite
def sampling_params(draw: Any) -> SamplingParams:
    max_tokens = draw(st.integers(1, 32))
    min_loops = draw(st.integers(1, 8))
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=draw(st.floats(0, 100)),
        top_k=draw(st.one_of(st.just(-1), st.integers(1, 2**31))),
        top_p=draw(st.floats(0, 1, exclude_min=True)),
        seed=draw(st.one_of(st.none(), UINT64)),
        stop_token_ids=draw(st.lists(st.integers(0, 2**63 - 1), max_size=3)),
        stop=draw(st.lists(TEXT, max_size=3)),
        ignore_eos=draw(st.booleans()),
        logprobs=draw(st.sampled_from([0, 1])),
        min_loops=min_loops,
        max_loops=draw(st.one_of(st.none(), st.integers(min_loops, 64))),
        exit_threshold=draw(st.one_of(st.none(), st.floats(0, 1e9))),
        exit_depths=draw(st.one_of(st.none(), col(st.integers(1, 64), max_tokens))),
        priority=draw(INT64),
    )


generate_requests = st.builds(
    GenerateRequest,
    request_id=TEXT,
    prompt=st.one_of(st.none(), TEXT),
    prompt_token_ids=st.one_of(st.none(), st.lists(st.integers(0, I32_MAX), max_size=10)),
    params=sampling_params(),
)
abort_requests = st.builds(AbortRequest, request_id=TEXT)
health_requests = st.builds(HealthRequest, nonce=INT64)
keepalives = st.builds(Keepalive, sent_at=FLOAT)
keepalive_acks = st.builds(KeepaliveAck, sent_at=FLOAT)


@st.composite
def request_outputs(draw: Any) -> RequestOutput:
    n = draw(st.integers(0, 6))
    return RequestOutput(
        request_id=draw(TEXT),
        first_index=draw(st.integers(0, 2**31)),
        token_ids=draw(col(st.integers(0, I32_MAX), n)),
        exit_depths=draw(col(st.integers(1, 64), n)),
        logprobs=draw(st.one_of(st.just([]), col(st.floats(max_value=0, allow_nan=False), n))),
        text=draw(TEXT),
        finished=draw(st.booleans()),
        finish_reason=draw(st.sampled_from([None, "stop", "length", "abort", "error"])),
        seed=draw(st.one_of(st.none(), UINT64)),
        error=draw(st.one_of(st.none(), TEXT)),
    )


engine_errors = st.builds(
    EngineError,
    request_id=st.one_of(st.none(), TEXT),
    code=st.sampled_from(["invalid_request", "overload", "protocol", "internal"]),
    message=TEXT,
)
worker_healths = st.builds(
    WorkerHealth,
    index=st.integers(0, 1024),
    alive=st.booleans(),
    kv_blocks_total=st.integers(0, 2**40),
    kv_blocks_used=st.integers(0, 2**40),
    running=st.integers(0, 4096),
    free_slots=st.integers(0, 4096),
    responsive=st.booleans(),
)
health_reports = st.builds(
    HealthReport,
    nonce=INT64,
    workers=st.lists(worker_healths, max_size=4),
    waiting=st.integers(0, 2**31),
    running=st.integers(0, 2**31),
)

# Every message type → (its strategy, the codec of the socket that carries it).
MESSAGES: dict[type, tuple[st.SearchStrategy, Any]] = {
    WorkerHello: (worker_hellos, worker_side_codec),
    ExecutionPlan: (execution_plans(), worker_side_codec),
    Heartbeat: (heartbeats, worker_side_codec),
    Shutdown: (shutdowns, worker_side_codec),
    WorkerReady: (worker_readies, engine_worker_codec),
    StepResult: (step_results(), engine_worker_codec),
    GenerateRequest: (generate_requests, frontend_codec),
    AbortRequest: (abort_requests, frontend_codec),
    HealthRequest: (health_requests, frontend_codec),
    Keepalive: (keepalives, frontend_codec),
    RequestOutput: (request_outputs(), client_codec),
    EngineError: (engine_errors, client_codec),
    HealthReport: (health_reports, client_codec),
    KeepaliveAck: (keepalive_acks, client_codec),
}
UNIONS = {
    worker_side_codec: WorkerInbound,
    engine_worker_codec: WorkerOutbound,
    frontend_codec: ClientInbound,
    client_codec: ClientOutbound,
}
CODECS = list(UNIONS)
CODEC_IDS = [f.__name__ for f in CODECS]


def any_message_for(codec_factory: Any) -> st.SearchStrategy:
    return st.one_of(*(s for s, c in MESSAGES.values() if c is codec_factory))


def frame(body: Any, header: bytes = HEADER) -> bytes:
    """A frame with the right header around an arbitrary msgpack body (lists, dicts, …)."""
    return header + msgspec.msgpack.encode(body)


def raw(codec: Codec, message: Any) -> Any:
    """The untyped msgpack body of a message, to tamper with (bytes stay bytes)."""
    return msgspec.msgpack.decode(codec.encode(message)[len(HEADER) :])


def decode_or_protocol_error(codec: Codec, data: bytes, union: Any) -> None:
    """Either a valid message of the socket's union comes out, or ProtocolError — nothing else."""
    try:
        message = codec.decode(data)
    except ProtocolError:
        return
    assert isinstance(message, get_args(union))


# --------------------------------------------------------------------------- 1. round trips


def test_every_message_type_is_covered() -> None:
    carried = {t for union in UNIONS.values() for t in get_args(union)}
    assert carried == set(MESSAGES)
    for message_type, (_, codec_factory) in MESSAGES.items():
        assert message_type in get_args(UNIONS[codec_factory])


@pytest.mark.parametrize("message_type", list(MESSAGES), ids=lambda t: t.__name__)
@FAST
@given(data=st.data())
def test_round_trip(message_type: type, data: Any) -> None:
    strategy, codec_factory = MESSAGES[message_type]
    message = data.draw(strategy)
    codec = codec_factory()
    encoded = codec.encode(message)
    assert isinstance(encoded, bytes) and encoded[: len(HEADER)] == HEADER
    decoded = codec.decode(encoded)
    assert type(decoded) is message_type
    assert decoded == message
    assert codec.decode(memoryview(encoded)) == message
    assert codec.decode(bytearray(encoded)) == message


def _one_row_of_each_batch() -> list[Any]:
    k, g = pack([7], I64), pack([3], I64)
    return [
        PrefillBatch(keys=k, generations=g, start_positions=pack([0], I32), query_lens=pack([3], I32),
                     seeds=pack([2**64 - 1], U64), token_ids=pack([1, 2, 3], I32)),
        PreludeBatch(keys=k, generations=g, positions=pack([3], I32), token_ids=pack([-1], I32),
                     seeds=pack([5], U64)),
        RecurrentBatch(keys=k, generations=g, positions=pack([3], I32), first_depths=pack([1], I32),
                       num_loops=pack([4], I32)),
        FinalizeBatch(keys=k, generations=g, positions=pack([3], I32), exit_depths=pack([2], I32)),
        CodaBatch(keys=k, generations=g, positions=pack([3], I32), seeds=pack([5], U64),
                  sample_indices=pack([0], I32), exit_depths=pack([4], I32)),
        DecodeBatch(keys=k, generations=g, positions=pack([3], I32), depths=pack([2], I32), exited=pack([0], I32),
                    exit_states=pack([0.25], F64), output_indices=pack([1], I32), seeds=pack([5], U64),
                    min_loops=pack([1], I32), max_loops=pack([4], I32), thresholds=pack([0.5], F64),
                    continues=pack([1], I32), exit_test=ExitTest.KL, max_passes=8),
        DecodeBatch(keys=k, generations=g, positions=pack([3], I32), depths=pack([0], I32), exited=pack([1], I32),
                    exit_states=pack([1.0], F64), output_indices=pack([1], I32), seeds=pack([5], U64),
                    min_loops=pack([1], I32), max_loops=pack([4], I32), thresholds=pack([0.0], F64),
                    continues=pack([0], I32), exit_test=ExitTest.PLANNED, max_passes=16,
                    num_planned=pack([3], I32), planned_depths=pack([2, 4, 1], I32)),
    ]


def test_plan_with_every_stage_batch_kind_round_trips_in_order() -> None:
    batches = _one_row_of_each_batch()
    assert {type(b) for b in batches} == set(STAGE_BATCHES)
    plan = ExecutionPlan(
        step_id=42,
        admits=[Admit(key=7, generation=3, sampling=SamplingOptions(temperature=0.5, top_k=5, top_p=0.9))],
        block_appends=BlockAppends(keys=pack([7], I64), generations=pack([3], I64),
                                   num_new=pack([2], I32), block_ids=pack([0, 1, 2, 3], I32)),
        batches=batches + batches[::-1],
        releases=SlotKeys(keys=pack([9], I64), generations=pack([1], I64)),
    )
    codec = worker_side_codec()
    decoded = codec.decode(codec.encode(plan))
    assert decoded == plan
    assert [type(b) for b in decoded.batches] == [type(b) for b in plan.batches]
    assert decoded.batches[5].exit_test is ExitTest.KL and decoded.batches[5].max_passes == 8
    assert decoded.batches[0].col("token_ids").tolist() == [1, 2, 3]
    assert decoded.batches[0].col("seeds").tolist() == [2**64 - 1]
    assert decoded.batches[1].col("token_ids").tolist() == [-1]
    assert decoded.batches[0].num_rows == 1


@FAST
@given(plan=execution_plans())
def test_columns_decode_to_the_packed_values(plan: ExecutionPlan) -> None:
    decoded = worker_side_codec().decode(worker_side_codec().encode(plan))
    for before, after in zip(plan.batches, decoded.batches, strict=True):
        for name in type(before).COLUMNS:
            np.testing.assert_array_equal(before.col(name), after.col(name))
            assert after.col(name).dtype == np.dtype(type(before).COLUMNS[name])


# --------------------------------------------------------------------------- 2. strict decoding


@pytest.mark.parametrize("codec_factory", CODECS, ids=CODEC_IDS)
@FUZZ
@given(data=st.binary(max_size=300))
def test_random_bytes(codec_factory: Any, data: bytes) -> None:
    decode_or_protocol_error(codec_factory(), data, UNIONS[codec_factory])
    decode_or_protocol_error(codec_factory(), HEADER + data, UNIONS[codec_factory])


_msgpack_values = st.recursive(
    st.none() | st.booleans() | INT64 | st.floats() | TEXT | st.binary(max_size=16)
    | st.sampled_from([t.__name__ for t in MESSAGES] + ["type", "Bogus"]),
    lambda children: st.lists(children, max_size=6) | st.dictionaries(TEXT | st.sampled_from(["type"]), children,
                                                                      max_size=5),
    max_leaves=25,
)


@pytest.mark.parametrize("codec_factory", CODECS, ids=CODEC_IDS)
@FUZZ
@given(body=_msgpack_values)
def test_arbitrary_msgpack_bodies(codec_factory: Any, body: Any) -> None:
    decode_or_protocol_error(codec_factory(), frame(body), UNIONS[codec_factory])


@pytest.mark.parametrize("codec_factory", CODECS, ids=CODEC_IDS)
@FUZZ
@given(data=st.data())
def test_valid_frame_with_a_flipped_byte(codec_factory: Any, data: Any) -> None:
    codec = codec_factory()
    encoded = bytearray(codec.encode(data.draw(any_message_for(codec_factory))))
    index = data.draw(st.integers(0, len(encoded) - 1))
    encoded[index] ^= data.draw(st.integers(1, 255))
    if index < len(HEADER):
        with pytest.raises(ProtocolError):
            codec.decode(bytes(encoded))
    else:  # a flip inside a float or a column can still be a valid message
        decode_or_protocol_error(codec, bytes(encoded), UNIONS[codec_factory])


@pytest.mark.parametrize("codec_factory", CODECS, ids=CODEC_IDS)
@FAST
@given(data=st.data())
def test_trailing_bytes_are_refused(codec_factory: Any, data: Any) -> None:
    codec = codec_factory()
    encoded = codec.encode(data.draw(any_message_for(codec_factory)))
    with pytest.raises(ProtocolError):
        codec.decode(encoded + data.draw(st.binary(min_size=1, max_size=8)))


def _sample_frames() -> list[tuple[Any, bytes]]:
    plan = ExecutionPlan(step_id=1, admits=[Admit(key=1, generation=2)], batches=_one_row_of_each_batch())
    return [
        (worker_side_codec, worker_side_codec().encode(plan)),
        (worker_side_codec, worker_side_codec().encode(Heartbeat(sent_at=1.5))),
        (engine_worker_codec, engine_worker_codec().encode(
            StepResult(step_id=1, keys=pack([1, 2], I64), generations=pack([1, 1], I64),
                       stages=pack([3, 5], I32), depths=pack([2, 2], I32),
                       exit_states=pack([0.1, math.nan], F64), tokens=pack([-1, 9], I32),
                       logprobs=pack([math.nan, -0.3], F64)))),
        (frontend_codec, frontend_codec().encode(
            GenerateRequest(request_id="r", prompt_token_ids=[1, 2, 3],
                            params=SamplingParams(max_tokens=2, exit_depths=[1, 2], seed=7)))),
        (client_codec, client_codec().encode(
            RequestOutput(request_id="r", token_ids=[5], exit_depths=[2], finished=True,
                          finish_reason="length"))),
    ]


@pytest.mark.parametrize("codec_factory,encoded", _sample_frames(), ids=lambda x: getattr(x, "__name__", ""))
def test_every_truncation_is_refused(codec_factory: Any, encoded: bytes) -> None:
    codec = codec_factory()
    codec.decode(encoded)  # the whole frame is valid
    for cut in range(len(encoded)):
        with pytest.raises(ProtocolError):
            codec.decode(encoded[:cut])


@pytest.mark.parametrize("codec_factory,body", [
    # wrong types: a string (or bool, or None, or list) where an int / float / bytes belongs
    (worker_side_codec, ["Heartbeat", "soon"]),
    (worker_side_codec, ["ExecutionPlan", "1"]),
    (worker_side_codec, ["ExecutionPlan", True]),
    (worker_side_codec, ["ExecutionPlan", 1.5]),
    (worker_side_codec, ["ExecutionPlan", 1, [[1, "2"]]]),
    (worker_side_codec, ["ExecutionPlan", 1, [], [], [["RecurrentBatch", [1], [2], [0], [1], [1]]]]),
    (worker_side_codec, ["ExecutionPlan", 1, [], [], [["CodaBatch", "keys"]]]),
    (worker_side_codec, ["ExecutionPlan", 1, [], [], "batches"]),
    (worker_side_codec, ["Shutdown", 3]),
    (worker_side_codec, ["WorkerHello", "1", 0, {}, "h"]),
    (engine_worker_codec, ["StepResult", "1"]),
    (engine_worker_codec, ["StepResult", 1, b"", b"", b"", b"", b"", b"", b"", "many"]),
    (frontend_codec, {"type": "GenerateRequest", "request_id": 5}),
    (frontend_codec, {"type": "GenerateRequest", "request_id": "a", "prompt_token_ids": ["1"]}),
    (frontend_codec, {"type": "GenerateRequest", "request_id": "a", "params": {"max_tokens": "16"}}),
    (frontend_codec, {"type": "GenerateRequest", "request_id": "a", "params": {"seed": 1.0}}),
    (frontend_codec, {"type": "GenerateRequest", "request_id": "a", "params": {"ignore_eos": 1}}),
    (frontend_codec, {"type": "GenerateRequest", "request_id": "a", "params": []}),
    (frontend_codec, {"type": "GenerateRequest"}),  # missing request_id
    (frontend_codec, {"type": "AbortRequest", "request_id": None}),
    (frontend_codec, {"type": "HealthRequest", "nonce": "x"}),
    (frontend_codec, {"type": "Keepalive", "sent_at": "now"}),
    (client_codec, {"type": "RequestOutput", "request_id": "r", "token_ids": "abc"}),
    (client_codec, {"type": "EngineError", "request_id": None, "code": 1, "message": "m"}),
    (client_codec, {"type": "HealthReport", "workers": [{"index": "0"}]}),
    # not a message at all / wrong shape
    (worker_side_codec, None),
    (worker_side_codec, 1),
    (worker_side_codec, []),
    (worker_side_codec, {"type": "Heartbeat", "sent_at": 1.0}),  # worker messages are arrays
    (frontend_codec, ["GenerateRequest", "a"]),  # client messages are maps
    (frontend_codec, {"request_id": "a"}),  # no tag
    # unknown tags, and tags of another socket's messages
    (worker_side_codec, ["Bogus", 1]),
    (worker_side_codec, ["WorkerReady", 1, 0, "h", "cpu", 1, [], 1]),
    (worker_side_codec, ["StepResult", 1]),
    (worker_side_codec, ["ExecutionPlan", 1, [], [], [["Bogus"]]]),
    (worker_side_codec, ["ExecutionPlan", 1, [], [], [["StepResult", 1]]]),
    (engine_worker_codec, ["ExecutionPlan", 1]),
    (engine_worker_codec, ["Shutdown"]),
    (frontend_codec, {"type": "Bogus"}),
    (frontend_codec, {"type": "RequestOutput", "request_id": "r"}),
    (frontend_codec, {"type": "KeepaliveAck"}),
    (client_codec, {"type": "GenerateRequest", "request_id": "r"}),
    (client_codec, {"type": "Keepalive"}),
])
def test_wrong_types_and_unknown_tags(codec_factory: Any, body: Any) -> None:
    with pytest.raises(ProtocolError):
        codec_factory().decode(frame(body))


def _batch_body(batch_type: type, **overrides: Any) -> list[Any]:
    """A one-row batch of `batch_type` as a raw array, with some columns replaced."""
    batch = next(b for b in _one_row_of_each_batch() if type(b) is batch_type)
    body = raw(worker_side_codec(), ExecutionPlan(step_id=1, batches=[batch]))[4][0]
    names = list(batch_type.__struct_fields__)
    for name, value in overrides.items():
        body[1 + names.index(name)] = value
    return body


def _plan_frame(batch_body: list[Any]) -> bytes:
    return frame(["ExecutionPlan", 1, [], [], [batch_body]])


def _params_frame(**params: Any) -> bytes:
    return frame({"type": "GenerateRequest", "request_id": "r", "prompt_token_ids": [1], "params": params})


OUT_OF_RANGE_WORKER_FRAMES = {
    # negative positions
    "prefill start_positions<0": _plan_frame(_batch_body(PrefillBatch, start_positions=pack([-1], I32))),
    "prelude positions<0": _plan_frame(_batch_body(PreludeBatch, positions=pack([-1], I32))),
    "recurrent positions<0": _plan_frame(_batch_body(RecurrentBatch, positions=pack([I32_MIN], I32))),
    "finalize positions<0": _plan_frame(_batch_body(FinalizeBatch, positions=pack([-5], I32))),
    "coda positions<0": _plan_frame(_batch_body(CodaBatch, positions=pack([-1], I32))),
    # other minimums
    "prefill query_lens=0": _plan_frame(_batch_body(PrefillBatch, query_lens=pack([0], I32),
                                                    token_ids=b"")),
    "prefill query_lens<0": _plan_frame(_batch_body(PrefillBatch, query_lens=pack([-3], I32))),
    "prefill token_ids != sum(query_lens)": _plan_frame(_batch_body(PrefillBatch, token_ids=pack([1, 2], I32))),
    "prefill token_ids<0": _plan_frame(_batch_body(PrefillBatch, token_ids=pack([1, -2, 3], I32))),
    "prelude token_ids<-1": _plan_frame(_batch_body(PreludeBatch, token_ids=pack([-2], I32))),
    "recurrent first_depths=0": _plan_frame(_batch_body(RecurrentBatch, first_depths=pack([0], I32))),
    "recurrent num_loops=0": _plan_frame(_batch_body(RecurrentBatch, num_loops=pack([0], I32))),
    "decode unknown exit test": _plan_frame(_batch_body(DecodeBatch, exit_test=9)),
    "decode max_passes=0": _plan_frame(_batch_body(DecodeBatch, max_passes=0)),
    "decode depths<0": _plan_frame(_batch_body(DecodeBatch, depths=pack([-1], I32))),
    "decode min_loops=0": _plan_frame(_batch_body(DecodeBatch, min_loops=pack([0], I32))),
    "decode max_loops<min_loops": _plan_frame(_batch_body(DecodeBatch, max_loops=pack([0], I32))),
    "finalize exit_depths=0": _plan_frame(_batch_body(FinalizeBatch, exit_depths=pack([0], I32))),
    "coda sample_indices<-1": _plan_frame(_batch_body(CodaBatch, sample_indices=pack([-2], I32))),
    "coda exit_depths=0": _plan_frame(_batch_body(CodaBatch, exit_depths=pack([0], I32))),
    "block_appends num_new<0": frame(["ExecutionPlan", 1, [], [pack([1], I64), pack([1], I64),
                                                             pack([-1], I32), b""]]),
    "block_appends block_ids<0": frame(["ExecutionPlan", 1, [], [pack([1], I64), pack([1], I64),
                                                               pack([1], I32), pack([-1], I32)]]),
    # columns of mismatched lengths
    "recurrent keys 2 rows, others 1": _plan_frame(_batch_body(RecurrentBatch, keys=pack([1, 2], I64))),
    "coda seeds 0 rows": _plan_frame(_batch_body(CodaBatch, seeds=b"")),
    "prefill generations 2 rows": _plan_frame(_batch_body(PrefillBatch, generations=pack([1, 2], I64))),
    "releases mismatched": frame(["ExecutionPlan", 1, [], [], [], [pack([1, 2], I64), pack([1], I64)]]),
    "block_appends mismatched": frame(["ExecutionPlan", 1, [], [pack([1], I64), pack([1], I64),
                                                              pack([0, 0], I32)]]),
    # byte length not a multiple of the itemsize
    "recurrent keys 7 bytes": _plan_frame(_batch_body(RecurrentBatch, keys=b"\x00" * 7)),
    "prelude seeds 9 bytes": _plan_frame(_batch_body(PreludeBatch, seeds=b"\x00" * 9)),
    "prefill token_ids 13 bytes": _plan_frame(_batch_body(PrefillBatch, token_ids=b"\x00" * 13)),
    "block_ids 3 bytes (ragged)": frame(["ExecutionPlan", 1, [], [b"", b"", b"", b"\x00" * 3]]),
    "releases keys 5 bytes": frame(["ExecutionPlan", 1, [], [], [], [b"\x00" * 5, b""]]),
}
OUT_OF_RANGE_RESULT_FRAMES = {
    "step result mismatched": frame(["StepResult", 1, pack([1, 2], I64), pack([1], I64)]),
    "step result exit_states 12 bytes": frame(["StepResult", 1, b"", b"", b"", b"", b"\x00" * 12]),
}
OUT_OF_RANGE_CLIENT_FRAMES = {
    "max_tokens=0": _params_frame(max_tokens=0),
    "max_tokens<0": _params_frame(max_tokens=-4),
    "min_loops>max_loops": _params_frame(min_loops=4, max_loops=3),
    "min_loops=0": _params_frame(min_loops=0),
    "top_p=0": _params_frame(top_p=0.0),
    "top_p>1": _params_frame(top_p=1.5),
    "top_p nan": _params_frame(top_p=math.nan),
    "top_k=0": _params_frame(top_k=0),
    "top_k=-2": _params_frame(top_k=-2),
    "temperature<0": _params_frame(temperature=-0.1),
    "temperature inf": _params_frame(temperature=math.inf),
    "temperature nan": _params_frame(temperature=math.nan),
    "seed<0": _params_frame(seed=-1),
    "logprobs=2": _params_frame(logprobs=2),
    "exit_threshold<0": _params_frame(exit_threshold=-0.5),
    "exit_threshold nan": _params_frame(exit_threshold=math.nan),
    "exit_depths length": _params_frame(max_tokens=3, exit_depths=[1, 2]),
    "stop_token_ids<0": _params_frame(stop_token_ids=[3, -1]),
    "unknown field in GenerateRequest": frame({"type": "GenerateRequest", "request_id": "r", "promtp": "x"}),
    "unknown field in SamplingParams": _params_frame(max_token=5),
    "unknown field in AbortRequest": frame({"type": "AbortRequest", "request_id": "r", "force": True}),
    "unknown field in HealthRequest": frame({"type": "HealthRequest", "verbose": True}),
    "unknown field in Keepalive": frame({"type": "Keepalive", "sent_at": 1.0, "x": 1}),
}


@pytest.mark.parametrize("name", list(OUT_OF_RANGE_WORKER_FRAMES))
def test_out_of_range_plans(name: str) -> None:
    with pytest.raises(ProtocolError):
        worker_side_codec().decode(OUT_OF_RANGE_WORKER_FRAMES[name])


@pytest.mark.parametrize("name", list(OUT_OF_RANGE_RESULT_FRAMES))
def test_out_of_range_results(name: str) -> None:
    with pytest.raises(ProtocolError):
        engine_worker_codec().decode(OUT_OF_RANGE_RESULT_FRAMES[name])


@pytest.mark.parametrize("name", list(OUT_OF_RANGE_CLIENT_FRAMES))
def test_out_of_range_client_requests(name: str) -> None:
    with pytest.raises(ProtocolError):
        frontend_codec().decode(OUT_OF_RANGE_CLIENT_FRAMES[name])


def test_tampering_helpers_produce_valid_frames_when_untouched() -> None:
    """The raw-body builders above are sound: without overrides they decode."""
    for batch_type in STAGE_BATCHES:
        plan = worker_side_codec().decode(_plan_frame(_batch_body(batch_type)))
        assert type(plan.batches[0]) is batch_type
    request = frontend_codec().decode(_params_frame(max_tokens=3, min_loops=2, max_loops=2, top_p=0.5))
    assert request.params == SamplingParams(max_tokens=3, min_loops=2, max_loops=2, top_p=0.5)


def test_deeply_nested_unknown_field_is_a_protocol_error() -> None:
    """Skipping an unknown value must not leak RecursionError (a ~100 kB frame, well under the limit)."""
    deep = b"\x91" * 100_000 + b"\xc0"
    body = (b"\x83" + msgspec.msgpack.encode("type") + msgspec.msgpack.encode("KeepaliveAck")
            + msgspec.msgpack.encode("extra") + deep + msgspec.msgpack.encode("sent_at")
            + msgspec.msgpack.encode(1.0))
    with pytest.raises(ProtocolError):
        client_codec().decode(HEADER + body)
    with pytest.raises(ProtocolError):  # array_like: extra trailing element
        worker_side_codec().decode(HEADER + b"\x93" + msgspec.msgpack.encode("Heartbeat")
                                   + msgspec.msgpack.encode(1.0) + deep)


@pytest.mark.parametrize("codec_factory,limit", [
    (worker_side_codec, DEFAULT_MAX_FRAME_BYTES),
    (engine_worker_codec, DEFAULT_MAX_FRAME_BYTES),
    (frontend_codec, CLIENT_MAX_FRAME_BYTES),
    (client_codec, CLIENT_MAX_FRAME_BYTES),
], ids=CODEC_IDS)
def test_oversized_frames(codec_factory: Any, limit: int) -> None:
    codec = codec_factory()
    assert codec.max_frame_bytes == limit
    with pytest.raises(ProtocolError, match="exceeds"):
        codec.decode(HEADER + b"\x00" * (limit + 1 - len(HEADER)))


def test_oversized_valid_message_is_refused_and_limit_is_inclusive() -> None:
    big = frontend_codec().encode(GenerateRequest(request_id="r", prompt="x" * (CLIENT_MAX_FRAME_BYTES + 10)))
    with pytest.raises(ProtocolError, match="exceeds"):
        frontend_codec().decode(big)
    message = Heartbeat(sent_at=2.0)
    encoded = worker_side_codec().encode(message)
    assert Codec(WorkerInbound, max_frame_bytes=len(encoded)).decode(encoded) == message
    with pytest.raises(ProtocolError):
        Codec(WorkerInbound, max_frame_bytes=len(encoded) - 1).decode(encoded)


MINIMAL = {
    worker_side_codec: Heartbeat(sent_at=1.0),
    engine_worker_codec: StepResult(step_id=1),
    frontend_codec: Keepalive(sent_at=1.0),
    client_codec: KeepaliveAck(sent_at=1.0),
}


@pytest.mark.parametrize("version", [0, PROTOCOL_VERSION + 1, 65535])
@pytest.mark.parametrize("codec_factory", CODECS, ids=CODEC_IDS)
def test_wrong_protocol_version_names_both_versions(codec_factory: Any, version: int) -> None:
    codec = codec_factory()
    body = codec.encode(MINIMAL[codec_factory])[len(HEADER) :]
    with pytest.raises(ProtocolError) as info:
        codec.decode(struct.pack("<2sH", b"RL", version) + body)
    text = str(info.value)
    assert re.search(rf"\b{version}\b", text), text
    assert re.search(rf"\b{PROTOCOL_VERSION}\b", text), text


@pytest.mark.parametrize("magic", [b"XX", b"rl", b"LR", b"\x00\x00", b"\x80\x04"])
@pytest.mark.parametrize("codec_factory", CODECS, ids=CODEC_IDS)
def test_bad_magic(codec_factory: Any, magic: bytes) -> None:
    codec = codec_factory()
    valid = codec.encode(MINIMAL[codec_factory])
    assert codec.decode(valid) == MINIMAL[codec_factory]
    with pytest.raises(ProtocolError, match="magic"):
        codec.decode(magic + valid[2:])


def test_a_pickle_is_not_a_frame() -> None:
    import pickle

    for codec_factory in CODECS:
        with pytest.raises(ProtocolError):
            codec_factory().decode(pickle.dumps(Heartbeat(sent_at=1.0)))
        with pytest.raises(ProtocolError):
            codec_factory().decode(HEADER + pickle.dumps({"type": "Keepalive"}))


def test_protocol_error_survives_and_codec_is_reusable() -> None:
    codec = frontend_codec()
    for bad in (b"", b"RL", HEADER, HEADER + b"\xc1", frame({"type": "Bogus"})):
        with pytest.raises(ProtocolError):
            codec.decode(bad)
    assert codec.decode(codec.encode(AbortRequest(request_id="x"))) == AbortRequest(request_id="x")


# --------------------------------------------------------------------------- 3. never pickles


class _Custom:
    touched = False

    def __reduce__(self) -> Any:
        _Custom.touched = True
        raise AssertionError("the codec tried to pickle")

    def __getstate__(self) -> Any:
        _Custom.touched = True
        raise AssertionError("the codec tried to pickle")


@pytest.mark.parametrize("obj", [
    {1, 2}, frozenset(), {"type": "Heartbeat", "sent_at": 1.0}, ["Heartbeat", 1.0], 3, "x", b"x", None,
    _Custom(), np.arange(3), np.int64(3), np.float32(1.0),
    SamplingOptions(), SamplingParams(), ModelInfo, Admit(key=1, generation=1),
    SlotKeys(), RecurrentBatch(), WorkerHealth(index=0, alive=True, kv_blocks_total=1, kv_blocks_used=0, running=0),
    # protocol messages holding things that are not plain values
    ExecutionPlan(step_id=np.int64(1)),
    ExecutionPlan(step_id=1, admits=[Admit(key=np.int64(1), generation=0)]),
    RequestOutput(request_id="r", token_ids=np.arange(2)),
    Heartbeat(sent_at=_Custom()),
    Shutdown(reason=_Custom()),
], ids=lambda o: type(o).__name__)
@pytest.mark.parametrize("codec_factory", CODECS, ids=CODEC_IDS)
def test_encoding_a_non_message_raises(codec_factory: Any, obj: Any) -> None:
    _Custom.touched = False
    with pytest.raises(TypeError):
        codec_factory().encode(obj)
    assert not _Custom.touched


# --------------------------------------------------------------------------- 4. no torch


def test_import_protocol_does_not_import_torch() -> None:
    result = subprocess.run(
        [sys.executable, "-c", "import protocol, sys; assert 'torch' not in sys.modules"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr


# --------------------------------------------------------------------------- 5. columnar size


def test_256_row_recurrent_plan_is_columnar() -> None:
    rows = 256
    batch = RecurrentBatch(
        keys=pack(np.arange(rows) + 10**12, I64),
        generations=pack(np.arange(rows) + 10**9, I64),
        positions=pack(np.arange(rows) + 100_000, I32),
        first_depths=pack(np.full(rows, 3), I32),
        num_loops=pack(np.full(rows, 2), I32),
    )
    plan = ExecutionPlan(step_id=1, batches=[batch])
    codec = worker_side_codec()
    encoded = codec.encode(plan)
    assert len(encoded) < rows * 40, len(encoded)
    # 28 bytes of columns per row, and little else
    assert len(encoded) < rows * (8 + 8 + 4 + 4 + 4) + 200, len(encoded)
    decoded = codec.decode(encoded)
    assert decoded == plan and decoded.batches[0].num_rows == rows
    np.testing.assert_array_equal(decoded.batches[0].col("positions"), np.arange(rows) + 100_000)


def test_256_row_decode_plan_is_columnar() -> None:
    """The decode hot path: a DecodeBatch of 256 rows costs its 64 bytes of columns per row."""
    rows = 256
    ints = pack(np.full(rows, 3), I32)
    batch = DecodeBatch(
        keys=pack(np.arange(rows) + 10**12, I64), generations=pack(np.arange(rows) + 10**9, I64),
        positions=pack(np.arange(rows) + 100_000, I32), depths=ints, exited=pack(np.zeros(rows), I32),
        exit_states=pack(np.full(rows, 0.5), F64), output_indices=ints, seeds=pack(np.arange(rows), U64),
        min_loops=pack(np.ones(rows), I32), max_loops=pack(np.full(rows, 4), I32),
        thresholds=pack(np.full(rows, 0.7), F64), continues=pack(np.zeros(rows), I32), max_passes=16,
    )
    codec = worker_side_codec()
    encoded = codec.encode(ExecutionPlan(step_id=1, batches=[batch]))
    assert len(encoded) < rows * (8 + 8 + 4 * 3 + 8 + 4 + 8 + 4 * 2 + 8 + 4) + 200, len(encoded)
    assert codec.decode(encoded).batches[0] == batch


def test_planned_depths_must_fit_their_rows() -> None:
    """PLANNED needs one count per row, and the depths must be as many as the counts say, each ≥ 1."""
    def batch(exit_test: ExitTest, num_planned: list[int], depths: list[int]) -> DecodeBatch:
        return DecodeBatch(keys=pack([7, 8], I64), generations=pack([1, 1], I64), positions=pack([3, 4], I32),
                           depths=pack([0, 0], I32), exited=pack([0, 0], I32), exit_states=pack([1.0, 1.0], F64),
                           output_indices=pack([1, 2], I32), seeds=pack([5, 6], U64), min_loops=pack([1, 1], I32),
                           max_loops=pack([4, 4], I32), thresholds=pack([0.0, 0.0], F64),
                           continues=pack([0, 0], I32), exit_test=exit_test, num_planned=pack(num_planned, I32),
                           planned_depths=pack(depths, I32))

    assert batch(ExitTest.PLANNED, [2, 1], [3, 1, 4]).col("planned_depths").tolist() == [3, 1, 4]
    assert batch(ExitTest.OURO, [], []).num_rows == 2  # a device test may leave them out
    with pytest.raises(ValueError, match="num_planned"):
        batch(ExitTest.PLANNED, [], [])
    with pytest.raises(ValueError, match="num_planned"):
        batch(ExitTest.OURO, [1], [2])
    with pytest.raises(ValueError, match="planned_depths length"):
        batch(ExitTest.PLANNED, [2, 1], [3, 1])
    with pytest.raises(ValueError, match="planned_depths"):
        batch(ExitTest.PLANNED, [1, 1], [3, 0])
