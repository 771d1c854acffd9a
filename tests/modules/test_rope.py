import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mla_quant.modules import RotaryEmbedding, YarnScaling
from mla_quant.modules.rope import rope_inv_freq, softmax_scale, yarn_find_correction_range

CONFIGS = Path(__file__).resolve().parents[2] / "configs"   # the published config.json files, copied
KIMI_F64 = {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


# ------------------------------------------------------------------------- the numbers of model_specs.md
def test_softmax_scale_with_yarn_mscale_matches_the_spec():
    assert softmax_scale(192, YarnScaling.from_config({**KIMI_F64, "factor": 32.0})) == pytest.approx(0.130861, abs=5e-7)
    assert softmax_scale(192, YarnScaling.from_config(KIMI_F64)) == pytest.approx(0.144680, abs=5e-7)
    ds_v3 = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
             "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    assert softmax_scale(192, YarnScaling.from_config(ds_v3)) == pytest.approx(0.135234, abs=5e-7)
    assert softmax_scale(256, None) == 0.0625  # GLM-5.x: no YaRN


def test_correction_range_matches_the_spec():
    assert yarn_find_correction_range(1, 1, 64, 50000, 4096) == (19, 20)   # Kimi, beta 1/1
    assert yarn_find_correction_range(32, 1, 64, 50000, 4096) == (8, 20)   # if beta_fast were 32
    assert yarn_find_correction_range(32, 1, 64, 10000, 4096) == (10, 23)  # DeepSeek-V3


def test_real_configs_parse():
    kimi = json.loads((CONFIGS / "kimi_k2_6.config.json").read_text())["text_config"]
    rope = RotaryEmbedding.from_config(kimi["qk_rope_head_dim"], kimi["rope_theta"], kimi["rope_scaling"])
    assert rope.attention_factor == 1.0  # mscale == mscale_all_dim
    assert rope.softmax_scale(kimi["qk_nope_head_dim"] + kimi["qk_rope_head_dim"]) == pytest.approx(0.144680, abs=5e-7)
    glm = json.loads((CONFIGS / "glm_5_2_fp8.config.json").read_text())
    rope = RotaryEmbedding.from_config(glm["qk_rope_head_dim"], glm["rope_theta"], glm["rope_scaling"])
    assert rope.scaling is None and rope.softmax_scale(256) == 0.0625
    assert torch.equal(rope.inv_freq, 1.0 / (8e6 ** (torch.arange(0, 64, 2).float() / 64)))


def test_yarn_frequencies_extrapolate_high_and_interpolate_low_dims():
    s = YarnScaling.from_config({**KIMI_F64, "beta_fast": 32.0})
    plain, yarn = rope_inv_freq(64, 50000.0), rope_inv_freq(64, 50000.0, s)
    low, high = yarn_find_correction_range(32, 1, 64, 50000.0, 4096)
    assert torch.equal(yarn[:low], plain[:low])                              # fast dims untouched
    assert torch.allclose(yarn[high:], plain[high:] / 64, rtol=1e-6)         # slow dims / factor
    mid = yarn[low:high]
    assert torch.all(mid <= plain[low:high]) and torch.all(mid >= plain[low:high] / 64)


def test_attention_factor_rules():
    assert YarnScaling.from_config({**KIMI_F64, "mscale": 1.0, "mscale_all_dim": 0.707}).cos_sin_factor() == \
        pytest.approx((0.1 * math.log(64) + 1) / (0.1 * 0.707 * math.log(64) + 1))
    no_m = YarnScaling.from_config({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096})
    assert no_m.cos_sin_factor() == pytest.approx(0.1 * math.log(4) + 1)
    assert no_m.softmax_mscale() == 1.0 and (no_m.beta_fast, no_m.beta_slow) == (32.0, 1.0)
    assert YarnScaling.from_config({"rope_type": "default"}) is None
    with pytest.raises(ValueError, match="not supported"):
        YarnScaling.from_config({"type": "longrope"})
    with pytest.raises(ValueError, match="factor"):
        YarnScaling.from_config({"type": "yarn"})


# --------------------------------------------------------------------------------- rotation conventions
def _deepseek_complex(x, positions, inv_freq):
    """DeepSeek reference apply_rotary_emb: pairs as complex numbers times polar(1, pos·freq)."""
    freqs_cis = torch.polar(torch.ones(len(positions), len(inv_freq)), torch.outer(positions.float(), inv_freq))
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs_cis[:, None, :]).flatten(-2)


def _hf_interleave(x, cos_half, sin_half):
    """HF apply_rotary_pos_emb_interleave: permute pairs to half-split order, then rotate_half."""
    t, h, d = x.shape
    xp = x.view(t, h, d // 2, 2).transpose(-1, -2).reshape(t, h, d)
    cos = torch.cat([cos_half, cos_half], -1)[:, None]
    sin = torch.cat([sin_half, sin_half], -1)[:, None]
    rot = torch.cat([-xp[..., d // 2:], xp[..., : d // 2]], -1)
    return xp * cos + rot * sin


@given(t=st.integers(1, 40), h=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_interleaved_matches_deepseek_complex_form_and_hf_permuted_form(t, h, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, 64, generator=g)
    positions = torch.randint(0, 300000, (t,), generator=g)
    rope = RotaryEmbedding(64, 50000.0, KIMI_F64)
    y = rope(x, positions)
    assert torch.allclose(y, _deepseek_complex(x, positions, rope.inv_freq), atol=1e-5)
    cos, sin = rope.cos_sin(positions)
    hf = _hf_interleave(x, cos, sin)
    perm = torch.cat([torch.arange(0, 64, 2), torch.arange(1, 64, 2)])
    assert torch.allclose(y[..., perm], hf, atol=1e-5)  # same rotation, HF keeps the permuted order


def test_half_split_matches_rotate_half():
    x = torch.randn(5, 3, 64)
    pos = torch.arange(5) * 1000
    rope = RotaryEmbedding(64, 10000.0, interleaved=False)
    cos, sin = rope.cos_sin(pos)
    cos, sin = torch.cat([cos, cos], -1)[:, None], torch.cat([sin, sin], -1)[:, None]
    rot = torch.cat([-x[..., 32:], x[..., :32]], -1)
    assert torch.allclose(rope(x, pos), x * cos + rot * sin, atol=1e-6)


@pytest.mark.parametrize("interleaved", [True, False])
def test_scores_depend_only_on_relative_position(interleaved):
    rope = RotaryEmbedding(64, 50000.0, KIMI_F64, interleaved=interleaved)
    q, k = torch.randn(64, dtype=torch.float64).float(), torch.randn(64).float()
    def score(pq, pk):
        return (rope(q[None], torch.tensor([pq])) * rope(k[None], torch.tensor([pk]))).sum().item()
    assert score(10, 3) == pytest.approx(score(1007, 1000), rel=1e-4, abs=1e-4)
    assert score(10, 3) != pytest.approx(score(10, 4), rel=1e-3)


def test_bf16_rotation_is_computed_in_fp32_and_rounded_once():
    x = torch.randn(7, 2, 64).to(torch.bfloat16)
    pos = torch.arange(7)
    rope = RotaryEmbedding(64, 50000.0, KIMI_F64)
    y = rope(x, pos)
    assert y.dtype == torch.bfloat16 and torch.equal(y, rope(x.float(), pos).to(torch.bfloat16))


def test_position_prefix_shapes_and_errors():
    rope = RotaryEmbedding(8, 10000.0)
    x = torch.randn(2, 5, 3, 8)
    pos = torch.arange(5).expand(2, 5)
    y = rope(x, pos)
    assert torch.allclose(y[1, :, 2], rope(x[1, :, 2], torch.arange(5)))  # [T, D] with [T]
    assert torch.equal(rope(x, torch.zeros(2, 5, dtype=torch.long)), x)   # position 0 is the identity
    with pytest.raises(ValueError, match="positions"):
        rope(x, torch.arange(5))
    with pytest.raises(ValueError, match="features"):
        rope(torch.randn(5, 6), torch.arange(5))
    with pytest.raises(ValueError, match="even"):
        RotaryEmbedding(7)
