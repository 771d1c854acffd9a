"""The models' plain forward: shapes, causality, structure (module names = checkpoint names), errors."""
from __future__ import annotations

import re

import pytest
import torch

from mla_quant.formats import BF16, FP8Block, Int4Group
from mla_quant.models import (Glm52Config, Glm52ForCausalLM, KimiK26Config, KimiK26ForCausalLM,
                              init_random_weights_, num_parameters)
from mla_quant.modules import MLP, MoE
from mla_quant.modules.dsa import DSAttention

MODELS = {"kimi": (KimiK26ForCausalLM, KimiK26Config.tiny), "glm": (Glm52ForCausalLM, Glm52Config.tiny)}


@pytest.fixture(scope="module", params=list(MODELS))
def tiny(request):
    cls, make = MODELS[request.param]
    model = cls(make(), dtype=torch.float32, formats="checkpoint")
    init_random_weights_(model, seed=7)
    return model


def test_shape_and_causality(tiny):
    cfg = tiny.config
    t = 14 if isinstance(cfg, Glm52Config) else 9           # GLM: longer than index_topk (8)
    ids = torch.randint(0, cfg.vocab_size, (2, t))
    with torch.no_grad():
        logits = tiny(ids)
        assert logits.shape == (2, t, cfg.vocab_size) and logits.dtype == torch.float32
        assert torch.isfinite(logits).all()
        cut = t - 4
        changed = ids.clone()
        changed[:, cut:] = torch.randint(0, cfg.vocab_size, (2, 4))
        other = tiny(changed)
    # tokens before the change see the same prefix: identical logits; the changed ones differ
    torch.testing.assert_close(other[:, :cut], logits[:, :cut], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(other[:, cut:], logits[:, cut:])
    # a batch row does not depend on the other rows
    with torch.no_grad():
        torch.testing.assert_close(tiny(ids[1:]), logits[1:], rtol=1e-5, atol=1e-5)


def test_structure_follows_config(tiny):
    cfg = tiny.config
    layers = tiny.model.layers
    assert len(layers) == cfg.num_hidden_layers
    for i, layer in enumerate(layers):
        assert isinstance(layer.mlp, MoE if i >= cfg.first_k_dense_replace else MLP)
        assert layer.self_attn.softmax_scale == pytest.approx(cfg.softmax_scale)
        if isinstance(cfg, Glm52Config):
            assert isinstance(layer.self_attn, DSAttention)
            assert (layer.self_attn.indexer is not None) == (cfg.indexer_types[i] == "full")
    keys = list(tiny.state_dict())
    assert keys[0] == "model.embed_tokens.weight" and keys[-1] == "lm_head.weight"
    assert "model.norm.weight" in keys and "model.layers.1.mlp.gate.e_score_correction_bias" in keys
    pattern = re.compile(r"^model\.layers\.\d+\.(input_layernorm|post_attention_layernorm|self_attn|mlp)\.")
    assert all(pattern.match(k) for k in keys if k.startswith("model.layers."))


@pytest.mark.parametrize("name", list(MODELS))
def test_parameter_count_of_a_bf16_model_equals_num_parameters(name):
    cls, make = MODELS[name]
    with torch.device("meta"):
        model = cls(make(), dtype=torch.bfloat16)
    assert sum(t.numel() for t in model.state_dict().values()) == num_parameters(model.config)


def test_full_configs_build_on_meta():
    """The real dimensions build (on meta, no memory) in the release formats, with the published counts."""
    with torch.device("meta"):
        kimi = KimiK26ForCausalLM(KimiK26Config.full().replace(num_hidden_layers=2), formats="checkpoint")
    fmts = kimi.linear_formats()
    assert fmts["model.layers.1.mlp.experts.383.down_proj"] == Int4Group(32)
    assert fmts["model.layers.1.self_attn.q_b_proj"] == BF16()
    packed = kimi.state_dict()["model.layers.1.mlp.experts.383.down_proj.weight_packed"]
    assert tuple(packed.shape) == (7168, 2048 // 8)
    with torch.device("meta"):
        glm = Glm52ForCausalLM(Glm52Config.full().replace(num_hidden_layers=4), formats="checkpoint")
    assert glm.linear_formats()["model.layers.3.mlp.experts.255.gate_proj"] == FP8Block(act_quant=False)
    sd = glm.state_dict()
    assert tuple(sd["model.layers.0.self_attn.indexer.wq_b.weight"].shape) == (32 * 128, 2048)
    assert tuple(sd["model.layers.0.self_attn.kv_b_proj.weight_scale_inv"].shape) == (28672 // 128, 512 // 128)
    assert not any(k.startswith("model.layers.2.self_attn.indexer") for k in sd)  # layer 2 is "shared"


def test_input_errors(tiny):
    v = tiny.config.vocab_size
    with pytest.raises(ValueError, match="input_ids"):
        tiny(torch.zeros(5, dtype=torch.long))               # [T] without a batch
    with pytest.raises(ValueError, match="input_ids"):
        tiny(torch.zeros(1, 3))                               # float ids
    with pytest.raises(ValueError, match=f"token id {v} outside"):
        tiny(torch.tensor([[1, v]]))
    with pytest.raises(ValueError, match="only with a PagedBatch"):
        tiny(torch.zeros(1, 3, dtype=torch.long), logits_index=torch.tensor([0]))


def test_config_type_and_tied_embeddings_errors():
    with pytest.raises(TypeError, match="KimiK26Config"):
        KimiK26ForCausalLM(Glm52Config.tiny())
    with pytest.raises(NotImplementedError, match="tie_word_embeddings"):
        Glm52ForCausalLM(Glm52Config.tiny().replace(tie_word_embeddings=True))
    with pytest.raises(TypeError, match="formats"):
        Glm52ForCausalLM(Glm52Config.tiny(), formats="int4")
