"""Kernels compiled for sm_90 on the CPU (rlt_worker/kernels/offline_compile.py): what a cubin says it
uses, read back through the cuobjdump Triton's package carries: registers and stack a thread (spills)
and shared memory a program, for the decode attention's variants at Ouro-1.4B's heads
(scripts/kernel_resources.py; the finding behind triton_backend.ATTENTION_WARPS).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlt_worker.attention import triton_backend as tb
from rlt_worker.kernels.offline_compile import compile_for, resource_usage

pytestmark = [pytest.mark.skipif(tb.triton is None, reason="Triton is not installed"), pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[1]


def test_a_small_kernel_uses_few_registers_and_no_stack(compiled: None) -> None:
    kernel = compile_for(tb._merge_kernel, dict(HEAD_DIM=128, D_PAD=128, NUM_SPLITS=8, S_PAD=8, ACC_F64=False,
                                                PDL=False),
                         {"m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32"}, {"num_warps": 4})
    usage = resource_usage(kernel)
    assert 0 < usage.registers < 128 and usage.stack_bytes == 0 and usage.shared_bytes == kernel.metadata.shared


def test_stack_shows_spills_and_more_warps_take_them_away(compiled: None, tmp_path: Path) -> None:
    """Without tl.dot at 4 warps the attention spills hundreds of bytes a thread on any Triton of the
    pinned range (328 B on 3.6, 256 on 3.9); with tl.dot at 8 warps it fits its registers. (How many
    bytes the default, tl.dot at 4 warps, spills is a version's detail: docs/benchmarks.md.)"""
    out = tmp_path / "resources.json"
    subprocess.run([sys.executable, "scripts/kernel_resources.py", "--modes", "plain", "--warps", "4,8", "--prefill",
                    "--json", str(out)], cwd=ROOT, check=True, capture_output=True, timeout=240)
    report = json.loads(out.read_text())
    rows = {(r["dot"], r["warps"]): r for r in report["rows"]}
    assert set(rows) == {(True, 4), (True, 8), (False, 4), (False, 8)}
    assert rows[False, 4]["stack_bytes"] >= 128 and rows[False, 4]["registers"] == 255, rows[False, 4]
    assert rows[True, 8]["stack_bytes"] == 0 and rows[True, 8]["registers"] < 255, rows[True, 8]
    assert rows[True, 8]["shared_bytes"] == rows[True, 4]["shared_bytes"] > 0  # tl.dot's K/V tiles: not per warp
    prefill = {(r["block_m"], r["block_n"]): r for r in report["prefill_rows"]}
    assert set(prefill) == {(64, 32), (64, 64), (128, 32)}
    assert prefill[64, 64]["shared_bytes"] > prefill[64, 32]["shared_bytes"] > 0  # K/V stages grow with block_n


def test_an_unknown_mode_is_refused_with_the_choices() -> None:
    done = subprocess.run([sys.executable, "scripts/kernel_resources.py", "--modes", "plain,rotray"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "rotray" in done.stderr and "rotary-store-first" in done.stderr
