"""ResultBuilder (rlt_worker/step_results.py) on the CPU: deferred rows take their place in plan order
and are asked for only when the result is built."""

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
    result = builder.finish(num_free_slots=1, copy_stream=None).result()
    assert asked == [1]
    assert result.col("keys").tolist() == [1, 2, 3, 4]
    assert result.col("tokens").tolist() == [11, 21, 31, -1]
    assert result.col("depths").tolist() == [4, 1, 2, 3]
    assert result.col("exit_states")[3] == 0.5 and result.step_id == 7


def test_copy_out_on_the_cpu_is_a_snapshot() -> None:
    """A device-refill plan's copies land after the next plan may have written its buffers: on the CPU
    copy_out's values are copies, so writing the source afterwards does not change them."""
    with make_llm("toy-ouro") as llm:
        runner = llm.engine.executor._worker.runner
        source = torch.arange(4)
        copies = runner.copy_out(source)
        source.fill_(-1)
        assert copies.event is None and copies.wait()[0].tolist() == [0, 1, 2, 3]
