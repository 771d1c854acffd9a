import json

import pytest
import torch
from hypothesis import given

import mla_quant as mq
from mla_quant.formats import BF16, FP8Block, Int4Group, KVFormat, format_from_dict
from mla_quant.testing import kv_formats, quantized_weights, sqnr_db, weight_formats

ALL = [BF16(), FP8Block(), FP8Block(block=(64, 128), act_quant=False, ue8m0=True), Int4Group(32),
       Int4Group(128, scale_dtype="float32"), KVFormat("bf16"), KVFormat("fp8_e4m3", "tensor"), KVFormat("fp8_ds_mla")]


@pytest.mark.parametrize("fmt", ALL, ids=repr)
def test_repr_and_dict_round_trip(fmt):
    ns = {c.__name__: c for c in (BF16, FP8Block, Int4Group, KVFormat)}
    assert eval(repr(fmt), ns) == fmt
    assert format_from_dict(json.loads(json.dumps(fmt.to_dict()))) == fmt
    assert hash(fmt) == hash(eval(repr(fmt), ns))


def test_formats_are_frozen():
    with pytest.raises(Exception):
        Int4Group().group_size = 64


def test_public_names():
    assert mq.formats.Int4Group(group_size=32).group_size == 32
    assert mq.formats.FP8Block(block=(128, 128)).block == (128, 128)
    assert mq.formats.KVFormat("fp8_ds_mla").kind == "fp8_ds_mla"


def test_bytes_per_element_include_scales():
    n, k = 2048, 7168  # a Kimi routed expert's gate_proj
    assert BF16().nbytes(n, k) == 2 * n * k
    assert FP8Block().nbytes(n, k) == n * k + 16 * 56 * 4
    assert Int4Group(32).nbytes(n, k) == n * k // 2 + n * k // 32 * 2 + 16
    assert Int4Group(32).nbytes(n, k) / BF16().nbytes(n, k) <= 0.29  # issue 5's bound
    assert Int4Group(32).bits_per_weight() == pytest.approx(4.5, abs=1e-3)


def test_kv_bytes_per_token():
    assert KVFormat("bf16").bytes_per_token() == 1152
    assert KVFormat("fp8_e4m3").bytes_per_token() == 580
    assert KVFormat("fp8_e4m3", "tensor").bytes_per_token() == 576
    assert KVFormat("fp8_ds_mla").bytes_per_token() == 656


@given(case=quantized_weights())
def test_dequantize_inverts_quantize_within_the_format_error(case):
    fmt, w, tensors = case
    deq = fmt.dequantize(tensors, torch.float32)
    assert deq.shape == w.shape
    floor = {"bf16": 40, "fp8_block": 18, "int4_g": 8}[fmt.name]  # heavy tails + outliers lower the SQNR
    assert sqnr_db(w, deq) > floor


@given(fmt=weight_formats(include_bf16=False))
def test_specs_describe_what_quantize_returns(fmt):
    w = torch.randn(130, 256)
    tensors = fmt.quantize(w)
    specs = fmt.tensor_specs(130, 256)
    assert set(tensors) == set(specs)
    for name, t in tensors.items():
        assert (tuple(t.shape), t.dtype) == specs[name], name


@given(fmt=kv_formats())
def test_kv_formats_halve_bf16_bytes_or_better(fmt):
    if fmt.quantized:
        assert fmt.bytes_per_token() <= 0.57 * KVFormat("bf16").bytes_per_token()


def test_bad_format_arguments():
    with pytest.raises(ValueError, match="group_size 48"):
        Int4Group(48)
    with pytest.raises(ValueError, match="kind 'int8'"):
        KVFormat("int8")
    with pytest.raises(ValueError, match="not divisible by group_size"):
        Int4Group(32).quantize(torch.randn(4, 40))
