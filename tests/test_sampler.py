"""Philox bits, uniform/truncated-normal statistics and the row-wise sampler (SPEC §5)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlt_worker.philox import (
    PURPOSE_SAMPLE,
    PURPOSE_STATE_INIT,
    philox4x32,
    seed_to_int64,
    truncated_normal,
    uniform,
)
from rlt_worker.sampler import SamplingKind, SamplingTensors, sample

KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


def chi2_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Upper-tail p-value of Pearson's chi-square with len-1 degrees of freedom."""
    stat = ((observed.double() - expected) ** 2 / expected).sum()
    dof = torch.tensor((observed.numel() - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, stat / 2))


def params(n: int, temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0, seed: int = 7,
           indices: list[int] | None = None) -> SamplingTensors:
    """n rows with the same parameters and indices 0..n-1 unless given."""
    return SamplingTensors.build([temperature] * n, [top_k] * n, [top_p] * n, [seed] * n,
                                 indices if indices is not None else list(range(n)))


# ---- Philox ----------------------------------------------------------------------------------

@pytest.mark.parametrize("counter,key,expected", KNOWN_ANSWERS)
def test_philox_known_answers(counter: tuple, key: tuple, expected: tuple) -> None:
    out = philox4x32(torch.tensor(counter), torch.tensor(key))
    assert out.tolist() == list(expected)


def test_philox_vectorised_over_rows() -> None:
    counters = torch.tensor([c for c, _, _ in KNOWN_ANSWERS])
    keys = torch.tensor([k for _, k, _ in KNOWN_ANSWERS])
    assert philox4x32(counters, keys).tolist() == [list(e) for _, _, e in KNOWN_ANSWERS]


def test_uniform_mapping_matches_spec() -> None:
    seed, index, purpose = 0x0123456789ABCDEF, 42, PURPOSE_SAMPLE
    u = uniform(torch.tensor([seed]), purpose, torch.tensor([index]), 10)[0]
    key = torch.tensor([seed % 2**32, seed // 2**32])
    for e in range(10):
        word = philox4x32(torch.tensor([e // 4, index, purpose, 0]), key)[e % 4].item()
        assert u[e].item() == (word + 0.5) / 2**32


def test_uniform_is_repeatable_and_prefix_stable() -> None:
    seeds, idx = torch.tensor([1, 2, 3]), torch.tensor([0, 5, 9])
    a = uniform(seeds, PURPOSE_SAMPLE, idx, 37)
    assert torch.equal(a, uniform(seeds, PURPOSE_SAMPLE, idx, 37))
    assert torch.equal(a[:, :10], uniform(seeds, PURPOSE_SAMPLE, idx, 10))
    assert a.dtype == torch.float64 and bool((a > 0).all() and (a < 1).all())


def test_streams_differ_by_seed_purpose_and_index() -> None:
    def draw(seed: int, purpose: int, index: int) -> torch.Tensor:
        return uniform(torch.tensor([seed]), purpose, torch.tensor([index]), 64)

    base = draw(5, PURPOSE_SAMPLE, 3)
    for other in (draw(6, PURPOSE_SAMPLE, 3), draw(5 + 2**32, PURPOSE_SAMPLE, 3),
                  draw(5, PURPOSE_STATE_INIT, 3), draw(5, PURPOSE_SAMPLE, 4)):
        assert not torch.isclose(base, other).any()


def test_seeds_at_or_above_2_pow_63() -> None:
    big = 2**64 - 1
    assert seed_to_int64(big) == -1 and seed_to_int64(2**63) == -(2**63)
    with pytest.raises(ValueError):
        seed_to_int64(2**64)
    u = uniform(torch.tensor([seed_to_int64(big)]), PURPOSE_SAMPLE, torch.tensor([0]), 4)[0]
    words = philox4x32(torch.tensor([0, 0, PURPOSE_SAMPLE, 0]), torch.tensor([2**32 - 1, 2**32 - 1]))
    assert u.tolist() == ((words.double() + 0.5) / 2**32).tolist()
    high = uniform(torch.tensor([seed_to_int64(2**63 + 5)]), PURPOSE_SAMPLE, torch.tensor([0]), 16)
    low = uniform(torch.tensor([5]), PURPOSE_SAMPLE, torch.tensor([0]), 16)
    assert not torch.equal(high, low)
    tokens, _ = sample(torch.zeros(2, 50), SamplingTensors.build([1.0] * 2, [-1] * 2, [1.0] * 2,
                                                                 [big, 2**63], [0, 0]))
    assert tokens.shape == (2,)


def test_uniform_chi_square() -> None:
    u = uniform(torch.tensor([12345]), PURPOSE_SAMPLE, torch.tensor([0]), 10_000)[0]
    counts = torch.histc(u, bins=20, min=0.0, max=1.0)
    assert chi2_pvalue(counts, torch.full((20,), 500.0, dtype=torch.float64)) > 1e-3


def test_truncated_normal_moments() -> None:
    x = truncated_normal(torch.tensor([3, 4]), torch.tensor([0, 1]), 100_000).flatten()
    assert x.dtype == torch.float64
    assert bool((x >= -3).all() and (x <= 3).all())
    phi3 = math.exp(-4.5) / math.sqrt(2 * math.pi)
    expected_std = math.sqrt(1 - 6 * phi3 / math.erf(3 / math.sqrt(2)))  # ~0.9866
    assert abs(x.mean().item()) < 0.01
    assert abs(x.std().item() - expected_std) < 0.005


# ---- Sampler ---------------------------------------------------------------------------------

def expected_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution the sampler should draw from, computed the slow obvious way."""
    probs = torch.softmax(logits.double() / temperature, -1)
    order = sorted(range(len(logits)), key=lambda t: (-logits[t].item(), t))
    kept = order[:top_k] if top_k > 0 else order
    mass = sum(probs[t].item() for t in kept)
    prefix, cum = [], 0.0
    for t in kept:
        prefix.append(t)
        cum += probs[t].item() / mass
        if top_p < 1.0 and cum >= top_p:
            break
    out = torch.zeros_like(probs)
    out[prefix] = probs[prefix]
    return out / out.sum()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, 3, 1.0), (1.5, -1, 0.8)])
def test_sample_frequencies(temperature: float, top_k: int, top_p: float) -> None:
    logits = torch.log(torch.tensor([0.05, 0.1, 0.15, 0.3, 0.4]))
    n = 10_000
    tokens, _ = sample(logits.expand(n, 5), params(n, temperature, top_k, top_p, seed=2024))
    probs = expected_probs(logits, temperature, top_k, top_p)
    counts = torch.bincount(tokens, minlength=5).double()
    support = probs > 0
    assert counts[~support].sum() == 0
    assert chi2_pvalue(counts[support], n * probs[support]) > 1e-3


def test_greedy_is_argmax_with_first_index_on_ties() -> None:
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, -1.0, 5.0, 5.0], [-3.0, -2.0, -1.0, -1.5]])
    tokens, logprobs = sample(logits, params(3, temperature=0.0, top_k=2, top_p=0.3))
    assert tokens.tolist() == [1, 0, 2]
    assert torch.equal(logprobs, torch.log_softmax(logits.double(), -1)[torch.arange(3), tokens])


def test_logprob_is_of_raw_logits_in_float64() -> None:
    logits = torch.randn(16, 40, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    tokens, logprobs = sample(logits, params(16, temperature=0.5, top_k=5, top_p=0.9))
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float64
    raw = torch.log_softmax(logits.double(), -1)[torch.arange(16), tokens]
    assert torch.equal(logprobs, raw)


def test_tie_rules_keep_lower_token_ids() -> None:
    flat = torch.zeros(1000, 10)
    assert set(sample(flat, params(1000, top_k=3))[0].tolist()) == {0, 1, 2}
    assert set(sample(flat, params(1000, top_p=0.35))[0].tolist()) == {0, 1, 2, 3}
    assert set(sample(flat, params(1000, top_p=0.0))[0].tolist()) == {0}
    # Cumulative mass exactly equal to top_p ends the prefix: 0.25 + 0.25 >= 0.5.
    assert set(sample(torch.zeros(1000, 4), params(1000, top_p=0.5))[0].tolist()) == {0, 1}


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    rows=st.lists(
        st.tuples(
            st.lists(st.integers(-4, 4), min_size=1, max_size=24),  # small ints: many exact ties
            st.integers(-1, 26),
            st.floats(0.0, 1.0),
            st.sampled_from([0.3, 1.0, 4.0]),
        ),
        min_size=1, max_size=4,
    ),
)
def test_top_k_top_p_stay_in_allowed_set(rows: list[tuple[list[int], int, float, float]]) -> None:
    reps = 64  # each row is drawn at 64 indices so the check has teeth
    for ints, top_k, top_p, temperature in rows:
        logits = torch.tensor(ints, dtype=torch.float64) * 0.75
        allowed = expected_probs(logits, temperature, top_k, top_p) > 0
        tokens, _ = sample(logits.expand(reps, -1), params(reps, temperature, top_k, top_p, seed=len(ints)))
        assert bool(allowed[tokens].all())


def test_rows_are_independent() -> None:
    gen = torch.Generator().manual_seed(1)
    n, v = 8, 300
    logits = torch.randn(n, v, generator=gen, dtype=torch.float64) * 3
    p = SamplingTensors.build(
        temperature=[0.0, 1.0, 0.5, 2.0, 1.0, 0.0, 0.8, 1.2],
        top_k=[-1, -1, 10, 0, 50, 5, -1, 3],
        top_p=[1.0, 0.9, 1.0, 0.5, 0.95, 0.1, 1.0, 0.7],
        seeds=[1, 2, 3, 2**63 + 4, 5, 6, 7, 8],
        indices=[0, 3, 1, 4, 1, 5, 9, 2],
    )
    tokens, logprobs = sample(logits, p)
    assert torch.equal(tokens, sample(logits, p)[0])  # repeatable
    for i in range(n):
        alone = SamplingTensors(*(getattr(p, f)[i:i + 1] for f in
                                  ("temperature", "top_k", "top_p", "seeds", "indices")))
        t, lp = sample(logits[i:i + 1], alone)
        assert t.item() == tokens[i].item() and lp.item() == logprobs[i].item()


def test_sampling_kind_of_a_batch() -> None:
    """GREEDY only when every row is; FILTERED only when a sampled row filters (a greedy row's top-k is moot)."""
    assert SamplingKind.of([True, True], [True, False]) is SamplingKind.GREEDY
    assert SamplingKind.of([True, False], [True, False]) is SamplingKind.GUMBEL
    assert SamplingKind.of([False, False], [False, True]) is SamplingKind.FILTERED
    with pytest.raises(ValueError, match="one filter flag a row"):
        SamplingKind.of([False], [False, True])


def test_each_kind_gives_the_general_paths_tokens() -> None:
    """The kind a batch is given only skips work: GUMBEL (no mask) and GREEDY (no noise) equal the
    general path, FILTERED, on the batches they are for; None reads the kind from the parameters."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 300, generator=gen, dtype=torch.float64) * 3
    seeds, indices = [1, 2, 2**63 + 4, 5, 6, 7], [0, 3, 1, 4, 9, 2]
    plain = SamplingTensors.build([0.0, 1.0, 0.5, 2.0, 1.0, 0.0], [-1, -1, 0, -1, -1, 5], [1.0] * 5 + [0.3],
                                  seeds, indices)
    greedy = SamplingTensors.build([0.0] * 6, [3] * 6, [0.5] * 6, seeds, indices)
    for p, kind in ((plain, SamplingKind.GUMBEL), (greedy, SamplingKind.GREEDY)):
        general = sample(logits, p, SamplingKind.FILTERED)
        for stated in (kind, None):
            got = sample(logits, p, stated)
            assert torch.equal(got[0], general[0]) and torch.equal(got[1], general[1])
    assert not torch.equal(sample(logits, plain, SamplingKind.GUMBEL)[0], sample(logits, greedy)[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_and_cuda_bits_identical() -> None:
    counters = torch.tensor([c for c, _, _ in KNOWN_ANSWERS])
    keys = torch.tensor([k for _, k, _ in KNOWN_ANSWERS])
    assert torch.equal(philox4x32(counters, keys), philox4x32(counters.cuda(), keys.cuda()).cpu())
    seeds = torch.tensor([0, 1, seed_to_int64(2**64 - 1), seed_to_int64(2**63)])
    idx = torch.tensor([0, 7, 123456, 2**31])
    cpu = uniform(seeds, PURPOSE_SAMPLE, idx, 1001)
    assert torch.equal(cpu, uniform(seeds.cuda(), PURPOSE_SAMPLE, idx.cuda(), 1001).cpu())
    # ndtri differs between CPU and CUDA in the last float64 ulp, so state init is close, not equal.
    normal = truncated_normal(seeds.cuda(), idx.cuda(), 1001).cpu()
    assert torch.allclose(truncated_normal(seeds, idx, 1001), normal, rtol=0, atol=1e-12)
    logits = torch.randn(4, 1001, dtype=torch.float64) * 2
    p = SamplingTensors.build([0.0, 1.0, 0.7, 1.3], [-1, 20, -1, 100], [1.0, 1.0, 0.9, 0.8],
                              [0, 1, 2**64 - 1, 2**63], [0, 7, 123456, 2**31])
    p_cuda = SamplingTensors(*(t.cuda() for t in (p.temperature, p.top_k, p.top_p, p.seeds, p.indices)))
    assert torch.equal(sample(logits, p)[0], sample(logits.cuda(), p_cuda)[0].cpu())
