import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mla_quant.kernels.hadamard import hadamard_transform
from mla_quant.kernels.indexer_k_append import (
    indexer_k_append,
    indexer_k_append_reference,
    quantize_indexer_keys_reference,
)
from mla_quant.testing import assert_bitwise_equal, tensors
from tests.conftest import HAS_CUDA

FP8 = torch.float8_e4m3fn


def pages(dtype, num_pages=6, page_size=16, d=64, device="cpu"):
    k = torch.full((num_pages, page_size, d), float("nan"), device=device).to(dtype)
    s = torch.full((num_pages, page_size), float("nan"), device=device) if dtype == FP8 else None
    return k, s


def assert_codes_close(a, e):
    """Bit-exact on the GPU. The Triton interpreter's own fp32 -> e4m3 / bf16 casts misround (DESIGN.md): by
    one step of the format, or by dropping the carry into the next binade (127.25 -> 64 instead of 128), so
    on the CPU a code may differ from the reference in exactly those two ways."""
    if HAS_CUDA:
        assert_bitwise_equal(a, e)
        return
    af, ef = a.float(), e.float()
    both_nan = torch.isnan(af) & torch.isnan(ef)
    step = ef.abs() * (2.0 ** -3 if a.dtype == FP8 else 2.0 ** -7) + 2.0 ** -9
    mant, _ = torch.frexp(ef)
    lost_carry = (mant.abs() == 0.5) & (af == ef / 2)
    assert torch.all(both_nan | ((af - ef).abs() <= step) | lost_carry)


@pytest.mark.parametrize("dtype", [FP8, torch.bfloat16, torch.float32])
def test_kernel_matches_reference_and_skips_negative_slots(triton_backend, dtype):
    dev = triton_backend
    k = (torch.randn(37, 64) * torch.logspace(-2, 2, 37)[:, None]).to(dev)
    slots = torch.randperm(6 * 16)[:37].to(dev)
    slots[[0, 5]] = -1
    got_k, got_s = pages(dtype, device=dev)
    want_k, want_s = pages(dtype, device=dev)
    indexer_k_append(k, slots, got_k, got_s)
    indexer_k_append_reference(k, slots, want_k, want_s)
    assert_codes_close(got_k, want_k)
    if dtype == FP8:
        assert_bitwise_equal(got_s, want_s)
    untouched = torch.ones(6 * 16, dtype=torch.bool)
    untouched[slots[slots >= 0].cpu()] = False
    assert torch.isnan(got_k.float().reshape(-1, 64)[untouched.to(dev)]).all()


@given(k=tensors(st.tuples(st.integers(1, 40), st.just(128))), ue8m0=st.booleans())
def test_fp8_keys_roundtrip_within_e4m3_precision(k, ue8m0):
    q, s = quantize_indexer_keys_reference(k, ue8m0)
    deq = q.float() * s[:, None]
    assert torch.all((deq - k).abs() <= k.abs() * 2 ** -4 + s[:, None] * 2 ** -9)


def test_hadamard_is_orthonormal_and_its_own_inverse():
    x, y = torch.randn(5, 128), torch.randn(5, 128)
    hx, hy = hadamard_transform(x), hadamard_transform(y)
    assert torch.allclose((hx * hy).sum(-1), (x * y).sum(-1), rtol=1e-5, atol=1e-5)
    assert torch.allclose(hadamard_transform(hx), x, atol=1e-5)
    eye = hadamard_transform(torch.eye(4), scale=1.0)
    assert torch.equal(eye, torch.tensor([[1., 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]]))
    with pytest.raises(ValueError, match="power of two"):
        hadamard_transform(torch.randn(3, 96))


def test_bad_inputs_name_the_argument():
    k = torch.randn(4, 64)
    slots = torch.arange(4)
    cache, scale = pages(FP8)
    with pytest.raises(ValueError, match="k_scale"):
        indexer_k_append(k, slots, cache, None)
    with pytest.raises(ValueError, match="k:"):
        indexer_k_append(torch.randn(4, 32), slots, cache, scale)
    with pytest.raises(ValueError, match="slot_mapping"):
        indexer_k_append(k, slots[:3], cache, scale)
    with pytest.raises(IndexError, match="slot_mapping"):
        indexer_k_append(k, slots + 6 * 16, cache, scale)
    with pytest.raises(ValueError, match="k_scale"):
        indexer_k_append(k, slots, cache.float(), scale)
