"""Part of a captured function that runs only where a device flag is set: a CUDA graph conditional node.

A device-refill pass (rlt_worker/device_refill.py) does its boundary work (FINALIZE, CODA, sampling,
the next PRELUDE) masked over every row, and in a pass where no row exits all of it is a no-op: at one
row on the H200 that is the LM head's read of its weight, 0.12 ms, in every pass. Under an IF node
the graph skips it on the device, with no readback. One strategy is chosen at construction:

    DeviceIf    CUDA graphs: the body is captured into an IF node on the flag (torch's
                CUDAGraph.begin_capture_to_if_node; CUDA 12.4+). Outside a capture (the warm-up runs
                before it) the body runs unconditionally, so every kernel in it compiles and its
                buffers are allocated before the capture.
    HostIf      emulated graphs (CPU tests): the flag is read on the host and the body runs only when
                it is set, so the tests skip exactly what the IF node skips.
    AlwaysRun   conditionals off (`cuda_graph_conditionals`), or a torch without IF nodes: the body
                runs every time; its result is the same, only slower.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger("rlt.worker")


class DeviceIf:
    name = "device"

    def __call__(self, flag: torch.Tensor, body: Callable[[], None]) -> None:
        if not torch.cuda.is_current_stream_capturing():
            body()
            return
        graph = torch.cuda.CUDAGraph.get_currently_capturing_graph()
        graph.begin_capture_to_if_node(flag)
        try:
            body()
        finally:
            graph.end_capture_to_conditional_node()


class HostIf:
    name = "host"

    def __call__(self, flag: torch.Tensor, body: Callable[[], None]) -> None:
        if bool(flag):
            body()


class AlwaysRun:
    name = "off"

    def __call__(self, flag: torch.Tensor, body: Callable[[], None]) -> None:
        body()


GraphIf = DeviceIf | HostIf | AlwaysRun


def make_graph_if(wanted: bool, emulate: bool) -> GraphIf:
    """The strategy for `wanted` (cuda_graph_conditionals) under real or emulated graphs."""
    if not wanted:
        return AlwaysRun()
    if emulate:
        return HostIf()
    if not hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node"):
        log.warning("torch %s has no CUDA graph conditional nodes: device-refill passes run their boundary "
                    "work in every pass", torch.__version__)
        return AlwaysRun()
    return DeviceIf()
