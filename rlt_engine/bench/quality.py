"""rlt-bench quality: bits per byte of a trained model on held-out text, at fixed depths and under the gate.

The engine itself scores the text by teacher forcing (`SamplingParams.forced_tokens`): each
held-out window's first byte is the prompt and the rest are forced outputs, so every scored
position runs through the scheduler, the exit policy and the paged KV exactly as generation
does. A window of n + 1 bytes scores outputs 1 … n − 1: output 0 comes from the prompt
position, which always runs all D loops.

    fixed d      every generated position runs d loops (d = 1 … D)
    ouro t       Ouro's gate exits at the first loop whose exit CDF reaches t

    rlt-bench quality                                   # tiny-ouro-py, 64 windows, the table
    rlt-bench quality --plot docs/quality.png --json quality.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import msgspec

from protocol.messages import SamplingParams
from rlt_engine.bench.corpus import held_out_windows, load_corpus
from rlt_engine.bench.report import log, pyplot


@dataclass(frozen=True)
class QualityRow:
    policy: str  # "fixed" or "ouro"
    setting: float  # loops (fixed) or threshold (ouro)
    bits_per_byte: float
    mean_loops: float
    scored_bytes: int

    @property
    def label(self) -> str:
        return f"fixed {int(self.setting)}" if self.policy == "fixed" else f"ouro {self.setting:g}"


def score(llm, windows: list[list[int]], params: SamplingParams) -> tuple[float, float, int]:
    """(bits per byte, mean loops per scored byte, scored bytes) of the windows under `params`."""
    requests = [msgspec.structs.replace(params, max_tokens=len(w) - 1, forced_tokens=w[1:]) for w in windows]
    outputs = llm.generate([w[:1] for w in windows], requests)
    nats, loops, count = 0.0, 0, 0
    for out in outputs:
        if out.finish_reason != "length":
            raise RuntimeError(f"request {out.request_id} ended {out.finish_reason!r} before its last forced token")
        nats -= sum(out.logprobs[1:])
        loops += sum(out.exit_depths[1:])
        count += len(out.logprobs) - 1
    return nats / count / math.log(2), loops / count, count


def run(args: argparse.Namespace) -> list[QualityRow]:
    from rlt_engine.llm import LLM

    corpus = load_corpus()
    log(f"held-out text: {len(corpus.held_out):,} bytes ({corpus.held_out_rule}), corpus sha256 {corpus.sha256[:16]}…")
    llm = LLM(args.model, workers=args.workers, device=args.device, dtype=args.dtype, exit_mode="ouro",
              max_num_seqs=args.max_num_seqs)
    try:
        length = args.length or llm.engine.model_info.max_model_len - 1
        windows = held_out_windows(corpus.held_out, length, args.windows).tolist()
        base = SamplingParams(temperature=0.0, logprobs=1, ignore_eos=True, seed=args.seed)
        settings = [("fixed", float(d), msgspec.structs.replace(base, max_loops=d)) for d in args.loops]
        settings += [("ouro", t, msgspec.structs.replace(base, exit_threshold=t)) for t in args.thresholds]
        rows = []
        for policy, setting, params in settings:
            start = time.monotonic()
            bpb, mean_loops, count = score(llm, windows, params)
            rows.append(QualityRow(policy, setting, round(bpb, 4), round(mean_loops, 3), count))
            took = time.monotonic() - start
            log(f"{rows[-1].label:>9}: {bpb:.4f} bits/byte at {mean_loops:.3f} loops/byte ({took:.1f} s)")
        return rows
    finally:
        llm.close()


def table(rows: Sequence[QualityRow]) -> str:
    lines = ["| policy | bits per byte | mean loops per byte |", "|---|---:|---:|"]
    lines += [f"| {r.label} | {r.bits_per_byte:.4f} | {r.mean_loops:.3f} |" for r in rows]
    return "\n".join(lines)


def gate_against_fixed(rows: Sequence[QualityRow]) -> list[str]:
    """For each gate setting: the fixed-depth loss at the same mean loops (linear between the
    fixed points) and whether the gate is better."""
    fixed = sorted((r.mean_loops, r.bits_per_byte) for r in rows if r.policy == "fixed")
    verdicts = []
    for r in rows:
        if r.policy != "ouro" or len(fixed) < 2 or not fixed[0][0] <= r.mean_loops <= fixed[-1][0]:
            continue
        upper = next(i for i, (x, _) in enumerate(fixed) if x >= r.mean_loops)
        (x0, y0), (x1, y1) = fixed[max(upper - 1, 0)], fixed[upper]
        at_equal = y0 if x1 == x0 else y0 + (y1 - y0) * (r.mean_loops - x0) / (x1 - x0)
        better = "better" if r.bits_per_byte < at_equal else "not better"
        verdicts.append(f"{r.label}: {r.bits_per_byte:.4f} vs fixed depth at {r.mean_loops:.3f} loops "
                        f"{at_equal:.4f} bits/byte ({better})")
    return verdicts


def plot(rows: Sequence[QualityRow], path: str, title: str) -> bool:
    """Bits per byte against mean loops: the fixed-depth line and the gate's points."""
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for policy, style in (("fixed", "o-"), ("ouro", "s--")):
        points = sorted((r.mean_loops, r.bits_per_byte, r.label) for r in rows if r.policy == policy)
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], style, label=policy)
            for x, y, label in points:
                ax.annotate(label.split()[1], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("mean loops per byte")
    ax.set_ylabel("held-out bits per byte")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rlt-bench quality", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-ouro-py", help="an Ouro checkpoint with a trained exit gate")
    p.add_argument("--device", default=None, help="cuda if available, else cpu")
    p.add_argument("--dtype", default=None, help="bfloat16 on cuda, float32 on cpu")
    p.add_argument("--workers", type=int, default=0, help="0 runs the model in this process")
    p.add_argument("--windows", type=int, default=64, help="held-out windows scored per policy")
    p.add_argument("--length", type=int, default=0, help="bytes per window after the prompt byte (0: context − 1)")
    p.add_argument("--loops", type=_ints, default=[1, 2, 3, 4], help="fixed depths")
    p.add_argument("--thresholds", type=_floats, default=[0.3, 0.5, 0.7, 0.9], help="ouro exit thresholds")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--plot", default=None, help="write a PNG of bits per byte against mean loops (needs matplotlib)")
    args = p.parse_args(argv)
    if args.windows < 1:
        p.error("--windows must be at least 1")
    if args.length < 0 or args.length == 1:
        p.error("--length must be 0 (auto) or at least 2")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rows = run(args)
    print(table(rows))
    for verdict in gate_against_fixed(rows):
        print(verdict)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"model": args.model, "windows": args.windows, "rows": [asdict(r) for r in rows]}, f, indent=1)
    if args.plot and plot(rows, args.plot, f"{args.model}: held-out Python stdlib, {args.windows} windows"):
        log(f"plot written to {args.plot}")
    return 0
