"""mla_prefill: the naive-form flash-attention kernel (interpreted on the CPU, real on the GPU) against its reference
and against full causal attention (a chunk of queries over a cached prefix is the tail of the full attention),
ragged batches with empty runs, head dims that are not powers of two, poisoned outputs, bad input."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mla_quant.kernels.mla_prefill import mla_prefill, mla_prefill_reference
from mla_quant.testing import assert_all_written, poisoned_empty, rel_err


def _cu(lengths, device="cpu"):
    return torch.tensor([0] + list(lengths), device=device).cumsum(0).to(torch.int32)


def full_causal(q, k, v, scale):
    """fp64 causal attention of a whole sequence: q/k [n, H, d], v [n, H, dv]."""
    n = q.shape[0]
    s = torch.einsum("ihd,jhd->hij", q.double(), k.double()) * scale
    s = s.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
    return torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), v.double()), torch.logsumexp(s, -1).T


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])  # the backend fixture is constant
@given(data=st.data(), dims=st.sampled_from([(48, 32), (64, 40), (24, 16), (40, 24)]), heads=st.integers(1, 3),
       causal=st.booleans())
def test_kernel_matches_chunks_of_full_attention(triton_backend, data, dims, heads, causal):
    d_qk, d_v = dims
    b = data.draw(st.integers(1, 4))
    kv_lens = data.draw(st.lists(st.integers(0, 70), min_size=b, max_size=b))
    q_lens = [data.draw(st.integers(0, n)) for n in kv_lens]  # the last q_len tokens are the new chunk
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    seqs = [(torch.randn(n, heads, d_qk, generator=g), torch.randn(n, heads, d_qk, generator=g),
             torch.randn(n, heads, d_v, generator=g)) for n in kv_lens]
    q = torch.cat([s[0][n - m:] for s, n, m in zip(seqs, kv_lens, q_lens)])
    k = torch.cat([s[1] for s in seqs])
    v = torch.cat([s[2] for s in seqs])
    dev = triton_backend
    out = poisoned_empty((q.shape[0], heads, d_v), device=dev)
    lse = poisoned_empty((q.shape[0], heads), device=dev)
    mla_prefill(q.to(dev), k.to(dev), v.to(dev), _cu(q_lens, dev), _cu(kv_lens, dev), None, 0.2, causal,
                out=out, lse=lse)
    assert_all_written(out, "out")
    out, lse = out.cpu(), lse.cpu()
    o_ref, lse_ref = mla_prefill_reference(q, k, v, _cu(q_lens), _cu(kv_lens), None, 0.2, causal)
    assert rel_err(out, o_ref) < 1e-5
    finite = torch.isfinite(lse_ref)
    assert torch.equal(finite, torch.isfinite(lse)) and torch.allclose(lse[finite], lse_ref[finite], atol=1e-4)
    if causal:  # a chunk over a cached prefix is the tail of the full causal attention
        row = 0
        for (qs, ks, vs), n, m in zip(seqs, kv_lens, q_lens):
            full_o, full_lse = full_causal(qs, ks, vs, 0.2)
            assert rel_err(out[row:row + m], full_o[n - m:]) < 1e-5
            assert torch.allclose(lse[row:row + m].double(), full_lse[n - m:], atol=1e-4)
            row += m


def test_non_strided_views_and_shared_rope_part(triton_backend):
    """k built as cat(k_nope, k_pe broadcast over heads) and v a slice of a wider tensor, as MLAttention does."""
    n, heads = 70, 3
    kv = torch.randn(n, heads, 24 + 32)
    k = torch.cat([kv[..., :24], torch.randn(n, 1, 16).expand(n, heads, 16)], -1)
    v = kv[..., 24:]
    q = torch.randn(n, heads, 40)
    cu = _cu([n])
    dev = triton_backend
    out, lse = mla_prefill(q.to(dev), k.to(dev), v.to(dev), cu.to(dev), cu.to(dev), n, 0.3)
    o_ref, lse_ref = mla_prefill_reference(q, k, v, cu, cu, n, 0.3)
    assert rel_err(out.cpu(), o_ref) < 1e-5 and torch.allclose(lse.cpu(), lse_ref, atol=1e-4)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(cu_q=[0, 3, 6]), ValueError, "cu_seqlens_q: must run from 0 to the 5"),
    (dict(cu_kv=[0, 3, 9]), ValueError, "cu_seqlens_kv: must run from 0 to the 8"),
    (dict(cu_kv=[0, 2, 8]), ValueError, "sequence 0 has 2 keys but 3 queries"),
    (dict(cu_q=[0, 4, 3, 5]), ValueError, "cu_seqlens_kv: 3 entries"),
    (dict(cu_q=[0, 6, 5], cu_kv=[0, 7, 8]), ValueError, "non-decreasing"),
    (dict(max_seqlen_q=2), ValueError, "max_seqlen_q: 2"),
    (dict(k=torch.randn(8, 2, 16)), ValueError, "k: shape"),
    (dict(v=torch.randn(7, 2, 8)), ValueError, "v: shape"),
    (dict(k=torch.randn(8, 2, 24).to(torch.bfloat16)), TypeError, "k: dtype"),
    (dict(q=torch.randn(5, 2, 24).to(torch.int32)), TypeError, "q: dtype"),
    (dict(scale=0.0), ValueError, "softmax_scale"),
])
def test_bad_input_raises_naming_the_argument(kwargs, exc, match):
    args = dict(q=torch.randn(5, 2, 24), k=torch.randn(8, 2, 24), v=torch.randn(8, 2, 8), cu_q=[0, 3, 5],
                cu_kv=[0, 4, 8], max_seqlen_q=None, scale=0.1)
    args.update(kwargs)
    cu_q = torch.tensor(args["cu_q"], dtype=torch.int32)
    cu_kv = torch.tensor(args["cu_kv"], dtype=torch.int32)
    with pytest.raises(exc, match=match):
        mla_prefill(args["q"], args["k"], args["v"], cu_q, cu_kv, args["max_seqlen_q"], args["scale"])


def test_non_causal_allows_more_queries_than_keys():
    q, k, v = torch.randn(5, 1, 16), torch.randn(2, 1, 16), torch.randn(2, 1, 16)
    out, _ = mla_prefill(q, k, v, _cu([5]), _cu([2]), None, 0.25, causal=False)
    p = torch.softmax(torch.einsum("ihd,jhd->hij", q, k) * 0.25, -1)
    assert torch.allclose(out, torch.einsum("hij,jhd->ihd", p, v), atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("d_qk, d_v, heads", [(192, 128, 16), (256, 256, 8)])
def test_real_dims_bf16_gpu(d_qk, d_v, heads):
    kv_lens, q_lens = [1000, 63, 2048, 1], [1000, 17, 512, 1]
    q = torch.randn(sum(q_lens), heads, d_qk, device="cuda").to(torch.bfloat16)
    k = torch.randn(sum(kv_lens), heads, d_qk, device="cuda").to(torch.bfloat16)
    v = torch.randn(sum(kv_lens), heads, d_v, device="cuda").to(torch.bfloat16)
    cu_q, cu_kv = _cu(q_lens, "cuda"), _cu(kv_lens, "cuda")
    out, lse = mla_prefill(q, k, v, cu_q, cu_kv, max(q_lens), d_qk ** -0.5)
    o_ref, lse_ref = mla_prefill_reference(q, k, v, cu_q, cu_kv, max(q_lens), d_qk ** -0.5)
    assert_all_written(out, "out")
    assert rel_err(out.float(), o_ref.float()) < 1e-2 and torch.allclose(lse, lse_ref, atol=2e-2)
