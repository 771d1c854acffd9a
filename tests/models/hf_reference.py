"""The Hugging Face transformers reference for a checkpoint folder in the real layout (tests only).

Independent of this library's loading: it reads the safetensors files itself, strips Kimi K2.6's
``language_model.`` prefix, drops the vision tower / projector / MTP layer, dequantizes INT4
(compressed-tensors pack-quantized) and FP8 blocks with its own few lines of torch, fuses the per-expert
weights the way transformers v5 stores them (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) and loads
them into ``DeepseekV3ForCausalLM`` (Kimi K2.6's text model; the ``kimi_k25`` wrapper maps to it) or
``GlmMoeDsaForCausalLM``, eager attention, in fp32.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open


def _unpack_int4(packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor) -> torch.Tensor:
    n, k = (int(v) for v in shape)
    words = packed.to(torch.int64) & 0xFFFFFFFF                      # [N, K/8] as unsigned
    shifts = torch.arange(8, dtype=torch.int64) * 4
    nibbles = (words[..., None] >> shifts) & 0xF                      # element j at bits 4·(j % 8)
    q = (nibbles - 8).reshape(n, -1)[:, :k].float()
    group = k // scale.shape[1]
    return q * scale.float().repeat_interleave(group, dim=1)


def _dequant_fp8(w: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    n, k = w.shape
    s = scale_inv.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return w.float() * s


def read_text_checkpoint(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(text config dict, fp32 dense state dict with HF per-expert keys) of a checkpoint folder."""
    cfg = json.loads((folder / "config.json").read_text())
    prefix = ""
    if cfg["model_type"] == "kimi_k25":
        cfg, prefix = dict(cfg["text_config"]), "language_model."
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    raw: dict[str, torch.Tensor] = {}
    for file in sorted(set(index.values())):
        with safe_open(str(folder / file), "pt") as f:
            for key in f.keys():
                raw[key] = f.get_tensor(key)
    mtp = re.compile(rf"^model\.layers\.({cfg['num_hidden_layers']}|{cfg['num_hidden_layers'] + 1})\.")
    block = tuple((cfg.get("quantization_config") or {}).get("weight_block_size") or (128, 128))
    out: dict[str, torch.Tensor] = {}
    for key, t in raw.items():
        if not key.startswith(prefix):
            continue  # vision_tower.*, mm_projector.*
        name = key[len(prefix):]
        if mtp.match(name):
            continue
        if name.endswith(".weight_packed"):
            base = key[: -len("_packed")]
            out[name[: -len("_packed")]] = _unpack_int4(t, raw[base + "_scale"], raw[base + "_shape"])
        elif name.endswith((".weight_scale", ".weight_shape", ".weight_scale_inv")):
            continue
        elif t.dtype == torch.float8_e4m3fn:
            out[name] = _dequant_fp8(t, raw[key + "_scale_inv"], block)
        else:
            out[name] = t.float()
    return cfg, out


def fuse_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert keys -> transformers v5's fused ``mlp.experts.gate_up_proj`` / ``down_proj``."""
    rx = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
    groups: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    out = {}
    for key, t in state.items():
        m = rx.match(key)
        if m:
            groups.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
        else:
            out[key] = t
    for base, parts in groups.items():
        n = 1 + max(e for e, _ in parts)
        out[base + ".gate_up_proj"] = torch.stack([torch.cat([parts[e, "gate"], parts[e, "up"]]) for e in range(n)])
        out[base + ".down_proj"] = torch.stack([parts[e, "down"] for e in range(n)])
    return out


def hf_reference_model(folder: str | Path) -> torch.nn.Module:
    """The transformers model for ``folder``, weights loaded (fp32, eager attention, eval mode)."""
    import transformers

    folder = Path(folder)
    cfg, state = read_text_checkpoint(folder)
    cfg = {k: v for k, v in cfg.items() if k not in ("quantization_config", "torch_dtype", "architectures")}
    if cfg["model_type"] == "glm_moe_dsa":
        config = transformers.GlmMoeDsaConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
        cls = transformers.GlmMoeDsaForCausalLM
    else:
        cfg["model_type"] = "deepseek_v3"  # kimi_k2 -> deepseek_v3, as transformers' kimi_k25 config does
        config = transformers.DeepseekV3Config(**{k: v for k, v in cfg.items() if k != "model_type"})
        cls = transformers.DeepseekV3ForCausalLM
    config._attn_implementation = "eager"
    model = cls(config).float().eval()
    result = model.load_state_dict(fuse_experts(state), strict=False)
    if result.unexpected_keys or result.missing_keys:
        raise AssertionError(f"HF reference: missing {result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]}")
    return model
