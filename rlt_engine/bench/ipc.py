"""rlt-bench ipc: what one engine step pays for the process boundary (SPEC §6).

For N rows (default 0, 1, 64, 256), the median (and p90) over many steps of:

    compute      Worker.execute(plan), called directly: no codec, no IPC
    workers=0    InprocExecutor.submit + collect: compute + encode/decode of the plan and the result
    workers=1    MultiprocExecutor.submit + collect: the same + a round trip to a worker process over ipc://
    pipelined    the same two with two plans in flight (max_plans_in_flight = 2): each step submits
                 plan i + 1, then collects plan i's result, so the worker computes while the
                 result and the next plan cross (--pipelined, on by default)
    floor        a raw pyzmq PAIR ping-pong over ipc:// between two processes, the plan's bytes one
                 way and the result's bytes back (blocking recv, no decoding); the echo process
                 busy-waits the median compute time before answering, and that time is subtracted
    polled floor the same with both ends waiting in zmq.Poller, as the executor and the worker must

The plan is one DecodeBatch of N rows, the decode hot path: one loop pass at position 0 of N open
slots of toy-ouro (hidden 64, float32, CPU, one torch thread by default) and Ouro's exit test, which
no row passes (min_loops = D), so each row reports its exit state. The model is real but tiny, so
`workers=1 − workers=0` is the IPC's cost, to be read beside the floors. N = 0 is an empty plan
(no slot ops, no batches): a runner that does no math at all, the fixed cost of one step.

    rlt-bench ipc [--rows 0,1,64,256] [--steps 300] [--warmup 50] [--threads 1] [--[no-]pipelined] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from functools import partial

import msgspec
import zmq

from protocol import config_hash, engine_worker_codec, worker_side_codec
from protocol.columns import F64, I32, I64, U64, pack
from protocol.messages import (
    PROTOCOL_VERSION,
    Admit,
    BlockAppends,
    DecodeBatch,
    ExecutionPlan,
    ExitTest,
    PrefillBatch,
    SlotKeys,
    StepResult,
    WorkerHello,
)
from rlt_engine.config import EngineConfig
from rlt_engine.executor.inproc import InprocExecutor
from rlt_engine.executor.multiproc import MultiprocExecutor

MAX_ROWS = 256
DEPTH = 4  # toy-ouro's D
BLOCK = 25  # steps one way runs before the next takes its turn

_ECHO_SERVER = """
import os, sys, time, zmq
ctx = zmq.Context(); sock = ctx.socket(zmq.PAIR); sock.connect(sys.argv[1])
reply, polled, parent = bytes(int(sys.argv[2])), sys.argv[3] == "poll", os.getppid()
work_s = float(sys.argv[4])  # busy for as long as the worker computes, then answer
sock.rcvtimeo = 1000  # wake once a second to notice a dead parent
poller = zmq.Poller(); poller.register(sock, zmq.POLLIN)
while os.getppid() == parent:
    if polled and not poller.poll(1000):
        continue
    try:
        frame = sock.recv()
    except zmq.Again:
        continue
    if frame == b"stop":
        break
    end = time.perf_counter() + work_s
    while time.perf_counter() < end:
        pass
    sock.send(reply)
sock.close(0); ctx.term()
"""


def _config() -> EngineConfig:
    # Distinct blocks for every slot's planes (256 slots × 4 planes), so nothing aliases.
    return EngineConfig(
        model="toy-ouro", workers=1, device="cpu", dtype="float32", max_num_seqs=MAX_ROWS,
        max_num_batched_tokens=2048, num_blocks=MAX_ROWS * 8,
    ).resolved()


def setup_plan(rows: int, num_planes: int, step_id: int = 1) -> ExecutionPlan:
    """Open `rows` slots (keys 1…rows), one block per plane each, and prefill one token each."""
    keys = list(range(1, rows + 1))
    return ExecutionPlan(
        step_id=step_id,
        admits=[Admit(k, 1) for k in keys],
        block_appends=BlockAppends(
            keys=pack(keys, I64), generations=pack([1] * rows, I64), num_new=pack([1] * rows, I32),
            block_ids=pack(range(rows * num_planes), I32),
        ),
        batches=[PrefillBatch(
            keys=pack(keys, I64), generations=pack([1] * rows, I64), start_positions=pack([0] * rows, I32),
            query_lens=pack([1] * rows, I32), seeds=pack([0] * rows, U64), token_ids=pack([65] * rows, I32),
        )],
    )


def step_plan(rows: int, step_id: int) -> ExecutionPlan:
    """One decode pass at position 0 of every open slot, which does not exit (0 rows: an empty plan)."""
    if rows == 0:
        return ExecutionPlan(step_id=step_id)
    ints = partial(pack, dtype=I32)
    return ExecutionPlan(step_id=step_id, batches=[DecodeBatch(
        keys=pack(range(1, rows + 1), I64), generations=pack([1] * rows, I64), positions=ints([0] * rows),
        depths=ints([0] * rows), exited=ints([0] * rows), exit_states=pack([1.0] * rows, F64),
        output_indices=ints([0] * rows), seeds=pack([0] * rows, U64), min_loops=ints([DEPTH] * rows),
        max_loops=ints([DEPTH] * rows), thresholds=pack([1.0] * rows, F64), continues=ints([0] * rows),
        exit_test=ExitTest.OURO, max_passes=1,
    )])


class DirectWorker:
    """The Worker called in-process with no codec at all, behind the executor's submit/collect."""

    def __init__(self, worker_config) -> None:
        from rlt_worker.worker import Worker

        self._worker = Worker(WorkerHello(protocol_version=PROTOCOL_VERSION, worker_index=0, config=worker_config,
                                          config_hash=config_hash(worker_config)))
        self._done: list = []

    def start(self) -> list:
        return [self._worker.start()]

    def submit(self, worker: int, plan: ExecutionPlan) -> None:
        self._done.extend((0, result) for result in self._worker.execute(plan))

    def collect(self, timeout: float | None = None) -> list:
        done, self._done = self._done, []
        return done

    def shutdown(self) -> None:
        self._worker.close()


class Pipelined:
    """An executor's steps with two plans in flight: submit plan i + 1, then collect plan i's result."""

    def __init__(self, executor) -> None:
        self._executor = executor
        self._in_flight = 0

    def step(self, plan: ExecutionPlan) -> None:
        self._executor.submit(0, plan)
        self._in_flight += 1
        while self._in_flight > 1:
            self._collect()

    def drain(self) -> None:
        while self._in_flight:
            self._collect()

    def _collect(self) -> None:
        for _, result in self._executor.collect(timeout=None):
            assert not result.error, result.error
            self._in_flight -= 1


def _one(executor, plan: ExecutionPlan) -> StepResult:
    executor.submit(0, plan)
    ((_, result),) = executor.collect(timeout=None)
    assert not result.error, result.error
    return result


def _open_slots(executor, rows: int, num_planes: int) -> None:
    if rows:
        _one(executor, setup_plan(rows, num_planes))


def _close_slots(executor, rows: int) -> None:
    if not rows:
        return
    keys = pack(range(1, rows + 1), I64)
    _one(executor, ExecutionPlan(step_id=10**6, releases=SlotKeys(keys=keys, generations=pack([1] * rows, I64))))


class PingPong:
    """A raw pyzmq PAIR round trip over ipc:// to an echo process: plan bytes out, result bytes back.

    `polled`: both ends wait in zmq.Poller before recv, as the executor and the worker do
    (they must: a death or a heartbeat has to wake the same wait), instead of a blocking recv.
    `work_s`: the echo process busy-waits this long before answering, as a worker computes,
    so that the floor pays the same wake-up of a caller that has been idle that long.
    """

    def __init__(self, plan_bytes: int, result_bytes: int, polled: bool = False, work_s: float = 0.0) -> None:
        self._directory = tempfile.mkdtemp(prefix="rlt-bench-")
        address = f"ipc://{self._directory}/pingpong.sock"
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PAIR)
        self._sock.linger = 0
        self._sock.bind(address)
        self._server = subprocess.Popen(
            [sys.executable, "-c", _ECHO_SERVER, address, str(result_bytes), "poll" if polled else "block",
             str(work_s)]
        )
        self._payload = bytes(plan_bytes)
        self._poller = zmq.Poller() if polled else None
        if self._poller is not None:
            self._poller.register(self._sock, zmq.POLLIN)

    def step(self, plan: ExecutionPlan | None = None) -> None:
        """One round trip (the plan only names the step; its bytes are stand-ins of the same size)."""
        self._sock.send(self._payload)
        if self._poller is not None:
            self._poller.poll()
        self._sock.recv()

    def close(self) -> None:
        self._sock.send(b"stop")
        self._server.wait(timeout=10)
        self._sock.close()
        self._ctx.term()
        shutil.rmtree(self._directory, ignore_errors=True)


def _frame_sizes(direct: DirectWorker, rows: int, num_planes: int) -> tuple[int, int]:
    """Bytes of one step's plan frame and of its result frame, as the codecs put them on the wire."""
    _open_slots(direct, rows, num_planes)
    plan = step_plan(rows, 2)
    result = _one(direct, plan)
    _close_slots(direct, rows)
    return len(engine_worker_codec().encode(plan)), len(worker_side_codec().encode(result))


def _stats(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {"median_us": statistics.median(ordered) * 1e6, "p90_us": ordered[int(0.9 * (len(ordered) - 1))] * 1e6}


def _median_compute(direct: DirectWorker, rows: int, samples: int = 30) -> float:
    """The direct worker's median step time, which the floors' echo process then spends busy."""
    times = []
    for i in range(samples):
        start = time.perf_counter()
        _one(direct, step_plan(rows, 10**5 + i))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(rows_list: Sequence[int], steps: int, warmup: int, threads: int = 1, pipelined: bool = True) -> list[dict]:
    """Every measurement for every row count; one dict per row count.

    The four ways take turns in blocks of BLOCK steps, so a load spike from another process
    hits all of them alike, while one way's idle-spinning OpenMP threads rarely overlap another's.
    """
    worker_config = msgspec.structs.replace(_config().worker_config("cpu"), num_threads=threads)
    direct = DirectWorker(worker_config)
    num_planes = direct.start()[0].num_planes
    inproc = InprocExecutor(worker_config)
    inproc.start()
    multi = MultiprocExecutor(_config(), num_threads=threads)
    multi.start()
    executors = {"compute": direct, "workers0": inproc, "workers1": multi}
    results = []
    try:
        for rows in rows_list:
            plan_bytes, result_bytes = _frame_sizes(direct, rows, num_planes)
            for executor in executors.values():
                _open_slots(executor, rows, num_planes)
            work_s = _median_compute(direct, rows)
            floors = {"floor": PingPong(plan_bytes, result_bytes, work_s=work_s),
                      "floor_poll": PingPong(plan_bytes, result_bytes, polled=True, work_s=work_s)}
            runners = {name: partial(_one, executor) for name, executor in executors.items()}
            pipes = {f"{name}_pipelined": Pipelined(executors[name]) for name in ("workers0", "workers1") if pipelined}
            runners |= {name: pipe.step for name, pipe in pipes.items()}
            runners |= {name: floor.step for name, floor in floors.items()}
            times: dict[str, list[float]] = {name: [] for name in runners}
            for block in range(0, warmup + steps, BLOCK):
                for name, run_step in runners.items():
                    for i in range(block, min(block + BLOCK, warmup + steps)):
                        plan = step_plan(rows, 2 + i)
                        start = time.perf_counter()
                        run_step(plan)
                        elapsed = time.perf_counter() - start
                        if i >= warmup:
                            times[name].append(elapsed)
                    if name in pipes:
                        pipes[name].drain()  # the next way starts from an idle worker
            for floor in floors.values():
                floor.close()
            for executor in executors.values():
                _close_slots(executor, rows)
            entry = {"rows": rows, "plan_bytes": plan_bytes, "result_bytes": result_bytes,
                     "floor_work_us": work_s * 1e6}
            entry |= {name: _stats(values) for name, values in times.items()}
            results.append(entry)
            print(_row_text(entry), flush=True)
    finally:
        multi.shutdown()
        inproc.shutdown()
        direct.shutdown()
    return results


COLUMNS = ("compute", "workers0", "workers1")
HEADER = (
    "| rows | plan B | result B | compute µs | workers=0 µs | workers=1 µs | w1 − w0 µs | floor − work µs | "
    "polled floor − work µs | pipelined w0 µs | pipelined w1 µs | pipelined w1 − w0 µs |"
    "\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def _row_text(e: dict) -> str:
    med = {k: e[k]["median_us"] for k in (*COLUMNS, "floor", "floor_poll")}
    cells = [e["rows"], e["plan_bytes"], e["result_bytes"], *(f"{med[k]:.0f}" for k in COLUMNS)]
    cells += [f"{med['workers1'] - med['workers0']:.0f}", f"{med['floor'] - e['floor_work_us']:.0f}",
              f"{med['floor_poll'] - e['floor_work_us']:.0f}"]
    if "workers0_pipelined" in e:
        w0, w1 = e["workers0_pipelined"]["median_us"], e["workers1_pipelined"]["median_us"]
        cells += [f"{w0:.0f}", f"{w1:.0f}", f"{w1 - w0:.0f}"]
    else:
        cells += ["—"] * 3
    return "| " + " | ".join(map(str, cells)) + " |"


def main(argv: Sequence[str] | None = None) -> int:
    """`rlt-bench ipc`: print a markdown table (medians) and optionally write every figure as JSON."""
    parser = argparse.ArgumentParser(prog="rlt-bench ipc", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="0,1,64,256", help="comma-separated row counts (0 = an empty plan)")
    parser.add_argument("--steps", type=int, default=300, help="timed steps per measurement")
    parser.add_argument("--warmup", type=int, default=50, help="untimed steps first")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads, in-process and in the worker (1 keeps OpenMP barriers of a shared "
                             "machine out of the figures)")
    parser.add_argument("--pipelined", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure both executors with two plans in flight")
    parser.add_argument("--json", default=None, help="write every figure (median and p90) here")
    args = parser.parse_args(argv)
    rows_list = [int(r) for r in args.rows.split(",")]
    if any(not 0 <= r <= MAX_ROWS for r in rows_list):
        parser.error(f"rows must be in 0 … {MAX_ROWS}")
    print(f"median of {args.steps} steps after {args.warmup} warm-up, toy-ouro float32, {args.threads} torch "
          f"thread(s), {len(os.sched_getaffinity(0))} CPU cores\n{HEADER}", flush=True)
    results = run(rows_list, args.steps, args.warmup, args.threads, args.pipelined)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
