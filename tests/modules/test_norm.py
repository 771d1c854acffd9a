import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mla_quant.modules import RMSNorm
from mla_quant.modules.norm import rms_norm
from mla_quant.testing import odd_sizes, tensors


@given(x=tensors(st.tuples(odd_sizes(1, 40), odd_sizes(1, 300))), eps=st.sampled_from([1e-6, 1e-5]))
def test_rms_norm_matches_float64_formula(x, eps):
    w = torch.randn(x.shape[-1])
    ref = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + eps) * w.double())
    y = rms_norm(x, w, eps)
    assert y.dtype == x.dtype
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-6 * ref.abs().max().item())


def test_bf16_input_is_normalised_in_fp32_and_rounded_once():
    torch.manual_seed(1)
    x = (torch.randn(64, 512) * 30).to(torch.bfloat16)
    norm = RMSNorm(512, eps=1e-6, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(512).to(torch.bfloat16))
    y = norm(x)
    exact = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.double())
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, exact.to(torch.bfloat16))  # one rounding of the exact value (fp32 error << bf16 ulp)


def test_state_dict_key_and_shape_check():
    norm = RMSNorm(16, dtype=torch.float32)
    assert list(norm.state_dict()) == ["weight"]
    assert torch.equal(norm(torch.zeros(3, 16)), torch.zeros(3, 16))  # eps keeps zeros finite
    with pytest.raises(ValueError, match="expected 16"):
        norm(torch.zeros(3, 15))
