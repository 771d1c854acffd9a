import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mla_quant.kernels.kv_layout import quantize_kv_rows
from mla_quant.kernels.sparse_mla_decode import sparse_mla_decode, sparse_mla_decode_reference
from mla_quant.testing import assert_all_written, page_tables, rel_err

KINDS = [("bf16", "token"), ("fp8_e4m3", "token"), ("fp8_e4m3", "tensor"), ("fp8_ds_mla", "token")]


def make_pages(kind, scale_mode, lengths, page_size, d_latent, d_rope, seed=0, tables=None, device="cpu"):
    """A page pool whose used slots hold quantized random rows and whose every other slot is NaN bytes.
    ``tables``: (block_table, seq_lens, num_pages) as ``page_tables`` draws them; default a fixed shuffle.
    Returns (data, scales, block_table, seq_lens)."""
    g = torch.Generator().manual_seed(seed)
    table, seq_lens, num_pages = tables if tables is not None else _table(lengths, page_size, seed)
    d = d_latent + d_rope
    rows = torch.randn(num_pages * page_size, d, generator=g)
    tensor_scale = torch.tensor([0.02]) if scale_mode == "tensor" else None
    data, scales = quantize_kv_rows(rows, kind, d_latent, tensor_scale)
    data = data.reshape(num_pages, page_size, -1).contiguous()
    used = torch.zeros(num_pages * page_size, dtype=torch.bool)
    for b, n in enumerate(lengths):
        pos = torch.arange(n)
        used[table[b, pos // page_size].long() * page_size + pos % page_size] = True
    data.view(torch.uint8).reshape(num_pages * page_size, -1)[~used] = 0xFF   # NaN in every unused slot
    if scales is not None and scale_mode == "token":
        scales = scales.reshape(num_pages, page_size).clone()
        scales.reshape(-1)[~used] = float("nan")
    return (data.to(device), None if scales is None else scales.to(device), table.to(device),
            seq_lens.to(device))


def _table(lengths, page_size, seed):
    need = [-(-n // page_size) for n in lengths]
    pool = sum(need) + 3
    perm = torch.randperm(pool, generator=torch.Generator().manual_seed(seed)).to(torch.int32)
    table = torch.full((len(lengths), max(need + [1])), -1, dtype=torch.int32)
    c = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[c:c + n]
        c += n
    return table, torch.tensor(lengths, dtype=torch.int32), pool


def random_indices(lengths, req_ids, k, seed, invalid_frac=0.2):
    """Per token: k distinct positions below its request's length, some replaced by -1."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((len(req_ids), k), -1, dtype=torch.int32)
    for t, r in enumerate(req_ids.tolist()):
        n = lengths[r]
        pick = torch.randperm(n, generator=g)[:k].to(torch.int32)
        out[t, :pick.numel()] = pick
        drop = torch.rand(k, generator=g) < invalid_frac
        out[t, drop] = -1
    return out


def dense_masked_attention(q_nope, q_pe, rows_of, req_ids, indices, scale, d_latent):
    """Independent check: full attention over each request's whole context with -inf outside the selection."""
    outs, lses = [], []
    for t, r in enumerate(req_ids.tolist()):
        kv = rows_of[r]                                             # [n, d] fp32
        logits = (q_nope[t].float() @ kv[:, :d_latent].T + q_pe[t].float() @ kv[:, d_latent:].T) * scale
        sel = torch.zeros(kv.shape[0], dtype=torch.bool)
        idx = indices[t][indices[t] >= 0].long()
        sel[idx] = True
        logits = logits.masked_fill(~sel, float("-inf"))
        lses.append(torch.logsumexp(logits, -1))
        outs.append(torch.softmax(logits, -1) @ kv[:, :d_latent])
    return torch.stack(outs), torch.stack(lses)


def request_rows(data, scales, kind, table, lengths, page_size, d_latent, d_rope):
    from mla_quant.kernels.kv_layout import dequantize_kv_rows

    out = []
    for b, n in enumerate(lengths):
        pos = torch.arange(n)
        slots = table[b, pos // page_size].long() * page_size + pos % page_size
        s = None if scales is None else (scales if scales.numel() == 1 else scales.reshape(-1)[slots])
        out.append(dequantize_kv_rows(data.reshape(-1, data.shape[-1])[slots], s, kind, d_latent, d_rope))
    return out


@pytest.mark.parametrize("kind,scale_mode", KINDS)
def test_reference_equals_dense_attention_under_a_mask(kind, scale_mode):
    lengths, ps, dl, dr = [37, 5, 64], 16, 128, 32
    data, scales, table, seq_lens = make_pages(kind, scale_mode, lengths, ps, dl, dr)
    req_ids = torch.tensor([0, 1, 2, 2, 0], dtype=torch.int32)
    idx = random_indices(lengths, req_ids, 12, seed=1)
    q_nope, q_pe = torch.randn(5, 3, dl), torch.randn(5, 3, dr)
    out, lse = sparse_mla_decode_reference(q_nope, q_pe, data, scales, kind, table, seq_lens, req_ids, idx, 0.07)
    rows = request_rows(data, scales, kind, table, lengths, ps, dl, dr)
    want, want_lse = dense_masked_attention(q_nope, q_pe, rows, req_ids, idx, 0.07, dl)
    assert rel_err(out, want) < 1e-5 and rel_err(lse, want_lse) < 1e-6


@pytest.mark.parametrize("kind,scale_mode", KINDS)
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_kernel_matches_reference(triton_backend, kind, scale_mode, num_splits):
    dev = triton_backend
    lengths, ps, dl, dr = [70, 9, 33], 16, 128, 64
    data, scales, table, seq_lens = make_pages(kind, scale_mode, lengths, ps, dl, dr, device=dev)
    req_ids = torch.tensor([0, 2, 1, 0, 0, 2, 1], dtype=torch.int32, device=dev)
    idx = random_indices(lengths, req_ids.cpu(), 40, seed=2).to(dev)
    q_nope, q_pe = torch.randn(7, 5, dl, device=dev), torch.randn(7, 5, dr, device=dev)
    out, lse = sparse_mla_decode(q_nope, q_pe, data, scales, kind, table, seq_lens, req_ids, idx, 0.1,
                                 num_splits=num_splits)
    ro, rl = sparse_mla_decode_reference(q_nope, q_pe, data, scales, kind, table, seq_lens, req_ids, idx, 0.1)
    assert_all_written(out, "out")
    assert rel_err(out, ro) < 1e-5 and rel_err(lse, rl) < 1e-6


def test_kernel_many_splits_combine_in_column_blocks(triton_backend):
    """Batch-1 decode shape: one token, a long top-k list split 128 ways (the combine kernel then holds the
    partials in several column blocks), some splits empty."""
    dev = triton_backend
    lengths, ps, dl, dr = [2100], 64, 128, 64
    data, scales, table, seq_lens = make_pages("bf16", "token", lengths, ps, dl, dr, device=dev)
    req_ids = torch.zeros(1, dtype=torch.int32, device=dev)
    idx = random_indices(lengths, req_ids.cpu(), 2048, seed=5)
    idx[:, 16:48] = -1                                   # two whole splits select nothing
    idx = idx.to(dev)
    q_nope, q_pe = torch.randn(1, 2, dl, device=dev), torch.randn(1, 2, dr, device=dev)
    out, lse = sparse_mla_decode(q_nope, q_pe, data, scales, "bf16", table, seq_lens, req_ids, idx, 0.1,
                                 num_splits=128)
    ro, rl = sparse_mla_decode_reference(q_nope, q_pe, data, scales, "bf16", table, seq_lens, req_ids, idx, 0.1)
    assert_all_written(out, "out")
    assert rel_err(out, ro) < 1e-5 and rel_err(lse, rl) < 1e-6


def test_bf16_partials_cost_one_rounding(triton_backend, monkeypatch):
    """``PARTIAL_DTYPE`` bf16 (a sweep setting): each split's output, a convex combination of value rows, is
    rounded once to bf16 before the merge, so the result moves by at most one bf16 step of the largest value
    (2^-7 of it: the interpreter truncates where the GPU rounds to nearest); lse is unchanged (fp32)."""
    from mla_quant.kernels import sparse_mla_decode as mod

    dev = triton_backend
    lengths, ps, dl, dr = [300], 16, 128, 64
    data, scales, table, seq_lens = make_pages("bf16", "token", lengths, ps, dl, dr, device=dev)
    req_ids = torch.zeros(1, dtype=torch.int32, device=dev)
    idx = random_indices(lengths, req_ids.cpu(), 256, seed=3).to(dev)
    q_nope, q_pe = torch.randn(1, 3, dl, device=dev), torch.randn(1, 3, dr, device=dev)
    args = (q_nope, q_pe, data, scales, "bf16", table, seq_lens, req_ids, idx, 0.1)
    o32, l32 = sparse_mla_decode(*args, num_splits=8)
    monkeypatch.setattr(mod, "PARTIAL_DTYPE", torch.bfloat16)
    o16, l16 = sparse_mla_decode(*args, num_splits=8)
    assert torch.equal(l16, l32)
    diff = (o16 - o32).abs().max()
    assert 0 < diff <= 2.0 ** -7 * data.float().nan_to_num(0.0).abs().max()


def test_kernel_ds_mla_with_several_scale_tiles(triton_backend):
    dev = triton_backend
    lengths, ps, dl, dr = [45, 20], 16, 256, 32
    data, scales, table, seq_lens = make_pages("fp8_ds_mla", "token", lengths, ps, dl, dr, device=dev)
    req_ids = torch.tensor([1, 0, 0], dtype=torch.int32, device=dev)
    idx = random_indices(lengths, req_ids.cpu(), 24, seed=4).to(dev)
    q_nope, q_pe = torch.randn(3, 3, dl, device=dev), torch.randn(3, 3, dr, device=dev)
    out, lse = sparse_mla_decode(q_nope, q_pe, data, scales, "fp8_ds_mla", table, seq_lens, req_ids, idx, 0.05)
    ro, rl = sparse_mla_decode_reference(q_nope, q_pe, data, scales, "fp8_ds_mla", table, seq_lens, req_ids, idx,
                                         0.05)
    assert rel_err(out, ro) < 1e-5 and rel_err(lse, rl) < 1e-6


def test_empty_selection_gives_zero_and_minus_inf(triton_backend):
    dev = triton_backend
    data, scales, table, seq_lens = make_pages("bf16", "token", [20], 16, 64, 32, device=dev)
    idx = torch.full((2, 8), -1, dtype=torch.int32, device=dev)
    idx[1, 3] = 7                                                    # one token, one key
    req = torch.zeros(2, dtype=torch.int32, device=dev)
    q_nope, q_pe = torch.randn(2, 4, 64, device=dev), torch.randn(2, 4, 32, device=dev)
    for fn in (sparse_mla_decode, sparse_mla_decode_reference):
        out, lse = fn(q_nope, q_pe, data, scales, "bf16", table, seq_lens, req, idx, 0.1)
        assert torch.all(out[0] == 0) and torch.all(lse[0] == float("-inf"))
        row = data.reshape(-1, 96)[table[0, 0].long() * 16 + 7].float()
        assert torch.allclose(out[1].float(), row[:64].expand(4, 64), rtol=1e-5, atol=1e-6)


def test_indices_past_the_length_are_ignored():
    data, scales, table, seq_lens = make_pages("bf16", "token", [10], 16, 64, 32)
    q_nope, q_pe = torch.randn(1, 2, 64), torch.randn(1, 2, 32)
    req = torch.zeros(1, dtype=torch.int32)
    base = torch.tensor([[0, 3, 9, -1]], dtype=torch.int32)
    past = torch.tensor([[0, 3, 9, 12]], dtype=torch.int32)          # 12 >= seq_len: a NaN slot, skipped
    a = sparse_mla_decode_reference(q_nope, q_pe, data, scales, "bf16", table, seq_lens, req, base, 0.1)
    b = sparse_mla_decode_reference(q_nope, q_pe, data, scales, "bf16", table, seq_lens, req, past, 0.1)
    assert torch.equal(a[0], b[0]) and not torch.isnan(b[0]).any()


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])  # the fixture only sets the backend
@given(lengths=st.lists(st.integers(1, 80), min_size=1, max_size=4), page_size=st.sampled_from([1, 4, 16, 32]),
       k=st.sampled_from([15, 16, 17]), kind=st.sampled_from(KINDS), seed=st.integers(0, 2**16), draw=st.data())
def test_hypothesis_ragged_batches_and_page_boundaries(triton_backend, lengths, page_size, k, kind, seed, draw):
    dev = triton_backend
    dl, dr = 128, 32
    tables = draw.draw(page_tables(lengths, page_size, share_prefix=True))   # drawn on the CPU
    data, scales, table, seq_lens = make_pages(kind[0], kind[1], lengths, page_size, dl, dr, seed, tables,
                                               device=dev)
    req_ids = torch.arange(len(lengths), dtype=torch.int32).repeat_interleave(2)
    idx = random_indices(lengths, req_ids, k, seed).to(dev)
    req_ids = req_ids.to(dev)
    g = torch.Generator().manual_seed(seed)
    q_nope = torch.randn(len(req_ids), 2, dl, generator=g).to(dev)
    q_pe = torch.randn(len(req_ids), 2, dr, generator=g).to(dev)
    out, lse = sparse_mla_decode(q_nope, q_pe, data, scales, kind[0], table, seq_lens, req_ids, idx, 0.1)
    ro, rl = sparse_mla_decode_reference(q_nope, q_pe, data, scales, kind[0], table, seq_lens, req_ids, idx, 0.1)
    assert rel_err(out, ro) < 1e-5
    finite = torch.isfinite(rl)
    # lse may sit near 0 (relative error undefined there): fp32 rounding of the log-sum-exp, relative or absolute
    assert torch.equal(finite, torch.isfinite(lse)) and torch.allclose(lse[finite], rl[finite], rtol=1e-6, atol=2e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("kind,scale_mode", KINDS)
def test_gpu_bf16_queries_at_glm_shapes(kind, scale_mode):
    lengths, ps, dl, dr = [3000, 700, 2100, 64], 64, 512, 64
    data, scales, table, seq_lens = make_pages(kind, scale_mode, lengths, ps, dl, dr, device="cuda")
    req_ids = torch.arange(4, dtype=torch.int32, device="cuda")
    idx = random_indices(lengths, req_ids.cpu(), 2048, seed=3, invalid_frac=0.0).cuda()
    q_nope = torch.randn(4, 16, dl, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(4, 16, dr, device="cuda", dtype=torch.bfloat16)
    scale = 1 / math.sqrt(256)
    out, lse = sparse_mla_decode(q_nope, q_pe, data, scales, kind, table, seq_lens, req_ids, idx, scale)
    ro, rl = sparse_mla_decode_reference(q_nope, q_pe, data, scales, kind, table, seq_lens, req_ids, idx, scale)
    assert rel_err(out.float(), ro.float()) < 2e-2 and rel_err(lse, rl) < 1e-3


def test_bad_inputs_name_the_argument():
    data, scales, table, seq_lens = make_pages("fp8_e4m3", "token", [10], 16, 64, 32)
    q_nope, q_pe = torch.randn(1, 2, 64), torch.randn(1, 2, 32)
    req = torch.zeros(1, dtype=torch.int32)
    idx = torch.zeros(1, 4, dtype=torch.int32)
    args = (q_nope, q_pe, data, scales, "fp8_e4m3", table, seq_lens, req, idx, 0.1)

    def call(**kw):
        names = ["q_nope", "q_pe", "kv_data", "kv_scales", "kind", "block_table", "seq_lens", "req_ids", "indices",
                 "softmax_scale"]
        a = dict(zip(names, args))
        a.update(kw)
        return sparse_mla_decode(**a)

    with pytest.raises(ValueError, match="kv_scales"):
        call(kv_scales=None)
    with pytest.raises(ValueError, match="kind"):
        call(kind="int4")
    with pytest.raises(TypeError, match="indices"):
        call(indices=idx.long())
    with pytest.raises(ValueError, match="q_pe"):
        call(q_pe=torch.randn(1, 3, 32))
    with pytest.raises(ValueError, match="kv_data"):
        call(q_nope=torch.randn(1, 2, 128))
    with pytest.raises(IndexError, match="req_ids"):
        call(req_ids=torch.ones(1, dtype=torch.int32))
    bad_table = table.clone()
    bad_table[0, 0] = 999
    with pytest.raises(IndexError, match="block_table"):
        call(block_table=bad_table)
