import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_quant.modules.indexer import LightningIndexer
from mla_quant.modules.rope import RotaryEmbedding
from mla_quant.testing import rel_err
from tests.modules.dsa_helpers import assert_same_selection, init_, make_pools, run_paged, schedule, selected_sets

HIDDEN, QLORA, HEADS, DIM, ROPE = 64, 48, 4, 64, 32


def indexer(topk=8, interleave=True, fmt="bf16", dtype=torch.float32, seed=0):
    return init_(LightningIndexer(HIDDEN, QLORA, HEADS, DIM, ROPE, topk, rope=RotaryEmbedding(ROPE, 10000.0),
                                  rope_interleave=interleave, fmt=fmt, dtype=dtype), seed)


def inputs(b, t, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, t, HIDDEN, generator=g), torch.randn(b, t, QLORA, generator=g)


def test_checkpoint_names():
    keys = set(indexer().state_dict())
    assert keys == {"wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight"}
    m = indexer()
    assert m.weights_proj.weight.dtype == torch.float32 and m.k_norm.bias is not None


def test_scores_are_the_formula():
    m = indexer()
    x, ql = inputs(2, 9)
    got = m.scores(x, ql)
    q, k, w = (t.detach() for t in m.project(x, ql, torch.arange(9).expand(2, 9)))
    want = torch.full((2, 9, 9), float("-inf"))
    for b in range(2):
        for t in range(9):
            for s in range(t + 1):
                want[b, t, s] = sum(float(w[b, t, h]) * max(float(q[b, t, h] @ k[b, s]) * DIM ** -0.5, 0.0)
                                    for h in range(HEADS))
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    assert torch.allclose(got[fin], want[fin], rtol=1e-5, atol=1e-6)



@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_batched_scores_equal_each_sequence_alone(fmt):
    """A batch scores like its sequences one at a time (the batched q·k is one GEMM per sequence)."""
    m = indexer(fmt=fmt)
    x, ql = inputs(3, 11)
    got = m.scores(x, ql)
    for b in range(3):
        assert torch.allclose(got[b:b + 1], m.scores(x[b:b + 1], ql[b:b + 1]), rtol=1e-6, atol=1e-6, equal_nan=True)

def test_rope_is_on_the_first_dims_only():
    m = indexer()
    x, ql = inputs(1, 4)
    q0, k0, _ = m.project(x, ql, torch.zeros(1, 4, dtype=torch.long))
    q5, k5, _ = m.project(x, ql, torch.full((1, 4), 5))
    assert torch.equal(k0[..., ROPE:], k5[..., ROPE:]) and not torch.allclose(k0[..., :ROPE], k5[..., :ROPE])
    assert torch.equal(q0[..., ROPE:], q5[..., ROPE:])


def test_topk_pads_short_prefixes_and_selects_the_best():
    m = indexer(topk=5)
    x, ql = inputs(2, 11)
    idx = m(x, ql)
    scores = m.scores(x, ql)
    assert idx.shape == (2, 11, 5) and idx.dtype == torch.int32
    for b in range(2):
        for t in range(11):
            sel = selected_sets(idx[b, t][None])[0]
            if t + 1 <= 5:
                assert sel == set(range(t + 1)) and (idx[b, t] == -1).sum() == 5 - (t + 1)
            else:
                assert_same_selection(idx[b, t][None], scores[b, t, :t + 1].topk(5).indices[None],
                                      scores[b, t][None].detach())


@pytest.mark.parametrize("model", ["glm_moe_dsa", "deepseek_v32"])
@pytest.mark.parametrize("topk", [1, 6, 13])
def test_matches_hugging_face(model, topk):
    pytest.importorskip("transformers")
    if model == "glm_moe_dsa":
        from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as M
        from transformers.models.glm_moe_dsa.configuration_glm_moe_dsa import GlmMoeDsaConfig as Config
        hf_cls, rot_cls, interleave = M.GlmMoeDsaIndexer, M.GlmMoeDsaRotaryEmbedding, True
    else:
        from transformers.models.deepseek_v32 import modeling_deepseek_v32 as M
        from transformers.models.deepseek_v32.configuration_deepseek_v32 import DeepseekV32Config as Config
        hf_cls, rot_cls, interleave = M.DeepseekV32Indexer, M.DeepseekV32RotaryEmbedding, False
    cfg = Config(hidden_size=HIDDEN, q_lora_rank=QLORA, index_n_heads=HEADS, index_head_dim=DIM,
                 qk_rope_head_dim=ROPE, index_topk=topk, num_attention_heads=4, num_key_value_heads=4,
                 kv_lora_rank=32, qk_nope_head_dim=32, v_head_dim=32, num_hidden_layers=1,
                 rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    hf = hf_cls(cfg, 0).float()
    ours = indexer(topk=topk, interleave=interleave)
    hf.load_state_dict(ours.state_dict())
    b, t = 2, 13
    x, ql = inputs(b, t)
    pos = torch.arange(t).expand(b, t)
    cos, sin = rot_cls(cfg)(x, pos)
    mask = torch.full((t, t), float("-inf")).triu(1).expand(b, t, t)
    want = hf(x, ql, (cos, sin), mask, pos)
    got = ours(x, ql)
    scores = ours.scores(x, ql).detach()
    for bb in range(b):  # HF's selection includes masked future keys when t < topk; keep the visible ones
        visible = torch.where(want[bb] <= torch.arange(t)[:, None], want[bb], -1)
        assert_same_selection(got[bb], visible, scores[bb])


def test_fp8_scores_track_full_precision():
    x, ql = inputs(2, 40)
    full = indexer(fmt="bf16")(x, ql)
    m = indexer(fmt="fp8")
    s_full = indexer(fmt="bf16").scores(x, ql)
    s_fp8 = m.scores(x, ql)
    fin = torch.isfinite(s_full)
    assert torch.equal(fin, torch.isfinite(s_fp8)) and rel_err(s_fp8[fin], s_full[fin]) < 0.1
    overlap = [len(a & b) / max(len(a), 1) for a, b in
               zip(selected_sets(full.flatten(0, 1)), selected_sets(m(x, ql).flatten(0, 1)))]
    assert sum(overlap) / len(overlap) > 0.8
    assert m.convert_format_("bf16") is m and torch.equal(m(x, ql), full)
    with pytest.raises(ValueError, match="fmt"):
        m.convert_format_("int4")


@pytest.mark.parametrize("fmt,key_kind", [("bf16", "fp32"), ("fp8", "fp8_e4m3"), ("bf16", "fp8_e4m3")])
def test_paged_selection_equals_plain(fmt, key_kind):
    """Chunked prefill then decode over paged keys picks the plain causal forward's sets (keys rounded the
    same way: fp32 pages for bf16, FP8 pages for fp8)."""
    m = indexer(topk=6, fmt=fmt)
    lengths = [23, 9, 17]
    xs = [inputs(1, n, seed=10 + i) for i, n in enumerate(lengths)]
    _, keys, alloc = make_pools(1, 40, 4, 64, 32, key_kind=key_kind)
    all_q = torch.cat([x[1][0] for x in xs])
    got = run_paged(alloc, [x[0][0] for x in xs], schedule(lengths, 7, 1),
                    lambda batch, x: (m.forward_paged(x, all_q[_token_rows(batch, lengths)], batch, keys.layer(0)),))
    for r, (x, ql) in enumerate(xs):
        plain = m(x, ql)[0]
        if fmt == "bf16" and key_kind == "fp8_e4m3":  # FP8 keys with bf16 queries: nearly the same sets
            same = [len(a & b) for a, b in zip(selected_sets(got[r][0]), selected_sets(plain))]
            assert sum(same) >= 0.9 * sum(len(s) for s in selected_sets(plain))
        else:
            assert_same_selection(got[r][0], plain, m.scores(x, ql)[0].detach())


def _token_rows(batch, lengths):
    """Rows of the step's tokens in the concatenation of all requests' tokens."""
    starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
    req = torch.repeat_interleave(torch.tensor(batch.request_ids), batch.query_lens.long())
    return starts[req] + batch.positions


@settings(max_examples=10)  # each example drives ~20 paged steps
@given(n=st.sampled_from([5, 6, 7, 11, 12, 13]), page_size=st.sampled_from([1, 4, 8]), prefill=st.integers(1, 13),
       seed=st.integers(0, 2**16))
def test_hypothesis_lengths_around_topk(n, page_size, prefill, seed):
    m = indexer(topk=6, seed=seed)
    lengths = [n, max(1, n - 1), n + 1]
    xs = [inputs(1, k, seed=seed + i) for i, k in enumerate(lengths)]
    _, keys, alloc = make_pools(1, 3 * (n + 2), page_size, 64, 32, key_kind="fp32")
    all_q = torch.cat([x[1][0] for x in xs])
    got = run_paged(alloc, [x[0][0] for x in xs], schedule(lengths, prefill, 1),
                    lambda batch, x: (m.forward_paged(x, all_q[_token_rows(batch, lengths)], batch, keys.layer(0)),))
    for r, (x, ql) in enumerate(xs):
        assert_same_selection(got[r][0], m(x, ql)[0], m.scores(x, ql)[0].detach())


def test_bad_inputs():
    m = indexer()
    x, ql = inputs(1, 4)
    with pytest.raises(ValueError, match="x"):
        m(torch.randn(1, 4, 32), ql)
    with pytest.raises(ValueError, match="q_latent"):
        m(x, torch.randn(1, 4, 40))
    _, keys, alloc = make_pools(1, 8, 4, 64, 32, head_dim=128)
    alloc.add_request(0)
    batch = alloc.plan([0], [4])
    with pytest.raises(ValueError, match="keys"):
        m.forward_paged(x[0], ql[0], batch, keys.layer(0))
    with pytest.raises(ValueError, match="rope_dim"):
        LightningIndexer(HIDDEN, QLORA, HEADS, DIM, 80, 8)
    with pytest.raises(ValueError, match="head_dim"):
        LightningIndexer(HIDDEN, QLORA, HEADS, 96, 32, 8)
