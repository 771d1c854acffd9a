import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mla_quant.kernels.fp8_quant import block_quant_fp8_reference
from mla_quant.kernels.int4_quant import int4_quantize_reference
from mla_quant.kernels.fused_moe import WEIGHT_KEYS, choose_block_m, dequantize_expert, fused_moe, fused_moe_reference
from mla_quant.testing import assert_bitwise_equal, assert_rel_close, poisoned_empty

# (kind, act_quant): the three weight formats, FP8 both weight-only and W8A8
VARIANTS = [("bf16", False), ("int4_group", False), ("fp8_block", False), ("fp8_block", True)]


def stacked(kind, e, n, k, seed, group_size=32, device="cpu"):
    """[E, N, K] random weights held in ``kind`` (the format's checkpoint tensors, stacked)."""
    w = (torch.randn(e, n, k, generator=torch.Generator().manual_seed(seed)) / k**0.5).to(device)
    if kind == "bf16":
        return {"weight": w}
    # the references quantize (fast on the CPU, also under the interpreter)
    quant = (lambda m: int4_quantize_reference(m, group_size)) if kind == "int4_group" else block_quant_fp8_reference
    per = [quant(w[i]) for i in range(e)]
    return {key: torch.stack([p[i] for p in per]) for i, key in enumerate(WEIGHT_KEYS[kind])}


def experts(kind, e, hidden, inter, seed=0, group_size=32, device="cpu"):
    return (stacked(kind, e, inter, hidden, seed, group_size, device),
            stacked(kind, e, inter, hidden, seed + 1, group_size, device),
            stacked(kind, e, hidden, inter, seed + 2, group_size, device))


def routing(t, e, k, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.zeros(0, k)
    return torch.rand(t, k, generator=g).to(device), ids.to(torch.int32).to(device)


def naive_moe(x, topk_weights, topk_ids, gate, up, down, kind, **kw):
    """Token by token, slot by slot, on dequantized weights (independent of the reference's loop)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            if not 0 <= e < next(iter(gate.values())).shape[0]:
                continue
            wg, wu, wd = (dequantize_expert(kind, w, e, **kw).double() for w in (gate, up, down))
            h = F.silu(wg @ x[t].double()) * (wu @ x[t].double())
            out[t] += float(topk_weights[t, j]) * (wd @ h)
    return out


@pytest.mark.parametrize("kind", ["bf16", "int4_group", "fp8_block"])
def test_reference_equals_naive_per_token_loop(kind):
    gate, up, down = experts(kind, 5, 128, 128)
    x = torch.randn(7, 128)
    w, ids = routing(7, 5, 3)
    ids[0, 0] = -1  # a dropped slot
    got = fused_moe_reference(x, w, ids, gate, up, down, kind=kind)
    assert_rel_close(got, naive_moe(x, w, ids, gate, up, down, kind).float(), 1e-5, kind)


@pytest.mark.parametrize("block_m", [1, 16])
@pytest.mark.parametrize("kind,act_quant", VARIANTS)
def test_kernel_matches_reference(triton_backend, kind, act_quant, block_m):
    dev = triton_backend
    gate, up, down = experts(kind, 6, 128, 128, device=dev)
    x = torch.randn(5, 128, device=dev)
    w, ids = routing(5, 6, 2, device=dev)
    out = poisoned_empty((5, 128), torch.float32, dev)
    got = fused_moe(x, w, ids, gate, up, down, kind=kind, act_quant=act_quant, block_m=block_m, out=out)
    assert got is out
    ref = fused_moe_reference(x.cpu(), w.cpu(), ids.cpu(), *({k: v.cpu() for k, v in d.items()}
                                                           for d in (gate, up, down)), kind=kind, act_quant=act_quant)
    assert_rel_close(got.cpu(), ref, 1e-5, f"{kind} act_quant={act_quant} block_m={block_m}")


# Every K-masked load path (kind, act_quant, INT4 tile form) at (hidden, intermediate) both multiples of the K
# block (EVEN_K: the K masks are dropped) and both not (ragged last blocks, masked). W8A8 only the former: its K
# (both hidden and intermediate) is a multiple of act_group, which the K block divides.
EVEN_K_CASES = [(*path, shape) for path in [("bf16", False, "planes"), ("fp8_block", False, "planes"),
                                            ("fp8_block", True, "planes"), ("int4_group", False, "planes"),
                                            ("int4_group", False, "dequant")]
                for shape in [(128, 128), (160, 96)] if not (path[1] and shape[1] % 128)]


@pytest.mark.parametrize("block_m", [1, 16])
@pytest.mark.parametrize("kind,act_quant,tile,shape", EVEN_K_CASES)
def test_even_and_ragged_k(triton_backend, kind, act_quant, tile, shape, block_m):
    dev, (hidden, inter) = triton_backend, shape
    gate, up, down = experts(kind, 3, hidden, inter, seed=5, device=dev)
    x = torch.randn(2, hidden, device=dev)
    w, ids = routing(2, 3, 2, seed=5, device=dev)
    out = poisoned_empty((2, hidden), torch.float32, dev)
    got = fused_moe(x, w, ids, gate, up, down, kind=kind, act_quant=act_quant, block_m=block_m, int4_tile=tile,
                    out=out)
    cpu = lambda d: {kk: v.cpu() for kk, v in d.items()}  # noqa: E731
    ref = fused_moe_reference(x.cpu(), w.cpu(), ids.cpu(), cpu(gate), cpu(up), cpu(down), kind=kind,
                              act_quant=act_quant)
    assert_rel_close(got.cpu(), ref, 1e-5, f"{kind} act_quant={act_quant} {tile} {shape} block_m={block_m}")


@pytest.mark.parametrize("case", ["one_token", "all_on_one_expert", "odd_63", "empty_experts", "dropped",
                                  "no_tokens", "shared_out"])
def test_edge_cases(triton_backend, case):
    dev, e, k = triton_backend, 4, 2
    t = {"one_token": 1, "odd_63": 63, "all_on_one_expert": 33, "no_tokens": 0}.get(case, 9)
    gate, up, down = experts("int4_group", e, 64, 64, device=dev)
    x = torch.randn(t, 64, device=dev)
    w, ids = routing(t, e, k, device=dev)
    if case == "all_on_one_expert":
        ids = torch.full((t, 1), 2, dtype=torch.int32, device=dev)
        w = w[:, :1]
    if case == "empty_experts":
        ids = ids % 2  # experts 2 and 3 get nothing
        ids[:, 1] = 1 - ids[:, 0]
    if case == "dropped":
        ids[::2, 0] = -1
        ids[1, 1] = e  # out of range: dropped too
    shared = torch.randn(t, 64, device=dev) if case == "shared_out" else None
    got = fused_moe(x, w, ids, gate, up, down, kind="int4_group", shared_out=shared)
    cpu = lambda d: {kk: v.cpu() for kk, v in d.items()}  # noqa: E731
    ref = fused_moe_reference(x.cpu(), w.cpu(), ids.cpu(), cpu(gate), cpu(up), cpu(down), kind="int4_group",
                              shared_out=None if shared is None else shared.cpu())
    assert got.shape == (t, 64)
    assert_rel_close(got.cpu(), ref, 1e-5, case)
    if case == "dropped":  # a token whose slots are all dropped gets exactly zero
        assert torch.equal(fused_moe(x[:1], w[:1], torch.full((1, k), -1, dtype=torch.int32, device=dev),
                                     gate, up, down, kind="int4_group").cpu(), torch.zeros(1, 64))


@pytest.mark.parametrize("kind", ["bf16", "int4_group", "fp8_block"])
def test_nan_weights_of_idle_experts_do_not_leak(triton_backend, kind):
    dev = triton_backend
    gate, up, down = experts(kind, 4, 128, 128, device=dev)
    for d in (gate, up, down):  # poison expert 3 completely (weights and scales)
        for key, v in d.items():
            if v.dtype.is_floating_point:
                v[3] = float("nan")
            else:
                v[3] = -1
    x = torch.randn(6, 128, device=dev)
    w, ids = routing(6, 3, 2, device=dev)  # experts 0..2 only
    for block_m in (1, 16):
        got = fused_moe(x, w, ids, gate, up, down, kind=kind, block_m=block_m)
        assert not torch.isnan(got).any(), block_m


def test_bf16_activations(triton_backend):
    dev = triton_backend
    gate, up, down = experts("int4_group", 4, 128, 64, device=dev)
    x = torch.randn(9, 128, device=dev).to(torch.bfloat16)
    w, ids = routing(9, 4, 2, device=dev)
    got = fused_moe(x, w, ids, gate, up, down, kind="int4_group")
    assert got.dtype == torch.bfloat16
    cpu = lambda d: {kk: v.cpu() for kk, v in d.items()}  # noqa: E731
    ref = fused_moe_reference(x.cpu(), w.cpu(), ids.cpu(), cpu(gate), cpu(up), cpu(down), kind="int4_group")
    assert_rel_close(got.float().cpu(), ref.float(), 2e-2, "bf16")  # the interpreter truncates to bf16


@settings(max_examples=6, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(t=st.integers(1, 20), e=st.integers(1, 9), k=st.integers(1, 4), group=st.sampled_from([32, 64]),
       block_m=st.sampled_from([None, 1, 16, 32]), seed=st.integers(0, 2**31 - 1))
def test_hypothesis_int4(triton_backend, t, e, k, group, block_m, seed):
    k = min(k, e)
    gate, up, down = experts("int4_group", e, 64, 64, seed, group, device=triton_backend)
    x = torch.randn(t, 64, generator=torch.Generator().manual_seed(seed)).to(triton_backend)
    w, ids = routing(t, e, k, seed, device=triton_backend)
    got = fused_moe(x, w, ids, gate, up, down, kind="int4_group", group_size=group, block_m=block_m)
    cpu = lambda d: {kk: v.cpu() for kk, v in d.items()}  # noqa: E731
    ref = fused_moe_reference(x.cpu(), w.cpu(), ids.cpu(), cpu(gate), cpu(up), cpu(down), kind="int4_group",
                              group_size=group)
    assert_rel_close(got.cpu(), ref, 1e-5, "int4")


def test_strided_experts_in_the_kernel(triton_backend):
    w13 = torch.randn(3, 128, 64, device=triton_backend) / 8
    down = {"weight": torch.randn(3, 64, 64, device=triton_backend) / 8}
    x = torch.randn(4, 64, device=triton_backend)
    w = torch.rand(4, 2, device=triton_backend)
    ids = torch.tensor([[0, 2], [1, 2], [2, 0], [1, 0]], dtype=torch.int32, device=triton_backend)
    got = fused_moe(x, w, ids, {"weight": w13[:, :64]}, {"weight": w13[:, 64:]}, down)
    want = fused_moe(x, w, ids, {"weight": w13[:, :64].contiguous()}, {"weight": w13[:, 64:].contiguous()}, down)
    assert_rel_close(got, want, 1e-6, "strided")


def test_block_m_heuristic():
    assert choose_block_m(8, 384) == 1 and choose_block_m(128, 384) == 1  # decode: one row per active expert
    assert choose_block_m(512, 384) == 1 and choose_block_m(672, 384) == 1  # up to 1.75 rows per expert: GEMVs
    assert choose_block_m(8, 384, "fp8_block") == 16 and choose_block_m(8, 384, "bf16") == 16  # tensor cores
    assert choose_block_m(768, 384) == 16 and choose_block_m(8192, 384) == 32
    assert choose_block_m(131072, 256) == 128


def test_bad_input_names_the_argument():
    gate, up, down = experts("int4_group", 2, 64, 64)
    x = torch.randn(3, 64)
    w, ids = routing(3, 2, 1)
    with pytest.raises(ValueError, match="kind"):
        fused_moe(x, w, ids, gate, up, down, kind="int3")
    with pytest.raises(ValueError, match="gate"):
        fused_moe(x, w, ids, {"weight": gate["weight_packed"]}, up, down, kind="int4_group")
    with pytest.raises(ValueError, match="down"):
        fused_moe(x, w, ids, gate, up, {k: v[:, :32] for k, v in down.items()}, kind="int4_group")
    with pytest.raises(ValueError, match="topk_ids"):
        fused_moe(x, w, ids[:2], gate, up, down, kind="int4_group")
    with pytest.raises(ValueError, match="group_size"):
        fused_moe(x, w, ids, gate, up, down, kind="int4_group", group_size=48)
    with pytest.raises(ValueError, match="scale"):
        fused_moe(x, w, ids, gate, up, down, kind="int4_group", group_size=64)
    with pytest.raises(ValueError, match="block_m"):
        fused_moe(x, w, ids, gate, up, down, kind="int4_group", block_m=8)
    with pytest.raises(TypeError, match="x"):
        fused_moe(x.to(torch.int32), w, ids, gate, up, down, kind="int4_group")
    with pytest.raises(ValueError, match="shared_out"):
        fused_moe(x, w, ids, gate, up, down, kind="int4_group", shared_out=torch.zeros(2, 64))


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4, 16, 63, 256, 1000])
@pytest.mark.parametrize("kind,act_quant", VARIANTS)
def test_gpu_real_widths(kind, act_quant, t):
    # Kimi's widths (hidden 7168, expert 2048), fewer experts to keep the reference loop short.
    e, k = 24, 8
    gate, up, down = experts(kind, e, 7168, 2048, device="cuda")
    x = (torch.randn(t, 7168, device="cuda") * 0.5).to(torch.bfloat16)
    w, ids = routing(t, e, k, device="cuda")
    out = poisoned_empty((t, 7168), torch.bfloat16, "cuda")
    got = fused_moe(x, w, ids, gate, up, down, kind=kind, act_quant=act_quant, out=out)
    ref = fused_moe_reference(x, w, ids, gate, up, down, kind=kind, act_quant=act_quant)
    assert_rel_close(got.float(), ref.float(), 1e-2, f"{kind} T={t}")  # bf16 weights / h rounding
    if t <= 16:  # both decode paths (GEMV and tensor-core tile) agree
        other = fused_moe(x, w, ids, gate, up, down, kind=kind, act_quant=act_quant, block_m=16)
        assert_rel_close(other.float(), got.float(), 1e-2, "block_m=16")


@pytest.mark.gpu
def test_gpu_fp32_is_the_exact_mode():
    gate, up, down = experts("int4_group", 8, 1024, 512, device="cuda")
    x = torch.randn(33, 1024, device="cuda")
    w, ids = routing(33, 8, 4, device="cuda")
    got = fused_moe(x, w, ids, gate, up, down, kind="int4_group")
    ref = fused_moe_reference(x, w, ids, gate, up, down, kind="int4_group")
    assert_rel_close(got, ref, 1e-5, "fp32 (IEEE dots)")


@pytest.mark.parametrize("block_m", [1, 16, 64, 128])
@pytest.mark.parametrize("kind, a_dtype, w8a8", [("bf16", torch.bfloat16, False), ("bf16", torch.float32, False),
                                                 ("fp8_block", torch.bfloat16, False), ("fp8_block", torch.float32, False),
                                                 ("fp8_block", torch.bfloat16, True), ("int4_group", torch.bfloat16, False)])
def test_autotune_prune_keeps_a_fitting_tile(kind, a_dtype, w8a8, block_m):
    """Shared memory on the H200 (OutOfResources seen for fp32 and bf16-upcast FP8 tiles): every pruned list
    holds a tile the model says fits, and every tile kept obeys the format's K rules."""
    from mla_quant.kernels.fused_moe import kernel as K

    kind_id = {"bf16": K.KIND_DENSE, "fp8_block": K.KIND_FP8, "int4_group": K.KIND_INT4}[kind]
    meta = dict(W8A8=w8a8, a_ptr=torch.empty(1, dtype=a_dtype), w1_ptr=torch.empty(1, dtype=torch.bfloat16),
                KIND=kind_id, IEEE=a_dtype == torch.float32 and not w8a8, GATED=True, BLOCK_M=block_m, GROUP=32,
                ACT_G=128, SBK=128)
    configs = K.GEMV_CONFIGS if block_m == 1 else K.DOT_CONFIGS
    kept = K._prune(configs, meta)
    fits = [c for c in kept if K._smem_bytes(meta, c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_stages)
            <= K.SMEM_BUDGET]
    assert fits, kept
    assert all(K._legal(c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], meta) for c in kept)
    if w8a8 and block_m > 1:  # one scale pair per K tile
        assert all(128 % c.kwargs["BLOCK_K"] == 0 for c in kept)


def _assert_int4_form(got, other, x, w, ids, gate, up, down, group, what):
    """An INT4 kernel form against the CPU reference and against another form of the same experts. fp32: the
    products are exact (q·s, q·a), only the summation order differs; bf16: h, the output and (in the tile forms)
    the weight are rounded to bf16."""
    cpu = lambda d: {kk: v.cpu() for kk, v in d.items()}  # noqa: E731
    ref = fused_moe_reference(x.cpu(), w.cpu(), ids.cpu(), cpu(gate), cpu(up), cpu(down), kind="int4_group",
                              group_size=group)
    tol = 1e-5 if x.dtype == torch.float32 else 2e-2
    assert_rel_close(got.float().cpu(), ref.float(), tol, what)
    assert_rel_close(got.float().cpu(), other.float().cpu(), tol, f"{what} vs the other form")


# --- the INT4 plane GEMV (gemv="prefetch", the default at block_m=1) against the previous GEMV ("tile") ---

# (hidden, intermediate, group, dtype): K blocks (256 interpreted) whole; ragged last blocks; groups of 64
@pytest.mark.parametrize("hidden,inter,group,dtype", [(512, 256, 32, torch.float32), (160, 96, 32, torch.float32),
                                                      (352, 96, 32, torch.bfloat16), (384, 256, 64, torch.float32)])
def test_plane_gemv_matches_reference_and_the_tile_gemv(triton_backend, hidden, inter, group, dtype):
    dev, shape = triton_backend, (hidden, inter)
    gate, up, down = experts("int4_group", 3, hidden, inter, seed=7, group_size=group, device=dev)
    x = torch.randn(2, hidden, device=dev).to(dtype)
    w, ids = routing(2, 3, 2, seed=7, device=dev)
    ids[1, 1] = -1  # a dropped slot
    out = poisoned_empty((2, hidden), dtype, dev)
    got = fused_moe(x, w, ids, gate, up, down, kind="int4_group", group_size=group, block_m=1, out=out)
    assert got is out
    tile = fused_moe(x, w, ids, gate, up, down, kind="int4_group", group_size=group, block_m=1, gemv="tile")
    _assert_int4_form(got, tile, x, w, ids, gate, up, down, group, f"planes {shape} g{group}")



def test_plane_order_is_the_documented_permutation(triton_backend):
    """planes[r, 256b + 32i + w] = a[r, 8(32b + w) + i] · 16^-j(i), zeros past K, exactly (a layout op), for
    the kernel and the reference; K = 352: one whole block of 256 and one of 12 words."""
    from mla_quant.kernels._gemm_utils import plane_order, plane_order_reference, plane_width

    a = torch.randn(3, 352)
    want = torch.zeros(3, plane_width(352))
    assert want.shape[1] == 512
    for k in range(352):
        w, i = divmod(k, 8)
        want[:, 256 * (w // 32) + 32 * i + w % 32] = a[:, k] * 16.0 ** -(i if i < 5 else i - 5)
    assert torch.equal(plane_order_reference(a), want)
    assert torch.equal(plane_order(a.to(triton_backend)).cpu(), want)
    bf16 = a.to(torch.bfloat16)
    assert torch.equal(plane_order(bf16.to(triton_backend)).cpu(), plane_order_reference(bf16))


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_plane_gemv_real_widths(t, dtype):
    """Kimi's widths (every K block whole: the inline-asm loads and LOP3 of the compiled plane GEMV run)."""
    e, k = 24, 8
    gate, up, down = experts("int4_group", e, 7168, 2048, device="cuda")
    x = (torch.randn(t, 7168, device="cuda") * 0.5).to(dtype)
    w, ids = routing(t, e, k, device="cuda")
    out = poisoned_empty((t, 7168), dtype, "cuda")
    got = fused_moe(x, w, ids, gate, up, down, kind="int4_group", block_m=1, gemv="planes", out=out)
    ref = fused_moe_reference(x, w, ids, gate, up, down, kind="int4_group")
    tile = fused_moe(x, w, ids, gate, up, down, kind="int4_group", block_m=1, gemv="tile")
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    assert_rel_close(got.float(), ref.float(), tol, f"planes T={t}")
    assert_rel_close(got.float(), tile.float(), tol, f"planes vs tile T={t}")
    prefetch = fused_moe(x, w, ids, gate, up, down, kind="int4_group", block_m=1, gemv="prefetch")
    assert_rel_close(prefetch.float(), ref.float(), tol, f"prefetch T={t}")


@pytest.mark.parametrize("hidden,inter", [(512, 256), (352, 96)])  # 2 K blocks / ragged: the prefetch mask
def test_prefetch_gemv_equals_the_plane_gemv(triton_backend, hidden, inter):
    dev = triton_backend
    gate, up, down = experts("int4_group", 3, hidden, inter, seed=9, device=dev)
    x = torch.randn(2, hidden, device=dev)
    w, ids = routing(2, 3, 2, seed=9, device=dev)
    out = poisoned_empty((2, hidden), torch.float32, dev)
    got = fused_moe(x, w, ids, gate, up, down, kind="int4_group", block_m=1, gemv="prefetch", out=out)
    planes = fused_moe(x, w, ids, gate, up, down, kind="int4_group", block_m=1, gemv="planes")
    _assert_same_sums(got, planes, "prefetch vs planes")  # the same products; only the load schedule differs
    assert torch.equal(got, fused_moe(x, w, ids, gate, up, down, kind="int4_group", block_m=1)), "the default"


# --- the decode path (block_m == 1, decode_fusion=True; "auto" at one token): no moe_align, the combine done in the down
# GEMV by the last program of each token and column tile to arrive; against the aligned path with its combine
# launch (decode_fusion=False), which runs the same arithmetic per row and the same sum per token ---

def _poison_allocations(monkeypatch):
    """Every ``torch.empty`` from here on is poisoned (NaN floats, integer minimum: the arrival counters), so a
    buffer read before it is written — counters the gate-up launch failed to zero, a y row never stored — shows
    as NaN or as an output the combine never wrote."""
    def empty(*size, dtype=torch.float32, device="cpu", **kw):
        size = size[0] if len(size) == 1 else size
        return poisoned_empty((size,) if isinstance(size, int) else size, dtype, device)
    monkeypatch.setattr(torch, "empty", empty)


def _decode_paths(monkeypatch, x, w, ids, gate, up, down, what, kind="int4_group", **kw):
    """The fused and the aligned decode path (into poisoned outputs, poisoned allocations), the fused one twice;
    asserts they are bitwise equal and returns the fused result."""
    _poison_allocations(monkeypatch)
    outs = []
    for fusion in (True, True, False):
        out = poisoned_empty(x.shape, x.dtype, x.device)
        got = fused_moe(x, w, ids, gate, up, down, kind=kind, block_m=1, out=out, decode_fusion=fusion, **kw)
        assert got is out
        outs.append(got)
    assert_bitwise_equal(outs[0], outs[1], f"{what}: fused, called twice")
    _assert_same_sums(outs[0], outs[2], f"{what}: fused vs aligned")
    return outs[0]


def _assert_same_sums(got, other, what):
    """Two launch paths that run the same products per tile: bitwise equal interpreted (one fixed tile); on the
    GPU each path's launches are autotuned apart (DIRECT and the form are in the key), so their K tiles and hence
    the fp32 summation order may differ: equal within fp32 (bf16) rounding there."""
    if got.is_cuda:
        assert_rel_close(got.float(), other.float(), 1e-5 if got.dtype == torch.float32 else 4e-3, what)
    else:
        assert_bitwise_equal(got, other, what)


# (tokens, top_k, shared_out, dropped slots, hidden): hidden 96 and 160 are ragged against the interpreted N tile
# (64) of the down GEMV, so the combine's last tile is masked
DECODE_CASES = [(1, 2, False, False, 96), (1, 1, True, False, 64), (1, 3, True, True, 160), (3, 1, False, True, 96),
                (4, 3, True, True, 96)]


@pytest.mark.parametrize("tokens,top_k,shared,dropped,hidden", DECODE_CASES)
def test_decode_fusion_equals_the_aligned_path(triton_backend, monkeypatch, tokens, top_k, shared, dropped, hidden):
    dev, e = triton_backend, 4
    gate, up, down = experts("int4_group", e, hidden, 64, seed=13, device=dev)
    x = torch.randn(tokens, hidden, device=dev)
    w, ids = routing(tokens, e, top_k, seed=13, device=dev)
    if dropped:  # outside [0, E) at both ends; token 0 loses every slot
        ids[0, :] = -1
        ids[-1, -1] = e
    shared_out = torch.randn(tokens, hidden, device=dev) if shared else None
    what = f"T={tokens} k={top_k} shared={shared} dropped={dropped} H={hidden}"
    got = _decode_paths(monkeypatch, x, w, ids, gate, up, down, what, shared_out=shared_out)
    cpu = lambda d: {kk: v.cpu() for kk, v in d.items()}  # noqa: E731
    ref = fused_moe_reference(x.cpu(), w.cpu(), ids.cpu(), cpu(gate), cpu(up), cpu(down), kind="int4_group",
                              shared_out=None if shared_out is None else shared_out.cpu())
    assert_rel_close(got.cpu(), ref, 1e-5, what)
    if dropped:  # a token whose slots are all dropped gets exactly the shared output (or zero)
        assert torch.equal(got[0].cpu(), torch.zeros(hidden) if shared_out is None else shared_out[0].cpu()), what


def test_decode_fusion_auto_fuses_one_token_only(triton_backend, monkeypatch):
    """"auto" (the default) takes the fused path at FUSION_MAX_TOKENS (1) token and the aligned one above: seen by
    whether moe_align runs (both paths give the same bits here, so only the launch tells them apart)."""
    import mla_quant.kernels.fused_moe as F

    dev, e = triton_backend, 4
    gate, up, down = experts("int4_group", e, 64, 64, seed=3, device=dev)
    calls = []
    align = F.moe_align
    monkeypatch.setattr(F, "moe_align", lambda *a, **kw: calls.append(a[0].shape[0]) or align(*a, **kw))
    assert F.FUSION_MAX_TOKENS == 1
    for tokens in (1, 2):
        w, ids = routing(tokens, e, 2, seed=tokens, device=dev)
        fused_moe(torch.randn(tokens, 64, device=dev), w, ids, gate, up, down, kind="int4_group", block_m=1)
    assert calls == [2], "auto: no align at one token, the aligned path at two"
    with pytest.raises(ValueError, match="decode_fusion"):
        fused_moe(torch.randn(1, 64, device=dev), w[:1], ids[:1], gate, up, down, kind="int4_group",
                  decode_fusion="yes")


# every other block_m == 1 kernel form takes the decode path too: the INT4 planes without prefetch and the tile
# GEMV; BF16 and FP8 (weight-only, W8A8) GEMVs; bf16 activations
@pytest.mark.parametrize("kind,act_quant,gemv,dtype", [("int4_group", False, "planes", torch.float32),
                                                       ("int4_group", False, "tile", torch.float32),
                                                       ("int4_group", False, "prefetch", torch.bfloat16),
                                                       ("int4_group", False, "half2", torch.bfloat16),
                                                       ("bf16", False, "prefetch", torch.float32),
                                                       ("fp8_block", False, "prefetch", torch.float32),
                                                       ("fp8_block", True, "prefetch", torch.float32)])
def test_decode_fusion_in_every_gemv_form(triton_backend, monkeypatch, kind, act_quant, gemv, dtype):
    dev, e, hidden = triton_backend, 3, 128 if act_quant else 96  # W8A8: K a multiple of act_group (128)
    gate, up, down = experts(kind, e, hidden, 128, seed=17, device=dev)
    x = torch.randn(2, hidden, device=dev).to(dtype)
    w, ids = routing(2, e, 2, seed=17, device=dev)
    ids[1, 0] = -1
    shared_out = torch.randn(2, hidden, device=dev).to(dtype)
    what = f"{kind} act_quant={act_quant} gemv={gemv} {dtype}"
    got = _decode_paths(monkeypatch, x, w, ids, gate, up, down, what, kind=kind, act_quant=act_quant, gemv=gemv,
                        shared_out=shared_out)
    cpu = lambda d: {kk: v.cpu() for kk, v in d.items()}  # noqa: E731
    ref = fused_moe_reference(x.cpu(), w.cpu(), ids.cpu(), cpu(gate), cpu(up), cpu(down), kind=kind,
                              act_quant=act_quant, shared_out=shared_out.cpu())
    assert_rel_close(got.float().cpu(), ref.float(), 1e-5 if dtype == torch.float32 else 2e-2, what)


def _kimi_decode_inputs(t, dtype, e, k=8):
    """x at Kimi's hidden width, a top-k routing over e experts with dropped slots (ids outside [0, e), as under
    expert parallelism; token 0 loses every third slot) and a shared output (CUDA)."""
    x = (torch.randn(t, 7168, device="cuda") * 0.5).to(dtype)
    w, ids = routing(t, e, k, device="cuda")
    ids[0, ::3] = -1
    ids[-1, 1] = e
    return x, w, ids, torch.randn(t, 7168, device="cuda").to(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_decode_fusion_real_widths(t, dtype):
    """Kimi's widths, top-8, with the shared output and dropped slots (as under expert parallelism), compiled: the
    last-arrival combine against the reference and the aligned path. The two paths tune their tiles separately
    (``DIRECT`` is in the autotuning key), so they agree bit for bit only when the tuning picks the same tiles:
    checked within tolerance here, bitwise on the CPU."""
    gate, up, down = experts("int4_group", 24, 7168, 2048, device="cuda")
    x, w, ids, shared_out = _kimi_decode_inputs(t, dtype, 24)
    outs = []
    for fusion in (True, True, False):
        out = poisoned_empty((t, 7168), dtype, "cuda")
        outs.append(fused_moe(x, w, ids, gate, up, down, kind="int4_group", shared_out=shared_out, out=out,
                              decode_fusion=fusion))
    ref = fused_moe_reference(x, w, ids, gate, up, down, kind="int4_group", shared_out=shared_out)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    assert_bitwise_equal(outs[0], outs[1], f"fused twice T={t}")  # counters left zero; a fixed summation order
    assert_rel_close(outs[0].float(), ref.float(), tol, f"fused T={t}")
    assert_rel_close(outs[0].float(), outs[2].float(), tol, f"fused vs aligned T={t}")


# --- the INT4 plane tensor-core tile (int4_tile="planes", the default at block_m > 1) vs the dequantized tile ---

# (hidden, intermediate, group, dtype, block_m): K blocks (128 interpreted) ragged (320, 224) or whole (256, 128);
# N tiles (64 interpreted) ragged at 224; groups of 64; 21 tokens x 2 slots over 3 experts: rows per expert not a
# multiple of block_m
@pytest.mark.parametrize("hidden,inter,group,dtype,block_m", [(320, 224, 32, torch.float32, 16),
                                                              (320, 224, 32, torch.bfloat16, 16),
                                                              (256, 128, 32, torch.bfloat16, 32),
                                                              (384, 192, 64, torch.float32, 16)])
def test_plane_tile_matches_reference_and_the_dequant_tile(triton_backend, hidden, inter, group, dtype, block_m):
    dev = triton_backend
    gate, up, down = experts("int4_group", 3, hidden, inter, seed=11, group_size=group, device=dev)
    x = torch.randn(21, hidden, device=dev).to(dtype)
    w, ids = routing(21, 3, 2, seed=11, device=dev)
    ids[4, 0] = -1  # a dropped slot
    out = poisoned_empty((21, hidden), dtype, dev)
    got = fused_moe(x, w, ids, gate, up, down, kind="int4_group", group_size=group, block_m=block_m,
                    int4_tile="planes", out=out)
    assert got is out
    tile = fused_moe(x, w, ids, gate, up, down, kind="int4_group", group_size=group, block_m=block_m,
                     int4_tile="dequant")
    assert torch.equal(got, fused_moe(x, w, ids, gate, up, down, kind="int4_group", group_size=group,
                                      block_m=block_m)), "the default is the plane tile"
    _assert_int4_form(got, tile, x, w, ids, gate, up, down, group, f"plane tile {(hidden, inter, group, block_m)}")


def test_int4_form_keywords_are_checked_and_the_tile_form_leaves_the_gemv_alone(triton_backend):
    dev = triton_backend
    gate, up, down = experts("int4_group", 2, 64, 64, device=dev)
    x = torch.randn(1, 64, device=dev)
    w, ids = routing(1, 2, 1, device=dev)
    with pytest.raises(ValueError, match="gemv"):
        fused_moe(x, w, ids, gate, up, down, kind="int4_group", gemv="planez")
    with pytest.raises(ValueError, match="int4_tile"):
        fused_moe(x, w, ids, gate, up, down, kind="int4_group", int4_tile="plane")
    # block_m == 1 runs the GEMV whatever the tile form (the default tile is the planes: ask for the other)
    a = fused_moe(x, w, ids, gate, up, down, kind="int4_group", block_m=1, int4_tile="dequant")
    assert torch.equal(a, fused_moe(x, w, ids, gate, up, down, kind="int4_group", block_m=1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unscaled_plane_order_is_the_permutation(triton_backend, dtype):
    """plane_order(a, scaled=False)[r, 256b + 32i + w] = a[r, 8(32b + w) + i] in a's dtype, zeros past K."""
    from mla_quant.kernels._gemm_utils import plane_order, plane_order_reference, plane_width

    a = torch.randn(3, 352).to(dtype)
    want = torch.zeros(3, plane_width(352), dtype=dtype)
    for k in range(352):
        w, i = divmod(k, 8)
        want[:, 256 * (w // 32) + 32 * i + w % 32] = a[:, k]
    assert torch.equal(plane_order_reference(a, scaled=False), want)
    assert torch.equal(plane_order(a.to(triton_backend), scaled=False).cpu(), want)


@pytest.mark.gpu
@pytest.mark.parametrize("t,block_m", [(32, None), (63, 16), (256, None), (256, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_plane_tile_real_widths(t, block_m, dtype):
    """Kimi's widths (every K block whole) at 32-256 tokens: the compiled plane tile against the reference and
    the dequantized tile."""
    e, k = 24, 8
    gate, up, down = experts("int4_group", e, 7168, 2048, device="cuda")
    x = (torch.randn(t, 7168, device="cuda") * 0.5).to(dtype)
    w, ids = routing(t, e, k, device="cuda")
    out = poisoned_empty((t, 7168), dtype, "cuda")
    got = fused_moe(x, w, ids, gate, up, down, kind="int4_group", block_m=block_m, int4_tile="planes", out=out)
    ref = fused_moe_reference(x, w, ids, gate, up, down, kind="int4_group")
    tile = fused_moe(x, w, ids, gate, up, down, kind="int4_group", block_m=block_m, int4_tile="dequant")
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    assert_rel_close(got.float(), ref.float(), tol, f"plane tile T={t} block_m={block_m}")
    assert_rel_close(got.float(), tile.float(), tol, f"plane tile vs dequant T={t} block_m={block_m}")


# --- gemv="fragments": mma.sync on fragments built in registers (fused_moe/fragments.py), the decode path ---

def _frag_experts(e, hidden, inter, group, dtype, dev, seed):
    """INT4 experts with scales in x's dtype (the fragment kernel scales the weights in it)."""
    gate, up, down = experts("int4_group", e, hidden, inter, seed=seed, group_size=group, device=dev)
    for w in (gate, up, down):
        w["weight_scale"] = w["weight_scale"].to(dtype)
    return gate, up, down


# (hidden, inter, group, dtype, tokens, top_k, shared, dropped): K whole and ragged against BK 128 (160, 96), rows
# ragged against the interpreted 32-row tile (96, 160), groups of 64, fp16, several tokens; the last two split K
# (the interpreter's 4 "SMs"): the gate-up in 4 (its last split arrives and writes h), the down in 4 per slot (8
# arrivals per token and tile)
FRAG_CASES = [(256, 128, 32, torch.bfloat16, 1, 4, True, False), (160, 96, 32, torch.float16, 2, 3, False, True),
              (384, 256, 64, torch.bfloat16, 1, 2, True, True), (128, 160, 32, torch.bfloat16, 3, 2, True, True),
              (512, 32, 32, torch.bfloat16, 1, 1, True, False), (64, 512, 32, torch.bfloat16, 1, 2, False, False)]


@pytest.mark.parametrize("hidden,inter,group,dtype,tokens,top_k,shared,dropped", FRAG_CASES)
def test_fragment_gemv_matches_reference(triton_backend, monkeypatch, hidden, inter, group, dtype, tokens, top_k,
                                         shared, dropped):
    dev, e = triton_backend, 5
    gate, up, down = _frag_experts(e, hidden, inter, group, dtype, dev, seed=hidden + inter)
    x = torch.randn(tokens, hidden, device=dev).to(dtype)
    w, ids = routing(tokens, e, top_k, seed=hidden, device=dev)
    if dropped:  # outside [0, E) at both ends; token 0 loses every slot
        ids[0, :] = -1
        ids[-1, -1] = e
    shared_out = torch.randn(tokens, hidden, device=dev).to(dtype) if shared else None
    what = f"fragments H={hidden} I={inter} g{group} {dtype} T={tokens} k={top_k}"
    if hidden in (512, 64):   # the split-K cases: the launch splits as the comment above says
        from mla_quant.kernels.fused_moe.fragments import MOE_FRAG_INTERPRETER
        from mla_quant.kernels.w4a16_gemm.fragments import frag_split

        bk, per_sm, warps, _ = MOE_FRAG_INTERPRETER
        rows, k = (inter, hidden) if hidden == 512 else (hidden, inter)
        assert frag_split(rows * tokens * top_k, k, 16 * warps, bk, 4, per_sm) == 4, what
    _poison_allocations(monkeypatch)   # h, the partials: read only where written
    outs = []
    for _ in range(2):
        out = poisoned_empty((tokens, hidden), dtype, dev)
        got = fused_moe(x, w, ids, gate, up, down, kind="int4_group", group_size=group, block_m=1, gemv="fragments",
                        shared_out=shared_out, out=out)
        assert got is out
        outs.append(got)
    assert_bitwise_equal(outs[0], outs[1], f"{what}: twice (counters left zero, a fixed summation order)")
    planes = fused_moe(x, w, ids, gate, up, down, kind="int4_group", group_size=group, block_m=1, gemv="planes",
                       shared_out=shared_out)
    assert_rel_close(outs[0].float().cpu(), planes.float().cpu(), 2e-2, f"{what} vs the plane GEMV")
    cpu = lambda d: {kk: v.cpu() for kk, v in d.items()}  # noqa: E731
    ref = fused_moe_reference(x.cpu(), w.cpu(), ids.cpu(), cpu(gate), cpu(up), cpu(down), kind="int4_group",
                              group_size=group, shared_out=None if shared_out is None else shared_out.cpu())
    assert_rel_close(outs[0].float().cpu(), ref.float(), 2e-2, what)
    if dropped:  # a token whose slots are all dropped gets exactly the shared output (or zero)
        want = torch.zeros(hidden, dtype=dtype) if shared_out is None else shared_out[0].cpu()
        assert torch.equal(outs[0][0].cpu(), want), what


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(t=st.integers(1, 3), e=st.integers(1, 6), k=st.integers(1, 3), group=st.sampled_from([32, 64]),
       hidden=st.sampled_from([64, 128, 192]), inter=st.sampled_from([32, 64, 96]), seed=st.integers(0, 2**31 - 1))
def test_hypothesis_fragment_gemv(triton_backend, t, e, k, group, hidden, inter, seed):
    """Any token count, experts, top-k, group and width (multiples of 32, ragged against the tiles): the fragment
    form equals the reference within bf16 rounding."""
    k = min(k, e)
    if hidden % group or inter % group:
        group = 32
    gate, up, down = _frag_experts(e, hidden, inter, group, torch.bfloat16, triton_backend, seed % 1000)
    x = torch.randn(t, hidden, generator=torch.Generator().manual_seed(seed)).to(triton_backend).to(torch.bfloat16)
    w, ids = routing(t, e, k, seed, device=triton_backend)
    got = fused_moe(x, w, ids, gate, up, down, kind="int4_group", group_size=group, block_m=1, gemv="fragments")
    cpu = lambda d: {kk: v.cpu() for kk, v in d.items()}  # noqa: E731
    ref = fused_moe_reference(x.cpu(), w.cpu(), ids.cpu(), cpu(gate), cpu(up), cpu(down), kind="int4_group",
                              group_size=group)
    assert_rel_close(got.float().cpu(), ref.float(), 2e-2, f"fragments t={t} e={e} k={k} g{group} {hidden}x{inter}")


def test_fragment_gemv_names_what_it_cannot_take(triton_backend):
    dev = triton_backend
    gate, up, down = _frag_experts(3, 128, 64, 32, torch.bfloat16, dev, seed=1)
    w, ids = routing(1, 3, 2, device=dev)
    x = torch.randn(1, 128, device=dev)
    run = lambda xx, **kw: fused_moe(xx, w, ids, gate, up, down, kind="int4_group", block_m=1,  # noqa: E731
                                     gemv="fragments", **kw)
    with pytest.raises(ValueError, match="fragments.*bf16 / fp16"):
        run(x)
    with pytest.raises(ValueError, match="fragments.*weight_scale.*float16"):
        run(x.to(torch.float16))
    with pytest.raises(ValueError, match="fragments.*decode_fusion=False"):
        run(x.to(torch.bfloat16), decode_fusion=False)
    with pytest.raises(ValueError, match="gemv"):
        fused_moe(x, w, ids, gate, up, down, kind="int4_group", block_m=1, gemv="fragment")


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_fragment_gemv_real_widths(t, dtype):
    """Kimi's widths, top-8, the shared output and dropped slots, compiled (the MMA fragments, the PTX bit tricks,
    the split-K gate-up): against the reference, the plane GEMV, and itself (bitwise)."""
    _assert_gpu_gemv_form("fragments", _frag_experts(24, 7168, 2048, 32, dtype, "cuda", seed=5), t, dtype,
                          decode_fusion=True)


def _assert_gpu_gemv_form(form, projections, t, dtype, **planes_kw):
    """An INT4 GEMV form at Kimi's widths (24 experts, top-8, the shared output and dropped slots), compiled: into
    poisoned outputs twice (bitwise the same), against the reference and the plane GEMV (``planes_kw``: its path)."""
    gate, up, down = projections
    x, w, ids, shared_out = _kimi_decode_inputs(t, dtype, 24)
    outs = []
    for _ in range(2):
        out = poisoned_empty((t, 7168), dtype, "cuda")
        outs.append(fused_moe(x, w, ids, gate, up, down, kind="int4_group", block_m=1, gemv=form,
                              shared_out=shared_out, out=out))
    assert_bitwise_equal(outs[0], outs[1], f"{form} twice T={t}")
    planes = fused_moe(x, w, ids, gate, up, down, kind="int4_group", block_m=1, gemv="planes", shared_out=shared_out,
                       **planes_kw)
    ref = fused_moe_reference(x, w, ids, gate, up, down, kind="int4_group", shared_out=shared_out)
    assert_rel_close(outs[0].float(), ref.float(), 1e-2, f"{form} vs reference T={t} {dtype}")
    assert_rel_close(outs[0].float(), planes.float(), 1e-2, f"{form} vs planes T={t} {dtype}")


# --- int4_tile="fragments": moe_align's blocks as the MMA's token columns (fused_moe/fragments.py) ---

# (hidden, inter, dtype, tokens, top_k, block_m, shared): K whole and ragged against BK 128 (160, 96), rows ragged
# against the interpreted 32-row tile, fp16, one and two token tiles; token 0 loses a slot, and tokens 1.. all take
# expert 0 in their first slot, so expert 0 holds more rows than one block (several blocks of one expert)
FRAG_BLOCK_CASES = [(128, 96, torch.bfloat16, 11, 3, 8, True), (160, 64, torch.float16, 18, 1, 16, False),
                    (64, 160, torch.bfloat16, 12, 2, 8, True)]


@pytest.mark.parametrize("hidden,inter,dtype,tokens,top_k,block_m,shared", FRAG_BLOCK_CASES)
def test_fragment_blocks_match_reference(triton_backend, monkeypatch, hidden, inter, dtype, tokens, top_k, block_m,
                                         shared):
    dev, e = triton_backend, 4
    gate, up, down = _frag_experts(e, hidden, inter, 32, dtype, dev, seed=hidden + inter)
    x = torch.randn(tokens, hidden, device=dev).to(dtype)
    w, ids = routing(tokens, e, top_k, seed=hidden, device=dev)
    for i in range(1, tokens):  # expert 0 first, then distinct others
        ids[i] = torch.tensor([0] + [1 + (i + j) % (e - 1) for j in range(top_k - 1)], dtype=ids.dtype)
    ids[0, -1] = -1
    assert int((ids == 0).sum()) > block_m
    shared_out = torch.randn(tokens, hidden, device=dev).to(dtype) if shared else None
    what = f"fragment blocks H={hidden} I={inter} {dtype} T={tokens} k={top_k} block_m={block_m}"
    _poison_allocations(monkeypatch)   # h, y: read only where written
    outs = []
    for _ in range(2):
        out = poisoned_empty((tokens, hidden), dtype, dev)
        got = fused_moe(x, w, ids, gate, up, down, kind="int4_group", block_m=block_m, int4_tile="fragments",
                        shared_out=shared_out, out=out)
        assert got is out
        outs.append(got)
    assert_bitwise_equal(outs[0], outs[1], f"{what}: twice")
    cpu = lambda d: {kk: v.cpu() for kk, v in d.items()}  # noqa: E731
    ref = fused_moe_reference(x.cpu(), w.cpu(), ids.cpu(), cpu(gate), cpu(up), cpu(down), kind="int4_group",
                              shared_out=None if shared_out is None else shared_out.cpu())
    assert_rel_close(outs[0].float().cpu(), ref.float(), 2e-2, what)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(t=st.integers(1, 12), e=st.integers(1, 5), k=st.integers(1, 3), block_m=st.sampled_from([8, 16]),
       hidden=st.sampled_from([64, 128]), inter=st.sampled_from([32, 96]), seed=st.integers(0, 2**31 - 1))
def test_hypothesis_fragment_blocks(triton_backend, t, e, k, block_m, hidden, inter, seed):
    """Any token count, experts, top-k and width (multiples of 32): the fragment blocks equal the reference within
    bf16 rounding."""
    k = min(k, e)
    gate, up, down = _frag_experts(e, hidden, inter, 32, torch.bfloat16, triton_backend, seed % 1000)
    x = torch.randn(t, hidden, generator=torch.Generator().manual_seed(seed)).to(triton_backend).to(torch.bfloat16)
    w, ids = routing(t, e, k, seed, device=triton_backend)
    got = fused_moe(x, w, ids, gate, up, down, kind="int4_group", block_m=block_m, int4_tile="fragments")
    cpu = lambda d: {kk: v.cpu() for kk, v in d.items()}  # noqa: E731
    ref = fused_moe_reference(x.cpu(), w.cpu(), ids.cpu(), cpu(gate), cpu(up), cpu(down), kind="int4_group")
    assert_rel_close(got.float().cpu(), ref.float(), 2e-2, f"fragment blocks t={t} e={e} k={k} {hidden}x{inter}")


def test_fragment_blocks_name_what_they_cannot_take(triton_backend):
    dev = triton_backend
    gate, up, down = _frag_experts(3, 128, 64, 32, torch.bfloat16, dev, seed=1)
    w, ids = routing(4, 3, 2, device=dev)
    x = torch.randn(4, 128, device=dev)
    run = lambda xx, block_m=8, **kw: fused_moe(xx, w, ids, gate, up, down, kind="int4_group",  # noqa: E731
                                                block_m=block_m, int4_tile="fragments", **kw)
    with pytest.raises(ValueError, match="fragments.*bf16 / fp16"):
        run(x)
    with pytest.raises(ValueError, match="fragments.*weight_scale.*float16"):
        run(x.to(torch.float16))
    with pytest.raises(ValueError, match="fragments.*block_m 64"):
        run(x.to(torch.bfloat16), block_m=64)
    with pytest.raises(ValueError, match="block_m: 8 "):
        fused_moe(x.to(torch.bfloat16), w, ids, gate, up, down, kind="int4_group", block_m=8, int4_tile="planes")


def test_frag_block_m_follows_choose_block_m():
    from mla_quant.kernels.fused_moe import frag_block_m

    assert frag_block_m(8, 384) == 1 == choose_block_m(8, 384)          # decode: the GEMV
    assert frag_block_m(672, 384) == 1 == choose_block_m(672, 384)
    assert frag_block_m(768, 384) == 16 and frag_block_m(8192, 384) == 16


def test_auto_tile_takes_fragment_blocks_only_where_they_apply(triton_backend, monkeypatch):
    """int4_tile="auto": the fragment blocks with block_m None between the GEMV's switch and FRAG_AUTO_MAX_ROWS rows
    per expert, for operands they take; the plane tile (or the GEMV) otherwise — decided before any kernel runs."""
    from mla_quant.kernels import fused_moe as F

    taken = []

    class Taken(Exception):
        pass

    def spy(*args):
        taken.append(args[7])  # block_m
        raise Taken

    monkeypatch.setattr(F, "_fused_moe_frag_blocks", spy)
    e, k = 4, 2
    gate, up, down = _frag_experts(e, 64, 32, 32, torch.bfloat16, triton_backend, seed=2)
    tokens = 6  # 3 rows per expert: past the GEMV's 1.75, within FRAG_AUTO_MAX_ROWS
    w, ids = routing(tokens, e, k, device=triton_backend)
    x = torch.randn(tokens, 64, device=triton_backend)
    with pytest.raises(Taken):
        fused_moe(x.to(torch.bfloat16), w, ids, gate, up, down, kind="int4_group")
    assert taken == [16]
    fused_moe(x, w, ids, gate, up, down, kind="int4_group")                      # fp32 x: the plane tile
    fused_moe(x.to(torch.bfloat16), w, ids, gate, up, down, kind="int4_group", block_m=16)   # block_m given
    fused_moe(x.to(torch.bfloat16)[:1], w[:1], ids[:1], gate, up, down, kind="int4_group")  # one token: the GEMV
    assert taken == [16]


@pytest.mark.gpu
@pytest.mark.parametrize("t,block_m", [(16, 8), (64, 8), (64, 16), (256, None)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_fragment_blocks_real_widths(t, block_m, dtype):
    """Kimi's widths (24 experts, top-8: several blocks per expert), the shared output and dropped slots, compiled
    (the PTX bit tricks and the MMAs on 8 / 16 token columns): into poisoned outputs twice (bitwise the same), against
    the reference and the plane tile."""
    gate, up, down = _frag_experts(24, 7168, 2048, 32, dtype, "cuda", seed=7)
    x, w, ids, shared_out = _kimi_decode_inputs(t, dtype, 24)
    outs = []
    for _ in range(2):
        out = poisoned_empty((t, 7168), dtype, "cuda")
        outs.append(fused_moe(x, w, ids, gate, up, down, kind="int4_group", block_m=block_m, int4_tile="fragments",
                              shared_out=shared_out, out=out))
    what = f"fragment blocks T={t} block_m={block_m} {dtype}"
    assert_bitwise_equal(outs[0], outs[1], f"{what}: twice")
    ref = fused_moe_reference(x, w, ids, gate, up, down, kind="int4_group", shared_out=shared_out)
    tile = fused_moe(x, w, ids, gate, up, down, kind="int4_group", block_m=16, int4_tile="planes",
                     shared_out=shared_out)
    assert_rel_close(outs[0].float(), ref.float(), 1e-2, f"{what} vs reference")
    assert_rel_close(outs[0].float(), tile.float(), 1e-2, f"{what} vs the plane tile")


# --- gemv="half2": fp16x2 arithmetic on activation pairs (kernels/_half2_gemv.py), bf16 / fp16 activations ---

def test_pair_order_is_the_documented_layout(triton_backend):
    """pairs[r, 128b + 32i + w % 32] = (x[8w + i], x[8w + i + 4]) · 2^-e in fp16 (low lane first), w the word in
    block b, and scales[r, run] = 2^e with the run's largest magnitude · 2^-e in [128, 256), exactly (a layout
    op), for the kernel and the reference; K = 352 (one whole block of 256 and a ragged one), a zero run, and
    runs of very large and very small values."""
    from mla_quant.kernels._half2_gemv import pair_order, pair_order_reference

    a = torch.randn(3, 352)
    a[0, 32:64] = 0.0
    a[1, 64:96] *= 2.0**60
    a[2, 96:128] *= 2.0**-60
    a = a.to(torch.bfloat16)
    pairs, scales = (t.cpu() for t in pair_order(a.to(triton_backend)))
    assert pairs.shape == (3, 256) and scales.shape == (3, 16)
    want_s = torch.zeros(3, 16)
    want = torch.zeros(3, 256, dtype=torch.int32)
    for r in range(3):
        for run in range(16):
            m = a[r, 32 * run:32 * run + 32].float().abs().max().item() if run < 11 else 0.0
            e = max(min(math.frexp(m)[1] - 1 - 7, 121), -126) if m > 0 else -126
            want_s[r, run] = 2.0**e
        for w in range(32 * 2):
            for i in range(4):
                lanes = [a[r, k].float() / want_s[r, w // 4] if k < 352 else torch.tensor(0.0)
                         for k in (8 * w + i, 8 * w + i + 4)]  # / 2^e: exact
                bits = [int(v.to(torch.float16).view(torch.int16)) & 0xFFFF for v in lanes]
                want[r, 128 * (w // 32) + 32 * i + w % 32] = (bits[0] | (bits[1] << 16)) - ((bits[1] >> 15) << 32)
    assert torch.equal(scales, want_s)
    assert torch.equal(pairs, want)
    ref_pairs, ref_scales = pair_order_reference(a)
    assert torch.equal(ref_pairs, want) and torch.equal(ref_scales, want_s)
    for dtype in (torch.float16, torch.float32):
        got = pair_order(a.to(dtype).to(triton_backend))
        assert all(torch.equal(p.cpu(), q) for p, q in zip(got, pair_order_reference(a.to(dtype))))


# (hidden, intermediate, group, dtype, tokens): K blocks (256 interpreted) whole; ragged last blocks (352, 96);
# groups of 64; fp16; one token (the decode path) and several (the aligned path); the prefetch form (the next K
# block's words one block ahead, the last run re-read past K) on a ragged and a whole-block case
HALF2_CASES = [(512, 256, 32, torch.bfloat16, 1, "half2"), (352, 96, 32, torch.bfloat16, 2, "half2"),
               (384, 256, 64, torch.float16, 1, "half2"), (160, 128, 32, torch.float16, 3, "half2"),
               (352, 96, 32, torch.bfloat16, 2, "half2_prefetch"), (768, 256, 32, torch.float16, 1, "half2_prefetch")]


@pytest.mark.parametrize("hidden,inter,group,dtype,tokens,form", HALF2_CASES)
def test_half2_gemv_matches_reference_and_the_plane_gemv(triton_backend, monkeypatch, hidden, inter, group, dtype,
                                                         tokens, form):
    """Interpreted, run_dot sums the same fp16 activation lanes in fp32, so the form equals the plane GEMV up to
    summation order (the GPU's fp16 chains are checked bit for bit by test_gpu_half2_run_dot_is_its_reference)."""
    dev = triton_backend
    gate, up, down = experts("int4_group", 3, hidden, inter, seed=11, group_size=group, device=dev)
    x = torch.randn(tokens, hidden, device=dev).to(dtype)
    w, ids = routing(tokens, 3, 2, seed=11, device=dev)
    ids[-1, 1] = -1  # a dropped slot
    shared_out = torch.randn(tokens, hidden, device=dev).to(dtype)
    planes = fused_moe(x, w, ids, gate, up, down, kind="int4_group", group_size=group, block_m=1, gemv="planes",
                       shared_out=shared_out)
    _poison_allocations(monkeypatch)  # h, its run scales: read only where written
    out = poisoned_empty((tokens, hidden), dtype, dev)
    got = fused_moe(x, w, ids, gate, up, down, kind="int4_group", group_size=group, block_m=1, gemv=form,
                    shared_out=shared_out, out=out)
    assert got is out
    what = f"{form} H={hidden} I={inter} g{group} {dtype} T={tokens}"
    assert_rel_close(got.float().cpu(), planes.float().cpu(), 2e-3, f"{what} vs the plane GEMV")
    cpu = lambda d: {kk: v.cpu() for kk, v in d.items()}  # noqa: E731
    ref = fused_moe_reference(x.cpu(), w.cpu(), ids.cpu(), cpu(gate), cpu(up), cpu(down), kind="int4_group",
                              group_size=group, shared_out=shared_out.cpu())
    assert_rel_close(got.float().cpu(), ref.float(), 2e-2, what)


def test_half2_gemv_names_what_it_cannot_take(triton_backend):
    dev = triton_backend
    gate, up, down = experts("int4_group", 3, 128, 64, seed=1, device=dev)
    w, ids = routing(1, 3, 2, device=dev)
    with pytest.raises(ValueError, match="half2.*float32.*bf16 / fp16"):
        fused_moe(torch.randn(1, 128, device=dev), w, ids, gate, up, down, kind="int4_group", block_m=1,
                  gemv="half2")


def _run_lanes(pairs_row: torch.Tensor, runs: int) -> torch.Tensor:
    """A pair-order row's 16 pairs of each of its first ``runs`` runs, [runs, 16] (pair plane i of word u at 4i + u),
    as run_dot and run_dot_reference take them."""
    r, j = torch.arange(runs)[:, None], torch.arange(16)
    return pairs_row[128 * (r // 8) + 4 * (r % 8) + 32 * (j // 4) + j % 4]


@pytest.mark.gpu
def test_gpu_half2_run_dot_is_its_reference():
    """The inline-PTX block of one run (run_dot) on random words and activation pairs equals its numpy emulation
    (run_dot_reference: every fp16 fma rounded once) bit for bit, including runs of the largest pair values."""
    import triton
    import triton.language as tl

    from mla_quant.kernels._gemm_utils import four_words
    from mla_quant.kernels._half2_gemv import load_pairs, pair_offsets, pair_order_reference, run_dot, \
        run_dot_reference

    @triton.jit
    def probe(w_ptr, x_ptr, out_ptr, R: tl.constexpr):
        run = tl.arange(0, R)
        tl.store(out_ptr + run, run_dot(four_words(w_ptr + 4 * run, False), load_pairs(x_ptr + pair_offsets(run),
                                                                                        False), False))

    runs = 256
    g = torch.Generator().manual_seed(3)
    words = torch.randint(-2**31, 2**31 - 1, (runs * 4,), generator=g, dtype=torch.int32)
    words[:16] = 0  # all codes -8 in the first runs: the largest partial sums
    x = torch.randn(1, 32 * runs, generator=g).to(torch.bfloat16)
    pairs, _ = pair_order_reference(x)
    out = torch.full((runs,), float("nan"), device="cuda")
    probe[(1,)](words.cuda(), pairs.cuda(), out, R=runs, num_warps=4)
    assert_bitwise_equal(out.cpu(), run_dot_reference(words.view(runs, 4), _run_lanes(pairs[0], runs)), "run_dot")


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form", ["half2", "half2_prefetch"])
def test_gpu_half2_gemv_real_widths(t, dtype, form, monkeypatch):
    """The half2 forms compiled (the 128-bit loads, the fp16x2 PTX, h pair-ordered between the launches) at Kimi's
    widths: against the reference, the plane GEMV (fp32 products), and itself (bitwise); with HALF2_INLINE_X (x put
    in pair order inside the gate-up) the same bits as through pair_order, at the same tile: the autotuner keys on
    the argument dtypes, so x itself (not its int32 pairs) is tuned afresh, and another K tile sums the runs in
    another order."""
    import mla_quant.kernels.fused_moe as F
    from mla_quant.kernels.fused_moe import kernel as K

    params = experts("int4_group", 24, 7168, 2048, seed=5, device="cuda")
    _assert_gpu_gemv_form(form, params, t, dtype)
    tuned = K.moe_gemv_half2_prefetch_autotuned if form == "half2_prefetch" else K.moe_gemv_half2_autotuned
    monkeypatch.setattr(tuned, "configs", tuned.configs[:1])  # one tile for both calls (the tuner then times none)
    x = torch.randn(t, 7168, device="cuda").to(dtype)
    w, ids = routing(t, 24, 8, seed=6, device="cuda")
    call = lambda: fused_moe(x, w, ids, params[0], params[1], params[2], kind="int4_group", block_m=1,  # noqa: E731
                             gemv=form)
    want = call()
    monkeypatch.setattr(F, "HALF2_INLINE_X", True)
    assert_bitwise_equal(call(), want, f"{form} t={t}: x in pair order inside the gate-up")


@pytest.mark.parametrize("tokens,fusion", [(1, "auto"), (1, False), (3, "auto")])
def test_half2_prefetch_launch_settings_change_no_bit(triton_backend, monkeypatch, tokens, fusion):
    """half2_prefetch's defaults — WEIGHTS_BEFORE_WAIT (routing and first weights read before the PDL wait, the
    counters zeroed after the gate-up's GEMV, a dropped slot waiting on its own path) and PAIRS_IN_GATE_UP (the
    gate-up's epilogue writes h in pair order: no pair_order launch between the GEMVs) and HALF2_STREAM_WEIGHTS (the
    weights loaded without L1 lines) — and HALF2_INLINE_X (the gate-up puts x in pair order itself) give the bits of
    the launches without them, under poisoned allocations (h's pair padding is never read), on the decode path
    (dropped slots) and the aligned one. Interpreted the waits return at once: this checks the code order,
    test_pdl.py the ordering on the GPU."""
    import mla_quant.kernels._half2_gemv as H
    import mla_quant.kernels.fused_moe as F
    from mla_quant.kernels.fused_moe import kernel as K

    dev = triton_backend
    gate, up, down = experts("int4_group", 4, 352, 96, seed=17, device=dev)
    x = torch.randn(tokens, 352, device=dev).to(torch.bfloat16)
    w, ids = routing(tokens, 4, 3, seed=17, device=dev)
    ids[0, 1] = -1
    shared_out = torch.randn(tokens, 352, device=dev).to(torch.bfloat16)
    seen, pair_orders = [], []
    pair_order = H.pair_order
    monkeypatch.setattr(H, "pair_order", lambda a, **kw: pair_orders.append(a.shape) or pair_order(a, **kw))
    if dev == "cpu":  # the interpreted launch: record what each GEMV launch was told
        launch = K._moe_gemm_kernel

        class Spy:
            def __getitem__(self, grid):
                def run(*args, **kw):
                    seen.append((kw["WEIGHTS_FIRST"], kw.get("PAIRS_OUT", False), kw["STREAM"],
                                 kw.get("INLINE_X", False)))
                    return launch[grid](*args, **kw)
                return run
        monkeypatch.setattr(K, "_moe_gemm_kernel", Spy())
    _poison_allocations(monkeypatch)
    outs = {}
    for early, pairs, stream, inline in ((("gate_up", "down"), True, False, False), (("down",), True, False, False),
                                         ((), True, False, False), (("gate_up", "down"), False, False, False),
                                         ((), False, False, False), (("gate_up", "down"), True, True, False),
                                         (("gate_up", "down"), True, False, True), ((), False, False, True)):
        monkeypatch.setattr(F, "WEIGHTS_BEFORE_WAIT", early)
        monkeypatch.setattr(F, "PAIRS_IN_GATE_UP", pairs)
        monkeypatch.setattr(F, "HALF2_STREAM_WEIGHTS", stream)
        monkeypatch.setattr(F, "HALF2_INLINE_X", inline)
        seen.clear(), pair_orders.clear()
        outs[early, pairs, stream, inline] = fused_moe(x, w, ids, gate, up, down, kind="int4_group", block_m=1,
                                                       gemv="half2_prefetch", decode_fusion=fusion,
                                                       shared_out=shared_out, out=poisoned_empty(x.shape, x.dtype, dev))
        # x's pair_order launch unless the gate-up reads x itself; h's unless the gate-up writes h in pair order
        assert len(pair_orders) == (not inline) + (not pairs), (early, pairs, inline)
        if dev == "cpu":  # reading x itself, the gate-up reads its routing only after its wait
            assert seen == [("gate_up" in early and not inline, pairs, stream, inline),
                            ("down" in early, False, stream, False)], (early, pairs, inline)
    plain = outs[(), False, False, False]
    for setting, got in outs.items():
        assert_bitwise_equal(got, plain, "(WEIGHTS_BEFORE_WAIT, PAIRS_IN_GATE_UP, HALF2_STREAM_WEIGHTS, "
                                         f"HALF2_INLINE_X) = {setting}")
    cpu = lambda d: {kk: v.cpu() for kk, v in d.items()}  # noqa: E731
    ref = fused_moe_reference(x.cpu(), w.cpu(), ids.cpu(), cpu(gate), cpu(up), cpu(down), kind="int4_group",
                              shared_out=shared_out.cpu())
    assert_rel_close(plain.float().cpu(), ref.float(), 2e-2, "vs reference")


def test_half2_run_dot_reference_is_within_its_fp16_bound():
    """The emulated fp16 chains (run_dot_reference) stay within the bound docs/moe.md states: each of a lane's
    16 fp16 roundings errs by at most half an fp16 ulp of that partial sum (below 2^15), so a run's error is at
    most 2 · 16 · 2^-11 · 2^15 / 2 in the worst case and about 2^-11 of the run's magnitudes in practice."""
    from mla_quant.kernels._half2_gemv import pair_order_reference, run_dot_reference

    runs = 512
    g = torch.Generator().manual_seed(5)
    words = torch.randint(-2**31, 2**31 - 1, (runs, 4), generator=g, dtype=torch.int32)
    x = torch.randn(1, 32 * runs, generator=g).to(torch.bfloat16)
    pairs, _ = pair_order_reference(x)
    lanes = _run_lanes(pairs[0], runs)
    low = (lanes & 0xFFFF).to(torch.int16).view(torch.float16).double()
    high = ((lanes >> 16) & 0xFFFF).to(torch.int16).view(torch.float16).double()
    u, i = torch.arange(16) % 4, torch.arange(16) // 4
    w = words.long()[:, u] & 0xFFFFFFFF
    exact = (((w >> 4 * i) & 0xF) - 8.0) * low + (((w >> (4 * i + 16)) & 0xF) - 8.0) * high
    got = run_dot_reference(words, lanes).double()
    err = (got - exact.sum(1)).abs()
    magnitude = exact.abs().sum(1)
    assert err.max() <= 32 * 2.0**-11 * 2**15 / 2
    assert (err / magnitude).median() < 2.0**-11, "typical error"
    assert (err > 0).any(), "fp16 rounding happened (the emulation is not the fp32 sum)"


def test_auto_gemv_takes_the_half2_forms_for_16_bit_activations(triton_backend, monkeypatch):
    """gemv="auto" (the default) runs a half2 form (seen by its pair_order launches: x, then h unless the gate-up
    writes h in pair order) for bf16 / fp16 x — half2_prefetch up to HALF2_PREFETCH_MAX_TOKENS (16), half2 above — and
    the plane GEMV with prefetch for fp32 x; the result equals the explicitly named form's."""
    import mla_quant.kernels._half2_gemv as H
    import mla_quant.kernels.fused_moe as F

    dev = triton_backend
    gate, up, down = experts("int4_group", 3, 256, 64, seed=2, device=dev)
    calls = []
    pair_order = H.pair_order
    monkeypatch.setattr(H, "pair_order", lambda a, **kw: calls.append(a.shape) or pair_order(a, **kw))
    assert F.HALF2_PREFETCH_MAX_TOKENS == 16
    monkeypatch.setattr(F, "HALF2_PREFETCH_MAX_TOKENS", 2)  # the rule at small token counts
    for tokens, dtype, form in ((1, torch.bfloat16, "half2_prefetch"), (2, torch.float16, "half2_prefetch"),
                                (3, torch.bfloat16, "half2"), (4, torch.float16, "half2"),
                                (1, torch.float32, "prefetch"),
                                (2, torch.float32, "prefetch")):
        w, ids = routing(tokens, 3, 2, seed=tokens, device=dev)
        x = torch.randn(tokens, 256, device=dev).to(dtype)
        calls.clear()
        got = fused_moe(x, w, ids, gate, up, down, kind="int4_group", block_m=1)
        # x's pair order always; h's by a launch of its own unless the gate-up writes it (PAIRS_IN_GATE_UP)
        launches = (1 + (form == "half2" or not F.PAIRS_IN_GATE_UP)) if form.startswith("half2") else 0
        assert len(calls) == launches, (tokens, dtype)
        named = fused_moe(x, w, ids, gate, up, down, kind="int4_group", block_m=1, gemv=form)
        assert torch.equal(got, named), (tokens, dtype, form)
