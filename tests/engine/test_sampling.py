"""Sampling: greedy ties, top-p sets, seeded determinism, and the sampled distribution."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_quant.engine import SamplingParams, sample, top_p_filter
from mla_quant.engine.sampling import sample_one, token_seed


def test_greedy_takes_the_lowest_id_on_ties():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, 5.0, 5.0, 5.0]])
    assert sample(logits, [SamplingParams()] * 2, [0, 0]) == [1, 0]


def test_top_p_keeps_the_smallest_set():
    probs = torch.tensor([0.1, 0.5, 0.25, 0.15])
    # sorted 0.5, 0.25, 0.15, 0.1: 0.5 < 0.6 so the next is needed; 0.75 >= 0.6 stops
    assert torch.equal(top_p_filter(probs, 0.6) > 0, torch.tensor([False, True, True, False]))
    assert torch.allclose(top_p_filter(probs, 0.6), torch.tensor([0, 2 / 3, 1 / 3, 0]))
    assert torch.equal(top_p_filter(probs, 0.5) > 0, torch.tensor([False, True, False, False]))
    assert torch.equal(top_p_filter(probs, 1.0), probs)


@settings(max_examples=20)
@given(st.lists(st.floats(-5, 5), min_size=2, max_size=40), st.floats(0.01, 1.0))
def test_top_p_mass(logits, top_p):
    probs = torch.softmax(torch.tensor(logits, dtype=torch.float64), 0)
    kept = top_p_filter(probs, top_p) > 0
    mass = float(probs[kept].sum())
    assert mass >= top_p - 1e-9                                  # reaches the mass
    assert mass - float(probs[kept].min()) < top_p + 1e-9        # dropping the least likely kept one would not
    assert float(probs[~kept].max()) <= float(probs[kept].min()) if (~kept).any() else True


def test_seeded_sampling_is_deterministic_and_per_index():
    logits = torch.randn(64)
    p = SamplingParams(temperature=1.0, seed=7)
    draws = [sample_one(logits, p, i) for i in range(40)]
    assert draws == [sample_one(logits, p, i) for i in range(40)]
    assert len(set(draws)) > 5
    assert [sample_one(logits, SamplingParams(temperature=1.0, seed=8), i) for i in range(40)] != draws
    assert len({token_seed(s, i) for s in range(50) for i in range(50)}) == 2500


def test_sampled_frequencies_follow_the_distribution():
    """Draws over many indices match softmax(logits / T) restricted to the top-p set (7 tokens: chi-square
    with 6 degrees of freedom)."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5, -2.0, -9.0])
    p = SamplingParams(temperature=0.7, top_p=0.99, seed=1)
    n = 4000
    counts = torch.bincount(torch.tensor([sample_one(logits, p, i) for i in range(n)]), minlength=10).double()
    expected = top_p_filter(torch.softmax(logits / 0.7, 0), 0.99).double() * n
    assert counts[expected == 0].sum() == 0
    keep = expected > 0
    assert int(keep.sum()) == 7
    chi2 = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    assert chi2 < 22.46, chi2             # the 0.999 quantile of chi-square with 6 degrees of freedom


def test_sample_checks_shapes():
    with pytest.raises(ValueError, match="logits"):
        sample(torch.zeros(2, 5), [SamplingParams()], [0])
    assert math.isclose(float(top_p_filter(torch.tensor([1.0]), 0.3).sum()), 1.0)
