"""The synthetic random-weight models: real Ouro and Huginn shapes, seeded weights made on the target device."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest
import torch
from factories import assert_matches_reference, make_llm, make_workload, run_workload

from rlt_engine.bench.throughput import KL_THRESHOLD, LATENT_THRESHOLD
from rlt_worker.models.config import HuginnConfig, OuroConfig
from rlt_worker.models.loader import build_model, load_model
from rlt_worker.models.ouro import OuroModel
from rlt_worker.models.synthetic import (
    ADAPTER_STATE_GAIN,
    SYNTHETIC_MODELS,
    WTE_GAIN,
    synthetic_config,
    synthetic_model_from_config,
)


def test_ouro_1_4b_shapes() -> None:
    cfg = OuroConfig.from_dict(synthetic_config("synthetic-ouro-1.4b"))
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (2048, 5632, 24)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (16, 16, 128)
    assert (cfg.vocab_size, cfg.rope_theta, cfg.total_ut_steps) == (49152, 1e6, 4)
    with torch.device("meta"):
        model = OuroModel(cfg)
    assert sum(p.numel() for p in model.parameters()) == 1_434_652_673
    assert "synthetic-ouro-2.6b" in SYNTHETIC_MODELS


def _small() -> dict:
    cfg = synthetic_config("synthetic-ouro-1.4b")
    cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=4, head_dim=16, vocab_size=300)
    return cfg


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_seeded_finite_and_scaled(dtype: torch.dtype) -> None:
    a = synthetic_model_from_config(_small(), dtype, "cpu")
    b = synthetic_model_from_config(_small(), dtype, "cpu")
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert x.dtype == dtype and x.device.type == "cpu"
        assert torch.equal(x, y), name
    sd = a.state_dict()
    assert sd["model.layers.0.input_layernorm.weight"].float().mean() == pytest.approx(1.0, abs=0.05)
    assert sd["model.layers.0.mlp.down_proj.weight"].float().std() == pytest.approx(128**-0.5, rel=0.1)
    assert sd["lm_head.weight"].float().std() == pytest.approx(3 * 64**-0.5, rel=0.1)
    with torch.inference_mode():
        h = a.embed(torch.arange(8), torch.arange(8), None)
        assert torch.isfinite(a.lm_head(a.model.norm(h))).all()


def test_load_model_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    import rlt_worker.models.synthetic as synthetic

    monkeypatch.setitem(synthetic.SYNTHETIC_MODELS, "synthetic-ouro-1.4b", _small())
    model = load_model("synthetic-ouro-1.4b", torch.float32, "cpu")
    assert model.info.family == "ouro" and model.info.hidden_size == 64 and model.info.default_depth == 4


# ---------------------------------------------------------------------------- Huginn-0125 shape

HUGINN = "synthetic-huginn-3.5b"


def huginn_block_params(h: int, inter: int) -> int:
    """One sandwich block of SPEC §9: Wqkv, qk_bias, proj, the fused fc (2 × inter), proj, four norms."""
    return 3 * h * h + 2 * h + h * h + 2 * inter * h + inter * h + 4 * h


def test_huginn_3_5b_shapes() -> None:
    cfg = HuginnConfig.from_dict(synthetic_config(HUGINN))
    assert (cfg.n_embd, cfg.n_heads, cfg.head_dim, cfg.intermediate_size) == (5280, 55, 96, 17920)
    assert (cfg.n_layers_in_prelude, cfg.n_layers_in_recurrent_block, cfg.n_layers_in_coda) == (2, 4, 2)
    assert (cfg.vocab_size, cfg.padded_vocab_size, cfg.rope_base, cfg.mean_recurrence) == (65536, 65536, 50000, 32)
    assert cfg.tie_embeddings and cfg.qk_bias and cfg.embed_scale == math.sqrt(5280)
    assert cfg.init_std == math.sqrt(2 / (5 * 5280)) and set(cfg.eos_token_ids) == {65504, 65505, 65508}
    model = build_model(cfg)  # the meta device: shapes only
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert shapes["transformer.core_block.3.attn.Wqkv.weight"] == (3 * 5280, 5280)
    assert shapes["transformer.coda.1.attn.qk_bias"] == (2, 1, 55, 96)
    assert shapes["transformer.prelude.0.mlp.fc.weight"] == (35840, 5280)
    assert shapes["transformer.adapter.weight"] == (5280, 10560)
    assert "lm_head.weight" not in shapes  # tied
    params = sum(math.prod(s) for s in shapes.values())
    assert params == 65536 * 5280 + 8 * huginn_block_params(5280, 17920) + 2 * 5280 * 5280 + 5280
    assert params == 3_564_976_800
    info = model.info
    assert (info.family, info.default_depth, info.num_loop_kv_layers, info.num_outer_kv_layers) == ("huginn", 32, 4, 4)
    assert (info.num_kv_heads, info.head_dim, info.max_model_len, info.has_coda_signal) == (55, 96, 4096, True)


def small_huginn(heads: int = 2) -> dict:
    """synthetic-huginn-3.5b at width heads × 96: its blocks, depth and scale rules, a 512-row vocabulary."""
    cfg = synthetic_config(HUGINN)
    width = heads * 96
    cfg.update(n_embd=width, n_heads=heads, num_key_value_heads=heads, intermediate_size=640, vocab_size=512,
               padded_vocab_size=512, block_size=512,
               init_values={"embed_scale": math.sqrt(width), "std": math.sqrt(2 / (5 * width))})
    return cfg


def test_huginn_seeded_and_scaled() -> None:
    a = synthetic_model_from_config(small_huginn(), torch.float32, "cpu")
    b = synthetic_model_from_config(small_huginn(), torch.float32, "cpu")
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    sd, h = a.state_dict(), 192
    for name in ("transformer.prelude.0.norm_1.weight", "transformer.core_block.2.norm_4.weight",
                 "transformer.ln_f.weight"):
        assert sd[name].mean() == pytest.approx(1.0, abs=0.05) and sd[name].std() == pytest.approx(0.1, rel=0.2)
    assert sd["transformer.wte.weight"].std() == pytest.approx(WTE_GAIN / math.sqrt(h), rel=0.05)
    adapter = sd["transformer.adapter.weight"]
    assert adapter[:, :h].std() == pytest.approx(ADAPTER_STATE_GAIN / math.sqrt(2 * h), rel=0.05)
    assert adapter[:, h:].std() == pytest.approx(1 / math.sqrt(2 * h), rel=0.05)
    assert sd["transformer.core_block.0.mlp.proj.weight"].std() == pytest.approx(640**-0.5, rel=0.05)
    assert sd["transformer.coda.0.attn.qk_bias"].std() == pytest.approx(0.1, rel=0.2)


SMALL_HUGINN = "synthetic-huginn-3.5b-width-192"


@pytest.fixture
def small_huginn_model(register_synthetic: Callable[[str, dict], None]) -> None:
    """Register SMALL_HUGINN (small_huginn()) for in-process engines and the dense reference."""
    register_synthetic(SMALL_HUGINN, small_huginn())


@pytest.mark.parametrize("exit_mode,state_init,kv_layout", [("kl", "random", "last_exited"),
                                                             ("latent_diff", "zero", "shared")])
def test_small_huginn_engine_equals_reference(
    small_huginn_model: None, single_thread: None, exit_mode: str, state_init: str, kv_layout: str
) -> None:
    """Huginn's blocks, 32 loops, heads of 96 and the synthetic scale at width 192, in float64: the engine
    (refill, rows of several requests at mixed depths) equals the dense reference in tokens and exit
    depths, and the bench's default thresholds exit at several depths below 32."""
    threshold = {"kl": KL_THRESHOLD, "latent_diff": LATENT_THRESHOLD}[exit_mode]
    jobs = make_workload(random.Random(f"small-huginn-{exit_mode}"), 4, depth=32, exit_mode=exit_mode,
                         threshold=threshold, max_prompt_len=8, max_tokens=5)
    with make_llm(SMALL_HUGINN, exit_mode=exit_mode, state_init=state_init, kv_layout=kv_layout,
                  max_num_seqs=4) as llm:
        run = run_workload(llm, jobs)
        assert_matches_reference(run, SMALL_HUGINN, kv_layout=kv_layout, exit_mode=exit_mode, state_init=state_init)
    depths = {d for life in run.lives for d in life.final.exit_depths[1:]}
    assert len(depths) >= 2 and max(depths) < 32, depths
