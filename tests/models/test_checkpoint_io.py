"""Checkpoints in the real on-disk layouts: save -> load bit-exact, the layout itself, skipped parts,
clear errors for missing / unexpected / mis-shaped keys."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mla_quant.formats import BF16, FP8Block, Int4Group
from mla_quant.models import (CheckpointError, Glm52Config, Glm52ForCausalLM, KimiK26Config, KimiK26ForCausalLM,
                              from_pretrained, init_random_weights_, save_pretrained)
from mla_quant.models.layout import KeyMap, checkpoint_formats, key_rules

SMALL_SHARDS = 1 << 20  # several shards for the tiny models


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        assert torch.equal(_bits(sa[k]), _bits(sb[k])), k


def _read_all(folder) -> dict[str, torch.Tensor]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for file in sorted(set(index.values())):
        out.update(load_file(str(folder / file)))
    assert set(out) == set(index)
    return out


@pytest.fixture(scope="module")
def kimi_ckpt(tmp_path_factory):
    model = KimiK26ForCausalLM(KimiK26Config.tiny(), dtype=torch.bfloat16, formats="checkpoint")
    init_random_weights_(model, seed=3)
    path = save_pretrained(model, tmp_path_factory.mktemp("kimi"), max_shard_bytes=SMALL_SHARDS)
    return model, path


@pytest.fixture(scope="module")
def glm_ckpt(tmp_path_factory):
    model = Glm52ForCausalLM(Glm52Config.tiny(), dtype=torch.bfloat16, formats="checkpoint")
    init_random_weights_(model, seed=4)
    with torch.no_grad():  # as if loaded from a bf16 release: the fp32 router / weights_proj hold bf16 values
        for name, t in model.state_dict(keep_vars=True).items():
            if name.endswith(("mlp.gate.weight", "weights_proj.weight")):
                t.copy_(t.to(torch.bfloat16).float())
    path = save_pretrained(model, tmp_path_factory.mktemp("glm"), max_shard_bytes=SMALL_SHARDS)
    return model, path


def test_kimi_layout_on_disk(kimi_ckpt):
    model, path = kimi_ckpt
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k25" and cfg["text_config"]["model_type"] == "kimi_k2"
    assert cfg["architectures"] == ["KimiK25ForConditionalGeneration"] and "vision_config" in cfg
    assert cfg["text_config"]["quantization_config"] == KimiK26Config.full().quantization_config
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and index["metadata"]["total_size"] > 0
    # one layer's experts span two shards (as in the real checkpoints): loading stacks them across shards
    files = {f for k, f in index["weight_map"].items() if k.startswith("language_model.model.layers.2.mlp.experts.")}
    assert len(files) == 2
    tensors = _read_all(path)
    assert all(k.startswith("language_model.") for k in tensors)
    assert "language_model.lm_head.weight" in tensors and "language_model.model.embed_tokens.weight" in tensors
    c = KimiK26Config.tiny()
    e = "language_model.model.layers.1.mlp.experts.5.gate_proj."
    assert tensors[e + "weight_packed"].dtype == torch.int32
    assert tuple(tensors[e + "weight_packed"].shape) == (c.moe_intermediate_size, c.hidden_size // 8)
    assert tensors[e + "weight_scale"].dtype == torch.bfloat16
    assert tuple(tensors[e + "weight_scale"].shape) == (c.moe_intermediate_size, c.hidden_size // 32)
    assert tensors[e + "weight_shape"].tolist() == [c.moe_intermediate_size, c.hidden_size]
    down = "language_model.model.layers.1.mlp.experts.5.down_proj.weight_shape"
    assert tensors[down].tolist() == [c.hidden_size, c.moe_intermediate_size]
    assert not any(k.endswith("weight_scale_inv") for k in tensors)
    # attention, shared experts, the dense MLP and the router stay unquantized
    for k in ("language_model.model.layers.0.mlp.gate_proj.weight", "language_model.model.layers.1.self_attn.o_proj.weight",
              "language_model.model.layers.1.mlp.shared_experts.down_proj.weight"):
        assert tensors[k].dtype == torch.bfloat16, k
    assert tensors["language_model.model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32


def test_glm_fp8_layout_on_disk(glm_ckpt):
    model, path = glm_ckpt
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "glm_moe_dsa" and cfg["quantization_config"]["quant_method"] == "fp8"
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    tensors = _read_all(path)
    c = Glm52Config.tiny()
    w = "model.layers.1.mlp.experts.3.down_proj.weight"
    assert tensors[w].dtype == torch.float8_e4m3fn and tensors[w + "_scale_inv"].dtype == torch.float32
    assert tuple(tensors[w + "_scale_inv"].shape) == (-(-c.hidden_size // 128), -(-c.moe_intermediate_size // 128))
    q = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"  # 160 rows: a partial block
    assert tuple(tensors[q + "_scale_inv"].shape) == (2, 2)
    full = [i for i, t in enumerate(c.indexer_types) if t == "full"]
    shared = [i for i, t in enumerate(c.indexer_types) if t == "shared"]
    assert tensors[f"model.layers.{full[1]}.self_attn.indexer.wk.weight"].dtype == torch.float8_e4m3fn
    assert tensors[f"model.layers.{full[1]}.self_attn.indexer.weights_proj.weight"].dtype == torch.bfloat16
    assert tensors["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16       # as the release stores them
    assert tensors["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert f"model.layers.{full[1]}.self_attn.indexer.k_norm.bias" in tensors
    assert not any(k.startswith(f"model.layers.{shared[0]}.self_attn.indexer") for k in tensors)
    assert tensors["lm_head.weight"].dtype == torch.bfloat16


def test_kimi_int4_round_trip_bit_exact(kimi_ckpt):
    model, path = kimi_ckpt
    loaded = from_pretrained(path, dtype=torch.bfloat16)
    assert isinstance(loaded, KimiK26ForCausalLM) and loaded.config == model.config
    assert_same_state(model, loaded)
    fmts = loaded.linear_formats()
    assert fmts["model.layers.2.mlp.experts.0.up_proj"] == Int4Group(32, scale_dtype="bfloat16")
    assert fmts["model.layers.2.mlp.shared_experts.up_proj"] == BF16()
    assert fmts["lm_head"] == BF16() and fmts["model.layers.0.self_attn.q_b_proj"] == BF16()
    assert not any(t.device.type == "meta" for t in loaded.state_dict().values())
    ids = torch.randint(0, model.config.vocab_size, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids), rtol=0, atol=0)


def test_glm_fp8_round_trip_bit_exact(glm_ckpt):
    model, path = glm_ckpt
    loaded = from_pretrained(path, dtype=torch.bfloat16)
    assert isinstance(loaded, Glm52ForCausalLM)
    assert_same_state(model, loaded)
    fmts = loaded.linear_formats()
    assert fmts["model.layers.3.mlp.experts.1.gate_proj"] == FP8Block(act_quant=False)
    assert fmts["model.layers.0.self_attn.indexer.weights_proj"] == BF16() and fmts["lm_head"] == BF16()


def test_glm_bf16_round_trip_and_dtype_change(tmp_path):
    model = Glm52ForCausalLM(Glm52Config.tiny(), dtype=torch.bfloat16)  # every linear layer BF16
    init_random_weights_(model, seed=5)
    save_pretrained(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["torch_dtype"] == "bfloat16"
    assert_same_state(model, from_pretrained(tmp_path, dtype=torch.bfloat16))
    fp32 = from_pretrained(tmp_path, dtype=torch.float32)      # bf16 on disk -> fp32 model: exact
    for k, t in model.state_dict().items():
        assert torch.equal(fp32.state_dict()[k].to(t.dtype), t), k
    assert fp32.state_dict()["model.norm.weight"].dtype == torch.float32


def test_skips_vision_projector_and_mtp(tmp_path, capsys):
    cfg = KimiK26Config.tiny().replace(num_hidden_layers=2)
    model = KimiK26ForCausalLM(cfg, dtype=torch.bfloat16, formats="checkpoint")
    init_random_weights_(model)
    extra = {"vision_tower.patch_embed.proj.weight": torch.randn(8, 3),
             "mm_projector.proj.0.weight": torch.randn(4, 4),
             "language_model.model.layers.2.enorm.weight": torch.randn(cfg.hidden_size),
             "language_model.model.layers.2.eh_proj.weight": torch.randn(cfg.hidden_size, 2 * cfg.hidden_size)}
    save_pretrained(model, tmp_path, extra_tensors=extra, max_shard_bytes=SMALL_SHARDS)
    loaded = from_pretrained(tmp_path, progress=True)
    assert_same_state(model, loaded)
    err = capsys.readouterr().err
    assert "vision tower" in err and "projector" in err and "multi-token-prediction" in err
    shards = len(set(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"].values()))
    assert err.count("[from_pretrained] shard ") == shards > 1


def test_key_rules_table():
    kimi = KeyMap(KimiK26Config.full())
    assert kimi.to_model("language_model.model.layers.60.mlp.experts.383.down_proj.weight_packed")[0] == \
        "model.layers.60.mlp.experts.383.down_proj.weight_packed"
    assert kimi.to_model("language_model.lm_head.weight")[0] == "lm_head.weight"
    assert kimi.to_model("language_model.model.layers.61.eh_proj.weight")[0] is None
    assert kimi.to_model("model.layers.0.input_layernorm.weight") == (None, None)  # no prefix: unexpected
    assert kimi.to_checkpoint("lm_head") == "language_model.lm_head"
    glm = KeyMap(Glm52Config.full())
    assert glm.to_model("model.layers.78.shared_head.norm.weight")[0] is None
    assert glm.to_model("model.layers.77.self_attn.indexer.wk.weight")[0] == "model.layers.77.self_attn.indexer.wk.weight"
    text_only = KeyMap(KimiK26Config.full().replace(vision_config=None))
    assert text_only.to_model("model.norm.weight")[0] == "model.norm.weight"
    assert all(r.note for r in key_rules(KimiK26Config.full()) if r.model_prefix is None)


def test_release_formats_from_config():
    kimi = checkpoint_formats(KimiK26Config.full())
    assert isinstance(kimi("model.layers.5.mlp.experts.100.down_proj"), Int4Group)
    for name in ("model.layers.5.mlp.shared_experts.down_proj", "model.layers.0.mlp.up_proj",
                 "model.layers.5.self_attn.kv_b_proj", "lm_head"):
        assert kimi(name) == BF16(), name
    glm = checkpoint_formats(Glm52Config.full())
    assert glm("model.layers.5.self_attn.indexer.wq_b") == FP8Block(act_quant=False)
    assert glm("model.layers.5.self_attn.indexer.weights_proj") == BF16() and glm("lm_head") == BF16()


# ---------------------------------------------------------------------------------------------- errors
def _rewrite(path, edit):
    """Apply ``edit(tensors) -> tensors`` to the shard set, rewriting the index."""
    index_file = path / "model.safetensors.index.json"
    weight_map = json.loads(index_file.read_text())["weight_map"]
    tensors = _read_all(path)
    for f in set(weight_map.values()):
        (path / f).unlink()
    tensors = edit(tensors)
    save_file(tensors, str(path / "model-00001-of-00001.safetensors"))
    index_file.write_text(json.dumps({"metadata": {}, "weight_map": {k: "model-00001-of-00001.safetensors"
                                                                     for k in tensors}}))


@pytest.fixture
def small_ckpt(tmp_path):
    cfg = KimiK26Config.tiny().replace(num_hidden_layers=2)
    model = KimiK26ForCausalLM(cfg, dtype=torch.bfloat16, formats="checkpoint")
    init_random_weights_(model)
    return save_pretrained(model, tmp_path)


def test_missing_key_is_named(small_ckpt):
    key = "language_model.model.layers.1.mlp.experts.7.up_proj.weight_scale"
    _rewrite(small_ckpt, lambda t: {k: v for k, v in t.items() if k != key})
    with pytest.raises(CheckpointError, match=f"missing key '{key}'"):
        from_pretrained(small_ckpt)


def test_unexpected_key_is_named(small_ckpt):
    key = "language_model.model.layers.0.self_attn.rotary.inv_freq"
    _rewrite(small_ckpt, lambda t: {**t, key: torch.ones(4)})
    with pytest.raises(CheckpointError, match=f"unexpected key '{key}'"):
        from_pretrained(small_ckpt)


def test_key_outside_the_table_is_named(small_ckpt):
    _rewrite(small_ckpt, lambda t: {**t, "model.norm.weight": torch.ones(4)})  # no language_model. prefix
    with pytest.raises(CheckpointError, match="unexpected key 'model.norm.weight'"):
        from_pretrained(small_ckpt)


def test_misshaped_key_is_named(small_ckpt):
    key = "language_model.model.layers.0.self_attn.kv_b_proj.weight"
    _rewrite(small_ckpt, lambda t: {**t, key: t[key][:-1].clone()})
    with pytest.raises(CheckpointError, match=f"'{key}': checkpoint shape"):
        from_pretrained(small_ckpt)


def test_wrong_quantized_dtype_is_named(small_ckpt):
    key = "language_model.model.layers.1.mlp.experts.0.down_proj.weight_packed"
    _rewrite(small_ckpt, lambda t: {**t, key: t[key].to(torch.int64)})
    with pytest.raises(CheckpointError, match=f"'{key}': checkpoint dtype torch.int64"):
        from_pretrained(small_ckpt)


def test_wrong_weight_shape_is_named(small_ckpt):
    key = "language_model.model.layers.1.mlp.experts.2.gate_proj.weight_shape"
    _rewrite(small_ckpt, lambda t: {**t, key: torch.tensor([7, 7])})
    with pytest.raises((CheckpointError, RuntimeError), match="experts.2.gate_proj.weight_shape"):
        from_pretrained(small_ckpt)


def test_no_checkpoint_files(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(Glm52Config.tiny().to_hf()))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        from_pretrained(tmp_path)


def test_single_file_checkpoint(tmp_path):
    model = Glm52ForCausalLM(Glm52Config.tiny().replace(num_hidden_layers=2), dtype=torch.bfloat16)
    init_random_weights_(model)
    save_pretrained(model, tmp_path)
    (shard,) = {v for v in json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"].values()}
    (tmp_path / shard).rename(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors.index.json").unlink()
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" in f.keys()
    assert_same_state(model, from_pretrained(tmp_path, dtype=torch.bfloat16))


# ---------------------------------------------------------------------------------------------- plans
def test_plan_converts_on_load(glm_ckpt):
    from mla_quant.formats.plan import QuantPlan

    model, path = glm_ckpt
    plan = QuantPlan({r"re:.*mlp\.experts": Int4Group(32), r"re:.*self_attn\.o_proj": BF16()})
    loaded = from_pretrained(path, dtype=torch.bfloat16, plan=plan)
    fmts = loaded.linear_formats()
    assert fmts["model.layers.2.mlp.experts.9.down_proj"] == Int4Group(32)
    assert fmts["model.layers.2.self_attn.o_proj"] == BF16()
    assert fmts["model.layers.2.self_attn.kv_b_proj"] == FP8Block(act_quant=False)   # untouched: checkpoint's
    # the converted experts hold the FP8 weights re-quantized: close to, not equal to, the originals
    w0 = model.model.layers[2].mlp.experts.expert_weight(9, "down_proj")
    w1 = loaded.model.layers[2].mlp.experts.expert_weight(9, "down_proj")
    assert 0 < ((w1 - w0).norm() / w0.norm()) < 0.15
    same = from_pretrained(path, dtype=torch.bfloat16, plan=QuantPlan({"_default": None}))
    assert_same_state(model, same)


def test_loads_a_checkpoint_converted_by_mla_quant_convert(glm_ckpt, tmp_path):
    """GLM FP8 -> routed experts INT4 with ``mla_quant.convert`` (Cloudflare's recipe): the result loads in
    mixed formats (INT4 experts from the compressed-tensors config, FP8 layers by their weight_scale_inv)."""
    from mla_quant.convert import convert_checkpoint

    model, path = glm_ckpt
    convert_checkpoint(path, tmp_path / "int4", compare=False, progress=False)
    loaded = from_pretrained(tmp_path / "int4", dtype=torch.bfloat16)
    fmts = loaded.linear_formats()
    assert fmts["model.layers.1.mlp.experts.0.gate_proj"] == Int4Group(32)
    assert fmts["model.layers.1.mlp.shared_experts.gate_proj"] == FP8Block(act_quant=False)
    assert fmts["model.layers.1.self_attn.q_b_proj"] == FP8Block(act_quant=False) and fmts["lm_head"] == BF16()
    for key in ("model.layers.1.self_attn.q_b_proj.weight", "model.embed_tokens.weight"):
        assert torch.equal(_bits(loaded.state_dict()[key]), _bits(model.state_dict()[key])), key


def test_text_only_kimi_k2_fp8_layout(tmp_path):
    """K2-Instruct style: no wrapper, no ``language_model.`` prefix, FP8 blocks (``weight_scale_inv``)."""
    from mla_quant.models.config import GLM_FP8_QUANTIZATION_CONFIG

    cfg = KimiK26Config.tiny().replace(num_hidden_layers=2, vision_config=None,
                                       quantization_config=dict(GLM_FP8_QUANTIZATION_CONFIG))
    model = KimiK26ForCausalLM(cfg, dtype=torch.bfloat16, formats="checkpoint")
    init_random_weights_(model)
    save_pretrained(model, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["model_type"] == "kimi_k2" and "text_config" not in raw and raw["quantization_config"]["quant_method"] == "fp8"
    tensors = _read_all(tmp_path)
    assert "model.layers.1.mlp.experts.0.up_proj.weight_scale_inv" in tensors and "lm_head.weight" in tensors
    loaded = from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert_same_state(model, loaded)
    assert loaded.linear_formats()["model.layers.0.self_attn.o_proj"] == FP8Block(act_quant=False)
