"""Work a captured graph runs only when a device flag holds: a CUDA graph conditional (IF) node.

A device-refill pass (rlt_worker/device_refill.py) does a row's boundary work (FINALIZE, CODA, the
LM head, sampling, PRELUDE) only where its exit test fired; in a pass where no row exited every
write of that work lands on the dummy slot or the spare output column. `run_if(flag, work)` lets the
captured pass skip it there without a host round trip. The strategy is chosen once, with the graphs:

    ConditionalNode   CUDA ≥ 12.4: work's kernels are captured into the body of an IF node, which a
                      replay runs only when the flag (a bool scalar on the device, written earlier in
                      the same graph) is true. Outside a capture (the warm-up passes) work runs every
                      time, which is allowed because skipping it changes nothing a real row reads.
    HostCondition     emulated graphs (CPU tests): the flag is read on the host, so the tests run
                      exactly the passes a replay runs, skipped bodies included.
    Unconditional     CUDA where the node cannot be built (the start-up probe failed, logged): work
                      runs at every pass.

The node is built with the CUDA runtime's graph API through ctypes (torch 2.11 has no binding for
it), as during a capture:

    capture stream   … → fill(handle) → set_condition(handle, flag) → [IF node] → …
                                                                         │ body graph, captured on
                                                                         │ a stream of its own, its
                                                                         ▼ allocations in the pool
                                                                       work()

`set_condition` is a one-thread kernel compiled by NVRTC that calls the device runtime's
cudaGraphSetConditional; it reads the handle from a device scalar that the graph fills with it at
every replay (the kernel launcher passes Python ints as 32-bit).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger("rlt.worker")

_SET_CONDITION = r"""
typedef __device_builtin__ unsigned long long cudaGraphConditionalHandle;
extern "C" __device__ __cudart_builtin__ void cudaGraphSetConditional(cudaGraphConditionalHandle handle,
                                                                      unsigned int value);
extern "C" __global__ void set_condition(const unsigned long long* handle, const bool* flag) {
    cudaGraphSetConditional(*handle, *flag ? 1u : 0u);
}
"""

# Route the current thread's (older torch: the current stream's) allocations to a pool.
_ROUTE_TO_POOL = getattr(torch._C, "_cuda_beginAllocateCurrentThreadToPool", None) or getattr(
    torch._C, "_cuda_beginAllocateCurrentStreamToPool", None)

# driver_types.h
_CAPTURE_ACTIVE = 1  # cudaStreamCaptureStatusActive
_CAPTURE_THREAD_LOCAL = 1  # cudaStreamCaptureModeThreadLocal
_NODE_CONDITIONAL = 13  # cudaGraphNodeTypeConditional
_CONDITION_IF = 0  # cudaGraphCondTypeIf
_ASSIGN_DEFAULT = 1  # cudaGraphCondAssignDefault: the condition starts each launch at its default (0)
_SET_DEPENDENCIES = 1  # cudaStreamSetCaptureDependencies


class _ConditionalParams(ctypes.Structure):
    _fields_ = [("handle", ctypes.c_ulonglong), ("type", ctypes.c_int), ("size", ctypes.c_uint),
                ("graphs_out", ctypes.POINTER(ctypes.c_void_p))]


class _NodeParams(ctypes.Structure):
    """cudaGraphNodeParams: 256 bytes, the node kind's parameters in a union at byte 16."""

    class _Union(ctypes.Union):
        _fields_ = [("reserved", ctypes.c_longlong * 29), ("conditional", _ConditionalParams)]

    _fields_ = [("type", ctypes.c_int), ("reserved0", ctypes.c_int * 3), ("params", _Union),
                ("reserved2", ctypes.c_longlong)]


class _GraphApi:
    """The CUDA runtime calls a conditional node needs (CUDA 13 names; CUDA 12.4–12.9: their _v2/_v3)."""

    def __init__(self) -> None:
        major = int(torch.version.cuda.split(".")[0])
        lib = ctypes.CDLL(f"libcudart.so.{major}")  # the runtime torch loaded (found by its soname)
        info, node = ("", "") if major >= 13 else ("_v3", "_v2")
        ptr, size, uint, ref = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint, ctypes.POINTER
        self._capture_info = self._bind(lib, f"cudaStreamGetCaptureInfo{info}", ptr, ref(ctypes.c_int),
                                        ptr, ref(ptr), ref(ptr), ref(ptr), ref(size))
        self._add_node = self._bind(lib, f"cudaGraphAddNode{node}", ref(ptr), ptr, ptr, ptr, size, ref(_NodeParams))
        self._update_dependencies = self._bind(lib, f"cudaStreamUpdateCaptureDependencies{node}", ptr, ref(ptr),
                                               ptr, size, uint)
        self._handle_create = self._bind(lib, "cudaGraphConditionalHandleCreate", ref(ctypes.c_ulonglong), ptr,
                                         uint, uint)
        self._begin_capture_to_graph = self._bind(lib, "cudaStreamBeginCaptureToGraph", ptr, ptr, ptr, ptr, size,
                                                  ctypes.c_int)
        self._end_capture = self._bind(lib, "cudaStreamEndCapture", ptr, ref(ptr))
        self._error_string = lib["cudaGetErrorString"]
        self._error_string.argtypes, self._error_string.restype = [ctypes.c_int], ctypes.c_char_p

    @staticmethod
    def _bind(lib: ctypes.CDLL, name: str, *argtypes: Any) -> Any:
        function = lib[name]
        function.argtypes, function.restype = list(argtypes), ctypes.c_int
        return function

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"{what}: {self._error_string(code).decode()} (CUDA error {code})")

    def if_node(self, stream: int) -> tuple[int, ctypes.c_void_p]:
        """Add an IF node after what `stream` has captured so far, and make the stream's later work
        depend on it; returns its condition handle and its (empty) body graph."""
        status, graph = ctypes.c_int(), ctypes.c_void_p()
        deps, edges, num_deps = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_size_t()
        self._check(self._capture_info(stream, ctypes.byref(status), None, ctypes.byref(graph), ctypes.byref(deps),
                                       ctypes.byref(edges), ctypes.byref(num_deps)), "cudaStreamGetCaptureInfo")
        if status.value != _CAPTURE_ACTIVE:
            raise RuntimeError("a conditional node needs a stream that is being captured")
        handle = ctypes.c_ulonglong()
        self._check(self._handle_create(ctypes.byref(handle), graph, 0, _ASSIGN_DEFAULT),
                    "cudaGraphConditionalHandleCreate")
        return handle.value, graph

    def add_if_node(self, stream: int, graph: ctypes.c_void_p, handle: int) -> ctypes.c_void_p:
        """The IF node on `handle` after the stream's captured work; the stream continues after it."""
        status, current = ctypes.c_int(), ctypes.c_void_p()
        deps, edges, num_deps = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_size_t()
        self._check(self._capture_info(stream, ctypes.byref(status), None, ctypes.byref(current), ctypes.byref(deps),
                                       ctypes.byref(edges), ctypes.byref(num_deps)), "cudaStreamGetCaptureInfo")
        params = _NodeParams(type=_NODE_CONDITIONAL)
        params.params.conditional = _ConditionalParams(handle=handle, type=_CONDITION_IF, size=1)
        node = ctypes.c_void_p()
        self._check(self._add_node(ctypes.byref(node), graph, deps, edges, num_deps, ctypes.byref(params)),
                    "cudaGraphAddNode")
        self._check(self._update_dependencies(stream, ctypes.byref(node), None, 1, _SET_DEPENDENCIES),
                    "cudaStreamUpdateCaptureDependencies")
        return ctypes.c_void_p(params.params.conditional.graphs_out[0])

    def begin_capture_to(self, stream: int, graph: ctypes.c_void_p) -> None:
        self._check(self._begin_capture_to_graph(stream, graph, None, None, 0, _CAPTURE_THREAD_LOCAL),
                    "cudaStreamBeginCaptureToGraph")

    def end_capture(self, stream: int) -> None:
        graph = ctypes.c_void_p()
        self._check(self._end_capture(stream, ctypes.byref(graph)), "cudaStreamEndCapture")


class ConditionalNode:
    """CUDA: `work` becomes the body of an IF node of the graph being captured (module docstring).
    `pool` is the captures' memory pool: the body's allocations come from it too."""

    name = "conditional node"

    def __init__(self, device: torch.device, pool: Any) -> None:
        self.device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        self.pool = pool
        self._api = _GraphApi()
        self._set_condition = torch.cuda._compile_kernel(_SET_CONDITION, "set_condition")
        self._body_stream = torch.cuda.Stream(device)

    def run_if(self, flag: torch.Tensor, work: Callable[[], None]) -> None:
        if not torch.cuda.is_current_stream_capturing():
            work()
            return
        stream = torch.cuda.current_stream(self.device).cuda_stream
        handle, graph = self._api.if_node(stream)
        # Two's complement: the fill writes the handle's 64 bits whatever its sign as an int64.
        stored = torch.full((), handle - (1 << 64) if handle >= 1 << 63 else handle, dtype=torch.int64,
                            device=self.device)
        self._set_condition(grid=(1, 1, 1), block=(1, 1, 1), args=[stored, flag])
        body = self._api.add_if_node(stream, graph, handle)
        self._capture_body(body, work)

    def _capture_body(self, body: ctypes.c_void_p, work: Callable[[], None]) -> None:
        # The body's capture is not the one torch's allocator routes to the pool: route this thread's
        # allocations there too. endAllocateToPool then drops the pool's first routing (the capture's
        # own), and this thread's keeps the rest of the capture in the pool until torch ends it;
        # releasePool returns the use the routing took, so the pool is freed with its graphs.
        side, index = self._body_stream.cuda_stream, self.device.index
        self._api.begin_capture_to(side, body)
        try:
            with torch.cuda.stream(self._body_stream):
                _ROUTE_TO_POOL(index, self.pool)
                try:
                    work()
                finally:
                    torch._C._cuda_endAllocateToPool(index, self.pool)
                    torch._C._cuda_releasePool(index, self.pool)
        finally:
            self._api.end_capture(side)

    def probe(self) -> None:
        """Raise unless a captured IF node runs its body exactly when its flag holds."""
        flag, target = torch.zeros((), dtype=torch.bool, device=self.device), torch.zeros(2, device=self.device)
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.graph(graph, pool=self.pool, stream=stream, capture_error_mode="thread_local"):
            self.run_if(flag.clone(), lambda: target.add_(torch.ones(2, device=self.device)))
        for value in (False, True, False, True):
            flag.fill_(value)
            graph.replay()
        torch.cuda.synchronize(self.device)
        if target.tolist() != [2.0, 2.0]:
            raise RuntimeError(f"an IF node's body ran {target.tolist()} times in 2 replays of 4 with its flag set")


class HostCondition:
    """Emulated graphs: the flag is read on the host (a CPU tensor: no wait)."""

    name = "host condition"

    def run_if(self, flag: torch.Tensor, work: Callable[[], None]) -> None:
        if bool(flag):
            work()


class Unconditional:
    """The conditional node could not be built here: the work runs at every replay."""

    name = "every pass"

    def run_if(self, flag: torch.Tensor, work: Callable[[], None]) -> None:
        work()


GraphCondition = ConditionalNode | HostCondition | Unconditional


def make_graph_condition(emulate: bool, device: torch.device, pool: Any) -> GraphCondition:
    """The strategy for graphs that are emulated (CPU tests) or captured (CUDA) into `pool`."""
    if emulate:
        return HostCondition()
    try:
        node = ConditionalNode(device, pool)
        node.probe()
    except Exception:  # keep serving: the boundary work then runs at every pass
        log.exception("CUDA graph conditional nodes are unavailable; device-refill passes run their boundary "
                      "work at every pass")
        return Unconditional()
    return node
