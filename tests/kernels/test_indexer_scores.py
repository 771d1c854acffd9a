import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mla_quant.kernels.indexer_k_append import quantize_indexer_keys_reference
from mla_quant.kernels.indexer_scores import (indexer_scores, indexer_scores_reference, indexer_topk,
                                             req_ids_from_cu_seqlens)
from mla_quant.testing import page_tables, rel_err
from tests.conftest import HAS_CUDA

FP8 = torch.float8_e4m3fn


def make_keys(key_dtype, lengths, page_size, d, seed=0, tables=None, device="cpu"):
    """Key pages with NaN in every slot no request uses; returns (k_cache, k_scale, table, keys per request)."""
    g = torch.Generator().manual_seed(seed)
    if tables is None:
        need = [-(-n // page_size) for n in lengths]
        pool = sum(need) + 2
        perm = torch.randperm(pool, generator=g).to(torch.int32)
        table = torch.full((len(lengths), max(need)), -1, dtype=torch.int32)
        c = 0
        for b, n in enumerate(need):
            table[b, :n] = perm[c:c + n]
            c += n
    else:
        table, _, pool = tables
    raw = torch.randn(pool * page_size, d, generator=g)
    scale = None
    if key_dtype == FP8:
        k, scale = quantize_indexer_keys_reference(raw)
        scale = scale.reshape(pool, page_size).clone()
    else:
        k = raw.to(key_dtype)
    k = k.reshape(pool, page_size, d).clone()
    used = torch.zeros(pool * page_size, dtype=torch.bool)
    for b, n in enumerate(lengths):
        pos = torch.arange(n)
        used[table[b, pos // page_size].long() * page_size + pos % page_size] = True
    k.view(torch.uint8).reshape(pool * page_size, -1)[~used] = 0xFF
    if scale is not None:
        scale.reshape(-1)[~used] = float("nan")
    return (k.to(device), None if scale is None else scale.to(device), table.to(device))


def step_tokens(lengths, query_lens):
    """Flattened query tokens of a step: the last query_lens[b] positions of request b."""
    req, pos = [], []
    for b, (n, m) in enumerate(zip(lengths, query_lens)):
        req += [b] * m
        pos += list(range(n - m, n))
    return torch.tensor(req, dtype=torch.int32), torch.tensor(pos, dtype=torch.int64)


def brute_force(q, w, k_cache, k_scale, table, req, pos, n):
    t, h, d = q.shape
    ps = k_cache.shape[1]
    out = torch.full((t, n), float("-inf"))
    for i in range(t):
        for s in range(int(pos[i]) + 1):
            slot = int(table[req[i], s // ps]) * ps + s % ps
            key = k_cache.reshape(-1, d)[slot].float()
            ks = 1.0 if k_scale is None else float(k_scale.reshape(-1)[slot])
            out[i, s] = ks * sum(float(w[i, j]) * max(float(q[i, j].float() @ key), 0.0) for j in range(h))
    return out


@pytest.mark.parametrize("key_dtype", [FP8, torch.bfloat16, torch.float32])
def test_reference_is_the_formula(key_dtype):
    lengths = [9, 20]
    k_cache, k_scale, table = make_keys(key_dtype, lengths, 8, 32)
    req, pos = step_tokens(lengths, [3, 2])
    q, w = torch.randn(5, 3, 32), torch.rand(5, 3)
    got = indexer_scores_reference(q, w, k_cache, k_scale, table, req, pos, 24)
    want = brute_force(q, w, k_cache, k_scale, table, req, pos, 24)
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and not torch.isnan(got).any()
    fin = torch.isfinite(want)
    assert torch.allclose(got[fin], want[fin], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("key_dtype,q_dtype", [(FP8, FP8), (FP8, torch.float32), (FP8, torch.bfloat16),
                                               (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)])
def test_kernel_matches_reference(triton_backend, key_dtype, q_dtype):
    dev = triton_backend
    lengths = [130, 7, 64, 65]
    k_cache, k_scale, table = make_keys(key_dtype, lengths, 16, 64, device=dev)
    req, pos = step_tokens(lengths, [5, 7, 1, 2])
    req, pos = req.to(dev), pos.to(dev)
    q = torch.randn(len(req), 4, 64, device=dev)
    q = q.clamp(-448, 448).to(q_dtype)
    w = torch.rand(len(req), 4, device=dev)
    got = indexer_scores(q, w, k_cache, k_scale, table, req, pos)
    want = indexer_scores_reference(q, w, k_cache, k_scale, table, req, pos)
    assert got.shape == (len(req), table.shape[1] * 16)
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and not torch.isnan(got).any()
    fin = torch.isfinite(want)
    assert rel_err(got[fin], want[fin]) < (1e-5 if not HAS_CUDA else 1e-2)


def test_masked_positions_are_minus_inf_and_max_ctx_truncates(triton_backend):
    dev = triton_backend
    k_cache, k_scale, table = make_keys(torch.float32, [40], 16, 32, device=dev)
    req = torch.zeros(3, dtype=torch.int32, device=dev)
    pos = torch.tensor([0, 17, 39], device=dev)
    q, w = torch.randn(3, 2, 32, device=dev), torch.rand(3, 2, device=dev)
    got = indexer_scores(q, w, k_cache, k_scale, table, req, pos, max_ctx=41)
    assert got.shape == (3, 41)
    for i, p in enumerate([0, 17, 39]):
        assert torch.isfinite(got[i, :p + 1]).all() and torch.all(got[i, p + 1:] == float("-inf"))


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])  # the fixture only sets the backend
@given(lengths=st.lists(st.integers(1, 90), min_size=1, max_size=4), page_size=st.sampled_from([1, 8, 16, 64]),
       key_dtype=st.sampled_from([FP8, torch.bfloat16, torch.float32]), seed=st.integers(0, 2**16), data=st.data())
def test_hypothesis_ragged_steps_and_page_boundaries(triton_backend, lengths, page_size, key_dtype, seed, data):
    dev = triton_backend
    tables = data.draw(page_tables(lengths, page_size, share_prefix=True))   # drawn on the CPU
    k_cache, k_scale, table = make_keys(key_dtype, lengths, page_size, 32, seed, tables, device=dev)
    qlens = [data.draw(st.integers(1, n)) for n in lengths]
    req, pos = step_tokens(lengths, qlens)
    req, pos = req.to(dev), pos.to(dev)
    g = torch.Generator().manual_seed(seed)
    q, w = torch.randn(len(req), 3, 32, generator=g).to(dev), torch.rand(len(req), 3, generator=g).to(dev)
    got = indexer_scores(q, w, k_cache, k_scale, table, req, pos)
    want = indexer_scores_reference(q, w, k_cache, k_scale, table, req, pos)   # pure torch on any device
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and not torch.isnan(got).any()
    fin = torch.isfinite(want)
    # fp32 in both, summed in another order: relative 1e-5 overall, plus an absolute floor for a score that is
    # the ReLU of a near-cancelling dot (one such score alone measured 1.07e-5 relative)
    assert rel_err(got[fin], want[fin]) < 1e-5 or torch.allclose(got[fin], want[fin], rtol=1e-5, atol=1e-5)


def test_req_ids_from_cu_seqlens():
    cu = torch.tensor([0, 3, 3, 4, 9], dtype=torch.int32)
    assert req_ids_from_cu_seqlens(cu, 9).tolist() == [0, 0, 0, 2, 3, 3, 3, 3, 3]


def test_bad_inputs_name_the_argument():
    k_cache, k_scale, table = make_keys(FP8, [10], 16, 32)
    req, pos = step_tokens([10], [2])
    q, w = torch.randn(2, 4, 32), torch.rand(2, 4)
    with pytest.raises(ValueError, match="k_scale"):
        indexer_scores(q, w, k_cache, None, table, req, pos)
    with pytest.raises(TypeError, match="weights"):
        indexer_scores(q, w.double(), k_cache, k_scale, table, req, pos)
    with pytest.raises(ValueError, match="weights"):
        indexer_scores(q, w[:, :3], k_cache, k_scale, table, req, pos)
    with pytest.raises(ValueError, match="head dim"):
        indexer_scores(torch.randn(2, 4, 64), w, k_cache, k_scale, table, req, pos)
    with pytest.raises(IndexError, match="positions"):
        indexer_scores(q, w, k_cache, k_scale, table, req, torch.tensor([3, 16]))
    with pytest.raises(IndexError, match="req_ids"):
        indexer_scores(q, w, k_cache, k_scale, table, req + 1, pos)
    bad = table.clone()
    bad[0, 0] = -1
    with pytest.raises(IndexError, match="block_table"):
        indexer_scores(q, w, k_cache, k_scale, bad, req, pos)


@pytest.mark.gpu
@pytest.mark.parametrize("q_dtype", [FP8, torch.bfloat16])
def test_gpu_glm_shapes_scores_and_selection(q_dtype):
    """32 heads × 128, page 64, FP8 keys: tensor-core dots against the fp32 reference; the top-2048 selection
    keeps the same scores (ties aside)."""
    from mla_quant.kernels.topk import topk_indices

    lengths = [5000, 2100, 64, 3000]
    k_cache, k_scale, table = make_keys(FP8, lengths, 64, 128, device="cuda")
    req, pos = step_tokens(lengths, [1, 1, 1, 1])
    req, pos = req.cuda(), pos.cuda()
    q = (torch.randn(4, 32, 128, device="cuda") * 20).clamp(-448, 448).to(q_dtype)
    w = torch.rand(4, 32, device="cuda")
    got = indexer_scores(q, w, k_cache, k_scale, table, req, pos)
    want = indexer_scores_reference(q, w, k_cache, k_scale, table, req, pos)
    fin = torch.isfinite(want)
    # Hopper's FP8 MMA accumulates with a shortened mantissa: allow 1e-3
    assert torch.equal(fin, torch.isfinite(got)) and rel_err(got[fin], want[fin]) < 1e-3
    sel = topk_indices(got, 2048)
    ref = topk_indices(want, 2048)
    for row in range(4):
        a, b = sel[row][sel[row] >= 0].long(), ref[row][ref[row] >= 0].long()
        assert a.numel() == b.numel()
        assert torch.allclose(want[row, a].sort().values, want[row, b].sort().values, rtol=2e-3, atol=1e-3)


# ------------------------------------------------------------------ indexer_topk: scores + selection, fused
def decode_step(lengths, page_size, key_dtype, seed, dev, heads=3, d=32, tables=None):
    k_cache, k_scale, table = make_keys(key_dtype, lengths, page_size, d, seed, tables, device=dev)
    req, pos = step_tokens(lengths, [1] * len(lengths))
    g = torch.Generator().manual_seed(seed)
    q, w = torch.randn(len(req), heads, d, generator=g), torch.rand(len(req), heads, generator=g)
    return q.to(dev), w.to(dev), k_cache, k_scale, table, req.to(dev), pos.to(dev)


@pytest.mark.parametrize("fused", [True, False])
def test_indexer_topk_selects_the_top_k_of_the_scores(triton_backend, fused):
    """Fused (the scores kernel counts the radix select's first digit) and unfused: a valid top-k of the very
    scores the kernel computes (as sets), -1 padding for a request shorter than k."""
    from tests.kernels.test_topk import selection_is_valid

    args = decode_step([130, 7, 64, 65], 16, FP8, 0, triton_backend)
    scores = indexer_scores(*args)
    idx = indexer_topk(*args, 20, fused=fused)
    assert idx.shape == (4, 20)
    selection_is_valid(scores, idx, 20)
    assert (idx[1] == -1).sum() == 20 - 7


def test_indexer_topk_kept_work_buffer(triton_backend):
    """A kept work buffer (``topk_work_buffer``, 4 rows) serves calls of 1 to 4 tokens in a row with other
    data: each selection is valid and the buffer is zero after every call; a wrong buffer is refused."""
    from mla_quant.kernels.indexer_scores import topk_work_buffer, topk_work_ints
    from tests.kernels.test_topk import selection_is_valid

    work = topk_work_buffer(triton_backend)
    for seed, lengths in enumerate([[130, 7, 64, 65], [90], [77, 130]]):
        args = decode_step(lengths, 16, FP8, seed, triton_backend)
        idx = indexer_topk(*args, 20, work=work)
        selection_is_valid(indexer_scores(*args), idx, 20)
        assert not work.cpu().any()
    args = decode_step([130, 7], 16, FP8, 5, triton_backend)
    for bad in (work[:1], work[:, :-1].contiguous(), work.float(), work.t()):
        with pytest.raises((ValueError, TypeError), match="work"):
            indexer_topk(*args, 20, work=bad)
    assert topk_work_ints() == work.shape[1]


def test_indexer_topk_all_ties_and_max_ctx(triton_backend):
    """q = 0: every visible score is exactly 0 (one radix bin), -inf past each position; max_ctx truncates."""
    from tests.kernels.test_topk import selection_is_valid

    q, w, k_cache, k_scale, table, req, pos = decode_step([90, 40], 8, torch.float32, 1, triton_backend)
    q = torch.zeros_like(q)
    idx = indexer_topk(q, w, k_cache, k_scale, table, req, pos, 33, max_ctx=91)
    selection_is_valid(indexer_scores(q, w, k_cache, k_scale, table, req, pos, 91), idx, 33)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])  # the fixture only sets the backend
@given(n=st.integers(20, 90), dk=st.sampled_from([-1, 0, 1]), rows=st.integers(1, 5),
       page_size=st.sampled_from([1, 8, 16]), key_dtype=st.sampled_from([FP8, torch.float32]),
       seed=st.integers(0, 2**16), data=st.data())
def test_indexer_topk_hypothesis_lengths_around_k(triton_backend, n, dk, rows, page_size, key_dtype, seed, data):
    """Ragged decode batches whose longest request holds k - 1, k or k + 1 tokens (so the block table holds a
    little more than k: the radix path), page boundaries; 5 rows take the unfused path."""
    from tests.kernels.test_topk import selection_is_valid

    lengths = [n] + [data.draw(st.integers(1, n)) for _ in range(rows - 1)]
    tables = data.draw(page_tables(lengths, page_size, share_prefix=True))
    args = decode_step(lengths, page_size, key_dtype, seed, triton_backend, tables=tables)
    k = n - dk
    idx = indexer_topk(*args, k)
    selection_is_valid(indexer_scores(*args), idx, k)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [8192, 65536])
def test_gpu_indexer_topk_fused_glm_decode(n):
    """GLM 5.2 decode at batch 1: the fused path selects the top-2048 of the kernel's scores (the selected
    values equal the 2048 largest: the fused kernel's scores may differ from indexer_scores' in the last bit),
    also when replayed from a CUDA graph with new queries."""

    def check(idx):
        scores = indexer_scores(*args)[0]
        sel = idx[0]
        assert (sel >= 0).all() and sel.unique().numel() == 2048
        assert torch.allclose(scores[sel.long()].sort().values, scores.topk(2048).values.sort().values,
                              rtol=1e-5, atol=0)

    q, w, k_cache, k_scale, table, req, pos = decode_step([n], 64, FP8, 0, "cuda", heads=32, d=128)
    q = (q * 20).clamp(-448, 448).to(FP8)
    args = (q, w, k_cache, k_scale, table, req, pos)
    check(indexer_topk(*args, 2048))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        idx = indexer_topk(*args, 2048)
    q.copy_((torch.randn(q.shape, device="cuda") * 20).clamp(-448, 448).to(FP8))
    graph.replay()
    torch.cuda.synchronize()
    check(idx)
