"""Work a captured graph runs only when a device flag holds: a CUDA graph conditional (IF) node.

A device-refill pass (rlt_worker/device_refill.py) does a row's boundary work (FINALIZE, CODA, the
LM head, sampling, PRELUDE) only where its exit test fired; in a pass where no row exited every
write of that work lands on the dummy slot or the spare output column. `run_if(flag, work)` lets the
captured pass skip it there without a host round trip. The strategy is chosen once, with the graphs:

    ConditionalNode   CUDA, torch with conditional nodes (CUDA ≥ 12.4): work's kernels are captured
                      into an IF node's body, which a replay runs only when the flag (a bool scalar
                      on the device, written earlier in the same graph) is true. Outside a capture
                      (the warm-up passes) work runs every time, which is allowed because skipping it
                      changes nothing a real row reads.
    HostCondition     emulated graphs (CPU tests): the flag is read on the host, so the tests run
                      exactly the passes a replay runs, skipped bodies included.
    Unconditional     CUDA without conditional nodes: work runs at every pass (the cost before).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class ConditionalNode:
    """CUDA: `work` becomes an IF node of the graph being captured (see the module docstring)."""

    name = "conditional node"

    @staticmethod
    def available() -> bool:
        graph = torch.cuda.CUDAGraph
        return all(hasattr(graph, name) for name in ("get_currently_capturing_graph", "begin_capture_to_if_node",
                                                     "end_capture_to_conditional_node"))

    def run_if(self, flag: torch.Tensor, work: Callable[[], None]) -> None:
        if not torch.cuda.is_current_stream_capturing():
            work()
            return
        graph = torch.cuda.CUDAGraph.get_currently_capturing_graph()
        graph.begin_capture_to_if_node(flag)
        try:
            work()
        finally:
            graph.end_capture_to_conditional_node()


class HostCondition:
    """Emulated graphs: the flag is read on the host (a CPU tensor: no wait)."""

    name = "host condition"

    def run_if(self, flag: torch.Tensor, work: Callable[[], None]) -> None:
        if bool(flag):
            work()


class Unconditional:
    """No conditional nodes in this build: the work runs at every replay."""

    name = "every pass"

    def run_if(self, flag: torch.Tensor, work: Callable[[], None]) -> None:
        work()


GraphCondition = ConditionalNode | HostCondition | Unconditional


def make_graph_condition(emulate: bool) -> GraphCondition:
    """The strategy for graphs that are emulated (CPU tests) or captured (CUDA)."""
    if emulate:
        return HostCondition()
    return ConditionalNode() if ConditionalNode.available() else Unconditional()
