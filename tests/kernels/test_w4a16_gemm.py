"""W4A16 GEMM: the Triton kernel (interpreted on CPU, real on GPU) against its reference, each tile path."""
import itertools

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mla_quant.kernels import int4_quant as I
from mla_quant.kernels._backend import triton_interpreted
from mla_quant.kernels._gemm_utils import int4_codes
from mla_quant.kernels._half2_gemv import inline_pairs, pair_order
from mla_quant.kernels.w4a16_gemm import w4a16_gemm, w4a16_gemm_reference
from mla_quant.kernels.w4a16_gemm.kernel import _half
from mla_quant.testing import assert_bitwise_equal, assert_rel_close, odd_sizes, poisoned_empty, tensors
from tests.conftest import HAS_CUDA
from tests.kernels.test_fused_moe import _run_lanes


def _weights(n, k, group, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    packed, scale = I.int4_quantize_reference(w, group, torch.bfloat16)
    return packed.to(device), scale.to(device)


def _cfg(bm, bn, bk, split=None, group_m=2):
    cfg = {"BM": bm, "BN": bn, "BK": bk, "GROUP_M": group_m, "num_warps": 4, "num_stages": 1}
    if split:
        cfg["SPLIT_K"] = split
    return cfg


# (M, N, K, group, config): one-token GEMV, small-batch mma, tiled; with and without split-K;
# N not a multiple of BN, K not a multiple of BK.
PATHS = [
    (1, 37, 256, 32, _cfg(1, 16, 64, 1)),
    (1, 50, 384, 128, _cfg(1, 32, 128, 3)),
    (5, 33, 256, 64, _cfg(16, 16, 128, 1)),
    (16, 20, 288, 32, _cfg(16, 16, 128, 2)),  # split 1 gets the ragged last K block
    (70, 45, 192, 64, _cfg(32, 32, 128, 1)),
    (63, 17, 512, 32, _cfg(32, 16, 64, 4)),
]


@pytest.mark.parametrize("m,n,k,group,cfg", PATHS, ids=lambda v: str(v) if not isinstance(v, dict) else
                         f"BM{v['BM']}-split{v.get('SPLIT_K')}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_path_matches_reference(triton_backend, m, n, k, group, cfg, dtype):
    dev = triton_backend
    packed, scale = _weights(n, k, group, dev)
    x = torch.randn(m, k, device=dev).to(dtype)
    out = poisoned_empty((m, n), dtype, dev)
    y = w4a16_gemm(x, packed, scale, group, out=out, config=cfg)
    assert y.data_ptr() == out.data_ptr() and y.dtype == dtype
    ref = w4a16_gemm_reference(x, packed, scale, group)
    # fp32: only the summation order differs; bf16: plus the rounding of the output (and the interpreter's casts)
    assert_rel_close(y.float(), ref.float(), 1e-5 if dtype == torch.float32 else 1e-2, f"{m}x{n}x{k} g{group}")


def test_split_k_is_deterministic_and_agrees_with_one_split(triton_backend):
    dev = triton_backend
    packed, scale = _weights(40, 512, 32, dev)
    x = torch.randn(3, 512, device=dev)
    a = w4a16_gemm(x, packed, scale, 32, config=_cfg(16, 16, 128, 4))
    b = w4a16_gemm(x, packed, scale, 32, config=_cfg(16, 16, 128, 4))
    c = w4a16_gemm(x, packed, scale, 32, config=_cfg(16, 16, 128, 1))
    assert_bitwise_equal(a, b, "two split-K runs")
    assert_rel_close(a, c, 1e-6, "split 4 vs split 1")


def test_split_k_counters_are_reset_for_the_next_launch(triton_backend):
    # The last program of a tile resets its arrival counter, so a workspace can be reused (the autotuner
    # launches the same arguments repeatedly).
    from mla_quant.kernels.w4a16_gemm.kernel import _w4a16_gemm_kernel

    dev = triton_backend
    m, n, k, split = 2, 32, 512, 4
    packed, scale = _weights(n, k, 32, dev)
    x = torch.randn(m, k, device=dev)
    part = torch.empty(split, m, n, device=dev)
    count = torch.zeros(2, dtype=torch.int32, device=dev)
    ref = w4a16_gemm_reference(x, packed, scale, 32)
    for _ in range(2):
        y = poisoned_empty((m, n), torch.float32, dev)
        _w4a16_gemm_kernel[(2, split)](x, packed, scale, y, part, count, m, n, k, k, n, m * n, 2, 4, GROUP=32, BM=16,
                                       BN=16, BK=128, SPLIT_K=split, GROUP_M=1, EVEN_K=True,
                                       INTERPRET=not HAS_CUDA, DOT_PRECISION="ieee")
        assert_rel_close(y, ref, 1e-5, "reused workspace")
        assert count.tolist() == [0, 0]


# tl.dot needs a K extent >= 16 on the GPU (the interpreter does not check it): the 16-row tile dots one nibble
# plane, BK/8 long, so it needs BK >= 128. Guarded by the configs, the prune, the launcher and _dot itself.

@pytest.mark.parametrize("fast", [0, 1, 2])
def test_every_autotune_config_gives_tl_dot_a_k_extent_of_16(fast):
    from mla_quant.kernels.w4a16_gemm.kernel import _configs, _prune, dot_k, dot_k_ok

    for cfg in _configs(fast):
        bm, bk = cfg.kwargs["BM"], cfg.kwargs["BK"]
        for group in I.GROUP_SIZES:
            if bk % group == 0:
                assert dot_k_ok(bm, bk, group, fast), (cfg, group, dot_k(bm, bk, group, fast))
    # the prune drops such a config (none above): a 16-row tile with BK = 64 dots 8-long planes
    bad = triton.Config({"BM": 16, "BN": 16, "BK": 64, "GROUP_M": 1}, num_warps=4, num_stages=2)
    assert dot_k(16, 64, 32) == 8 and _prune([bad], {"M_BUCKET": 16, "GROUP": 32}) == []
    assert dot_k(16, 64, 32, fast=1) == 32 and dot_k(1, 64, 32) is None and dot_k(32, 64, 32) == 64


@pytest.mark.parametrize("k", [32, 64, 96])
def test_small_k_selects_legal_dots_and_matches_reference(triton_backend, k):
    from mla_quant.kernels.w4a16_gemm import _interpreter_config
    from mla_quant.kernels.w4a16_gemm.kernel import _configs, _prune, dot_k_ok, split_k

    dev, m, n = triton_backend, 16, 24
    auto = _interpreter_config(m, 32)
    assert dot_k_ok(auto["BM"], auto["BK"], 32)
    for cfg in _prune(_configs(0), {"M_BUCKET": m, "GROUP": 32}):  # the GPU autotuner's choices at 16 tokens
        bm, bn, bk = cfg.kwargs["BM"], cfg.kwargs["BN"], cfg.kwargs["BK"]
        assert bm == 16 and dot_k_ok(bm, bk, 32) and split_k(m, n, k, bm, bn, bk, 132) == 1  # one K block
    packed, scale = _weights(n, k, 32, dev, seed=k)
    x = torch.randn(m, k, device=dev)
    ref = w4a16_gemm_reference(x, packed, scale, 32)
    with pytest.raises(ValueError, match="config: BM=16, BK=64 gives tl.dot a K extent of 8"):
        w4a16_gemm(x, packed, scale, 32, config=_cfg(16, 16, 64, 1))
    for split in (1, 2):  # K < BK: the masked tail; split 2 leaves the second split empty (a zero partial)
        y = w4a16_gemm(x, packed, scale, 32, out=poisoned_empty((m, n), torch.float32, dev),
                       config=_cfg(16, 16, 128, split))
        assert_rel_close(y, ref, 1e-5, f"K={k} split {split}")


def test_kernel_refuses_a_short_dot_at_compile_time(triton_backend):
    # the static_assert in _dot fails under the interpreter as the GPU compiler would
    from mla_quant.kernels.w4a16_gemm.kernel import _w4a16_gemm_kernel

    dev, m, n, k = triton_backend, 2, 16, 64
    packed, scale = _weights(n, k, 32, dev)
    x, y = torch.randn(m, k, device=dev), torch.empty(m, n, device=dev)
    part, count = torch.empty(1, device=dev), torch.zeros(1, dtype=torch.int32, device=dev)
    with pytest.raises(Exception) as info:  # InterpreterError on CPU, CompilationError on the GPU
        _w4a16_gemm_kernel[(1, 1)](x, packed, scale, y, part, count, m, n, k, k, n, m * n, 2, 4, GROUP=32, BM=16,
                                   BN=16, BK=64, SPLIT_K=1, GROUP_M=1, EVEN_K=True,
                                   INTERPRET=not HAS_CUDA, DOT_PRECISION="ieee")
    chain, err = [], info.value  # the compiler names the source line; the assertion's text is in its cause
    while err is not None:
        chain.append(str(err))
        err = err.__cause__
    assert any("K extent < 16" in text for text in chain), chain


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture],  # the fixture only sets the backend
          max_examples=20)
@given(m=odd_sizes(1, 40), n=odd_sizes(1, 70), kg=st.integers(1, 6), group=st.sampled_from([32, 64, 128]),
       seed=st.integers(0, 2**31 - 1))
def test_autoselected_config_matches_reference_over_shapes(triton_backend, m, n, kg, group, seed):
    dev = triton_backend
    k = kg * group
    packed, scale = _weights(n, k, group, dev, seed)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dev)
    y = w4a16_gemm(x, packed, scale, group)
    assert_rel_close(y, w4a16_gemm_reference(x, packed, scale, group), 1e-5)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=8)
@given(x=tensors(st.tuples(st.integers(1, 3), st.integers(1, 5), st.just(128)), dtype=torch.float32))
def test_leading_dimensions_and_outlier_activations(triton_backend, x):
    packed, scale = _weights(24, 128, 32, triton_backend)
    x = x.to(triton_backend)
    y = w4a16_gemm(x, packed, scale, 32)
    assert y.shape == (*x.shape[:-1], 24)
    assert_rel_close(y, w4a16_gemm_reference(x, packed, scale, 32), 1e-5)


def test_dispatch_on_cpu_uses_the_reference(torch_backend):
    packed, scale = _weights(8, 64, 32)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    assert torch.equal(w4a16_gemm(x, packed, scale, 32), w4a16_gemm_reference(x, packed, scale, 32))


def test_reference_is_x_times_dequantized_weight():
    packed, scale = _weights(8, 64, 32)
    x = torch.randn(3, 64)
    w = I.int4_dequantize_reference(packed, scale, 32, torch.float32)
    assert torch.equal(w4a16_gemm_reference(x, packed, scale, 32), x @ w.T)


def test_empty_batch():
    packed, scale = _weights(8, 64, 32)
    assert w4a16_gemm(torch.zeros(0, 64), packed, scale, 32).shape == (0, 8)


def test_bad_inputs_name_the_argument():
    packed, scale = _weights(8, 64, 32)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="x: last dimension 32"):
        w4a16_gemm(torch.randn(2, 32), packed, scale, 32)
    with pytest.raises(TypeError, match="x: dtype torch.int32"):
        w4a16_gemm(x.int(), packed, scale, 32)
    with pytest.raises(TypeError, match="weight_packed: dtype"):
        w4a16_gemm(x, packed.float(), scale, 32)
    with pytest.raises(ValueError, match="weight_scale: shape"):
        w4a16_gemm(x, packed, scale[:, :1].contiguous(), 32)
    with pytest.raises(ValueError, match="group_size: 48"):
        w4a16_gemm(x, packed, scale, 48)
    with pytest.raises(ValueError, match="weight_scale: shape"):
        w4a16_gemm(x, packed, scale, 64)
    with pytest.raises(ValueError, match="out: shape"):
        w4a16_gemm(x, packed, scale, 32, out=torch.empty(2, 9))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 16, 64, 512])
@pytest.mark.parametrize("n,k", [(4096, 7168), (7168, 2048)])
def test_autotuned_kernel_on_real_shapes(m, n, k):
    packed, scale = _weights(n, k, 32, "cuda")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = w4a16_gemm(x, packed, scale, 32)
    assert_rel_close(y.float(), w4a16_gemm_reference(x.float(), packed, scale, 32), 1e-2, f"M={m}")


@pytest.mark.gpu
def test_gpu_bf16_output_rounds_like_the_reference():
    packed, scale = _weights(256, 1024, 32, "cuda")
    x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
    ref = w4a16_gemm_reference(x, packed, scale, 32).float()
    y = w4a16_gemm(x, packed, scale, 32, fast_dequant=0).float()  # dequantizes to bf16 first, as the reference
    assert ((y - ref).abs() <= 2 ** -7 * ref.abs() + 1e-2).all()  # one bf16 ulp plus summation order
    # the default at 8 rows ("auto": FAST_DEQUANT 1) scales each group's dot, so the weight is never rounded to
    # bf16: up to ~0.2 off the reference where outputs cancel, within the fast paths' tolerance
    assert_rel_close(w4a16_gemm(x, packed, scale, 32).float(), ref, 1e-2, "auto at 8 rows")


# --- dequant_gemm: the whole weight dequantized by int4_dequantize, then torch.mm (prefill) ---

@pytest.mark.parametrize("m,n,k,group", [(1, 24, 256, 32), (7, 33, 384, 128), (130, 40, 256, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequant_gemm_matches_reference(triton_backend, m, n, k, group, dtype):
    dev = triton_backend
    packed, scale = _weights(n, k, group, dev, seed=m)
    x = torch.randn(m, k, device=dev).to(dtype)
    out = poisoned_empty((m, n), dtype, dev)
    y = w4a16_gemm(x, packed, scale, group, out=out, dequant_gemm=True)
    assert y.data_ptr() == out.data_ptr() and not y.isnan().any()
    ref = w4a16_gemm_reference(x, packed, scale, group)
    # the weight rounded to x's dtype exactly as the reference rounds it; only the sums' order and rounding differ
    assert_rel_close(y.float(), ref.float(), 1e-5 if dtype == torch.float32 else 1e-2, f"{m}x{n}x{k}")


def test_dequant_gemm_leading_dims_and_strided_rows(triton_backend):
    dev = triton_backend
    packed, scale = _weights(20, 128, 32, dev, seed=3)
    x = torch.randn(2, 3, 160, device=dev)[..., 16:144]  # rows 160 apart, not contiguous
    y = w4a16_gemm(x, packed, scale, 32, dequant_gemm=True)
    assert y.shape == (2, 3, 20)
    assert_rel_close(y, w4a16_gemm_reference(x, packed, scale, 32), 1e-5)


def test_dequant_gemm_auto_rule_and_errors(triton_backend, monkeypatch):
    """"auto" dequantizes first from DEQUANT_GEMM_MIN_M tokens when nothing is pinned; a pinned config or
    fast_dequant level keeps the tiles; impossible combinations name the argument."""
    from mla_quant.kernels import w4a16_gemm as module

    dev = triton_backend
    monkeypatch.setattr(module, "DEQUANT_GEMM_MIN_M", 4)  # keep the interpreter's tiles small
    calls = []
    real = module.int4_dequantize
    monkeypatch.setattr(module, "int4_dequantize", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    packed, scale = _weights(24, 256, 32, dev, seed=2)
    x = torch.randn(4, 256, device=dev)
    ref = w4a16_gemm_reference(x, packed, scale, 32)
    assert_rel_close(w4a16_gemm(x, packed, scale, 32), ref, 1e-5)
    assert calls == [(24, 32)], "4 tokens: dequantized first"
    assert_rel_close(w4a16_gemm(x[:3], packed, scale, 32), ref[:3], 1e-5)
    assert_rel_close(w4a16_gemm(x, packed, scale, 32, dequant_gemm=False), ref, 1e-5)
    assert_rel_close(w4a16_gemm(x, packed, scale, 32, config=_cfg(16, 16, 128)), ref, 1e-5)
    assert_rel_close(w4a16_gemm(x, packed, scale, 32, fast_dequant=1), ref, 1e-2)
    assert len(calls) == 1, "3 tokens, dequant_gemm=False, a pinned config and a fast_dequant level: the tiles"
    with pytest.raises(ValueError, match="dequant_gemm: 'yes'"):
        w4a16_gemm(x, packed, scale, 32, dequant_gemm="yes")
    with pytest.raises(ValueError, match="dequant_gemm=True with a pinned config"):
        w4a16_gemm(x, packed, scale, 32, dequant_gemm=True, config=_cfg(16, 16, 128))
    with pytest.raises(ValueError, match="pick one path"):
        w4a16_gemm(x.bfloat16(), packed, scale, 32, dequant_gemm=True, fragments=True)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [128, 512, 2048])
@pytest.mark.parametrize("n,k", [(18432, 7168), (7168, 18432), (576, 7168)])
def test_gpu_dequant_gemm_real_shapes(m, n, k):
    """Prefill shapes: "auto" dequantizes first (the same bits as dequant_gemm=True), within a bf16 ulp plus the sums'
    order of the reference and of the tile that dequantizes in its main loop."""
    packed, scale = _weights(n, k, 32, "cuda")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = w4a16_gemm(x, packed, scale, 32)
    assert torch.equal(y, w4a16_gemm(x, packed, scale, 32, dequant_gemm=True))
    assert_rel_close(y.float(), w4a16_gemm_reference(x.float(), packed, scale, 32), 1e-2, f"M={m} {n}x{k}")
    assert_rel_close(y.float(), w4a16_gemm(x, packed, scale, 32, dequant_gemm=False).float(), 1e-2, "vs the tile")


# --- FAST_DEQUANT (fast_dequant=True): codes from 16-bit lanes, the group scale applied to each group's dot ---

def test_bf16_magic_number_gives_every_code_exactly():
    # The bit trick itself, in torch: bf16 bits 0x4300 | n are 128 + n, and 128 + n - 136 = n - 8 exactly.
    n = torch.arange(16, dtype=torch.int32)
    for magic, offset, dtype in ((0x4300, 136.0, torch.bfloat16), (0x6400, 1032.0, torch.float16)):
        lanes = (n | magic).to(torch.int16).view(dtype)
        assert torch.equal(lanes.float(), (n + offset - 8).float())
        assert torch.equal((lanes - offset).float(), (n - 8).float())  # the subtraction in the 16-bit type


@triton.jit
def _unpack_codes(w_ptr, o_ptr, INTERPRET: tl.constexpr):
    words = tl.load(w_ptr + tl.arange(0, 2))
    nib = (words[:, None] >> (tl.arange(0, 8) * 4)[None, :]) & 0xF  # [2, 8]: element 8w + i
    q = int4_codes(nib, o_ptr.dtype.element_ty, INTERPRET, False)
    tl.store(o_ptr + tl.arange(0, 16), tl.reshape(q, (16,)).to(o_ptr.dtype.element_ty))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int4_codes_kernel_is_exact_for_all_nibbles(triton_backend, dtype):
    # on the GPU this runs the bf16 bitcast path (under the interpreter, bf16 takes the fp32 form)
    words = torch.tensor([0x76543210, 0xFEDCBA98 - 2**32], dtype=torch.int32, device=triton_backend)
    out = poisoned_empty((16,), dtype, triton_backend)
    _unpack_codes[(1,)](words, out, INTERPRET=triton_interpreted())
    assert torch.equal(out.float().cpu(), torch.arange(16, dtype=torch.float32) - 8)


# M=1 on the 16-row tensor-core tile, ragged K with split-K, group 128, the tiled path with ragged N and K.
FAST_PATHS = [
    (1, 37, 256, 32, _cfg(16, 16, 64, 1)),
    (1, 50, 384, 128, _cfg(16, 32, 128, 3)),
    (5, 33, 288, 32, _cfg(16, 16, 128, 2)),
    (40, 45, 192, 64, _cfg(32, 32, 128, 1)),
]


@pytest.mark.parametrize("m,n,k,group,cfg", FAST_PATHS, ids=lambda v: str(v) if not isinstance(v, dict) else
                         f"BM{v['BM']}-split{v.get('SPLIT_K')}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("level", [1, 2])
def test_fast_dequant_paths_match_reference(triton_backend, m, n, k, group, cfg, dtype, level):
    dev = triton_backend
    packed, scale = _weights(n, k, group, dev, seed=m + n)
    x = torch.randn(m, k, device=dev).to(dtype)
    x[0, :group] *= 100  # an outlier group: level 2 subtracts 136 · Σx from each group's partial
    out = poisoned_empty((m, n), dtype, dev)
    y = w4a16_gemm(x, packed, scale, group, out=out, config={**cfg, "FAST_DEQUANT": level})
    ref = w4a16_gemm_reference(x, packed, scale, group)
    # fp32: the same products, summed per group then scaled; 16-bit: the weight is not rounded to x.dtype
    # before the product (the reference rounds it) — within the default path's tolerance
    assert_rel_close(y.float(), ref.float(), 1e-5 if dtype == torch.float32 else 1e-2, f"{m}x{n}x{k} g{group}")
    if dtype == torch.float16:  # no interpreter rounding issue in fp16: level 2 equals level 1 to fp32 rounding
        other = w4a16_gemm(x, packed, scale, group, config={**cfg, "FAST_DEQUANT": 3 - level})
        assert_rel_close(y.float(), other.float(), 2e-3, "level 1 vs 2")


@pytest.mark.parametrize("m", [1, 6])
@pytest.mark.parametrize("level", [True, 2])
def test_fast_dequant_keyword_selects_the_fast_path(triton_backend, m, level):
    dev = triton_backend
    packed, scale = _weights(24, 160, 32, dev, seed=m)
    x = torch.randn(m, 160, device=dev)
    fast = w4a16_gemm(x, packed, scale, 32, fast_dequant=level)
    assert_rel_close(fast, w4a16_gemm_reference(x, packed, scale, 32), 1e-5, "fast_dequant=True")
    assert_rel_close(fast, w4a16_gemm(x, packed, scale, 32), 1e-5, "fast vs default")


def test_fast_dequant_auto_takes_level_1_for_a_few_tokens(triton_backend):
    """"auto": FAST_DEQUANT 1 for 2..FAST_AUTO_MAX_M tokens (bit-equal to fast_dequant=1 there), off at one token
    and above, and off whenever a config is pinned."""
    from mla_quant.kernels.w4a16_gemm import FAST_AUTO_MAX_M

    dev = triton_backend
    packed, scale = _weights(24, 160, 32, dev, seed=5)
    for m, level in ((1, 0), (2, 1), (FAST_AUTO_MAX_M, 1), (FAST_AUTO_MAX_M + 1, 0)):
        x = torch.randn(m, 160, device=dev)
        assert torch.equal(w4a16_gemm(x, packed, scale, 32), w4a16_gemm(x, packed, scale, 32, fast_dequant=level)), m
    x = torch.randn(6, 160, device=dev)
    cfg = _cfg(16, 16, 128)
    assert torch.equal(w4a16_gemm(x, packed, scale, 32, config=cfg),
                       w4a16_gemm(x, packed, scale, 32, config=cfg, fast_dequant=0))
    assert not torch.equal(w4a16_gemm(x, packed, scale, 32, fast_dequant=0),
                           w4a16_gemm(x, packed, scale, 32, fast_dequant=1)), "the two paths must differ here"


def test_fast_configs_are_separate_from_the_default_ones():
    from mla_quant.kernels.w4a16_gemm.kernel import _configs, _prune

    def kept(fast, bucket):
        return {(c.kwargs["BM"], c.kwargs.get("FAST_DEQUANT", False))
                for c in _prune(_configs(fast), {"M_BUCKET": bucket, "GROUP": 32})}

    assert kept(False, 1) == {(1, False)}  # the default one-token choice is unchanged: GEMV only
    assert kept(True, 1) == {(1, True), (16, True)}  # fast: GEMV or the 16-row tensor-core tile
    assert kept(True, 16) == {(16, True)} and kept(False, 16) == {(16, False)}
    assert kept(2, 1) == {(1, 2), (16, 2)}
    with pytest.raises(ValueError, match="fast_dequant"):
        w4a16_gemm(torch.randn(1, 64), *_weights(8, 64, 32), 32, fast_dequant=3)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 16, 64, 512])
@pytest.mark.parametrize("n,k", [(2048, 7168), (7168, 2048)])
@pytest.mark.parametrize("level", [1, 2])
def test_fast_dequant_autotuned_on_real_shapes(m, n, k, level):
    packed, scale = _weights(n, k, 32, "cuda")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = w4a16_gemm(x, packed, scale, 32, fast_dequant=level)
    assert_rel_close(y.float(), w4a16_gemm_reference(x.float(), packed, scale, 32), 1e-2, f"M={m}")
    assert_rel_close(y.float(), w4a16_gemm(x, packed, scale, 32).float(), 1e-2, f"fast vs default M={m}")


def _every_nibble_case(seed: int, dev) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [1, 256], packed int32 [8, 32], scale bf16 [8, 8] (group 32): word j holds nibble (j + i) % 16 at position
    i, rows rotate the words; power-of-two scales and signed activations keep every partial sum exact in fp32."""
    j = torch.arange(16)
    nib = (j[:, None] + torch.arange(8)[None, :]) % 16  # [16 words, 8 positions]
    word = (nib << (4 * torch.arange(8))).sum(1).to(torch.int64)
    word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
    packed = torch.stack([word.repeat(2).roll(r) for r in range(8)]).to(dev)  # [8 rows, 32 words]: K = 256
    g = torch.Generator().manual_seed(seed)
    scale = (2.0 ** torch.randint(-2, 3, (8, 8), generator=g)).to(torch.bfloat16).to(dev)
    sign = torch.where(torch.rand(1, 256, generator=g) < 0.5, -1.0, 1.0)
    x = (2.0 ** torch.randint(-2, 3, (1, 256), generator=g) * sign).to(dev)
    return x, packed, scale


# --- the one-token plane GEMV in two launches (gemv="planes": plane_order, then the GEMV) ---

@pytest.mark.parametrize("n,k,group,cfg", [
    (37, 256, 32, _cfg(1, 16, 256, 1)),    # ragged N, one whole K block
    (50, 384, 128, _cfg(1, 32, 256, 2)),   # K = 3 groups of 128, split-K 2, a ragged (half) last K block
    (20, 288, 32, _cfg(1, 16, 256, 1)),    # a ragged last K block of one group
    (64, 1024, 64, _cfg(1, 64, 512, 1)),   # two whole K blocks of two plane blocks each
], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plane_gemv_matches_reference_and_the_tile_gemv(triton_backend, n, k, group, cfg, dtype):
    dev = triton_backend
    packed, scale = _weights(n, k, group, dev, seed=n)
    x = torch.randn(1, k, device=dev).to(dtype)
    out = poisoned_empty((1, n), dtype, dev)
    y = w4a16_gemm(x, packed, scale, group, out=out, config=cfg, gemv="planes")
    assert y.data_ptr() == out.data_ptr()
    tile = w4a16_gemm(x, packed, scale, group, config=cfg, gemv="tile")
    ref = w4a16_gemm_reference(x, packed, scale, group)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert_rel_close(y.float(), ref.float(), tol, f"planes {n}x{k} g{group}")
    assert_rel_close(y.float(), tile.float(), tol, f"planes vs tile {n}x{k} g{group}")


def test_plane_gemv_is_exact_for_every_nibble_at_every_position(triton_backend):
    """Word j holds nibble (j + i) % 16 at position i: every code at every position (the in-place AND-OR and
    the 16^-j folding of nibbles 0-4 and 5-7); power-of-two scales and activations keep every sum exact."""
    dev = triton_backend
    x, packed, scale = _every_nibble_case(0, dev)
    y = w4a16_gemm(x, packed, scale, 32, config=_cfg(1, 16, 256, 1), gemv="planes")
    assert torch.equal(y.cpu(), w4a16_gemm_reference(x, packed, scale, 32).cpu())


def test_plane_gemv_tiles_keep_the_activation_in_the_word_layout():
    from mla_quant.kernels.w4a16_gemm.kernel import _configs, _prune, planes_tile_ok

    assert planes_tile_ok(512, 4) and not planes_tile_ok(1024, 4) and planes_tile_ok(1024, 8)
    assert not planes_tile_ok(128, 4) and not planes_tile_ok(384, 4)  # whole plane blocks of 256 only
    kept = _prune(_configs(0), {"M_BUCKET": 1, "GROUP": 32}, PLANES=True)
    assert kept and all(planes_tile_ok(c.kwargs["BK"], c.num_warps) for c in kept)
    with pytest.raises(ValueError, match="gemv"):
        w4a16_gemm(torch.randn(1, 64), *_weights(8, 64, 32), 32, gemv="plane")


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(4096, 7168), (7168, 2048), (7168, 18432)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_plane_gemv_real_shapes(n, k, dtype):
    """Every K block whole (the compiled inline-asm path); against the reference and the previous GEMV."""
    packed, scale = _weights(n, k, 32, "cuda")
    x = torch.randn(1, k, device="cuda", dtype=dtype)
    y = w4a16_gemm(x, packed, scale, 32, gemv="planes")
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    assert_rel_close(y.float(), w4a16_gemm_reference(x.float(), packed, scale, 32).float(), tol, f"{n}x{k}")
    assert_rel_close(y.float(), w4a16_gemm(x, packed, scale, 32, gemv="tile").float(), tol, "planes vs tile")


# --- the one-launch plane GEMV (gemv="planes1", the default at M = 1): x read in place, no plane_order launch ---

@pytest.mark.parametrize("n,k,group,cfg", [
    (37, 256, 32, None),                   # ragged N, the interpreter's config (one whole K block)
    (50, 384, 64, _cfg(1, 16, 128, 3)),    # K = 6 groups of 64 in 3 splits, N ragged
    (20, 288, 32, _cfg(1, 16, 256, 2)),    # a ragged last K block of one group (split 2: K blocks 256 + 32)
    (24, 448, 64, _cfg(1, 32, 256, None)),  # a ragged last block of 3 groups of 64; split from planes1_split
], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_planes1_gemv_matches_reference(triton_backend, n, k, group, cfg, dtype):
    dev = triton_backend
    packed, scale = _weights(n, k, group, dev, seed=n + k)
    x = torch.randn(1, k, device=dev).to(dtype)
    out = poisoned_empty((1, n), dtype, dev)
    y = w4a16_gemm(x, packed, scale, group, out=out, config=cfg, gemv="planes1")
    assert y.data_ptr() == out.data_ptr() and y.dtype == dtype
    ref = w4a16_gemm_reference(x, packed, scale, group)
    assert_rel_close(y.float(), ref.float(), 1e-5 if dtype == torch.float32 else 1e-2, f"planes1 {n}x{k} g{group}")


def test_planes1_gemv_is_exact_for_every_nibble_and_deterministic(triton_backend):
    """As the plane test above: every code at every nibble position, power-of-two scales and activations (every
    sum exact), so the in-place planes (x · 16^-j in registers) must equal the reference bit for bit; split-K
    (4 splits of one 64-K block) sums in a fixed order: two runs are bitwise equal."""
    dev = triton_backend
    x, packed, scale = _every_nibble_case(1, dev)
    ref = w4a16_gemm_reference(x, packed, scale, 32).cpu()
    for cfg in (_cfg(1, 16, 256, 1), _cfg(1, 8, 64, 4)):
        y = w4a16_gemm(x, packed, scale, 32, config=cfg, gemv="planes1")
        assert torch.equal(y.cpu(), ref), cfg
    a, b = (w4a16_gemm(x * 1.1, packed, scale, 32, config=_cfg(1, 8, 64, 4), gemv="planes1") for _ in range(2))
    assert_bitwise_equal(a, b, "two split-K runs")


def test_planes1_grid_keeps_programs_and_bytes_in_flight():
    """The launch plan at M = 1 for real widths on 132 SMs: every split keeps at least one K block, the grid at
    most ~4 programs per SM; every candidate tile is one the in-place activation load suits."""
    from mla_quant.kernels.w4a16_gemm.kernel import PLANES1_TILES, _planes1_configs, _prune, planes1_split

    sms = 132
    for n, k in ((2048, 7168), (4096, 7168), (7168, 7168), (7168, 2048)):
        for bn, bk, _, _ in PLANES1_TILES:
            split = planes1_split(n, k, bn, bk, sms)
            tiles, iters = triton.cdiv(n, bn), triton.cdiv(k, bk)
            assert split <= iters and (split == 1 or tiles * split <= 4 * sms), (n, k, bn, bk, split)
            assert tiles * split * 2 > 4 * sms or split * 2 > iters  # no further doubling fits
    assert planes1_split(2048, 7168, 16, 512, sms) == 4 and planes1_split(7168, 2048, 16, 512, sms) == 1
    for bn, bk, warps, _ in PLANES1_TILES:  # >= 64 B of words per thread and K block
        assert bn * bk // 2 // (32 * warps) >= 64, (bn, bk, warps)
    kept = _prune(_planes1_configs(), {"M_BUCKET": 1, "GROUP": 32}, PLANES1=True, X_VEC=True)
    assert len(kept) == len(PLANES1_TILES)
    strided = _prune(_planes1_configs(), {"M_BUCKET": 1, "GROUP": 128}, PLANES1=True, X_VEC=False)
    assert strided and all(c.kwargs["BK"] // 8 < 32 * c.num_warps for c in strided)  # no BK=1024 with 4 warps
    assert len(strided) == len(PLANES1_TILES) - 2


@triton.jit
def _unpack_lanes(src, lo_ptr, hi_ptr, DT: tl.constexpr):
    v = tl.load(src + tl.arange(0, 64))
    tl.store(lo_ptr + tl.arange(0, 64), _half(v, False, DT))
    tl.store(hi_ptr + tl.arange(0, 64), _half(v, True, DT))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_planes1_half_lanes_unpack_exactly(triton_backend, dtype):
    """The 16-bit lanes of the 128-bit activation loads (kernel._half, compiled only on the GPU path) read back
    every value, the low lane and the high lane of each int32."""
    dev = triton_backend
    a = (torch.randn(128) * 2.0 ** torch.randint(-20, 20, (128,))).to(dtype)
    a[:4] = torch.tensor([0.0, -0.0, 65504.0 if dtype == torch.float16 else 3e38, -1e-7])
    a = a.to(dev)
    lo, hi = (torch.empty(64, device=dev) for _ in range(2))
    _unpack_lanes[(1,)](a.view(torch.int32), lo, hi, DT=tl.bfloat16 if dtype == torch.bfloat16 else tl.float16)
    assert torch.equal(torch.stack([lo, hi], 1).reshape(-1).cpu(), a.float().cpu())  # element 2p low, 2p + 1 high


def test_planes1_with_unaligned_activations(triton_backend):
    """x not 16-byte aligned (a view one element in): no 128-bit activation loads; a pinned tile the strided
    per-plane loads do not suit (BK/8 = 128 threads) runs another GEMV — the result is the same."""
    from mla_quant.kernels.w4a16_gemm.kernel import planes1_tile_ok

    dev = triton_backend
    assert planes1_tile_ok(1024, 4, True) and not planes1_tile_ok(1024, 4, False) and planes1_tile_ok(512, 4, False)
    packed, scale = _weights(40, 1024, 32, dev)
    x = torch.randn(1, 1025, device=dev)[:, 1:]
    assert x.data_ptr() % 16
    ref = w4a16_gemm_reference(x, packed, scale, 32)
    for cfg in (_cfg(1, 16, 1024, 1), _cfg(1, 16, 512, 2)):
        y = w4a16_gemm(x, packed, scale, 32, config=cfg, gemv="planes1")
        assert_rel_close(y, ref, 1e-5, str(cfg))


def test_planes1_at_several_tokens_runs_the_usual_paths(triton_backend):
    dev = triton_backend
    packed, scale = _weights(24, 256, 32, dev)
    x = torch.randn(3, 256, device=dev)
    y = w4a16_gemm(x, packed, scale, 32, gemv="planes1")
    assert_rel_close(y, w4a16_gemm_reference(x, packed, scale, 32), 1e-5, "3 tokens")


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(2048, 7168), (4096, 7168), (7168, 2048)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_planes1_real_shapes(n, k, dtype):
    """Every K block whole (the compiled unmasked path), each autotune candidate's split; against the reference
    and the default plane GEMV."""
    packed, scale = _weights(n, k, 32, "cuda")
    x = torch.randn(1, k, device="cuda", dtype=dtype)
    y = w4a16_gemm(x, packed, scale, 32, gemv="planes1")
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    assert_rel_close(y.float(), w4a16_gemm_reference(x.float(), packed, scale, 32).float(), tol, f"{n}x{k}")
    assert_rel_close(y.float(), w4a16_gemm(x, packed, scale, 32).float(), tol, "planes1 vs planes")
    assert_bitwise_equal(y, w4a16_gemm(x, packed, scale, 32, gemv="planes1"), "deterministic")
    x_odd = torch.cat([x.new_zeros(1, 1), x], 1)[:, 1:]  # not 16-byte aligned: the strided per-plane loads
    assert_rel_close(w4a16_gemm(x_odd, packed, scale, 32, gemv="planes1").float(), y.float(), tol, "strided")


# --- the whole-row one-token GEMV (gemv="rows", what "auto" runs at M = 1 but for long 16-bit rows: gemv.py) ---

@pytest.mark.parametrize("n,k,group,tile", [
    (37, 448, 32, (8, 64, 4, False)),     # 56 words: a masked last chunk of 64; N ragged
    (37, 448, 32, (8, 32, 4, False)),     # seven chunks, each loaded after the previous one's sums, the last masked
    (37, 448, 32, (8, 16, 4, True)),      # pipelined: each chunk loaded before the previous chunk's sums
    (64, 1024, 64, (16, 64, 4, True)),    # whole chunks, group 64 (two runs share a scale)
    (20, 384, 128, (4, 16, 2, False)),    # group 128, 3 chunks of 16 words
    (20, 384, 64, (4, 64, 2, True)),      # pipelined, a masked last chunk
    (9, 256, 32, (32, 32, 4, True)),      # one program wider than N, one chunk: nothing to pipeline
    (37, 448, 32, (8, 0, 4, False)),      # spans 32 + 16 + 8 words, none masked
    (20, 416, 32, (4, 0, 2, False)),      # 52 words: spans 32 + 16 + a masked 4 of 8
    (9, 576, 64, (16, 0, 4, False)),      # 72 words: spans 64 + 8, no third; group 64 across a span's edge
    (7, 1792, 32, (2, 0, 1, False)),      # the rule's one-warp tile: spans 128 + 64 + 32
], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rows_gemv_matches_reference(triton_backend, n, k, group, tile, dtype):
    _check_rows_gemv(triton_backend, n, k, group, tile, dtype, n + k)


def _check_rows_gemv(dev, n: int, k: int, group: int, tile: tuple, dtype, seed: int) -> None:
    """gemv_launch at ``tile`` into a NaN-poisoned y equals the reference (fp32 sums: 1e-5; bf16 / fp16: 1e-2)."""
    from mla_quant.kernels.w4a16_gemm.gemv import gemv_launch

    g = torch.Generator().manual_seed(seed)
    packed, scale = I.int4_quantize_reference(torch.randn(n, k, generator=g), group, dtype)
    packed, scale = packed.to(dev), scale.to(dev)
    x = torch.randn(k, generator=g).to(dtype).to(dev)
    y = poisoned_empty((n,), dtype, dev)
    gemv_launch(x, packed, scale, y, group, tile, interpreted=triton_interpreted())
    ref = w4a16_gemm_reference(x[None], packed, scale, group)[0]
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert_rel_close(y.float(), ref.float(), tol, f"rows {n}x{k} g{group} {tile}")


def test_rows_gemv_is_the_default_exact_for_every_nibble_and_deterministic(triton_backend):
    """Every code at every nibble position with power-of-two scales and activations (every sum exact): the default
    one-token call (the rows GEMV) equals the reference bit for bit, also with prefetch_weights (on the CPU no PDL),
    and repeated calls are bitwise equal (no split-K: one fixed order per output)."""
    dev = triton_backend
    x, packed, scale = _every_nibble_case(2, dev)
    ref = w4a16_gemm_reference(x, packed, scale, 32).cpu()
    assert torch.equal(w4a16_gemm(x, packed, scale, 32).cpu(), ref)
    assert torch.equal(w4a16_gemm(x, packed, scale, 32, gemv="rows", prefetch_weights=True).cpu(), ref)
    xb = (x * 1.1).to(torch.bfloat16)
    a, b = (w4a16_gemm(xb, packed, scale, 32) for _ in range(2))
    assert_bitwise_equal(a, b, "two rows runs")


def test_rows_gemv_strided_and_unaligned_activations(triton_backend):
    """x not 16-byte aligned (a view one element in) and x with leading dimensions [1, 1, K]: the same result."""
    dev = triton_backend
    packed, scale = _weights(40, 512, 32, dev)
    x = torch.randn(1, 513, device=dev)[:, 1:]
    assert x.data_ptr() % 16
    ref = w4a16_gemm_reference(x, packed, scale, 32)
    assert_rel_close(w4a16_gemm(x, packed, scale, 32), ref, 1e-5, "unaligned")
    y = w4a16_gemm(x.contiguous().view(1, 1, 512), packed, scale, 32)
    assert y.shape == (1, 1, 40)
    assert_rel_close(y[0], ref, 1e-5, "leading dims")


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=10, deadline=None)
@given(n=odd_sizes(1, 40), runs=st.integers(1, 40), group=st.sampled_from([32, 64, 128]),
       tile=st.sampled_from([(2, 0, 1, False), (8, 0, 4, False), (4, 0, 2, False), (8, 16, 4, True)]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**31 - 1))
def test_rows_gemv_spans_over_shapes(triton_backend, n, runs, group, tile, dtype, seed):
    """Any N and row length (K = 32 · runs, rounded up to the group): the row in power-of-two spans (BKW 0, the
    default's one-warp form among them) equals the reference, NaN-poisoned outputs overwritten."""
    _check_rows_gemv(triton_backend, n, -(-32 * runs // group) * group, group, tile, dtype, seed)


def test_row_spans():
    """Powers of two, largest first, covering the row; only the last one may pass its end."""
    from mla_quant.kernels.w4a16_gemm.gemv import row_spans

    assert row_spans(896) == (512, 256, 128) and row_spans(2304) == (2048, 256, 0) and row_spans(256) == (256, 0, 0)
    assert row_spans(52) == (32, 16, 4) and row_spans(60) == (32, 16, 16)
    for kw in range(4, 3000, 4):
        spans = [s for s in row_spans(kw) if s]
        assert all(s & (s - 1) == 0 for s in spans) and spans == sorted(spans, reverse=True)
        assert sum(spans[:-1]) < kw <= sum(spans)


def test_rows_gemv_tile_rule():
    """Rows up to 1024 words: one warp, the row in spans, ~64 words per thread (2 rows at K = 7168, 8 at 2048); longer
    rows: pipelined chunks of at most 1024 words (a 4096-word chunk spilled at K = 18432); the interpreter's tile
    pipelines its chunks."""
    from mla_quant.kernels.w4a16_gemm.gemv import gemv_tile

    assert gemv_tile(4096, 7168) == (2, 0, 1, False) and gemv_tile(7168, 2048) == (8, 0, 1, False)
    for n, k in ((2048, 7168), (4096, 7168), (7168, 2048), (7168, 18432), (64, 256), (64, 64)):
        bn, bkw, warps, pipe = gemv_tile(n, k)
        words = triton.next_power_of_2(k // 8)
        if words <= 1024:
            assert bkw == 0 and warps == 1 and bn * words == 2048 or (bn == 1 and words > 2048)
        else:
            assert 0 < bkw <= 1024 and pipe and warps in (2, 4, 8)
    assert gemv_tile(64, 2048, interpreted=True)[3]


# --- the whole-row GEMV in fp16x2 arithmetic (gemv="rows_half2": pair_order, then gemv_half2.py) ---

@pytest.mark.parametrize("n,k,group,tile", [
    (37, 448, 32, (8, 4, 4, True)),       # 14 runs: four pipelined chunks, the last half past K; N ragged
    (37, 448, 32, (8, 16, 4, False)),     # one chunk of 16 runs, two past K
    (20, 384, 128, (4, 8, 2, False)),     # group 128 (four runs share a scale), chunks loaded after the sums
    (64, 1024, 64, (16, 8, 4, True)),     # whole chunks, group 64
    (9, 256, 32, (32, 4, 4, True)),       # one program wider than N
    (24, 96, 32, (8, 2, 2, True)),        # 3 runs: K below one 256-wide pair-order block
    (37, 448, 32, (8, 0, 4, False)),      # spans of 8 + 4 + 2 runs, none past K
    (24, 480, 32, (8, 0, 2, False)),      # 15 runs: spans 8 + 4 + 4, the last one past K by a run
    (9, 576, 64, (2, 0, 1, False)),       # 18 runs: spans 16 + 2 on one warp, group 64
], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rows_half2_gemv_matches_reference_and_the_rows_gemv(triton_backend, n, k, group, tile, dtype):
    """The half2 GEMV on x in pair order matches the reference and the fp32 rows GEMV at bf16 level; on x itself
    (``half2_launch_x``: pair order made in registers) it equals the pair-order launch bit for bit."""
    from mla_quant.kernels.w4a16_gemm.gemv_half2 import half2_launch, half2_launch_x

    dev = triton_backend
    g = torch.Generator().manual_seed(n + k)
    packed, scale = I.int4_quantize_reference(torch.randn(n, k, generator=g), group, dtype)
    packed, scale = packed.to(dev), scale.to(dev)
    x = (torch.randn(k, generator=g) * 3).to(dtype).to(dev)
    pairs, pair_scales = pair_order(x[None])
    y = poisoned_empty((n,), dtype, dev)
    half2_launch(pairs[0], pair_scales[0], packed, scale, y, group, tile, interpreted=triton_interpreted())
    what = f"rows_half2 {n}x{k} g{group} {tile}"
    assert_rel_close(y.float(), w4a16_gemm_reference(x[None], packed, scale, group)[0].float(), 1e-2, what)
    assert_rel_close(y.float(), w4a16_gemm(x[None], packed, scale, group)[0].float(), 1e-2, f"{what} vs rows")
    y_inline = poisoned_empty((n,), dtype, dev)
    half2_launch_x(x, packed, scale, y_inline, group, tile, interpreted=triton_interpreted())
    assert torch.equal(y_inline, y), f"{what}: x in pair order inside the GEMV"


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=10, deadline=None)
@given(n=odd_sizes(1, 40), runs=st.integers(1, 20), group=st.sampled_from([32, 64, 128]),
       tile=st.sampled_from([(8, 4, 4, True), (4, 8, 2, False), (16, 2, 4, True), (2, 16, 1, False),
                             (2, 0, 1, False), (4, 0, 2, False)]),
       dtype=st.sampled_from([torch.bfloat16, torch.float16]), scale_x=st.sampled_from([1e-3, 1.0, 300.0]),
       seed=st.integers(0, 2**31 - 1))
def test_rows_half2_gemv_over_shapes_and_activation_ranges(triton_backend, n, runs, group, tile, dtype, scale_x,
                                                           seed):
    """Any N, any number of runs (K = 32 · runs, rounded up to the group), any tile, activations from 1e-3 to 300:
    the per-run power-of-two scales keep fp16 in range, so the result matches the reference at bf16 level; x put
    in pair order inside the GEMV gives the same bits as the pair-order launch."""
    from mla_quant.kernels.w4a16_gemm.gemv_half2 import half2_launch, half2_launch_x

    dev = triton_backend
    k = -(-32 * runs // group) * group
    g = torch.Generator().manual_seed(seed)
    packed, scale = I.int4_quantize_reference(torch.randn(n, k, generator=g), group, dtype)
    packed, scale = packed.to(dev), scale.to(dev)
    x = (torch.randn(k, generator=g) * scale_x).to(dtype).to(dev)
    pairs, pair_scales = pair_order(x[None])
    y = poisoned_empty((n,), dtype, dev)
    half2_launch(pairs[0], pair_scales[0], packed, scale, y, group, tile, interpreted=triton_interpreted())
    ref = w4a16_gemm_reference(x[None], packed, scale, group)[0].float()
    what = f"rows_half2 {n}x{k} g{group} {tile} x*{scale_x}"
    assert_rel_close(y.float(), ref, 1e-2 if n >= 8 else 1.0, what)
    # per output, against Σ|x·w| (a few outputs can cancel): fp16 sums and the bf16 / fp16 output, both ~2^-9
    w = I.int4_dequantize_reference(packed.cpu(), scale.cpu(), group).float()
    bound = 2.0**-7 * (x.cpu().float().abs() @ w.abs().T)
    assert ((y.cpu().float() - ref.cpu()).abs() <= bound).all(), what
    y_inline = poisoned_empty((n,), dtype, dev)
    half2_launch_x(x, packed, scale, y_inline, group, tile, interpreted=triton_interpreted())
    assert torch.equal(y_inline, y), f"rows_half2 {n}x{k} g{group} {tile} x*{scale_x}: pair order inside the GEMV"


def test_rows_half2_gemv_is_exact_for_every_nibble_and_names_what_it_cannot_take(triton_backend):
    """Every code at every nibble position, power-of-two scales and activations: each fp16 chain's partial sums are
    multiples of 8 below 2^14 (exact in fp16), so the half2 call's fp32 sums are exact and its output equals the
    rows GEMV's bit for bit (the CPU's fp32 lanes too), plain and with prefetch_weights (the reference rounds alike
    on the GPU: test_gpu_rows_half2_gemv_real_shapes; the interpreter rounds fp32 -> bf16 ties its own way); fp32
    activations are refused by name."""
    dev = triton_backend
    x, packed, scale = _every_nibble_case(3, dev)
    xb = x.to(torch.bfloat16)
    rows = w4a16_gemm(xb, packed, scale, 32).cpu()
    assert torch.equal(w4a16_gemm(xb, packed, scale, 32, gemv="rows_half2").cpu(), rows)
    assert torch.equal(w4a16_gemm(xb, packed, scale, 32, gemv="rows_half2", prefetch_weights=True).cpu(), rows)
    with pytest.raises(ValueError, match="rows_half2.*bf16 / fp16.*float32"):
        w4a16_gemm(x, packed, scale, 32, gemv="rows_half2")


def _half2_launches(monkeypatch) -> list:
    """A list that records, for each half2 GEMV launch from here on, whether it read x itself (INLINE_X)."""
    import mla_quant.kernels.w4a16_gemm.gemv_half2 as G

    calls, launch = [], G._launch
    monkeypatch.setattr(G, "_launch", lambda *a: calls.append(a[-1]) or launch(*a))
    return calls


def test_auto_gemv_takes_the_half2_rows_for_long_16_bit_rows(triton_backend, monkeypatch):
    """gemv="auto" (the default) runs the half2 rows GEMV (seen by its launch) for bf16 / fp16 x whose rows hold
    at least HALF2_MIN_ROW_WORDS words, the fp32 rows GEMV otherwise and for fp32 x; each result equals the named
    form's."""
    import mla_quant.kernels.w4a16_gemm as W

    dev = triton_backend
    calls = _half2_launches(monkeypatch)
    assert W.HALF2_MIN_ROW_WORDS == 256
    monkeypatch.setattr(W, "HALF2_MIN_ROW_WORDS", 64)
    for k, dtype, form in ((512, torch.bfloat16, "rows_half2"), (512, torch.float16, "rows_half2"),
                           (256, torch.bfloat16, "rows"), (512, torch.float32, "rows")):
        packed, scale = _weights(24, k, 32, dev)
        x = torch.randn(1, k, device=dev).to(dtype)
        calls.clear()
        got = w4a16_gemm(x, packed, scale, 32)
        assert len(calls) == (1 if form == "rows_half2" else 0), (k, dtype)
        assert torch.equal(got, w4a16_gemm(x, packed, scale, 32, gemv=form)), (k, dtype, form)


def test_rows_half2_puts_aligned_x_in_pair_order_itself(triton_backend, monkeypatch):
    """gemv="rows_half2" reads a 16-byte aligned x as it is (pair order made in the GEMV's registers: no pair_order
    launch) and an unaligned one through pair_order, with the same bits either way — also for runs of zeros, of
    subnormal-range values, and with inf and NaN (NaN where the pair-order path has NaN); ``half2_launch_x`` names
    an x it cannot take."""
    import mla_quant.kernels.w4a16_gemm as W
    import mla_quant.kernels.w4a16_gemm.gemv_half2 as G

    dev = triton_backend
    calls = _half2_launches(monkeypatch)
    n, k = 20, 320
    packed, scale = _weights(n, k, 32, dev)
    for dtype, special in itertools.product((torch.bfloat16, torch.float16), (None, "inf", "nan")):
        buf = torch.randn(k + 8, device=dev).to(dtype)
        buf[32:64] = 0.0                      # a run of zeros
        buf[64:96] *= 1e-6                    # a run far below fp16's normal range before its scale
        if special:
            buf[100] = float(special)
        aligned, unaligned = buf[:k], buf[1:k + 1]
        assert aligned.data_ptr() % 16 == 0 and unaligned.data_ptr() % 16
        for x in (aligned, unaligned, buf[8:k + 8]):
            calls.clear()
            got = w4a16_gemm(x[None], packed, scale, 32, gemv="rows_half2")
            assert calls == [x.data_ptr() % 16 == 0], (dtype, x.data_ptr() % 16)
            with monkeypatch.context() as m:
                m.setattr(W, "HALF2_INLINE_X", False)
                want = w4a16_gemm(x[None], packed, scale, 32, gemv="rows_half2")
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
            assert got.isfinite().all() == (special is None), (dtype, special)
    with pytest.raises(ValueError, match="16-byte aligned"):
        G.half2_launch_x(unaligned, packed, scale, torch.empty(n, dtype=torch.float16, device=dev), 32, (4, 4, 2, True))


@triton.jit
def _inline_pairs_probe(x_ptr, out_ptr, R: tl.constexpr, INTERPRET: tl.constexpr):
    """inline_pairs of runs 0..R-1 of x -> out int32 [R, 17] (16 pairs, then the scale's bits)."""
    run = tl.arange(0, R)[None, :]
    made = inline_pairs(x_ptr, run, INTERPRET)
    for j in tl.static_range(16):
        tl.store(out_ptr + 17 * run + j, made[j])
    tl.store(out_ptr + 17 * run + 16, made[16].to(tl.int32, bitcast=True))


def _pair_order_runs(dtype: torch.dtype, runs: int) -> torch.Tensor:
    """[runs, 32] activations that walk the corners of the run scale: zeros and -0, subnormals of the dtype, runs
    spanning 2^100 (fp16 subnormals and zeros after the scale), the dtype's largest values, inf, NaN."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(runs, 32, generator=g, dtype=torch.float64)
    x *= 2.0 ** (torch.randint(-60, 60, (runs, 1), generator=g) if dtype == torch.bfloat16 else
                 torch.randint(-20, 10, (runs, 1), generator=g))  # a scale per run
    x[1], x[2] = 0.0, -0.0
    tiny, big = (1e-39, 1e37) if dtype == torch.bfloat16 else (2e-7, 1e4)  # subnormal; near the largest finite
    x[3] = torch.randn(32, generator=g, dtype=torch.float64) * tiny
    x[4] = torch.randn(32, generator=g, dtype=torch.float64) * 2.0 ** torch.randint(-100 if dtype == torch.bfloat16
                                                                                      else -30, 1, (32,), generator=g)
    x[5] = torch.randn(32, generator=g, dtype=torch.float64) * big
    x[6, 7], x[7, 3], x[7, 9] = float("inf"), float("-inf"), float("inf")
    x[8, 5], x[9] = float("nan"), float("nan")
    x[10, :31] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_inline_pairs_is_pair_order(triton_backend, dtype):
    """The block that puts a run of x in pair order in registers (inline_pairs; on the GPU one PTX block) makes the
    same pairs and run scale as the pair_order launch, bit for bit, over the corners of the scale (NaN lanes: NaN in
    both)."""
    dev = triton_backend
    runs = 64
    x = _pair_order_runs(dtype, runs).to(dev)
    out = torch.full((runs, 17), -1, dtype=torch.int32, device=dev)
    _inline_pairs_probe[(1,)](x, out, R=runs, INTERPRET=triton_interpreted(), num_warps=4)
    pairs, scales = (t[0].cpu() for t in pair_order(x.view(1, -1)))
    want = torch.cat([_run_lanes(pairs, runs), scales[:runs, None].view(torch.int32)], dim=1)
    out = out.cpu()
    nan = x.isnan().any(dim=1).cpu()
    assert nan.sum() == 2
    assert_bitwise_equal(out[~nan], want[~nan], f"inline_pairs {dtype}")
    got16, want16 = (t[nan, :16].contiguous().view(torch.float16) for t in (out, want))
    torch.testing.assert_close(got16, want16, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(out[nan, 16], want[nan, 16])


def test_rows_half2_tile_rule():
    """One chunk holds at most 256 runs; rows of more chunks pipeline them; the interpreter's tile pipelines; the
    measured picks."""
    from mla_quant.kernels.w4a16_gemm.gemv_half2 import half2_tile

    for n, k in ((2048, 7168), (4096, 7168), (7168, 2048), (7168, 18432), (6144, 12288), (64, 256)):
        bn, br, warps, pipe = half2_tile(n, k)
        assert br <= min(triton.next_power_of_2(k // 32), 256) and bn >= 1 and warps in (2, 4, 8)
        assert pipe or br >= k // 32
    # session 37's picks (H100, the GEMV on x itself with PDL): 224-run rows split by N
    assert half2_tile(2048, 7168) == (8, 256, 4, False) and half2_tile(4096, 7168) == (16, 32, 8, True)
    assert half2_tile(7168, 2048) == (16, 32, 4, True) and half2_tile(7168, 18432) == (32, 32, 8, True)
    assert half2_tile(64, 2048, interpreted=True)[3]


def test_quant_linear_prefetches_only_settled_weights(triton_backend, monkeypatch):
    """QuantLinear lets the one-token GEMV read its weights early only from the second call on the same, unwritten
    weight tensors: a new weight (set_weight) or an in-place write (copy_) makes the next call a plain launch."""
    import mla_quant as mq
    from mla_quant.kernels import w4a16_gemm as W

    seen = []
    real = W.w4a16_gemm

    def spy(*args, prefetch_weights=False, **kw):
        seen.append(prefetch_weights)
        return real(*args, prefetch_weights=prefetch_weights, **kw)

    monkeypatch.setattr("mla_quant.modules.linear.w4a16_gemm", spy)
    dev = triton_backend
    layer = mq.modules.QuantLinear(256, 24, fmt=mq.formats.Int4Group(32), dtype=torch.float32, device=dev)
    layer.set_weight(torch.randn(24, 256))
    x = torch.randn(1, 256, device=dev)
    first = layer(x)
    assert_bitwise_equal(layer(x), first, "the prefetching call")
    layer.set_weight(torch.randn(24, 256))
    layer(x)
    with torch.no_grad():
        layer.weight_scale.mul_(2)
    layer(x)
    layer(x)
    assert seen == [False, True, False, False, True]


def test_caller_counters_are_left_zero_and_reused(triton_backend):
    """counters=: the split-K arrival counters from the caller (no torch.zeros launch per call); every launch
    leaves them zero, so one buffer serves repeated calls; too short, wrong dtype: a clear error."""
    dev = triton_backend
    packed, scale = _weights(40, 512, 32, dev)
    x = torch.randn(1, 512, device=dev)
    ref = w4a16_gemm_reference(x, packed, scale, 32)
    counters = torch.zeros(40, dtype=torch.int32, device=dev)
    for gemv, cfg in (("planes1", _cfg(1, 16, 128, 4)), ("planes1", None), ("planes", _cfg(1, 16, 256, 2))):
        for _ in range(2):
            y = w4a16_gemm(x, packed, scale, 32, config=cfg, gemv=gemv, counters=counters,
                           out=poisoned_empty((1, 40), torch.float32, dev))
            assert_rel_close(y, ref, 1e-5, f"{gemv} {cfg}")
            assert not counters.any()
    with pytest.raises(ValueError, match="counters: 2 entries"):
        w4a16_gemm(x, packed, scale, 32, config=_cfg(1, 16, 128, 4), gemv="planes1",
                   counters=torch.zeros(2, dtype=torch.int32, device=dev))
    with pytest.raises((TypeError, ValueError), match="counters"):
        w4a16_gemm(x, packed, scale, 32, counters=torch.zeros(40, device=dev))


# --- 2-16 tokens: the swapped-operand kernel (swap_ab), weight as the wgmma A operand, one group per pair of dots ---
SWAP_CASES = [(2, 40, 320, 32), (5, 72, 256, 64), (16, 130, 512, 128), (16, 64, 7 * 32, 32)]  # N, K ragged


@pytest.mark.parametrize("m,n,k,group", SWAP_CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_swapped_kernel_matches_reference(triton_backend, m, n, k, group, dtype):
    dev = triton_backend
    packed, scale = _weights(n, k, group, dev, seed=m + n)
    scale = scale.to(dtype)
    x = torch.randn(m, k, device=dev).to(dtype)
    x[-1, -group:] *= 50  # an outlier group in the last (possibly ragged) K block
    out = poisoned_empty((m, n), dtype, dev)
    y = w4a16_gemm(x, packed, scale, group, out=out, swap_ab=True)
    ref = w4a16_gemm_reference(x, packed, scale, group)
    # the group scale multiplies the fp32 partial (the reference rounds each weight to x.dtype first): as FAST_DEQUANT
    assert_rel_close(y.float(), ref.float(), 1e-2, f"{m}x{n}x{k} g{group}")
    assert_rel_close(y.float(), w4a16_gemm(x, packed, scale, group, fast_dequant=1).float(), 1e-2, "vs FAST_DEQUANT 1")


def test_swapped_kernel_strided_and_batched_activations(triton_backend):
    """Rows of x with a stride past K (a column slice of a wider tensor), leading dimensions, and one token under
    swap_ab=True: the same result as contiguous rows of the same values."""
    dev = triton_backend
    packed, scale = _weights(40, 256, 32, dev, seed=3)
    wide = torch.randn(6, 256 + 64, device=dev).to(torch.bfloat16)
    x = wide[:, 64:]                                                    # stride(0) = 320, not K
    y = w4a16_gemm(x, packed, scale, 32, swap_ab=True)
    assert_bitwise_equal(y, w4a16_gemm(x.contiguous(), packed, scale, 32, swap_ab=True), "strided rows")
    y3 = w4a16_gemm(x.contiguous().view(2, 3, 256), packed, scale, 32, swap_ab=True)
    assert y3.shape == (2, 3, 40)
    assert_bitwise_equal(y3.view(6, 40), y, "leading dimensions")
    one = w4a16_gemm(x[:1].contiguous(), packed, scale, 32, swap_ab=True)
    assert_rel_close(one.float(), w4a16_gemm_reference(x[:1], packed, scale, 32).float(), 1e-2, "one token")


def _exact_case(n, k, m, seed, device):
    """Weights with every nibble value at every position (columns shuffled), power-of-two fp16 group-32 scales and
    small-integer fp16 activations [m, k]: every dequantized weight, product and sum is exact in fp16 / fp32."""
    codes = torch.arange(n * k).reshape(n, k) % 16
    codes = codes[:, torch.randperm(k, generator=torch.Generator().manual_seed(seed))]
    packed = I.int4_pack_reference(codes - 8)
    scale = (2.0 ** torch.randint(-3, 3, (n, k // 32))).to(torch.float16)
    x = torch.randint(-4, 5, (m, k)).to(torch.float16)
    return packed.to(device), scale.to(device), x.to(device)


def test_swapped_kernel_is_exact_in_fp32_sums_for_every_nibble(triton_backend):
    """Every nibble value at every byte position and both halves: with power-of-two scales and small-integer
    activations every product and partial sum is exact, so the kernel must equal the reference bit for bit (fp16: the
    interpreter's fp32 -> bf16 store truncates instead of rounding)."""
    packed, scale, x = _exact_case(16, 256, 3, 1, triton_backend)
    y = w4a16_gemm(x, packed, scale, 32, swap_ab=True)
    assert_bitwise_equal(y, w4a16_gemm_reference(x, packed, scale, 32), "swapped kernel, every nibble")


def test_swap_ab_auto_rule_and_errors(triton_backend):
    """"auto": the swapped kernel for 2..SWAP_MAX_M tokens of bf16 / fp16 without a pinned config or FAST_DEQUANT
    level where the fragment kernel is off (bit-equal to swap_ab=True there); fp32 activations, one token, more
    tokens, a config or an explicit level keep the other paths."""
    from mla_quant.kernels.w4a16_gemm import SWAP_FORCED_MAX_M, SWAP_MAX_M, _takes_swap

    assert _takes_swap("auto", 2, torch.bfloat16, True) and _takes_swap("auto", SWAP_MAX_M, torch.float16, True)
    assert not _takes_swap("auto", 1, torch.bfloat16, True)
    assert not _takes_swap("auto", SWAP_MAX_M + 1, torch.bfloat16, True)
    assert not _takes_swap("auto", 8, torch.float32, True) and not _takes_swap("auto", 8, torch.bfloat16, False)
    assert not _takes_swap(False, 8, torch.bfloat16, True) and _takes_swap(True, 1, torch.bfloat16, False)
    assert _takes_swap(True, SWAP_FORCED_MAX_M, torch.bfloat16, True)
    dev = triton_backend
    packed, scale = _weights(24, 256, 32, dev, seed=5)
    x = torch.randn(6, 256, device=dev).to(torch.bfloat16)
    assert torch.equal(w4a16_gemm(x, packed, scale, 32, fragments=False),
                       w4a16_gemm(x, packed, scale, 32, swap_ab=True))
    assert torch.equal(w4a16_gemm(x, packed, scale, 32, fast_dequant=1),
                       w4a16_gemm(x, packed, scale, 32, swap_ab=False))
    with pytest.raises(ValueError, match="swap_ab"):
        w4a16_gemm(x.float(), packed, scale, 32, swap_ab=True)
    with pytest.raises(ValueError, match="swap_ab=True: needs at most 128 tokens"):
        w4a16_gemm(torch.randn(SWAP_FORCED_MAX_M + 1, 256, device=dev).to(torch.bfloat16), packed, scale, 32,
                   swap_ab=True)
    with pytest.raises(ValueError, match="swap_ab"):
        w4a16_gemm(x, packed, scale, 32, swap_ab="yes")


def test_swap_split_leaves_every_split_a_block():
    from mla_quant.kernels.w4a16_gemm.kernel import SWAP_MAX_SPLIT, swap_split

    assert swap_split(7168, 256) == SWAP_MAX_SPLIT == 16  # 28 blocks: the measured split at 2048 / 4096 x 7168
    assert swap_split(2048, 256) == 8 and swap_split(256, 256) == 1 and swap_split(320, 256) == 2
    assert swap_split(7168, 256, cap=6) == 4 and swap_split(7168, 256, cap=0) == 1


def test_swap_plan_token_tile_and_split():
    """BM: the power of two >= M from 16; up to 16 tokens the split of swap_split, past them at most
    SWAP_WIDE_TOKEN_PROGRAMS / BM programs per SM (fp32 partials [M, N] per split)."""
    from mla_quant.kernels.w4a16_gemm.kernel import SWAP_WIDE_TOKEN_PROGRAMS, swap_plan, swap_split

    assert swap_plan(2, 4096, 7168, 132) == (16, swap_split(7168, 256)) == swap_plan(16, 4096, 7168, 132)
    assert [swap_plan(m, 4096, 7168, 132)[0] for m in (17, 32, 33, 64, 65, 128)] == [32, 32, 64, 64, 128, 128]
    for m in (17, 64, 128):
        for n, k in ((4096, 7168), (7168, 18432), (2048, 7168), (7168, 2048), (576, 7168)):
            bm, split = swap_plan(m, n, k, 132)
            assert split & (split - 1) == 0 and 1 <= split <= swap_split(k, 256)
            assert -(-n // 64) * split <= max(SWAP_WIDE_TOKEN_PROGRAMS // bm * 132, -(-n // 64)), (m, n, k, split)
    # the measured best (H100, session 42): 8 / 4 splits at 32 tokens, 4 / 2 at 64 (4096 x 7168 / 7168 x 18432)
    assert [swap_plan(m, n, k, 132)[1] for m in (32, 64) for n, k in ((4096, 7168), (7168, 18432))] == [8, 4, 4, 2]


# past 16 tokens: token tiles of 32, 64, 128 (rows past M padding), both activation load forms, ragged N and K blocks
SWAP_WIDE_CASES = [(17, 40, 320, 32), (33, 72, 512, 64), (70, 64, 7 * 32, 32), (128, 24, 256, 128)]


@pytest.mark.parametrize("m,n,k,group", SWAP_WIDE_CASES, ids=str)
@pytest.mark.parametrize("x_split", [False, True], ids=["gathers", "x_split"])
def test_swapped_kernel_wide_token_tiles(triton_backend, m, n, k, group, x_split):
    from mla_quant.kernels.w4a16_gemm import _swap_launch

    dev = triton_backend
    packed, scale = _weights(n, k, group, dev, seed=m + n)
    x = torch.randn(m, k, device=dev).to(torch.bfloat16)
    x[m // 2, -group:] *= 50  # an outlier group in the last (possibly ragged) K block
    ref = w4a16_gemm_reference(x, packed, scale, group)
    y = _swap_launch(x, packed, scale, poisoned_empty((m, n), torch.bfloat16, dev), group, None, True,
                     x_split=x_split)
    assert_rel_close(y.float(), ref.float(), 1e-2, f"{m}x{n}x{k} g{group}")
    assert_bitwise_equal(w4a16_gemm(x, packed, scale, group, swap_ab=True),
                         _swap_launch(x, packed, scale, torch.empty_like(y), group, None, True), "swap_ab=True")


def test_swapped_kernel_exact_at_wide_tiles_in_both_load_forms(triton_backend):
    """Every nibble at 40 tokens (a 64-token tile): the two activation load forms give the reference bit for bit."""
    from mla_quant.kernels.w4a16_gemm import _swap_launch

    packed, scale, x = _exact_case(16, 256, 40, 2, triton_backend)
    ref = w4a16_gemm_reference(x, packed, scale, 32)
    for x_split in (False, True):
        y = _swap_launch(x, packed, scale, torch.empty_like(ref), 32, None, True, x_split=x_split)
        assert_bitwise_equal(y, ref, f"x_split={x_split}")


# swapped: 4 K blocks of 256 (split 4), two row tiles of 64; fragments: 4 K blocks of 128, three row tiles of 32
@pytest.mark.parametrize("k,tiles,kernel", [(1024, 2, {"swap_ab": True}), (512, 3, {"fragments": True})],
                         ids=["swapped", "fragments"])
def test_small_batch_kernels_leave_caller_counters_zero(triton_backend, k, tiles, kernel):
    dev = triton_backend
    packed, scale = _weights(72, k, 32, dev)
    x = torch.randn(4, k, device=dev).to(torch.bfloat16)
    ref = w4a16_gemm(x, packed, scale, 32, **kernel)
    counters = torch.zeros(tiles, dtype=torch.int32, device=dev)
    for _ in range(2):
        assert torch.equal(w4a16_gemm(x, packed, scale, 32, counters=counters, **kernel), ref)
        assert not counters.any()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 8, 16, 24, 64, 100])
@pytest.mark.parametrize("n,k", [(2048, 7168), (7168, 2048), (4096, 7168)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_swapped_kernel_real_shapes(m, n, k, dtype):
    packed, scale = _weights(n, k, 32, "cuda")
    scale = scale.to(dtype)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    y = w4a16_gemm(x, packed, scale, 32, swap_ab=True)
    assert_rel_close(y.float(), w4a16_gemm_reference(x.float(), packed, scale, 32), 1e-2, f"M={m} {n}x{k}")
    assert_rel_close(y.float(), w4a16_gemm(x, packed, scale, 32, swap_ab=False).float(), 1e-2, "vs FAST_DEQUANT tile")
    assert torch.equal(y, w4a16_gemm(x, packed, scale, 32, swap_ab=True)), "deterministic"


# --- 1-128 tokens: the fragment kernel (fragments.py), mma.sync on fragments built in each thread's registers ---
FRAG_CASES = [(2, 40, 320, 32), (5, 72, 256, 64), (8, 130, 512, 128), (9, 64, 7 * 32, 32), (16, 96, 384, 32),
              (1, 48, 128, 32),  # N and K ragged (K % 128), 1-2 token tiles
              (27, 40, 256, 32), (41, 72, 7 * 64, 64)]  # 4 token tiles; two chunks of 4 (the second mostly padding)


@pytest.mark.parametrize("m,n,k,group", FRAG_CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fragment_kernel_matches_reference(triton_backend, m, n, k, group, dtype):
    """Against the reference, which rounds each weight to x.dtype as the kernel does: only the summation order and
    the output rounding differ. An outlier group in the last (possibly ragged) K block; a poisoned output."""
    dev = triton_backend
    packed, scale = _weights(n, k, group, dev, seed=m + n)
    scale = scale.to(dtype)
    x = torch.randn(m, k, device=dev).to(dtype)
    x[-1, -group:] *= 50
    y = w4a16_gemm(x, packed, scale, group, out=poisoned_empty((m, n), dtype, dev), fragments=True)
    assert_rel_close(y.float(), w4a16_gemm_reference(x, packed, scale, group).float(), 1e-2, f"{m}x{n}x{k} g{group}")
    assert torch.equal(y, w4a16_gemm(x, packed, scale, group, fragments=True)), "deterministic"


def test_fragment_kernel_streamed_weights_change_no_bit(triton_backend, monkeypatch):
    """``fragments.STREAM_WEIGHTS`` (the weights' words and scales loaded without L1 lines: load hints, interpreted
    as plain loads) leaves every output bit as it was. 9 tokens (two token tiles), ragged N and K."""
    from mla_quant.kernels.w4a16_gemm import fragments

    dev = triton_backend
    packed, scale = _weights(72, 7 * 32, 32, dev, seed=3)
    x = torch.randn(9, 7 * 32, device=dev).to(torch.bfloat16)
    plain = w4a16_gemm(x, packed, scale, 32, out=poisoned_empty((9, 72), torch.bfloat16, dev), fragments=True)
    monkeypatch.setattr(fragments, "STREAM_WEIGHTS", True)
    streamed = w4a16_gemm(x, packed, scale, 32, out=poisoned_empty((9, 72), torch.bfloat16, dev), fragments=True)
    assert_bitwise_equal(streamed, plain, "fragment kernel, streamed weights")


def test_fragment_kernel_is_exact_for_every_nibble(triton_backend):
    """Every nibble value at every position of every lane's words: with power-of-two scales and small-integer
    activations every weight, product and sum is exact, so the kernel equals the reference bit for bit (fp16: the
    interpreter's fp32 -> bf16 store truncates instead of rounding). 9 tokens: two token tiles."""
    packed, scale, x = _exact_case(32, 512, 9, 2, triton_backend)
    y = w4a16_gemm(x, packed, scale, 32, fragments=True)
    assert_bitwise_equal(y, w4a16_gemm_reference(x, packed, scale, 32), "fragment kernel, every nibble")


def test_fragment_kernel_rows_strides_and_alignment(triton_backend):
    """Rows of x with a stride past K and leading dimensions give what contiguous rows give; rows that are only
    2-byte aligned (an odd element offset) are not taken by "auto" (the swapped kernel runs) and refused by True."""
    dev = triton_backend
    packed, scale = _weights(40, 256, 32, dev, seed=3)
    wide = torch.randn(6, 256 + 64, device=dev).to(torch.bfloat16)
    x = wide[:, 64:]                                                    # stride(0) = 320, not K
    y = w4a16_gemm(x, packed, scale, 32)                                # "auto": the fragment kernel
    assert_bitwise_equal(y, w4a16_gemm(x.contiguous(), packed, scale, 32, fragments=True), "strided rows")
    y3 = w4a16_gemm(x.contiguous().view(2, 3, 256), packed, scale, 32)
    assert y3.shape == (2, 3, 40)
    assert_bitwise_equal(y3.view(6, 40), y, "leading dimensions")
    odd = torch.randn(6 * 256 + 1, device=dev).to(torch.bfloat16)[1:].view(6, 256)  # 2-byte aligned rows
    odd.copy_(x)
    assert_bitwise_equal(w4a16_gemm(odd, packed, scale, 32), w4a16_gemm(x, packed, scale, 32, swap_ab=True),
                         "2-byte aligned: the swapped kernel")
    with pytest.raises(ValueError, match="4-byte aligned"):
        w4a16_gemm(odd, packed, scale, 32, fragments=True)


def test_fragments_auto_rule_and_errors(triton_backend):
    """"auto": 2..FRAG_AUTO_MAX_M tokens of bf16 / fp16 with scales of the same dtype, no pinned config, FAST_DEQUANT
    level or swap_ab=True; otherwise the other paths. Bad values and impossible calls name the argument."""
    from mla_quant.kernels.w4a16_gemm import FRAG_AUTO_MAX_M, FRAG_MAX_M

    dev = triton_backend
    packed, scale = _weights(24, 256, 32, dev, seed=5)
    x = torch.randn(6, 256, device=dev).to(torch.bfloat16)
    frag = w4a16_gemm(x, packed, scale, 32, fragments=True)
    assert torch.equal(w4a16_gemm(x, packed, scale, 32), frag)
    swapped = w4a16_gemm(x, packed, scale, 32, swap_ab=True)
    assert torch.equal(w4a16_gemm(x, packed, scale, 32, fragments=False), swapped)
    assert torch.equal(w4a16_gemm(x, packed, scale.float(), 32), w4a16_gemm(x, packed, scale.float(), 32,
                                                                             swap_ab=True)), "fp32 scales: swapped"
    assert torch.equal(w4a16_gemm(x, packed, scale, 32, fast_dequant=1), w4a16_gemm(x, packed, scale, 32,
                                                                                    swap_ab=False))
    one = x[:1].contiguous()
    assert torch.equal(w4a16_gemm(one, packed, scale, 32), w4a16_gemm(one, packed, scale, 32, fragments=False))
    with pytest.raises(ValueError, match="fragments"):
        w4a16_gemm(x, packed, scale, 32, fragments="yes")
    with pytest.raises(ValueError, match="fragments=True.*float32"):
        w4a16_gemm(x.float(), packed, scale, 32, fragments=True)
    with pytest.raises(ValueError, match="fragments=True.*weight_scale"):
        w4a16_gemm(x, packed, scale.float(), 32, fragments=True)
    shifted = torch.zeros(24 * 32 + 1, dtype=torch.int32, device=dev)[1:].view(24, 32)  # 4-byte offset
    shifted.copy_(packed)
    assert torch.equal(w4a16_gemm(x, shifted, scale, 32), swapped), "weights not 16-byte aligned: swapped"
    with pytest.raises(ValueError, match="fragments=True.*16-byte"):
        w4a16_gemm(x, shifted, scale, 32, fragments=True)
    with pytest.raises(ValueError, match="fragments=True.*tokens"):
        w4a16_gemm(torch.randn(FRAG_MAX_M + 1, 256, device=dev).to(torch.bfloat16), packed, scale, 32,
                   fragments=True)
    # "auto" up to FRAG_AUTO_MAX_M tokens (4 token tiles), the tiles past it
    many = torch.randn(FRAG_AUTO_MAX_M + 1, 256, device=dev).to(torch.bfloat16)
    assert torch.equal(w4a16_gemm(many[:-1], packed, scale, 32), w4a16_gemm(many[:-1], packed, scale, 32,
                                                                            fragments=True))
    assert torch.equal(w4a16_gemm(many, packed, scale, 32), w4a16_gemm(many, packed, scale, 32, fragments=False))


def test_fragment_split_and_launch_rule():
    from mla_quant.kernels.w4a16_gemm.fragments import (FRAG_INTERPRETER_TILE, frag_chunks, frag_plan, frag_split,
                                                        frag_tile)

    assert frag_split(2048, 7168, 64, 128, 132) == 16 and frag_split(4096, 7168, 64, 128, 132) == 8
    assert frag_split(64, 128, 64, 128, 132) == 1 and frag_split(64, 384, 64, 128, 132) == 2
    assert frag_split(4096, 7168, 64, 128, 132, per_sm=8) == 16
    assert [frag_tile(m)[1:] for m in (1, 4, 5, 8, 9, 16)] == [(256, 4, 8)] * 2 + [(128, 4, 4)] * 4
    with pytest.raises(StopIteration):
        frag_tile(129)
    # token chunks of at most 32 tokens, each a power of two of token tiles of 8
    assert [frag_chunks(m) for m in (1, 8, 9, 17, 32, 33, 40, 64)] == [(1, 1), (1, 1), (1, 2), (1, 4), (1, 4), (2, 4),
                                                                      (2, 4), (2, 4)]
    # two chunks share the programs per SM: the split of 64 tokens is that of 4 programs per SM over twice the rows
    assert frag_plan(4096, 7168, 64, 132)[0] == frag_split(4096, 7168, 64, 128, 132, 2) == 4
    assert frag_plan(4096, 7168, 2, 132) == (frag_split(4096, 7168, 64, 256, 132, 8), frag_tile(2)) == (16, (1, 256, 4, 8))
    assert frag_plan(4096, 7168, 16, 132, interpreted=True)[1] == FRAG_INTERPRETER_TILE


@pytest.mark.gpu
@pytest.mark.parametrize("m", [17, 24, 32, 40, 64, 100])
@pytest.mark.parametrize("n,k", [(2048, 7168), (7168, 2048), (4096, 7168)])
def test_gpu_fragment_kernel_token_chunks(m, n, k):
    """17-128 tokens on fragments=True: 4 token tiles per program, chunks of 32 tokens past 32. Against the reference
    (relative) and the tiles "auto" ran there before; deterministic; kept counters stay zero."""
    packed, scale = _weights(n, k, 32, "cuda")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    counters = torch.zeros(n, dtype=torch.int32, device="cuda")
    y = w4a16_gemm(x, packed, scale, 32, fragments=True, counters=counters)
    assert_rel_close(y.float(), w4a16_gemm_reference(x.float(), packed, scale, 32), 1e-2, f"M={m} {n}x{k}")
    assert_rel_close(y.float(), w4a16_gemm(x, packed, scale, 32, fragments=False).float(), 1e-2, "vs the tiles")
    assert torch.equal(y, w4a16_gemm(x, packed, scale, 32, fragments=True, counters=counters)), "deterministic"
    assert not counters.any()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 5, 8, 16, 24, 32])
@pytest.mark.parametrize("n,k", [(2048, 7168), (7168, 2048), (4096, 7168)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_fragment_kernel_real_shapes(m, n, k, dtype):
    """"auto" runs the fragment kernel: the reference (1 ulp of the output dtype, relative), the swapped kernel (the
    tiles past its 16 tokens), deterministic; kept counters give the same bits and stay zero."""
    packed, scale = _weights(n, k, 32, "cuda")
    scale = scale.to(dtype)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    y = w4a16_gemm(x, packed, scale, 32)
    assert torch.equal(y, w4a16_gemm(x, packed, scale, 32, fragments=True))
    assert_rel_close(y.float(), w4a16_gemm_reference(x.float(), packed, scale, 32), 1e-2, f"M={m} {n}x{k}")
    other = w4a16_gemm(x, packed, scale, 32, swap_ab=True) if m <= 16 else w4a16_gemm(x, packed, scale, 32,
                                                                                      fragments=False)
    assert_rel_close(y.float(), other.float(), 1e-2, "vs swapped / tiles")
    counters = torch.zeros(n, dtype=torch.int32, device="cuda")
    assert torch.equal(y, w4a16_gemm(x, packed, scale, 32, counters=counters)) and not counters.any()


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(2048, 7168), (4096, 7168), (7168, 2048), (7168, 18432), (1000, 1536)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_rows_gemv_real_shapes(n, k, dtype):
    """The compiled rows GEMV at real widths (18432: three chunks, the last masked; 1000 x 1536: ragged N, 192
    words in a 256-word chunk): against the reference and the split-K plane GEMV; with prefetch_weights (PDL, the
    weights read before the wait) bitwise equal to the plain launch, also in a chain of calls that each follow the
    previous one's GEMV; deterministic."""
    packed, scale = _weights(n, k, 32, "cuda")
    x = torch.randn(1, k, device="cuda", dtype=dtype)
    y = w4a16_gemm(x, packed, scale, 32, out=poisoned_empty((1, n), dtype, "cuda"))
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    assert_rel_close(y.float(), w4a16_gemm_reference(x.float(), packed, scale, 32).float(), tol, f"{n}x{k}")
    assert_rel_close(y.float(), w4a16_gemm(x, packed, scale, 32, gemv="planes1").float(), tol, "rows vs planes1")
    chain = [w4a16_gemm(x, packed, scale, 32, prefetch_weights=True) for _ in range(8)]
    for i, c in enumerate(chain):
        assert_bitwise_equal(c, y, f"prefetch call {i}")


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(4096, 7168), (7168, 2048), (7168, 18432), (1000, 1536)])
def test_gpu_gemv_streamed_weights_are_bitwise_equal(n, k):
    """The weights streamed past L1 (``stream``, the default of both one-token GEMVs) change where lines live, not
    the sums: each GEMV's output is bitwise the one with plain loads, and equals the reference at bf16 level."""
    from mla_quant.kernels.w4a16_gemm.gemv import gemv_launch, gemv_tile
    from mla_quant.kernels.w4a16_gemm.gemv_half2 import half2_launch, half2_tile

    packed, scale = _weights(n, k, 32, "cuda")
    x = torch.randn(k, device="cuda", dtype=torch.bfloat16)
    pairs, pair_scales = pair_order(x[None])
    ref = w4a16_gemm_reference(x[None].float(), packed, scale, 32)[0].float()
    for form, launch in (("rows", lambda y, s: gemv_launch(x, packed, scale, y, 32, gemv_tile(n, k), stream=s)),
                         ("half2", lambda y, s: half2_launch(pairs[0], pair_scales[0], packed, scale, y, 32,
                                                             half2_tile(n, k), stream=s))):
        plain, streamed = (poisoned_empty((n,), torch.bfloat16, "cuda") for _ in range(2))
        launch(plain, False)
        launch(streamed, True)
        assert_rel_close(plain.float(), ref, 1e-2, form)
        assert_bitwise_equal(streamed, plain, f"{form} streamed")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 4, 9, 16])
@pytest.mark.parametrize("n,k", [(4096, 7168), (7168, 2048), (1000, 1536)])
def test_gpu_fragments_streamed_weights_are_bitwise_equal(m, n, k):
    """The fragment kernel (2-16 tokens) with its weights' words and scales past L1 (``stream``) gives the bits of
    plain loads, and the reference at bf16 level."""
    from mla_quant.kernels.w4a16_gemm import _frag_launch

    packed, scale = _weights(n, k, 32, "cuda")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ref = w4a16_gemm_reference(x.float(), packed, scale, 32).float()
    plain, streamed = (poisoned_empty((m, n), torch.bfloat16, "cuda") for _ in range(2))
    _frag_launch(x, packed, scale, plain, 32, None, False, stream=False)
    _frag_launch(x, packed, scale, streamed, 32, None, False, stream=True)
    assert_rel_close(plain.float(), ref, 1e-2, "fragments")
    assert_bitwise_equal(streamed, plain, "fragments streamed")


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(2048, 7168), (4096, 7168), (7168, 2048), (7168, 18432), (6144, 12288),
                                 (1000, 1536)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_rows_half2_gemv_real_shapes(n, k, dtype):
    """The compiled half2 rows GEMV (with its pair-order launch) at real widths: against the reference and the fp32
    rows GEMV at bf16 level; with prefetch_weights (both launches with PDL) bitwise equal to the plain call, also in a
    chain of calls that each follow the previous one's GEMV; the every-nibble case bit for bit on the GPU."""
    packed, scale = _weights(n, k, 32, "cuda")
    x = torch.randn(1, k, device="cuda", dtype=dtype)
    y = w4a16_gemm(x, packed, scale, 32, out=poisoned_empty((1, n), dtype, "cuda"), gemv="rows_half2")
    assert_rel_close(y.float(), w4a16_gemm_reference(x.float(), packed, scale, 32).float(), 1e-2, f"{n}x{k}")
    assert_rel_close(y.float(), w4a16_gemm(x, packed, scale, 32).float(), 1e-2, "rows_half2 vs rows")
    chain = [w4a16_gemm(x, packed, scale, 32, gemv="rows_half2", prefetch_weights=True) for _ in range(8)]
    for i, c in enumerate(chain):
        assert_bitwise_equal(c, y, f"prefetch call {i}")
    xe, pe, se = _every_nibble_case(4, "cuda")
    xe = xe.to(dtype)
    assert torch.equal(w4a16_gemm(xe, pe, se, 32, gemv="rows_half2"), w4a16_gemm_reference(xe, pe, se, 32))
