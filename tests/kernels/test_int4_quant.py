import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mla_quant.kernels import int4_quant as I
from mla_quant.testing import assert_bitwise_equal, odd_sizes, sqnr_db, tensors
from tests.conftest import HAS_CUDA


def test_pack_layout_matches_compressed_tensors_spec():
    # Element j of a row goes to word j // 8 at bits 4·(j % 8), as nibble q + 8.
    q = torch.tensor([[-8, -7, 0, 1, 2, 3, 6, 7, 7, 7, 7, 7, 7, 7, 7, -8]], dtype=torch.int8)
    words = I.int4_pack(q)
    expected0 = sum((int(v) + 8) << (4 * i) for i, v in enumerate(q[0, :8]))
    expected1 = sum((int(v) + 8) << (4 * i) for i, v in enumerate(q[0, 8:]))
    as_signed = [e - 2**32 if e >= 2**31 else e for e in (expected0, expected1)]
    assert words.dtype == torch.int32 and words.tolist() == [as_signed]


@given(n=odd_sizes(1, 64), kw=st.integers(1, 40), seed=st.integers(0, 2**31 - 1))
def test_pack_unpack_roundtrip_is_exact(n, kw, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (n, kw * 8), generator=g, dtype=torch.int8)
    assert torch.equal(I.int4_unpack(I.int4_pack(q)), q)
    words = torch.randint(-2**31, 2**31 - 1, (n, kw), generator=g, dtype=torch.int64).to(torch.int32)
    assert torch.equal(I.int4_pack(I.int4_unpack(words)), words)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_quantize_is_symmetric_minmax_with_stored_scale(group):
    w = torch.randn(5, 4 * group)
    packed, scale = I.int4_quantize_reference(w, group, torch.bfloat16)
    expected = (w.reshape(5, -1, group).abs().amax(-1) / 7.5).to(torch.bfloat16)
    assert torch.equal(scale, expected)
    q = I.int4_unpack(packed)
    s = scale.float().repeat_interleave(group, 1)
    assert torch.equal(q, torch.round(w / s).clamp(-8, 7).to(torch.int8))


def test_zero_group_gets_zero_scale_and_codes():
    w = torch.zeros(2, 64)
    w[1, 32:] = torch.randn(32)
    packed, scale = I.int4_quantize(w, 32)
    assert scale[0].tolist() == [0.0, 0.0] and scale[1, 0] == 0 and scale[1, 1] > 0
    assert torch.all(I.int4_unpack(packed)[0] == 0)
    assert not torch.isnan(I.int4_dequantize(packed, scale, 32, torch.float32)).any()


@given(w=tensors(st.tuples(odd_sizes(1, 80), st.sampled_from([128, 256, 384]))), group=st.sampled_from([32, 64, 128]))
def test_rounding_error_is_at_most_half_a_step(w, group):
    packed, scale = I.int4_quantize(w, group, torch.float32)
    deq = I.int4_dequantize(packed, scale, group, torch.float32)
    step = scale.repeat_interleave(group, 1)
    assert torch.all((deq - w).abs() <= step / 2 * (1 + 1e-5))  # fp32 ulps of w / scale


@pytest.mark.parametrize("shape", [(1, 32), (63, 256), (129, 1024)])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_kernels_match_reference(triton_backend, shape, group):
    if shape[1] % group:
        pytest.skip("K not a multiple of the group")
    w = torch.randn(shape).to(triton_backend)
    # The interpreter rounds fp32 -> bf16 by truncation; bf16 results are checked bit-exactly on the GPU.
    scale_dtypes = [torch.float32, torch.bfloat16] if HAS_CUDA else [torch.float32]
    for sd in scale_dtypes:
        packed, scale = I.int4_quantize(w, group, sd)
        pr, sr = I.int4_quantize_reference(w, group, sd)
        assert_bitwise_equal(scale, sr, f"scale {sd}")
        assert_bitwise_equal(packed, pr, f"packed {sd}")
        for out in scale_dtypes:  # the interpreter rounds fp32 -> bf16 by truncation
            assert_bitwise_equal(I.int4_dequantize(pr, sr, group, out),
                                 I.int4_dequantize_reference(pr, sr, group, out), f"dequant {out}")


@pytest.mark.parametrize("config", [{"BN": 2, "BK": 256, "num_warps": 2}, {"BN": 2, "BK": 128, "K_FAST": False},
                                    {"BN": 2, "BK": 128, "num_warps": 1, "STAGES": 2, "PROGRAMS_PER_SM": 3}])
def test_quantize_launch_configs_agree(triton_backend, config):
    # persistent (STAGES): 3 programs loop over the 33 x 3 tiles, masked at the edges (K = 320)
    w = torch.randn(65, 320).to(triton_backend)
    w[3, :32] = 0.0  # an all-zero group
    packed, scale = I.int4_quantize(w, 32, torch.float32)
    p2, s2 = I.int4_quantize(w, 32, torch.float32, config=config)
    assert_bitwise_equal(p2, packed, "packed")
    assert_bitwise_equal(s2, scale, "scale")


@pytest.mark.parametrize("config", [{"BN": 2, "BK": 128, "num_warps": 1}, {"BN": 4, "BK": 256, "num_warps": 2},
                                    {"BN": 4, "BK": 128, "K_FAST": False}])
def test_dequantize_launch_configs_agree(triton_backend, config):
    # ragged row and K tiles (65 x 320), in both grid orders
    w = torch.randn(65, 320).to(triton_backend)
    packed, scale = I.int4_quantize(w, 32, torch.float32)
    out = I.int4_dequantize(packed, scale, 32, torch.float32, config=config)
    assert_bitwise_equal(out, I.int4_dequantize_reference(packed, scale, 32, torch.float32), f"dequant {config}")


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, {"BN": 4, "BK": 1024, "num_warps": 1, "K_FAST": False}])
def test_dequantize_bit_exact_on_gpu_large(config):
    # 2049 x 7168 (a partial last row block), bf16 and fp32 out
    packed, scale = I.int4_quantize(torch.randn(2049, 7168, device="cuda", dtype=torch.bfloat16), 32)
    for out in (torch.bfloat16, torch.float32):
        assert_bitwise_equal(I.int4_dequantize(packed, scale, 32, out, config=config),
                             I.int4_dequantize_reference(packed, scale, 32, out), f"dequant {out}")


def test_sqnr_of_gaussian_weights_matches_the_int4_grid():
    w = torch.randn(512, 2048)
    deq = I.int4_dequantize(*I.int4_quantize(w, 32), 32, torch.float32)
    assert 18 < sqnr_db(w, deq) < 24  # ~20 dB for 16 levels over a Gaussian group's range


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="group_size"):
        I.int4_quantize(torch.randn(4, 48), 32)
    with pytest.raises(ValueError, match="group_size: 16"):
        I.int4_quantize(torch.randn(4, 64), 16)
    with pytest.raises(TypeError, match="packed: dtype"):
        I.int4_dequantize(torch.zeros(4, 4, dtype=torch.int64), torch.zeros(4, 1))
    with pytest.raises(ValueError, match="scale: shape"):
        I.int4_dequantize(torch.zeros(4, 8, dtype=torch.int32), torch.zeros(4, 3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        I.int4_pack(torch.full((1, 8), 9, dtype=torch.int8))


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, {"BN": 4, "BK": 1024, "num_warps": 4, "STAGES": 3, "PROGRAMS_PER_SM": 4},
                                    {"BN": 1, "BK": 1024, "num_warps": 1, "STAGES": 3, "PROGRAMS_PER_SM": 16}])
def test_quantize_bit_exact_on_gpu_large(config):
    # 2049 x 7168 bf16: persistent programs loop over the ~14k tiles; a partial last row block; an all-zero group
    w = torch.randn(2049, 7168, device="cuda", dtype=torch.bfloat16)
    w[5, :32] = 0.0
    w[6, :32] = torch.arange(-15, 17, device="cuda", dtype=torch.bfloat16) / 2  # a group of halves
    for sd in (torch.bfloat16, torch.float16, torch.float32):
        packed, scale = I.int4_quantize(w, 32, sd, config=config)
        pr, sr = I.int4_quantize_reference(w, 32, sd)
        assert_bitwise_equal(scale, sr, f"scale {sd}")
        assert_bitwise_equal(packed, pr, f"packed {sd}")
