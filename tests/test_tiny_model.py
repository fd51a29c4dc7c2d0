"""The shipped trained model `tiny-ouro-py`, its training script and `rlt-bench quality` / `greedy`."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from protocol.messages import SamplingParams
from rlt_engine.bench.corpus import (
    ExtraText,
    StdlibText,
    held_out_windows,
    is_held_out,
    read_site_packages,
    read_stdlib,
)
from rlt_engine.bench.greedy import PROMPTS, continue_prompts, judge, meets_target
from rlt_engine.bench.held_out import held_out_for
from rlt_engine.bench.prepared import EOS, load_prepared, prepare
from rlt_engine.bench.quality import QualityRow, depth_verdict, gate_against_fixed, score, target_verdict
from rlt_engine.bench.training_text import definition_documents, summary_docstrings
from rlt_engine.checkpoints import DEFAULT_MODEL, resolve_model
from rlt_engine.cli import main
from rlt_engine.llm import LLM
from rlt_engine.tokenizer import HFTokenizer, byte_level_pieces, load_tokenizer
from rlt_worker.models.loader import load_model

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = Path(resolve_model("tiny-ouro-py"))
SMALL = ["--hidden", "64", "--layers", "1", "--intermediate", "128", "--context", "64", "--batch", "2",
         "--warmup", "1", "--eval-windows", "2", "--eval-every", "0", "--greedy-tokens", "4", "--gate-steps", "3",
         "--device", "cpu"]


@functools.cache
def _train_tiny():
    """scripts/train_tiny.py as a module (registered first: its dataclasses look themselves up)."""
    spec = importlib.util.spec_from_file_location("train_tiny", ROOT / "scripts" / "train_tiny.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_tiny"] = module
    spec.loader.exec_module(module)
    return module


@functools.cache
def _small_corpus() -> StdlibText:
    """40 training files and 3 held-out files of this interpreter's standard library."""
    full = read_stdlib()
    train = [i for i, f in enumerate(full.files) if not is_held_out(f)][:40]
    held = [i for i, f in enumerate(full.files) if is_held_out(f)][:3]
    keep = sorted(train + held)
    return StdlibText([full.files[i] for i in keep], [full.texts[i] for i in keep], "small-" + full.sha256)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    return prepare(tmp_path_factory.mktemp("data"), 320, _small_corpus()).directory


@pytest.fixture(scope="module")
def trained(prepared: Path, tmp_path_factory) -> Path:
    """A checkpoint of the small configuration trained for a few CPU steps from the prepared data."""
    out = tmp_path_factory.mktemp("ckpt") / "small"
    assert _train_tiny().main(["train", "--data", str(prepared), "--out", str(out), *SMALL, "--steps", "4"]) == 0
    return out


# --------------------------------------------------------------------------- the shipped checkpoint


def test_the_default_model_is_the_shipped_checkpoint() -> None:
    assert DEFAULT_MODEL == "tiny-ouro-py"
    assert SHIPPED.is_dir() and SHIPPED.parent == ROOT / "rlt_engine" / "checkpoints"
    assert resolve_model("toy-ouro") == "toy-ouro"  # anything else passes through


def test_shipped_checkpoint_meets_issue_20_bounds_and_its_training_record() -> None:
    """Ouro with its gate, D = 4, ≥ 1,024 positions, ≤ 24 MB of weights whose SHA-256 is the recorded
    one, a byte-level BPE tokenizer.json of the model's vocabulary, trained on the corpus it names."""
    config = json.loads((SHIPPED / "config.json").read_text())
    record = json.loads((SHIPPED / "training.json").read_text())
    weights = (SHIPPED / "model.safetensors").read_bytes()
    assert config["model_type"] == "ouro" and config["total_ut_steps"] == 4
    assert config["max_position_embeddings"] >= 1024
    assert len(weights) <= 24_000_000
    assert hashlib.sha256(weights).hexdigest() == record["model_safetensors_sha256"]
    pieces = byte_level_pieces(SHIPPED / "tokenizer.json")
    assert len(pieces) == config["vocab_size"] and sum(p is not None and len(p) > 1 for p in pieces) > 0  # merges
    assert record["corpus"]["files"] and len(record["corpus"]["sha256"]) == 64
    assert len(record["held_out_eval"]["bpb_per_loop"]) == 4 and record["device_name"]


def test_shipped_checkpoint_loads_through_the_ordinary_loader() -> None:
    model = load_model(str(SHIPPED), torch.float32, "cpu")
    assert model.info.family == "ouro" and model.info.has_exit_gate
    tokenizer = load_tokenizer("tiny-ouro-py")
    text = "def f(x):\n\treturn x  # é\n"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text and max(ids) < model.info.vocab_size
    specials = sorted({*model.info.eos_token_ids, model.config.bos_token_id, model.config.pad_token_id})
    assert tokenizer.decode([*ids, *specials]) == text  # specials print nothing


@pytest.mark.timeout(600)
def test_shipped_model_continues_python_prompts_with_valid_python() -> None:
    """Issue 20: greedy, 96 tokens, ≥ 4 of the 6 prompts give valid Python (cut at the last complete
    line) and none only whitespace, through the engine on the CPU."""
    with LLM(DEFAULT_MODEL, workers=0, device="cpu") as llm:
        verdicts = continue_prompts(llm)
    assert meets_target(verdicts), "\n".join(f"{v.prompt!r} + {v.continuation!r}: {v.error or 'valid'}"
                                             for v in verdicts)


# --------------------------------------------------------------------------- the greedy check itself


def test_greedy_judge_cuts_at_the_last_complete_line() -> None:
    assert judge("def f(n):", "\n    return n\n\ndef g(", ended=False).is_valid  # the partial line is cut
    assert judge("import os", "\nimport re", ended=True).is_valid  # <eos>: the whole text counts
    assert not judge("import os", "\nimport re", ended=False).is_valid  # nothing of it is complete
    assert judge("def f(n):", "\n\n\n   ", ended=False).error == "only whitespace"
    assert judge("def f(n):", "2121", ended=False).error == "no complete line of code"
    assert "indented block" in judge("def f(n):", "\n    return n\n\ndef g(x):\n  y", ended=False).error
    valid, blank = judge("x = 1", "\ny = 2\n", False), judge("x = 1", "  ", False)
    assert meets_target([valid] * 4 + [judge("x", "(\n", False)] * 2)
    assert not meets_target([valid] * 3 + [judge("x", "(\n", False)] * 3)
    assert not meets_target([valid] * 5 + [blank])
    assert len(PROMPTS) == 6


# --------------------------------------------------------------------------- prepare and train


def test_prepare_is_deterministic_and_its_ids_are_the_text(prepared: Path, tmp_path: Path) -> None:
    """The same corpus gives the same tokenizer and ids; the ids decode to the files, the tokenizer
    never saw a held-out file, and the byte counts add up to the text."""
    again = prepare(tmp_path / "again", 320, _small_corpus())
    first = load_prepared(prepared)
    assert (prepared / "tokenizer.json").read_bytes() == (again.directory / "tokenizer.json").read_bytes()
    assert np.array_equal(first.train, again.train) and np.array_equal(first.held_out, again.held_out)
    corpus = _small_corpus()
    train_texts, held_texts = corpus.split()
    assert first.decode(first.train.tolist()) == b"".join(train_texts).decode()
    assert first.decode(first.held_out.tolist()) == b"".join(held_texts).decode()
    assert int((first.held_out == EOS).sum()) == len(held_texts)  # one <eos> per file
    assert first.byte_counts()[first.held_out].sum() == sum(map(len, held_texts)) + len(held_texts)
    assert first.meta["corpus"]["sha256"] == corpus.sha256 and first.vocab_size == 320
    assert len(first.train) < 0.75 * sum(map(len, train_texts))  # BPE: tokens of several bytes
    tokenizer = HFTokenizer(prepared / "tokenizer.json")
    assert [p["ids"] for p in first.meta["greedy_prompts"]] == [tokenizer.encode(p) for p in PROMPTS]
    (again.directory / "tokenizer.json").write_bytes((again.directory / "tokenizer.json").read_bytes() + b" ")
    with pytest.raises(ValueError, match="not the tokenizer prepared.json records"):
        load_prepared(again.directory)


def test_exit_distribution_and_objective() -> None:
    """p_d = λ_d ∏(1 − λ_j), the last loop takes the rest; the objective is Σ p_d L_d − β H(p)."""
    train_tiny = _train_tiny()
    hazards = torch.tensor([0.5, 0.5, 0.5, 0.9])[:, None, None]
    p = train_tiny.exit_distribution(hazards)
    assert torch.allclose(p[:, 0, 0], torch.tensor([0.5, 0.25, 0.125, 0.125]))
    losses = torch.tensor([4.0, 3.0, 2.0, 1.0])[:, None, None]
    loss, expected = train_tiny.ouro_objective(losses, hazards, beta=0.1)
    entropy = -sum(x * math.log(x) for x in (0.5, 0.25, 0.125, 0.125))
    assert math.isclose(float(expected), 2 + 0.75 + 0.25 + 0.125)
    assert math.isclose(float(loss), float(expected) - 0.1 * entropy, rel_tol=1e-6)


def test_threshold_exit_reads_the_first_loop_whose_cdf_reaches_it() -> None:
    _train_tiny()  # puts scripts/ on the path
    from train_tiny_model import threshold_exit

    losses = torch.tensor([4.0, 3.0, 2.0, 1.0])[:, None, None].repeat(1, 1, 2)  # [D, B=1, T=2]
    p = torch.tensor([[0.6, 0.1], [0.2, 0.1], [0.1, 0.1], [0.1, 0.7]])[:, None, :]
    assert threshold_exit(losses, p, 0.5, 1.0) == {"bpb": 2.5, "mean_loops": 2.5}  # loops 1 and 4
    assert threshold_exit(losses, p, 0.7, 1.0) == {"bpb": 2.0, "mean_loops": 3.0}  # loops 2 and 4
    assert threshold_exit(losses, p, 0.95, 1.0) == {"bpb": 1.0, "mean_loops": 4.0}  # both run every loop


def test_gate_stage_loss_wants_an_exit_where_the_next_loop_stops_helping() -> None:
    """Loop 2 improves the token by a nat, loops 3 and 4 not at all: the loss is lowest for a gate
    that continues after loop 1 (target ≈ 0) and leans to exiting after loops 2 and 3 (target
    σ(50 · 0.005) = 0.562), and highest for the opposite gate."""
    _train_tiny()  # puts scripts/ on the path
    from train_tiny_model import gate_stage_loss

    losses = torch.tensor([3.0, 2.0, 2.0, 2.0])[:, None, None]
    def loss_at(*hazards):
        return float(gate_stage_loss(losses, torch.tensor([*hazards, 0.5])[:, None, None], 50.0, 0.005))
    best = loss_at(1e-4, 0.5622, 0.5622)
    assert best < loss_at(1e-4, 0.45, 0.45) and best < loss_at(1e-4, 0.7, 0.7)
    assert best < loss_at(0.5, 0.5, 0.5) < loss_at(0.99, 0.01, 0.01)


def test_exit_floor_and_detached_gate_split_the_objective() -> None:
    """floor α: LM weights (1 − α) p + α / D; detach_gate: the losses' gradient is those weights
    (p held constant), the gate's gradient is that of Σ p_d sg(L_d) − β H(p); defaults: Ouro's."""
    train_tiny = _train_tiny()
    base = torch.tensor([0.5, 0.5, 0.5, 0.9])[:, None, None]
    targets = torch.tensor([4.0, 3.0, 2.0, 1.0])[:, None, None]

    def grads(**kwargs):
        hazards, losses = base.clone().requires_grad_(True), targets.clone().requires_grad_(True)
        loss, expected = train_tiny.ouro_objective(losses, hazards, 0.1, **kwargs)
        loss.backward()
        return loss, expected, losses.grad[:, 0, 0], hazards.grad[:, 0, 0]

    p = torch.tensor([0.5, 0.25, 0.125, 0.125])
    loss0, expected0, dl0, dh0 = grads()
    assert torch.allclose(dl0, p)  # Ouro's: the losses weighed by p
    _, _, dl_half, _ = grads(floor=0.5)
    assert torch.allclose(dl_half, 0.5 * p + 0.125)
    loss1, expected1, dl1, dh1 = grads(floor=1.0, detach_gate=True)
    assert torch.allclose(dl1, torch.full((4,), 0.25))  # every loop trained equally
    assert torch.allclose(dh1, dh0)  # the gate learns exactly what Ouro's objective teaches it
    assert math.isclose(expected1.item(), expected0.item())
    assert math.isclose(loss1.item(), 2.5 + loss0.item(), rel_tol=1e-6)  # mean L_d + the gate's objective
    _, _, dl2, dh2 = grads(floor=0.5, detach_gate=True)
    assert torch.allclose(dl2, 0.5 * p + 0.125) and torch.allclose(dh2, dh0)
    _, _, dl3, dh3 = grads(floor=0.5, detach_gate=True, floor_shape="depth")
    assert torch.allclose(dl3, 0.5 * p + 0.5 * torch.tensor([0.1, 0.2, 0.3, 0.4]))  # the floor ∝ d
    assert torch.allclose(dh3, dh0)  # the floor's shape never reaches the gate
    _, _, dl4, _ = grads(floor=0.5, detach_gate=True, floor_shape="square")
    assert torch.allclose(dl4, 0.5 * p + 0.5 * torch.tensor([1.0, 4.0, 9.0, 16.0]) / 30)  # the floor ∝ d²
    _, _, dl5, _ = grads(floor=0.5, detach_gate=True, floor_shape="cube")
    assert torch.allclose(dl5, 0.5 * p + 0.5 * torch.tensor([1.0, 8.0, 27.0, 64.0]) / 100)  # the floor ∝ d³
    with pytest.raises(ValueError, match="floor shape"):
        grads(floor=0.5, floor_shape="linear")


def test_boolean_flags_parse_and_the_recipe_defaults() -> None:
    train_tiny = _train_tiny()
    assert train_tiny._flag("1") and train_tiny._flag("true") and not train_tiny._flag("0")
    with pytest.raises(Exception, match="expected"):
        train_tiny._flag("maybe")
    cfg = train_tiny.TrainConfig()
    # issue 20: the recipe that trains every loop (α = 0.5 beat α = 1 on the H200), reproducibly on CUDA
    assert cfg.detach_gate and cfg.exit_floor == 0.5 and cfg.deterministic


def test_site_packages_corpus_has_a_manifest_and_skips_stdlib_copies() -> None:
    """The extra training text: per-distribution byte cap, versions, SHA-256, no tests, no file equal
    to a stdlib file, a missing distribution recorded as such; deterministic."""
    import importlib.metadata

    stdlib = _small_corpus()
    extra = read_site_packages(stdlib, ("tqdm", "no-such-distribution"), 60_000)
    assert extra == read_site_packages(stdlib, ("tqdm", "no-such-distribution"), 60_000)
    rows = {r["name"]: r for r in extra.manifest["distributions"]}
    assert rows["tqdm"]["version"] == importlib.metadata.version("tqdm")
    assert rows["no-such-distribution"] == {"name": "no-such-distribution", "version": None, "files": 0, "bytes": 0}
    assert 0 < rows["tqdm"]["bytes"] == sum(map(len, extra.texts)) <= 60_000
    assert extra.files == sorted(extra.files) and all(f.startswith("tqdm/") and f.endswith(".py") for f in extra.files)
    assert not any({"tests", "test"} & set(f.split("/")) for f in extra.files)
    assert extra.manifest["sha256"] == extra.sha256 and len(extra.sha256) == 64
    # a distribution file that equals a stdlib file is left out (vendored copies of held-out files)
    copy = StdlibText([*stdlib.files, "copy.py"], [*stdlib.texts, extra.texts[0]], "x")
    again = read_site_packages(copy, ("tqdm",), 60_000)
    assert extra.files[0] in again.manifest["duplicates_left_out"] and extra.files[0] not in again.files


def test_prepare_adds_extra_text_to_the_training_split_only(tmp_path: Path) -> None:
    corpus = _small_corpus()
    extra = ExtraText(["pkg/a.py"], [b"def extra():\n    return 42\n"], "e" * 64, {"sha256": "e" * 64, "files": 1})
    data = prepare(tmp_path / "d", 320, corpus, extra)
    base = prepare(tmp_path / "b", 320, corpus)
    train_texts, held_texts = corpus.split()
    assert data.decode(data.train.tolist()) == b"".join([*train_texts, *extra.texts]).decode()
    assert data.decode(data.held_out.tolist()) == base.decode(base.held_out.tolist())
    meta = data.meta["corpus"]
    assert meta["extra"]["file_list"] == ["pkg/a.py"] and meta["extra"]["sha256"] == "e" * 64
    assert meta["stdlib_train_bytes"] == sum(map(len, train_texts))
    assert meta["train_bytes"] == meta["stdlib_train_bytes"] + len(extra.texts[0])
    assert base.meta["corpus"]["extra"] is None


_LONG_DOCSTRINGS = '''"""Module summary.

More text.
"""
import os


class A:
    r"""
    Return a thing
    over two lines.

    Parameters
    ----------
    """

    def f(self):
        """One paragraph only
        kept whole."""
        x = """not a docstring

        at all"""
        return x

    def g(self):
        \'\'\'Summary — ü.

        Details.\'\'\'
        joined = ("""a

        b""" "c")

    def h(self):
        ("""joined

        """ "literal")
'''

# The three multi-paragraph docstrings cut; everything else (one paragraph, not a docstring, joined
# literals) as it was.
_CUTS = [('"""Module summary.\n\nMore text.\n"""', '"""Module summary."""'),
         ('    over two lines.\n\n    Parameters\n    ----------\n    """', '    over two lines.\n    """'),
         ("\'\'\'Summary — ü.\n\n        Details.\'\'\'", "\'\'\'Summary — ü.\'\'\'")]
_SUMMARIES = functools.reduce(lambda text, cut: text.replace(*cut), _CUTS, _LONG_DOCSTRINGS)


def test_docstrings_are_cut_to_their_first_paragraph_and_nothing_else_changes() -> None:
    assert all(_LONG_DOCSTRINGS.count(long) == 1 for long, _ in _CUTS)
    assert summary_docstrings(_LONG_DOCSTRINGS.encode()).decode() == _SUMMARIES
    assert summary_docstrings(_SUMMARIES.encode()) == _SUMMARIES.encode()
    not_python = b'def f(:\n    """a\n\n    b"""\n'
    assert summary_docstrings(not_python) == not_python


def test_top_level_definitions_become_documents() -> None:
    """Split before each top-level def and class (at its first decorator), nothing lost; a nested
    definition, a file without any and one that does not parse stay whole."""
    source = (b'"""Doc."""\nimport os\n\nX = 1\n\n\n@cache\n@wraps(f)\ndef f():\n    def inner():\n'
              b'        pass\n    return 1\n\n\nclass A:\n    def m(self):\n        pass\n\n'
              b'if __name__ == "__main__":\n    f()\n')
    documents = definition_documents(source)
    assert b"".join(documents) == source
    assert [d.split(b"\n")[0] for d in documents] == [b'"""Doc."""', b"@cache", b"class A:"]
    assert definition_documents(b"def f():\n    pass\n") == [b"def f():\n    pass\n"]
    assert definition_documents(b"import os\n") == [b"import os\n"]
    assert definition_documents(b"def f(:\ndef g(): pass\n") == [b"def f(:\ndef g(): pass\n"]


def test_prepare_splits_the_training_split_into_definition_documents(tmp_path: Path) -> None:
    corpus = _small_corpus()
    split = prepare(tmp_path / "split", 320, corpus, documents="definition")
    train_texts, _ = corpus.split()
    documents = [d for t in train_texts for d in definition_documents(t)]
    eos = int(np.sum(split.train == EOS))
    assert eos == len(documents) == split.meta["corpus"]["documents"]["train_documents"] > len(train_texts)
    assert split.decode(split.train.tolist()) == b"".join(documents).decode()
    assert int(np.sum(split.held_out == EOS)) == len(corpus.split()[1])  # held-out files stay whole


def test_prepare_cuts_the_training_splits_docstrings_only(tmp_path: Path) -> None:
    corpus = _small_corpus()
    cut = prepare(tmp_path / "cut", 320, corpus, docstrings="summary")
    whole = prepare(tmp_path / "whole", 320, corpus)
    train_texts, _ = corpus.split()
    assert cut.decode(cut.train.tolist()) == b"".join(map(summary_docstrings, train_texts)).decode()
    assert cut.decode(cut.held_out.tolist()) == whole.decode(whole.held_out.tolist())
    meta = cut.meta["corpus"]
    assert meta["docstrings"] == {"training_split": "summary", "held_out": "keep",
                                  "train_bytes_before": sum(map(len, train_texts))}
    assert meta["train_bytes"] < meta["docstrings"]["train_bytes_before"]
    assert whole.meta["corpus"]["train_bytes"] == whole.meta["corpus"]["docstrings"]["train_bytes_before"]


def test_training_windows_start_at_line_starts(prepared: Path) -> None:
    """--window-starts line: every window's first token follows a newline or a file's <eos>, and every
    such start can be drawn; `any` draws as runs 1 to 6 did."""
    train_tiny = _train_tiny()
    data = load_prepared(prepared)
    context = 64
    starts = train_tiny.line_starts(data, context, np.random.default_rng(0))(20_000)
    before = [data.pieces[t] for t in data.train[starts - 1]]
    assert all(p is None or b"\n" in p for p in before)
    assert starts.max() + context < len(data.train)
    text = data.decode(data.train[: 5_000].tolist())
    assert len(set(starts[starts < 5_000].tolist())) > text.count("\n") // 4  # many lines, not a few
    drawn = train_tiny.any_token_starts(data, context, np.random.default_rng(3))(5)
    assert drawn.tolist() == np.random.default_rng(3).integers(0, len(data.train) - context - 1, 5).tolist()
    assert train_tiny.TrainConfig().window_starts == "line" and set(train_tiny.WINDOW_STARTS) == {"line", "any"}


def test_lr_warms_up_then_decays_to_a_tenth() -> None:
    train_tiny = _train_tiny()
    cfg = train_tiny.TrainConfig(lr=1.0, warmup=10, steps=110)
    assert train_tiny.lr_at(0, cfg) == pytest.approx(0.1) and train_tiny.lr_at(9, cfg) == pytest.approx(1.0)
    assert train_tiny.lr_at(60, cfg) == pytest.approx(0.55) and train_tiny.lr_at(110, cfg) == pytest.approx(0.1)


@pytest.mark.timeout(300)
def test_training_is_seeded_and_writes_a_checkpoint_the_engine_serves(prepared: Path, trained: Path,
                                                                      tmp_path: Path, capsys) -> None:
    """The same command twice gives the same losses and weights; the checkpoint (bf16 weights, the
    data's tokenizer) loads through the ordinary loader and generates through LLM and rlt-generate."""
    again = tmp_path / "again"
    assert _train_tiny().main(["train", "--data", str(prepared), "--out", str(again), *SMALL, "--steps", "4"]) == 0
    first, second = (json.loads((d / "training.json").read_text()) for d in (trained, again))
    strip = lambda rows: [{k: v for k, v in r.items() if k == "step" or "loss" in k or "nats" in k} for r in rows]  # noqa: E731
    assert strip(first["history"]) == strip(second["history"]) and len(first["history"]) >= 2
    assert first["model_safetensors_sha256"] == second["model_safetensors_sha256"]
    assert first["held_out_eval"] == second["held_out_eval"] and len(first["held_out_eval"]["bpb_per_loop"]) == 4
    assert first["corpus"]["sha256"] == _small_corpus().sha256 and first["stopped_early"] is None
    assert first["compile"] == {"asked": "auto", "used": False, "error": None}  # auto: eager on the CPU
    assert first["gate_stage"]["steps"] == 3 and len(first["held_out_eval"]["gate_sweep"]) == 6
    assert (trained / "tokenizer.json").read_bytes() == (prepared / "tokenizer.json").read_bytes()
    model = load_model(str(trained), torch.float32, "cpu")
    assert model.info.default_depth == 4 and model.info.max_model_len == 64 and model.info.vocab_size == 320
    with LLM(str(trained), workers=0, device="cpu") as llm:
        out = llm.generate(["def f(x):"], SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)[0]
    assert len(out.token_ids) == 6 or out.finish_reason == "stop"
    assert out.text == load_tokenizer(str(trained)).decode(out.token_ids)
    capsys.readouterr()
    assert main(["generate", "--offline", "--model", str(trained), "--device", "cpu", "--temperature", "0",
                 "--max-tokens", "6", "def f(x):"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == out.text.rstrip("\n")


@pytest.mark.timeout(300)
def test_max_seconds_stops_early_and_still_saves(prepared: Path, tmp_path: Path) -> None:
    """--max-seconds 0: the run stops after its first step, says so, and writes a loadable checkpoint."""
    out = tmp_path / "stopped"
    assert _train_tiny().main(["train", "--data", str(prepared), "--out", str(out), *SMALL, "--steps", "50",
                               "--max-seconds", "0"]) == 0
    record = json.loads((out / "training.json").read_text())
    assert record["stopped_early"]["at_step"] == 1 and record["stopped_early"]["of_steps"] == 50
    assert record["steps_run"] == 1 and "--max-seconds" in record["stopped_early"]["reason"]
    assert load_model(str(out), torch.float32, "cpu").info.default_depth == 4


@pytest.mark.timeout(300)
def test_stop_after_repeats_a_cut_run_on_the_same_schedule(prepared: Path, tmp_path: Path) -> None:
    """--stop-after 2 of a 4-step schedule: the first two steps of the whole run, the same learning
    rates included (a 2-step schedule would anneal sooner), and the stop recorded."""
    runs = {}
    for name, extra in (("whole", []), ("cut", ["--stop-after", "2"])):
        out = tmp_path / name
        assert _train_tiny().main(["train", "--data", str(prepared), "--out", str(out), *SMALL, "--steps", "4",
                                   "--log-every", "1", "--gate-steps", "0", *extra]) == 0
        runs[name] = json.loads((out / "training.json").read_text())
    strip = lambda rows: [{k: r[k] for k in ("step", "loss", "lr")} for r in rows]  # noqa: E731
    assert strip(runs["cut"]["history"]) == strip(runs["whole"]["history"])[:2]
    assert runs["cut"]["steps_run"] == 2 and runs["cut"]["stop_after"] == 2
    assert runs["cut"]["stopped_early"] == {"at_step": 2, "of_steps": 4, "reason": "--stop-after 2 reached"}
    assert runs["whole"]["stopped_early"] is None
    with pytest.raises(SystemExit):
        _train_tiny().main(["train", "--data", str(prepared), "--out", str(tmp_path / "bad"), *SMALL,
                            "--steps", "4", "--stop-after", "5"])


@pytest.mark.timeout(300)
def test_a_failing_compile_falls_back_to_eager(prepared: Path, trained: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compile raising at the first step: the run says so and trains eagerly, as --compile off does."""
    def broken(fn, **kwargs):
        def compiled(*args):
            raise RuntimeError("inductor: no compiler here")
        return compiled

    monkeypatch.setattr(torch, "compile", broken)
    out = tmp_path / "fallback"
    assert _train_tiny().main(["train", "--data", str(prepared), "--out", str(out), *SMALL, "--steps", "4",
                               "--compile", "on"]) == 0
    record = json.loads((out / "training.json").read_text())
    assert record["compile"]["used"] is False and "no compiler here" in record["compile"]["error"]
    reference = json.loads((trained / "training.json").read_text())
    assert record["model_safetensors_sha256"] == reference["model_safetensors_sha256"]


@pytest.mark.timeout(120)
def test_a_strict_loss_step_relaxes_when_an_op_has_no_deterministic_variant(prepared: Path) -> None:
    """The strict step (CUDA's default) runs forward and backward without warn_only; an op that strict
    determinism refuses drops the batch's partial gradients, records the refusal and reruns the batch
    under warn_only, which is where evaluation and the optimizer stay."""
    tt = _train_tiny()
    cfg = tt.TrainConfig(hidden=64, layers=1, intermediate=128, context=16, batch=2, dropout=0.0)
    data = load_prepared(prepared)
    model = tt.new_model(cfg, data.vocab_size, "cpu")[0]
    tokens = torch.from_numpy(data.train[: 2 * (cfg.context + 1)].astype(np.int64)).view(2, -1)
    step = tt.LossStep(model, cfg, "cpu", "off")
    expected = step(tokens)[0].item()
    model.zero_grad(set_to_none=True)
    step.determinism["strict"] = True  # as on CUDA
    seen = []

    def refuse_once(batch):
        seen.append((torch.are_deterministic_algorithms_enabled(),
                     torch.is_deterministic_algorithms_warn_only_enabled()))
        if len(seen) == 1:
            torch.autograd.backward(sum(p.sum() for p in model.parameters()))  # partial gradients to drop
            raise RuntimeError("scatter_reduce_cuda does not have a deterministic implementation, but you set ...")
        return step.eager(batch)

    step.fn = refuse_once
    tt.use_deterministic_kernels()
    try:
        loss = step(tokens)[0].item()
        after = torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
    assert seen == [(True, False), (True, True)] and after
    assert step.determinism["strict"] is False and "scatter_reduce_cuda" in step.determinism["relaxed_by"]
    assert loss == expected
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    reference = tt.LossStep(tt.new_model(cfg, data.vocab_size, "cpu")[0], cfg, "cpu", "off")
    reference(tokens)
    assert all(torch.equal(g, r.grad) for g, r in zip(grads, reference.model.parameters(), strict=True))


@pytest.mark.timeout(300)
def test_the_trainers_greedy_check_matches_the_engine(prepared: Path, trained: Path) -> None:
    """The trainer's own greedy continuations (no engine, no tokenizers: what the GPU machine prints)
    are the engine's, in float64."""
    train_tiny = _train_tiny()
    data = load_prepared(prepared)
    model = load_model(str(trained), torch.float64, "cpu")
    mine = train_tiny.greedy_continuations(model, data, 8, "cpu", torch.float64)
    with LLM(str(trained), workers=0, device="cpu", dtype="float64") as llm:
        engine = continue_prompts(llm, max_tokens=8)
    assert [(v.continuation, v.ended) for v in mine] == [(v.continuation, v.ended) for v in engine]


# --------------------------------------------------------------------------- rlt-bench quality


@pytest.mark.timeout(300)
def test_quality_bench_scores_held_out_text_with_the_engine(tmp_path: Path) -> None:
    """`rlt-bench quality` on toy-ouro: fixed d runs exactly d loops per token; the gate in between."""
    out = tmp_path / "quality.json"
    code = main(["bench", "quality", "--model", "toy-ouro", "--device", "cpu", "--windows", "3", "--length", "6",
                 "--loops", "1,4", "--thresholds", "0.5", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    rows = {(r["policy"], r["setting"]): r for r in report["rows"]}
    assert rows["fixed", 1.0]["mean_loops"] == 1.0 and rows["fixed", 4.0]["mean_loops"] == 4.0
    assert 1.0 <= rows["ouro", 0.5]["mean_loops"] <= 4.0
    assert all(r["scored_bytes"] == r["scored_tokens"] == 3 * 5 and math.isfinite(r["bits_per_byte"])
               for r in rows.values())  # a byte model: one byte per token
    assert len(report["corpus_sha256"]) == 64


@pytest.mark.timeout(300)
def test_bits_per_byte_of_a_bpe_model_divides_by_the_texts_bytes(prepared: Path, trained: Path) -> None:
    """The engine's score of BPE windows = the dense model's nats over the scored tokens / (ln 2 ×
    the UTF-8 bytes of their text as `tokenizers` decodes it)."""
    train_tiny = _train_tiny()
    model = load_model(str(trained), torch.float64, "cpu")
    held_out = held_out_for(str(trained), 320, EOS, str(prepared))
    windows = held_out_windows(held_out.ids, 20, 3)
    with LLM(str(trained), workers=0, device="cpu", dtype="float64", exit_mode="ouro") as llm:
        params = SamplingParams(temperature=0.0, logprobs=1, ignore_eos=True, max_loops=4)
        bpb, mean_loops, num_bytes, tokens = score(llm, windows.tolist(), params, held_out)
    losses, _ = train_tiny.per_loop_losses(model, torch.from_numpy(windows), torch.float64)
    nats = float(losses[-1, :, 1:].sum())  # targets window[2:]: output 0 (target window[1]) is not scored
    tokenizer = HFTokenizer(trained / "tokenizer.json")
    texts = [tokenizer.decode(w[2:].tolist()) for w in windows]
    assert all("\ufffd" not in t for t in texts)
    expected_bytes = sum(len(t.encode("utf-8")) for t in texts)
    assert tokens == 3 * 19 and mean_loops == 4.0
    assert num_bytes == expected_bytes > tokens  # BPE: more bytes than tokens
    assert bpb == pytest.approx(nats / (math.log(2) * expected_bytes), rel=1e-6)


@pytest.mark.timeout(300)
def test_quality_and_greedy_benches_run_on_a_bpe_checkpoint(prepared: Path, trained: Path, tmp_path: Path,
                                                           capsys) -> None:
    """`rlt-bench quality --data` and `rlt-bench greedy` end to end on the CPU-trained BPE checkpoint."""
    out = tmp_path / "quality.json"
    assert main(["bench", "quality", "--model", str(trained), "--data", str(prepared), "--device", "cpu",
                 "--windows", "2", "--length", "12", "--loops", "1,4", "--thresholds", "0.5",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["corpus_sha256"] == _small_corpus().sha256
    assert all(r["scored_bytes"] > r["scored_tokens"] == 2 * 11 for r in report["rows"])
    assert any(v.startswith("gate target") for v in report["verdicts"])
    capsys.readouterr()
    code = main(["bench", "greedy", "--model", str(trained), "--device", "cpu", "--max-tokens", "8"])
    printed = capsys.readouterr().out
    assert code in (0, 1) and printed.count("\n--- ") + printed.startswith("--- ") == 6
    assert f"=== {printed.count(': valid')}" in printed and ("NOT met" in printed) == (code == 1)


def test_quality_sizes_the_kv_pool_for_every_window_at_once(trained: Path) -> None:
    from rlt_engine.bench.quality import kv_blocks_for

    assert kv_blocks_for(str(trained), 3, 20) == 3 * 4 * (2 + 1)  # 21 positions: 2 blocks of 16, one spare
    assert kv_blocks_for(str(trained), 2, 0) == 2 * 4 * (4 + 1)  # the context: 64 positions
    assert kv_blocks_for("toy-ouro", 3, 20) is None  # built-in: the engine's default


def test_tokenized_held_out_equals_the_prepared_one(prepared: Path, trained: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --data, the held-out files are tokenized with the checkpoint's tokenizer: the same ids."""
    monkeypatch.setattr("rlt_engine.bench.held_out.read_stdlib", _small_corpus)
    from_text = held_out_for(str(trained), 320, EOS)
    from_data = held_out_for(str(trained), 320, EOS, str(prepared))
    assert np.array_equal(from_text.ids, from_data.ids) and from_text.corpus_sha256 == from_data.corpus_sha256
    with pytest.raises(ValueError, match="not the model's"):
        held_out_for("toy-ouro", 264, 257, str(prepared))


def test_gate_verdict_interpolates_the_fixed_line() -> None:
    rows = [QualityRow("fixed", 1, 3.0, 1.0, 10), QualityRow("fixed", 2, 2.0, 2.0, 10),
            QualityRow("ouro", 0.5, 2.4, 1.5, 10), QualityRow("ouro", 0.9, 1.9, 1.8, 10)]
    verdicts = gate_against_fixed(rows)
    assert verdicts[0].endswith("2.5000 bits/byte (better)")
    assert verdicts[1].endswith("2.2000 bits/byte (better)")
    assert gate_against_fixed([*rows[:2], QualityRow("ouro", 0.5, 2.6, 1.5, 10)])[0].endswith("(not better)")


def test_target_verdict_needs_fixed_d_within_one_percent_at_three_loops() -> None:
    fixed = [QualityRow("fixed", d, bpb, d, 10) for d, bpb in ((1, 1.5), (2, 1.4), (3, 1.35), (4, 1.3))]
    assert depth_verdict(fixed) == "deeper is better: yes (1.5000 > 1.4000 > 1.3500 > 1.3000)"
    assert depth_verdict([*fixed[:3], QualityRow("fixed", 4, 1.36, 4, 10)]).startswith("deeper is better: NO")
    close, cheap_but_worse, close_but_deep = (QualityRow("ouro", 0.7, 1.312, 2.9, 10),
                                              QualityRow("ouro", 0.5, 1.32, 2.1, 10),
                                              QualityRow("ouro", 0.9, 1.301, 3.2, 10))
    assert "met by ouro 0.7" in target_verdict([*fixed, close, cheap_but_worse, close_but_deep])
    assert "NOT met" in target_verdict([*fixed, cheap_but_worse, close_but_deep])
