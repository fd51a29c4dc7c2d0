"""Native models: stage API at full depth vs an independent plain forward, loader strictness, configs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from rlt_worker.models import CheckpointError, LayerId, LoopedModel, load_model, save_checkpoint
from rlt_worker.models.config import HuginnConfig, OuroConfig, load_config
from rlt_worker.models.toy import TOY_MODELS, toy_checkpoint

F64 = torch.float64
PROMPT = torch.tensor([256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 10, 84, 104])
T = PROMPT.numel()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The toy tensors are tiny: intra-op threads only add overhead (and noise on a busy box)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------
# A tiny dense attention context: per (layer, plane) K/V keyed by position, causal reads.


class DenseContext:
    """Stores every row's K/V under (layer, depth) — depth 0 for layers outside the loop."""

    def __init__(self, max_len: int = 64) -> None:
        self.kv: dict[tuple[LayerId, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.max_len = max_len
        self.positions = torch.zeros(0, dtype=torch.long)
        self.depth = 0

    def attend(self, layer: LayerId, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        key = (layer, self.depth if layer.in_loop else 0)
        if key not in self.kv:
            # NaN-filled: reading a position nobody wrote poisons the result instead of passing.
            self.kv[key] = (
                k.new_full((self.max_len, *k.shape[1:]), math.nan),
                v.new_full((self.max_len, *v.shape[1:]), math.nan),
            )
        keys, vals = self.kv[key]
        keys[self.positions], vals[self.positions] = k, v
        span = int(self.positions.max()) + 1
        rep = q.shape[1] // k.shape[1]
        keys, vals = keys[:span].repeat_interleave(rep, dim=1), vals[:span].repeat_interleave(rep, dim=1)
        scores = torch.einsum("nhd,shd->nhs", q, keys) / math.sqrt(q.shape[-1])
        future = torch.arange(span)[None, :] > self.positions[:, None]
        w = torch.softmax(scores.masked_fill(future[:, None, :], float("-inf")), dim=-1)
        return torch.einsum("nhs,shd->nhd", w, vals)


def run_stages(
    model: LoopedModel, ids: torch.Tensor, loops: int, chunk: int, noise: torch.Tensor | None = None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Prefill through the stage API at full depth in chunks; returns logits [T, V] and per-loop λ."""
    ctx, logits, gates = DenseContext(), [], [[] for _ in range(loops)]
    for start in range(0, ids.numel(), chunk):
        pos = torch.arange(start, min(ids.numel(), start + chunk))
        ctx.positions, ctx.depth = pos, 0
        e = model.embed(ids[pos], pos, ctx)
        s = model.init_state(e, None if noise is None else noise[pos])
        for d in range(1, loops + 1):
            ctx.depth = d
            s = model.loop(s, e, pos, ctx)
            if model.info.has_exit_gate:
                gates[d - 1].append(model.exit_gate(s))
        ctx.depth = 0
        logits.append(model.lm_head(model.coda(s, pos, ctx)))
    return torch.cat(logits), [torch.cat(g) for g in gates if g]


# ---------------------------------------------------------------------------------------------
# Plain full-sequence forwards written from SPEC §9 with raw state-dict tensors.


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [T, Hq, dh], k/v [T, Hkv, dh] → [T, Hq·dh] with full-sequence causal SDPA."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    return o.transpose(0, 1).reshape(q.shape[0], -1)


def inv_freq(dh: int, base: float) -> torch.Tensor:
    return 1.0 / base ** (torch.arange(0, dh, 2, dtype=F64) / dh)


def rope_split_half(x: torch.Tensor, base: float) -> torch.Tensor:
    ang = torch.arange(x.shape[0], dtype=F64)[:, None, None] * inv_freq(x.shape[-1], base)
    x1, x2 = x.chunk(2, dim=-1)
    c, s = ang.cos(), ang.sin()
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def rope_adjacent(x: torch.Tensor, base: float) -> torch.Tensor:
    ang = torch.arange(x.shape[0], dtype=F64)[:, None, None] * inv_freq(x.shape[-1], base)
    xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(xc * torch.polar(torch.ones_like(ang), ang)).flatten(-2)


def plain_ouro(cfg: dict, w: dict[str, torch.Tensor], ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    eps, hd, theta = cfg["rms_norm_eps"], cfg["head_dim"], cfg["rope_theta"]
    x, lams = w["model.embed_tokens.weight"][ids], []
    for _ in range(cfg["total_ut_steps"]):
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            h = rms(x, w[p + "input_layernorm.weight"], eps)
            q = (h @ w[p + "self_attn.q_proj.weight"].T).view(T, -1, hd)
            k = (h @ w[p + "self_attn.k_proj.weight"].T).view(T, -1, hd)
            v = (h @ w[p + "self_attn.v_proj.weight"].T).view(T, -1, hd)
            a = causal(rope_split_half(q, theta), rope_split_half(k, theta), v) @ w[p + "self_attn.o_proj.weight"].T
            x = x + rms(a, w[p + "input_layernorm_2.weight"], eps)
            h = rms(x, w[p + "post_attention_layernorm.weight"], eps)
            m = F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)
            x = x + rms(m @ w[p + "mlp.down_proj.weight"].T, w[p + "post_attention_layernorm_2.weight"], eps)
        x = rms(x, w["model.norm.weight"], eps)
        lams.append(torch.sigmoid(x @ w["model.early_exit_gate.weight"][0] + w["model.early_exit_gate.bias"][0]))
    return x @ w["lm_head.weight"].T, torch.stack(lams)


def plain_huginn_block(cfg: dict, w: dict[str, torch.Tensor], p: str, x: torch.Tensor) -> torch.Tensor:
    eps, nh, base = cfg["norm_eps"], cfg["n_heads"], cfg["rope_base"]
    hd = cfg["n_embd"] // nh
    h = rms(x, w[p + "norm_1.weight"], eps)
    q, k, v = (h @ w[p + "attn.Wqkv.weight"].T).split(cfg["n_embd"], dim=-1)
    q = q.view(T, nh, hd) + w[p + "attn.qk_bias"][0, 0]
    k = k.view(T, nh, hd) + w[p + "attn.qk_bias"][1, 0]
    a = causal(rope_adjacent(q, base), rope_adjacent(k, base), v.view(T, nh, hd)) @ w[p + "attn.proj.weight"].T
    x = rms(a + x, w[p + "norm_2.weight"], eps)
    g, u = (rms(x, w[p + "norm_3.weight"], eps) @ w[p + "mlp.fc.weight"].T).chunk(2, dim=-1)
    return rms((F.silu(g) * u) @ w[p + "mlp.proj.weight"].T + x, w[p + "norm_4.weight"], eps)


def plain_huginn(cfg: dict, w: dict[str, torch.Tensor], ids: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
    scale, std = cfg["init_values"]["embed_scale"], cfg["init_values"]["std"]
    e = w["transformer.wte.weight"][ids] * scale
    for i in range(cfg["n_layers_in_prelude"]):
        e = plain_huginn_block(cfg, w, f"transformer.prelude.{i}.", e)
    s = torch.zeros_like(e) if noise is None else noise * std * scale
    for _ in range(cfg["mean_recurrence"]):
        s = torch.cat([s, e], dim=-1) @ w["transformer.adapter.weight"].T
        for j in range(cfg["n_layers_in_recurrent_block"]):
            s = plain_huginn_block(cfg, w, f"transformer.core_block.{j}.", s)
    x = rms(s, w["transformer.ln_f.weight"], cfg["norm_eps"])
    for j in range(cfg["n_layers_in_coda"]):
        x = plain_huginn_block(cfg, w, f"transformer.coda.{j}.", x)
    x = rms(x, w["transformer.ln_f.weight"], cfg["norm_eps"])
    return x @ w["transformer.wte.weight"].T


def trunc_noise(n: int, h: int, seed: int = 7) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.nn.init.trunc_normal_(torch.empty(n, h, dtype=F64), a=-3.0, b=3.0, generator=g)


# ---------------------------------------------------------------------------------------------
# (1) stage API at full depth == plain forward


@pytest.mark.parametrize("chunk", [T, 1, 5])
def test_ouro_stages_match_plain_forward(chunk: int) -> None:
    cfg, w = toy_checkpoint("toy-ouro")
    model = load_model("toy-ouro", F64, "cpu")
    logits, gates = run_stages(model, PROMPT, cfg["total_ut_steps"], chunk)
    ref_logits, ref_gates = plain_ouro(cfg, w, PROMPT)
    assert (logits - ref_logits).abs().max().item() < 1e-9
    assert (torch.stack(gates) - ref_gates).abs().max().item() < 1e-9
    assert gates[0].dtype == F64 and gates[0].shape == (T,)


@pytest.mark.parametrize("chunk", [T, 1, 5])
@pytest.mark.parametrize("with_noise", [False, True])
def test_huginn_stages_match_plain_forward(chunk: int, with_noise: bool) -> None:
    cfg, w = toy_checkpoint("toy-huginn")
    model = load_model("toy-huginn", F64, "cpu")
    noise = trunc_noise(T, cfg["n_embd"]) if with_noise else None
    logits, _ = run_stages(model, PROMPT, cfg["mean_recurrence"], chunk, noise)
    ref = plain_huginn(cfg, w, PROMPT, noise)
    assert (logits - ref).abs().max().item() < 1e-9


def test_huginn_noise_changes_logits_and_has_no_gate() -> None:
    model = load_model("toy-huginn", F64, "cpu")
    zero, _ = run_stages(model, PROMPT, 6, T)
    noisy, _ = run_stages(model, PROMPT, 6, T, trunc_noise(T, 64))
    assert (zero - noisy).abs().max().item() > 1e-6
    with pytest.raises(NotImplementedError, match="no exit gate"):
        model.exit_gate(torch.zeros(2, 64, dtype=F64))


def test_toy_models_are_not_degenerate() -> None:
    ouro = load_model("toy-ouro", F64, "cpu")
    logits, gates = run_stages(ouro, PROMPT, 4, T)
    lam = torch.stack(gates)
    assert 0.05 < lam.min().item() and lam.max().item() < 0.95 and lam.std().item() > 0.05
    for name in TOY_MODELS:
        logits, _ = run_stages(load_model(name, F64, "cpu"), PROMPT, 4 if name == "toy-ouro" else 6, T)
        top2 = logits.topk(2, dim=-1).values
        assert (top2[:, 0] - top2[:, 1]).min().item() > 1e-6
        assert logits.argmax(-1).unique().numel() > 3


def test_model_info() -> None:
    o = load_model("toy-ouro", torch.float32, "cpu").info
    assert (o.family, o.default_depth, o.num_loop_kv_layers, o.num_outer_kv_layers) == ("ouro", 4, 2, 0)
    assert (o.num_kv_heads, o.head_dim, o.vocab_size, o.max_model_len, o.eos_token_ids) == (2, 16, 264, 512, (257,))
    assert o.has_exit_gate and not o.has_coda_signal
    h = load_model("toy-huginn", torch.bfloat16, "cpu").info
    assert (h.family, h.default_depth, h.num_loop_kv_layers, h.num_outer_kv_layers) == ("huginn", 6, 2, 2)
    assert (h.num_kv_heads, h.head_dim, h.max_model_len, h.eos_token_ids) == (4, 16, 512, (257,))
    assert h.has_coda_signal and not h.has_exit_gate


# ---------------------------------------------------------------------------------------------
# (2) save → load round trip


@pytest.mark.parametrize("name", list(TOY_MODELS))
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_save_load_round_trip(tmp_path: Path, name: str, dtype: torch.dtype) -> None:
    model = load_model(name, dtype, "cpu")
    save_checkpoint(model, tmp_path, TOY_MODELS[name])
    again = load_model(str(tmp_path), dtype, "cpu")
    loops = model.info.default_depth
    noise = trunc_noise(T, 64) if name == "toy-huginn" else None
    a, _ = run_stages(model, PROMPT, loops, T, noise)
    b, _ = run_stages(again, PROMPT, loops, T, noise)
    assert a.dtype == dtype and torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# (3) strict loader


def write_checkpoint(path: Path, cfg: dict, state: dict[str, torch.Tensor]) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    return str(path)


BAD_TENSOR = {
    "toy-ouro": ("model.layers.1.self_attn.k_proj.weight", (32, 64)),
    "toy-huginn": ("transformer.core_block.1.attn.qk_bias", (2, 1, 4, 16)),
}


@pytest.mark.parametrize("name", list(TOY_MODELS))
def test_loader_names_missing_tensor(tmp_path: Path, name: str) -> None:
    cfg, state = toy_checkpoint(name)
    bad, _ = BAD_TENSOR[name]
    del state[bad]
    with pytest.raises(CheckpointError, match=f"missing tensor '{bad}'"):
        load_model(write_checkpoint(tmp_path, cfg, state), F64, "cpu")


@pytest.mark.parametrize("name", list(TOY_MODELS))
def test_loader_names_unexpected_tensor(tmp_path: Path, name: str) -> None:
    cfg, state = toy_checkpoint(name)
    state["model.layers.7.mlp.extra.weight"] = torch.zeros(3, 3, dtype=F64)
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.7\.mlp\.extra\.weight'"):
        load_model(write_checkpoint(tmp_path, cfg, state), F64, "cpu")


@pytest.mark.parametrize("name", list(TOY_MODELS))
def test_loader_names_misshaped_tensor(tmp_path: Path, name: str) -> None:
    cfg, state = toy_checkpoint(name)
    bad, shape = BAD_TENSOR[name]
    wrong = (shape[0] + 1, *shape[1:])
    state[bad] = torch.zeros(wrong, dtype=F64)
    with pytest.raises(CheckpointError) as err:
        load_model(write_checkpoint(tmp_path, cfg, state), F64, "cpu")
    assert bad in str(err.value) and str(wrong) in str(err.value) and str(shape) in str(err.value)


def test_huginn_loader_ignores_freqs_cis_and_accepts_stored_tied_head(tmp_path: Path) -> None:
    cfg, state = toy_checkpoint("toy-huginn")
    state["freqs_cis"] = torch.zeros(512, 1, 8, 2, dtype=F64)
    state["lm_head.weight"] = state["transformer.wte.weight"].clone()
    model = load_model(write_checkpoint(tmp_path, cfg, state), F64, "cpu")
    ref, _ = run_stages(load_model("toy-huginn", F64, "cpu"), PROMPT, 6, T)
    assert torch.equal(run_stages(model, PROMPT, 6, T)[0], ref)


def test_saved_names_are_the_originals(tmp_path: Path) -> None:
    for name in TOY_MODELS:
        _, state = toy_checkpoint(name)
        save_checkpoint(load_model(name, F64, "cpu"), tmp_path / name)  # config defaults to the model's
        assert set(load_file(str(tmp_path / name / "model.safetensors"))) == set(state)
        assert load_model(str(tmp_path / name), F64, "cpu").info == load_model(name, F64, "cpu").info


def test_tied_ouro_reads_the_embedding(tmp_path: Path) -> None:
    cfg, state = toy_checkpoint("toy-ouro")
    cfg["tie_word_embeddings"] = True
    del state["lm_head.weight"]
    model = load_model(write_checkpoint(tmp_path, cfg, state), F64, "cpu")
    logits, _ = run_stages(model, PROMPT, 4, T)
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    assert (logits - plain_ouro(cfg, state, PROMPT)[0]).abs().max().item() < 1e-9


def test_loader_rejects_bad_names_and_dtypes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="neither a built-in"):
        load_model(str(tmp_path / "nope"), F64, "cpu")
    with pytest.raises(ValueError, match="unsupported dtype"):
        load_model("toy-ouro", torch.int32, "cpu")


# ---------------------------------------------------------------------------------------------
# (4) config parsing


def test_ouro_config_rejects_sliding_window_layers() -> None:
    cfg = dict(TOY_MODELS["toy-ouro"], layer_types=["full_attention", "sliding_attention"], sliding_window=64)
    with pytest.raises(ValueError, match="layer 1 .*sliding_attention"):
        load_config(cfg)
    derived = dict(TOY_MODELS["toy-ouro"], use_sliding_window=True, sliding_window=64, max_window_layers=0)
    del derived["layer_types"]
    with pytest.raises(ValueError, match="layer 0 "):
        load_config(derived)
    # A window that applies to no layer (use_sliding_window off, the official default) is fine.
    inert = dict(TOY_MODELS["toy-ouro"], sliding_window=4096)
    del inert["layer_types"]
    assert isinstance(load_config(inert), OuroConfig)


def test_ouro_config_fields() -> None:
    cfg = load_config(dict(TOY_MODELS["toy-ouro"], eos_token_id=[257, 1], auto_map={"x": "y"}))
    assert isinstance(cfg, OuroConfig)
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.total_ut_steps, cfg.eos_token_ids) == (2, 16, 4, (257, 1))


def test_huginn_config_init_values() -> None:
    given = load_config(dict(TOY_MODELS["toy-huginn"], init_values={"embed_scale": 3.5, "std": 0.25}))
    assert isinstance(given, HuginnConfig)
    assert (given.embed_scale, given.init_std) == (3.5, 0.25)
    bare = dict(TOY_MODELS["toy-huginn"])
    del bare["init_values"]
    parsed = load_config(bare)
    assert parsed.embed_scale == math.sqrt(64) and parsed.init_std == math.sqrt(2 / (5 * 64))
    assert parsed.block_size == 512 and parsed.head_dim == 16


def test_huginn_default_eos_for_the_release_vocabulary() -> None:
    release = dict(TOY_MODELS["toy-huginn"], vocab_size=65536, padded_vocab_size=65536, eos_token_id=65505)
    assert load_config(release).eos_token_ids == (65504, 65505, 65508)


def test_load_config_model_type_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no 'model_type'"):
        load_config({"hidden_size": 8})
    with pytest.raises(ValueError, match="unknown model_type 'llama'"):
        load_config({"model_type": "llama"})
    (tmp_path / "config.json").write_text(json.dumps(TOY_MODELS["toy-huginn"]))
    assert isinstance(load_config(tmp_path), HuginnConfig)
