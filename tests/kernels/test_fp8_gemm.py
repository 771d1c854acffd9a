"""Block-scaled FP8 GEMM: the Triton kernels — portable and Hopper TMA variants (interpreted on CPU, real on
GPU) — against the reference."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mla_quant.kernels.fp8_gemm import (TMA_CANDIDATES, WS_CANDIDATES, default_config, fp8_gemm, fp8_gemm_reference,
                                       ws_config, ws_default_config)
from mla_quant.kernels.fp8_quant import FP8, act_quant_fp8_reference, block_quant_fp8_reference
from mla_quant.testing import assert_rel_close, odd_sizes, poisoned_empty, realistic_tensor
from tests.conftest import FP8_MMA_REL_TOL


def _operands(m, n, k, block=(128, 128), device="cpu", seed=0):
    x = realistic_tensor((m, k), seed)
    w = realistic_tensor((n, k), seed + 1, heavy_tail=True)
    a, a_s = act_quant_fp8_reference(x, block[1])
    b, b_s = block_quant_fp8_reference(w, block)
    return [t.to(device) for t in (a, a_s, b, b_s)]


SM90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                          reason="the warp-specialized Gluon kernel is written for sm_90")
CFG = {"BM": 32, "BN": 32, "GROUP_M": 2, "num_warps": 4, "num_stages": 1}


@pytest.mark.parametrize("m,n,k,block", [(1, 37, 256, (128, 128)), (63, 200, 384, (128, 128)),
                                         (40, 70, 256, (64, 128)), (17, 33, 128, (32, 32))])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(triton_backend, m, n, k, block, out_dtype):
    a, a_s, b, b_s = _operands(m, n, k, block, triton_backend)
    out = poisoned_empty((m, n), out_dtype, triton_backend)
    c = fp8_gemm(a, a_s, b, b_s, block, out_dtype, out=out, config=CFG)
    assert c.data_ptr() == out.data_ptr()
    ref = fp8_gemm_reference(a, a_s, b, b_s, block, out_dtype)
    # products of e4m3 values are exact in fp32: only the summation order differs (and the bf16 rounding)
    assert_rel_close(c.float(), ref.float(), 1e-5 if out_dtype == torch.float32 else 1e-2, f"{m}x{n}x{k}")


def test_scales_apply_per_k_block_and_per_weight_block(triton_backend):
    # One nonzero K block per case: C must carry exactly that block's a_scale · b_scale.
    m, n, k = 4, 256, 384
    a = torch.ones(m, k).to(FP8)
    b = torch.ones(n, k).to(FP8)
    a_s = torch.arange(1, 1 + m * 3, dtype=torch.float32).reshape(m, 3)
    b_s = torch.tensor([[1.0, 10.0, 100.0], [2.0, 20.0, 200.0]])
    dev = triton_backend
    c = fp8_gemm(a.to(dev), a_s.to(dev), b.to(dev), b_s.to(dev), (128, 128), torch.float32, config=CFG).cpu()
    expected = 128 * (a_s[:, None, :] * b_s.repeat_interleave(128, 0)[None, :, :]).sum(-1)
    assert torch.equal(c, expected)


@pytest.mark.parametrize("split", [2, 3, 4])  # 5 K blocks: splits of 3 / 2+2+1 / 2+2+1+none (an empty split)
def test_split_k_matches_reference_and_is_deterministic(triton_backend, split):
    m, n, k, block = 17, 70, 160, (32, 32)
    a, a_s, b, b_s = _operands(m, n, k, block, triton_backend, seed=split)
    out = poisoned_empty((m, n), torch.float32, triton_backend)
    cfg = {**CFG, "SPLIT_K": split}
    c = fp8_gemm(a, a_s, b, b_s, block, torch.float32, out=out, config=cfg)
    assert_rel_close(c, fp8_gemm_reference(a, a_s, b, b_s, block, torch.float32), 1e-5, f"split {split}")
    again = fp8_gemm(a, a_s, b, b_s, block, torch.float32, config=cfg)  # partials summed in split order
    assert torch.equal(again, c)
    whole = fp8_gemm(a, a_s, b, b_s, block, torch.float32, config={**CFG, "SPLIT_K": 1})
    assert_rel_close(c, whole, 1e-5, "split vs whole K")


def test_split_k_only_where_the_tiles_leave_sms_idle():
    from mla_quant.kernels.fp8_gemm.kernel import split_k

    assert split_k(1, 2048, 7168, 64, 128, 128, 132) == 16   # 16 tiles -> 256 programs, 3-4 K blocks each
    assert split_k(16, 7168, 2048, 64, 128, 128, 132) == 4    # 56 tiles, 16 K blocks
    assert split_k(512, 4096, 7168, 64, 128, 128, 132) == 1   # 256 tiles fill the GPU
    assert split_k(1, 2048, 256, 64, 128, 128, 132) == 1      # 2 K blocks: nothing to split


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])  # the fixture only sets the backend
@given(m=odd_sizes(1, 70), n=odd_sizes(1, 150), kb=st.integers(1, 3), seed=st.integers(0, 2**31 - 1))
def test_default_config_over_shapes(triton_backend, m, n, kb, seed):
    a, a_s, b, b_s = _operands(m, n, 128 * kb, device=triton_backend, seed=seed)
    c = fp8_gemm(a, a_s, b, b_s, out_dtype=torch.float32)
    assert_rel_close(c, fp8_gemm_reference(a, a_s, b, b_s, out_dtype=torch.float32), FP8_MMA_REL_TOL)


TMA_CFG = {"BM": 32, "BN": 32, "GROUP_M": 2, "num_warps": 4, "num_stages": 1}


@pytest.mark.parametrize("m,n,k,block", [(1, 37, 256, (128, 128)), (63, 200, 384, (128, 128)),
                                         (40, 70, 256, (64, 128)), (17, 33, 128, (32, 32)), (70, 100, 256, (16, 128))])
@pytest.mark.parametrize("persistent", [0, 1])
def test_tma_variant_matches_reference(triton_backend, m, n, k, block, persistent):
    # the descriptors zero-fill ragged M / N edges; bn < BN (16 < 32) takes the per-column scale path,
    # bn >= BN the scalar one; persistent: fewer programs than tiles (4 "SMs" on the CPU) walk all tiles
    a, a_s, b, b_s = _operands(m, n, k, block, triton_backend)
    out = poisoned_empty((m, n), torch.float32, triton_backend)
    c = fp8_gemm(a, a_s, b, b_s, block, torch.float32, out=out, config={**TMA_CFG, "PERSISTENT": persistent},
                 variant="tma")
    assert c.data_ptr() == out.data_ptr()
    assert_rel_close(c, fp8_gemm_reference(a, a_s, b, b_s, block, torch.float32), 1e-5, f"{m}x{n}x{k}")


def test_tma_variant_bad_inputs(triton_backend):
    a, a_s, b, b_s = _operands(3, 20, 256, device=triton_backend)
    with pytest.raises(ValueError, match="variant"):
        fp8_gemm(a, a_s, b, b_s, variant="wgmma")
    with pytest.raises(ValueError, match="config: unknown keys"):
        fp8_gemm(a, a_s, b, b_s, config={**TMA_CFG, "SPLIT_K": 2}, variant="tma")
    misaligned = torch.empty(20 * 256 + 1, dtype=FP8, device=triton_backend)[1:].view(20, 256)
    with pytest.raises(ValueError, match="16-byte aligned"):
        fp8_gemm(a, a_s, misaligned, b_s, variant="tma")


def test_ws_variant_bad_inputs(triton_backend):
    a, a_s, b, b_s = _operands(130, 20, 256, device=triton_backend)
    if triton_backend != "cuda" or torch.cuda.get_device_capability()[0] != 9:
        with pytest.raises(ValueError, match="'ws' is a Gluon kernel for Hopper"):
            fp8_gemm(a, a_s, b, b_s, variant="ws")
        return
    with pytest.raises(ValueError, match="config: unknown keys"):
        fp8_gemm(a, a_s, b, b_s, config={"BM": 64}, variant="ws")
    with pytest.raises(ValueError, match="BN in"):
        fp8_gemm(a, a_s, b, b_s, config={"BN": 32}, variant="ws")
    misaligned = torch.empty(20 * 256 + 1, dtype=FP8, device=triton_backend)[1:].view(20, 256)
    with pytest.raises(ValueError, match="16-byte aligned"):
        fp8_gemm(a, a_s, misaligned, b_s, variant="ws")
    a64, a64_s, b64, b64_s = _operands(130, 20, 256, (128, 64), triton_backend)
    with pytest.raises(ValueError, match="bk = 128"):
        fp8_gemm(a64, a64_s, b64, b64_s, (128, 64), variant="ws")


def test_reference_is_the_sum_of_scaled_block_products():
    a, a_s, b, b_s = _operands(5, 130, 256)
    c = fp8_gemm_reference(a, a_s, b, b_s, out_dtype=torch.float32)
    expected = torch.zeros(5, 130, dtype=torch.float64)
    for kb in range(2):
        sl = slice(128 * kb, 128 * (kb + 1))
        prod = a[:, sl].double() @ b[:, sl].double().T
        expected += prod * a_s[:, kb, None].double() * b_s[:, kb].double().repeat_interleave(128)[None, :130]
    assert_rel_close(c, expected.float(), 1e-6)


def test_dispatch_on_cpu_uses_the_reference(torch_backend):
    a, a_s, b, b_s = _operands(3, 20, 128)
    assert torch.equal(fp8_gemm(a, a_s, b, b_s), fp8_gemm_reference(a, a_s, b, b_s))


def test_bad_inputs_name_the_argument():
    a, a_s, b, b_s = _operands(3, 20, 256)
    with pytest.raises(TypeError, match="a: dtype"):
        fp8_gemm(a.float(), a_s, b, b_s)
    with pytest.raises(ValueError, match="b: shape"):
        fp8_gemm(a, a_s, b[:, :128], b_s)
    with pytest.raises(ValueError, match="a_scale: shape"):
        fp8_gemm(a, a_s[:, :1].contiguous(), b, b_s)
    with pytest.raises(ValueError, match="b_scale: shape"):
        fp8_gemm(a, a_s, b, b_s[:, :1].contiguous())
    with pytest.raises(ValueError, match="K: 256 is not divisible"):
        fp8_gemm(a, a_s, b, b_s, (128, 512))
    with pytest.raises(ValueError, match="block"):
        fp8_gemm(a, a_s, b, b_s, (100, 128))
    with pytest.raises(TypeError, match="out_dtype"):
        fp8_gemm(a, a_s, b, b_s, out_dtype=torch.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 64, 512, 2048])
@pytest.mark.parametrize("n,k", [(4096, 7168), (7168, 2048), (2048, 7168)])
def test_autotuned_kernel_on_real_shapes(m, n, k):
    a, a_s, b, b_s = _operands(m, n, k, device="cuda")
    c = fp8_gemm(a, a_s, b, b_s)
    ref = fp8_gemm_reference(a, a_s, b, b_s, out_dtype=torch.float32)
    # the tensor cores accumulate e4m3 products within one 128-wide block at reduced precision
    assert_rel_close(c.float(), ref, 1e-2, f"M={m}")


@pytest.mark.gpu
def test_gpu_fp32_output_is_close_to_exact():
    a, a_s, b, b_s = _operands(256, 384, 1024, device="cuda")
    c = fp8_gemm(a, a_s, b, b_s, out_dtype=torch.float32)
    # fp8 tensor-core accumulation is inexact inside a block; promotion every 128 keeps it small
    assert_rel_close(c, fp8_gemm_reference(a, a_s, b, b_s, out_dtype=torch.float32), 1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 63, 1000, 8192])
@pytest.mark.parametrize("n,k", [(4096, 7168), (1000, 2048)])  # N = 1000: a ragged last column tile
def test_tma_variant_on_real_and_odd_shapes(m, n, k):
    a, a_s, b, b_s = _operands(m, n, k, device="cuda")
    ref = fp8_gemm_reference(a, a_s, b, b_s, out_dtype=torch.float32)
    for config in (default_config(m), *TMA_CANDIDATES):
        out = poisoned_empty((m, n), torch.bfloat16, "cuda")
        c = fp8_gemm(a, a_s, b, b_s, out=out, config=config, variant="tma")
        assert_rel_close(c.float(), ref, 1e-2, f"M={m} {config}")


@pytest.mark.gpu
@SM90
@pytest.mark.parametrize("m", [1, 63, 1000, 8192])
@pytest.mark.parametrize("n,k", [(4096, 7168), (1000, 2048), (7168, 128)])  # one K block; a ragged column tile
def test_ws_variant_on_real_and_odd_shapes(m, n, k):
    a, a_s, b, b_s = _operands(m, n, k, device="cuda", seed=m)
    ref = fp8_gemm_reference(a, a_s, b, b_s, out_dtype=torch.float32)
    for config in (ws_default_config(m), *WS_CANDIDATES):
        out = poisoned_empty((m, n), torch.bfloat16, "cuda")
        c = fp8_gemm(a, a_s, b, b_s, out=out, config=config, variant="ws")
        assert_rel_close(c.float(), ref, 1e-2, f"M={m} {config}")
    # fp32 out: only the tensor cores' in-block accumulation and the summation order differ from the reference
    c32 = fp8_gemm(a, a_s, b, b_s, out_dtype=torch.float32, variant="ws")
    assert_rel_close(c32, ref, 1e-3, f"M={m} fp32")


@pytest.mark.gpu
@SM90
@pytest.mark.parametrize("m,n,k", [(300, 256, 384), (2000, 1024, 640)])
def test_ws_variant_applies_each_k_blocks_scales(m, n, k):
    # ones times ones: every K block's product is exactly 128, so C is exactly Σ_kb 128 · a_s[m, kb] · b_s[n, kb].
    # Odd K-block counts (3, 5): a KSPLIT group or a PAIR_SLOTS slot takes one block alone; 2000 x 1024 gives each
    # program several tiles, so the KSPLIT groups' rings (which advance by 3 and 2 units per tile) drift apart
    kb = k // 128
    a = torch.ones(m, k, device="cuda").to(FP8)
    b = torch.ones(n, k, device="cuda").to(FP8)
    # (scales with few significant bits, 4^kb apart between the blocks: every sum is exact in fp32, in any order)
    a_s = (torch.arange(m * kb, dtype=torch.float32, device="cuda").reshape(m, kb) % 61 + 1) / 64
    b_s = (torch.arange(1, 1 + n // 128, dtype=torch.float32, device="cuda")[:, None]
           * 4.0 ** torch.arange(kb, dtype=torch.float32, device="cuda")[None, :])
    expected = 128 * (a_s[:, None, :] * b_s.repeat_interleave(128, 0)[None, :, :]).sum(-1)
    for config in WS_CANDIDATES:
        c = fp8_gemm(a, a_s, b, b_s, (128, 128), torch.float32, config=config, variant="ws")
        assert torch.equal(c, expected), config
    # bf16 out through the TMA-store epilogue: the exact values rounded once
    c = fp8_gemm(a, a_s, b, b_s, (128, 128), torch.bfloat16, variant="ws")
    assert torch.equal(c, expected.to(torch.bfloat16))


@pytest.mark.gpu
def test_auto_variant_is_ws_on_hopper_past_64_tokens():
    a, a_s, b, b_s = _operands(1000, 2304, 1024, device="cuda")  # 8 x 18 tiles of 128 x 128: the SMs are filled
    c = fp8_gemm(a, a_s, b, b_s, out_dtype=torch.float32)
    assert torch.equal(c, fp8_gemm(a, a_s, b, b_s, out_dtype=torch.float32,
                                   variant="ws" if torch.cuda.get_device_capability()[0] == 9 else "portable"))
    # a pinned configuration of the tma kernel keeps auto on the tma kernel
    if torch.cuda.get_device_capability()[0] == 9:
        cfg = default_config(1000)
        assert torch.equal(fp8_gemm(a, a_s, b, b_s, out_dtype=torch.float32, config=cfg),
                           fp8_gemm(a, a_s, b, b_s, out_dtype=torch.float32, config=cfg, variant="tma"))
        # too few 128 x 128 tiles to fill the SMs (2 x 3): the tma kernel's smaller tiles
        small = _operands(256, 384, 1024, device="cuda")
        assert torch.equal(fp8_gemm(*small, out_dtype=torch.float32),
                           fp8_gemm(*small, out_dtype=torch.float32, variant="tma"))
    assert_rel_close(c, fp8_gemm_reference(a, a_s, b, b_s, out_dtype=torch.float32), 1e-3)


def test_ws_default_config_takes_128_column_tiles_with_k_blocks_in_pairs():
    for m, n in ((8192, 7168), (512, 7168), (2048, 2048), (2048, 7168), (512, 4096)):
        assert ws_default_config(m, n, 132) == {"BN": 128, "GROUP_M": 8, "STAGES": 3, "TMA_STORE": 1, "AHEAD": 1,
                                                "PAIR_SLOTS": 1}
    assert ws_default_config(8192)["BN"] == 128  # no N or SM count: the same tile


def test_ws_config_pins_only_what_it_names_and_names_bad_settings():
    # 512 x 2048 takes KSPLIT by default; a pinned configuration does not inherit it (nor AHEAD)
    assert ws_config(512, 2048, 132, (128, 128), None)["KSPLIT"] == 1
    pinned = ws_config(512, 2048, 132, (128, 128), {"BN": 256, "STAGES": 3})
    assert pinned == {"BN": 256, "GROUP_M": 8, "STAGES": 3, "TMA_STORE": 1}
    assert ws_config(8192, 7168, 132, (128, 128), {"STAGES": 5}) == {"BN": 128, "GROUP_M": 8, "STAGES": 5,
                                                                     "TMA_STORE": 1}
    with pytest.raises(ValueError, match="unknown keys.*SPLITK"):
        ws_config(512, 2048, 132, (128, 128), {"SPLITK": 2})
    with pytest.raises(ValueError, match="KSPLIT and AHEAD take BN 64 or 128"):
        ws_config(8192, 7168, 132, (128, 128), {"BN": 256, "AHEAD": 1})
    with pytest.raises(ValueError, match="bk = 128"):
        ws_config(8192, 7168, 132, (128, 64), None)
    with pytest.raises(ValueError, match="BN in \\(64, 128, 256\\)"):
        ws_config(8192, 7168, 132, (128, 128), {"BN": 96})
    # an AHEAD pair holds two slots at once; under KSPLIT each group has half of the ring (an even STAGES count)
    with pytest.raises(ValueError, match="STAGES 2 < 4.*deadlock"):
        ws_config(512, 2048, 132, (128, 128), {"KSPLIT": 1, "AHEAD": 1, "STAGES": 2})
    with pytest.raises(ValueError, match="KSPLIT splits the ring.*STAGES 7 must be even"):
        ws_config(512, 2048, 132, (128, 128), {"KSPLIT": 1, "AHEAD": 1, "STAGES": 7})
    with pytest.raises(ValueError, match="STAGES 1 < 2"):
        ws_config(8192, 7168, 132, (128, 128), {"AHEAD": 1, "STAGES": 1})
    assert ws_config(512, 2048, 132, (128, 128), {"KSPLIT": 1, "AHEAD": 1, "STAGES": 4})["STAGES"] == 4
    # PAIR_SLOTS: the pair is one slot (one slot per group suffices); it needs AHEAD
    assert ws_config(8192, 7168, 132, (128, 128), {"AHEAD": 1, "PAIR_SLOTS": 1, "STAGES": 1})["PAIR_SLOTS"] == 1
    assert ws_config(512, 2048, 132, (128, 128), {"KSPLIT": 1, "AHEAD": 1, "PAIR_SLOTS": 1, "STAGES": 2})["STAGES"] == 2
    with pytest.raises(ValueError, match="PAIR_SLOTS needs AHEAD"):
        ws_config(8192, 7168, 132, (128, 128), {"PAIR_SLOTS": 1})


def test_ws_default_config_splits_k_between_the_groups_where_64_row_tiles_fill_one_wave():
    # 132 SMs: 512 x 2048 has 64 tiles of 128 rows (under 90 %) and 128 of 64 rows (one wave, 97 %)
    assert ws_default_config(512, 2048, 132) == {"BN": 128, "GROUP_M": 8, "STAGES": 4, "TMA_STORE": 0, "KSPLIT": 1,
                                                 "AHEAD": 1, "PAIR_SLOTS": 1}
    assert ws_default_config(256, 4096, 132).get("KSPLIT") == 1  # 64 / 128 tiles
    assert "KSPLIT" not in ws_default_config(512, 4096, 132)  # 128 tiles of 128 rows already fill the SMs
    assert "KSPLIT" not in ws_default_config(512, 1024, 132)  # 64 tiles of 64 rows: still under 90 %
    assert "KSPLIT" not in ws_default_config(768, 2048, 132)  # 192 tiles of 64 rows: two waves
    assert "KSPLIT" not in ws_default_config(512, 2048)  # no SM count


@pytest.mark.gpu
@SM90
@pytest.mark.parametrize("m,n,k", [(512, 7168, 256), (300, 800, 384), (1000, 1000, 2048)])
def test_ws_wide_tiles_match_the_reference(m, n, k):
    # n = 800: the last 256-column tile's second half lies past N (its weight-scale row is clamped, nothing stored);
    # n = 1000: ragged inside the second half; 512 x 7168: what "auto" runs with 128 x 256 tiles on an H200
    a, a_s, b, b_s = _operands(m, n, k, device="cuda", seed=n)
    ref = fp8_gemm_reference(a, a_s, b, b_s, out_dtype=torch.float32)
    for stages in (3, 4):
        cfg = {"BN": 256, "GROUP_M": 8, "STAGES": stages, "TMA_STORE": 1}
        out = poisoned_empty((m, n), torch.bfloat16, "cuda")
        assert_rel_close(fp8_gemm(a, a_s, b, b_s, out=out, config=cfg, variant="ws").float(), ref, 1e-2, cfg)
        c32 = fp8_gemm(a, a_s, b, b_s, out_dtype=torch.float32, config=dict(cfg, TMA_STORE=0), variant="ws")
        assert_rel_close(c32, ref, 1e-3, f"fp32 {cfg}")
    if ws_default_config(m, n, torch.cuda.get_device_properties(0).multi_processor_count)["BN"] == 256:
        wide = {"BN": 256, "GROUP_M": 8, "STAGES": 4, "TMA_STORE": 1}
        assert torch.equal(fp8_gemm(a, a_s, b, b_s), fp8_gemm(a, a_s, b, b_s, config=wide, variant="ws"))
