"""kv_append: the Triton kernel against its reference (bit-exact on the GPU; bf16 exact on the CPU interpreter),
the reference against ``kv_layout.quantize_kv_rows``, untouched slots, skipped slots and bad input."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mla_quant.kernels.fp8_quant import act_quant_fp8, kv_quant_fp8
from mla_quant.kernels.fp8_quant.reference import FP8
from mla_quant.kernels.kv_append import kv_append, kv_append_reference
from mla_quant.kernels.kv_layout import dequantize_kv_rows, kv_data_dtype, kv_row_width, quantize_kv_rows
from mla_quant.testing import assert_bitwise_equal, odd_sizes, tensors
from tests.conftest import HAS_CUDA

FORMATS = [("bf16", "token"), ("fp8_e4m3", "token"), ("fp8_e4m3", "tensor"), ("fp8_ds_mla", "token")]


def make_pages(kind, scale, num_pages, page_size, d_latent, d_rope, device="cpu", tensor_scale=0.05):
    """NaN-poisoned pages (every byte 0xFF) in the given format."""
    width = kv_row_width(kind, d_latent, d_rope)
    data = torch.empty((num_pages, page_size, width), dtype=kv_data_dtype(kind), device=device)
    data.view(torch.uint8).fill_(0xFF)
    scales = None
    if kind == "fp8_e4m3":
        scales = (torch.full((num_pages, page_size), float("nan"), device=device) if scale == "token"
                  else torch.tensor([tensor_scale], device=device))
    return data, scales


def random_slots(t, num_slots, seed, skip_frac=0.0):
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=g)[:t]
    if skip_frac:
        slots[torch.rand(t, generator=g) < skip_frac] = -1
    return slots


def assert_fp8_codes_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """e4m3 codes: bit-exact on the GPU. Under the CPU interpreter, whose own fp32 -> e4m3 cast drops the carry at
    binade edges or misrounds by a step (DESIGN.md), a code may differ by one e4m3 step or a lost carry; it also
    casts NaN to ±384 (0x7C), so an expected NaN code is not compared there."""
    if HAS_CUDA:
        assert_bitwise_equal(actual, expected, what)
        return
    a, e = actual.float(), expected.float()
    differ = (a != e) & ~torch.isnan(e)
    a, e = a[differ], e[differ]
    _, exp = torch.frexp(torch.maximum(a.abs(), e.abs()))
    one_step = (a - e).abs() <= torch.exp2((exp - 4).clamp_min(-9).float())
    mant, _ = torch.frexp(e)
    lost_carry = (mant.abs() == 0.5) & (a * e >= 0) & (a.abs() < e.abs()) & (a.abs() >= e.abs() / 2)
    assert torch.all(one_step | lost_carry), f"{what}: not the interpreter's fp8 fault: {a[:4]} vs {e[:4]}"
    assert differ.float().mean() < 0.2 if differ.numel() else True


def assert_pages_match(kind, scale, d_latent, got, want):
    """Compare two (data, scales) page sets: exact except e4m3 codes under the interpreter."""
    (data, scales), (data_r, scales_r) = got, want
    if kind == "bf16":
        assert_bitwise_equal(data, data_r, "bf16 pages")
    elif kind == "fp8_e4m3":
        assert_bitwise_equal(scales, scales_r, "scales")
        assert_fp8_codes_close(data, data_r, "e4m3 pages")
    else:
        raw, raw_r = data.view(-1, data.shape[-1]), data_r.view(-1, data.shape[-1])
        assert_bitwise_equal(raw[:, d_latent:].contiguous(), raw_r[:, d_latent:].contiguous(), "tile scales + rope")
        assert_fp8_codes_close(raw[:, :d_latent].contiguous().view(FP8), raw_r[:, :d_latent].contiguous().view(FP8),
                               "latent codes")


# --------------------------------------------------------------------------------------- reference
@pytest.mark.parametrize("kind,scale", FORMATS)
def test_reference_writes_quantize_kv_rows_at_the_slots_and_nothing_else(kind, scale):
    d_latent, d_rope, num_pages, page_size = 256, 64, 6, 16
    rows = torch.randn(37, d_latent + d_rope)
    data, scales = make_pages(kind, scale, num_pages, page_size, d_latent, d_rope)
    slots = random_slots(37, num_pages * page_size, seed=1, skip_frac=0.2)
    kv_append_reference(rows, slots, data, scales, kind, scale, d_latent)
    keep = slots >= 0
    want, want_s = quantize_kv_rows(rows[keep], kind, d_latent, scales if scale == "tensor" else None)
    flat = data.view(-1, data.shape[-1])
    assert_bitwise_equal(flat[slots[keep]], want, "written rows")
    if kind == "fp8_e4m3" and scale == "token":
        assert_bitwise_equal(scales.view(-1)[slots[keep]], want_s, "written scales")
    untouched = torch.ones(num_pages * page_size, dtype=torch.bool)
    untouched[slots[keep]] = False
    assert torch.all(flat[untouched].view(torch.uint8) == 0xFF), "a slot that was not addressed changed"
    if kind == "fp8_e4m3" and scale == "token":
        assert torch.isnan(scales.view(-1)[untouched]).all()


@pytest.mark.parametrize("kind,scale", FORMATS)
def test_roundtrip_error_is_within_the_format(kind, scale):
    d_latent, d_rope = 512, 64
    rows = torch.randn(50, d_latent + d_rope)
    data, scales = make_pages(kind, scale, 4, 16, d_latent, d_rope, tensor_scale=float(rows.abs().max()) / 448)
    slots = torch.arange(50)
    kv_append(rows, slots, data, scales, kind, scale, d_latent)
    flat = data.view(-1, data.shape[-1])[:50]
    s = scales.view(-1)[:50] if scale == "token" and scales is not None else scales
    back = dequantize_kv_rows(flat, s, kind, d_latent, d_rope)
    rel = ((back - rows).norm() / rows.norm()).item()
    assert rel < {"bf16": 4e-3, "fp8_e4m3": 0.06, "fp8_ds_mla": 0.06}[kind]
    if kind == "fp8_ds_mla":  # the rope part stays bf16
        assert torch.equal(back[:, d_latent:], rows[:, d_latent:].bfloat16().float())


# --------------------------------------------------------------------------------------- kernel vs reference
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])  # the fixture only sets the backend
@given(kind_scale=st.sampled_from(FORMATS), t=odd_sizes(1, 70), page_size=st.sampled_from([1, 16, 64]),
       dims=st.sampled_from([(128, 64), (256, 32), (512, 64)]), seed=st.integers(0, 2**31 - 1),
       skip=st.sampled_from([0.0, 0.3]), data=st.data())
def test_kernel_matches_reference(triton_backend, kind_scale, t, page_size, dims, seed, skip, data):
    kind, scale = kind_scale
    d_latent, d_rope = dims
    dev = triton_backend
    num_pages = -(-(t + 5) // page_size)
    dtype = torch.bfloat16 if not HAS_CUDA else data.draw(st.sampled_from([torch.bfloat16, torch.float32]))
    rows = data.draw(tensors((t, d_latent + d_rope), dtype=dtype)).to(dev)
    slots = random_slots(t, num_pages * page_size, seed, skip).to(dev)
    ts = float(rows.float().abs().max()) / 448 + 1e-6
    got = make_pages(kind, scale, num_pages, page_size, d_latent, d_rope, dev, ts)
    want = make_pages(kind, scale, num_pages, page_size, d_latent, d_rope, dev, ts)
    kv_append(rows, slots, *got, kind, scale, d_latent)
    kv_append_reference(rows, slots, *want, kind, scale, d_latent)
    assert_pages_match(kind, scale, d_latent, got, want)


@pytest.mark.parametrize("kind,scale", FORMATS)
def test_kernel_handles_non_finite_rows_like_the_reference(triton_backend, kind, scale):
    dev = triton_backend
    rows = torch.randn(9, 576, dtype=torch.bfloat16)
    rows[0, 3], rows[1, 100], rows[2, 520], rows[3, :] = float("inf"), float("nan"), -float("inf"), 0.0
    rows = rows.to(dev)
    slots = torch.tensor([4, 0, 7, 1, 8, 2, 3, 5, 6], device=dev)
    got = make_pages(kind, scale, 3, 4, 512, 64, dev, 0.02)
    want = make_pages(kind, scale, 3, 4, 512, 64, dev, 0.02)
    kv_append(rows, slots, *got, kind, scale, 512)
    kv_append_reference(rows, slots, *want, kind, scale, 512)
    assert_pages_match(kind, scale, 512, got, want)


@pytest.mark.parametrize("kind,scale", FORMATS[1:])
def test_kernel_rounds_exactly_like_the_fp8_quant_kernels(triton_backend, kind, scale):
    """The fp8_quant kernels are bit-exact with the shared references on the GPU; kv_append's kernel must do the
    same fp32 ops (a once-rounded reciprocal times x, not a per-element division). Same fp32 values give the same
    codes even through the interpreter's faulty e4m3 cast, so this comparison is exact on the CPU too."""
    dev = triton_backend
    torch.manual_seed(1)  # data on which a per-element division differs (checked on the interpreter too)
    t = 64
    rows = (torch.randn(t, 576) * torch.logspace(-2, 2, 576)).bfloat16().to(dev)
    data, scales = make_pages(kind, scale, 4, 16, 512, 64, dev, 0.3)
    slots = torch.arange(t, device=dev)
    kv_append(rows, slots, data, scales, kind, scale, 512)
    flat = data.view(-1, data.shape[-1])[:t]
    if kind == "fp8_e4m3":
        q, s = kv_quant_fp8(rows, scales if scale == "tensor" else None)
        assert_bitwise_equal(flat, q, "e4m3 codes vs kv_quant_fp8")
        assert_bitwise_equal(scales.view(-1)[:t] if scale == "token" else scales, s, "scales")
    else:
        q, s = act_quant_fp8(rows[:, :512].contiguous(), 128, ue8m0=True)
        raw = flat.view(torch.uint8)
        assert_bitwise_equal(raw[:, :512].contiguous().view(FP8), q, "latent codes vs act_quant_fp8")
        assert_bitwise_equal(raw[:, 512:528].contiguous().view(torch.float32), s, "tile scales")


def test_strided_rows_are_read_through_their_stride(triton_backend):
    dev = triton_backend
    wide = torch.randn(11, 700, dtype=torch.bfloat16, device=dev)
    rows = wide[:, :576]  # a view with row stride 700, e.g. a slice of the kv_a projection output
    slots = torch.arange(11, device=dev)
    got = make_pages("bf16", "token", 1, 16, 512, 64, dev)
    want = make_pages("bf16", "token", 1, 16, 512, 64, dev)
    kv_append(rows, slots, *got, "bf16", "token", 512)
    kv_append_reference(rows.contiguous(), slots, *want, "bf16", "token", 512)
    assert_bitwise_equal(got[0], want[0])


@pytest.mark.gpu
@pytest.mark.parametrize("kind,scale", FORMATS)
@pytest.mark.parametrize("t", [1, 63, 1000, 4096])
def test_gpu_bit_exact_large(kind, scale, t):
    torch.manual_seed(t)
    rows = (torch.randn(t, 576, device="cuda") * torch.logspace(-2, 2, 576, device="cuda")).bfloat16()
    slots = random_slots(t, 64 * 80, seed=t, skip_frac=0.1).cuda()
    got = make_pages(kind, scale, 80, 64, 512, 64, "cuda", 0.3)
    want = make_pages(kind, scale, 80, 64, 512, 64, "cuda", 0.3)
    kv_append(rows, slots, *got, kind, scale, 512)
    kv_append_reference(rows, slots, *want, kind, scale, 512)
    assert_bitwise_equal(got[0], want[0], "data")
    if got[1] is not None:
        assert_bitwise_equal(got[1], want[1], "scales")


@pytest.mark.gpu
def test_gpu_out_of_range_slots_are_never_written_when_unchecked():
    rows = torch.randn(4, 576, device="cuda").bfloat16()
    buffer = torch.full((4, 4, 576), 7.0, dtype=torch.bfloat16, device="cuda")
    data = buffer[1:3]  # contiguous pages with guard pages on both sides
    kv_append(rows, torch.tensor([1, 8, 2**40, 2], device="cuda"), data, None, "bf16", check_slots=False)
    torch.cuda.synchronize()
    flat = data.reshape(-1, 576)
    assert torch.equal(flat[1], rows[0]) and torch.equal(flat[2], rows[3])
    assert torch.all(buffer[0] == 7.0) and torch.all(buffer[3] == 7.0)


# --------------------------------------------------------------------------------------- bad input
def test_bad_input_is_named():
    data, scales = make_pages("fp8_e4m3", "token", 2, 4, 512, 64)
    rows = torch.randn(3, 576)
    with pytest.raises(IndexError, match="slot_mapping"):
        kv_append(rows, torch.tensor([0, 1, 8]), data, scales, "fp8_e4m3")
    with pytest.raises(IndexError, match="slot_mapping"):
        kv_append(rows, torch.tensor([0, -2, 1]), data, scales, "fp8_e4m3")
    with pytest.raises(ValueError, match="twice"):
        kv_append(rows, torch.tensor([0, 1, 1]), data, scales, "fp8_e4m3")
    with pytest.raises(TypeError, match="slot_mapping"):
        kv_append(rows, torch.tensor([0.0, 1.0, 2.0]), data, scales, "fp8_e4m3")
    with pytest.raises(ValueError, match="slot_mapping"):
        kv_append(rows, torch.tensor([0, 1]), data, scales, "fp8_e4m3")
    with pytest.raises(ValueError, match="scales"):
        kv_append(rows, torch.tensor([0, 1, 2]), data, None, "fp8_e4m3")
    with pytest.raises(ValueError, match="scales"):
        kv_append(rows, torch.tensor([0, 1, 2]), data, scales, "fp8_e4m3", scale="tensor")
    with pytest.raises(TypeError, match="data"):
        kv_append(rows, torch.tensor([0, 1, 2]), data, scales, "bf16")
    with pytest.raises(ValueError, match="data"):
        kv_append(torch.randn(3, 560), torch.tensor([0, 1, 2]), data, scales, "fp8_e4m3", d_latent=496)
    with pytest.raises(ValueError, match="kind"):
        kv_append(rows, torch.tensor([0, 1, 2]), data, scales, "int4")
    with pytest.raises(TypeError, match="rows"):
        kv_append(rows.to(torch.int32), torch.tensor([0, 1, 2]), data, scales, "fp8_e4m3")
    with pytest.raises(ValueError, match="d_latent"):
        kv_append(rows, torch.tensor([0, 1, 2]), data, scales, "fp8_e4m3", d_latent=576)
