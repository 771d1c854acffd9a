"""Programmatic dependent launch (``kernels/_pdl.py``) changes when a kernel is scheduled, never what it reads:
each decode-step chain, captured in a CUDA graph with PDL and replayed on new inputs, gives what plain launches
give (bit for bit where the kernels are deterministic). GPU only; the CPU side is in test_backend.py."""
import pytest
import torch
import triton
import triton.language as tl

from mla_quant.kernels import _pdl
from mla_quant.kernels._triton_utils import gdc_launch_dependents, gdc_wait
from mla_quant.kernels.fused_moe import fused_moe
from mla_quant.kernels.indexer_scores import indexer_topk, topk_work_buffer
from mla_quant.kernels.mla_decode import mla_decode
from mla_quant.kernels.sparse_mla_decode import sparse_mla_decode
from tests.kernels.test_fused_moe import experts, routing
from tests.kernels.test_indexer_scores import FP8, decode_step
from tests.kernels.test_w4a16_gemm import _weights as int4_weights

pytestmark = pytest.mark.gpu


def plain(fn, monkeypatch):
    """fn() with every kernel launched without PDL."""
    with monkeypatch.context() as m:
        m.setattr(_pdl, "ENABLED", False)
        out = fn()
        torch.cuda.synchronize()
        return out


def captured(fn):
    """fn's outputs and a CUDA graph of it, captured with PDL after one eager (compiling) call."""
    if not _pdl.pdl_launch(torch.device("cuda"), "topk").get("launch_pdl"):
        pytest.skip("programmatic dependent launch needs an sm_90+ GPU (or MLA_QUANT_PDL=0 is set)")
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def replayed(graph, out):
    graph.replay()
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("skip", [None, frozenset()], ids=["default", "split_kernel_too"])
def test_mla_decode_split_and_merge(monkeypatch, skip):
    """16 heads, ragged requests long enough to split: the merge (and with ``SKIP`` empty the split kernel too)
    launched with PDL in a graph equal plain launches bit for bit, on the captured queries and on new ones."""
    if skip is not None:
        monkeypatch.setattr(_pdl, "SKIP", skip)
    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = [5000, 4097, 130]
    pages = 3 * 80 + 8                          # 80 pages of 64 tokens per request: up to 5120 tokens
    pool = torch.randn(pages, 64, 576, generator=g, device="cuda").to(torch.bfloat16)
    table = torch.randperm(pages, generator=g, device="cuda")[:3 * 80].view(3, 80).to(torch.int32)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    q = torch.randn(3, 1, 16, 576, generator=g, device="cuda").to(torch.bfloat16)

    def step():
        return mla_decode(q, pool, None, table, seq_lens, 0.07, "bf16", 512, max_seq_len=5000, validate=False)

    graph, out = captured(step)
    for _ in range(2):
        got = [t.clone() for t in replayed(graph, out)]
        want = plain(step, monkeypatch)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        q.copy_(torch.randn(q.shape, generator=g, device="cuda"))


@pytest.mark.parametrize("n,heads", [(8192, 8), (65536, 8), (65536, 64)])
def test_dsa_step(monkeypatch, n, heads):
    """GLM 5.2 decode at batch 1: indexer scores (first radix digit fused), the top-k rounds and the fused
    finish, the sparse attention and its merge — five kernels chained with PDL in a graph with a kept work
    buffer (at 64 heads the sparse split kernel is launched plainly) — select the same 2048 keys as plain
    launches and attend to the same result (the selection's order, claimed by atomics, may differ, and so the
    summation order)."""
    q_idx, w_idx, keys, key_scales, table, req, pos = decode_step([n], 64, FP8, 0, "cuda", heads=32, d=128)
    q_idx = (q_idx * 20).clamp(-448, 448).to(FP8)
    g = torch.Generator(device="cuda").manual_seed(1)
    pool = torch.randn(keys.shape[0], 64, 576, generator=g, device="cuda").to(torch.bfloat16)
    q = torch.randn(1, heads, 576, generator=g, device="cuda").to(torch.bfloat16)
    seq_lens = pos.to(torch.int32) + 1
    work = topk_work_buffer("cuda", 1)

    def step():
        idx = indexer_topk(q_idx, w_idx, keys, key_scales, table, req, pos, 2048, n, work=work)
        out, lse = sparse_mla_decode(q[..., :512], q[..., 512:], pool, None, "bf16", table, seq_lens, req, idx,
                                     256 ** -0.5)
        return idx, out, lse

    graph, outs = captured(step)
    for _ in range(2):
        idx, out, lse = [t.clone() for t in replayed(graph, outs)]
        want_idx, want_out, want_lse = plain(step, monkeypatch)
        assert torch.equal(idx.sort(dim=-1).values, want_idx.sort(dim=-1).values)
        assert not work.any(), "the kept work buffer must be left zero"
        torch.testing.assert_close(out.float(), want_out.float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(lse, want_lse, rtol=1e-4, atol=1e-4)
        q_idx.copy_((torch.randn(q_idx.shape, generator=g, device="cuda") * 20).clamp(-448, 448).to(FP8))
        q.copy_(torch.randn(q.shape, generator=g, device="cuda"))


def test_fused_moe_int4_one_token(monkeypatch):
    """The INT4 decode path at one token (gate-up GEMV zeroing the arrival counters, down GEMV combining on
    arrival) chained with PDL in a graph equals plain launches."""
    gate, up, down = experts("int4_group", 16, 1024, 512, seed=3, device="cuda")
    weights, ids = routing(1, 16, 4, seed=4, device="cuda")
    x = torch.randn(1, 1024, device="cuda").to(torch.bfloat16)

    def step():
        return fused_moe(x, weights, ids, gate, up, down, kind="int4_group")

    graph, out = captured(step)
    for seed in (5, 6):
        got = replayed(graph, out).clone()
        want = plain(step, monkeypatch)
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
        x.copy_(torch.randn(x.shape, generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda"))


@triton.jit
def _late_copy(src_ptr, dst_ptr, n, SPIN_NS: tl.constexpr, BLOCK: tl.constexpr):
    """Let the next kernel be scheduled, spin SPIN_NS, wait for the kernel before, then copy src to dst (int32):
    a PDL kernel that writes its output long after its dependents may have started."""
    gdc_launch_dependents()
    pid = tl.program_id(0)
    t0 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [pid], dtype=tl.int64, is_pure=False, pack=1)
    t = t0
    while t - t0 < SPIN_NS:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [pid], dtype=tl.int64, is_pure=False,
                                      pack=1)
    gdc_wait()
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)


def _write_late(src: torch.Tensor, dst: torch.Tensor, spin_us: int = 50):
    """dst.copy_(src) (same shape and dtype, a whole number of 4-byte words) by a PDL launch of _late_copy, word by
    word."""
    assert src.shape == dst.shape and src.dtype == dst.dtype and src.is_contiguous() and dst.is_contiguous()
    src_words, dst_words = src.view(torch.int32), dst.view(torch.int32)
    n = dst_words.numel()  # words, not elements: bf16 x has two per word
    _late_copy[(triton.cdiv(n, 1024),)](src_words, dst_words, n, SPIN_NS=spin_us * 1000, BLOCK=1024, launch_pdl=True)


@pytest.mark.parametrize("tokens", [1, 4])
def test_fused_moe_reads_weights_before_its_wait_only_when_safe(monkeypatch, tokens):
    """fused_moe's half2_prefetch launches read the routing and their first weights before their PDL wait
    (WEIGHTS_BEFORE_WAIT). The four kernels just before the call are PDL kernels that let fused_moe be scheduled at
    once and write the routing ids, the routing weights and the down and gate weights only ~50 µs later: the result
    must be that of the new routing and weights (plain launches), eagerly and replayed from a graph."""
    if not _pdl.pdl_launch(torch.device("cuda"), "fused_moe").get("launch_pdl"):
        pytest.skip("programmatic dependent launch needs an sm_90+ GPU (or MLA_QUANT_PDL=0 is set)")
    import mla_quant.kernels.fused_moe as F

    assert F.WEIGHTS_BEFORE_WAIT == ("gate_up", "down")
    gate, up, down = experts("int4_group", 16, 1024, 512, seed=3, device="cuda")
    new_gate, _, new_down = experts("int4_group", 16, 1024, 512, seed=9, device="cuda")
    weights, ids = routing(tokens, 16, 4, seed=4, device="cuda")
    new_weights, new_ids = routing(tokens, 16, 4, seed=8, device="cuda")
    x = torch.randn(tokens, 1024, device="cuda").to(torch.bfloat16)
    old = {"ids": ids.clone(), "w": weights.clone(), "gate": gate["weight_packed"].clone(),
           "down": down["weight_packed"].clone()}

    def reset():
        ids.copy_(old["ids"]), weights.copy_(old["w"])
        gate["weight_packed"].copy_(old["gate"]), down["weight_packed"].copy_(old["down"])
        torch.cuda.synchronize()

    def step():
        _write_late(new_down["weight_packed"], down["weight_packed"])
        _write_late(new_gate["weight_packed"], gate["weight_packed"])
        _write_late(new_weights, weights)
        _write_late(new_ids, ids)
        return fused_moe(x, weights, ids, gate, up, down, kind="int4_group", block_m=1, gemv="half2_prefetch")

    want = plain(lambda: fused_moe(x, new_weights, new_ids, {**gate, "weight_packed": new_gate["weight_packed"]}, up,
                                   {**down, "weight_packed": new_down["weight_packed"]}, kind="int4_group", block_m=1,
                                   gemv="half2_prefetch"), monkeypatch)
    stale = plain(lambda: fused_moe(x, weights, ids, gate, up, down, kind="int4_group", block_m=1,
                                    gemv="half2_prefetch"), monkeypatch)
    assert not torch.equal(stale, want)
    got = step()
    torch.cuda.synchronize()
    assert torch.equal(got, want), "eager"
    reset()
    graph, out = captured(step)
    for _ in range(2):
        reset()
        assert torch.equal(replayed(graph, out), want), "graph replay"


# The late writers of the tests below spin this long: longer than the host takes to launch the next call eagerly
# (w4a16_gemm's and fused_moe's Python paths), so that call's kernels are scheduled while the write is pending. With
# 50 µs the write was done before the GEMV started, and the tests passed on the racy kernels of 2e3a7a4 too. Each test
# also replays its step from a CUDA graph, where the launches follow each other without the host in between.
LATE_US = 2000


def _late_pair_order(real):
    """pair_order whose outputs are written LATE_US late by PDL kernels that let the next kernel start at once,
    over buffers poisoned with NaN (fp16 pairs 0xFFFF, fp32 scales NaN): a GEMV that reads its pairs before its
    wait reads NaN."""
    def late(a, hold_next=False):
        pairs, scales = real(a, hold_next)
        late_pairs = torch.full_like(pairs, -1)
        late_scales = torch.full_like(scales, float("nan"))
        _write_late(pairs, late_pairs, LATE_US)
        _write_late(scales, late_scales, LATE_US)
        return late_pairs, late_scales
    return late


def _eager_and_replayed(step, want, reset=lambda: None):
    """step() twice eagerly and twice replayed from a CUDA graph (reset() before each) equals ``want`` bit for bit."""
    for i in range(2):
        reset()
        torch.cuda.synchronize()
        got = step()
        torch.cuda.synchronize()
        assert torch.equal(got, want), f"eager call {i}"
    reset()
    graph, out = captured(step)
    for i in range(2):
        reset()
        torch.cuda.synchronize()
        assert torch.equal(replayed(graph, out), want), f"graph replay {i}"


@pytest.mark.parametrize("gemv,dtype", [("rows", torch.bfloat16), ("rows", torch.float32),
                                        ("rows_half2", torch.bfloat16)])
@pytest.mark.parametrize("n", [2048, 4096])
def test_one_token_gemv_reads_x_after_its_wait(monkeypatch, gemv, dtype, n):
    """w4a16_gemm(prefetch_weights=True) reads its weights before its PDL wait but x only after it. Here the
    kernel just before writes x LATE_US after letting the GEMV start: the result must be that of the new x. (Until
    session 36 the rows GEMV read x with ``ld.global.nc`` loads, which ptxas hoisted above the wait, together with
    most of the arithmetic.)"""
    if not _pdl.pdl_launch(torch.device("cuda"), "w4a16_gemv").get("launch_pdl"):
        pytest.skip("programmatic dependent launch needs an sm_90+ GPU (or MLA_QUANT_PDL=0 is set)")
    from mla_quant.kernels.w4a16_gemm import w4a16_gemm
    packed, scale = int4_weights(n, 7168, 32, "cuda")
    g = torch.Generator(device="cuda").manual_seed(2)
    old_x = torch.randn(1, 7168, generator=g, device="cuda").to(dtype)
    new_x = torch.randn(1, 7168, generator=g, device="cuda").to(dtype)
    x = old_x.clone()
    want = plain(lambda: w4a16_gemm(new_x, packed, scale, 32, gemv=gemv), monkeypatch)
    assert not torch.equal(want, plain(lambda: w4a16_gemm(old_x, packed, scale, 32, gemv=gemv), monkeypatch))

    def step():
        _write_late(new_x, x, LATE_US)
        return w4a16_gemm(x, packed, scale, 32, gemv=gemv, prefetch_weights=True)

    _eager_and_replayed(step, want, reset=lambda: x.copy_(old_x))


@pytest.mark.parametrize("n", [2048, 4096])
def test_half2_gemv_reads_pairs_after_its_wait(monkeypatch, n):
    """The half2 rows GEMV with prefetch_weights, its activation pairs and their scales written late (poisoned
    until then) by the kernels just before it: it must read them only after its wait."""
    if not _pdl.pdl_launch(torch.device("cuda"), "w4a16_gemv").get("launch_pdl"):
        pytest.skip("programmatic dependent launch needs an sm_90+ GPU (or MLA_QUANT_PDL=0 is set)")
    from mla_quant.kernels import _half2_gemv
    from mla_quant.kernels.w4a16_gemm import w4a16_gemm
    packed, scale = int4_weights(n, 7168, 32, "cuda")
    x = torch.randn(1, 7168, generator=torch.Generator(device="cuda").manual_seed(3), device="cuda").bfloat16()
    want = plain(lambda: w4a16_gemm(x, packed, scale, 32, gemv="rows_half2"), monkeypatch)
    monkeypatch.setattr(_half2_gemv, "pair_order", _late_pair_order(_half2_gemv.pair_order))
    _eager_and_replayed(lambda: w4a16_gemm(x, packed, scale, 32, gemv="rows_half2", prefetch_weights=True), want)


@pytest.mark.parametrize("gemv", ["half2", "half2_prefetch"])
def test_fused_moe_half2_reads_pairs_after_its_wait(monkeypatch, gemv):
    """fused_moe's one-token half2 GEMVs with their activation pairs (x's, and h's where pair_order makes them)
    written late and poisoned until then: the result equals plain launches."""
    if not _pdl.pdl_launch(torch.device("cuda"), "fused_moe").get("launch_pdl"):
        pytest.skip("programmatic dependent launch needs an sm_90+ GPU (or MLA_QUANT_PDL=0 is set)")
    from mla_quant.kernels import _half2_gemv
    gate, up, down = experts("int4_group", 16, 1024, 512, seed=3, device="cuda")
    weights, ids = routing(1, 16, 4, seed=4, device="cuda")
    x = torch.randn(1, 1024, generator=torch.Generator(device="cuda").manual_seed(5), device="cuda").bfloat16()

    def step():
        return fused_moe(x, weights, ids, gate, up, down, kind="int4_group", block_m=1, gemv=gemv)

    want = plain(step, monkeypatch)
    monkeypatch.setattr(_half2_gemv, "pair_order", _late_pair_order(_half2_gemv.pair_order))
    _eager_and_replayed(step, want)
