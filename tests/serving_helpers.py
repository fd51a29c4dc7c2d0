"""Real-process helpers of the serving tests: an rlt-serve process and client processes.

`ServerProcess` starts `python -m rlt_engine.cli serve … --device cpu --dtype float64` (toy-ouro
unless the arguments name a model), waits for its ready line and, whatever happens, stops
exactly the processes it started (the server and the worker processes found as its children).
Run as a script (`python serving_helpers.py client JOBS.json OUT.json`), this file is a client
process: lanes of jobs, each lane a thread that streams its jobs one after the other and may
abort them, and a JSON report at the end.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

READY = "rlt-serve ready on "
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
IPC_PATH_MAX = 107


def short_ipc_path(tmp_path: Path, name: str = "rlt.sock") -> str:
    """A socket path under tmp_path, or under a short private directory when that is too long."""
    path = str(tmp_path / name)
    if len(path) <= IPC_PATH_MAX - 8:
        return path
    return os.path.join(tempfile.mkdtemp(prefix="rlts-", dir="/tmp"), name)


def _terminate_with_the_tests() -> None:
    """In the server's process, before exec: SIGTERM when the process that started it dies (Linux).

    The fixtures stop every server they start, but not when the test process itself is killed (a
    `timeout` around pytest, a CI job cancelled): a module-scoped server was found running 36 minutes
    after such a run. SIGTERM shuts it down as Ctrl-C would, and its workers follow their parent.
    """
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


class ServerProcess:
    """One `rlt-serve` process tree, started and stopped by pid."""

    def __init__(self, ipc: str, *args: str, workers: int = 1, log_dir: Path | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.ipc = ipc
        self.env = {**os.environ, **(env or {})}
        self.address = f"ipc://{ipc}"
        self.args = ["--workers", str(workers), *args]
        self.log_path = Path(log_dir or os.path.dirname(ipc)) / f"serve-{os.getpid()}-{time.monotonic_ns()}.log"
        self.proc: subprocess.Popen | None = None
        self.tree: list[psutil.Process] = []  # the server and every descendant seen, for cleanup
        self.stdout_lines: list[str] = []

    def start(self, timeout: float = 180.0) -> ServerProcess:
        """Start the server and wait for its ready line (raises with the log tail if it never comes)."""
        model = [] if "--model" in self.args else ["--model", "toy-ouro"]
        # One torch thread per worker: the suite runs two test processes on two cores, and a worker's
        # second thread then waits at every op for a core (one busy neighbour made a test 12× slower).
        threads = [] if "--cpu-threads" in self.args else ["--cpu-threads", "1"]
        cmd = [sys.executable, "-m", "rlt_engine.cli", "serve", "--ipc", self.ipc, "--device", "cpu",
               "--dtype", "float64", *model, *threads, *self.args]
        self._log = open(self.log_path, "wb")
        # Its own process group, as a shell job would be: a test can signal the group like Ctrl-C does.
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log, stdin=subprocess.DEVNULL, text=True,
                                     start_new_session=True, env=self.env, preexec_fn=_terminate_with_the_tests)
        self.tree = [psutil.Process(self.proc.pid)]
        ready = threading.Event()
        threading.Thread(target=self._read_stdout, args=(ready,), daemon=True).start()
        deadline = time.monotonic() + timeout
        while not ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"rlt-serve did not become ready (exit {self.proc.poll()}):\n{self.log_tail()}")
        self.refresh_tree()
        return self

    def _read_stdout(self, ready: threading.Event) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.stdout_lines.append(line)
            if line.startswith(READY):
                ready.set()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def refresh_tree(self) -> None:
        """Remember every current descendant too (they must be gone after the server)."""
        try:
            children = psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return
        known = {p.pid for p in self.tree}
        self.tree += [c for c in children if c.pid not in known]

    def worker_pids(self) -> list[int]:
        """Pids of the server's worker processes (its children)."""
        self.refresh_tree()
        return [c.pid for c in psutil.Process(self.pid).children()]

    def signal(self, sig: int) -> None:
        self.refresh_tree()
        os.kill(self.pid, sig)

    def signal_group(self, sig: int) -> None:
        """Signal the server's process group (the server and its workers), as Ctrl-C in a terminal does."""
        self.refresh_tree()
        os.killpg(self.pid, sig)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def alive_tree(self) -> list[psutil.Process]:
        """Processes of this tree still running (not zombies)."""
        alive = []
        for p in self.tree:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        return alive

    def wait_tree_gone(self, timeout: float) -> list[psutil.Process]:
        """Wait until no process of the tree runs; returns those still running at the timeout."""
        deadline = time.monotonic() + timeout
        while (alive := self.alive_tree()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return alive

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL for whatever of the tree is left; closes the pipes."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.refresh_tree()
            self.proc.send_signal(signal.SIGTERM)
            time.sleep(0.05)
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)  # the second one skips the drain
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        for p in self.alive_tree():
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()


class ClientProcess:
    """A client process running lanes of jobs (see run_client)."""

    def __init__(self, address: str, lanes: list[list[dict]], workdir: Path, name: str) -> None:
        self.jobs_path = workdir / f"{name}.jobs.json"
        self.out_path = workdir / f"{name}.out.json"
        self.jobs_path.write_text(json.dumps({"address": address, "lanes": lanes}))
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "client", str(self.jobs_path), str(self.out_path)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
        )
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.strip())

    def wait_for_line(self, prefix: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(line.startswith(prefix) for line in self.lines):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise AssertionError(f"client never printed {prefix!r}; lines: {self.lines[-5:]}")
            time.sleep(0.02)

    def result(self, timeout: float) -> dict:
        """Wait for the process and return its report."""
        _, err = self.proc.communicate(timeout=timeout)
        assert self.proc.returncode == 0, f"client exited {self.proc.returncode}: {err[-3000:]}"
        return json.loads(self.out_path.read_text())

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._thread.join(5)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


def run_client(jobs_path: str, out_path: str) -> int:
    """Client process: run each lane of jobs in its own thread; write one record per job."""
    from protocol.messages import SamplingParams
    from rlt_engine.client import Client

    spec = json.loads(Path(jobs_path).read_text())
    client = Client(spec["address"])
    results: list[dict] = []
    lock = threading.Lock()

    def say(text: str) -> None:
        with lock:
            print(text, flush=True)

    def lane(jobs: list[dict]) -> None:
        for job in jobs:
            record = {"id": job["id"], "key": job.get("key"), "token_ids": [], "exit_depths": [],
                      "finish_reason": None, "error": None, "closed_early": False, "deltas": 0}
            try:
                stream = client.stream(job["prompt"], SamplingParams(**job["params"]), request_id=job["id"])
                abort_after = job.get("abort_after")
                if abort_after == 0:
                    stream.close() if job.get("abort_mode") == "close" else client.abort(job["id"])
                    record["closed_early"] = job.get("abort_mode") == "close"
                for delta in stream:
                    record["deltas"] += 1
                    if record["deltas"] == 1:
                        say(f"streaming {job['id']}")
                    if abort_after is not None and record["deltas"] == abort_after:
                        if job.get("abort_mode") == "close":
                            stream.close()
                            record["closed_early"] = not delta.finished
                        else:
                            client.abort(job["id"])
                out = stream.output
                record.update(token_ids=out.token_ids, exit_depths=out.exit_depths, finish_reason=out.finish_reason,
                              seed=out.seed)
            except Exception as exc:  # reported, asserted by the test
                record["error"] = f"{type(exc).__name__}: {exc}"
            with lock:
                results.append(record)
        say("lane done")

    threads = [threading.Thread(target=lane, args=(jobs,)) for jobs in spec["lanes"]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stray = client._core.stray
    client.close()
    Path(out_path).write_text(json.dumps({"results": results, "stray": stray,
                                          "torch_imported": "torch" in sys.modules}))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["client"]:
        sys.exit(run_client(sys.argv[2], sys.argv[3]))
    sys.exit(f"usage: {sys.argv[0]} client JOBS.json OUT.json")
