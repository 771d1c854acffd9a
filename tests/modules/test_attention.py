"""MLAttention: checkpoint names and shapes, the plain forward against an eager DeepSeek-style reference, and the
cached path's invariants — paged (absorbed decode / naive prefill) == naive attention over the cached rows,
chunked prefill == one prefill, speculative decode == sequential decode, mixed batches, prefill then
token-by-token decode == full forward (within a stated SQNR per KV format), absorbed-weight caching, errors."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_quant.cache import PagedBatch, PagedKVCache
from mla_quant.formats import FP8Block, Int4Group, KVFormat
from mla_quant.modules import MLAttention, RotaryEmbedding
from mla_quant.testing import rel_err, sqnr_db

HIDDEN, HEADS, Q_RANK, KV_RANK, NOPE, ROPE, V = 64, 4, 48, 128, 32, 16, 24
KV_FORMATS = ["bf16", "fp8_e4m3", "fp8_e4m3/tensor", "fp8_ds_mla"]


def make_attention(q_lora_rank=Q_RANK, dtype=torch.float32, seed=0, **kw) -> MLAttention:
    torch.manual_seed(seed)
    m = MLAttention(HIDDEN, HEADS, q_lora_rank, KV_RANK, NOPE, ROPE, V, rope_theta=10000.0, dtype=dtype,
                    rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                  "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}, **kw)
    for name, mod in m.named_modules():
        if hasattr(mod, "set_weight"):
            mod.set_weight(torch.randn(mod.out_features, mod.in_features) * mod.in_features ** -0.5 * 2)
        elif name.endswith("layernorm"):
            with torch.no_grad():
                mod.weight.copy_(1 + 0.1 * torch.randn(mod.dim))
    return m


def kv_format_of(name: str) -> KVFormat:
    kind, _, scale = name.partition("/")
    return KVFormat(kind, scale or "token")


def make_cache(kv_format: str, num_pages=32, page_size=4, device="cpu") -> PagedKVCache:
    """NaN-poisoned pages; per-tensor fp8 layers use the scale 0.02 (latents reach about ±5)."""
    return PagedKVCache(1, num_pages, page_size, KV_RANK, ROPE, kv_format_of(kv_format), device=device,
                        tensor_scales=0.02).poison_()


def make_batch(block_table, prev_lens, q_lens, page_size) -> PagedBatch:
    """The step's metadata: request b has prev_lens[b] cached tokens and adds q_lens[b]."""
    dev = block_table.device
    pos = [torch.arange(p, p + q, device=dev) for p, q in zip(prev_lens, q_lens)]
    slots = [block_table[b, t // page_size].long() * page_size + t % page_size for b, t in enumerate(pos)]
    return PagedBatch(block_table=block_table,
                      seq_lens=torch.tensor([p + q for p, q in zip(prev_lens, q_lens)], dtype=torch.int32, device=dev),
                      cu_seqlens_q=torch.tensor([0] + list(q_lens), device=dev).cumsum(0).to(torch.int32),
                      positions=torch.cat(pos), slot_mapping=torch.cat(slots), page_size=page_size,
                      max_query_len=max(q_lens))


def table_for(lengths, page_size, num_pages, seed=0, shared_prefix_pages=0):
    """A shuffled block table; requests b > 0 may share request 0's first pages."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_pages, generator=g).to(torch.int32)
    need = [-(-n // page_size) for n in lengths]
    table = torch.full((len(lengths), max(need)), -1, dtype=torch.int32)
    c = 0
    for b, k in enumerate(need):
        table[b, :k] = perm[c:c + k]
        c += k
    table[1:, :shared_prefix_pages] = table[0, :shared_prefix_pages]
    return table


def run_steps(m, cache, x_per_request, table, schedule, page_size):
    """Feed tokens through forward_paged: schedule = list of per-request query lengths per step.
    Returns the outputs per request, concatenated over steps."""
    prev = [0] * len(x_per_request)
    outs = [[] for _ in x_per_request]
    for q_lens in schedule:
        active = [b for b, q in enumerate(q_lens) if q > 0]
        batch = make_batch(table[active], [prev[b] for b in active], [q_lens[b] for b in active], page_size)
        x = torch.cat([x_per_request[b][prev[b]:prev[b] + q_lens[b]] for b in active])
        y = m.forward_paged(x, batch, cache.layer(0))
        row = 0
        for b in active:
            outs[b].append(y[row:row + q_lens[b]])
            row += q_lens[b]
            prev[b] += q_lens[b]
    return [torch.cat(o) for o in outs]


def naive_over_rows(m, x, rows):
    """Expected output of one request's tokens x [n, hidden] (positions 0..n-1) attending, causally, over
    the rows [n, kv + rope] as the cache stores them (dequantized): the naive form, attention in fp64."""
    n = x.shape[0]
    pos = torch.arange(n, device=x.device)
    q_nope, q_pe = m.project_q(x, pos)
    k_nope, v = m.expand_kv(rows[:, :KV_RANK].to(m.dtype))
    k = torch.cat([k_nope, rows[:, None, KV_RANK:].to(m.dtype).expand(n, HEADS, ROPE)], -1)
    q = torch.cat([q_nope, q_pe], -1)
    s = torch.einsum("ihd,jhd->hij", q.double(), k.double()) * m.softmax_scale
    s = s.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), 1), float("-inf"))
    o = torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), v.double()).to(m.dtype)
    return m.output(o)


def cached_rows(cache, table, b, n, page_size):
    return cache.read(0, table[b][: -(-n // page_size)], n)


# ------------------------------------------------------------------------------------------ structure
def test_parameter_names_and_real_shapes():
    kimi = MLAttention(7168, 64, 1536, 512, 128, 64, 128, rope_theta=50000.0, device="meta",
                       rope_scaling={"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                                     "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})
    shapes = {k: tuple(v.shape) for k, v in kimi.state_dict().items()}
    assert shapes == {"q_a_proj.weight": (1536, 7168), "q_a_layernorm.weight": (1536,),
                      "q_b_proj.weight": (12288, 1536), "kv_a_proj_with_mqa.weight": (576, 7168),
                      "kv_a_layernorm.weight": (512,), "kv_b_proj.weight": (16384, 512),
                      "o_proj.weight": (7168, 8192)}
    assert kimi.softmax_scale == pytest.approx(0.144680, abs=5e-7)
    glm = MLAttention(6144, 64, 2048, 512, 192, 64, 256, rope_theta=8e6, device="meta",
                      linear_formats={n: FP8Block() for n in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                                                               "kv_b_proj", "o_proj")})
    sd = glm.state_dict()
    assert tuple(sd["kv_b_proj.weight"].shape) == (28672, 512) and tuple(sd["kv_b_proj.weight_scale_inv"].shape) == (224, 4)
    assert tuple(sd["o_proj.weight"].shape) == (6144, 16384) and glm.softmax_scale == 0.0625
    no_q_lora = MLAttention(64, 2, None, 32, 16, 16, 16, device="meta")
    assert "q_proj.weight" in no_q_lora.state_dict() and not hasattr(no_q_lora, "q_a_proj")


def test_bad_construction_and_inputs():
    with pytest.raises(ValueError, match="unknown projections"):
        MLAttention(64, 2, 32, 32, 16, 16, 16, linear_formats={"wq": FP8Block()})
    with pytest.raises(ValueError, match="rope"):
        MLAttention(64, 2, 32, 32, 16, 16, 16, rope=RotaryEmbedding(32))
    with pytest.raises(ValueError, match="no q latent"):
        MLAttention(64, 2, None, 32, 16, 16, 16).q_latent(torch.randn(1, 64))
    m = make_attention()
    with pytest.raises(ValueError, match="x: expected"):
        m(torch.randn(3, HIDDEN))
    cache = make_cache("bf16")
    batch = make_batch(table_for([3], 4, 32), [0], [3], 4)
    with pytest.raises(ValueError, match="x: 2 tokens"):
        m.forward_paged(torch.randn(2, HIDDEN), batch, cache.layer(0))
    with pytest.raises(ValueError, match="page_size"):
        m.forward_paged(torch.randn(3, HIDDEN), make_batch(table_for([3], 8, 32), [0], [3], 8), cache.layer(0))
    other = PagedKVCache(1, 32, 4, 64, ROPE, "bf16")
    with pytest.raises(ValueError, match="kv: rows of 64"):
        m.forward_paged(torch.randn(3, HIDDEN), batch, other.layer(0))


# ------------------------------------------------------------------------------------------ plain forward
def _deepseek_eager(m, x):
    """DeepSeek-V3 reference MLA (naive), written out with dense fp32 weights and complex RoPE."""
    def w(lin):
        return lin.weight_dequantized(torch.float32)

    def rms(t, norm):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.float()

    def rope(t, pos):  # [B, T, (H,) D] interleaved pairs as complex numbers
        f = torch.polar(torch.ones(len(pos), ROPE // 2), torch.outer(pos.float(), m.rotary_emb.inv_freq))
        tc = torch.view_as_complex(t.float().reshape(*t.shape[:-1], -1, 2))
        f = f.view(1, len(pos), *([1] * (t.dim() - 3)), ROPE // 2)
        return torch.view_as_real(tc * f).flatten(-2)

    bsz, t, _ = x.shape
    pos = torch.arange(t)
    q = rms(x @ w(m.q_a_proj).T, m.q_a_layernorm) @ w(m.q_b_proj).T
    q = q.view(bsz, t, HEADS, NOPE + ROPE)
    q = torch.cat([q[..., :NOPE], rope(q[..., NOPE:], pos)], -1)
    kv = x @ w(m.kv_a_proj_with_mqa).T
    latent, k_pe = kv[..., :KV_RANK], rope(kv[..., KV_RANK:], pos)
    kvb = (rms(latent, m.kv_a_layernorm) @ w(m.kv_b_proj).T).view(bsz, t, HEADS, NOPE + V)
    k = torch.cat([kvb[..., :NOPE], k_pe[:, :, None].expand(bsz, t, HEADS, ROPE)], -1)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * m.softmax_scale
    s = s.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
    o = torch.einsum("bhij,bjhd->bihd", torch.softmax(s, -1), kvb[..., NOPE:])
    return o.flatten(-2) @ w(m.o_proj).T


def test_forward_matches_eager_deepseek_reference():
    m = make_attention()
    x = torch.randn(2, 19, HIDDEN)
    assert rel_err(m(x), _deepseek_eager(m, x)) < 1e-5


def test_forward_without_q_lora_and_in_bf16():
    m = make_attention(q_lora_rank=None)
    x = torch.randn(2, 9, HIDDEN)
    y = m(x)
    mb = make_attention(q_lora_rank=None, dtype=torch.bfloat16)
    mb.load_state_dict({k: v.to(torch.bfloat16) for k, v in m.state_dict().items()})
    yb = mb(x.to(torch.bfloat16))
    assert yb.dtype == torch.bfloat16 and sqnr_db(y, yb.float()) > 35


# ------------------------------------------------------------------------------------------ cached path
@pytest.mark.parametrize("kv_format", KV_FORMATS)
def test_paged_steps_equal_naive_attention_over_the_cached_rows(kv_format):
    """Prefill chunks (naive kernel) then decode steps (absorbed kernel), two ragged requests sharing nothing:
    every output equals the naive attention over the rows the cache holds (exact up to fp32 rounding)."""
    m, page_size = make_attention(), 4
    lengths = [13, 7]
    xs = [torch.randn(n, HIDDEN) for n in lengths]
    cache = make_cache(kv_format, page_size=page_size)
    table = table_for(lengths, page_size, 32, seed=1)
    got = run_steps(m, cache, xs, table, [[6, 5], [3, 0], [1, 1], [1, 1], [1, 0], [1, 0]], page_size)
    for b, n in enumerate(lengths):
        rows = cached_rows(cache, table, b, n, page_size)
        assert rel_err(got[b], naive_over_rows(m, xs[b], rows)) < 1e-5, f"request {b}"


def test_paged_kernels_interpreted_equal_naive_attention(triton_backend):
    """The same invariant with the Triton kernels (interpreted on the CPU), fp8 per-token pages."""
    if triton_backend != "cpu":
        pytest.skip("GPU: covered by test_cached_path_gpu")
    m, page_size = make_attention(), 4
    lengths = [10, 6]
    xs = [torch.randn(n, HIDDEN) for n in lengths]
    cache = make_cache("fp8_e4m3", page_size=page_size)
    table = table_for(lengths, page_size, 32, seed=2)
    got = run_steps(m, cache, xs, table, [[7, 4], [1, 1], [2, 1]], page_size)
    for b, n in enumerate(lengths):
        assert rel_err(got[b], naive_over_rows(m, xs[b], cached_rows(cache, table, b, n, page_size))) < 1e-5


@pytest.mark.parametrize("kv_format, min_db", [("bf16", 40), ("fp8_e4m3", 20), ("fp8_e4m3/tensor", 20),
                                                ("fp8_ds_mla", 20)])
def test_prefill_then_decode_matches_full_forward(kv_format, min_db):
    """The stated accuracy of the cached path against the uncached forward (docs/mla.md): BF16 pages only round
    the latent to bf16; FP8 pages add e4m3 rounding."""
    m, page_size = make_attention(), 4
    x = torch.randn(2, 12, HIDDEN)
    full = m(x)
    cache = make_cache(kv_format, page_size=page_size)
    table = table_for([12, 12], page_size, 32, seed=3)
    got = run_steps(m, cache, [x[0], x[1]], table, [[5, 8]] + [[1, 1]] * 4 + [[1, 0]] * 3, page_size)
    assert sqnr_db(full, torch.stack(got)) > min_db


@pytest.mark.parametrize("kv_format", ["bf16", "fp8_ds_mla"])
def test_chunked_prefill_equals_one_prefill(kv_format):
    m, page_size = make_attention(), 4
    x = torch.randn(23, HIDDEN)
    table = table_for([23], page_size, 32, seed=4)
    one = run_steps(m, make_cache(kv_format), [x], table, [[23]], page_size)[0]
    chunked = run_steps(m, make_cache(kv_format), [x], table, [[7], [9], [1], [6]], page_size)[0]
    assert rel_err(chunked, one) < 1e-5


def test_speculative_decode_equals_sequential_decode():
    m, page_size = make_attention(), 4
    xs = [torch.randn(12, HIDDEN), torch.randn(9, HIDDEN)]
    table = table_for([12, 9], page_size, 32, seed=5)
    seq = run_steps(m, make_cache("fp8_e4m3"), xs, table, [[9, 6], [1, 1], [1, 1], [1, 1]], page_size)
    spec_cache = make_cache("fp8_e4m3")
    spec = run_steps(m, spec_cache, xs, table, [[9, 6], [3, 3]], page_size)
    assert m.uses_decode_kernel(make_batch(table, [9, 6], [3, 3], page_size))
    for a, b in zip(seq, spec):
        assert rel_err(b, a) < 1e-5


def test_mixed_prefill_and_decode_batch_equals_separate_runs():
    m, page_size = make_attention(), 4
    xs = [torch.randn(8, HIDDEN), torch.randn(11, HIDDEN)]
    table = table_for([8, 11], page_size, 32, seed=6)
    mixed = run_steps(m, make_cache("bf16"), xs, table, [[7, 0], [1, 11]], page_size)
    assert not m.uses_decode_kernel(make_batch(table, [7, 0], [1, 11], page_size))
    alone0 = run_steps(m, make_cache("bf16"), xs[:1], table[:1], [[7], [1]], page_size)[0]
    alone1 = run_steps(m, make_cache("bf16"), xs[1:], table[1:], [[11]], page_size)[0]
    assert rel_err(mixed[0], alone0) < 1e-5 and rel_err(mixed[1], alone1) < 1e-5


@settings(max_examples=8, deadline=None)
@given(data=st.data(), page_size=st.sampled_from([1, 16, 64]), kv_format=st.sampled_from(KV_FORMATS))
def test_ragged_prompts_shared_prefix_pages(data, page_size, kv_format):
    """Two requests whose prompts share a prefix of whole pages (prefix sharing: the second request's table
    points at the first's pages), ragged prompt and decode lengths, any page size."""
    m = make_attention()
    shared_pages = data.draw(st.integers(0, 2 if page_size < 64 else 1))
    prefix = shared_pages * page_size
    n0 = data.draw(st.integers(max(prefix, 1), prefix + 12))
    n1 = data.draw(st.integers(max(prefix, 1), prefix + 12))
    x0 = torch.randn(n0 + 3, HIDDEN)
    x1 = torch.cat([x0[:prefix], torch.randn(n1 + 3 - prefix, HIDDEN)])
    num_pages = 2 * ((n0 + n1 + 6) // page_size + 2)
    table = table_for([n0 + 3, n1 + 3], page_size, num_pages, seed=data.draw(st.integers(0, 99)),
                      shared_prefix_pages=shared_pages)
    cache = make_cache(kv_format, num_pages, page_size)
    # request 0 writes the shared pages; request 1's prefill only appends past them
    run_steps(m, cache, [x0], table[:1], [[n0]], page_size)
    batch = make_batch(table[1:], [prefix], [n1 - prefix], page_size)
    if n1 > prefix:
        m.forward_paged(x1[prefix:n1], batch, cache.layer(0))
    prev, got = [n0, n1], [[], []]
    for _ in range(3):
        y = m.forward_paged(torch.stack([x0[prev[0]], x1[prev[1]]]), make_batch(table, prev, [1, 1], page_size),
                            cache.layer(0))
        got[0].append(y[0])
        got[1].append(y[1])
        prev = [prev[0] + 1, prev[1] + 1]
    for b, (x, n) in enumerate([(x0, n0 + 3), (x1, n1 + 3)]):
        want = naive_over_rows(m, x[:n], cached_rows(cache, table, b, n, page_size))[-3:]
        assert rel_err(torch.stack(got[b]), want) < 1e-5, f"request {b}"


# ------------------------------------------------------------------------------------------ weights
def test_absorbed_weights_follow_weight_changes():
    m = make_attention()
    w_uk, w_uv = m.absorbed_weights()
    assert m.absorbed_weights()[0] is w_uk  # cached
    dense = m.kv_b_proj.weight_dequantized().view(HEADS, NOPE + V, KV_RANK)
    assert torch.equal(w_uk, dense[:, :NOPE]) and torch.equal(w_uv, dense[:, NOPE:])
    m.kv_b_proj.set_weight(torch.randn(HEADS * (NOPE + V), KV_RANK))            # new tensors
    assert not torch.equal(m.absorbed_weights()[0], w_uk)
    w2 = m.absorbed_weights()[0]
    with torch.no_grad():
        m.kv_b_proj.weight.mul_(2)                                                 # in place
    assert torch.equal(m.absorbed_weights()[0], 2 * w2)
    m.kv_b_proj.convert_format_(FP8Block())                                       # format change
    fp8 = m.kv_b_proj.weight_dequantized().view(HEADS, NOPE + V, KV_RANK)
    assert torch.equal(m.absorbed_weights()[0], fp8[:, :NOPE])
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    sd["kv_b_proj.weight_scale_inv"] *= 0.5
    m.load_state_dict(sd)                                                          # load_state_dict copies in place
    assert torch.equal(m.absorbed_weights()[0], fp8[:, :NOPE] * 0.5)


@pytest.mark.parametrize("fmt, min_db", [(FP8Block(act_quant=False), None), (Int4Group(32), None), (FP8Block(), 25)])
def test_quantized_projections_in_the_cached_path(fmt, min_db):
    """Weight-only formats: the absorbed decode (dequantized W_UK / W_UV) is exactly the naive form. W8A8
    kv_b_proj: the naive form also rounds the latent to e4m3, the absorbed form cannot — a stated SQNR."""
    weight_only = FP8Block(act_quant=False)
    m = make_attention(linear_formats={"q_a_proj": weight_only, "kv_a_proj_with_mqa": weight_only, "kv_b_proj": fmt})
    for name in ("q_a_proj", "kv_a_proj_with_mqa", "kv_b_proj"):
        lin = getattr(m, name)
        lin.set_weight(torch.randn(lin.out_features, lin.in_features) * lin.in_features ** -0.5 * 2)
    page_size, x = 4, torch.randn(13, HIDDEN)
    cache = make_cache("bf16")
    table = table_for([13], page_size, 32, seed=7)
    got = run_steps(m, cache, [x], table, [[10], [1], [1], [1]], page_size)[0]  # a 10-token prefill: naive form
    want = naive_over_rows(m, x, cached_rows(cache, table, 0, 13, page_size))
    if min_db is None:
        assert rel_err(got, want) < 1e-5
    else:
        assert rel_err(got[:10], want[:10]) < 1e-5 and sqnr_db(want[10:], got[10:]) > min_db


# ------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", KV_FORMATS)
def test_cached_path_gpu(kv_format):
    """bf16 module on the GPU kernels: prefill + decode against the naive attention over the cached rows."""
    m = make_attention(dtype=torch.bfloat16).cuda()
    page_size, lengths = 16, [70, 33]
    xs = [torch.randn(n, HIDDEN, device="cuda").to(torch.bfloat16) for n in lengths]
    cache = make_cache(kv_format, 32, page_size, device="cuda")
    table = table_for(lengths, page_size, 32, seed=8).cuda()
    got = run_steps(m, cache, xs, table, [[60, 30], [5, 1], [1, 1], [1, 1]] + [[1, 0]] * 3, page_size)
    for b, n in enumerate(lengths):
        want = naive_over_rows(m, xs[b], cached_rows(cache, table, b, n, page_size))
        assert sqnr_db(want.float(), got[b].float()) > 35, f"request {b}"
