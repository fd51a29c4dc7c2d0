"""MultiprocExecutor and the worker process, with real processes on the CPU (SPEC §6, §7).

Every test runs with its own short TMPDIR (ipc paths must fit a unix socket address) and
ends by checking that no process it started is left and no socket file remains.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import msgspec
import psutil
import pytest
import zmq
import zmq.auth

import rlt_engine.engine as engine_module
import rlt_engine.executor.multiproc as multiproc
from protocol import PROTOCOL_VERSION, config_hash, engine_worker_codec
from protocol.messages import ExecutionPlan, KeepaliveAck, StepResult, WorkerHello
from rlt_engine import LLM, EngineConfig, SamplingParams
from rlt_engine.errors import WorkerStartupError
from rlt_engine.executor import WorkerLost
from rlt_engine.executor.multiproc import MultiprocExecutor, RemoteWorker
from rlt_engine.executor.processes import remove_stale_dirs

log = logging.getLogger("test_multiproc")

PROMPTS = [[72, 101, 108, 108, 111], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [200, 17], [9] * 11]
# One torch thread a worker (tests/factories.py says why).
MODEL_OPTIONS = {"device": "cpu", "dtype": "float64", "exit_mode": "ouro", "cpu_threads": 1}


def _params(max_tokens: int = 8) -> list[SamplingParams]:
    """Greedy and seeded temperature-1 sampling, both with the Ouro gate at threshold 0.5."""
    greedy = {"max_tokens": max_tokens, "exit_threshold": 0.5, "temperature": 0.0}
    sampled = {"max_tokens": max_tokens, "exit_threshold": 0.5, "temperature": 1.0}
    return [
        SamplingParams(**greedy), SamplingParams(**sampled, seed=11),
        SamplingParams(**sampled, seed=12), SamplingParams(**greedy),
    ]


def _run(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[tuple[list[int], list[int]]]:
    params = (_params() * 3)[: len(prompts)]
    return [(o.token_ids, o.exit_depths) for o in llm.generate(prompts, params, use_tqdm=False)]


_reference_cache: dict[str, list] = {}


def _reference(kv_layout: str = "last_exited", prompts: list[list[int]] = PROMPTS) -> list:
    """The in-process (workers=0) outputs every multi-process run must equal."""
    key = f"{kv_layout}-{prompts!r}"
    if key not in _reference_cache:
        with LLM("toy-ouro", workers=0, kv_layout=kv_layout, **MODEL_OPTIONS) as llm:
            _reference_cache[key] = _run(llm, prompts)
    return _reference_cache[key]


def _is_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pids: list[int], limit_s: float) -> float | None:
    """Seconds until every pid is gone (a zombie counts as gone), or None after `limit_s`."""
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        if all(_is_gone(p) for p in pids):
            return time.monotonic() - start
        time.sleep(0.02)
    return None


def _kill_pids(pids: list[int]) -> None:
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            proc.kill()
            proc.wait(5)
        except (psutil.Error, ChildProcessError):
            pass


def _socket_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_socket()]


@pytest.fixture(autouse=True)
def isolated(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory):
    """A private short TMPDIR; afterwards no child process and no socket file may remain."""
    tmp_path_factory.getbasetemp()  # pytest's own temp root, made now: not inside `root`, which goes
    root = Path(tempfile.mkdtemp(prefix="rltt-", dir="/tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield root
    leftover = [p for p in me.children(recursive=True) if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE]
    _kill_pids([p.pid for p in leftover])  # only processes this test started
    sockets = _socket_files(root)
    entries = [e for e in root.iterdir() if e.name.startswith("rlt-")]  # executors' private directories
    monkeypatch.undo()
    shutil.rmtree(root, ignore_errors=True)
    assert not leftover, f"processes left behind: {[p.pid for p in leftover]}"
    assert not sockets, f"socket files left behind: {sockets}"
    assert not entries, f"files left behind: {entries}"


# ---------------------------------------------------------------------------------- equality


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kv_layout", ["last_exited", "shared"])
def test_workers_match_inprocess(kv_layout: str) -> None:
    expected = _reference(kv_layout)
    for workers in (1, 2):
        with LLM("toy-ouro", workers=workers, kv_layout=kv_layout, **MODEL_OPTIONS) as llm:
            assert _run(llm) == expected, f"workers={workers} differs from workers=0"


# ---------------------------------------------------------------------------------- bad input


def _bad_frames(count: int) -> list[bytes]:
    """Random bytes, truncated plans, wrong message types, other versions, bad magic, oversize."""
    rng = random.Random(7)
    codec = engine_worker_codec()
    plan = codec.encode(ExecutionPlan(step_id=3))
    header = b"RL" + struct.pack("<H", PROTOCOL_VERSION)
    makers = [
        lambda: bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 64))),
        lambda: plan[: rng.randrange(0, len(plan))],
        lambda: header + msgspec.msgpack.encode(StepResult(step_id=1)),  # a message workers never accept
        lambda: header + msgspec.msgpack.encode(KeepaliveAck(sent_at=1.0)),
        lambda: header + msgspec.msgpack.encode(rng.randrange(1000)),
        lambda: b"RL" + struct.pack("<H", PROTOCOL_VERSION + 1) + plan[4:],
        lambda: b"XX" + plan[2:],
        lambda: header + bytes(rng.getrandbits(8) for _ in range(40)),
    ]
    return [makers[i % len(makers)]() for i in range(count)]


@pytest.mark.timeout(90)
def test_cpu_threads_per_worker() -> None:
    """cpu_threads (--cpu-threads) sets each local CPU worker's torch threads; 0, the default, splits
    this process's cores among its local workers (at least 1 each). Nothing is spawned to tell."""
    cores = len(os.sched_getaffinity(0))
    for workers, threads, want in [(2, 0, max(1, cores // 2)), (1, 0, cores), (2, 3, 3)]:
        executor = MultiprocExecutor(EngineConfig(model="toy-ouro", workers=workers, device="cpu",
                                                  cpu_threads=threads))
        assert [c.num_threads for c in executor._configs] == [want] * workers
    with pytest.raises(ValueError, match="cpu_threads"):
        EngineConfig(cpu_threads=-1)


def test_malformed_frames_are_dropped_and_the_worker_keeps_serving() -> None:
    frames = _bad_frames(100)
    with LLM("toy-ouro", workers=1, **MODEL_OPTIONS) as llm:
        executor = llm.engine.executor
        handle = executor._handles[0]
        for frame in frames:
            handle.socket.send(frame)  # through the executor's own socket
        assert _run(llm) == _reference(), "the worker served wrong results after malformed frames"
        text = Path(handle.log_path).read_text()
        assert text.count("dropped a malformed frame") == 100, text[-2000:]
        assert executor.alive_workers() == [0]


@pytest.mark.timeout(60)
def test_protocol_version_mismatch_refuses_startup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(multiproc, "PROTOCOL_VERSION", PROTOCOL_VERSION + 98)
    with pytest.raises(WorkerStartupError) as err:
        LLM("toy-ouro", workers=1, **MODEL_OPTIONS)
    message = str(err.value)
    assert f"protocol version {PROTOCOL_VERSION + 98}" in message and f"speaks {PROTOCOL_VERSION}" in message, message
    assert "exited with code 3" in message, message


@pytest.mark.timeout(60)
def test_config_hash_mismatch_refuses_startup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(multiproc, "config_hash", lambda config: "0123456789abcdef")
    with pytest.raises(WorkerStartupError) as err:
        LLM("toy-ouro", workers=1, **MODEL_OPTIONS)
    message = str(err.value)
    assert "engine 0123456789abcdef" in message and f"worker {config_hash(_worker_config())}" in message, message


def _worker_config():
    executor = MultiprocExecutor(EngineConfig(model="toy-ouro", workers=1, **MODEL_OPTIONS))
    return executor._configs[0]


@pytest.mark.timeout(30)
def test_frame_of_another_version_ends_the_handshake(isolated: Path) -> None:
    """A hand-made hello whose header says version + 1: the worker names both versions and exits 3."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.linger = 0
    address = f"ipc://{isolated}/hand.sock"
    sock.bind(address)
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlt_worker.worker_process", "--connect", address, "--index", "0",
         "--parent-pid", str(os.getpid())],
        stderr=subprocess.PIPE, text=True,
    )
    try:
        config = _worker_config()
        hello = WorkerHello(protocol_version=PROTOCOL_VERSION, worker_index=0, config=config,
                            config_hash=config_hash(config))
        frame = engine_worker_codec().encode(hello)
        sock.send(b"RL" + struct.pack("<H", PROTOCOL_VERSION + 1) + frame[4:])
        _, stderr = proc.communicate(timeout=20)
    finally:
        proc.kill()
        proc.wait()
        sock.close()
        ctx.term()
        Path(address[len("ipc://") :]).unlink(missing_ok=True)
    assert proc.returncode == 3, stderr
    assert f"engine speaks protocol version {PROTOCOL_VERSION + 1}, this worker speaks {PROTOCOL_VERSION}" in stderr


@pytest.mark.timeout(60)
def test_worker_dying_during_startup_fails_promptly(tmp_path: Path) -> None:
    """A checkpoint directory the engine accepts (it has a config.json) but a worker cannot load."""
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no-such-family"}')
    start = time.monotonic()
    with pytest.raises(WorkerStartupError) as err:
        LLM(str(broken), workers=2, device="cpu", dtype="float64")
    elapsed = time.monotonic() - start
    log.info("startup failure reported after %.2f s", elapsed)
    message = str(err.value)
    assert "exited with code 1 during startup" in message and "no-such-family" in message, message
    assert elapsed < 30


def test_an_unknown_model_fails_before_any_worker_starts() -> None:
    with pytest.raises(ValueError, match="neither a built-in model .*tiny-ouro-py.* nor a checkpoint directory"):
        LLM("/nonexistent/model", workers=2, device="cpu", dtype="float64")


# ---------------------------------------------------------------------------------- engine death

_ENGINE_SCRIPT = textwrap.dedent("""
    import json, sys, time
    from rlt_engine import LLM, SamplingParams
    llm = LLM("toy-ouro", workers=2, device="cpu", dtype="float64")
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    print(json.dumps(sorted(llm.engine.executor.worker_pids().values())), flush=True)
    time.sleep(600)
""")


def _start_engine(tmpdir: Path) -> tuple[subprocess.Popen, list[int]]:
    env = dict(os.environ, TMPDIR=str(tmpdir))
    engine = subprocess.Popen([sys.executable, "-c", _ENGINE_SCRIPT], stdout=subprocess.PIPE, text=True, env=env)
    line = engine.stdout.readline()
    assert line, "the engine subprocess died before reporting its workers"
    return engine, json.loads(line)


def _assert_next_start_removes_stale_dir(root: Path) -> None:
    """A killed engine leaves its private directory; the next executor start removes it."""
    assert [p.name for p in root.glob("rlt-*")], "the killed engine left no directory to clean"
    remove_stale_dirs(str(root))
    assert not list(root.glob("rlt-*"))


@pytest.mark.timeout(90)
def test_workers_exit_when_the_engine_is_killed(isolated: Path) -> None:
    engine, pids = _start_engine(isolated)
    try:
        assert len(pids) == 2 and not any(_is_gone(p) for p in pids)
        engine.send_signal(signal.SIGKILL)
        elapsed = _wait_gone(pids, 2 * 3.0)
        log.info("workers gone %.3f s after SIGKILL of the engine", elapsed or -1)
        assert elapsed is not None, "workers outlived a killed engine by more than 6 s"
    finally:
        engine.kill()
        engine.wait()
        _kill_pids(pids)
    _assert_next_start_removes_stale_dir(isolated)


@pytest.mark.timeout(90)
def test_workers_exit_when_the_engine_is_stopped(isolated: Path) -> None:
    engine, pids = _start_engine(isolated)
    try:
        time.sleep(3.5)  # idle but alive: the heartbeat thread keeps its workers
        assert not any(_is_gone(p) for p in pids), "workers left an idle engine"
        engine.send_signal(signal.SIGSTOP)
        elapsed = _wait_gone(pids, 2 * 3.0)
        log.info("workers gone %.3f s after SIGSTOP of the engine", elapsed or -1)
        assert elapsed is not None, "workers outlived a stopped engine by more than 6 s"
        assert elapsed > 1.5, "workers left before the heartbeat deadline"
    finally:
        engine.send_signal(signal.SIGCONT)
        engine.kill()
        engine.wait()
        _kill_pids(pids)
    _assert_next_start_removes_stale_dir(isolated)


@pytest.mark.timeout(240)
def test_a_plan_longer_than_worker_timeout_is_not_a_hang() -> None:
    """A real long plan (a 400-token prompt prefilled through 16 loops in one chunk, float64 on
    the CPU) outlasts worker_timeout; the worker's heartbeats while busy keep it from being killed."""
    config = EngineConfig(model="toy-ouro", workers=1, worker_timeout=2.0, max_loops=16, num_blocks=1024,
                          prefill_chunk_size=512, **MODEL_OPTIONS)
    engine = engine_module.LLMEngine(config)
    try:
        engine.add_request("long prefill", list(range(1, 201)) * 2, SamplingParams(max_tokens=2, seed=0))
        longest, outputs = 0.0, []
        while not (outputs and outputs[-1].finished):
            start = time.monotonic()
            outputs = engine.step()
            longest = max(longest, time.monotonic() - start)
        log.info("longest step %.2f s against worker_timeout %.1f s", longest, config.worker_timeout)
        assert outputs[-1].finish_reason == "length", outputs[-1]
        assert not engine.is_dead and engine.num_worker_restarts == 0
        assert longest > config.worker_timeout, f"the longest step took {longest:.2f} s: it proves nothing"
    finally:
        engine.close()


# ---------------------------------------------------------------------------------- resources


@pytest.mark.timeout(150)
def test_start_close_cycles_leak_nothing(isolated: Path) -> None:
    me = psutil.Process()
    samples = []
    for _ in range(6):
        llm = LLM("toy-ouro", workers=2, **MODEL_OPTIONS)
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
        llm.close()
        samples.append((me.num_fds(), me.num_threads(), len(me.children(recursive=True)),
                        len(_socket_files(isolated)), len(list(isolated.glob("rlt-*")))))
    log.info("fds, threads, children, socket files, dirs after each cycle: %s", samples)
    baseline = samples[1]
    for cycle, sample in enumerate(samples[2:], start=3):
        assert all(now <= then for now, then in zip(sample, baseline, strict=True)), (cycle, samples)
    assert samples[-1][2:] == (0, 0, 0)


# ---------------------------------------------------------------------------------- tcp workers


def _free_port_pair() -> int:
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    raise RuntimeError("no two adjacent free ports")


def _remote_worker(port: int, server_key: Path, worker_key: Path, hello_timeout: float = 30) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "rlt_worker.worker_process", "--connect", f"tcp://127.0.0.1:{port}",
         "--curve-server-key", str(server_key), "--curve-key", str(worker_key), "--hello-timeout", str(hello_timeout)],
        stderr=subprocess.PIPE, text=True,
    )


@pytest.fixture
def keys(isolated: Path) -> dict[str, Path]:
    directory = isolated / "keys"
    directory.mkdir()
    for name in ("engine", "worker", "intruder"):
        zmq.auth.create_certificates(str(directory), name)
    return {name: directory / f"{name}.key" for name in ("engine", "worker", "intruder")} | {
        f"{name}_secret": directory / f"{name}.key_secret" for name in ("engine", "worker", "intruder")
    }


@pytest.mark.timeout(90)
def test_tcp_worker_with_curve_serves(monkeypatch: pytest.MonkeyPatch, keys: dict[str, Path]) -> None:
    expected = _reference()
    port = _free_port_pair()
    remote = RemoteWorker(f"tcp://127.0.0.1:{port}", str(keys["engine_secret"]), (str(keys["worker"]),))
    monkeypatch.setattr(engine_module, "make_executor", lambda config: MultiprocExecutor(config, remote=remote))
    worker = _remote_worker(port, keys["engine"], keys["worker_secret"])
    try:
        with LLM("toy-ouro", workers=1, **MODEL_OPTIONS) as llm:
            assert llm.engine.executor.worker_pids() == {}  # nothing local: the only worker is remote
            assert _run(llm) == expected
        _, stderr = worker.communicate(timeout=10)
        assert worker.returncode == 0, stderr  # it got the Shutdown
    finally:
        worker.kill()
        worker.wait()


@pytest.mark.timeout(60)
def test_tcp_worker_with_a_wrong_key_is_refused(keys: dict[str, Path]) -> None:
    port = _free_port_pair()
    remote = RemoteWorker(f"tcp://127.0.0.1:{port}", str(keys["engine_secret"]), (str(keys["worker"]),))
    intruder = _remote_worker(port, keys["engine"], keys["intruder_secret"], hello_timeout=4)
    wrong_server = _remote_worker(port, keys["intruder"], keys["worker_secret"], hello_timeout=4)
    try:
        config = EngineConfig(model="toy-ouro", workers=1, **MODEL_OPTIONS)
        executor = MultiprocExecutor(config, remote=remote, startup_timeout=3)
        with pytest.raises(WorkerStartupError, match="remote worker 0 never connected"):
            executor.start()
        executor.shutdown()
        _, intruder_err = intruder.communicate(timeout=15)
        _, wrong_server_err = wrong_server.communicate(timeout=15)
    finally:
        for proc in (intruder, wrong_server):
            proc.kill()
            proc.wait()
    assert intruder.returncode == 3 and "refused this worker's CURVE key" in intruder_err, intruder_err
    assert wrong_server.returncode == 3, wrong_server_err


# ---------------------------------------------------------------------------------- worker death


@pytest.mark.timeout(120)
def test_killed_worker_is_reported_fast_and_its_requests_complete_exactly() -> None:
    """SIGKILL one of two workers mid-generation: WorkerLost within 2 × 1 s, then exact replays."""
    prompts = PROMPTS * 2
    expected = _reference(prompts=prompts)
    with LLM("toy-ouro", workers=2, **MODEL_OPTIONS) as llm:
        engine, executor = llm.engine, llm.engine.executor
        losses: list[tuple[float, WorkerLost]] = []
        collect = executor.collect

        def recording_collect(timeout: float | None = None):
            events = collect(timeout)
            losses.extend((time.monotonic(), e) for _, e in events if isinstance(e, WorkerLost))
            return events

        executor.collect = recording_collect
        for i, (prompt, params) in enumerate(zip(prompts, _params(8) * 2, strict=True)):
            engine.add_request(f"r{i}", prompt, params)
        outputs: dict[str, object] = {}
        replays, killed_at = 0, None
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    outputs[output.request_id] = output
            on_victim = [r for r in engine.scheduler.running[1] if r.output_token_ids]
            if killed_at is None and len(on_victim) >= 3:
                replays = len(on_victim)  # each has delivered tokens: each is a depth-faithful replay
                os.kill(executor.worker_pids()[1], signal.SIGKILL)
                killed_at = time.monotonic()
        assert killed_at is not None and replays >= 3
        assert len(losses) == 1 and "SIGKILL" in losses[0][1].reason and losses[0][1].worker == 1
        detection = losses[0][0] - killed_at
        log.info("WorkerLost(%s) %.3f s after SIGKILL; %d requests replayed", losses[0][1].reason, detection, replays)
        assert detection < 2 * 1.0
        assert executor.alive_workers() == [0]
        got = [(outputs[f"r{i}"].token_ids, outputs[f"r{i}"].exit_depths) for i in range(len(prompts))]
        assert got == expected


@pytest.mark.timeout(120)
def test_restart_replaces_a_killed_worker() -> None:
    """restart_workers=True: the engine asks the executor for a replacement and finishes exactly."""
    expected = _reference()
    with LLM("toy-ouro", workers=1, restart_workers=True, **MODEL_OPTIONS) as llm:
        engine, executor = llm.engine, llm.engine.executor
        for i, (prompt, params) in enumerate(zip(PROMPTS, _params(8), strict=True)):
            engine.add_request(f"r{i}", prompt, params)
        outputs = {}
        first_pid = executor.worker_pids()[0]
        killed = False
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    outputs[output.request_id] = output
            if not killed and any(r.output_token_ids for r in engine.scheduler.running[0]):
                os.kill(first_pid, signal.SIGKILL)
                killed = True
        assert killed and executor.alive_workers() == [0] and executor.worker_pids()[0] != first_pid
        assert _is_gone(first_pid)
        assert [(outputs[f"r{i}"].token_ids, outputs[f"r{i}"].exit_depths) for i in range(len(PROMPTS))] == expected


@pytest.mark.timeout(120)
def test_a_replacement_worker_starts_with_an_empty_prefix_cache() -> None:
    """Prompts sharing a two-block prefix, prefix caching on: SIGKILL the only worker once its cache
    holds blocks and a request has tokens. The engine drops that worker's cache index, so the replays
    recompute their prefixes in the replacement's empty pool (hits on the old index would read blocks
    it never wrote) and every output equals an in-process run without caching."""
    prefix = [(7 * i) % 251 for i in range(40)]
    prompts = [prefix + [i + 1] * (i + 2) for i in range(4)]
    with LLM("toy-ouro", workers=0, enable_prefix_caching=False, **MODEL_OPTIONS) as llm:
        expected = _run(llm, prompts)
    with LLM("toy-ouro", workers=1, restart_workers=True, **MODEL_OPTIONS) as llm:
        engine, executor = llm.engine, llm.engine.executor
        for i, (prompt, params) in enumerate(zip(prompts, _params(8), strict=True)):
            engine.add_request(f"r{i}", prompt, params)
        first_pid, old_kv, outputs, killed = executor.worker_pids()[0], engine.kv_managers[0], {}, False
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    outputs[output.request_id] = output
            has_tokens = any(r.output_token_ids for r in engine.scheduler.running[0])
            if not killed and old_kv.num_cached_blocks and has_tokens:
                os.kill(first_pid, signal.SIGKILL)
                killed = True
        assert killed and _is_gone(first_pid) and engine.scheduler.stats.num_replays >= 1
        assert engine.kv_managers[0] is not old_kv  # the replacement's, new with its pool
        assert [(outputs[f"r{i}"].token_ids, outputs[f"r{i}"].exit_depths) for i in range(len(prompts))] == expected
        assert engine.health().prefix_cache_hits > 0


@pytest.mark.timeout(120)
def test_a_worker_that_dies_while_idle_is_noticed_before_the_next_plan() -> None:
    """SIGKILL worker 0 while the engine has nothing to do: the next step sees the death (its
    silence check reads the pidfd) before placing anything on it, so new requests run on worker 1
    and equal the reference; health reports the dead worker with 0 KV used and 0 free slots."""
    expected = _reference(prompts=PROMPTS[:2])
    with LLM("toy-ouro", workers=2, **MODEL_OPTIONS) as llm:
        engine, executor = llm.engine, llm.engine.executor
        victim = executor.worker_pids()[0]
        os.kill(victim, signal.SIGKILL)
        assert _wait_gone([victim], 10) is not None
        outs = llm.generate(PROMPTS[:2], _params(8)[:2], use_tqdm=False)
        assert [(o.token_ids, o.exit_depths) for o in outs] == expected
        (dead, alive) = engine.health().workers
        assert not dead.alive and dead.kv_blocks_used == 0 and dead.free_slots == 0 and not dead.responsive
        assert alive.alive and alive.free_slots > 0
