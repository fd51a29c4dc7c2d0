"""rlt-bench quality: bits per byte of a trained model on held-out text, at fixed depths and under the gate.

The engine itself scores the text by teacher forcing (`SamplingParams.forced_tokens`): each
held-out window's first token is the prompt and the rest are forced outputs, so every scored
position runs through the scheduler, the exit policy and the paged KV exactly as generation
does. A window of n + 1 tokens scores outputs 1 … n − 1: output 0 comes from the prompt
position, which always runs all D loops. Bits per byte = the scored tokens' nats / (ln 2 × the
UTF-8 bytes of their text), summed over all windows (held_out.py says how bytes are counted and
where the held-out text comes from).

    fixed d      every generated position runs d loops (d = 1 … D)
    ouro t       Ouro's gate exits at the first loop whose exit CDF reaches t

Besides the table it says whether the loss falls with depth and which thresholds reach fixed
D's loss within 1% at ≤ 3 mean loops (issue 20's target, shaded in the plot).

    rlt-bench quality                                   # tiny-ouro-py, 40 windows, the table
    rlt-bench quality --data .train/tiny-ouro-py --plot docs/quality.png --json quality.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import msgspec

from protocol.messages import SamplingParams
from rlt_engine.bench.corpus import held_out_windows
from rlt_engine.bench.held_out import HeldOut, held_out_for, trained_on
from rlt_engine.bench.report import log, pyplot
from rlt_engine.checkpoints import resolve_model

TARGET_TOLERANCE = 0.01  # within 1% of fixed D's bits per byte …
TARGET_MAX_LOOPS = 3.0  # … at no more than 3 mean loops per token


@dataclass(frozen=True)
class QualityRow:
    policy: str  # "fixed" or "ouro"
    setting: float  # loops (fixed) or threshold (ouro)
    bits_per_byte: float
    mean_loops: float  # per scored token
    scored_bytes: int
    scored_tokens: int = 0

    @property
    def label(self) -> str:
        return f"fixed {int(self.setting)}" if self.policy == "fixed" else f"ouro {self.setting:g}"


def score(llm, windows: list[list[int]], params: SamplingParams, held_out: HeldOut) -> tuple[float, float, int, int]:
    """(bits per byte, mean loops per scored token, scored bytes, scored tokens) of the windows under `params`."""
    requests = [msgspec.structs.replace(params, max_tokens=len(w) - 1, forced_tokens=w[1:]) for w in windows]
    outputs = llm.generate([w[:1] for w in windows], requests)
    nats, loops, tokens, num_bytes = 0.0, 0, 0, 0
    for window, out in zip(windows, outputs, strict=True):
        if out.finish_reason != "length":
            raise RuntimeError(f"request {out.request_id} ended {out.finish_reason!r} before its last forced token")
        nats -= sum(out.logprobs[1:])
        loops += sum(out.exit_depths[1:])
        tokens += len(out.logprobs) - 1
        num_bytes += held_out.bytes_of(window[2:])  # output i is forced token window[1 + i]; output 0 is not scored
    return nats / num_bytes / math.log(2), loops / tokens, num_bytes, tokens


def kv_blocks_for(model: str, windows: int, length: int, block_size: int = 16) -> int | None:
    """KV blocks for every window at once (a plane per loop depth), from the checkpoint's config.json;
    None (the engine's default) for a built-in model or a config without Ouro's keys."""
    path = Path(resolve_model(model)) / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    if "total_ut_steps" not in config or "max_position_embeddings" not in config:
        return None
    positions = (length or config["max_position_embeddings"] - 1) + 1
    return windows * config["total_ut_steps"] * (math.ceil(positions / block_size) + 1)


def run(args: argparse.Namespace) -> tuple[list[QualityRow], HeldOut]:
    from rlt_engine.llm import LLM

    num_blocks = args.num_blocks or kv_blocks_for(args.model, min(args.windows, args.max_num_seqs), args.length)
    llm = LLM(args.model, workers=args.workers, device=args.device, dtype=args.dtype, exit_mode="ouro",
              max_num_seqs=args.max_num_seqs, num_blocks=num_blocks)
    try:
        info = llm.engine.model_info
        held_out = held_out_for(args.model, info.vocab_size, info.eos_token_ids[0], args.data)
        log(f"held-out text: {len(held_out.ids):,} tokens, {held_out.bytes_of(held_out.ids):,} bytes from "
            f"{held_out.source}; corpus sha256 {held_out.corpus_sha256[:16]}…")
        recorded = trained_on(args.model)
        if recorded and recorded != held_out.corpus_sha256:
            log(f"warning: the model's training.json records corpus sha256 {recorded[:16]}…, not this one "
                "(another interpreter's standard library?): pass --data with the prepared directory")
        length = args.length or info.max_model_len - 1
        windows = held_out_windows(held_out.ids, length, args.windows).tolist()
        base = SamplingParams(temperature=0.0, logprobs=1, ignore_eos=True, seed=args.seed)
        settings = [("fixed", float(d), msgspec.structs.replace(base, max_loops=d)) for d in args.loops]
        settings += [("ouro", t, msgspec.structs.replace(base, exit_threshold=t)) for t in args.thresholds]
        rows = []
        for policy, setting, params in settings:
            start = time.monotonic()
            bpb, mean_loops, num_bytes, tokens = score(llm, windows, params, held_out)
            rows.append(QualityRow(policy, setting, round(bpb, 4), round(mean_loops, 3), num_bytes, tokens))
            took = time.monotonic() - start
            log(f"{rows[-1].label:>9}: {bpb:.4f} bits/byte at {mean_loops:.3f} loops/token ({took:.1f} s)")
        return rows, held_out
    finally:
        llm.close()


def full_depth(rows: Sequence[QualityRow]) -> QualityRow | None:
    """The deepest fixed-depth row (loop D's loss, the reference of the target)."""
    fixed = [r for r in rows if r.policy == "fixed"]
    return max(fixed, key=lambda r: r.setting) if fixed else None


def reaches_full_depth(row: QualityRow, reference: QualityRow) -> bool:
    """Within TARGET_TOLERANCE of the reference's bits per byte at ≤ TARGET_MAX_LOOPS mean loops."""
    return row.bits_per_byte <= reference.bits_per_byte * (1 + TARGET_TOLERANCE) and row.mean_loops <= TARGET_MAX_LOOPS


def table(rows: Sequence[QualityRow]) -> str:
    """Markdown: each row's bits per byte, mean loops and its distance from fixed D."""
    reference = full_depth(rows)
    name = reference.label if reference else "fixed D"
    lines = [f"| policy | bits per byte | mean loops per token | vs {name} |", "|---|---:|---:|---:|"]
    for r in rows:
        versus = f"{100 * (r.bits_per_byte / reference.bits_per_byte - 1):+.2f}%" if reference else "–"
        lines.append(f"| {r.label} | {r.bits_per_byte:.4f} | {r.mean_loops:.3f} | {versus} |")
    return "\n".join(lines)


def depth_verdict(rows: Sequence[QualityRow]) -> str | None:
    """Whether bits per byte falls at every added loop of the fixed depths."""
    fixed = sorted((r for r in rows if r.policy == "fixed"), key=lambda r: r.setting)
    if len(fixed) < 2:
        return None
    falls = all(b.bits_per_byte < a.bits_per_byte for a, b in itertools.pairwise(fixed))
    chain = " > ".join(f"{r.bits_per_byte:.4f}" for r in fixed) if falls else ", ".join(
        f"{r.label} {r.bits_per_byte:.4f}" for r in fixed)
    return f"deeper is better: {'yes' if falls else 'NO'} ({chain})"


def target_verdict(rows: Sequence[QualityRow]) -> str | None:
    """Which gate thresholds reach fixed D within 1% at ≤ 3 mean loops (issue 20's target)."""
    reference = full_depth(rows)
    gates = [r for r in rows if r.policy == "ouro"]
    if reference is None or not gates:
        return None
    hits = [r for r in gates if reaches_full_depth(r, reference)]
    goal = (f"within {100 * TARGET_TOLERANCE:g}% of {reference.label} ({reference.bits_per_byte:.4f}) "
            f"at ≤ {TARGET_MAX_LOOPS:g} mean loops")
    if not hits:
        return f"gate target ({goal}): NOT met by any threshold"
    best = min(hits, key=lambda r: r.mean_loops)
    return (f"gate target ({goal}): met by {', '.join(r.label for r in hits)}; "
            f"fewest loops {best.label}: {best.bits_per_byte:.4f} at {best.mean_loops:.3f} loops")


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
    """Bits per byte against mean loops: the fixed-depth line, the gate's points and, shaded, the
    target region (within 1% of fixed D's loss at ≤ 3 mean loops)."""
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
    reference = full_depth(rows)
    if reference is not None:
        (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
        bound = reference.bits_per_byte * (1 + TARGET_TOLERANCE)
        ax.fill_between([x0, TARGET_MAX_LOOPS], y0, bound, color="tab:green", alpha=0.12, linewidth=0,
                        label=f"≤ {100 * TARGET_TOLERANCE:g}% above {reference.label}, ≤ {TARGET_MAX_LOOPS:g} loops")
        ax.set_xlim(x0, x1)
        ax.set_ylim(y0, max(y1, bound))
    ax.set_xlabel("mean loops per token")
    ax.set_ylabel("held-out bits per byte")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
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
    p.add_argument("--data", default=None,
                   help="a `scripts/train_tiny.py prepare` directory: score its pre-tokenized held-out ids")
    p.add_argument("--windows", type=int, default=40, help="held-out windows scored per policy")
    p.add_argument("--length", type=int, default=0, help="tokens per window after the prompt token (0: context − 1)")
    p.add_argument("--loops", type=_ints, default=[1, 2, 3, 4], help="fixed depths")
    p.add_argument("--thresholds", type=_floats, default=[0.3, 0.5, 0.7, 0.8, 0.9], help="ouro exit thresholds")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--num-blocks", type=int, default=0,
                   help="KV blocks per worker (0: enough for every window at once, from config.json)")
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
    rows, held_out = run(args)
    print(table(rows))
    verdicts = [v for v in (depth_verdict(rows), target_verdict(rows)) if v]
    for verdict in [*verdicts, *gate_against_fixed(rows)]:
        print(verdict)
    print(f"held-out corpus sha256 {held_out.corpus_sha256} ({held_out.source})")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"model": args.model, "windows": args.windows, "length": args.length,
                       "corpus_sha256": held_out.corpus_sha256, "held_out_source": held_out.source,
                       "verdicts": verdicts, "rows": [asdict(r) for r in rows]}, f, indent=1)
    title = f"{args.model}: held-out Python stdlib ({held_out.corpus_sha256[:8]}), {args.windows} windows"
    if args.plot and plot(rows, args.plot, title):
        log(f"plot written to {args.plot}")
    return 0
