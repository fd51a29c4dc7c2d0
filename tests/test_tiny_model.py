"""The shipped trained model `tiny-ouro-py`, its training script and `rlt-bench quality`."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from rlt_engine.bench.quality import QualityRow, gate_against_fixed
from rlt_engine.checkpoints import DEFAULT_MODEL, resolve_model
from rlt_engine.cli import main
from rlt_engine.tokenizer import load_tokenizer
from rlt_worker.models.loader import load_model

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = Path(resolve_model("tiny-ouro-py"))


@functools.cache
def _train_tiny():
    """scripts/train_tiny.py as a module (registered first: its dataclasses look themselves up)."""
    spec = importlib.util.spec_from_file_location("train_tiny", ROOT / "scripts" / "train_tiny.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_tiny"] = module
    spec.loader.exec_module(module)
    return module


def test_the_default_model_is_the_shipped_checkpoint() -> None:
    assert DEFAULT_MODEL == "tiny-ouro-py"
    assert SHIPPED.is_dir() and SHIPPED.parent == ROOT / "rlt_engine" / "checkpoints"
    assert resolve_model("toy-ouro") == "toy-ouro"  # anything else passes through


def test_shipped_checkpoint_matches_its_training_record() -> None:
    """Ouro layout within the issue's bounds, ≤ 20 MB, and the weights' SHA-256 is the one recorded."""
    config = json.loads((SHIPPED / "config.json").read_text())
    record = json.loads((SHIPPED / "training.json").read_text())
    weights = (SHIPPED / "model.safetensors").read_bytes()
    assert config["model_type"] == "ouro" and config["total_ut_steps"] == 4
    assert 256 <= config["hidden_size"] <= 384 and 4 <= config["num_hidden_layers"] <= 6
    assert sum(p.stat().st_size for p in SHIPPED.iterdir()) <= 20 * 2**20
    assert hashlib.sha256(weights).hexdigest() == record["model_safetensors_sha256"]
    assert record["corpus"]["files"] and len(record["corpus"]["sha256"]) == 64


def test_shipped_checkpoint_loads_through_the_ordinary_loader() -> None:
    model = load_model(str(SHIPPED), torch.float32, "cpu")
    assert model.info.family == "ouro" and model.info.has_exit_gate
    tokenizer = load_tokenizer("tiny-ouro-py")
    text = "def f(x):\n\treturn x  # é\n"
    assert tokenizer.encode(text) == list(text.encode())  # ids are the bytes
    assert tokenizer.decode([*text.encode(), 256, 257, 258]) == text  # specials print nothing


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


@pytest.mark.timeout(300)
def test_training_script_is_seeded_and_writes_a_loadable_checkpoint(tmp_path: Path) -> None:
    """Two steps of a small configuration, twice: the same losses, and a checkpoint the loader reads."""
    train_tiny = _train_tiny()
    args = ["--hidden", "64", "--layers", "1", "--context", "32", "--batch", "2", "--steps", "2", "--warmup", "1",
            "--eval-windows", "2", "--device", "cpu"]
    records = []
    for run in ("a", "b"):
        assert train_tiny.main(["--out", str(tmp_path / run), *args]) == 0
        records.append(json.loads((tmp_path / run / "training.json").read_text()))
    assert records[0]["history"] == [{**row, "elapsed_s": records[0]["history"][i]["elapsed_s"]}
                                     for i, row in enumerate(records[1]["history"])]
    assert records[0]["model_safetensors_sha256"] == records[1]["model_safetensors_sha256"]
    assert len(records[0]["held_out_eval"]["bpb_per_loop"]) == 4
    model = load_model(str(tmp_path / "a"), torch.float32, "cpu")
    assert model.info.default_depth == 4 and model.info.max_model_len == 32


@pytest.mark.timeout(300)
def test_quality_bench_scores_held_out_text_with_the_engine(tmp_path: Path) -> None:
    """`rlt-bench quality` on toy-ouro: fixed d runs exactly d loops per byte; the gate in between."""
    out = tmp_path / "quality.json"
    code = main(["bench", "quality", "--model", "toy-ouro", "--device", "cpu", "--windows", "3", "--length", "6",
                 "--loops", "1,4", "--thresholds", "0.5", "--json", str(out)])
    assert code == 0
    rows = {(r["policy"], r["setting"]): r for r in json.loads(out.read_text())["rows"]}
    assert rows["fixed", 1.0]["mean_loops"] == 1.0 and rows["fixed", 4.0]["mean_loops"] == 4.0
    assert 1.0 <= rows["ouro", 0.5]["mean_loops"] <= 4.0
    assert all(r["scored_bytes"] == 3 * 5 and math.isfinite(r["bits_per_byte"]) for r in rows.values())


def test_gate_verdict_interpolates_the_fixed_line() -> None:
    rows = [QualityRow("fixed", 1, 3.0, 1.0, 10), QualityRow("fixed", 2, 2.0, 2.0, 10),
            QualityRow("ouro", 0.5, 2.4, 1.5, 10), QualityRow("ouro", 0.9, 1.9, 1.8, 10)]
    verdicts = gate_against_fixed(rows)
    assert verdicts[0].endswith("2.5000 bits/byte (better)")
    assert verdicts[1].endswith("2.2000 bits/byte (better)")
    assert gate_against_fixed([*rows[:2], QualityRow("ouro", 0.5, 2.6, 1.5, 10)])[0].endswith("(not better)")
