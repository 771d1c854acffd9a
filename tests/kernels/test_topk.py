import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mla_quant.kernels.topk import topk_indices, topk_indices_reference


def selection_is_valid(scores, idx, k):
    """idx selects min(k, N) entries of each row: all finite entries when there are ≤ k of them (-1 for the
    rest), else k distinct entries whose values are the k largest (as a multiset: ties may pick any)."""
    n = scores.shape[-1]
    assert idx.dtype == torch.int32 and idx.shape == (scores.shape[0], min(k, n))
    for row, sel in zip(scores, idx):
        finite = torch.isfinite(row)
        picked = sel[sel >= 0].long()
        assert picked.unique().numel() == picked.numel()
        if int(finite.sum()) <= k:
            assert set(picked.tolist()) == set(finite.nonzero().flatten().tolist())
        else:
            assert picked.numel() == min(k, n)
            assert torch.equal(row[picked].sort().values, row.topk(min(k, n)).values.sort().values)


def test_fewer_valid_than_k_pads_with_minus_one():
    scores = torch.tensor([[3.0, float("-inf"), 1.0, float("-inf"), 2.0]])
    idx = topk_indices(scores, 4)
    assert sorted(idx[0].tolist()) == [-1, 0, 2, 4]
    assert topk_indices(scores, 9).shape == (1, 5)


def test_ties_are_any_valid_choice():
    scores = torch.tensor([[1.0, 5.0, 5.0, 5.0, 0.0]])
    selection_is_valid(scores, topk_indices(scores, 2), 2)


@given(k=st.integers(1, 20), n=st.integers(1, 40), rows=st.integers(1, 6), seed=st.integers(0, 2**16),
       causal=st.booleans(), ties=st.booleans())
def test_selection_around_k(k, n, rows, seed, causal, ties):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, n, generator=g)
    if ties:
        scores = scores.round()
    if causal:  # row r sees a prefix whose length straddles k: k-1, k, k+1, ...
        visible = torch.tensor([max(1, min(n, k - 1 + r)) for r in range(rows)])
        scores = scores.masked_fill(torch.arange(n)[None, :] >= visible[:, None], float("-inf"))
    selection_is_valid(scores, topk_indices(scores, k), k)
    assert torch.equal(topk_indices(scores, k), topk_indices_reference(scores, k))


def test_bad_inputs():
    with pytest.raises(ValueError, match="k"):
        topk_indices(torch.randn(2, 4), 0)
    with pytest.raises(ValueError, match="scores"):
        topk_indices(torch.randn(2, 0), 3)
    with pytest.raises(ValueError, match="scores"):
        topk_indices(torch.randn(4), 3)
