"""ResultBuilder (rlt_worker/step_results.py) on the CPU: deferred rows take their place in plan order
and are asked for only when the result is built; ended requests' rows go ahead in early results."""

from __future__ import annotations

import numpy as np
import torch
from factories import make_llm

from protocol.messages import Stage
from rlt_worker.step_results import ResultBuilder


def _keys(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def test_deferred_rows_keep_their_place_and_come_when_built() -> None:
    builder, asked = ResultBuilder(step_id=7), []
    builder.add(Stage.CODA, _keys(1), _keys(1), depths=np.array([4]), tokens=np.array([11]))
    later = ResultBuilder(step_id=-1)
    later.add(Stage.DECODE, _keys(2, 3), _keys(2, 3), depths=np.array([1, 2]), tokens=np.array([21, 31]))

    def rows() -> list[dict[str, object]]:
        asked.append(1)
        return later.parts()

    builder.defer(rows, None)
    builder.add(Stage.RECURRENT, _keys(4), _keys(4), depths=np.array([3]),
                exit_states=torch.tensor([0.5], dtype=torch.float64))
    assert not asked
    (pending,) = builder.finish(num_free_slots=1)
    result = pending.result()
    assert asked == [1]
    assert result.col("keys").tolist() == [1, 2, 3, 4]
    assert result.col("tokens").tolist() == [11, 21, 31, -1]
    assert result.col("depths").tolist() == [4, 1, 2, 3]
    assert result.col("exit_states")[3] == 0.5 and result.step_id == 7


def test_ended_requests_rows_go_ahead_in_early_results() -> None:
    """send_early: every row so far of the ended requests, in order, in an early result ahead of the
    plan's; the plan's result has every other row, in order, and no row is in both."""
    builder = ResultBuilder(step_id=5)
    builder.add(Stage.DECODE, _keys(1, 2, 3), _keys(9, 9, 9), depths=np.array([1, 2, 3]), tokens=np.array([10, 20, 30]),
                logprobs=torch.tensor([-1.0, -2.0, -3.0], dtype=torch.float64))
    builder.add(Stage.DECODE, _keys(2, 3), _keys(9, 9), depths=np.array([4, 1]), tokens=np.array([21, 31]))
    builder.send_early(_keys(2))
    builder.send_early(_keys(2))  # sent already: nothing new
    builder.send_early(_keys(7))  # no rows (a row that continued an ended request's slot): no result
    builder.add(Stage.DECODE, _keys(1, 3), _keys(9, 9), depths=np.array([2, 2]), tokens=np.array([11, 32]))
    builder.add(Stage.RECURRENT, _keys(1, 3), _keys(9, 9), depths=np.array([1, 0]))
    early, final = (pending.result() for pending in builder.finish(num_free_slots=3))
    assert early.early and not final.early and early.step_id == final.step_id == 5
    assert early.col("keys").tolist() == [2, 2] and early.col("tokens").tolist() == [20, 21]
    assert early.col("depths").tolist() == [2, 4] and early.col("logprobs")[0] == -2.0
    assert final.col("keys").tolist() == [1, 3, 3, 1, 3, 1, 3]
    assert final.col("tokens").tolist() == [10, 30, 31, 11, 32, -1, -1]
    assert final.col("stages").tolist() == [Stage.DECODE] * 5 + [Stage.RECURRENT] * 2
    assert final.num_free_slots == 3


def test_an_early_result_with_nothing_left_to_carry_is_not_sent() -> None:
    """defer_early: rows known when it is built; when an earlier early result carried them all, it builds
    None, and the worker's sender skips it (the next result still goes out, in order)."""
    from rlt_worker.worker_process import _send_landed

    builder = ResultBuilder(step_id=4)
    builder.add(Stage.DECODE, _keys(1, 2), _keys(9, 9), depths=np.array([1, 1]), tokens=np.array([10, 20]))
    ended = ResultBuilder(step_id=-1)
    ended.add(Stage.DECODE, _keys(2), _keys(9), depths=np.array([3]), tokens=np.array([21]))
    builder.defer_early(ended.parts, None)
    builder.defer_early(lambda: [], None)  # found no ended row it had not sent
    pending = builder.finish(num_free_slots=1)

    class Recording:  # the worker's EngineLink, as _send_landed uses it
        def __init__(self) -> None:
            self.sent: list = []

        def send(self, message: object) -> None:
            self.sent.append(message)

    link = Recording()
    _send_landed(link, pending)
    first, final = link.sent
    assert first.early and first.col("keys").tolist() == [2, 2] and first.col("tokens").tolist() == [20, 21]
    assert not final.early and final.col("keys").tolist() == [1]


def test_copy_out_on_the_cpu_is_a_snapshot() -> None:
    """A device-refill plan's copies land after the next plan may have written its buffers: on the CPU
    copy_out's values are copies, so writing the source afterwards does not change them."""
    with make_llm("toy-ouro") as llm:
        runner = llm.engine.executor._worker.runner
        source = torch.arange(4)
        copies = runner.copy_out(source)
        source.fill_(-1)
        assert copies.event is None and copies.wait()[0].tolist() == [0, 1, 2, 3]
