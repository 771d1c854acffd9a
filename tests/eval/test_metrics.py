"""Fidelity metrics on distributions with known answers."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_quant.eval import error_by_position, kl_divergence, sqnr_db, top1_agreement


def test_kl_of_identical_and_shifted_logits_is_zero():
    p = torch.randn(3, 7, 50)
    assert float(kl_divergence(p, p)) == 0.0
    assert float(kl_divergence(p, p + 3.5)) < 1e-12             # softmax ignores a constant shift
    assert kl_divergence(p, p, "none").shape == (3, 7)


@settings(max_examples=20)
@given(st.floats(-8, 8), st.floats(-8, 8))
def test_kl_of_two_token_distributions(a, b):
    """Logits [0, a] and [0, b]: Bernoulli(σ(a)) against Bernoulli(σ(b)), closed form."""
    p, q = 1 / (1 + math.exp(-a)), 1 / (1 + math.exp(-b))
    expected = p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))
    got = float(kl_divergence(torch.tensor([0.0, a], dtype=torch.float64), torch.tensor([0.0, b], dtype=torch.float64)))
    assert got == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_kl_against_uniform_is_log_v_minus_entropy():
    p = torch.tensor([[0.0, math.log(3.0)]], dtype=torch.float64)      # P = (1/4, 3/4)
    entropy = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert float(kl_divergence(p, torch.zeros(1, 2))) == pytest.approx(math.log(2) - entropy, rel=1e-12)
    v = torch.randn(4, 100, dtype=torch.float64)
    logp = torch.log_softmax(v.double(), -1)
    expected = math.log(100) + (logp.exp() * logp).sum(-1)
    assert torch.allclose(kl_divergence(v, torch.zeros_like(v), "none"), expected, rtol=1e-10)


def test_kl_is_asymmetric_and_handles_zeros():
    p, q = torch.tensor([0.0, -float("inf")]), torch.tensor([0.0, 0.0])
    assert float(kl_divergence(p, q)) == pytest.approx(math.log(2))   # P = (1, 0): zero terms contribute 0
    assert math.isinf(float(kl_divergence(q, p)))                      # Q gives 0 where P does not
    assert kl_divergence(torch.randn(5, 9, dtype=torch.bfloat16), torch.randn(5, 9)).dtype == torch.float64


def test_top1_agreement():
    p = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    q = torch.tensor([[0.0, 5.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 9.0], [2.0, 1.0, 0.0]])
    assert float(top1_agreement(p, q)) == 0.5
    assert top1_agreement(p, q, "none").tolist() == [True, False, True, False]


def test_sqnr():
    ref = torch.ones(100)
    assert sqnr_db(ref, ref * 1.1) == pytest.approx(20.0)
    assert sqnr_db(ref, ref) == math.inf
    x = torch.randn(1000, dtype=torch.float64)
    assert sqnr_db(x, x + 0.01 * x) == pytest.approx(40.0)


def test_error_by_position_bins():
    """A model whose logits drift linearly with position: KL grows along the context, by position and binned."""
    p = torch.randn(2, 1, 30, dtype=torch.float64).expand(2, 12, 30)    # the same distribution at each position
    drift = torch.arange(12).view(1, 12, 1) * 0.05 * torch.randn(1, 1, 30)
    rows = error_by_position(p, p + drift)
    assert [(a, b) for a, b, _, _ in rows] == [(i, i + 1) for i in range(12)]
    kls = [kl for _, _, kl, _ in rows]
    assert kls[0] == 0.0 and all(x < y for x, y in zip(kls, kls[1:]))
    binned = error_by_position(p, p + drift, bins=4)
    assert [(a, b) for a, b, _, _ in binned] == [(0, 3), (3, 6), (6, 9), (9, 12)]
    assert binned[1][2] == pytest.approx(sum(kls[3:6]) / 3)
    assert len(error_by_position(p[0], p[0], bins=50)) == 12             # [T, V] input; at most one bin per position


def test_shape_errors():
    with pytest.raises(ValueError, match="q_logits: shape"):
        kl_divergence(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="reduction"):
        kl_divergence(torch.zeros(2, 3), torch.zeros(2, 3), "sum")
    with pytest.raises(ValueError, match="approx"):
        sqnr_db(torch.zeros(3), torch.zeros(4))
