"""Save any model of this library in the REAL on-disk layout, so tests and examples build checkpoints
themselves (no download) and ``from_pretrained`` reads them like the published ones:

* ``config.json`` with the real nesting (``kimi_k25`` + ``text_config`` for Kimi K2.6) and a
  ``quantization_config`` that describes the model's formats (compressed-tensors ``pack-quantized`` for
  INT4 layers, ``fp8`` blocks for FP8 layers, none when everything is unquantized);
* ``model.safetensors.index.json`` + ``model-0000i-of-0000n.safetensors`` shards;
* keys through the inverse of the key-mapping table (``language_model.`` prefix for Kimi K2.6), per-expert
  INT4 tensors ``weight_packed`` / ``weight_scale`` / ``weight_shape``, FP8 ``weight`` + ``weight_scale_inv``;
* tensors in the model's dtype, except fp32 ones by spec (``e_score_correction_bias``, ``weight_scale_inv``)
  and fp32 compute copies (router, indexer ``weights_proj``) whose values the model dtype cannot hold.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from .layout import KeyMap, quantization_config_for

INDEX_FILE = "model.safetensors.index.json"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


FP32_BY_SPEC = ("e_score_correction_bias", "weight_scale_inv")  # stored fp32 in the releases


def _as_stored(key: str, t: torch.Tensor, compute_dtype: torch.dtype) -> torch.Tensor:
    """fp32 tensors the model keeps in fp32 for compute (router ``gate.weight``, indexer ``weights_proj``)
    are stored in the checkpoint dtype when that is lossless — as the releases store them; the loader casts
    them back up exactly."""
    if t.dtype != torch.float32 or compute_dtype not in (torch.bfloat16, torch.float16) or key.endswith(FP32_BY_SPEC):
        return t
    low = t.to(compute_dtype)
    return low if torch.equal(low.float(), t) else t


def save_pretrained(model: torch.nn.Module, path: str | os.PathLike, max_shard_bytes: int = 4 * 2**30,
                    extra_tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """Write ``model`` (a ``KimiK26ForCausalLM`` / ``Glm52ForCausalLM``) to folder ``path``.

    ``max_shard_bytes``: shards are filled in key order up to this size (a tensor larger than it gets
    a shard of its own). ``extra_tensors``: more checkpoint keys written verbatim (tests use it to add a
    vision tower or an MTP layer that the loader must skip). Returns the folder.
    """
    config = model.config
    keymap = KeyMap(config)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)

    formats = model.linear_formats()
    compute_dtype = getattr(model, "dtype", torch.bfloat16)
    hf_config = config.replace(quantization_config=quantization_config_for(config, formats),
                               torch_dtype=_dtype_name(compute_dtype)).to_hf()
    if hf_config.get("text_config", hf_config).get("quantization_config") is None:
        hf_config.get("text_config", hf_config).pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")

    tensors: dict[str, torch.Tensor] = {}
    for key, t in model.state_dict().items():
        if t.device.type == "meta":
            raise ValueError(f"save_pretrained: {key!r} is still on the meta device (not loaded)")
        tensors[keymap.to_checkpoint(key)] = _as_stored(key, t, compute_dtype)
    for key, t in (extra_tensors or {}).items():
        if key in tensors:
            raise ValueError(f"save_pretrained: extra tensor {key!r} collides with a model key")
        tensors[key] = t

    shards: list[list[str]] = [[]]
    size = 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes

    weight_map, total = {}, 0
    for i, keys in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        shard = {k: tensors[k].detach().to("cpu").contiguous() for k in keys}
        save_file(shard, str(out / name), metadata={"format": "pt"})
        for k, t in shard.items():
            weight_map[k] = name
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return out
