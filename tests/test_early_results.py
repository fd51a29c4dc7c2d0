"""Early results: a request that ends at a pass before its plan's last (its last output sampled, or a
stop token the worker read back) is sent ahead of the plan's result, so its last tokens are not
delivered a plan's remaining passes late. Float64 on the CPU, against the dense reference.

The in-process executor hands back every result that has landed at once; here its collect is paced
to one result a call, as results arrive one by one over a socket, so that the engine's handling of
an early result while its plan is still in flight is what the test sees.
"""

from __future__ import annotations

import random

import pytest
from factories import DEPTH, Driver, Job, assert_matches_reference, make_llm, make_params, make_prompt

from protocol.messages import StepResult

pytestmark = pytest.mark.usefixtures("single_thread")


class PacedCollect:
    """The executor's collect, one event a call (the rest wait for the next), recording each result."""

    def __init__(self, executor, driver: Driver) -> None:
        self._inner, self._driver = executor.collect, driver
        self._queue: list = []
        # Each result, the ids whose finished output was delivered before it, and the worker's last
        # completed plan in the engine's books before it (so after the result before it was applied).
        self.results: list[tuple[StepResult, set[str], int]] = []

    def __call__(self, timeout: float | None = None) -> list:
        if not self._queue:
            self._queue.extend(self._inner(timeout))
        if not self._queue:
            return []
        worker, event = self._queue.pop(0)
        if isinstance(event, StepResult):
            delivered = {o.request_id for o in self._driver.stream if o.finished}
            completed = self._driver.engine.scheduler.books[worker].kv.completed_step
            self.results.append((event, delivered, completed))
        return [(worker, event)]


def _jobs(exit_mode: str, stop_tokens: bool = False) -> list[Job]:
    """Requests of 5 … 17 outputs arriving together: with 4·D passes a plan most end mid-plan."""
    depth, rng = DEPTH["toy-ouro"], random.Random(f"early-{exit_mode}")
    return [Job(f"r{i}", make_prompt(rng, 5), make_params(
        rng, depth=depth, exit_mode=exit_mode, max_tokens=5 + 2 * i, ignore_eos=not stop_tokens,
        **({"stop_token_ids": list(range(0, 256, 3))} if stop_tokens and i % 2 else {})))
        for i in range(7)]


def _run(exit_mode: str, in_flight: int, jobs: list[Job]) -> tuple[Driver, PacedCollect]:
    with make_llm("toy-ouro", exit_mode=exit_mode, loops_per_plan=4 * DEPTH["toy-ouro"], max_num_seqs=4,
                  max_plans_in_flight=in_flight) as llm:
        driver = Driver(llm)
        paced = PacedCollect(llm.engine.executor, driver)
        llm.engine.executor.collect = paced
        driver.run(jobs)
        assert_matches_reference(driver, "toy-ouro", kv_layout="last_exited", exit_mode=exit_mode)
        driver.assert_resources_returned()
    return driver, paced


def _key_ids(driver: Driver) -> dict[int, str]:
    return {life.key: life.job.request_id for life in driver.lives}


@pytest.mark.parametrize("in_flight", [1, 2])
@pytest.mark.parametrize("exit_mode", ["fixed", "trace"])
def test_requests_that_end_mid_plan_are_delivered_ahead_of_it(exit_mode: str, in_flight: int) -> None:
    """Planned exits: every early result holds whole requests that ended there (finish reason length),
    comes before its plan's result, which repeats none of its rows; applying it leaves the plan in
    flight, and by the time the plan's result is read the engine has delivered those requests'
    finished outputs. Tokens and exit depths are the reference's."""
    driver, paced = _run(exit_mode, in_flight, _jobs(exit_mode))
    ids = _key_ids(driver)
    early = [(i, r) for i, (r, _, _) in enumerate(paced.results) if r.early]
    assert len(early) >= 2, "no request ended mid-plan"
    finals = {r.step_id: i for i, (r, _, _) in enumerate(paced.results) if not r.early}
    for i, result in early:
        keys = set(result.col("keys").tolist())
        final_at = finals[result.step_id]
        assert i < final_at, "an early result came after its plan's result"
        assert paced.results[i + 1][2] < result.step_id, "an early result completed its plan"
        final, delivered, _ = paced.results[final_at]
        assert not keys & set(final.col("keys").tolist()), "a row in both the early result and its plan's"
        assert {ids[k] for k in keys} <= delivered, "an ended request was not delivered before its plan's result"
        for key in keys:
            life = next(life for life in driver.lives if life.key == key)
            assert life.final.finish_reason == "length"
            assert len(life.final.token_ids) == life.job.params.max_tokens


def test_stop_tokens_read_back_end_rows_early() -> None:
    """A gate exit decided on the device (ouro, host loop on the CPU): a stop token read back with a
    pass's exits ends its row, and its rows go ahead of the plan's result too."""
    driver, paced = _run("ouro", 2, _jobs("ouro", stop_tokens=True))
    stopped = {life.key for life in driver.lives if life.final.finish_reason == "stop"}
    early_keys = {k for r, _, _ in paced.results if r.early for k in r.col("keys").tolist()}
    assert stopped & early_keys, "no stop token ended a row mid-plan"


def test_early_results_cross_the_worker_process() -> None:
    """workers = 1: the worker process sends early results before their plan's, in order."""
    jobs = _jobs("trace")
    with make_llm("toy-ouro", exit_mode="trace", workers=1, loops_per_plan=4 * DEPTH["toy-ouro"], max_num_seqs=4,
                  max_plans_in_flight=2) as llm:
        seen: list[StepResult] = []
        inner = llm.engine.executor.collect

        def recording(timeout: float | None = None) -> list:
            events = inner(timeout)
            seen.extend(e for _, e in events if isinstance(e, StepResult))
            return events

        llm.engine.executor.collect = recording
        outputs = llm.generate([list(j.prompt) for j in jobs], [j.params for j in jobs], use_tqdm=False)
    assert [len(o.token_ids) for o in outputs] == [j.params.max_tokens for j in jobs]
    order = [(r.step_id, r.early) for r in seen]
    assert any(early for _, early in order)
    for i, (step, early) in enumerate(order):
        if early:
            assert (step, False) in order[i + 1:], "an early result came after its plan's result"
