"""``mla_quant.gptq``: GPTQ rounding into the Int4Group layout, and the calibration Hessians of a model."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_quant.convert import int4_quantize_mse
from mla_quant.formats import BF16, Int4Group
from mla_quant.gptq import HESSIAN_SUFFIX, HessianCollector, HessianFile, gptq_quantize, output_error
from mla_quant.kernels import int4_quant as I
from mla_quant.kernels.int4_quant.reference import int4_group_scales
from mla_quant.modules import QuantLinear
from mla_quant.modules.moe import MoE
from mla_quant.testing import assert_bitwise_equal


def _correlated_inputs(t: int, k: int, seed: int) -> torch.Tensor:
    """Calibration rows [t, k] with a low-rank structure and a few loud channels, as LLM activations have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, 16, generator=g) @ torch.randn(16, k, generator=g) + 0.2 * torch.randn(t, k, generator=g)
    x[:, torch.randperm(k, generator=g)[:4]] *= 8
    return x


def _dequant(packed, scale, group):
    return I.int4_dequantize_reference(packed, scale, group, torch.float32)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 40), groups=st.integers(1, 6), group=st.sampled_from([32, 64, 128]), seed=st.integers(0, 99),
       clip=st.sampled_from(["absmax", "mse"]), act_order=st.booleans())
def test_a_diagonal_hessian_passes_nothing_on(n, groups, group, seed, clip, act_order):
    """Uncorrelated inputs: GPTQ is round-to-nearest (clip "absmax") or the MSE search ("mse"), bit for bit, in the
    weight's column order or in activation order."""
    k = groups * group
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    w[0, : min(k, 5)] *= 40
    h = torch.diag(torch.rand(k, generator=g) + 0.1)
    got = gptq_quantize(w, h, group, block_size=group * (1 + seed % 3), clip=clip, act_order=act_order)
    want = I.int4_quantize_reference(w, group) if clip == "absmax" else int4_quantize_mse(w, group)
    assert_bitwise_equal(got[0], want[0], "codes")
    assert_bitwise_equal(got[1], want[1], "scales")


def test_no_calibration_data_is_round_to_nearest():
    """An all-zero Hessian (no token reached the layer): every column is dead and rounds to nearest."""
    w = torch.randn(24, 256) * 0.02
    got = gptq_quantize(w, torch.zeros(256, 256))
    want = I.int4_quantize_reference(w, 32)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("clip", ["absmax", "mse"])
def test_gptq_lowers_the_output_error_on_correlated_inputs(seed, clip):
    """On the calibration inputs, GPTQ's outputs are much closer to the source's than round-to-nearest's (or the MSE
    search's); output_error agrees with the error measured on the rows themselves."""
    n, k = 96, 512
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02
    x = _correlated_inputs(2048, k, seed)
    h = x.T @ x / x.shape[0]
    packed, scale = gptq_quantize(w, h, clip=clip)
    assert scale.dtype == torch.bfloat16 and scale.shape == (n, k // 32) and packed.shape == (n, k // 8)
    q = _dequant(packed, scale, 32)
    base = _dequant(*(I.int4_quantize_reference(w, 32) if clip == "absmax" else int4_quantize_mse(w, 32)), 32)
    ours, theirs = output_error(w, q, h), output_error(w, base, h)
    assert ours["out_sqnr_db"] > theirs["out_sqnr_db"] + 6, (ours, theirs)
    measured = ((x @ (w - q).T).pow(2).sum() / (x @ w.T).pow(2).sum()).sqrt().item()
    assert ours["out_rel_err"] == pytest.approx(measured, rel=1e-4)


def _gptq_textbook(w, h, group, damp=0.01, act_order=False):
    """GPTQ as first written (OBQ's update, no Cholesky, no blocks), in fp64: round column j with its group's
    scale (chosen at the group's first column; with ``act_order`` all fixed first from w, the columns visited by
    decreasing Hessian diagonal), spread its error over the columns not yet rounded by the inverse Hessian, then
    remove column j from that inverse."""
    k = w.shape[1]
    wk = w.double().clone()
    hd = h.double() + damp * torch.diagonal(h).double().mean() * torch.eye(k, dtype=torch.float64)
    inv = torch.linalg.inv(hd)
    q = torch.zeros_like(wk)
    order = torch.argsort(torch.diagonal(h), descending=True, stable=True).tolist() if act_order else range(k)
    fixed = int4_group_scales(w, group, torch.bfloat16).float()
    todo = torch.ones(k, dtype=torch.bool)
    for j in order:
        if act_order:
            s = fixed[:, j // group]
        elif j % group == 0:
            s = int4_group_scales(wk[:, j:j + group].float(), group, torch.bfloat16).float()[:, 0]
        q[:, j] = torch.round(wk[:, j].float() * (1 / s)).clamp(-8, 7).double() * s.double()
        err = (wk[:, j] - q[:, j]) / inv[j, j]
        todo[j] = False
        wk[:, todo] -= err[:, None] * inv[j, todo][None, :]
        inv -= torch.outer(inv[:, j], inv[j, :]) / inv[j, j]
    return q.float()


@pytest.mark.parametrize("block", [32, 64, 128])
@pytest.mark.parametrize("act_order", [False, True], ids=["in_order", "act_order"])
def test_blocked_cholesky_form_equals_the_textbook_update(block, act_order):
    """The lazy block updates and the Cholesky factor compute what the column-by-column inverse update computes:
    the same codes but for rare rounding ties, the same output error (also visiting the columns by decreasing
    Hessian diagonal, the codes put back in the weight's column order)."""
    n, k = 48, 256
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(7)) * 0.02
    x = _correlated_inputs(1024, k, 7)
    h = x.T @ x / x.shape[0]
    ours = _dequant(*gptq_quantize(w, h, block_size=block, act_order=act_order), 32)
    book = _gptq_textbook(w, h, 32, act_order=act_order)
    assert (ours == book).float().mean() > 0.99
    assert output_error(w, ours, h)["out_sqnr_db"] == pytest.approx(output_error(w, book, h)["out_sqnr_db"], abs=0.1)


def test_a_batch_of_weights_is_each_weight_alone():
    """All experts of a layer in one call (one column loop for all): each equals its own call, a dead expert (zero
    Hessian: no token) rounds to nearest, and one that needs more damping does not change the others' damping."""
    e, n, k = 4, 24, 256
    g = torch.Generator().manual_seed(3)
    w = torch.randn(e, n, k, generator=g) * 0.02
    hs = []
    for i in range(e):
        x = _correlated_inputs(256, k, 10 + i)
        hs.append(x.T @ x / 256)
    hs[1] = torch.zeros(k, k)
    # indefinite: 1 % damping fails, the tenfold retry (this matrix's alone) succeeds
    hs[2] = hs[2] - (torch.linalg.eigvalsh(hs[2].double()).min().float() + 0.05 * hs[2].diagonal().mean()) * torch.eye(k)
    h = torch.stack(hs)
    for clip, act_order in (("absmax", False), ("mse", False), ("absmax", True)):
        packed, scale = gptq_quantize(w, h, clip=clip, act_order=act_order)
        assert packed.shape == (e, n, k // 8) and scale.shape == (e, n, k // 32) and scale.is_contiguous()
        for i in range(e):
            one = gptq_quantize(w[i], h[i], clip=clip, act_order=act_order)
            assert (I.int4_unpack_reference(packed[i]) == I.int4_unpack_reference(one[0])).float().mean() > 0.999
            assert (scale[i] == one[1]).float().mean() > 0.999
        rtn = I.int4_quantize_reference(w[1], 32) if clip == "absmax" else int4_quantize_mse(w[1], 32)
        assert torch.equal(packed[1], rtn[0]) and torch.equal(scale[1], rtn[1])


def test_activation_order_lowers_the_output_error_further_with_loud_channels():
    """Loud input channels rounded first (their errors land on quieter columns): above GPTQ in column order."""
    for seed in range(3):
        w = torch.randn(96, 512, generator=torch.Generator().manual_seed(seed)) * 0.02
        x = _correlated_inputs(2048, 512, seed)
        h = x.T @ x / x.shape[0]
        plain = output_error(w, _dequant(*gptq_quantize(w, h), 32), h)["out_sqnr_db"]
        ordered = output_error(w, _dequant(*gptq_quantize(w, h, act_order=True), 32), h)["out_sqnr_db"]
        assert ordered > plain + 1.5, (seed, plain, ordered)   # +3.1-3.5 dB seen


def test_the_result_is_the_int4group_layout():
    """The tensors load into a QuantLinear in Int4Group and run as any INT4 weight: codes in range, scales that
    dequantize to what the loop rounded to (the output error of the layer equals that of the dequantized weight)."""
    k, n = 256, 40
    w = torch.randn(n, k) * 0.02
    x = _correlated_inputs(512, k, 5)
    packed, scale = gptq_quantize(w, x.T @ x)
    codes = I.int4_unpack_reference(packed)
    assert int(codes.min()) >= -8 and int(codes.max()) <= 7
    layer = QuantLinear(k, n, fmt=BF16(), dtype=torch.float32)
    layer.convert_format_(Int4Group(32))
    layer.tensors["weight_packed"].copy_(packed)
    layer.tensors["weight_scale"].copy_(scale)
    torch.testing.assert_close(layer(x[:8]), x[:8] @ _dequant(packed, scale, 32).T, rtol=0, atol=1e-5)


def test_bad_input_is_named():
    w, h = torch.randn(8, 64), torch.eye(64)
    with pytest.raises(ValueError, match="hessian: shape"):
        gptq_quantize(w, torch.eye(32))
    with pytest.raises(ValueError, match="group_size"):
        gptq_quantize(torch.randn(8, 48), torch.eye(48))
    with pytest.raises(ValueError, match="block_size"):
        gptq_quantize(w, h, block_size=48)
    with pytest.raises(ValueError, match="clip"):
        gptq_quantize(w, h, clip="percentile")
    with pytest.raises(ValueError, match="finite"):
        gptq_quantize(w, h * float("nan"))
    with pytest.raises(ValueError, match=r"expected \[\.\.\., N, K\]"):
        gptq_quantize(torch.randn(64), h)
    with pytest.raises(ValueError, match="hessian: shape"):
        gptq_quantize(torch.randn(3, 8, 64), torch.eye(64))   # a batch of weights needs a batch of Hessians


def test_hessian_collector_per_expert_and_linear(tmp_path):
    """A tiny MoE: the routed experts' Hessians are X_e^T X_e / T_e over the tokens routed to expert e (gate and up
    share it), the down projection's over silu(gate)·up of those tokens; the shared expert's linear layers are
    hooked too. Saved and read back lazily, also under a checkpoint name with Kimi's ``language_model.`` prefix."""
    torch.manual_seed(0)
    moe = MoE(64, 32, n_routed_experts=6, num_experts_per_tok=2, dtype=torch.float32)
    for p in moe.parameters():
        p.data.normal_(0, 0.2)
    for e in range(6):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            moe.experts.set_expert_weight(e, proj, torch.randn(moe.experts.proj_shape(proj)) * 0.2)
    moe.gate.e_score_correction_bias.data[5] = -1e4  # expert 5 is never selected: no calibration token
    batches = [torch.randn(10, 64), torch.randn(7, 64)]
    model = torch.nn.ModuleDict({"mlp": moe})
    with HessianCollector(model) as hc:
        for x in batches:
            model["mlp"](x)
    assert not moe.experts._forward_pre_hooks, "hooks removed on exit"
    xs = torch.cat(batches)
    _, ids = moe.gate(xs)
    hs, counts = hc.hessians(), hc.tokens()
    for e in range(6):
        xe = xs[(ids == e).any(-1)]
        if not len(xe):
            assert f"mlp.experts.{e}.gate_proj" not in hs
            continue
        h_in = xe.T @ xe / len(xe)
        act = F.silu(xe @ moe.experts.expert_weight(e, "gate_proj").T) * (xe @ moe.experts.expert_weight(e, "up_proj").T)
        torch.testing.assert_close(hs[f"mlp.experts.{e}.gate_proj"], h_in, rtol=1e-5, atol=1e-6)
        assert hs[f"mlp.experts.{e}.up_proj"] is hs[f"mlp.experts.{e}.gate_proj"]
        torch.testing.assert_close(hs[f"mlp.experts.{e}.down_proj"], act.T @ act / len(xe), rtol=1e-5, atol=1e-6)
        assert counts[f"mlp.experts.{e}.down_proj"] == len(xe)
    torch.testing.assert_close(hs["mlp.shared_experts.gate_proj"], xs.T @ xs / len(xs), rtol=1e-5, atol=1e-6)
    assert counts["mlp.shared_experts.gate_proj"] == 17
    hc.save(tmp_path / "h.safetensors")
    hf = HessianFile(tmp_path / "h.safetensors")
    name = next(n for n in hs if n.endswith("experts.0.up_proj") or n.endswith("experts.1.up_proj"))
    assert torch.equal(hf.get(name), hs[name])
    assert torch.equal(hf.get("language_model." + name), hs[name])
    with pytest.raises(KeyError, match="no Hessian for 'mlp.experts.99.gate_proj'"):
        hf.get("mlp.experts.99.gate_proj")
    assert all(k.endswith((HESSIAN_SUFFIX, ".tokens")) for k in hf._file.keys())
    # expert 5, which no token was routed to: listed with 0 tokens, read back as a zero Hessian (round-to-nearest)
    assert not (ids == 5).any() and "mlp.experts.5.gate_proj" not in hs
    for p in ("gate_proj", "up_proj", "down_proj"):
        assert counts[f"mlp.experts.5.{p}"] == 0 and f"mlp.experts.5.{p}" in hf.unseen
    assert torch.equal(hf.get("mlp.experts.5.down_proj", 32), torch.zeros(32, 32))
    with pytest.raises(ValueError, match="saw no calibration token"):
        hf.get("mlp.experts.5.gate_proj")


def test_hessian_collector_all_experts(tmp_path):
    """``all_experts``: every expert's gate / up Hessian is the layer's whole input (one tensor for all of them, saved
    once), its down Hessian that of silu(gate)·up over every token, every expert counted with all tokens — expert 5,
    which routing never picks, included; the layer's output is the routed one all the same."""
    torch.manual_seed(1)
    moe = MoE(64, 32, n_routed_experts=6, num_experts_per_tok=2, dtype=torch.float32)
    for e in range(6):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            moe.experts.set_expert_weight(e, proj, torch.randn(moe.experts.proj_shape(proj)) * 0.2)
    moe.gate.e_score_correction_bias.data[5] = -1e4
    xs = torch.randn(2, 9, 64)                           # [batch, seq, hidden]: rows flattened by the collector
    routed = moe(xs)
    with HessianCollector(moe, r"^experts\.", all_experts=True) as hc:
        assert torch.equal(moe(xs), routed)
    x = xs.reshape(-1, 64)
    hs, counts = hc.hessians(), hc.tokens()
    torch.testing.assert_close(hs["experts.0.gate_proj"], x.T @ x / 18, rtol=1e-5, atol=1e-6)
    for e in range(6):
        assert hs[f"experts.{e}.gate_proj"] is hs["experts.0.gate_proj"] is hs[f"experts.{e}.up_proj"]
        act = F.silu(x @ moe.experts.expert_weight(e, "gate_proj").T) * (x @ moe.experts.expert_weight(e, "up_proj").T)
        torch.testing.assert_close(hs[f"experts.{e}.down_proj"], act.T @ act / 18, rtol=1e-5, atol=1e-6)
        assert all(counts[f"experts.{e}.{p}"] == 18 for p in ("gate_proj", "up_proj", "down_proj"))
    hc.save(tmp_path / "h.safetensors")
    hf = HessianFile(tmp_path / "h.safetensors")
    stored = [k for k in hf._file.keys() if k.endswith(HESSIAN_SUFFIX)]
    assert sorted(stored) == sorted(["experts.*.gate_proj" + HESSIAN_SUFFIX]
                                    + [f"experts.{e}.down_proj{HESSIAN_SUFFIX}" for e in range(6)])
    assert not hf.unseen
    for name in ("experts.5.up_proj", "language_model.experts.2.gate_proj", "experts.3.down_proj"):
        assert torch.equal(hf.get(name), hs[name.removeprefix("language_model.")])


def test_hessian_collector_takes_the_experts_arguments_by_name():
    moe = MoE(64, 32, n_routed_experts=4, num_experts_per_tok=2, dtype=torch.float32)
    x = torch.randn(6, 64)
    weights, ids = moe.gate(x)
    with HessianCollector(moe.experts) as hc:
        moe.experts(x, topk_weights=weights, topk_ids=ids)
    assert sum(n for name, n in hc.tokens().items() if name.endswith("gate_proj")) == 12   # 6 tokens x top-2


def test_hessian_collector_pattern():
    moe = MoE(64, 32, n_routed_experts=4, num_experts_per_tok=2, dtype=torch.float32)
    with HessianCollector(moe, r"shared_experts\.down_proj") as hc:
        moe(torch.randn(5, 64))
    assert set(hc.hessians()) == {"shared_experts.down_proj"}
    with pytest.raises(ValueError, match="no linear layer"):
        HessianCollector(moe, r"nothing_here")


def _tiny_kimi(layers=3, seed=0):
    """A Kimi K2.6-shaped byte model at the smoke size with two MoE layers (fp32), random weights."""
    from mla_quant.eval import train
    from mla_quant.models import KimiK26ForCausalLM

    config = train.model_config("smoke")
    config.num_hidden_layers = layers
    return train.init_weights_(KimiK26ForCausalLM(config, dtype=torch.float32), seed).eval()


def test_gptq_in_memory_layer_by_layer():
    """gptq_: every routed expert ends in Int4Group; the model's outputs on the calibration text stay closer to the
    fp32 model's than round-to-nearest's (what GPTQ minimises, layer by layer); each weight's own output error is
    below round-to-nearest's on average; later layers were calibrated after the earlier ones were quantized."""
    import copy

    from mla_quant.eval.table import EXPERTS
    from mla_quant.formats.plan import QuantPlan, quantize_
    from mla_quant.gptq import gptq_

    torch.manual_seed(0)
    model = _tiny_kimi()
    calib = [torch.randint(0, 256, (2, 48)) for _ in range(3)]
    with torch.no_grad():
        ref = torch.cat([model(ids) for ids in calib])
    rtn = quantize_(copy.deepcopy(model), QuantPlan({EXPERTS: Int4Group(32)}))
    seen = []
    real = HessianCollector.__init__

    def spy(self, m, pattern=None, dtype=torch.float32, *, targets=None, **options):
        seen.append(([name for name, _ in targets], [type(mod.experts.fmt).__name__ for mod in m.modules()
                                                     if hasattr(mod, "experts") and hasattr(mod.experts, "fmt")]))
        real(self, m, pattern, dtype, targets=targets, **options)

    HessianCollector.__init__ = spy
    try:
        rows = gptq_(model, calib)
    finally:
        HessianCollector.__init__ = real
    experts = [m for m in model.modules() if type(m).__name__ == "StackedExperts"]
    assert len(experts) == 2 and all(isinstance(m.fmt, Int4Group) for m in experts)
    # one collection per decoder layer with experts, in order; the second after the first layer's experts are INT4
    assert [names for names, _ in seen] == [["model.layers.1.mlp.experts"], ["model.layers.2.mlp.experts"]]
    assert seen[0][1] == ["BF16", "BF16"] and seen[1][1] == ["Int4Group", "BF16"]
    with torch.no_grad():
        ours = torch.cat([model(ids) for ids in calib])
        theirs = torch.cat([rtn(ids) for ids in calib])
    assert (ours - ref).pow(2).mean() < 0.75 * (theirs - ref).pow(2).mean()   # ~0.5x over four seeds
    assert len(rows) > 0 and all(r["name"].startswith("model.layers.") for r in rows)
    mean = {m: sum(r[m]["out_sqnr_db"] for r in rows) / len(rows) for m in ("gptq", "rtn")}
    assert mean["gptq"] > mean["rtn"] + 2, mean                              # +3.7-3.9 dB over four seeds


def test_gptq_in_memory_errors():
    from mla_quant.gptq import gptq_

    model = _tiny_kimi(layers=2)
    with pytest.raises(ValueError, match="no linear layer"):
        gptq_(model, [], pattern="nothing")
    with pytest.raises(TypeError, match="Int4Group"):
        gptq_(model, [], fmt=BF16())
    plain = torch.nn.Sequential(torch.nn.Linear(32, 32))
    with pytest.raises(TypeError, match="plain nn.Linear"):
        gptq_(plain, [torch.randn(2, 32)], pattern="0")
