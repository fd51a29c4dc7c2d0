"""The synthetic random-weight models: real Ouro shapes, seeded weights made on the target device."""

from __future__ import annotations

import pytest
import torch

from rlt_worker.models.config import OuroConfig
from rlt_worker.models.loader import load_model
from rlt_worker.models.ouro import OuroModel
from rlt_worker.models.synthetic import SYNTHETIC_MODELS, synthetic_config, synthetic_model_from_config


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
    assert model.info.family == "ouro" and model.info.hidden_size == 64 and model.info.default_loops == 4
