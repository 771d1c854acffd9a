"""The Gluon wgmma W4A16 kernel (``w4a16_gemm(..., wgmma=True)``, ``w4a16_gemm/wgmma.py``).

On the CPU: the K order it gives the activations (``k_order``) is the order its register assembly puts the weights
in (the same joins, reshape and permute on torch tensors), the plan, the dispatch and its errors. On a Hopper GPU:
against the reference on random and exact data, ragged shapes, every group size, split-K and kept counters."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_quant.kernels import int4_quant as I
from mla_quant.kernels.w4a16_gemm import w4a16_gemm, w4a16_gemm_reference
from mla_quant.kernels.w4a16_gemm import wgmma as W
from mla_quant.testing import assert_bitwise_equal, assert_rel_close, poisoned_empty
from tests.conftest import HAS_CUDA
from tests.kernels.test_w4a16_gemm import _exact_case, _weights

IS_HOPPER = HAS_CUDA and torch.cuda.get_device_capability()[0] == 9
hopper = pytest.mark.skipif(not IS_HOPPER, reason="a Gluon kernel for Hopper (sm_90)")


def _assembled_codes(words: torch.Tensor, bk: int) -> torch.Tensor:
    """What ``_dequant`` assembles from a word tile [R, BK/8] (its codes, scale 1), with torch's stack for
    ``gl.join`` (a new last dim) and the kernel's own ``A_PERM``: [R, BK] in the A operand's K order."""
    r, wpl = words.shape[0], bk // 32
    nib = [((words >> (4 * n)) & 0xF) - 8 for n in range(8)]
    o = [nib[i // 2 + 4 * (i % 2)] for i in range(8)]  # asm outputs: (n0, n4), (n1, n5), (n2, n6), (n3, n7)
    q0 = torch.stack((torch.stack((o[0], o[1]), -1), torch.stack((o[2], o[3]), -1)), -1)
    q1 = torch.stack((torch.stack((o[4], o[5]), -1), torch.stack((o[6], o[7]), -1)), -1)
    a = torch.stack((q0, q1), -1).reshape(r, 4, wpl, 2, 2, 2)
    return a.permute(*W.A_PERM.value).reshape(r, bk)


@pytest.mark.parametrize("bk", [64, 128])
def test_register_assembly_puts_the_weights_in_k_order(bk):
    """Column L of the assembled A operand is the weight at K offset ``k_order(bk)[L]`` of the block: so x permuted
    by k_order meets each weight (a wrong join order, permutation or nibble pair breaks this)."""
    codes = torch.randint(-8, 8, (16, bk), generator=torch.Generator().manual_seed(bk))
    words = I.int4_pack_reference(codes)  # int32 [16, bk / 8]
    assert torch.equal(_assembled_codes(words, bk), codes[:, W.k_order(bk)])


@pytest.mark.parametrize("bk", [64, 128])
def test_k_order_is_a_permutation_and_each_lane_reads_one_group(bk):
    """A permutation of the block; logical columns 2j, 2j+1 (+ 8, + 16t) — lane j of a quad — all map into one group
    of 32 (one scale per lane, row and block) and into lane j's own contiguous words."""
    order = W.k_order(bk)
    assert sorted(order.tolist()) == list(range(bk))
    lane = (torch.arange(bk) >> 1) & 3
    for j in range(4):
        phys = order[lane == j]
        assert len(set((phys // 32).tolist())) == 1
        assert phys.min() == 8 * (bk // 32) * j and phys.max() == 8 * (bk // 32) * (j + 1) - 1


@settings(max_examples=30, deadline=None)
@given(m=st.integers(1, 7), blocks=st.integers(1, 4))
def test_permuted_x_times_assembled_weights_is_the_product(m, blocks):
    """x' @ A^T over whole K (blocks of 64) equals x @ W^T: the kernel's math with torch matmuls (exact codes)."""
    k = 64 * blocks
    g = torch.Generator().manual_seed(m * 10 + blocks)
    codes = torch.randint(-8, 8, (8, k), generator=g)
    x = torch.randint(-3, 4, (m, k), generator=g).float()
    words = I.int4_pack_reference(codes)
    a = torch.cat([_assembled_codes(words[:, 8 * b:8 * b + 8], 64) for b in range(blocks)], 1).float()
    assert torch.equal(W.permute_x(x) @ a.T, x @ codes.float().T)


def _emulate(x, packed, scale, group, bn=128, split=1):
    """The kernel's index math in torch, program by program: row tiles of ``bn`` (rows past N zero, as TMA fills
    them), this split's K blocks of 64, each word's scale at group (kb·BK + 8·word) // G, the weight rounded to x's
    dtype as ``_pairs`` does, assembled in the A operand's order, times x' in fp32; partials summed in split order."""
    bk, (m, k), n = W.WGMMA_BK, x.shape, packed.shape[0]
    n_kb = k // bk
    per = -(-n_kb // split)
    xp = W.permute_x(x).float()
    y = torch.zeros(m, n)
    word_k = torch.arange(bk // 8) * 8
    for row0 in range(0, n, bn):
        rows = torch.arange(row0, row0 + bn)
        ok = rows < n
        total = torch.zeros(bn, m)
        for pid_k in range(split):
            acc = torch.zeros(bn, m)
            for kb in range(pid_k * per, min(pid_k * per + per, n_kb)):
                words = torch.zeros(bn, bk // 8, dtype=torch.int32)
                words[ok] = packed[rows[ok], kb * (bk // 8):(kb + 1) * (bk // 8)]
                sc = torch.zeros(bn, bk // 8, dtype=x.dtype)
                sc[ok] = scale[rows[ok]][:, (kb * bk + word_k) // group]
                # logical column L holds physical K k_order[L], of word k_order[L] // 8: q · s rounded to x's dtype
                a = (_assembled_codes(words, bk).float() * sc[:, W.k_order(bk) // 8].float()).to(x.dtype)
                acc += a.float() @ xp[:, kb * bk:(kb + 1) * bk].T
            total += acc
        y[:, rows[ok]] = total[ok].T
    return y


@pytest.mark.parametrize("group,n,split", [(32, 200, 1), (64, 130, 3), (128, 256, 2), (32, 64, 4)])
def test_emulated_kernel_matches_the_reference(group, n, split):
    """The kernel's index math (tiles, ragged rows, splits, each word's group scale) reproduces the reference."""
    packed, scale = _weights(n, 512, group, seed=group + n)
    x = torch.randn(5, 512).to(torch.bfloat16)
    ref = w4a16_gemm_reference(x, packed, scale, group).float()
    assert_rel_close(_emulate(x, packed, scale, group, split=split), ref, 1e-2, f"g{group} n{n} split {split}")


def test_plan_fills_the_sms_and_leaves_no_split_empty():
    for m, n, k in ((17, 2048, 7168), (64, 7168, 18432), (128, 4096, 7168), (40, 8192, 64), (33, 100, 640)):
        bm, split = W.wgmma_plan(m, n, k, 132)
        assert bm == max(32, 1 << (m - 1).bit_length()) and bm >= m
        n_kb = k // W.WGMMA_BK
        per = -(-n_kb // split)
        assert (split - 1) * per < n_kb <= split * per
        assert split == 1 or -(-n // 128) * split <= 2 * 132


def test_cpu_call_runs_the_reference_and_bad_calls_name_the_problem():
    packed, scale = _weights(24, 128, 32, seed=1)
    x = torch.randn(40, 128).to(torch.bfloat16)
    ref = w4a16_gemm_reference(x, packed, scale, 32)
    assert_bitwise_equal(w4a16_gemm(x, packed, scale, 32, wgmma=True), ref, "CPU: the reference")
    with pytest.raises(ValueError, match="wgmma=True: the wgmma kernel cannot take x of torch.float32"):
        w4a16_gemm(x.float(), packed, scale, 32, wgmma=True)
    with pytest.raises(ValueError, match=r"cannot take 129 tokens \(it takes up to 128\)"):
        w4a16_gemm(torch.randn(129, 128).to(torch.bfloat16), packed, scale, 32, wgmma=True)
    with pytest.raises(ValueError, match="weight_scale of torch.bfloat16"):
        w4a16_gemm(x.half(), packed, scale, 32, wgmma=True)
    p96, s96 = _weights(24, 96, 32, seed=2)
    with pytest.raises(ValueError, match="K = 96, not a multiple of 64"):
        w4a16_gemm(torch.randn(4, 96).to(torch.bfloat16), p96, s96, 32, wgmma=True)
    with pytest.raises(ValueError, match="pick one kernel"):
        w4a16_gemm(x, packed, scale, 32, wgmma=True, swap_ab=True)
    with pytest.raises(ValueError, match="wgmma"):
        w4a16_gemm(x, packed, scale, 32, wgmma="yes")


def test_interpreter_refuses_it_by_name(triton_backend):
    packed, scale = _weights(24, 128, 32, triton_backend, seed=1)
    with pytest.raises(ValueError, match="Gluon kernel for Hopper"):
        w4a16_gemm(torch.randn(4, 128, device=triton_backend).to(torch.bfloat16), packed, scale, 32, wgmma=True)


# ----------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k,group", [(17, 2048, 7168, 32), (33, 4096, 7168, 32), (64, 7168, 2048, 32),
                                         (100, 1000, 1600, 32), (128, 7168, 18432, 32), (1, 256, 64, 32),
                                         (48, 520, 4160, 64), (70, 384, 2048, 128), (5, 130, 128, 128)])
def test_gpu_matches_reference(m, n, k, group, dtype):
    """Random weights and activations (an outlier group in the last K block), NaN-poisoned y: within bf16-level
    error of the reference (the kernel sums in fp32 in another order)."""
    packed, scale = _weights(n, k, group, "cuda", seed=m + n)
    scale = scale.to(dtype)
    x = torch.randn(m, k, device="cuda").to(dtype)
    x[-1, -group:] *= 50
    out = poisoned_empty((m, n), dtype, "cuda")
    y = w4a16_gemm(x, packed, scale, group, out=out, wgmma=True)
    assert_rel_close(y.float(), w4a16_gemm_reference(x, packed, scale, group).float(), 5e-3, f"{m}x{n}x{k} g{group}")


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("m", [3, 40, 128])
def test_gpu_is_exact_for_every_nibble(m):
    """Every nibble value at every position, power-of-two fp16 scales, small-integer x: every product and partial sum
    is exact, so the kernel equals the reference bit for bit, at one split and at several."""
    packed, scale, x = _exact_case(96, 1024, m, 4, "cuda")
    ref = w4a16_gemm_reference(x, packed, scale, 32)
    assert_bitwise_equal(w4a16_gemm(x, packed, scale, 32, wgmma=True), ref, "planned split")
    for split in (1, 3, 16):
        y = torch.empty_like(ref)
        W.wgmma_launch(x, packed, scale, y, 32, None, 132, split=split)
        assert_bitwise_equal(y, ref, f"split {split}")


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("tile", [(4, 6), (8, 4), (16, 4)])
def test_gpu_tiles_and_kept_counters(tile):
    """Each launch tile of the sweep; a kept counter buffer is left at zero, and a second launch with it is bitwise
    the first (split-K sums in split order)."""
    n, k, m = 4096, 7168, 64
    packed, scale = _weights(n, k, 32, "cuda", seed=7)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    counters = torch.zeros(n, dtype=torch.int32, device="cuda")
    y1, y2 = (poisoned_empty((m, n), torch.bfloat16, "cuda") for _ in range(2))
    W.wgmma_launch(x, packed, scale, y1, 32, counters, 132, tile=tile)
    assert int(counters.abs().sum()) == 0
    W.wgmma_launch(x, packed, scale, y2, 32, counters, 132, tile=tile)
    assert_bitwise_equal(y1, y2, f"tile {tile}, second launch")
    assert_rel_close(y1.float(), w4a16_gemm_reference(x, packed, scale, 32).float(), 5e-3, f"tile {tile}")


@pytest.mark.gpu
@hopper
def test_gpu_strided_and_batched_activations():
    packed, scale = _weights(200, 512, 32, "cuda", seed=3)
    wide = torch.randn(40, 512 + 64, device="cuda").to(torch.bfloat16)
    x = wide[:, 64:]
    y = w4a16_gemm(x, packed, scale, 32, wgmma=True)
    assert_bitwise_equal(y, w4a16_gemm(x.contiguous(), packed, scale, 32, wgmma=True), "strided rows")
    y3 = w4a16_gemm(x.contiguous().view(4, 10, 512), packed, scale, 32, wgmma=True)
    assert_bitwise_equal(y3.view(40, 200), y, "leading dimensions")
