"""Per-layer error through hooks, logits through the paged cache, and the report."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from mla_quant.eval import calibrate_kv_scales, capture, compare, kl_divergence, layer_errors, paged_logits
from mla_quant.formats import Int4Group, KVFormat
from mla_quant.formats.plan import QuantPlan, quantize_
from mla_quant.models import KimiK26Config, KimiK26ForCausalLM, init_random_weights_
from tests.conftest import DEVICE


@pytest.fixture(scope="module")
def model():
    m = KimiK26ForCausalLM(KimiK26Config.tiny(), dtype=torch.float32, device=DEVICE)
    return init_random_weights_(m, 0).eval()


@pytest.fixture(scope="module")
def dense():
    """No router: logits move continuously with the KV rounding (a MoE router can flip on a near-tie)."""
    config = KimiK26Config.tiny().replace(num_hidden_layers=2, first_k_dense_replace=2)
    return init_random_weights_(KimiK26ForCausalLM(config, dtype=torch.float32, device=DEVICE), 0).eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, 512, (2, 19), generator=torch.Generator().manual_seed(0)).to(DEVICE)


def test_layer_errors_locate_the_change(model, ids):
    """Identical models: infinite SQNR everywhere. INT4 experts in layer 2 only: layers 0-1 stay exact, layer
    2's attention (before its experts) stays exact and its output does not."""
    same = layer_errors(model, copy.deepcopy(model), ids)
    assert [r["layer"] for r in same] == [0, 1, 2]
    assert all(math.isinf(v) for r in same for k, v in r.items() if k != "layer")
    changed = quantize_(copy.deepcopy(model), QuantPlan({r"re:model\.layers\.2\.mlp\.experts": Int4Group(32)}))
    rows = layer_errors(model, changed, ids)
    assert all(math.isinf(rows[i]["hidden_sqnr_db"]) for i in (0, 1))
    assert math.isinf(rows[2]["attn_sqnr_db"])
    assert 10 < rows[2]["hidden_sqnr_db"] < 60


def test_capture_needs_a_match(model):
    with pytest.raises(ValueError, match="pattern"):
        with capture(model, "nothing"):
            pass


def test_paged_logits_match_the_plain_forward(dense, ids):
    """BF16 pages, prefill in chunks then decode: the plain forward up to the latents' bf16 rounding
    (measured KL ≈ 2.5e-6); FP8 pages are further off (measured ≈ 6e-4)."""
    with torch.no_grad():
        plain = dense(ids).float()
    paged = paged_logits(dense, ids, "bf16", page_size=4, chunk=5, decode_from=12)
    assert paged.shape == plain.shape
    assert float(kl_divergence(plain, paged)) < 1e-4
    assert torch.equal(plain.argmax(-1), paged.argmax(-1))
    fp8 = paged_logits(dense, ids, "fp8_e4m3", page_size=4, decode_from=12)
    assert float(kl_divergence(plain, paged)) < float(kl_divergence(plain, fp8)) < 0.05
    with pytest.raises(ValueError, match="decode_from"):
        paged_logits(dense, ids, decode_from=0)


def test_compare_report(model, ids, tmp_path):
    q = quantize_(copy.deepcopy(model), QuantPlan({r"re:.*mlp\.experts": Int4Group(32)}))
    report = compare(model, q, ids, "int4 experts + fp8 kv", kv_format="fp8_e4m3", page_size=4, bins=4)
    assert 0 < report.kl < 0.5 and 0 < report.top1 <= 1 and report.positions == 38
    assert len(report.by_position) == 4 and len(report.layers) == 3
    text = report.format()
    assert "int4 experts + fp8 kv" in text and "hidden_sqnr_db" in text
    assert report.to_dict()["kl"] == report.kl
    pytest.importorskip("matplotlib")
    assert (tmp_path / "r.png").exists() is False
    report.plot(str(tmp_path / "r.png"))
    assert (tmp_path / "r.png").stat().st_size > 1000


def test_keep_from_and_per_tensor_scales(dense, ids):
    """Only the kept rows come back (the same values); per-tensor FP8 with calibrated scales is about as close
    as per-token FP8, and scales 100x too small (saturating at ±448·scale) are far worse."""
    with torch.no_grad():
        plain = dense(ids).float()
    full = paged_logits(dense, ids, "fp8_e4m3", page_size=4, decode_from=12)
    tail = paged_logits(dense, ids, "fp8_e4m3", page_size=4, decode_from=12, keep_from=10)
    assert tail.shape == (2, 9, 512) and torch.allclose(tail, full[:, 10:], atol=1e-5)
    scales = calibrate_kv_scales(dense, ids, page_size=4)
    assert len(scales) == 2 and all(0 < s < 1 for s in scales)
    tensor = KVFormat("fp8_e4m3", "tensor")
    good = paged_logits(dense, ids, tensor, page_size=4, decode_from=12, tensor_scales=scales)
    bad = paged_logits(dense, ids, tensor, page_size=4, decode_from=12, tensor_scales=[s / 100 for s in scales])
    kl_token, kl_good, kl_bad = (float(kl_divergence(plain, x)) for x in (full, good, bad))
    assert kl_good < 3 * kl_token and kl_bad > 10 * kl_good
