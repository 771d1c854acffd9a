import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from mla_quant.formats import BF16, FP8Block, Int4Group
from mla_quant.kernels.fp8_quant import act_quant_fp8_reference
from mla_quant.modules import MLP, MoE, StackedExperts
from mla_quant.testing import assert_bitwise_equal, assert_rel_close, rel_err

PROJ = ("gate_proj", "up_proj", "down_proj")
EXACT_FORMATS = [BF16(), Int4Group(32), Int4Group(64), Int4Group(128), FP8Block(act_quant=False)]


def make_moe(fmt, hidden=128, inter=128, e=8, k=2, n_group=1, topk_group=1, shared=1, seed=0, dtype=torch.float32,
             shared_fmt=None, device="cpu", **kw):
    torch.manual_seed(seed)
    m = MoE(hidden, inter, e, k, n_shared_experts=shared, n_group=n_group, topk_group=topk_group,
            routed_scaling_factor=2.5, expert_fmt=fmt, shared_fmt=shared_fmt, dtype=dtype, device=device, **kw)
    with torch.no_grad():
        for p in PROJ:
            n, kk = m.experts.proj_shape(p)
            for i in range(e):
                m.experts.set_expert_weight(i, p, torch.randn(n, kk, device=device) / kk**0.5)
        m.gate.weight.normal_()
        m.gate.e_score_correction_bias.uniform_(-0.1, 0.1)
        if m.shared_experts is not None:
            for lin in (m.shared_experts.gate_proj, m.shared_experts.up_proj, m.shared_experts.down_proj):
                lin.set_weight(torch.randn(lin.out_features, lin.in_features, device=device) / lin.in_features**0.5)
    return m


@torch.no_grad()
def naive_layer(m: MoE, x: torch.Tensor, w8a8_group: int | None = None) -> torch.Tensor:
    """Token by token on the dequantized weights in fp64 (with the W8A8 activation rounding if asked)."""
    dense = {}

    def expert(e):
        if e not in dense:
            dense[e] = [m.experts.expert_weight(e, p).double() for p in PROJ]
        return dense[e]

    def act(a):
        if w8a8_group is None:
            return a.double()
        q, s = act_quant_fp8_reference(a.float()[None], w8a8_group)
        return (q.double().unflatten(-1, (-1, w8a8_group)) * s[..., None]).flatten(-2)[0]

    tokens = x.reshape(-1, m.hidden_size)
    weights, ids = m.gate(tokens)
    out = torch.zeros(tokens.shape, dtype=torch.float64)
    for t in range(tokens.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            wg, wu, wd = expert(e)
            h = (F.silu(wg @ act(tokens[t])) * (wu @ act(tokens[t]))).to(x.dtype)
            out[t] += float(weights[t, j]) * (wd @ act(h))
        if m.shared_experts is not None:
            s = m.shared_experts
            wg, wu, wd = (lin.weight_dequantized().double() for lin in (s.gate_proj, s.up_proj, s.down_proj))
            out[t] += wd @ (F.silu(wg @ tokens[t].double()) * (wu @ tokens[t].double()))
    return out.reshape(x.shape)


@pytest.mark.parametrize("fmt", EXACT_FORMATS, ids=repr)
def test_layer_equals_fp32_reference_on_dequantized_weights(fmt):
    m = make_moe(fmt, n_group=4, topk_group=2, k=3)
    x = torch.randn(2, 5, 128)
    with torch.no_grad():
        y = m(x)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert rel_err(y, naive_layer(m, x)) < 1e-5


def test_w8a8_layer_rounds_activations_per_token():
    m = make_moe(FP8Block(), shared_fmt=BF16())
    x = torch.randn(7, 128)
    with torch.no_grad():
        y = m(x)
    assert rel_err(y, naive_layer(m, x, w8a8_group=128)) < 1e-5
    assert rel_err(y, naive_layer(m, x)) > 1e-4  # the rounding is really there


@settings(max_examples=15)
@given(t=st.integers(1, 40), cfg=st.sampled_from([(4, 1, 1, 1), (8, 2, 1, 2), (16, 4, 2, 4), (12, 3, 2, 3),
                                                  (6, 1, 1, 6)]),
       fmt=st.sampled_from(EXACT_FORMATS), shared=st.integers(0, 2), seed=st.integers(0, 1000))
def test_hypothesis_layer(t, cfg, fmt, shared, seed):
    e, n_group, topk_group, k = cfg
    m = make_moe(fmt, hidden=128, inter=128, e=e, k=k, n_group=n_group, topk_group=topk_group, shared=shared,
                 seed=seed)
    x = torch.randn(t, 128)
    with torch.no_grad():
        assert rel_err(m(x), naive_layer(m, x)) < 1e-5


def test_module_names_and_state_dict_keys_are_the_checkpoints():
    m = make_moe(Int4Group(32), e=3, shared=2)
    keys = set(m.state_dict())
    expected = {"gate.weight", "gate.e_score_correction_bias"}
    expected |= {f"experts.{e}.{p}.{s}" for e in range(3) for p in PROJ
                 for s in ("weight_packed", "weight_scale", "weight_shape")}
    expected |= {f"shared_experts.{p}.weight" for p in PROJ}
    assert keys == expected
    assert m.shared_experts.gate_proj.out_features == 2 * 128
    sd = m.state_dict()
    packed = sd["experts.1.down_proj.weight_packed"]
    assert packed.shape == (128, 16) and packed.dtype == torch.int32
    assert sd["experts.1.gate_proj.weight_scale"].dtype == torch.bfloat16
    assert sd["experts.2.down_proj.weight_shape"].tolist() == [128, 128]
    assert MoE(64, 32, 4, 2, n_shared_experts=0, dtype=torch.float32).shared_experts is None
    fp8 = set(make_moe(FP8Block(), e=2, shared=0).state_dict())
    fp8_experts = {f"experts.{e}.{p}.{s}" for e in range(2) for p in PROJ for s in ("weight", "weight_scale_inv")}
    assert fp8 == {"gate.weight", "gate.e_score_correction_bias"} | fp8_experts


def random_checkpoint(fmt, e, hidden, inter, seed=0):
    """Per-expert tensors in the checkpoint layout with arbitrary bits (every int32 word, odd bf16 scales)."""
    g = torch.Generator().manual_seed(seed)
    ckpt = {}
    for i in range(e):
        for p in PROJ:
            n, k = (hidden, inter) if p == "down_proj" else (inter, hidden)
            key = f"mlp.experts.{i}.{p}."
            if isinstance(fmt, Int4Group):
                words = torch.randint(-2**31, 2**31, (n, k // 8), generator=g, dtype=torch.int64)
                ckpt[key + "weight_packed"] = words.to(torch.int32)
                ckpt[key + "weight_scale"] = (torch.rand(n, k // fmt.group_size, generator=g) * 1e-2).to(torch.bfloat16)
                ckpt[key + "weight_shape"] = torch.tensor([n, k])
            elif isinstance(fmt, FP8Block):
                bits = torch.randint(0, 256, (n, k), generator=g, dtype=torch.int32).to(torch.uint8)
                ckpt[key + "weight"] = bits.view(torch.float8_e4m3fn)  # every byte, NaN patterns included
                ckpt[key + "weight_scale_inv"] = torch.rand(-(-n // 128), -(-k // 128), generator=g)
            else:
                ckpt[key + "weight"] = torch.randn(n, k, generator=g).to(torch.bfloat16)
    return ckpt


class Holder(torch.nn.Module):
    def __init__(self, fmt, e, hidden, inter, device=None):
        super().__init__()
        self.mlp = torch.nn.Module()
        self.mlp.experts = StackedExperts(e, hidden, inter, fmt=fmt, dtype=torch.bfloat16, device=device)


@pytest.mark.parametrize("fmt", [Int4Group(32), Int4Group(128), FP8Block(), BF16()], ids=repr)
@pytest.mark.parametrize("meta", [False, True])
def test_load_then_save_is_bit_exact(fmt, meta, tmp_path):
    ckpt = random_checkpoint(fmt, 5, 256, 128)
    model = Holder(fmt, 5, 256, 128, device="meta" if meta else None)
    result = model.load_state_dict(ckpt, assign=meta)
    assert not result.missing_keys and not result.unexpected_keys
    assert not any(p.is_meta for p in model.parameters())
    saved = model.state_dict()
    assert set(saved) == set(ckpt)
    for key, t in ckpt.items():
        assert_bitwise_equal(saved[key], t, key)
    save_file(saved, tmp_path / "experts.safetensors")  # the views save as independent tensors
    for key, t in load_file(tmp_path / "experts.safetensors").items():
        assert_bitwise_equal(t, ckpt[key], key)


def test_loading_in_parts_equals_loading_at_once():
    fmt = Int4Group(32)
    ckpt = random_checkpoint(fmt, 4, 128, 64)
    whole = Holder(fmt, 4, 128, 64)
    whole.load_state_dict(ckpt)
    for assign in (False, True):
        parts = Holder(fmt, 4, 128, 64, device="meta" if assign else None)
        first = {k: v for k, v in ckpt.items() if int(k.split(".")[2]) < 2}
        res = parts.load_state_dict(first, strict=False, assign=assign)
        assert len(res.missing_keys) == 2 * 3 * 3 and not res.unexpected_keys
        parts.load_state_dict({k: v for k, v in ckpt.items() if k not in first}, strict=False, assign=assign)
        for key, t in whole.state_dict().items():
            assert_bitwise_equal(parts.state_dict()[key], t, key)


def test_load_errors_name_the_key():
    fmt = Int4Group(32)
    ckpt = random_checkpoint(fmt, 3, 128, 64)
    model = Holder(fmt, 3, 128, 64)
    missing = dict(ckpt)
    del missing["mlp.experts.2.up_proj.weight_scale"]
    with pytest.raises(RuntimeError, match=r"mlp\.experts\.2\.up_proj\.weight_scale"):
        model.load_state_dict(missing)
    extra = dict(ckpt, **{"mlp.experts.3.up_proj.weight_packed": ckpt["mlp.experts.0.up_proj.weight_packed"]})
    with pytest.raises(RuntimeError, match=r"Unexpected key.*mlp\.experts\.3\.up_proj\.weight_packed"):
        model.load_state_dict(extra)
    bad_shape = dict(ckpt, **{"mlp.experts.1.down_proj.weight_shape": torch.tensor([128, 32])})
    with pytest.raises(RuntimeError, match=r"mlp\.experts\.1\.down_proj\.weight_shape"):
        model.load_state_dict(bad_shape)
    bad_tensor = dict(ckpt, **{"mlp.experts.0.gate_proj.weight_packed": torch.zeros(64, 8, dtype=torch.int32)})
    with pytest.raises(RuntimeError, match=r"size mismatch for mlp\.experts\.0\.gate_proj\.weight_packed"):
        model.load_state_dict(bad_tensor)
    with pytest.raises(RuntimeError, match="assign=True"):
        Holder(fmt, 3, 128, 64, device="meta").load_state_dict(ckpt)


def test_convert_format_requantizes_each_expert():
    m = make_moe(BF16(), e=3, shared=0)
    dense = {p: [m.experts.expert_weight(e, p) for e in range(3)] for p in PROJ}
    m.experts.convert_format_(Int4Group(32))
    assert m.experts.fmt == Int4Group(32)
    for p in PROJ:
        for e in range(3):
            want = Int4Group(32).quantize(dense[p][e])
            for suffix in ("weight_packed", "weight_scale"):
                assert_bitwise_equal(m.experts.tensors(p)[suffix][e], want[suffix], f"{p}.{suffix}")
    m.experts.convert_format_(FP8Block())
    assert set(m.experts.tensors("gate_proj")) == {"weight", "weight_scale_inv"}
    with pytest.raises(ValueError, match="group_size"):
        StackedExperts(2, 48, 32, fmt=Int4Group(32))


def test_mlp_is_swiglu():
    mlp = MLP(64, 96, dtype=torch.float32)
    for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        lin.set_weight(torch.randn(lin.out_features, lin.in_features) / lin.in_features**0.5)
    x = torch.randn(4, 64)
    with torch.no_grad():
        want = mlp.down_proj.weight @ (F.silu(mlp.gate_proj.weight @ x.T) * (mlp.up_proj.weight @ x.T))
        torch.testing.assert_close(mlp(x), want.T, rtol=1e-5, atol=1e-6)
    assert set(mlp.state_dict()) == {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}


def test_gradients_flow_through_the_layer():
    m = make_moe(BF16(), k=3)
    x = torch.randn(6, 128, requires_grad=True)
    m(x).square().sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert m.gate.weight.grad.abs().sum() > 0  # through the routing weights
    assert m.experts.gate_proj_weight.grad.abs().sum() > 0


def test_bad_inputs():
    m = make_moe(BF16(), e=4)
    with pytest.raises(ValueError, match="features"):
        m(torch.randn(3, 64))
    with pytest.raises(ValueError, match="set_expert_weight"):
        m.experts.set_expert_weight(0, "gate_proj", torch.zeros(3, 3))
    with pytest.raises(TypeError, match="format"):
        StackedExperts(2, 64, 64, fmt=object())


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [BF16(), Int4Group(32), FP8Block(), FP8Block(act_quant=False)], ids=repr)
@pytest.mark.parametrize("t", [1, 16, 63])
def test_gpu_layer_matches_cpu_fp32(fmt, t):
    cpu = make_moe(fmt, hidden=1024, inter=512, e=16, k=4, n_group=4, topk_group=2, shared_fmt=BF16())
    gpu = make_moe(fmt, hidden=1024, inter=512, e=16, k=4, n_group=4, topk_group=2, shared_fmt=BF16(),
                   dtype=torch.bfloat16, device="cuda")
    gpu.load_state_dict({k: v.cuda() for k, v in cpu.state_dict().items()})
    x = torch.randn(t, 1024).to(torch.bfloat16)  # both see the same inputs, so both route alike
    with torch.inference_mode():
        want = cpu(x.float())
        got = gpu(x.cuda())
    assert_rel_close(got.float().cpu(), want, 3e-2, repr(fmt))


def test_assign_stacked_holds_views_of_a_fused_gate_up():
    m = make_moe(BF16(), e=4, shared=0)
    x = torch.randn(5, 128)
    with torch.no_grad():
        want = m(x)
    w13 = torch.cat([m.experts.gate_proj_weight.detach(), m.experts.up_proj_weight.detach()], dim=1)  # [E, 2I, H]
    m.experts.assign_stacked_("gate_proj", {"weight": w13[:, :128]})
    m.experts.assign_stacked_("up_proj", {"weight": w13[:, 128:]})
    assert m.experts.gate_proj_weight.data_ptr() == w13.data_ptr()
    with torch.no_grad():
        assert torch.equal(m(x), want)
    with pytest.raises(ValueError, match="gate_proj.weight shape"):
        m.experts.assign_stacked_("gate_proj", {"weight": w13})
    with pytest.raises(ValueError, match="needs"):
        m.experts.assign_stacked_("gate_proj", {"weight_packed": w13})

