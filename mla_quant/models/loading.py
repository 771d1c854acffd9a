"""``from_pretrained``: a Hugging Face folder in the real checkpoint layout -> a model of this library.

Steps (gpt-fast's ``_load_model``, DeepSeek's ``convert.py`` table):

1. read ``config.json`` (:func:`config_from_hf`) and the safetensors index (or a single
   ``model.safetensors``);
2. map every checkpoint key through the ONE key-mapping table (``layout.key_rules``): renamed, skipped
   with a note (vision tower, projector, MTP layer), or unexpected -> error naming the key;
3. decide each linear layer's format from the checkpoint (``layout.checkpoint_formats``) and build the
   model on ``meta`` in those formats;
4. check the key sets (missing / unexpected -> an error naming the keys) before reading any tensor;
5. read ONE shard at a time, check each tensor's shape and dtype against the model (error naming the
   key), move it to ``device`` and ``load_state_dict(..., assign=True)``; one progress line per shard on
   stderr for large checkpoints;
6. with a ``plan``, convert on load through ``mla_quant.quantize_``.
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from safetensors import safe_open

from .config import KimiK26Config, ModelConfig, config_from_hf
from .layout import KeyMap, checkpoint_formats
from .saving import INDEX_FILE

_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
              "F8_E4M3": torch.float8_e4m3fn, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
              "I64": torch.int64, "U8": torch.uint8, "BOOL": torch.bool}
_COMPUTE_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
PROGRESS_BYTES = 2**30  # show per-shard progress for checkpoints larger than this


class CheckpointError(ValueError):
    """A checkpoint does not fit the model: missing, unexpected or mis-shaped keys (named)."""


def model_class(config: ModelConfig):
    from .glm import Glm52ForCausalLM
    from .kimi import KimiK26ForCausalLM

    return KimiK26ForCausalLM if isinstance(config, KimiK26Config) else Glm52ForCausalLM


def read_weight_map(path: str | os.PathLike) -> dict[str, str]:
    """checkpoint key -> shard file name, from the index or a single ``model.safetensors``."""
    folder = Path(path)
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no 'weight_map' in the safetensors index")
        return dict(weight_map)
    single = folder / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), "pt") as f:
            return {k: single.name for k in f.keys()}
    raise FileNotFoundError(f"from_pretrained: neither {INDEX_FILE} nor model.safetensors in {str(folder)!r}")


def stored_dtype(folder: Path, file: str, key: str) -> torch.dtype:
    with safe_open(str(folder / file), "pt") as f:
        name = f.get_slice(key).get_dtype()
    if name not in _ST_DTYPES:
        raise CheckpointError(f"{key!r}: unsupported stored dtype {name}")
    return _ST_DTYPES[name]


def int4_scale_dtype(folder: Path, weight_map: dict[str, str]) -> torch.dtype | None:
    """The dtype the checkpoint stores INT4 group scales in (bf16 for Kimi K2.6), read from a header."""
    for key, file in weight_map.items():
        if key.endswith(".weight_scale") and key[: -len("scale")] + "packed" in weight_map:
            return stored_dtype(folder, file, key)
    return None


def check_and_convert(key: str, t: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """A stored tensor made to fit the model's (meta) tensor ``want``, or an error naming ``key``."""
    if tuple(t.shape) != tuple(want.shape):
        raise CheckpointError(f"{key!r}: checkpoint shape {tuple(t.shape)} does not match the model's "
                              f"{tuple(want.shape)}")
    if t.dtype != want.dtype:
        if t.dtype in _COMPUTE_FLOATS and want.dtype in _COMPUTE_FLOATS:
            t = t.to(want.dtype)
        else:
            raise CheckpointError(f"{key!r}: checkpoint dtype {t.dtype} does not match the model's {want.dtype} "
                                  "(quantized tensors are never converted implicitly)")
    return t


def check_weight_shape(key: str, t: torch.Tensor, packed: torch.Tensor | None) -> None:
    """``weight_shape`` [N, K] must agree with ``weight_packed`` [N, K/8] (compressed-tensors)."""
    if packed is None:
        return
    n, k = (int(v) for v in t.tolist())
    if (n, k // 8) != tuple(packed.shape) or k % 8:
        raise CheckpointError(f"{key!r}: weight_shape {[n, k]} does not match weight_packed {tuple(packed.shape)}")


def materialize_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Non-persistent buffers (RoPE tables) were built on meta: rebuild them on ``device``."""
    from ..modules.rope import RotaryEmbedding, rope_inv_freq

    for name, module in model.named_modules():
        for bname, buf in list(module.named_buffers(recurse=False)):
            if buf is None or buf.device.type != "meta":
                continue
            if isinstance(module, RotaryEmbedding) and bname == "inv_freq":
                module.inv_freq = rope_inv_freq(module.dim, module.base, module.scaling).to(device)
            elif hasattr(module, "materialize_buffers_"):
                module.materialize_buffers_(device)
            else:
                raise RuntimeError(f"from_pretrained: buffer {name}.{bname} is still on meta after loading "
                                   "(its module has no materialize_buffers_)")


def from_pretrained(path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16,
                    device: torch.device | str | None = None, plan=None, progress: bool | None = None):
    """Load a Kimi K2.6 / GLM 5.2 checkpoint folder (the real layout) into ``KimiK26ForCausalLM`` /
    ``Glm52ForCausalLM``.

    ``dtype``: the compute dtype (unquantized weights, norms, activations); quantized tensors keep their
    stored dtypes. ``plan=None`` keeps the checkpoint's formats exactly (weight-only INT4 / FP8, no
    activation or KV quantization): with ``dtype=torch.float32`` this is the exact reference mode.
    ``plan``: a ``QuantPlan`` applied on load. ``progress``: one stderr line per shard (default: for
    checkpoints over 1 GiB).
    """
    folder = Path(path)
    device = torch.device(device or "cpu")
    config = config_from_hf(folder)
    weight_map = read_weight_map(folder)
    keymap = KeyMap(config)

    to_model: dict[str, str] = {}
    skipped: Counter[str] = Counter()
    unmatched: list[str] = []
    for ckey in weight_map:
        mkey, rule = keymap.to_model(ckey)
        if rule is None:
            unmatched.append(ckey)
        elif mkey is None:
            skipped[rule.note] += 1
        else:
            to_model[ckey] = mkey

    fmt_for = checkpoint_formats(config, weight_map.keys(), int4_scale_dtype(folder, weight_map))
    with torch.device("meta"):
        model = model_class(config)(config, dtype=dtype, formats=fmt_for)
    expected = model.state_dict()

    unexpected = unmatched + sorted(k for k, m in to_model.items() if m not in expected)
    if unexpected:
        raise CheckpointError(f"unexpected key {unexpected[0]!r} in the checkpoint"
                              + (f" (and {len(unexpected) - 1} more: {unexpected[1:4]})" if len(unexpected) > 1
                                 else "") + "; the model has no such tensor")
    missing = sorted(set(expected) - set(to_model.values()))
    if missing:
        names = [keymap.to_checkpoint(m) for m in missing]
        raise CheckpointError(f"missing key {names[0]!r} in the checkpoint"
                              + (f" (and {len(names) - 1} more: {names[1:4]})" if len(names) > 1 else ""))

    files = sorted({weight_map[k] for k in to_model})
    total_bytes = sum((folder / f).stat().st_size for f in files)
    show = progress if progress is not None else total_bytes > PROGRESS_BYTES
    if show and skipped:
        for note, n in skipped.items():
            print(f"[from_pretrained] skipping {n} tensors: {note}", file=sys.stderr)
    start = time.perf_counter()
    for i, file in enumerate(files):
        t0 = time.perf_counter()
        part: dict[str, torch.Tensor] = {}
        with safe_open(str(folder / file), "pt", device="cpu") as f:
            for ckey in f.keys():
                mkey = to_model.get(ckey)
                if mkey is None:
                    continue
                part[mkey] = check_and_convert(ckey, f.get_tensor(ckey), expected[mkey]).to(device)
        for mkey, t in part.items():
            if mkey.endswith(".weight_shape"):
                check_weight_shape(keymap.to_checkpoint(mkey), t, part.get(mkey[: -len("shape")] + "packed"))
        model.load_state_dict(part, strict=False, assign=True)
        if show:
            gb = (folder / file).stat().st_size / 1e9
            print(f"[from_pretrained] shard {i + 1}/{len(files)} {file}: {len(part)} tensors, {gb:.2f} GB, "
                  f"{time.perf_counter() - t0:.1f} s (total {time.perf_counter() - start:.1f} s)", file=sys.stderr)
        del part
    materialize_buffers(model, device)
    leftover = [n for n, t in model.state_dict().items() if t.device.type == "meta"]
    if leftover:  # cannot happen after the key checks; a guard against shards that lie about their keys
        raise CheckpointError(f"missing key {keymap.to_checkpoint(leftover[0])!r}: not found in its shard")
    model.eval()
    if plan is not None:
        from ..formats.plan import quantize_

        quantize_(model, plan)
    return model



__all__ = ["from_pretrained", "read_weight_map", "CheckpointError", "model_class", "check_and_convert",
           "check_weight_shape", "int4_scale_dtype", "materialize_buffers", "stored_dtype"]
