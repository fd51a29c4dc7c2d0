"""The scheduler alone (no worker, no model): plans out, hand-built StepResults in (STYLE §9)."""

from __future__ import annotations

import pytest
from factories import add_requests, make_scheduler, result_for, run_step

from protocol.messages import AppliedOps, DecodeBatch, PrefillBatch
from rlt_engine.request import Phase, RequestStatus


def slot_ops(plan):
    releases = plan.releases
    return {
        "admits": [(a.key, a.generation) for a in plan.admits],
        "releases": list(zip(releases.col("keys").tolist(), releases.col("generations").tolist(), strict=True)),
        "exports": plan.exports.col("keys").tolist(),
        "imports": plan.imports.col("keys").tolist(),
    }


def run_until(scheduler, condition, max_steps: int = 200, **result):
    plans = []
    for _ in range(max_steps):
        if condition():
            return plans
        plan = run_step(scheduler, **result)
        if plan is not None:
            plans.append(plan)
    raise AssertionError("condition not reached")


def test_admission_is_first_come_first_served_within_the_slots():
    s = make_scheduler(max_num_seqs=2)
    r0, r1, r2 = add_requests(s, 3)
    plan = run_step(s)
    assert slot_ops(plan)["admits"] == [(r0.key, r0.generation), (r1.key, r1.generation)]
    assert r2.status == RequestStatus.WAITING and list(s.waiting) == [r2]
    prefills = [b for b in plan.batches if isinstance(b, PrefillBatch)]
    assert prefills and prefills[0].col("keys").tolist() == [r0.key, r1.key]


def test_release_is_sent_next_and_the_slot_counts_as_held_until_it_completes():
    """r0 finishes; its release goes in the next plan, and r2 (waiting for a slot) is admitted only
    in the plan after that one completed: admits apply before releases within a plan."""
    s = make_scheduler(max_num_seqs=2)
    r0, r1, r2 = add_requests(s, 3)
    r1.params = r1.params.__class__(max_tokens=40, seed=1, ignore_eos=True)  # outlives r0
    run_until(s, lambda: r0.is_finished)
    book = s.books[0]
    assert book.to_release == [(r0.key, r0.generation)] and book.num_slots_held == 2
    release_plan = s.schedule(0)
    built = release_plan.build()
    assert slot_ops(built)["releases"] == [(r0.key, r0.generation)]
    assert r2.status == RequestStatus.WAITING, "admitted before the release plan completed"
    assert book.num_slots_held == 2 and book.releases_in_flight == {built.step_id: 1}
    s.update(0, result_for(built))
    assert book.releases_in_flight == {} and book.num_slots_held == 1
    plan = run_step(s)
    assert (r2.key, r2.generation) in slot_ops(plan)["admits"]


def test_on_demand_growth_appends_one_block_per_plane_as_positions_advance():
    s = make_scheduler(block_size=4, num_planes=4)
    (r,) = add_requests(s, 1, prompt_len=3, max_tokens=10)  # positions 0 … 11: 3 blocks per plane
    plans = run_until(s, lambda: r.is_finished)
    appended = [p.block_appends.col("num_new").tolist() for p in plans if p.block_appends.num_rows]
    assert appended[0] == [2]  # admission: the prompt plus one block (7 positions → 2 blocks)
    assert appended[1:] == [[1]], appended  # one more block once position 8 is needed
    assert s.books[0].kv.num_free_blocks == 64  # its last step has completed: the blocks are back
    assert s.books[0].to_release == [(r.key, r.generation)]  # the slot goes with the next plan


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_growth_preempts_the_largest_and_the_victim_resumes(mode):
    """Two requests on a pool too small for both to grow: one is preempted. swap: the next plan
    exports it, it resumes (import) only after that plan completed, keeping its outputs and phase.
    recompute: its slot is released and it replays from its prompt in a new generation."""
    s = make_scheduler(num_blocks=16, block_size=4, num_planes=4, preemption=mode)  # 4 blocks per plane
    a, b = add_requests(s, 2, prompt_len=3, max_tokens=10)
    plans = run_until(s, lambda: s.stats.num_preemptions > 0)
    victim = a if a.status == RequestStatus.WAITING else b
    survivor = b if victim is a else a
    generation_then = max(g for p in plans for k, g in slot_ops(p)["admits"] if k == victim.key)
    outputs_then = victim.num_outputs
    plan = run_step(s)
    if mode == "swap":
        assert slot_ops(plan)["exports"] == [victim.key] and slot_ops(plan)["releases"] == []
    else:
        assert slot_ops(plan)["releases"] == [(victim.key, generation_then)]
        assert victim.phase == Phase.PREFILL and victim.num_prefilled == 0
    plans = run_until(s, lambda: victim.status == RequestStatus.RUNNING)
    resumed = run_step(s)
    assert victim.generation > generation_then and victim.num_outputs >= outputs_then
    ops = [slot_ops(p) for p in plans + [resumed]]
    if mode == "swap":
        assert any(o["imports"] == [victim.key] for o in ops), ops
        assert not any((victim.key, victim.generation) in o["admits"] for o in ops)
    else:
        assert any((victim.key, victim.generation) in o["admits"] for o in ops), ops
    run_until(s, lambda: victim.is_finished and survivor.is_finished)
    assert victim.num_outputs == survivor.num_outputs == 10
    run_step(s)
    assert s.books[0].kv.num_free_blocks == 16 and not s.books[0].swap.copies and s.books[0].num_slots_held == 0


def test_a_failed_step_that_opened_nothing_releases_nothing_and_resends_its_releases():
    """The plan carrying r0's release and r2's admit fails before any slot op ran: r2 (reached by
    the plan) ends with an error and is not released; r0's release is sent again; r1, which
    the plan also ran, ends with an error too; a later request is admitted normally."""
    s = make_scheduler(max_num_seqs=3)
    r0, r1 = add_requests(s, 2)
    r1.params = r1.params.__class__(max_tokens=40, seed=1, ignore_eos=True)
    run_until(s, lambda: r0.is_finished)
    (r2,) = add_requests(s, 1, prefix="late")
    plan = run_step(s, error="boom", applied=AppliedOps())
    ops = slot_ops(plan)
    assert ops["releases"] == [(r0.key, r0.generation)] and (r2.key, r2.generation) in ops["admits"]
    assert r1.finish_reason == r2.finish_reason == "error"
    book = s.books[0]
    assert (r2.key, r2.generation) not in book.to_release
    assert set(book.to_release) == {(r0.key, r0.generation), (r1.key, r1.generation)}
    (r3,) = add_requests(s, 1, prefix="after")
    plan = run_step(s)
    assert set(slot_ops(plan)["releases"]) == {(r0.key, r0.generation), (r1.key, r1.generation)}
    run_until(s, lambda: r3.is_finished)
    run_step(s)
    assert book.num_slots_held == 0 and book.kv.num_free_blocks == 64 and len(s.rng) == 0


@pytest.mark.parametrize(("setting", "bound"), [(0, 4), (8, 8), (32, 16)])
def test_a_plan_runs_at_most_loops_while_prompt_pending_passes_while_a_prompt_waits(setting: int, bound: int) -> None:
    """loops_per_plan 16, D 4, one slot: while the second request waits to be placed, and while its
    prompt and first token are pending, a DecodeBatch runs at most loops_while_prompt_pending passes
    (0: D; never more than loops_per_plan); once nothing is pending, loops_per_plan."""
    scheduler = make_scheduler(loops_per_plan=16, loops_while_prompt_pending=setting, max_num_seqs=1)
    first, second = add_requests(scheduler, 2, max_tokens=6)
    passes: list[tuple[bool, int]] = []
    for _ in range(64):
        pending = bool(scheduler.waiting) or not second.num_outputs
        plan = run_step(scheduler)
        if plan is None:
            break
        passes += [(pending, b.max_passes) for b in plan.batches if isinstance(b, DecodeBatch)]
    assert first.status == second.status == RequestStatus.FINISHED
    assert {p for pending, p in passes if pending} == {bound}
    assert {p for pending, p in passes if not pending} == {16}
