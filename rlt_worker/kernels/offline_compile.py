"""Compile a Triton kernel for a GPU architecture on a machine without one, and read what it uses.

Triton's own compiler (and the ptxas and cuobjdump its package carries) builds a kernel for sm_90
from its constexprs and argument types alone: no device, no launch. What comes back is the PTX (the
PDL tests read the order of its memory instructions: tests/test_pdl.py) and the cubin, whose
resource usage says what a launch would cost on the chip: registers a thread, stack a thread (spills
live there) and shared memory a program. That costs no device time, so a kernel's variants can be
weighed before any is timed (scripts/kernel_resources.py).
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["OURO_ATTENTION_TYPES", "ResourceUsage", "compile_for", "ouro_attention_constexprs", "resource_usage"]

HOPPER = 90

# The decode attention (triton_backend._attn_kernel) as a 1-row pass of Ouro-1.4B launches it in bf16
# (16 q heads, 16 kv heads, Dh 128, 16-token blocks, 8 splits): the argument types that are not the
# defaults, and the constexprs of a variant (the default launch: tl.dot, 64-token tiles, no rotary).
OURO_ATTENTION_TYPES = {"bt_ptr": "*i32", "ctx_ptr": "*i32", "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32",
                        "qk_scale": "fp32", "scale_ptr": "*fp64", "pos_ptr": "*i64"}


def ouro_attention_constexprs(*, rotary: bool = False, store_first: bool = False, use_dot: bool = True,
                              tile: int = 64) -> dict[str, object]:
    from rlt_worker.attention import triton_backend as tb  # the prefetch lines as the launch derives them

    return dict(GROUP=1, GROUP_PAD=16 if use_dot else 1, HEAD_DIM=128, D_PAD=128, BLOCK_SIZE=16, TILE=tile,
                NUM_SPLITS=8, USE_DOT=use_dot, DOT_PRECISION=None, ACC_F64=False, ROTARY=rotary, Q_HEADS=16,
                STORE_FIRST=store_first, **tb._prefetch_lines(head_dim=128, element_size=2))


@dataclass(frozen=True)
class ResourceUsage:
    """A compiled kernel's use of the chip: per thread, per program."""

    registers: int  # a thread's registers (255 is the most a thread may have)
    stack_bytes: int  # a thread's stack frame: registers spilled to local memory, when > 0
    shared_bytes: int  # a program's shared memory


def compile_for(
    fn: Callable[..., object],
    constexprs: Mapping[str, object],
    types: Mapping[str, str],
    options: Mapping[str, object],
    divisible: Iterable[str] = (),
    arch: int = HOPPER,
) -> Any:
    """`fn` (a plain function: Triton jits it here) compiled for sm_`arch`. Arguments not in
    `constexprs` get their type from `types`, else *bf16 for a pointer (a name ending in _ptr) and
    i32 for a scalar; those in `divisible` (and then every pointer too) are declared multiples of 16,
    as the JIT specializes them at real shapes. `options`: the launch's compile options."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    args = list(inspect.signature(fn).parameters)
    divisible = tuple(divisible)
    signature = {arg: "constexpr" if arg in constexprs else types.get(arg, "*bf16" if arg.endswith("_ptr") else "i32")
                 for arg in args}
    attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(args)
             if arg in divisible or (divisible and arg.endswith("_ptr"))}
    source = ASTSource(fn=triton.jit(fn), signature=signature, constexprs=dict(constexprs), attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=dict(options))


_USAGE = re.compile(r"REG:(\d+) STACK:(\d+)")


def resource_usage(kernel: Any) -> ResourceUsage:
    """Registers and stack a thread from the cubin (the cuobjdump Triton's package carries), shared
    memory a program from Triton's metadata (the cubin's static part leaves out Triton's dynamic
    shared memory)."""
    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        listing = subprocess.run([cuobjdump, "--dump-resource-usage", cubin.name], capture_output=True, text=True,
                                 check=True).stdout
    match = _USAGE.search(listing)
    if match is None:
        raise RuntimeError(f"cuobjdump printed no resource usage for {kernel.name}: {listing[:400]!r}")
    return ResourceUsage(registers=int(match[1]), stack_bytes=int(match[2]), shared_bytes=kernel.metadata.shared)
