"""What the slow inter-token gaps of a closed loop hold: the engine steps between two deliveries.

    python scripts/profile_itl.py OUT_DIR [--exit trace] [--concurrency 32] [--variants plain,gc_frozen,mixed]

Issue 19's ITL p99 / p50 at c = 32 is 5.8 (target ≤ 2), with and without mixed batches, and its
cause was not known. A request's gap is the time between two of its deliveries, spread over the
tokens the later one brought (the benchmark's ITL). This script runs the benchmark's closed loop
(2·c requests, 1,024-token prompts, 128 outputs, workers = 0) with every engine step timed and
every plan it submitted summarized (prompt tokens run in passes of their own, prompt tokens riding
the loop passes, loop rows and decode passes; a step that submitted nothing is a `collect`),
Python's garbage collections timed by generation (gc.callbacks), and the runner's graph captures
counted per step. Then, for the gaps at or above
the ITL p99 and for typical ones (p40 … p60), what the steps ending inside them held, on average.

Variants, on one engine (`--mixed`: with mixed batches), each a warm-up run and a timed run, both
from an empty prefix cache: `plain`, and `gc_frozen` (gc.freeze() after the warm-up, so that a
collection does not walk the objects the engine and the model hold since start-up). Writes
OUT_DIR/profile_itl.json. `--model toy-ouro --device cpu --prompt-len 24
--output-len 6 --concurrency 4` runs the same code on the CPU (a smoke test).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field

from profile_ouro_gap import add_closed_loop_args, closed_loop_engine  # scripts/, this script's folder

from protocol.messages import DecodeBatch, ExecutionPlan, PrefillBatch, RecurrentBatch
from rlt_engine.bench.throughput import cold_closed_loop, percentile

VARIANTS = ("plain", "gc_frozen")


@dataclass
class Step:
    start: float
    end: float = 0.0
    prompt_tokens: int = 0  # in PREFILL passes of their own
    riding_tokens: int = 0  # riding the loop passes (mixed batches)
    loop_rows: int = 0  # DecodeBatch and RecurrentBatch rows
    decode_passes: int = 0  # the DecodeBatches' max_passes, summed over the step's plans
    plans: int = 0
    gc_ms: dict[int, float] = field(default_factory=lambda: defaultdict(float))  # generation → ms
    captures: int = 0

    @property
    def kind(self) -> str:
        parts = [name for name, n in (("prefill", self.prompt_tokens), ("riding", self.riding_tokens),
                                      ("loop", self.loop_rows)) if n]
        return "+".join(parts) or ("collect" if not self.plans else "other")


class StepRecorder:
    """Times every engine.step, and what each one submitted, collected and spent in gc."""

    def __init__(self, engine) -> None:
        self.engine, self.steps, self.deliveries = engine, [], []  # deliveries: (request, tokens, time, finished)
        self._real_step, self._gc_start, self._active = engine.step, 0.0, False
        self._runner = getattr(getattr(engine.executor, "_worker", None), "runner", None)
        engine.add_plan_listener(self._on_plan)
        gc.callbacks.append(self._on_gc)

    def close(self) -> None:
        gc.callbacks.remove(self._on_gc)
        self.stop()

    def record(self) -> None:
        self.steps, self.deliveries, self._active = [], [], True
        self.engine.step = self._step

    def stop(self) -> None:
        self._active = False
        self.engine.step = self._real_step

    def _captures(self) -> int:
        stats = self._runner.graph_stats if self._runner is not None else None
        return stats.get("lazy_captures", 0) if stats else 0

    def _step(self, *args, **kwargs):
        step = Step(start=time.perf_counter())
        self.steps.append(step)
        before = self._captures()
        outputs = self._real_step(*args, **kwargs)
        step.end = time.perf_counter()
        step.captures = self._captures() - before
        self.deliveries.extend((out.request_id, out.num_tokens, step.end, out.finished) for out in outputs)
        return outputs

    def _on_plan(self, worker: int, plan: ExecutionPlan) -> None:
        if not (self._active and self.steps):
            return
        step = self.steps[-1]
        step.plans += 1
        for batch in plan.batches:
            if isinstance(batch, PrefillBatch):
                tokens = int(batch.col("query_lens").sum())
                if batch.rides_loop_passes:
                    step.riding_tokens += tokens
                else:
                    step.prompt_tokens += tokens
            elif isinstance(batch, DecodeBatch):
                step.loop_rows += batch.num_rows
                step.decode_passes += batch.max_passes
            elif isinstance(batch, RecurrentBatch):
                step.loop_rows += batch.num_rows

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._active and self.steps:
            self.steps[-1].gc_ms[info["generation"]] += (time.perf_counter() - self._gc_start) * 1e3


def gaps(deliveries: list[tuple[str, int, float, bool]]) -> list[tuple[float, float, int, bool]]:
    """Every request's gaps (previous delivery, this one, new tokens, whether this one finished the
    request), from its second delivery on."""
    last: dict[str, tuple[int, float]] = {}
    out = []
    for request, tokens, t, finished in deliveries:
        if request in last and tokens > last[request][0]:
            out.append((last[request][1], t, tokens - last[request][0], finished))
        if request not in last or tokens > last[request][0]:
            last[request] = (tokens, t)
    return out


def what_gaps_hold(steps: list[Step], chosen: list[tuple[float, float, int, bool]]) -> dict:
    """The mean over `chosen` gaps of what their steps (those ending inside the gap) held; `last`: the
    share of gaps that end with the request's finished output (its last tokens)."""
    sums: dict[str, float] = defaultdict(float)
    kinds: dict[str, int] = defaultdict(int)
    for t0, t1, _, finished in chosen:
        inside = [s for s in steps if t0 < s.end <= t1]
        sums["gap_ms"] += (t1 - t0) * 1e3
        sums["last"] += finished
        sums["steps"] += len(inside)
        for s in inside:
            sums["prompt_tokens"] += s.prompt_tokens
            sums["riding_tokens"] += s.riding_tokens
            sums["decode_passes"] += s.decode_passes
            sums["gc_ms"] += sum(s.gc_ms.values())
            sums["gc_gen2_ms"] += s.gc_ms.get(2, 0.0)
            sums["captures"] += s.captures
            kinds[s.kind] += 1
        sums["longest_step_ms"] += max(((s.end - s.start) * 1e3 for s in inside), default=0.0)
    n = max(len(chosen), 1)
    return {"gaps": len(chosen), **{k: round(v / n, 3) for k, v in sums.items()},
            "step_kinds": dict(sorted(kinds.items(), key=lambda kv: -kv[1]))}


def slowest(steps: list[Step], all_gaps: list[tuple[float, float, int, bool]], count: int = 6) -> list[dict]:
    """The `count` slowest gaps per token, each with its steps in order (kind, ms, what they ran)."""
    ranked = sorted(all_gaps, key=lambda g: -(g[1] - g[0]) / g[2])[:count]
    return [{"per_token_ms": round((t1 - t0) / k * 1e3, 2), "tokens": k, "last": finished,
             "steps": [[s.kind, round((s.end - s.start) * 1e3, 2), s.prompt_tokens, s.riding_tokens, s.loop_rows,
                        s.decode_passes, round(sum(s.gc_ms.values()), 2), s.captures]
                       for s in steps if t0 < s.end <= t1]}
            for t0, t1, k, finished in ranked]


def step_table(steps: list[Step]) -> dict:
    """Per step kind: count and wall ms (median, p99, max); gc and captures over all steps."""
    by_kind: dict[str, list[float]] = defaultdict(list)
    for s in steps:
        by_kind[s.kind].append((s.end - s.start) * 1e3)
    table = {kind: {"steps": len(ms), "p50_ms": round(statistics.median(ms), 2),
                    "p99_ms": round(percentile(ms, 99), 2), "max_ms": round(max(ms), 2)}
             for kind, ms in sorted(by_kind.items(), key=lambda kv: -len(kv[1]))}
    gc_by_gen: dict[int, float] = defaultdict(float)
    for s in steps:
        for gen, ms in s.gc_ms.items():
            gc_by_gen[gen] += ms
    return {"by_kind": table, "gc_ms_by_generation": {str(g): round(ms, 2) for g, ms in sorted(gc_by_gen.items())},
            "longest_gc_step_ms": round(max((sum(s.gc_ms.values()) for s in steps), default=0.0), 2),
            "captures": sum(s.captures for s in steps)}


def run_variant(engine, recorder: StepRecorder, jobs, c: int, frozen: bool, seconds: float) -> dict:
    cold_closed_loop(engine, jobs, c, time.perf_counter() + seconds)  # warm-up
    if frozen:
        gc.collect()
        gc.freeze()
    recorder.record()
    run = cold_closed_loop(engine, jobs, c, time.perf_counter() + seconds)
    recorder.stop()
    if frozen:
        gc.unfreeze()
    all_gaps = gaps(recorder.deliveries)
    per_token = sorted(g for t0, t1, k, _ in all_gaps for g in [(t1 - t0) / k] * k)
    p40, p50, p60, p99 = (percentile(per_token, q) for q in (40, 50, 60, 99))
    slow = [g for g in all_gaps if (g[1] - g[0]) / g[2] >= p99]
    typical = [g for g in all_gaps if p40 <= (g[1] - g[0]) / g[2] <= p60]
    summary = run.summary()
    return {"tok_s": round(run.tokens_per_s, 1), "itl_p50_ms": round(summary["itl_p50_s"] * 1e3, 2),
            "itl_p99_ms": round(summary["itl_p99_s"] * 1e3, 2), "recomputed_p50_ms": round(p50 * 1e3, 2),
            "recomputed_p99_ms": round(p99 * 1e3, 2), "steps": len(recorder.steps),
            "slow_gaps": what_gaps_hold(recorder.steps, slow), "typical_gaps": what_gaps_hold(recorder.steps, typical),
            "step_table": step_table(recorder.steps),
            "slowest": slowest(recorder.steps, all_gaps),
            "slowest_columns": ["kind", "ms", "prompt_tokens", "riding_tokens", "loop_rows", "decode_passes", "gc_ms",
                                "captures"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir")
    add_closed_loop_args(p, mixed=False)
    p.add_argument("--variants", default="plain,gc_frozen", help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--seconds", type=float, default=60.0, help="deadline of each run")
    args = p.parse_args()
    variants = args.variants.split(",")
    if unknown := set(variants) - set(VARIANTS):
        p.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    c = args.concurrency
    report: dict = {"exit": args.exit, "mixed": args.mixed, "concurrency": c, "variants": {}}
    llm, jobs = closed_loop_engine(args)
    engine = llm.engine
    recorder = StepRecorder(engine)
    try:
        for variant in variants:
            result = run_variant(engine, recorder, jobs, c, variant == "gc_frozen", args.seconds)
            report["variants"][variant] = result
            print(variant, json.dumps({k: result[k] for k in ("tok_s", "itl_p50_ms", "itl_p99_ms")}), flush=True)
            print("  slow gaps:", json.dumps(result["slow_gaps"]), flush=True)
            print("  typical gaps:", json.dumps(result["typical_gaps"]), flush=True)
    finally:
        recorder.close()
        llm.close()
    with open(f"{args.out_dir}/profile_itl.json", "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
