"""Triton's interpreter from pytest: a test module's interpreter cases run in a child process.

TRITON_INTERPRET=1 takes effect only if it is set before triton is first imported (the tl.*
helpers are jitted at import), and pytest may have imported it already: so a module's cases run
in one child, started as `python <its file> --interp-cases`, and each test reads its case's
verdict. The module ends with `if __name__ == "__main__": interp.main(INTERP_CASES)`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
import torch

from rlt_worker.attention import triton_backend as tb

ROOT = Path(__file__).resolve().parents[1]

# A process that imported Triton in interpreter mode cannot run compiled kernels.
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or tb._interpreting(),
                                reason="needs CUDA and TRITON_INTERPRET unset")


def child(test_file: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`python test_file args…` with TRITON_INTERPRET=1 and the repository on the path."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    return subprocess.run([sys.executable, str(Path(test_file).resolve()), *args],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def verdicts(test_file: str) -> dict[str, str]:
    """Every interpreter case's verdict ("ok" or its traceback), from one child run of test_file."""
    proc = child(test_file, "--interp-cases")
    assert proc.returncode == 0, f"interpreter child failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(cases: Mapping[str, Callable[[], None]], single: Mapping[str, Callable[[], None]] | None = None) -> None:
    """The child's body: `--interp-cases` runs every case and prints the verdicts as JSON (report,
    don't stop: each case is its own test in the parent); `--case NAME` runs one of `single`."""
    if sys.argv[1:] == ["--interp-cases"]:
        results = {}
        for name, case in cases.items():
            try:
                case()
                results[name] = "ok"
            except Exception:
                results[name] = traceback.format_exc()
        print(json.dumps(results))
    elif sys.argv[1:2] == ["--case"] and single is not None:
        single[sys.argv[2]]()
