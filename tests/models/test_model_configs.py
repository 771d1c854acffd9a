"""Configs read from the real config.json layouts; .full() dimensions and parameter counts."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from mla_quant.models import Glm52Config, KimiK26Config
from mla_quant.models.config import config_from_hf, num_parameters

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
KIMI_JSON = CONFIGS / "kimi_k2_6.config.json"
GLM_JSON = CONFIGS / "glm_5_2_fp8.config.json"


def test_config_files_are_the_reference_copies():
    ref = Path("/work/shared/reference/configs")
    if not ref.exists():
        pytest.skip("reference folder not present")
    for name in (KIMI_JSON.name, GLM_JSON.name):
        assert json.loads((CONFIGS / name).read_text()) == json.loads((ref / name).read_text())


def test_kimi_from_real_layout_equals_full():
    raw = json.loads(KIMI_JSON.read_text())
    cfg = KimiK26Config.from_hf(KIMI_JSON)
    assert cfg == KimiK26Config.full()
    # every key of the real text_config is a field with the file's value
    for key, value in raw["text_config"].items():
        assert getattr(cfg, key) == value, key
    assert cfg.vision_config == raw["vision_config"] and cfg.has_language_model_prefix
    assert cfg.quantization_config["quant_method"] == "compressed-tensors"
    # published dimensions
    assert (cfg.num_hidden_layers, cfg.n_routed_experts, cfg.hidden_size, cfg.first_k_dense_replace) == (61, 384, 7168, 1)
    assert (cfg.num_attention_heads, cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_head_dim) == (64, 512, 1536, 192)
    rp = cfg.rope_params
    assert rp["rope_type"] == "yarn" and rp["factor"] == 64.0 and rp["original_max_position_embeddings"] == 4096
    assert (rp["beta_fast"], rp["beta_slow"], rp["mscale"], rp["mscale_all_dim"]) == (1.0, 1.0, 1.0, 1.0)
    assert cfg.softmax_scale == pytest.approx(0.144680, abs=1e-6)


def test_kimi_round_trip_real_nesting():
    raw = json.loads(KIMI_JSON.read_text())
    out = KimiK26Config.from_hf(KIMI_JSON).to_hf()
    assert out["model_type"] == "kimi_k25" and out["architectures"] == raw["architectures"]
    assert out["text_config"]["model_type"] == "kimi_k2"
    for key, value in raw["text_config"].items():
        assert out["text_config"][key] == value, key
    assert KimiK26Config.from_hf(out) == KimiK26Config.full()


def test_kimi_text_only_layout_and_other_values():
    raw = json.loads(KIMI_JSON.read_text())["text_config"]
    raw = dict(raw, model_type="deepseek_v3", rope_scaling=dict(raw["rope_scaling"], beta_fast=32.0, factor=32.0),
               rms_norm_eps=1e-6, some_future_key=7)
    cfg = KimiK26Config.from_hf(raw)
    assert not cfg.has_language_model_prefix and cfg.extra == {"some_future_key": 7}
    assert cfg.rope_params["beta_fast"] == 32.0 and cfg.rms_norm_eps == 1e-6
    assert cfg.softmax_scale == pytest.approx(0.130861, abs=1e-6)
    assert cfg.to_hf()["some_future_key"] == 7 and "text_config" not in cfg.to_hf()


def test_glm_from_real_layout_equals_full():
    raw = json.loads(GLM_JSON.read_text())
    cfg = Glm52Config.from_hf(GLM_JSON)
    assert cfg == Glm52Config.full()
    for key, value in raw.items():
        assert getattr(cfg, key) == value, key
    assert (cfg.num_hidden_layers, cfg.n_routed_experts, cfg.hidden_size, cfg.first_k_dense_replace) == (78, 256, 6144, 3)
    assert cfg.indexer_types.count("full") == 21 and cfg.indexer_types.count("shared") == 57
    assert cfg.softmax_scale == 0.0625 and cfg.rope_params == {"rope_type": "default", "rope_theta": 8e6}
    assert cfg.quantization_config["weight_block_size"] == [128, 128]


def test_glm_indexer_types_rule_and_overrides():
    # the HF rule: "full" if max(i - offset + 1, 0) % freq == 0
    assert Glm52Config.derive_indexer_types(8, 4, 2) == ["full", "full", "shared", "shared", "shared", "full",
                                                         "shared", "shared"]
    assert Glm52Config.derive_indexer_types(3, None, None) == ["full"] * 3  # HF defaults: freq 1
    raw = json.loads(GLM_JSON.read_text())
    explicit = ["full", "shared"] * 39
    assert Glm52Config.from_hf(dict(raw, indexer_types=explicit)).indexer_types == explicit
    pattern = Glm52Config.from_hf(dict(raw, index_topk_pattern="F" + "S" * 77))
    assert pattern.indexer_types == ["full"] + ["shared"] * 77
    other = Glm52Config.from_hf(dict(raw, index_topk_freq=3, rope_parameters={"rope_theta": 1e6, "rope_type": "default"},
                                     rope_theta=None))
    assert other.indexer_types.count("full") == 27 and other.rope_params["rope_theta"] == 1e6
    with pytest.raises(ValueError, match="indexer_types"):
        Glm52Config.from_hf(dict(raw, indexer_types=["shared"] * 78))
    with pytest.raises(ValueError, match="indexer_types"):
        Glm52Config.from_hf(dict(raw, indexer_types=["full"] * 5))


def test_config_dispatch_and_errors(tmp_path):
    assert isinstance(config_from_hf(KIMI_JSON), KimiK26Config)
    assert isinstance(config_from_hf(GLM_JSON), Glm52Config)
    (tmp_path / "config.json").write_text(GLM_JSON.read_text())
    assert isinstance(config_from_hf(tmp_path), Glm52Config)
    with pytest.raises(ValueError, match="model_type 'llama'"):
        config_from_hf({"model_type": "llama"})
    with pytest.raises(FileNotFoundError, match="config.json"):
        config_from_hf(tmp_path / "nope")
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        KimiK26Config.tiny().replace(num_experts_per_tok=99)
    with pytest.raises(ValueError, match="rope"):
        KimiK26Config.tiny().replace(rope_scaling={"type": "longrope", "factor": 2.0})


def test_parameter_counts_full():
    kimi = num_parameters(KimiK26Config.full(), breakdown=True)
    assert sum(kimi.values()) == pytest.approx(1.026e12, rel=0.01)
    assert kimi["routed_experts"] == pytest.approx(1.0147e12, rel=1e-3)
    assert kimi["attention"] == pytest.approx(6.17e9, rel=1e-2)
    assert kimi["embeddings"] == pytest.approx(2.35e9, rel=1e-2)
    assert kimi["dense_mlp"] == pytest.approx(0.40e9, rel=1e-2)
    assert kimi["shared_experts"] + kimi["routers"] == pytest.approx(2.81e9, rel=1e-2)
    glm = num_parameters(Glm52Config.full())
    assert glm == pytest.approx(743.4e9, rel=0.01) and glm == pytest.approx(744e9, rel=0.01)


@pytest.mark.parametrize("cls", [KimiK26Config, Glm52Config])
def test_tiny_keeps_structure(cls):
    t = cls.tiny()
    assert cls.from_hf(t.to_hf()) == t
    assert 0 < t.first_k_dense_replace < t.num_hidden_layers  # dense and MoE layers
    for dim in (t.hidden_size, t.intermediate_size, t.moe_intermediate_size, t.q_lora_rank, t.kv_lora_rank,
                t.num_attention_heads * t.v_head_dim):
        assert dim % 128 == 0 and dim % 32 == 0, dim
    assert t.quantization_config == cls.full().quantization_config
    assert t.rope_params["rope_type"] == cls.full().rope_params["rope_type"]
    if cls is Glm52Config:
        assert "full" in t.indexer_types[1:] and "shared" in t.indexer_types and t.index_topk <= 8
    assert math.isfinite(t.softmax_scale)
