"""``python -m mla_quant.convert``: a tiny FP8 / BF16 checkpoint on disk, converted, reloaded bit for bit."""
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mla_quant.convert import (EXPERTS, MSE_GRID, convert_checkpoint, ignore_list, int4_quantize_mse, main,
                               parse_plan, quantize_weight)
from mla_quant.formats import BF16, FP8Block, Int4Group
from mla_quant.formats.plan import QuantPlan
from mla_quant.gptq import HESSIAN_SUFFIX, gptq_quantize
from mla_quant.kernels import fp8_quant
from mla_quant.kernels import int4_quant as I
from mla_quant.modules import QuantLinear
from mla_quant.testing import assert_bitwise_equal

H, F = 256, 64  # hidden, expert width (tiny; group 32 divides both)
EXPERT_KEYS = [f"model.layers.{l}.mlp.experts.{e}.{p}_proj" for l in (1, 2) for e in range(2)
               for p in ("gate", "up", "down")]
OTHER_LINEAR = ["model.layers.1.self_attn.q_proj", "model.layers.2.self_attn.q_proj",
                "model.layers.1.mlp.shared_experts.gate_proj", "model.layers.0.mlp.gate_proj"]


def _shape(name):
    return (H, F) if name.endswith("down_proj") else (F, H) if "experts" in name else (H, H)


def _write_checkpoint(folder, fp8=True, seed=0):
    """Two shards, an index, a config; one expert's weight_scale_inv sits in the other shard."""
    g = torch.Generator().manual_seed(seed)
    shards = [{}, {}]
    dense = {}
    for i, name in enumerate(EXPERT_KEYS + OTHER_LINEAR):
        w = torch.randn(_shape(name), generator=g) * 0.02
        w[0, :5] *= 40  # outliers, so clipping matters
        dense[name] = w
        if fp8:
            q, s = fp8_quant.block_quant_fp8_reference(w)
            shards[i % 2][name + ".weight"] = q
            shards[(i + (name == EXPERT_KEYS[0])) % 2][name + ".weight_scale_inv"] = s
        else:
            shards[i % 2][name + ".weight"] = w.to(torch.bfloat16)
    shards[0]["model.embed_tokens.weight"] = torch.randn(100, H, generator=g).to(torch.bfloat16)
    shards[1]["model.layers.1.input_layernorm.weight"] = torch.rand(H, generator=g).to(torch.bfloat16)
    shards[1]["model.layers.1.mlp.gate.e_score_correction_bias"] = torch.rand(4, generator=g)
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file(shard, str(folder / name))
        weight_map.update({k: name for k in shard})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    (folder / "config.json").write_text(json.dumps({"model_type": "glm_moe_dsa", "hidden_size": H,
                                                    **({"quantization_config": qc} if fp8 else {})}))
    (folder / "tokenizer_config.json").write_text("{}")
    return dense


def _load_all(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _source_weight(src, name):
    t = _load_all(src)
    if name + ".weight_scale_inv" in t:
        return fp8_quant.block_dequant_fp8_reference(t[name + ".weight"], t[name + ".weight_scale_inv"],
                                                     out_dtype=torch.float32)
    return t[name + ".weight"].float()


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8-source", "bf16-source"])
def test_rtn_output_reloads_bit_exact_with_in_memory_quantization(tmp_path, fp8):
    src, dst = tmp_path / "src", tmp_path / "dst"
    _write_checkpoint(src, fp8=fp8)
    before = _load_all(src)
    report = convert_checkpoint(src, dst, method="rtn", progress=False)
    out = _load_all(dst)
    assert len(report.tensors) == len(EXPERT_KEYS)
    for name in EXPERT_KEYS:
        assert name + ".weight" not in out and name + ".weight_scale_inv" not in out
        # the same weight loaded into a QuantLinear and converted in memory (what quantize_ does)
        layer = QuantLinear(*reversed(_shape(name)), fmt=FP8Block(act_quant=False) if fp8 else BF16())
        layer.load_state_dict({k[len(name) + 1:]: v for k, v in before.items() if k.startswith(name + ".")})
        layer.convert_format_(Int4Group(32))
        for suffix in ("weight_packed", "weight_scale", "weight_shape"):
            assert_bitwise_equal(out[f"{name}.{suffix}"], getattr(layer, suffix), f"{name}.{suffix}")
    for key, t in before.items():  # everything else is copied bit for bit
        if not any(key.startswith(n + ".") for n in EXPERT_KEYS):
            assert_bitwise_equal(out[key], t, key)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(out)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in out.values())
    assert (dst / "tokenizer_config.json").is_file()
    assert report.bytes_out < report.bytes_in


def test_mse_method_is_bit_exact_and_never_worse_than_rtn(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    _write_checkpoint(src)
    report = convert_checkpoint(src, dst, method="mse", progress=False)
    out = _load_all(dst)
    for name in EXPERT_KEYS:
        w = _source_weight(src, name)
        packed, scale = int4_quantize_mse(w, 32, torch.bfloat16)
        assert_bitwise_equal(out[name + ".weight_packed"], packed, name)
        assert_bitwise_equal(out[name + ".weight_scale"], scale, name)
    for row in report.tensors:
        assert row["errors"]["mse"]["rel_err"] <= row["errors"]["rtn"]["rel_err"] + 1e-12, row["name"]
    assert sum(r["errors"]["mse"]["sqnr_db"] for r in report.tensors) > sum(
        r["errors"]["rtn"]["sqnr_db"] for r in report.tensors)  # the search pays off on outlier groups
    saved = json.loads((dst / "conversion_report.json").read_text())
    assert saved["method"] == "mse" and len(saved["tensors"]) == len(EXPERT_KEYS)
    assert "mse" in report.summary() and "rtn" in report.summary()


def test_mse_with_a_one_point_grid_is_round_to_nearest():
    w = torch.randn(20, 128) * torch.rand(20, 1)
    packed, scale = int4_quantize_mse(w, 32, torch.bfloat16, grid=(1.0,))
    ref_packed, ref_scale = I.int4_quantize_reference(w, 32, torch.bfloat16)
    assert torch.equal(packed, ref_packed) and torch.equal(scale, ref_scale)
    assert MSE_GRID[0] == 1.0


def test_config_and_plan_metadata_describe_the_output(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    _write_checkpoint(src)
    plan = parse_plan("experts")
    convert_checkpoint(src, dst, plan=plan, progress=False)
    assert QuantPlan.from_checkpoint(dst) == plan
    with safe_open(str(next(dst.glob("*.safetensors"))), "pt") as f:
        assert QuantPlan.from_metadata(f.metadata()) == plan
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    w = qc["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["group_size"], w["symmetric"], w["strategy"], w["type"]) == (4, 32, True, "group", "int")
    assert qc["config_groups"]["group_0"]["targets"] == ["Linear"] and qc["weight_block_size"] == [128, 128]
    from mla_quant.convert import _ct_match

    for name in EXPERT_KEYS:
        assert not _ct_match(name, qc["ignore"]), name
    for name in OTHER_LINEAR:
        assert _ct_match(name, qc["ignore"]), name


def test_ignore_list_falls_back_to_exact_names_when_a_regex_would_overreach():
    int4 = ["model.layers.1.mlp.experts.0.gate_proj"]
    assert ignore_list(int4, ["model.layers.0.mlp.experts.0.gate_proj"]) == ["model.layers.0.mlp.experts.0.gate_proj"]
    assert ignore_list(int4, ["model.layers.0.self_attn.q_proj", "model.layers.5.self_attn.q_proj"]) == [
        r"re:model\.layers\.\d+\.self_attn\.q_proj$"]


def test_a_plan_can_convert_other_formats(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    dense = _write_checkpoint(src, fp8=False)
    plan = QuantPlan({EXPERTS: Int4Group(64), "re:.*self_attn\\.q_proj": FP8Block(), "_default": None})
    convert_checkpoint(src, dst, plan=plan, progress=False)
    out = _load_all(dst)
    q, s = FP8Block().quantize(dense["model.layers.1.self_attn.q_proj"].to(torch.bfloat16).float()).values()
    assert_bitwise_equal(out["model.layers.1.self_attn.q_proj.weight"], q, "fp8 weight")
    assert_bitwise_equal(out["model.layers.1.self_attn.q_proj.weight_scale_inv"], s, "fp8 scale")
    assert out["model.layers.1.mlp.experts.0.down_proj.weight_scale"].shape == (H, F // 64)


def test_cli_runs_and_reports_both_methods(tmp_path, capsys):
    src, dst = tmp_path / "src", tmp_path / "dst"
    _write_checkpoint(src)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(QuantPlan({EXPERTS: Int4Group(32)}).to_json())
    assert main([str(src), str(dst), "--plan", str(plan_file), "--method", "mse", "--device", "cpu", "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "converted 12 weights with 'mse'" in text and "rtn" in text


def test_errors(tmp_path):
    src = tmp_path / "src"
    _write_checkpoint(src)
    with pytest.raises(ValueError, match="method"):
        convert_checkpoint(src, tmp_path / "d", method="awq", progress=False)
    with pytest.raises(ValueError, match="method 'gptq': pass hessians="):
        convert_checkpoint(src, tmp_path / "d", method="gptq", progress=False)
    with pytest.raises(ValueError, match="method 'gptq': needs the layer's hessian"):
        quantize_weight(torch.randn(4, 64), Int4Group(32), "gptq")
    with pytest.raises(FileNotFoundError, match="hessians: no file"):
        convert_checkpoint(src, tmp_path / "d", method="gptq", hessians=tmp_path / "none.safetensors", progress=False)
    with pytest.raises(ValueError, match="DST: must differ"):
        convert_checkpoint(src, src, progress=False)
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        convert_checkpoint(tmp_path / "nothing", tmp_path / "d2", progress=False)
    with pytest.raises(ValueError, match="not divisible by group_size"):
        quantize_weight(torch.randn(4, 48), Int4Group(32))


# --- GPTQ: per-layer Hessians of calibration inputs in a file (gptq.HessianCollector.save's layout) ---
def _write_hessians(path, names, seed=0, skip=()):
    """Correlated calibration rows per layer (gate and up of an expert share them), as X^T X / T."""
    g = torch.Generator().manual_seed(seed)
    tensors, inputs = {}, {}
    for name in names:
        if name in skip:
            continue
        k = _shape(name)[1]
        key = name.replace("up_proj", "gate_proj")
        if key not in inputs:
            x = torch.randn(512, 8, generator=g) @ torch.randn(8, k, generator=g) + 0.1 * torch.randn(512, k, generator=g)
            inputs[key] = x.T @ x / 512
        tensors[name + HESSIAN_SUFFIX] = inputs[key].clone()
        tensors[name + ".tokens"] = torch.tensor([512])
    save_file(tensors, str(path))
    return {n: t for n, t in tensors.items() if n.endswith(HESSIAN_SUFFIX)}


def test_gptq_method_is_bit_exact_with_gptq_quantize_and_lowers_the_output_error(tmp_path, capsys):
    src, dst, hfile = tmp_path / "src", tmp_path / "dst", tmp_path / "h.safetensors"
    _write_checkpoint(src)
    hs = _write_hessians(hfile, EXPERT_KEYS)
    assert main([str(src), str(dst), "--method", "gptq", "--hessians", str(hfile), "--device", "cpu", "--quiet"]) == 0
    assert "converted 12 weights with 'gptq'" in capsys.readouterr().out
    out = _load_all(dst)
    for name in EXPERT_KEYS:
        packed, scale = gptq_quantize(_source_weight(src, name), hs[name + HESSIAN_SUFFIX], 32)
        assert_bitwise_equal(out[name + ".weight_packed"], packed, name)
        assert_bitwise_equal(out[name + ".weight_scale"], scale, name)
    report = json.loads((dst / "conversion_report.json").read_text())
    for row in report["tensors"]:
        errors = row["errors"]
        assert set(errors) == {"rtn", "mse", "gptq"}
        assert errors["gptq"]["out_sqnr_db"] > max(errors["rtn"]["out_sqnr_db"], errors["mse"]["out_sqnr_db"]) + 3
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["weights"]["observer"] == "minmax"


def test_gptq_needs_every_int4_layer_s_hessian_and_mse_clip_is_recorded(tmp_path):
    src, hfile = tmp_path / "src", tmp_path / "h.safetensors"
    _write_checkpoint(src)
    _write_hessians(hfile, EXPERT_KEYS, skip=(EXPERT_KEYS[3],))
    with pytest.raises(KeyError, match=f"no Hessian for '{EXPERT_KEYS[3]}'"):
        convert_checkpoint(src, tmp_path / "d", method="gptq", hessians=hfile, progress=False)
    # rtn with a partial file: the output errors of the layers it covers, nothing else changes
    report = convert_checkpoint(src, tmp_path / "d2", method="rtn", hessians=hfile, progress=False)
    rows = {r["name"]: r["errors"] for r in report.tensors}
    assert "out_sqnr_db" not in rows[EXPERT_KEYS[3]]["rtn"] and "gptq" not in rows[EXPERT_KEYS[3]]
    assert "out_sqnr_db" in rows[EXPERT_KEYS[0]]["rtn"] and "gptq" in rows[EXPERT_KEYS[0]]
    assert "mean output SQNR dB" in report.summary()
    hs = _write_hessians(hfile, EXPERT_KEYS)
    convert_checkpoint(src, tmp_path / "d3", method="gptq", hessians=hfile, gptq_clip="mse", progress=False)
    qc = json.loads((tmp_path / "d3" / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["weights"]["observer"] == "mse"
    assert qc["config_groups"]["group_0"]["weights"]["actorder"] is None
    assert main([str(src), str(tmp_path / "d4"), "--method", "gptq", "--hessians", str(hfile), "--gptq-act-order",
                 "--device", "cpu", "--quiet", "--no-compare"]) == 0
    qc = json.loads((tmp_path / "d4" / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["weights"]["actorder"] == "weight"   # the stored layout is unchanged
    out = _load_all(tmp_path / "d4")
    name = EXPERT_KEYS[5]
    packed, scale = gptq_quantize(_source_weight(src, name), hs[name + HESSIAN_SUFFIX], 32, act_order=True)
    assert_bitwise_equal(out[name + ".weight_packed"], packed, name)
    assert_bitwise_equal(out[name + ".weight_scale"], scale, name)
