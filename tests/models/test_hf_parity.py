"""Parity with Hugging Face transformers (>= 5.24; optional): the same weights, read from the real on-disk
layouts, give the same fp32 logits as ``deepseek_v3`` (Kimi K2.6's text model) and ``glm_moe_dsa`` (GLM 5.2,
with its indexer and "shared" layers, on sequences longer than ``index_topk``) — relative error < 1e-4.

The reference side reads the files itself (``hf_reference.py``): INT4 and FP8 weights are dequantized there
with its own few lines of torch, the experts fused as transformers v5 holds them.
"""
from __future__ import annotations

import pytest
import torch

from mla_quant.models import (Glm52Config, Glm52ForCausalLM, KimiK26Config, KimiK26ForCausalLM, from_pretrained,
                              init_random_weights_, save_pretrained)

transformers = pytest.importorskip("transformers")
if tuple(int(p) for p in transformers.__version__.split(".")[:2]) < (5, 24):
    pytest.skip(f"transformers {transformers.__version__} < 5.24 (older releases had a GLM RoPE bug)",
                allow_module_level=True)

from tests.models.hf_reference import hf_reference_model  # noqa: E402

REL_TOL = 1e-4


def _kimi_other() -> KimiK26Config:
    """Other values than the release: a direct q_proj, group-limited routing, YaRN with beta_fast 32 and
    mscale != mscale_all_dim (an attention_factor != 1), two dense layers."""
    rope = {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
            "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 1.0}
    return KimiK26Config.tiny().replace(q_lora_rank=None, n_group=4, topk_group=2, num_hidden_layers=3,
                                        first_k_dense_replace=2, rope_scaling=rope, rms_norm_eps=1e-6,
                                        routed_scaling_factor=2.5)


def _glm_other() -> Glm52Config:
    """Explicit indexer types with two shared layers in a row after the first full one."""
    return Glm52Config.tiny().replace(indexer_types=["full", "shared", "shared", "full"], index_topk=6,
                                      rope_theta=1e6, first_k_dense_replace=2)


def _kimi_k2_fp8() -> KimiK26Config:
    """A text-only Kimi K2 (K2-Instruct style: ``model_type: kimi_k2`` at the top, no ``language_model.``
    prefix, DeepSeek FP8 blocks with ``weight_scale_inv``)."""
    from mla_quant.models.config import GLM_FP8_QUANTIZATION_CONFIG

    return KimiK26Config.tiny().replace(vision_config=None, quantization_config=dict(GLM_FP8_QUANTIZATION_CONFIG))


CASES = {
    # name: (model class, config, formats, sequence length)
    "kimi_int4": (KimiK26ForCausalLM, KimiK26Config.tiny(), "checkpoint", 12),
    "kimi_other_bf16": (KimiK26ForCausalLM, _kimi_other(), None, 10),
    "kimi_k2_fp8_text_only": (KimiK26ForCausalLM, _kimi_k2_fp8(), "checkpoint", 9),
    "glm_fp8": (Glm52ForCausalLM, Glm52Config.tiny(), "checkpoint", 20),
    "glm_other_bf16": (Glm52ForCausalLM, _glm_other(), None, 17),
}


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(name, tmp_path):
    cls, config, formats, seq = CASES[name]
    model = cls(config, dtype=torch.bfloat16, formats=formats)   # bf16 on disk, as the releases
    init_random_weights_(model, seed=11)
    save_pretrained(model, tmp_path, max_shard_bytes=1 << 20)
    ours = from_pretrained(tmp_path, dtype=torch.float32)
    ref = hf_reference_model(tmp_path)
    ids = torch.randint(0, config.vocab_size, (2, seq))
    with torch.no_grad():
        got = ours(ids)
        want = ref(ids).logits
    assert got.shape == want.shape == (2, seq, config.vocab_size)
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < REL_TOL, f"{name}: relative error {rel:.2e}"
    # the attention scale the layers use is the config's (HF: yarn_apply_mscale)
    assert ours.model.layers[0].self_attn.softmax_scale == pytest.approx(ref.model.layers[0].self_attn.scaling)


def test_transformers_reads_our_config_json(tmp_path):
    """The saved config.json parses with transformers' own config classes (kimi_k25 -> deepseek_v3)."""
    kimi = KimiK26ForCausalLM(KimiK26Config.tiny().replace(num_hidden_layers=2), dtype=torch.bfloat16,
                              formats="checkpoint")
    init_random_weights_(kimi)
    save_pretrained(kimi, tmp_path / "kimi")
    cfg = transformers.AutoConfig.from_pretrained(tmp_path / "kimi")
    assert cfg.model_type == "kimi_k25" and cfg.text_config.model_type == "deepseek_v3"
    for key in ("hidden_size", "n_routed_experts", "q_lora_rank", "first_k_dense_replace", "routed_scaling_factor"):
        assert getattr(cfg.text_config, key) == getattr(kimi.config, key), key
    assert cfg.text_config.rope_parameters["rope_type"] == "yarn"
    glm = Glm52ForCausalLM(Glm52Config.tiny().replace(num_hidden_layers=2), dtype=torch.bfloat16)
    init_random_weights_(glm)
    save_pretrained(glm, tmp_path / "glm")
    cfg = transformers.AutoConfig.from_pretrained(tmp_path / "glm")
    assert cfg.model_type == "glm_moe_dsa" and cfg.indexer_types == glm.config.indexer_types
    assert cfg.index_topk == glm.config.index_topk
