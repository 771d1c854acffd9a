"""kv_capacity_tokens: the seed's Kimi K2.6 numbers from the real config, the formula on stand-in configs."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from mla_quant.cache import kv_bytes_per_token, kv_capacity, kv_capacity_tokens, weight_bytes_per_gpu
from mla_quant.formats import KVFormat

CONFIGS = Path(__file__).resolve().parents[2] / "configs"   # the published config.json files, copied
KIMI = CONFIGS / "kimi_k2_6.config.json"


def test_kimi_k26_on_8_h200_tp8_reproduces_the_seed():
    config = json.loads(KIMI.read_text())            # the multimodal file: the text_config is used
    bf16 = kv_capacity_tokens(config, "bf16")
    fp8 = kv_capacity_tokens(config, "fp8_e4m3")
    fp8_tensor = kv_capacity_tokens(config, KVFormat("fp8_e4m3", "tensor"))
    print(f"Kimi K2.6 8xH200 TP8: bf16 {bf16}, fp8_e4m3 {fp8}, fp8 per tensor {fp8_tensor}, "
          f"fp8_ds_mla {kv_capacity_tokens(config, 'fp8_ds_mla')}")
    assert bf16 == pytest.approx(686_000, rel=0.02)
    assert fp8 == pytest.approx(1_370_000, rel=0.02)
    assert fp8_tensor == pytest.approx(1_370_000, rel=0.02)
    assert fp8_tensor == pytest.approx(2 * bf16, rel=0.001)
    assert bf16 % 64 == 0 and fp8 % 64 == 0


def test_kimi_k26_weight_bytes_follow_the_checkpoint():
    text = json.loads(KIMI.read_text())["text_config"]
    whole = weight_bytes_per_gpu(text, tp=1)             # one GPU holding everything = the checkpoint
    # INT4 g32 routed experts (0.5 + 2/32 bytes per parameter) 570.8 GB + 11.7B bf16 parameters 23.4 GB
    assert whole == pytest.approx(594.2e9, rel=0.002)
    assert weight_bytes_per_gpu(text, tp=8) == pytest.approx(76.18e9, rel=0.002)
    assert kv_bytes_per_token(text, "bf16") == 61 * 1152
    report = kv_capacity(text, "bf16")
    assert report.replicas == 1 and report.hbm_bytes == 141e9 and report.reserve_bytes == pytest.approx(16.6e9)
    assert report.tokens * report.bytes_per_token <= report.kv_budget_bytes


def test_formula_on_a_stand_in_config_dict_or_object():
    cfg = {"num_hidden_layers": 3, "kv_lora_rank": 128, "qk_rope_head_dim": 32}
    per_token = 3 * (128 + 32) * 2
    tokens = kv_capacity_tokens(cfg, "bf16", hbm_gb=10, weight_bytes_per_gpu=4e9, reserve_gb=1, page_size=16)
    assert tokens == int(5e9 // (per_token * 16)) * 16
    obj = SimpleNamespace(text_config=SimpleNamespace(**cfg))
    assert kv_capacity_tokens(obj, "bf16", hbm_gb=10, weight_bytes_per_gpu=4e9, reserve_gb=1, page_size=16) == tokens
    mixed = ["bf16", "fp8_e4m3", "fp8_ds_mla"]
    assert kv_bytes_per_token(cfg, mixed) == 320 + 164 + (128 + 4 + 64)
    assert kv_capacity_tokens(cfg, "bf16", hbm_gb=1, weight_bytes_per_gpu=4e9) == 0   # nothing left


def test_fp8_doubles_tokens_and_weights_shrink_them():
    cfg = {"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64}
    kw = dict(weight_bytes_per_gpu=70e9, page_size=1)
    bf16 = kv_capacity_tokens(cfg, "bf16", **kw)
    assert kv_capacity_tokens(cfg, KVFormat("fp8_e4m3", "tensor"), **kw) == pytest.approx(2 * bf16, abs=2)
    assert kv_capacity_tokens(cfg, "fp8_e4m3", **kw) == pytest.approx(2 * bf16 * 576 / 580, abs=2)
    assert kv_capacity_tokens(cfg, "bf16", weight_bytes_per_gpu=80e9, page_size=1) < bf16


def test_bad_arguments_are_named():
    cfg = {"num_hidden_layers": 3, "kv_lora_rank": 128, "qk_rope_head_dim": 32}
    with pytest.raises(ValueError, match="kv_lora_rank"):
        kv_capacity_tokens({"num_hidden_layers": 3, "qk_rope_head_dim": 32}, weight_bytes_per_gpu=1e9)
    with pytest.raises(ValueError, match="hidden_size"):
        kv_capacity_tokens(cfg)                       # no weight bytes given and none derivable
    with pytest.raises(ValueError, match="gpus/tp"):
        kv_capacity_tokens(cfg, gpus=8, tp=3, weight_bytes_per_gpu=1e9)
    with pytest.raises(ValueError, match="kv"):
        kv_capacity_tokens(cfg, ["bf16"], weight_bytes_per_gpu=1e9)
