import pytest
import torch

from mla_quant.formats import BF16, Int4Group
from mla_quant.modules import MoE, qat
from mla_quant.testing import assert_bitwise_equal
from tests.modules.test_moe import PROJ, make_moe


@pytest.mark.parametrize("group", [32, 128])
def test_fake_quant_is_the_int4_grid_with_straight_through_gradient(group):
    w = torch.randn(48, 256, requires_grad=True)
    fmt = Int4Group(group)
    fq = qat.fake_quant_int4(w, fmt)
    assert torch.equal(fq, fmt.dequantize(fmt.quantize(w.detach()), torch.float32))
    upstream = torch.randn_like(w)
    (fq * upstream).sum().backward()
    assert torch.equal(w.grad, upstream)  # d fq / d w = identity
    frozen = fmt.quantize(w.detach())["weight_scale"] * 2  # fixed scales: codes on that grid
    assert torch.equal(qat.fake_quant_int4(w, fmt, frozen),
                       fmt.dequantize({"weight_packed": qat.export_int4(w, fmt, frozen)["weight_packed"],
                                       "weight_scale": frozen}, torch.float32))


def _train(m: MoE, steps: int = 3) -> None:
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.05)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(16, m.hidden_size, generator=g)
        loss = m(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("start", [BF16(), Int4Group(32)], ids=repr)
def test_qat_then_export_serves_exactly_what_was_trained(start, frozen):
    m = make_moe(start, e=6, k=2)
    x = torch.randn(11, 128)
    with torch.no_grad():
        before = m(x)
    qat.enable_qat_(m, qat.QATConfig(Int4Group(32), frozen_scales=frozen))
    assert m.experts.qat is not None and m.experts.gate_proj_weight.requires_grad
    with torch.no_grad():
        fq = m(x)
    if isinstance(start, Int4Group) and frozen:
        assert torch.equal(fq, before)  # from an INT4 checkpoint with its scales: nothing changed yet
    _train(m)
    with torch.no_grad():
        trained = m(x)
    assert not torch.equal(trained, fq)
    qat.export_qat_(m)
    assert m.experts.qat is None and m.experts.fmt == Int4Group(32)
    assert m.experts.gate_proj_weight_packed.dtype == torch.int32
    with torch.no_grad():
        served = m(x)
    assert torch.equal(served, trained)  # the INT4 model computes what the fake-quant forward computed


def test_gradients_reach_the_active_masters_only():
    m = make_moe(Int4Group(32), e=8, k=1, shared=0)
    qat.enable_qat_(m)
    x = torch.randn(3, 128)
    _, ids = m.gate(x)
    m(x).sum().backward()
    grad = m.experts.down_proj_weight.grad
    used = set(ids.flatten().tolist())
    for e in range(8):
        assert (grad[e].abs().sum() > 0) == (e in used)


def test_qat_state_dict_holds_the_masters():
    m = make_moe(Int4Group(32), e=2, shared=0)
    qat.enable_qat_(m, qat.QATConfig(frozen_scales=True))
    sd = m.state_dict()
    assert {k for k in sd if k.startswith("experts.")} == {f"experts.{e}.{p}.{s}" for e in range(2) for p in PROJ
                                                            for s in ("weight", "weight_scale")}
    twin = make_moe(Int4Group(32), e=2, shared=0, seed=5)
    qat.enable_qat_(twin, qat.QATConfig(frozen_scales=True))
    twin.load_state_dict(sd)
    for key, t in sd.items():
        assert_bitwise_equal(twin.state_dict()[key], t, key)


def test_mode_errors():
    m = make_moe(BF16(), e=2, shared=0)
    with pytest.raises(RuntimeError, match="not in QAT"):
        m.experts.export_qat_()
    qat.enable_qat_(m)
    with pytest.raises(RuntimeError, match="already"):
        m.experts.enable_qat_()
    with pytest.raises(RuntimeError, match="export_qat_"):
        m.experts.convert_format_(Int4Group(32))
