"""QuantPlan / quantize_ / Phase / PhaseRecipe / PhaseSwitch / handoff_kv on toy models built from QuantLinear."""
import copy
import dataclasses
import json

import pytest
import torch
from torch import nn

import mla_quant as mq
from mla_quant.cache import PagedKVCache
from mla_quant.formats import BF16, FP8Block, Int4Group, KVFormat
from mla_quant.formats.plan import (METADATA_KEY, Phase, PhaseRecipe, PhaseSwitch, QuantPlan, build_pools,
                                    handoff_kv, quantize_)
from mla_quant.kernels import fp8_quant
from mla_quant.modules import QuantLinear
from mla_quant.testing import assert_bitwise_equal, assert_rel_close
from tests.conftest import FP8_MMA_REL_TOL, HAS_CUDA

D, I_, E = 128, 64, 3  # hidden, expert width, experts


class ToyAttention(nn.Module):
    """Stands in for MLAttention: linear layers plus the ``kv_format`` the plan's KV rules set."""

    def __init__(self):
        super().__init__()
        self.q_proj = QuantLinear(D, D, dtype=torch.float32)
        self.o_proj = QuantLinear(D, D, dtype=torch.float32)
        self.kv_format = KVFormat("bf16")

    def forward(self, x):
        return self.o_proj(torch.tanh(self.q_proj(x)))


class ToyStackedExperts(nn.Module):
    """Stands in for the MoE's stacked experts: one [E, I, D] tensor, duck-typed ``convert_format_``."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(E, I_, D) * 0.05, requires_grad=False)
        self.fmt = BF16()
        self.conversions = 0

    def convert_format_(self, fmt):
        self.w.data = torch.stack([fmt.dequantize(fmt.quantize(w)) for w in self.w.data])
        self.fmt, self.conversions = fmt, self.conversions + 1
        return self

    def forward(self, x):
        return torch.einsum("td,eid->ti", x, self.w).relu() @ self.w.mean(0)


class ToyIndexer(nn.Module):
    """Stands in for the DSA indexer: a precision format (``convert_format_``) and its own linear layer."""

    def __init__(self):
        super().__init__()
        self.wk = QuantLinear(D, 32, dtype=torch.float32)
        self.fmt = BF16()

    def convert_format_(self, fmt):
        self.fmt = fmt
        return self

    def forward(self, x):
        return self.wk(x).sum(-1, keepdim=True) * 0.0


class ToyLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = ToyAttention()
        self.self_attn.indexer = ToyIndexer()
        self.mlp = nn.Module()
        self.mlp.experts = ToyStackedExperts()
        self.mlp.shared_experts = QuantLinear(D, D, dtype=torch.float32)

    def forward(self, x):
        h = x + self.self_attn(x) + self.self_attn.indexer(x)
        return h + self.mlp.experts(h) + self.mlp.shared_experts(h)


class ToyModel(nn.Module):
    def __init__(self, layers=3):
        super().__init__()
        self.layers = nn.ModuleList(ToyLayer() for _ in range(layers))
        self.lm_head = nn.Linear(D, 50, bias=False)  # a plain nn.Linear: the plan may replace it

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x)


@pytest.fixture
def model():
    torch.manual_seed(0)
    m = ToyModel()
    for mod in m.modules():
        if isinstance(mod, QuantLinear):
            mod.set_weight(torch.randn(mod.out_features, mod.in_features) * 0.05)
    return m


def _snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


PLAN = QuantPlan({
    "re:.*mlp\\.experts": Int4Group(32),
    "layers.0.mlp.shared_experts": None,
    "re:.*indexer": FP8Block(),
    "re:.*self_attn\\.(q|o)_proj": FP8Block(),
    "lm_head": None,
    "re:layers\\.0\\.self_attn": KVFormat("bf16"),
    "re:.*self_attn": KVFormat("fp8_e4m3"),
    "_default": Int4Group(64),
})


# ------------------------------------------------------------------------------------------ matching
def test_first_match_wins_and_default_comes_last():
    assert PLAN.format_for("layers.1.mlp.experts") == Int4Group(32)
    assert PLAN.format_for("layers.0.mlp.shared_experts") is None      # exact name before _default
    assert PLAN.format_for("layers.1.mlp.shared_experts") == Int4Group(64)
    assert PLAN.format_for("layers.2.self_attn.indexer.wk") == Int4Group(64)  # fullmatch: "indexer" ≠ ".wk"
    plan = QuantPlan({"_default": BF16(), "re:.*": FP8Block()})
    assert plan.format_for("anything") == FP8Block()  # _default applies only when nothing else matches
    assert plan.rule_for("x") == "re:.*"


def test_kv_rules_apply_only_to_kv_writers(model):
    assert PLAN.kv_format_for("layers.0.self_attn") == KVFormat("bf16")
    assert PLAN.kv_format_for("layers.2.self_attn") == KVFormat("fp8_e4m3")
    assert PLAN.format_for("layers.2.self_attn") == Int4Group(64)  # weight rules skip KV values
    assert PLAN.kv_formats(model) == [KVFormat("bf16"), KVFormat("fp8_e4m3"), KVFormat("fp8_e4m3")]
    assert PLAN.kv_formats(["a", "layers.3.self_attn"], default="fp8_ds_mla") == [
        KVFormat("fp8_ds_mla"), KVFormat("fp8_e4m3")]


def test_plan_touches_exactly_the_modules_it_matches(model):
    before = _snapshot(model)
    plan = QuantPlan({"re:layers\\.1\\.mlp\\.experts": Int4Group(32), "layers.2.self_attn.o_proj": FP8Block()})
    assert set(plan.matched(model)) == {"layers.1.mlp.experts", "layers.2.self_attn.o_proj"}
    out = quantize_(model, plan)
    assert out is model
    assert model.layers[1].mlp.experts.fmt == Int4Group(32) and model.layers[1].mlp.experts.conversions == 1
    assert model.layers[2].self_attn.o_proj.fmt == FP8Block()
    after = model.state_dict()
    changed = {k for k in before if k not in after or before[k].dtype != after[k].dtype
               or not torch.equal(before[k], after[k])}
    assert changed == {"layers.1.mlp.experts.w", "layers.2.self_attn.o_proj.weight"}
    assert "layers.2.self_attn.o_proj.weight_scale_inv" in after
    assert all(m.conversions == 0 for i, m in enumerate(mod.mlp.experts for mod in model.layers) if i != 1)


def test_full_plan_sets_every_kind(model):
    quantize_(model, PLAN)
    l0, l1 = model.layers[0], model.layers[1]
    assert l1.mlp.experts.fmt == Int4Group(32)
    assert l0.mlp.shared_experts.fmt == BF16() and l1.mlp.shared_experts.fmt == Int4Group(64)
    assert l1.self_attn.indexer.fmt == FP8Block() and l1.self_attn.indexer.wk.fmt == Int4Group(64)
    assert l1.self_attn.q_proj.fmt == FP8Block()
    assert type(model.lm_head) is nn.Linear  # None: left as it is
    assert [lay.self_attn.kv_format for lay in model.layers] == [KVFormat("bf16"), KVFormat("fp8_e4m3"),
                                                                KVFormat("fp8_e4m3")]
    assert PLAN.matched(model) == {}  # applying it again would change nothing
    snap = _snapshot(model)
    quantize_(model, PLAN)
    for k, v in model.state_dict().items():
        assert_bitwise_equal(v, snap[k], k)
    assert l1.mlp.experts.conversions == 1


def test_plain_linear_is_replaced_by_a_quant_linear(model):
    quantize_(model, {"lm_head": Int4Group(32)})
    assert isinstance(model.lm_head, QuantLinear) and model.lm_head.fmt == Int4Group(32)
    assert set(model.state_dict()) >= {"lm_head.weight_packed", "lm_head.weight_scale", "lm_head.weight_shape"}


def test_bf16_plan_is_bit_exact(model):
    x = torch.randn(5, D)
    expected = model(x)
    quantize_(model, {"_default": BF16()})
    assert isinstance(model.lm_head, QuantLinear)
    assert_bitwise_equal(model(x), expected, "BF16 plan")


def test_quantized_model_equals_its_dequantized_reference(triton_backend, monkeypatch):
    if not HAS_CUDA:  # the interpreter's fp32 -> e4m3 cast rounds wrongly: quantize activations in torch
        monkeypatch.setattr(fp8_quant, "act_quant_fp8", fp8_quant.act_quant_fp8_reference)
    model = ToyModel(layers=2).to(triton_backend)  # layer 1 gets every quantized format of PLAN
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            mod.set_weight(torch.randn(mod.out_features, mod.in_features, device=triton_backend) * 0.05)
    quantize_(model, PLAN)  # the quantizers' kernels run here (bit-exact with their references)
    reference = copy.deepcopy(model).cpu()
    for mod in reference.modules():  # same stored bits, reference math
        if isinstance(mod, QuantLinear) and not isinstance(mod.fmt, BF16):
            mod.convert_format_(dataclasses.replace(mod.fmt, kernel="torch"))
    x = torch.randn(9, D)
    expected = reference(x)
    assert_rel_close(model(x.to(triton_backend)).cpu(), expected, FP8_MMA_REL_TOL)


# ------------------------------------------------------------------------------------------ serialising
def test_plan_round_trips_through_repr_dict_json_and_metadata(tmp_path):
    ns = {c.__name__: c for c in (QuantPlan, BF16, FP8Block, Int4Group, KVFormat)}
    assert eval(repr(PLAN), ns) == PLAN and hash(eval(repr(PLAN), ns)) == hash(PLAN)
    assert QuantPlan.from_dict(json.loads(json.dumps(PLAN.to_dict()))) == PLAN
    assert QuantPlan.from_json(PLAN.to_json()) == PLAN
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = tmp_path / "w.safetensors"
    save_file({"x": torch.zeros(2)}, str(path), metadata=PLAN.to_metadata())
    with safe_open(str(path), "pt") as f:
        assert QuantPlan.from_metadata(f.metadata()) == PLAN
    assert QuantPlan.from_metadata({"other": "1"}) is None and METADATA_KEY in PLAN.to_metadata()


def test_recipe_round_trips():
    recipe = mq.PhaseRecipe(prefill=mq.Phase(weights={"_default": FP8Block()}, kv="bf16"),
                            decode=mq.Phase(weights=QuantPlan({"re:.*experts": Int4Group(32)}), kv="fp8_e4m3"))
    ns = {c.__name__: c for c in (QuantPlan, Phase, PhaseRecipe, BF16, FP8Block, Int4Group, KVFormat)}
    assert eval(repr(recipe), ns) == recipe
    assert PhaseRecipe.from_json(recipe.to_json()) == recipe
    assert recipe.decode.kv == KVFormat("fp8_e4m3") and isinstance(recipe.prefill.weights, QuantPlan)
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.prefill = recipe.decode


def test_bad_rules_are_named():
    with pytest.raises(ValueError, match="'re:\\(' is not a valid regex"):
        QuantPlan({"re:(": BF16()})
    with pytest.raises(TypeError, match="rule 'x' has value 4"):
        QuantPlan({"x": 4})
    with pytest.raises(ValueError, match="duplicate"):
        QuantPlan([("a", None), ("a", BF16())])
    with pytest.raises(ValueError, match="phase: 'mid'"):
        PhaseRecipe().phase("mid")
    with pytest.raises(TypeError, match="prefill must be a Phase"):
        PhaseRecipe(prefill="fp8")


# ------------------------------------------------------------------------------------------ phases
RECIPE = PhaseRecipe(
    prefill=Phase(weights={"re:.*mlp\\..*": FP8Block(), "re:.*indexer": FP8Block()}, kv="bf16"),
    decode=Phase(weights={"re:.*mlp\\..*": Int4Group(32), "lm_head": Int4Group(32)}, kv="fp8_e4m3"),
)


def test_two_pools_and_one_switching_instance_agree_bit_for_bit(model):
    x = torch.randn(4, D)
    prefill, decode = build_pools(copy.deepcopy(model), RECIPE)
    assert prefill.layers[0].mlp.experts.fmt == FP8Block() and decode.layers[0].mlp.experts.fmt == Int4Group(32)
    assert type(prefill.lm_head) is nn.Linear and isinstance(decode.lm_head, QuantLinear)
    assert [l.self_attn.kv_format for l in decode.layers] == [KVFormat("fp8_e4m3")] * 3
    assert RECIPE.decode.kv_formats(decode) == [KVFormat("fp8_e4m3")] * 3

    switch = PhaseSwitch(model, RECIPE)
    assert set(switch.variants) >= {"layers.0.mlp.experts", "lm_head", "layers.2.self_attn.indexer"}
    assert switch.extra_bytes() > 0
    for phase, pool in (("prefill", prefill), ("decode", decode), ("prefill", prefill)):
        switch.use(phase)
        assert_bitwise_equal(model(x), pool(x), phase)
        assert switch.kv_formats() == RECIPE.phase(phase).kv_formats(model)
    assert model.layers[1].mlp.experts.conversions == 1  # switching converts nothing


def test_recipe_apply_keeps_one_switch(model):
    RECIPE.apply(model, "decode")
    switch = model.phase_switch
    assert isinstance(model.lm_head, QuantLinear) and switch.phase == "decode"
    RECIPE.apply(model, "prefill")
    assert model.phase_switch is switch and type(model.lm_head) is nn.Linear
    assert "phase_switch" not in dict(model.named_modules())


# ------------------------------------------------------------------------------------------ KV hand-off
def _filled_cache(fmt, pages, n_tokens, seed=0):
    cache = PagedKVCache(num_layers=3, num_pages=8, page_size=4, kv_lora_rank=128, rope_dim=16, kv_format=fmt)
    cache.poison_()
    g = torch.Generator().manual_seed(seed)
    pages_t = torch.tensor(pages)
    pos = torch.arange(n_tokens)
    slots = pages_t[pos // 4] * 4 + pos % 4
    for layer in range(3):
        rows = torch.randn(n_tokens, 144, generator=g) * (1 + 10 * layer)
        cache.append(layer, rows, slots)
    return cache


@pytest.mark.parametrize("dst_fmt", ["bf16", "fp8_e4m3", "fp8_ds_mla"])
def test_handoff_preserves_every_token(dst_fmt):
    src_pages, dst_pages, n = [5, 2, 7], [0, 3, 1], 10  # 10 tokens: the last page is partial
    src = _filled_cache("bf16", src_pages, n)
    dst = PagedKVCache(num_layers=3, num_pages=8, page_size=4, kv_lora_rank=128, rope_dim=16, kv_format=dst_fmt)
    dst.poison_()
    got = handoff_kv(src, dst, src_pages, dst_pages)
    assert got.tolist() == dst_pages
    for layer in range(3):
        a, b = src.read(layer, src_pages, n), dst.read(layer, dst_pages, n)
        if dst_fmt == "bf16":
            assert_bitwise_equal(b, a, f"layer {layer}")
            continue
        # e4m3 keeps 3 mantissa bits: |error| <= 2^-4 |x| (normals) + half the smallest subnormal step
        scale = a.abs().amax(-1, keepdim=True) / 448
        assert ((b - a).abs() <= a.abs() * 2 ** -4 + scale * 2 ** -9).all(), f"layer {layer}"


def test_handoff_takes_block_tables_and_per_layer_formats():
    src = _filled_cache("bf16", [1, 4, 6, 0], 16)  # request 1: pages 1, 4; request 2: pages 6, 0
    formats = PLAN.kv_formats(["layers.0.self_attn", "layers.1.self_attn", "layers.2.self_attn"])
    dst = PagedKVCache(num_layers=3, num_pages=8, page_size=4, kv_lora_rank=128, rope_dim=16, kv_format=formats)
    src_table = torch.tensor([[1, 4, -1], [6, 0, -1]], dtype=torch.int32)  # two requests: 6 and 7 tokens
    dst_table = torch.tensor([[7, 2, -1], [5, 3, -1]], dtype=torch.int32)
    assert handoff_kv(src, dst, src_table, dst_table).tolist() == [7, 2, 5, 3]
    assert_bitwise_equal(dst.read(0, [7, 2], 6), src.read(0, [1, 4], 6), "bf16 layer")
    assert_rel_close(dst.read(2, [5, 3], 7), src.read(2, [6, 0], 7), 0.05, "fp8 layer")


def test_handoff_errors():
    src = _filled_cache("bf16", [0, 1], 8)
    dst = PagedKVCache(num_layers=3, num_pages=8, page_size=4, kv_lora_rank=128, rope_dim=16)
    with pytest.raises(ValueError, match="dst_pages: 1 pages for 2"):
        handoff_kv(src, dst, [0, 1], [3])
    with pytest.raises(IndexError, match="dst_pages: page id 9"):
        handoff_kv(src, dst, [0, 1], [3, 9])
    with pytest.raises(TypeError, match="src_cache: dict has no copy_pages_to"):
        handoff_kv({}, dst, [0], [1])


# ------------------------------------------------------------------------------------------ real modules
def test_plan_drives_the_library_modules():
    """The duck typing meets the real StackedExperts (WeightFormat) and LightningIndexer ("bf16"/"fp8")."""
    from mla_quant.modules.experts import StackedExperts
    from mla_quant.modules.indexer import LightningIndexer

    holder = nn.Module()
    holder.mlp = nn.Module()
    holder.mlp.experts = StackedExperts(4, 128, 64, dtype=torch.float32)
    holder.self_attn = nn.Module()
    holder.self_attn.indexer = LightningIndexer(128, 64, n_heads=2, head_dim=32, rope_dim=16, topk=8,
                                                dtype=torch.float32)
    plan = QuantPlan({"re:.*experts": Int4Group(32), "re:.*indexer": FP8Block(), "re:.*indexer\\..*": None})
    assert set(plan.matched(holder)) == {"mlp.experts", "self_attn.indexer"}
    quantize_(holder, plan)
    assert holder.mlp.experts.fmt == Int4Group(32) and holder.self_attn.indexer.fmt == "fp8"
    assert plan.matched(holder) == {}
    assert holder.self_attn.indexer.wk.fmt == BF16()
    with pytest.raises(TypeError, match="precision name"):
        quantize_(holder, {"re:.*indexer": Int4Group(32)})
    recipe = PhaseRecipe(prefill=Phase(weights={"re:.*indexer": BF16()}), decode=Phase(weights={"re:.*indexer": FP8Block()}))
    switch = PhaseSwitch(holder, recipe)
    assert list(switch.variants) == ["self_attn.indexer"] and holder.self_attn.indexer.fmt == "bf16"
    switch.use("decode")
    assert holder.self_attn.indexer.fmt == "fp8"
