"""A decode pass's GEMVs as one dependent chain: cuBLAS and cuBLASLt against split-K and strip GEMVs, plain and PDL.

Run on the GPU host (~1.5 minutes with --sweep, most of it compiling the candidates):

    python scripts/bench_gemv_chain.py [--rows 1,8] [--sweep] [--json $OUT/gemv-chain.json]

Issue 18: at 1 row the pass's four GEMMs per layer read their weights at ~55% of HBM bandwidth
with cuBLAS, and PDL could not help, since a cuBLAS kernel is not PDL-launched: no Triton-to-Triton
edge exists. The question this answers: does a chain of split-K GEMVs (rlt_worker/kernels/
splitk_gemv.py) launched with PDL, each loading its first weight tile before it waits for its
predecessor, beat the same chain of cuBLAS GEMMs?

The chain is Ouro-1.4B's decode GEMVs, nothing else (bf16, random weights of scale 1/√K, so
activations stay of order 1), `--layers` distinct layers so each weight comes from HBM:

    h [M, 2048] ─ q|k|v [6144, 2048] ─ o [2048, 2048] ─ gate|up [11264, 2048] ─ down [2048, 5632] ─ next layer
        each GEMV reads the first K columns of its predecessor's output (a view: no copy kernel)
        q|k|v → o: its first 2048 columns (the width of attention's output)
        gate|up → down: its first 5632 (the width of SwiGLU's output)

Modes: `cublas` (F.linear), `cublaslt` (F.linear with torch's preferred BLAS library cuBLASLt
while the chain runs and is captured), `splitk` (SplitKGemv, plain launches), `splitk_pdl`
(SplitKGemv with KernelLaunch(pdl=True)), `strip` and `strip_pdl` (StripGemv: rlt_worker/kernels/
strip_gemv.py, each program a strip of whole weight rows); one GEMV per shape serves all layers, as
FusedOuroModel's does. Each Triton mode takes one setting per shape from its family's candidates
(CANDIDATES, STRIP_CANDIDATES): the first (a guess), or with `--sweep` the fastest, timed first in
a single-shape chain (--layers GEMVs of that shape on one input: stream order serializes them as a
data dependency would, and a PDL launch waits on its predecessor whatever it reads) and picked by
time summed over the row counts (one setting serves every M: batch invariance).

Before timing, each mode is checked against cuBLAS: every shape's GEMV (layer 0) within one bf16
ulp (rtol 2⁻⁷, atol 2e-3), the whole chain's graph output within 0.1 relative (96 roundings
compound: a CPU simulation of two fp32 summation orders gives 0.02-0.03 after 24 layers; a wrong
chain gives ~1.4); each PDL mode's graph output bit-equal to its plain mode's, and each Triton
mode's graph bit-equal to its eager chain. Timing: the whole chain (4·layers GEMVs) captured in one
CUDA graph, warmed up, then --batches batches of --per-batch replays between CUDA events, the modes'
batches interleaved; the median batch, per chain. Reported per mode and M: ms per chain, GB/s of weights,
the ratio to cuBLAS (> 1: faster), the configs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rlt_worker.kernels.launch import PLAIN, KernelLaunch, interpreting  # noqa: E402
from rlt_worker.kernels.splitk_gemv import SplitKConfig, SplitKGemv  # noqa: E402
from rlt_worker.kernels.strip_gemv import StripConfig, StripGemv, split_k  # noqa: E402
from rlt_worker.models.ouro_fused import SPLITK_MAX_ROWS, STRIP_SETTINGS, Gemv, GemvSetting  # noqa: E402

# (name, out_features, in_features) of one layer's GEMVs in chain order (Ouro-1.4B, packed weights).
LAYER = (("q|k|v", 6144, 2048), ("o", 2048, 2048), ("gate|up", 11264, 2048), ("down", 2048, 5632))
MODES = ("cublas", "cublaslt", "splitk", "splitk_pdl", "strip", "strip_pdl")

# (block_n, block_k, splits, num_warps, num_stages) per shape, the first one the default. Seeded by
# the kernel's isolated sweep (docs/benchmarks/h200-splitk-sweep-7d64e4e.json: only tl.dot settings
# won, warps 4), adjusted for the loop-carried W tile: it lives in registers (BLOCK_N·BLOCK_K·2
# bytes over the threads, twice while the next one loads), so a 64-column tile gets 8 warps (4
# spill), and num_stages rings only x (tiny, from L2): 1, which saves the shared memory, but for
# one setting per shape at 3. Tiles of 16-64 columns × 128-512 of K, with the slices that give
# 1-4 waves of 132 SMs; dot only (multiply-add never won at 8 rows).
CANDIDATES: dict[str, tuple[tuple[int, int, int, int, int], ...]] = {
    "q|k|v": ((32, 256, 1, 4, 1), (32, 256, 2, 4, 1), (64, 256, 1, 8, 1), (64, 512, 1, 8, 1),
              (16, 512, 1, 4, 1), (32, 256, 1, 4, 3)),
    "o": ((16, 256, 1, 4, 1), (32, 256, 4, 4, 1), (16, 512, 1, 4, 1), (32, 256, 2, 4, 1),
          (32, 128, 4, 4, 1), (16, 256, 2, 4, 3)),
    "gate|up": ((32, 256, 1, 4, 1), (64, 256, 1, 8, 1), (32, 512, 1, 4, 1), (16, 512, 1, 4, 1),
                (32, 256, 2, 4, 1), (32, 256, 1, 4, 3)),
    "down": ((32, 256, 4, 4, 1), (64, 256, 4, 8, 1), (32, 512, 4, 4, 1), (32, 256, 8, 4, 1),
             (16, 256, 4, 4, 1), (32, 256, 4, 4, 3)),
}
# (block_n, num_warps) per shape to sweep, after the model's own setting (STRIP_SETTINGS), the
# default: the strip is block_n·K elements over 32·num_warps threads, 32-192 of them a thread
# (K = 5632 runs as 4096 + 2048 masked lanes).
STRIP_CANDIDATES: dict[str, tuple[tuple[int, int], ...]] = {
    "q|k|v": ((4, 4), (2, 4), (2, 2), (1, 2), (1, 4), (8, 4), (4, 8), (8, 8), (16, 8)),
    "o": ((4, 4), (2, 4), (1, 4), (2, 2), (1, 2), (4, 2), (4, 8), (8, 8), (8, 4)),
    "gate|up": ((4, 4), (2, 4), (2, 2), (8, 4), (4, 8), (8, 8), (16, 8), (4, 2), (16, 16)),
    "down": ((2, 8), (1, 4), (2, 4), (4, 8), (1, 2), (1, 8), (1, 1), (2, 2), (4, 16)),
}
GEMV_TOL = dict(rtol=2.0**-7, atol=2e-3)  # one bf16 ulp between two roundings of fp32 sums
CHAIN_RTOL = 0.1  # relative norm of the difference after the whole chain (module docstring)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,8")
    p.add_argument("--layers", type=int, default=24, help="distinct layers (Ouro-1.4B: 24)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--sweep", action="store_true", help="pick each shape's fastest candidate per split-K mode")
    p.add_argument("--batches", type=int, default=15, help="timed batches of replays (the median is reported)")
    p.add_argument("--per-batch", type=int, default=20, help="graph replays between two CUDA events")
    p.add_argument("--sweep-batches", type=int, default=5)
    p.add_argument("--sweep-per-batch", type=int, default=10)
    p.add_argument("--max-rows", type=int, default=SPLITK_MAX_ROWS, help="split-K's row bound (its BLOCK_M)")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def candidates(name: str) -> list[SplitKConfig]:
    """The shape's split-K settings to try, the default first."""
    return [SplitKConfig(bn, bk, s, nw, ns, True) for bn, bk, s, nw, ns in CANDIDATES[name]]


def strip_candidates(name: str) -> list[StripConfig]:
    """The shape's strip settings to try, the model's (bf16) first."""
    n, k = next((n, k) for layer_name, n, k in LAYER if layer_name == name)
    swept = [StripConfig(bn, nw) for bn, nw in STRIP_CANDIDATES[name]]
    own = STRIP_SETTINGS.get((n, k, torch.bfloat16))
    return [own, *(cfg for cfg in swept if cfg != own)] if own else swept


@dataclass(frozen=True)
class Family:
    """A Triton GEMV the chain can run: its settings per shape, how one is built, and its record."""

    candidates: Callable[[str], list]
    build: Callable[[int, int, GemvSetting, KernelLaunch, int, torch.device], Gemv]
    record: Callable[[GemvSetting, int, int, int], dict]


def splitk_record(cfg: SplitKConfig, n: int, k: int, max_rows: int) -> dict:
    """The setting, the slices it runs (a count that leaves a slice empty gives fewer) and its programs."""
    gemv = SplitKGemv(n, k, cfg, max_rows, "cpu")  # only for its slice count: a CPU workspace of a few KB
    return {**vars(cfg), "splits_run": gemv.splits, "programs": gemv.splits * math.ceil(n / cfg.block_n)}


def strip_record(cfg: StripConfig, n: int, k: int, max_rows: int) -> dict:
    """The setting, its programs and the strip's elements per thread (masked lanes included)."""
    del max_rows  # a strip has no row tile: rows loop over the strip in registers
    k_hi, k_lo, k_lo_pad = split_k(k)
    lanes = k_hi + (k_lo_pad if k_lo else 0)
    return {**vars(cfg), "programs": math.ceil(n / cfg.block_n),
            "strip_elements_per_thread": cfg.block_n * lanes // (32 * cfg.num_warps)}


FAMILIES = {
    "splitk": Family(candidates, lambda n, k, cfg, launch, rows, device: SplitKGemv(n, k, cfg, rows, device, launch),
                     splitk_record),
    "strip": Family(strip_candidates, lambda n, k, cfg, launch, rows, device: StripGemv(n, k, cfg, rows, launch),
                    strip_record),
}


def family_of(mode: str) -> str | None:
    """The Triton family a mode runs (splitk_pdl → splitk), or None for the cuBLAS modes."""
    name = mode.removesuffix("_pdl")
    return name if name in FAMILIES else None


@contextmanager
def blas_for(mode: str) -> Iterator[None]:
    """torch's preferred BLAS library for the mode (cuBLASLt for `cublaslt`), restored afterwards."""
    if mode != "cublaslt":
        yield
        return
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def layer_bytes(itemsize: int = 2) -> int:
    """One layer's weight bytes (bf16: 102,760,448)."""
    return sum(n * k for _, n, k in LAYER) * itemsize


def chain_input(y: torch.Tensor, in_features: int) -> torch.Tensor:
    """The next GEMV's input: the first in_features columns of its predecessor's output, as a view."""
    if y.dim() != 2 or y.shape[1] < in_features:
        raise ValueError(f"a GEMV of {in_features} inputs cannot follow an output of shape {tuple(y.shape)}")
    return y[:, :in_features]


Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def run_chain(linear: Linear, layers: list[list[torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
    """x through every layer's q|k|v → o → gate|up → down (weights in LAYER order); the last output."""
    h = x
    for weights in layers:
        for w in weights:
            h = linear(chain_input(h, w.shape[1]), w)
    return h


def gemv_linear(gemvs: dict[tuple[int, int], Gemv]) -> Linear:
    """F.linear's signature over one GEMV per weight shape."""
    return lambda x, w: gemvs[tuple(w.shape)](x, w)


def make_gemvs(configs: dict[str, GemvSetting], launch: KernelLaunch, max_rows: int, device: torch.device,
               layer: tuple[tuple[str, int, int], ...] | None = None,
               family: str = "splitk") -> dict[tuple[int, int], Gemv]:
    """One GEMV of `family` per shape of `layer` (name, out, in; LAYER by default), with that name's setting."""
    build = FAMILIES[family].build
    return {(n, k): build(n, k, configs[name], launch, max_rows, device) for name, n, k in layer or LAYER}


def capture(run: Callable[[], torch.Tensor], mode: str = "") -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """run() once eagerly (compiles, cuBLAS workspaces), then captured, both under the mode's BLAS
    library: the graph and its output tensor."""
    with blas_for(mode):
        run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
    return graph, out


def time_graph(graph: torch.cuda.CUDAGraph, batches: int, per_batch: int) -> float:
    """Median ms per replay over `batches` batches of `per_batch` back-to-back replays, after 3 warm-up ones."""
    return time_graphs({"graph": graph}, batches, per_batch)["graph"]


def time_graphs(graphs: dict[str, torch.cuda.CUDAGraph], batches: int, per_batch: int) -> dict[str, float]:
    """Median ms per replay of each graph (batches of `per_batch` back-to-back replays after 3 warm-up ones),
    their batches interleaved: clock drift falls on every mode alike."""
    for graph in graphs.values():
        for _ in range(3):
            graph.replay()
    times: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(batches):
        for name, graph in graphs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(per_batch):
                graph.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / per_batch)
    return {name: statistics.median(t) for name, t in times.items()}


def label(cfg: GemvSetting) -> str:
    """A setting in a few characters: N32 K256 S4 w4 st1 (S: the slices asked for), or a strip's N4 w4."""
    if isinstance(cfg, StripConfig):
        return f"N{cfg.block_n} w{cfg.num_warps}"
    return f"N{cfg.block_n} K{cfg.block_k} S{cfg.splits} w{cfg.num_warps} st{cfg.num_stages}"


def config_record(cfg: GemvSetting, n: int, k: int, max_rows: int) -> dict:
    """The setting's JSON record (its family's)."""
    return FAMILIES["strip" if isinstance(cfg, StripConfig) else "splitk"].record(cfg, n, k, max_rows)


def time_candidate(args: argparse.Namespace, gemv: Gemv, weights: list[torch.Tensor],
                   xs: dict[int, torch.Tensor]) -> dict[int, float]:
    """ms per single-shape chain (each weight once, one input) at each row count."""
    ms = {}
    for rows, x in xs.items():
        graph, _ = capture(lambda x=x: [gemv(x, w) for w in weights][-1])
        ms[rows] = time_graph(graph, args.sweep_batches, args.sweep_per_batch)
        del graph
    return ms


def sweep(args: argparse.Namespace, layers: list[list[torch.Tensor]], modes: dict[str, KernelLaunch],
          rows_list: list[int]) -> tuple[dict[str, dict[str, GemvSetting]], list[dict]]:
    """Each Triton mode's fastest candidate per shape (least ms summed over the row counts), each timed
    in a chain of --layers GEMVs of its shape; the JSON rows of every timing."""
    device = layers[0][0].device
    picked: dict[str, dict[str, GemvSetting]] = {mode: {} for mode in modes}
    results = []
    for i, (name, n, k) in enumerate(LAYER):
        weights = [layer[i] for layer in layers]
        chain_bytes = len(weights) * n * k * weights[0].element_size()
        xs = {rows: torch.randn(rows, k, device=device, dtype=weights[0].dtype) for rows in rows_list}
        for mode, launch in modes.items():
            family = FAMILIES[family_of(mode)]
            timed: list[tuple[GemvSetting, dict[int, float]]] = []
            for cfg in family.candidates(name):
                try:
                    ms = time_candidate(args, family.build(n, k, cfg, launch, args.max_rows, device), weights, xs)
                except Exception as exc:  # a setting the compiler cannot build (shared memory, registers): skip it
                    print(f"sweep {name:>7} {mode:>10} {label(cfg)}: skipped ({type(exc).__name__}: {str(exc)[:120]})")
                    continue
                timed.append((cfg, ms))
                results.append({"mode": mode, "shape": name, "config": config_record(cfg, n, k, args.max_rows),
                                "ms_per_chain": ms, "gb_per_s": {r: chain_bytes / (t * 1e6) for r, t in ms.items()}})
            if not timed:
                raise SystemExit(f"{name}: no candidate setting could be built for {mode}")
            picked[mode][name] = min(timed, key=lambda t: sum(t[1].values()))[0]
            cells = ", ".join(f"{label(cfg)} " + " ".join(f"{t * 1e3 / len(weights):.2f}" for t in ms.values())
                              for cfg, ms in timed)
            print(f"sweep {name:>7} {mode:>10} (µs per GEMV at rows {rows_list}): {cells}; "
                  f"picked {label(picked[mode][name])}", flush=True)
    return picked, results


def check(outputs: dict[str, torch.Tensor], eager: dict[str, torch.Tensor]) -> dict:
    """The chain's graph outputs against cuBLAS's (CHAIN_RTOL), and each Triton mode's graph against its
    eager chain launched plain with the same settings (bit-equal: for a PDL mode, PDL against plain);
    raises SystemExit on a failure. The relative errors, for the record."""
    ref = outputs["cublas"].float()
    report = {}
    for mode, out in outputs.items():
        rel = float((out.float() - ref).norm() / ref.norm())
        report[mode] = {"chain_rel_err_vs_cublas": rel, "finite": bool(torch.isfinite(out).all())}
        if not report[mode]["finite"] or rel > CHAIN_RTOL:
            raise SystemExit(f"{mode}: the chain's output is {rel:.3g} (relative) from cuBLAS's (> {CHAIN_RTOL})")
        if mode in eager:
            report[mode]["graph_bit_equal_eager_plain"] = equal = torch.equal(out, eager[mode])
            if not equal:
                raise SystemExit(f"{mode}: the graph replay differs from the eager chain launched plain"
                                 + (" (a PDL ordering bug)" if mode.endswith("_pdl") else ""))
    return report


def check_gemvs(linears: dict[str, Linear], layer: list[torch.Tensor], rows: int) -> dict:
    """Every shape's GEMV, every mode against cuBLAS on one input, within GEMV_TOL; the largest difference."""
    report = {}
    for (name, _, k), w in zip(LAYER, layer, strict=True):
        x = torch.randn(rows, k, device=w.device, dtype=w.dtype)
        want = F.linear(x, w)
        for mode, linear in linears.items():
            with blas_for(mode):
                got = linear(x, w)
            where = f"{mode} {name} M{rows}"
            torch.testing.assert_close(got, want, **GEMV_TOL, msg=lambda e, where=where: f"{where}: {e}")
            report[f"{mode} {name}"] = float((got.float() - want.float()).abs().max())
    return report


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available() or interpreting():
        raise SystemExit("bench_gemv_chain times compiled kernels in CUDA graphs: run it on a CUDA GPU "
                         "with TRITON_INTERPRET unset")
    device, dtype = torch.device("cuda"), torch.bfloat16
    rows_list, mode_names = ints(args.rows), args.modes.split(",")
    if "cublas" not in mode_names or set(mode_names) - set(MODES):
        raise SystemExit(f"--modes: a subset of {MODES} with cublas (the reference), got {args.modes}")
    pdl = KernelLaunch.for_device(True, device)
    if any(m.endswith("_pdl") for m in mode_names) and not pdl.pdl:
        raise SystemExit(f"{torch.cuda.get_device_name()} has no programmatic dependent launch (sm_90+)")
    launches = {m: (pdl if m.endswith("_pdl") else PLAIN) for m in mode_names if family_of(m)}
    gen = torch.Generator(device=device).manual_seed(0)
    layers = [[(torch.randn(n, k, device=device, generator=gen) * k**-0.5).to(dtype) for _, n, k in LAYER]
              for _ in range(args.layers)]
    chain_bytes = args.layers * layer_bytes(dtype.itemsize)
    print(f"{torch.cuda.get_device_name()}: {args.layers} layers × 4 GEMVs, {chain_bytes / 1e9:.3f} GB of "
          f"weights a chain ({layer_bytes(dtype.itemsize) / 1e6:.1f} MB a layer), rows {rows_list}", flush=True)

    started = time.perf_counter()
    if args.sweep:
        configs, sweep_results = sweep(args, layers, launches, rows_list)
    else:
        configs = {m: {name: FAMILIES[family_of(m)].candidates(name)[0] for name, _, _ in LAYER} for m in launches}
        sweep_results = []
    sweep_s = time.perf_counter() - started
    linears: dict[str, Linear] = {m: F.linear for m in mode_names if not family_of(m)}
    plain_twins: dict[str, Linear] = {}  # each Triton mode's settings, launched plain: the bitwise reference
    for mode, launch in launches.items():
        linears[mode] = gemv_linear(make_gemvs(configs[mode], launch, args.max_rows, device, family=family_of(mode)))
        plain_twins[mode] = gemv_linear(make_gemvs(configs[mode], PLAIN, args.max_rows, device,
                                                     family=family_of(mode)))

    report_checks, results = {}, []
    for rows in rows_list:
        report_checks[f"gemv M{rows}"] = check_gemvs({m: f for m, f in linears.items() if m != "cublas"},
                                                     layers[0], rows)
        x = torch.randn(rows, LAYER[0][2], device=device, dtype=dtype, generator=gen)
        graphs, outputs, eager = {}, {}, {}
        for mode, linear in linears.items():
            if mode in plain_twins:
                eager[mode] = run_chain(plain_twins[mode], layers, x)
            graphs[mode], out = capture(lambda linear=linear, x=x: run_chain(linear, layers, x), mode)
            graphs[mode].replay()
            torch.cuda.synchronize()
            outputs[mode] = out
        report_checks[f"chain M{rows}"] = check(outputs, eager)
        times = time_graphs(graphs, args.batches, args.per_batch)
        for mode, ms in times.items():
            results.append({"mode": mode, "rows": rows, "ms_per_chain": ms, "us_per_gemv": ms * 1e3 / (4 * args.layers),
                            "gb_per_s": chain_bytes / (ms * 1e6), "x_cublas": times["cublas"] / ms})
        del graphs, outputs, eager

    wall_s = {"sweep": sweep_s, "total": time.perf_counter() - started}
    print(f"\n{'mode':>10} {'rows':>4} {'ms/chain':>9} {'µs/GEMV':>8} {'GB/s':>6} {'×cublas':>8}")
    for r in results:
        print(f"{r['mode']:>10} {r['rows']:>4} {r['ms_per_chain']:>9.3f} {r['us_per_gemv']:>8.2f} "
              f"{r['gb_per_s']:>6.0f} {r['x_cublas']:>8.3f}")
    for mode, shapes in configs.items():
        print(f"{mode:>10} configs: " + ", ".join(f"{name} {label(cfg)}" for name, cfg in shapes.items()))
    print(f"wall: sweep {wall_s['sweep']:.1f} s, total {wall_s['total']:.1f} s (after start-up)")
    if args.json:
        config_json = {mode: {name: config_record(configs[mode][name], n, k, args.max_rows) for name, n, k in LAYER}
                       for mode in configs}
        write_json(args.json, {"dtype": str(dtype), "layers": args.layers, "rows": rows_list,
                               "chain_weight_bytes": chain_bytes, "batches": args.batches,
                               "per_batch": args.per_batch, "swept": args.sweep, "wall_s": wall_s,
                               "configs": config_json, "checks": report_checks, "results": results,
                               "sweep": sweep_results})


def write_json(path: str, report: dict) -> None:
    import triton

    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "commit": os.environ.get("RLT_COMMIT") or git_commit(), **report}, f, indent=1)


def git_commit() -> str | None:
    """The checkout's commit (with `-dirty` if it has changes), or None outside a git checkout."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = head.stdout.strip()
    return (commit + ("-dirty" if dirty.stdout.strip() else "")) if head.returncode == 0 and commit else None


if __name__ == "__main__":
    main()
