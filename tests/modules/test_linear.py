"""QuantLinear: the chokepoint's compute path per format equals its reference math."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from mla_quant.formats import BF16, FP8Block, Int4Group
from mla_quant.kernels import fp8_quant
from mla_quant.modules import QuantLinear, quant_linear, quant_linear_reference
from mla_quant.testing import assert_bitwise_equal, assert_rel_close, sqnr_db, weight_formats
from tests.conftest import FP8_MMA_REL_TOL, HAS_CUDA

FORMATS = [BF16(), FP8Block(), FP8Block(act_quant=False), FP8Block(block=(64, 128)), Int4Group(32),
           Int4Group(64), Int4Group(128)]


def _layer(fmt, n=70, k=256, dtype=torch.float32, bias=False, seed=0, device="cpu"):
    """A layer built on ``device`` (its weight quantized there) from CPU-seeded values; returns (layer, w)."""
    g = torch.Generator().manual_seed(seed)
    layer = QuantLinear(k, n, bias=bias, fmt=fmt, dtype=dtype, device=device)
    w = (torch.randn(n, k, generator=g) * 0.05).to(device)
    layer.set_weight(w)
    if bias:
        with torch.no_grad():
            layer.bias.copy_(torch.randn(n, generator=g))
    return layer, w


@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_path_equals_reference_math(triton_backend, monkeypatch, fmt, dtype):
    if not HAS_CUDA:  # the interpreter's fp32 -> e4m3 cast rounds wrongly: quantize activations in torch
        monkeypatch.setattr(fp8_quant, "act_quant_fp8", fp8_quant.act_quant_fp8_reference)
    layer, _ = _layer(fmt, dtype=dtype, bias=True, device=triton_backend)
    x = torch.randn(2, 5, 256, device=triton_backend).to(dtype)
    y = layer(x)
    ref = quant_linear_reference(x, layer.fmt, layer.tensors, layer.bias)
    assert y.shape == (2, 5, 70) and y.dtype == dtype
    # W8A8 in fp32: the reference accumulates e4m3 products in fp32, Hopper's fp8 MMA with fewer bits (conftest)
    fp32_tol = FP8_MMA_REL_TOL if isinstance(fmt, FP8Block) and fmt.act_quant else 1e-5
    assert_rel_close(y.float(), ref.float(), fp32_tol if dtype == torch.float32 else 2e-2, repr(fmt))


def test_bf16_format_is_exactly_nn_linear():
    lin = nn.Linear(96, 40, bias=True)
    ql = QuantLinear.from_linear(lin)
    x = torch.randn(7, 96)
    assert ql.fmt == BF16() and ql.dtype == torch.float32
    assert_bitwise_equal(ql(x), lin(x), "BF16 QuantLinear vs nn.Linear")


def test_w8a8_reference_rounds_activations_per_token_group(torch_backend):
    layer, _ = _layer(FP8Block())
    x = torch.randn(3, 256)
    q, s = fp8_quant.act_quant_fp8_reference(x, 128)
    xs = (q.float().reshape(3, 2, 128) * s[..., None]).reshape(3, 256)
    expected = xs @ layer.weight_dequantized(torch.float32).T
    assert_bitwise_equal(layer(x), expected, "W8A8 on CPU")


def test_weight_only_fp8_and_int4_use_the_dequantized_weight(torch_backend):
    for fmt in (FP8Block(act_quant=False), Int4Group(32)):
        layer, _ = _layer(fmt)
        x = torch.randn(4, 256)
        assert_bitwise_equal(layer(x), x @ layer.weight_dequantized(torch.float32).T, repr(fmt))


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])  # the fixture only sets the backend
@given(fmt=weight_formats(), m=st.integers(1, 20), seed=st.integers(0, 2**31 - 1))
def test_quantized_output_tracks_the_dense_layer(triton_backend, fmt, m, seed):
    layer, w = _layer(fmt, n=33, k=256, seed=seed, device=triton_backend)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(seed)).to(triton_backend)
    floor = {"bf16": 60, "fp8_block": 20, "int4_g": 10}[fmt.name]
    assert sqnr_db((x @ w.T).cpu(), layer(x).cpu()) > floor


def test_forced_reference_kernel_field(triton_backend):
    fmt = Int4Group(32, kernel="torch")
    layer, _ = _layer(fmt, device=triton_backend)
    x = torch.randn(3, 256, device=triton_backend)
    assert torch.equal(layer(x), quant_linear_reference(x, fmt, layer.tensors))


@pytest.mark.parametrize("fmt", [FP8Block(), Int4Group(32)], ids=repr)
def test_a_cpu_weight_is_quantized_on_the_layers_device(triton_backend, fmt):
    """set_weight moves the dense weight to the layer first: a CPU weight on a CUDA layer is quantized by the
    CUDA kernel (bit-identical to quantizing a CUDA copy), not by the CPU path."""
    w = torch.randn(33, 256) * 0.05
    layer = QuantLinear(256, 33, fmt=fmt, device=triton_backend)
    layer.set_weight(w)
    same, _ = _layer(fmt, n=33, device=triton_backend)
    same.set_weight(w.to(triton_backend))
    for name, t in layer.tensors.items():
        assert t.device.type == torch.device(triton_backend).type, name
        assert_bitwise_equal(t, same.tensors[name], name)
    assert sqnr_db(w, layer.weight_dequantized().cpu()) > 15


def test_convert_between_storage_equal_formats_keeps_the_bits():
    layer, _ = _layer(FP8Block())
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    layer.convert_format_(FP8Block(act_quant=False))
    assert layer.fmt == FP8Block(act_quant=False)
    for k, v in layer.state_dict().items():
        assert_bitwise_equal(v, before[k], k)


def test_convert_format_requantizes_and_state_dict_keys_follow():
    layer, w = _layer(BF16())
    layer.convert_format_(Int4Group(32))
    assert set(layer.state_dict()) == {"weight_packed", "weight_scale", "weight_shape"}
    assert layer.weight_shape.tolist() == [70, 256]
    assert sqnr_db(w, layer.weight_dequantized()) > 15
    layer.convert_format_(FP8Block())
    assert set(layer.state_dict()) == {"weight", "weight_scale_inv"}
    assert layer.weight.dtype == fp8_quant.FP8


@pytest.mark.parametrize("m", [1, 5, 16, 27, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_layer_keeps_its_split_k_counters_zero(triton_backend, m, dtype):
    """An Int4Group layer passes its kept counters (N entries, a plain attribute: not in the state dict or the
    buffers) to the W4A16 GEMM for up to COUNTERS_MAX_TOKENS (32) tokens (27 bf16 tokens: the fragment kernel's four
    token tiles; fp32: the tiles): the output equals the functional call bit for bit and the counters are zero after
    every call; above that the GEMM allocates its own."""
    from mla_quant.kernels.w4a16_gemm import w4a16_gemm

    layer, _ = _layer(Int4Group(32), n=72, k=1024, dtype=dtype, device=triton_backend)  # 4 K blocks: split-K runs
    dev = torch.device(triton_backend)
    counters = layer.split_k_counters(dev)
    assert counters.dtype == torch.int32 and counters.numel() == 72 and counters is layer.split_k_counters(dev)
    assert "_split_k_counters" not in dict(layer.named_buffers()) and "_split_k_counters" not in layer.state_dict()
    x = torch.randn(m, 1024, device=triton_backend).to(dtype)
    for _ in range(2):
        y = layer(x)
        assert not counters.any()
    assert_bitwise_equal(y, w4a16_gemm(x, layer.weight_packed, layer.weight_scale, 32), f"M={m}")


def test_from_linear_in_a_quantized_format():
    lin = nn.Linear(256, 20, bias=False)
    ql = QuantLinear.from_linear(lin, Int4Group(32))
    assert isinstance(ql.fmt, Int4Group) and ql.bias is None
    assert sqnr_db(lin.weight.detach(), ql.weight_dequantized()) > 15


def test_bad_input_is_named():
    layer, _ = _layer(BF16())
    with pytest.raises(ValueError, match="input has 10 features, expected 256"):
        layer(torch.randn(2, 10))
    with pytest.raises(ValueError, match="set_weight: shape"):
        layer.set_weight(torch.randn(3, 3))
    with pytest.raises(ValueError, match="not divisible by group_size"):
        QuantLinear(100, 8, fmt=Int4Group(32))
    with pytest.raises(TypeError, match="no compute path"):
        quant_linear(torch.randn(2, 4), object(), {})


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
def test_gpu_layer_matches_reference(fmt):
    layer, _ = _layer(fmt, n=1000, k=1024, dtype=torch.bfloat16, bias=True)
    layer.cuda()
    for m in (1, 7, 300):
        x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
        ref = quant_linear_reference(x.float(), layer.fmt, layer.tensors, layer.bias.float())
        assert_rel_close(layer(x).float(), ref, 2e-2, f"{fmt!r} M={m}")


@pytest.mark.gpu
@pytest.mark.parametrize("warm_first", [True, False])
def test_gpu_int4_layer_counters_under_cuda_graph_capture(warm_first):
    """Kept counters made by an eager call serve the captured graph; a layer first called inside a capture makes
    none there (the GEMM zeroes its own in the graph). Either way replays match the eager output and leave the
    counters zero."""
    layer, _ = _layer(Int4Group(32), n=2048, k=7168, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(8, 7168, device="cuda", dtype=torch.bfloat16)
    ref = quant_linear(x, layer.fmt, layer.tensors)  # no kept counters
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        if warm_first:
            layer(x)
        else:  # compile the kernels outside the capture without making the layer's counters
            quant_linear(x, layer.fmt, layer.tensors)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = layer(x)
    assert ("_split_k_counters" in layer.__dict__) == warm_first
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise_equal(y, ref, f"warm_first={warm_first}")
    if warm_first:
        assert not layer.split_k_counters(x.device).any()
    assert_bitwise_equal(layer(x), ref, "eager after the graph")
