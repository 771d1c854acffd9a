"""A SwiGLU MLP at one token: ``swiglu_pair_order`` (h = silu(gate) · up, put in pair order in one launch),
``w4a16_gemv_pairs`` (the half2 GEMV on those pairs) and ``w4a16_swiglu_gemv`` (the gate and up GEMVs and the SwiGLU in
one launch), each against its reference, and the MLP's one-token paths that use them."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mla_quant.formats import BF16, Int4Group
from mla_quant.kernels import int4_quant as I
from mla_quant.kernels._gemm_utils import plane_width
from mla_quant.kernels._half2_gemv import pair_order_reference, pair_values, swiglu_reference
from mla_quant.kernels.w4a16_gemm import (swiglu_pair_order, swiglu_pair_order_reference, w4a16_gemm,
                                          w4a16_gemv_pairs, w4a16_gemv_pairs_reference, w4a16_swiglu_gemv,
                                          w4a16_swiglu_gemv_reference)
from mla_quant.modules import mlp as mlp_module
from mla_quant.modules import PairedActivations, QuantLinear
from mla_quant.modules.mlp import MLP
from mla_quant.testing import assert_rel_close, odd_sizes, poisoned_empty

ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}  # one unit in the last place, relative to [1, 2)


def _gate_up(rows, k, dtype, dev, seed, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    gate = (torch.randn(rows, k, generator=g) * spread).to(dtype).to(dev)
    up = (torch.randn(rows, k, generator=g) * spread).to(dtype).to(dev)
    return gate, up


def _runs(t, k):
    """[R, K] -> [R, runs, 32] (zeros / False past K), a run being 32 consecutive K."""
    return torch.nn.functional.pad(t, (0, -k % 32)).view(t.shape[0], -1, 32)


def _per_element(t, k):
    """[R, runs] -> [R, K]: each run's value at its 32 elements."""
    return t.repeat_interleave(32, dim=1)[:, :k]


def _check_swiglu_pairs(gate, up, what):
    """The kernel's pairs are exactly pair order of some h (its own, rounded to gate's dtype); h has the reference's
    NaNs and infs, and elsewhere is the reference h within one unit of the dtype (the sigmoid's exp may differ in the
    last fp32 bit), nearly always equal. A run holding an inf or NaN is scaled by 2^121, so its finite values are not
    compared (the format keeps only the non-finite ones there)."""
    dtype, (rows, k) = gate.dtype, gate.shape
    pairs, scales = swiglu_pair_order(gate, up)
    assert pairs.shape == (rows, plane_width(k) // 2) and scales.shape == (rows, plane_width(k) // 32)
    pairs, scales = pairs.cpu(), scales.cpu()
    h = pair_values(pairs, scales, k)
    # pair order of its own h: the same values and run scales, except in runs holding a NaN (the kernel's run maximum
    # skips NaN, the reference's does not)
    own = pair_order_reference(h.to(dtype))
    clean = ~_runs(h.isnan(), k).any(-1)
    runs = clean.shape[1]
    assert torch.equal(own[1][:, :runs][clean], scales[:, :runs][clean]), f"{what}: run scales"
    keep = _per_element(clean, k)
    assert torch.equal(pair_values(*own, k)[keep], h[keep]), f"{what}: not pair order of h"
    ref = swiglu_reference(gate.cpu(), up.cpu()).float()
    assert torch.equal(h.isnan(), ref.isnan()), f"{what}: NaN positions"
    inf = ref.isinf()
    assert torch.equal(h.isinf(), inf) and torch.equal(h[inf], ref[inf]), f"{what}: infs"
    # the reference's h as its pairs hold it (values below 2^-24 of their run's largest are fp16 subnormals there)
    ref = pair_values(*swiglu_pair_order_reference(gate.cpu(), up.cpu()), k)
    ok = _per_element(~_runs(~ref.isfinite(), k).any(-1), k)
    floor = 2.0**-23 * _per_element(_runs(ref.abs(), k).amax(-1), k)
    diff = (h[ok] - ref[ok]).abs()
    assert (diff <= ULP[dtype] * ref[ok].abs() + floor[ok]).all(), f"{what}: h off by {diff.max().item()}"
    assert (diff > 0).sum().item() <= max(2, 0.01 * diff.numel()), \
        f"{what}: {(diff > 0).sum().item()} of {diff.numel()} h differ"
    return pairs, scales


@pytest.mark.parametrize("rows,k", [(1, 2048), (1, 300), (3, 256), (2, 96), (1, 2080)], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_swiglu_pair_order_matches_reference(triton_backend, rows, k, dtype):
    """Odd K (a run and a 256-wide block cut by K: zeros past it), several rows, both activation dtypes."""
    gate, up = _gate_up(rows, k, dtype, triton_backend, seed=rows * k)
    _check_swiglu_pairs(gate, up, f"{rows}x{k} {dtype}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_swiglu_pair_order_special_values(triton_backend, dtype):
    """Zeros, a run of tiny and a run of huge gates, ±inf and NaN: each run scaled on its own, NaN and inf where the
    reference has them (silu(-inf) · up is NaN as in torch, silu(+inf) · up is ±inf)."""
    gate, up = _gate_up(1, 512, dtype, triton_backend, seed=7)
    big = 6e4 if dtype == torch.float16 else 1e30
    gate[0, 0:32] = 0
    gate[0, 32:64] *= 1e-3
    gate[0, 64:96] = big / 4 * torch.sign(gate[0, 64:96])
    up[0, 64:96] = 2.0
    gate[0, 100], gate[0, 101], gate[0, 102] = float("inf"), float("-inf"), float("nan")
    up[0, 200] = float("nan")
    _check_swiglu_pairs(gate, up, f"special {dtype}")


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=10, deadline=None)
@given(rows=st.integers(1, 3), k=odd_sizes(1, 700), dtype=st.sampled_from([torch.bfloat16, torch.float16]),
       spread=st.sampled_from([1e-3, 1.0, 8.0]), seed=st.integers(0, 2**31 - 1))
def test_swiglu_pair_order_over_shapes(triton_backend, rows, k, dtype, spread, seed):
    """Any row count, any K, gates from 1e-3 to 8 (saturated SiLU): pair order of h, h the reference's."""
    gate, up = _gate_up(rows, k, dtype, triton_backend, seed, spread)
    _check_swiglu_pairs(gate, up, f"{rows}x{k} {dtype} *{spread}")


def test_swiglu_pair_order_reference_on_cpu(torch_backend):
    """The torch backend returns the reference: pair order of the once-rounded h, bit for bit."""
    gate, up = _gate_up(2, 300, torch.bfloat16, torch_backend, seed=3)
    pairs, scales = swiglu_pair_order(gate, up)
    want = swiglu_pair_order_reference(gate, up)
    assert torch.equal(pairs, want[0]) and torch.equal(scales, want[1])
    assert torch.equal(pair_values(pairs, scales, 300), swiglu_reference(gate, up).float())


def test_swiglu_pair_order_rejects_bad_input():
    gate = torch.randn(1, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="up: shape"):
        swiglu_pair_order(gate, gate[:, :32].contiguous())
    with pytest.raises((TypeError, ValueError), match="up"):
        swiglu_pair_order(gate, gate.half())
    with pytest.raises((TypeError, ValueError), match="gate"):
        swiglu_pair_order(gate.float(), gate.float())
    with pytest.raises(ValueError, match="contiguous"):
        wide = torch.randn(1, 128, dtype=torch.bfloat16)
        swiglu_pair_order(wide[:, ::2], wide[:, 1::2])


def _int4(n, k, group, dtype, dev, seed):
    g = torch.Generator().manual_seed(seed)
    packed, scale = I.int4_quantize_reference(torch.randn(n, k, generator=g), group, dtype)
    return packed.to(dev), scale.to(dev)


@pytest.mark.parametrize("n,k,group", [(13, 2048, 32), (64, 448, 32), (20, 384, 128), (9, 2080, 32)], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w4a16_gemv_pairs_is_the_half2_gemv(triton_backend, n, k, group, dtype):
    """On pairs made by ``swiglu_pair_order`` the GEMV matches its reference at bf16 level, and gives the bits of
    ``w4a16_gemm(gemv="rows_half2")`` on the h those pairs hold (same tile, same pairs: it only skips making them)."""
    dev = triton_backend
    packed, scale = _int4(n, k, group, dtype, dev, seed=n + k)
    gate, up = _gate_up(1, k, dtype, dev, seed=k)
    pairs, scales = swiglu_pair_order(gate, up)
    out = poisoned_empty((1, n), dtype, dev)
    y = w4a16_gemv_pairs(pairs, scales, packed, scale, group, dtype=dtype, out=out)
    assert y.data_ptr() == out.data_ptr() and y.dtype == dtype
    what = f"{n}x{k} g{group} {dtype}"
    ref = w4a16_gemv_pairs_reference(pairs.cpu(), scales.cpu(), packed.cpu(), scale.cpu(), group, dtype=dtype)
    assert_rel_close(y.float().cpu(), ref.float(), 1e-2, what)
    h = pair_values(pairs.cpu(), scales.cpu(), k).to(dtype).to(dev)
    same = w4a16_gemm(h, packed, scale, group, gemv="rows_half2")
    assert torch.equal(y, same), f"{what}: not the half2 GEMV's bits"


def test_w4a16_gemv_pairs_rejects_bad_input():
    packed, scale = _int4(8, 256, 32, torch.bfloat16, "cpu", 0)
    pairs, scales = pair_order_reference(torch.randn(1, 256, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="one token"):
        w4a16_gemv_pairs(pairs.expand(2, -1).contiguous(), scales.expand(2, -1).contiguous(), packed, scale)
    with pytest.raises(ValueError, match="for K = 512"):
        w4a16_gemv_pairs(pairs, scales, *_int4(8, 512, 32, torch.bfloat16, "cpu", 0))
    with pytest.raises(ValueError, match="dtype"):
        w4a16_gemv_pairs(pairs, scales, packed, scale, dtype=torch.float32)
    with pytest.raises(ValueError, match="out: shape"):
        w4a16_gemv_pairs(pairs, scales, packed, scale, out=torch.empty(1, 9, dtype=torch.bfloat16))
    with pytest.raises((TypeError, ValueError), match="pairs"):
        w4a16_gemv_pairs(pairs.float(), scales, packed, scale)


@pytest.mark.parametrize("inter,k,group", [(37, 448, 32), (20, 2048, 64), (9, 256, 128)], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w4a16_swiglu_gemv_matches_reference(triton_backend, inter, k, group, dtype):
    """Gate and up in one launch: h matches the reference (fp32 sums, one rounding) at bf16 level, into a poisoned
    output; an x that is not 16-byte aligned (its pairs from a pair_order launch) gives the same bits."""
    dev = triton_backend
    gp, gs = _int4(inter, k, group, dtype, dev, seed=inter)
    upk, us = _int4(inter, k, group, dtype, dev, seed=inter + 1)
    wide = (torch.randn(1, k + 1) * 2).to(dtype).to(dev)
    x = wide[:, 1:].clone()
    out = poisoned_empty((1, inter), dtype, dev)
    h = w4a16_swiglu_gemv(x, gp, gs, upk, us, group, out=out)
    assert h.data_ptr() == out.data_ptr()
    ref = w4a16_swiglu_gemv_reference(x.cpu(), gp.cpu(), gs.cpu(), upk.cpu(), us.cpu(), group)
    what = f"{inter}x{k} g{group} {dtype}"
    assert_rel_close(h.float().cpu(), ref.float(), 1e-2, what)
    wide[:, 1:] = x
    assert torch.equal(w4a16_swiglu_gemv(wide[:, 1:], gp, gs, upk, us, group), h), f"{what}: unaligned x"


def test_w4a16_swiglu_gemv_rejects_bad_input():
    gp, gs = _int4(8, 256, 32, torch.bfloat16, "cpu", 0)
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one token"):
        w4a16_swiglu_gemv(x.expand(2, -1), gp, gs, gp, gs)
    with pytest.raises(ValueError, match="up_packed"):
        w4a16_swiglu_gemv(x, gp, gs, *_int4(9, 256, 32, torch.bfloat16, "cpu", 0))
    with pytest.raises((TypeError, ValueError), match="x"):
        w4a16_swiglu_gemv(x.float(), gp, gs, gp, gs)
    with pytest.raises(ValueError, match="out: shape"):
        w4a16_swiglu_gemv(x, gp, gs, gp, gs, out=torch.empty(1, 9, dtype=torch.bfloat16))


def _mlp(hidden, inter, dtype, dev, seed=0):
    """An MLP with an INT4 down projection; gate and up in BF16 (the path does not depend on their format, and the
    interpreter's 2048-row GEMVs would take a minute)."""
    torch.manual_seed(seed)
    mlp = MLP(hidden, inter, fmt=BF16(), dtype=dtype, device=dev)
    mlp.down_proj.convert_format_(Int4Group(group_size=32))
    for proj in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        proj.set_weight(torch.randn(proj.out_features, proj.in_features) * proj.in_features**-0.5)
    return mlp


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mlp_one_token_takes_the_swiglu_pairs(triton_backend, dtype, monkeypatch):
    """One token through an INT4 MLP whose down projection has rows of at least ``HALF2_MIN_ROW_WORDS`` words: h goes
    to the down GEMV in pair order, made by ``swiglu_pair_order``; the result is the eager SwiGLU's at bf16 level
    and, on the same h, the bits of the down projection on x."""
    dev = triton_backend
    mlp = _mlp(16, 2048, dtype, dev)
    x = torch.randn(1, 16, device=dev).to(dtype)
    calls = []
    made = mlp_module.swiglu_pair_order
    monkeypatch.setattr(mlp_module, "swiglu_pair_order", lambda g, u: calls.append(g.shape) or made(g, u))
    y = mlp(x)
    assert calls == [(1, 2048)], "the one-token MLP did not make h's pairs"
    pairs, scales = made(mlp.gate_proj(x), mlp.up_proj(x))
    h = pair_values(pairs.cpu(), scales.cpu(), 2048).to(dtype).to(dev)
    assert torch.equal(y, mlp.down_proj(h)), "the down projection on h's pairs is not its GEMV on h"
    with monkeypatch.context() as m:
        m.setattr(mlp_module, "SWIGLU_PAIRS", False)
        eager = mlp(x)
    assert len(calls) == 1
    assert_rel_close(y.float(), eager.float(), 2e-2, f"one token {dtype} vs the eager SwiGLU")
    y2 = mlp(x.expand(3, -1).contiguous())  # three tokens: the eager SwiGLU
    assert len(calls) == 1 and y2.shape == (3, 16)
    # the pairs go through down_proj's __call__: a forward hook (tensor parallelism's all-reduce) sees the output
    handle = mlp.down_proj.register_forward_hook(lambda module, args, out: out * 2)
    assert torch.equal(mlp(x), 2 * y) and len(calls) == 2
    handle.remove()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mlp_one_token_runs_gate_and_up_in_one_launch(triton_backend, dtype, monkeypatch):
    """INT4 gate and up (hidden 2048): one ``w4a16_swiglu_gemv`` launch makes h, which is the reference's at bf16
    level, and the MLP's result is the down projection of that h; a forward hook on gate_proj (which the fused
    launch would skip) sends the call back through the layers, as does turning the setting off."""
    dev = triton_backend
    torch.manual_seed(1)
    mlp = MLP(2048, 8, fmt=BF16(), dtype=dtype, device=dev)
    for proj in (mlp.gate_proj, mlp.up_proj):
        proj.convert_format_(Int4Group(group_size=32))
    for proj in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        proj.set_weight(torch.randn(proj.out_features, proj.in_features) * proj.in_features**-0.5)
    x = torch.randn(1, 2048, device=dev).to(dtype)
    made, calls = mlp_module.w4a16_swiglu_gemv, []
    monkeypatch.setattr(mlp_module, "w4a16_swiglu_gemv", lambda *a, **k: calls.append(1) or made(*a, **k))
    y = mlp(x)
    assert calls == [1], "the one-token INT4 MLP did not run gate and up in one launch"
    g, u = mlp.gate_proj, mlp.up_proj
    h = made(x, g.weight_packed, g.weight_scale, u.weight_packed, u.weight_scale, 32)
    ref = w4a16_swiglu_gemv_reference(x.cpu(), g.weight_packed.cpu(), g.weight_scale.cpu(), u.weight_packed.cpu(),
                                      u.weight_scale.cpu(), 32)
    assert_rel_close(h.float().cpu(), ref.float(), 1e-2, f"h {dtype}")
    assert torch.equal(y, mlp.down_proj(h))
    handle = mlp.gate_proj.register_forward_hook(lambda module, args, out: out)
    hooked = mlp(x)
    handle.remove()
    with monkeypatch.context() as m:
        m.setattr(mlp_module, "GATE_UP_IN_ONE_LAUNCH", False)
        plain = mlp(x)
    assert len(calls) == 1 and torch.equal(hooked, plain)
    assert_rel_close(y.float(), plain.float(), 3e-2, f"one launch vs the layers {dtype}")


def test_mlp_repr_names_its_widths():
    assert "hidden_size=64, intermediate_size=32" in repr(MLP(64, 32))


def test_quant_linear_on_pairs_needs_int4():
    """A layer whose weight is not Int4Group refuses pair-ordered activations, naming why."""
    layer = QuantLinear(256, 8, fmt=BF16())
    pairs = PairedActivations(*pair_order_reference(torch.randn(1, 256, dtype=torch.bfloat16)))
    with pytest.raises(ValueError, match="Int4Group"):
        layer(pairs)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden,inter", [(7168, 2048), (7168, 18432), (6144, 12288)], ids=str)
def test_gpu_mlp_pairs_at_real_widths(hidden, inter):
    """Kimi K2.6's shared expert and dense MLP, GLM 5.2's dense MLP, one token, compiled: the down GEMV on the SwiGLU's
    pairs gives the bits of ``w4a16_gemm``'s half2 GEMV on the h they hold (plainly and with the weights before the
    PDL wait); gate and up in one launch match their reference; the MLP on either path gives the eager SwiGLU's result
    at bf16 level."""
    torch.manual_seed(hidden + inter)
    mlp = MLP(hidden, inter, fmt=Int4Group(group_size=32), device="cuda")
    for proj in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        proj.set_weight(torch.randn(proj.out_features, proj.in_features, device="cuda") * proj.in_features**-0.5)
    x = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
    gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    pairs, scales = _check_swiglu_pairs(gate, up, f"{hidden}x{inter}")
    pairs, scales = pairs.cuda(), scales.cuda()
    h = pair_values(pairs.cpu(), scales.cpu(), inter).bfloat16().cuda()
    t = mlp.down_proj.tensors
    for prefetch in (False, True):
        y = w4a16_gemv_pairs(pairs, scales, t["weight_packed"], t["weight_scale"], 32, prefetch_weights=prefetch)
        same = w4a16_gemm(h, t["weight_packed"], t["weight_scale"], 32, gemv="rows_half2", prefetch_weights=prefetch)
        assert torch.equal(y, same), f"{hidden}x{inter} prefetch={prefetch}: not the half2 GEMV's bits"
    g, u = mlp.gate_proj, mlp.up_proj
    h = w4a16_swiglu_gemv(x, g.weight_packed, g.weight_scale, u.weight_packed, u.weight_scale, 32)
    ref = w4a16_swiglu_gemv_reference(x, g.weight_packed, g.weight_scale, u.weight_packed, u.weight_scale, 32)
    assert_rel_close(h.float(), ref.float(), 1e-2, f"{hidden}x{inter}: gate and up in one launch")
    y = mlp(x)  # gate and up in one launch
    with pytest.MonkeyPatch.context() as m:
        m.setattr(mlp_module, "GATE_UP_IN_ONE_LAUNCH", False)
        on_pairs = mlp(x)
        m.setattr(mlp_module, "SWIGLU_PAIRS", False)
        eager = mlp(x)
    assert_rel_close(y.float(), eager.float(), 2e-2, f"{hidden}x{inter}: one launch vs the eager SwiGLU")
    assert_rel_close(on_pairs.float(), eager.float(), 2e-2, f"{hidden}x{inter}: pairs vs the eager SwiGLU")
