import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_quant.modules.attention import MLAttention
from mla_quant.modules.dsa import DSAttention, causal_indices, sparse_attention_expanded, topk_mask
from mla_quant.testing import rel_err
from tests.modules.dsa_helpers import assert_same_selection, init_, make_pools, run_paged, schedule

HIDDEN, HEADS, QLORA, KVLORA, NOPE, ROPE, V = 64, 4, 48, 128, 32, 32, 32
IDX_HEADS, IDX_DIM = 4, 64


def dsa(indexer_type="full", topk=8, seed=0, dtype=torch.float32, **kw):
    m = DSAttention(HIDDEN, HEADS, QLORA, KVLORA, NOPE, ROPE, V, index_n_heads=IDX_HEADS, index_head_dim=IDX_DIM,
                    index_topk=topk, indexer_type=indexer_type, dtype=dtype, **kw)
    return init_(m, seed)


def x_of(b, t, seed=1):
    return torch.randn(b, t, HIDDEN, generator=torch.Generator().manual_seed(seed))


def dense_masked_reference(m, x, topk_indices):
    """Naive MLA with a -inf mask outside each query's selection (and the future), written out per head."""
    b, t, _ = x.shape
    pos = torch.arange(t, device=x.device).expand(b, t)
    q_nope, q_pe = m.project_q(x, pos)
    latent, k_pe = m.project_kv(x, pos)
    k_nope, v = m.expand_kv(latent)
    logits = (torch.einsum("bqhd,bkhd->bhqk", q_nope, k_nope)
              + torch.einsum("bqhr,bkr->bhqk", q_pe, k_pe)) * m.softmax_scale
    allowed = torch.zeros(b, t, t, dtype=torch.bool)
    for bb in range(b):
        for q in range(t):
            for s in topk_indices[bb, q].tolist():
                if 0 <= s <= q:
                    allowed[bb, q, s] = True
    logits = logits.masked_fill(~allowed[:, None].to(x.device), float("-inf"))
    o = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(logits, -1), v)
    return m.output(o)


def test_checkpoint_names_full_and_shared():
    full = set(dsa("full").state_dict())
    shared = set(dsa("shared").state_dict())
    assert {k for k in full if k.startswith("indexer.")} == {
        "indexer.wq_b.weight", "indexer.wk.weight", "indexer.k_norm.weight", "indexer.k_norm.bias",
        "indexer.weights_proj.weight"}
    assert full - shared == {k for k in full if k.startswith("indexer.")} and dsa("shared").indexer is None


def test_sparse_forward_equals_masked_dense_attention():
    m = dsa(topk=5)
    x = x_of(2, 17)
    y, idx = m(x)
    assert idx.shape == (2, 17, 5)
    assert rel_err(y, dense_masked_reference(m, x, idx)) < 1e-5


def test_sparse_path_with_every_token_selected_equals_dense_mla():
    """The masked (expanded) path itself — not the dense shortcut — equals MLAttention when nothing is cut."""
    m = dsa(topk=64)
    mla = MLAttention(HIDDEN, HEADS, QLORA, KVLORA, NOPE, ROPE, V, dtype=torch.float32)
    mla.load_state_dict({k: v for k, v in m.state_dict().items() if not k.startswith("indexer.")})
    x = x_of(2, 19)
    pos = torch.arange(19).expand(2, 19)
    q_nope, q_pe = m.project_q(x, pos)
    latent, k_pe = m.project_kv(x, pos)
    k_nope, v = m.expand_kv(latent)
    q = torch.cat([q_nope, q_pe], -1)
    k = torch.cat([k_nope, k_pe[..., None, :].expand(-1, -1, HEADS, -1)], -1)
    every = causal_indices(torch.arange(19), 19).expand(2, 19, 19)
    o = sparse_attention_expanded(q, k, v, every, m.softmax_scale)
    assert rel_err(m.output(o), mla(x)) < 1e-5
    y, idx = m(x)                                     # T <= topk: the dense shortcut, the same numbers
    assert rel_err(y, mla(x)) < 1e-6 and torch.equal(idx[0], every[0])


def test_shared_layer_reuses_exactly_the_given_indices():
    full, shared = dsa("full", topk=6, seed=0), dsa("shared", topk=6, seed=1)
    x = x_of(1, 20)
    _, idx = full(x)
    y, out_idx = shared(x, topk_indices=idx)
    assert out_idx is idx
    assert rel_err(y, dense_masked_reference(shared, x, idx)) < 1e-5
    other = torch.roll(idx, 1, dims=1)
    other = torch.where(other <= torch.arange(20)[None, :, None], other, -1).to(torch.int32)
    other[..., 0] = 0                                 # every query keeps at least one visible key
    assert rel_err(shared(x, topk_indices=other)[0], y) > 1e-3
    with pytest.raises(ValueError, match="topk_indices"):
        shared(x)
    with pytest.raises(ValueError, match="topk_indices"):
        shared(x, topk_indices=idx.long())
    with pytest.raises(ValueError, match="topk_indices"):
        full(x, topk_indices=idx)


@pytest.mark.parametrize("t", [7, 8, 9, 23])
def test_matches_hugging_face_full_and_shared(t):
    pytest.importorskip("transformers")
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as M
    from transformers.models.glm_moe_dsa.configuration_glm_moe_dsa import GlmMoeDsaConfig

    cfg = GlmMoeDsaConfig(hidden_size=HIDDEN, q_lora_rank=QLORA, index_n_heads=IDX_HEADS, index_head_dim=IDX_DIM,
                          qk_rope_head_dim=ROPE, index_topk=8, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                          kv_lora_rank=KVLORA, qk_nope_head_dim=NOPE, v_head_dim=V, num_hidden_layers=2,
                          indexer_types=["full", "shared"],
                          rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    cfg._attn_implementation = "eager"
    ours = [dsa("full", seed=3), dsa("shared", seed=4)]
    hf = [M.GlmMoeDsaAttention(cfg, i).float() for i in range(2)]
    for h, o in zip(hf, ours):
        h.load_state_dict(o.state_dict())
    x = x_of(2, t)
    pos = torch.arange(t).expand(2, t)
    cos, sin = M.GlmMoeDsaRotaryEmbedding(cfg)(x, pos)
    mask = torch.full((t, t), float("-inf")).triu(1).expand(2, 1, t, t)
    with torch.no_grad():
        y0, _, idx0 = hf[0](x, (cos, sin), mask, position_ids=pos)
        y1, _, _ = hf[1](x, (cos, sin), mask, position_ids=pos, prev_topk_indices=idx0)
        z0, i0 = ours[0](x)
        z1, _ = ours[1](x, topk_indices=i0)
    assert rel_err(z0, y0) < 1e-5 and rel_err(z1, y1) < 1e-5


KV_CASES = [("bf16", 3e-3), ("fp8_e4m3", 0.08), ("fp8_ds_mla", 0.08)]


@pytest.mark.parametrize("kv_format,tol", KV_CASES)
def test_paged_prefill_and_decode_equal_the_plain_forward(kv_format, tol):
    """Chunked prefill, then decode, of a full and a shared layer over NaN-poisoned pages: the selections
    equal the plain forward's (fp32 indexer keys) and the outputs match it to the KV format's precision."""
    full, shared = dsa("full", topk=8, seed=0), dsa("shared", topk=8, seed=1)
    lengths = [27, 6, 19]
    xs = [x_of(1, n, seed=20 + i)[0] for i, n in enumerate(lengths)]
    cache, keys, alloc = make_pools(2, 40, 4, KVLORA, ROPE, kv_format, head_dim=IDX_DIM)

    def step(batch, x):
        y0, i0 = full.forward_paged(x, batch, cache.layer(0), keys.layer(0))
        y1, i1 = shared.forward_paged(x, batch, cache.layer(1), topk_indices=i0)
        assert i1 is i0
        return y0, y1, i0

    got = run_paged(alloc, xs, schedule(lengths, 10, 1), step)
    for r, x in enumerate(xs):
        _, i0 = full(x[None])
        y0, y1, idx = got[r]
        assert not torch.isnan(y0).any() and not torch.isnan(y1).any()
        scores = full.indexer.scores(x[None], full.q_latent(x[None]))[0].detach()
        assert_same_selection(idx, i0[0], scores)
        # outputs: against the plain masked computation with the cached path's own selection (an exact tie
        # may pick another equally-scored key), so the error is the KV format's alone
        with torch.no_grad():
            z0 = dense_masked_reference(full, x[None], idx[None])[0]
            z1 = dense_masked_reference(shared, x[None], idx[None])[0]
        assert rel_err(y0, z0) < tol and rel_err(y1, z1) < tol


@pytest.mark.parametrize("kv_format,key_kind,tol", [("fp8_ds_mla", "fp32", 0.12), ("bf16", "fp8_e4m3", 0.01)])
def test_paged_path_through_the_triton_kernels(triton_backend, kv_format, key_kind, tol):
    """The cached steps through the Triton kernels (interpreted on the CPU): outputs equal the masked
    computation with the selection made, and (fp32 keys) the selection is the plain forward's up to ties.
    fp8_ds_mla's tolerance covers e4m3 with power-of-two tile scales plus the interpreter's fp8 misrounding."""
    dev = triton_backend
    full, shared = dsa("full", topk=8, seed=2).to(dev), dsa("shared", topk=8, seed=3).to(dev)
    lengths = [21, 12]
    xs = [x_of(1, n, seed=40 + i)[0].to(dev) for i, n in enumerate(lengths)]
    cache, keys, alloc = make_pools(2, 16, 4, KVLORA, ROPE, kv_format, head_dim=IDX_DIM, key_kind=key_kind,
                                    device=dev)

    def step(batch, x):
        y0, i0 = full.forward_paged(x, batch, cache.layer(0), keys.layer(0))
        return y0, shared.forward_paged(x, batch, cache.layer(1), topk_indices=i0)[0], i0

    got = run_paged(alloc, xs, schedule(lengths, 9, 1), step)
    for x, (y0, y1, idx) in zip(xs, got):
        assert not torch.isnan(y0).any() and not torch.isnan(y1).any()
        with torch.no_grad():
            z0 = dense_masked_reference(full, x[None], idx[None].cpu())[0]
            z1 = dense_masked_reference(shared, x[None], idx[None].cpu())[0]
            plain = full(x[None])[1][0]
            scores = full.indexer.scores(x[None], full.q_latent(x[None]))[0]
        assert rel_err(y0, z0) < tol and rel_err(y1, z1) < tol
        if key_kind == "fp32":
            assert_same_selection(idx.cpu(), plain.cpu(), scores.cpu())


def test_paged_short_contexts_run_dense_mla():
    """A block table of at most topk tokens: the layer is exactly MLAttention.forward_paged."""
    m = dsa(topk=64)
    mla = MLAttention(HIDDEN, HEADS, QLORA, KVLORA, NOPE, ROPE, V, dtype=torch.float32)
    mla.load_state_dict({k: v for k, v in m.state_dict().items() if not k.startswith("indexer.")})
    lengths = [13, 30]
    xs = [x_of(1, n, seed=5 + i)[0] for i, n in enumerate(lengths)]
    cache, keys, alloc = make_pools(2, 20, 4, KVLORA, ROPE, "bf16", head_dim=IDX_DIM)
    got = run_paged(alloc, xs, schedule(lengths, 8, 1),
                    lambda b, x: (m.forward_paged(x, b, cache.layer(0), keys.layer(0))[0],
                                  mla.forward_paged(x, b, cache.layer(1))))
    for y, z in got:
        assert torch.equal(y, z)


@settings(max_examples=10)  # each example drives ~20 paged steps
@given(n=st.sampled_from([7, 8, 9, 15, 16, 17]), page_size=st.sampled_from([2, 4, 8]), prefill=st.integers(1, 17),
       seed=st.integers(0, 2**16))
def test_hypothesis_lengths_around_topk(n, page_size, prefill, seed):
    full = dsa("full", topk=8, seed=seed)
    lengths = [n, max(1, n - 1), n + 1]
    xs = [x_of(1, k, seed=seed + i)[0] for i, k in enumerate(lengths)]
    cache, keys, alloc = make_pools(1, 3 * (n + 4), page_size, KVLORA, ROPE, "bf16", head_dim=IDX_DIM)
    got = run_paged(alloc, xs, schedule(lengths, prefill, 1),
                    lambda b, x: full.forward_paged(x, b, cache.layer(0), keys.layer(0)))
    for r, x in enumerate(xs):
        _, i = full(x[None])
        scores = full.indexer.scores(x[None], full.q_latent(x[None]))[0].detach()
        assert_same_selection(got[r][1], i[0], scores)
        with torch.no_grad():
            z = dense_masked_reference(full, x[None], got[r][1][None])[0]
        assert rel_err(got[r][0], z) < 3e-3


def test_topk_mask_and_causal_indices():
    idx = torch.tensor([[[0, -1, 2]]], dtype=torch.int32)
    assert topk_mask(idx, 4).tolist() == [[[True, False, True, False]]]
    assert causal_indices(torch.tensor([0, 2]), 3).tolist() == [[0, -1, -1], [0, 1, 2]]


def test_bad_inputs():
    full, shared = dsa("full"), dsa("shared")
    cache, keys, alloc = make_pools(2, 8, 4, KVLORA, ROPE, "bf16", head_dim=IDX_DIM)
    alloc.add_request(0)
    batch = alloc.plan([0], [3])
    x = x_of(1, 3)[0]
    with pytest.raises(ValueError, match="keys"):
        full.forward_paged(x, batch, cache.layer(0))
    with pytest.raises(ValueError, match="topk_indices"):
        shared.forward_paged(x, batch, cache.layer(1))
    with pytest.raises(ValueError, match="topk_indices"):
        shared.forward_paged(x, batch, cache.layer(1), topk_indices=torch.zeros(2, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="indexer_type"):
        dsa("sparse")
    with pytest.raises(ValueError, match="q_lora_rank"):
        DSAttention(HIDDEN, HEADS, None, KVLORA, NOPE, ROPE, V)
    with pytest.raises(ValueError, match="x"):
        full(torch.randn(1, 3, 32))
