"""``load_sharded``: each rank reads from a checkpoint folder only the tensors, or the slices of tensors,
that it keeps after :func:`apply_ep` / :func:`apply_tp`.

Steps (gpt-fast's order, the models' key-mapping table):

1. read ``config.json`` and the safetensors index; decide each linear layer's format from the checkpoint
   (``models.layout.checkpoint_formats``) and build the model on ``meta``;
2. check the checkpoint's keys against the full model (missing / unexpected keys are errors naming them);
3. shard the meta model (``apply_ep`` then ``apply_tp``): every sliced tensor records its slice
   (``Shard``) in the full tensor's coordinates;
4. per safetensors file, read each kept key with ``safe_open(...).get_slice(key)[slice]`` (only those bytes
   are read), check shape and dtype, move to ``device``, ``load_state_dict(..., assign=True)``.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from ..models.config import config_from_hf
from ..models.layout import KeyMap, checkpoint_formats
from ..models.loading import (CheckpointError, check_and_convert, int4_scale_dtype, materialize_buffers,
                              model_class, read_weight_map)
from ..modules.experts import PROJECTIONS as EXPERT_PROJECTIONS
from ..modules.experts import StackedExperts
from ..modules.linear import QuantLinear
from .comm import ProcessGroup
from .ep import ExpertParallelExperts, apply_ep
from .shard import Shard, shards_of
from .tp import apply_tp


def _expert_ids(experts: StackedExperts) -> range:
    first = experts.first_expert if isinstance(experts, ExpertParallelExperts) else 0
    return range(first, first + experts.num_experts)


def _split_param(name: str) -> tuple[str, str]:
    """``gate_proj_weight_packed`` -> (``gate_proj``, ``weight_packed``)."""
    for proj in EXPERT_PROJECTIONS:
        if name.startswith(proj + "_"):
            return proj, name[len(proj) + 1:]
    raise KeyError(name)


def key_shards(model: nn.Module) -> dict[str, Shard]:
    """State-dict key -> the slice of the checkpoint tensor this rank keeps, for every sliced tensor (keys not
    listed are read whole). Per-expert checkpoint tensors drop the stack's leading expert dimension."""
    out: dict[str, Shard] = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        for tensor_name, shard in shards_of(module).items():
            if not isinstance(module, StackedExperts):
                out[prefix + tensor_name] = shard
            elif shard.dim > 0:  # dim 0 (experts) is expressed by which expert keys exist
                proj, suffix = _split_param(tensor_name)
                per_expert = Shard(shard.dim - 1, shard.start, shard.stop, shard.full)
                for e in _expert_ids(module):
                    out[f"{prefix}{e}.{proj}.{suffix}"] = per_expert
    return out


def _int4_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Model key prefix of every INT4 weight -> its [N, K] (the value its ``weight_shape`` holds)."""
    shapes: dict[str, tuple[int, int]] = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            shapes[name] = (module.out_features, module.in_features)
        elif isinstance(module, StackedExperts):
            for e in _expert_ids(module):
                for proj in EXPERT_PROJECTIONS:
                    shapes[f"{name}.{e}.{proj}"] = module.proj_shape(proj)
    return shapes


def _read(f, ckey: str, shard: Shard | None) -> torch.Tensor:
    if shard is None:
        return f.get_tensor(ckey)
    sl = f.get_slice(ckey)
    index = [slice(None)] * len(sl.get_shape())
    index[shard.dim] = slice(shard.start, shard.stop)
    return sl[tuple(index)].contiguous()


def load_sharded(path: str | os.PathLike, *, tp: bool = True, ep: bool = False,
                 tp_group: ProcessGroup | None = None, ep_group: ProcessGroup | None = None,
                 ep_tokens: str = "replicated", dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str | None = None, plan=None, stats: dict | None = None) -> nn.Module:
    """Load a Kimi K2.6 / GLM 5.2 checkpoint folder (the real layout) straight into this rank's shard.

    ``tp`` / ``ep``: apply :func:`~mla_quant.parallel.apply_tp` over ``tp_group`` and / or
    :func:`~mla_quant.parallel.apply_ep` over ``ep_group`` (None = the default group; ``ep_tokens`` as
    ``apply_ep``'s ``tokens``). ``dtype`` / ``plan`` as ``models.from_pretrained``; ``device``: this rank's
    device (e.g. ``f"cuda:{local_rank}"``). ``stats``: a dict that receives ``bytes_read`` and
    ``tensors_read`` (the bytes this rank read from the files). The result equals
    ``from_pretrained(path)`` followed by the same transforms.
    """
    folder = Path(path)
    device = torch.device(device or "cpu")
    config = config_from_hf(folder)
    weight_map = read_weight_map(folder)
    keymap = KeyMap(config)
    fmt_for = checkpoint_formats(config, weight_map.keys(), int4_scale_dtype(folder, weight_map))
    with torch.device("meta"):
        model = model_class(config)(config, dtype=dtype, formats=fmt_for)

    full_keys = set(model.state_dict())
    mapped = {}
    for ckey in weight_map:
        mkey, rule = keymap.to_model(ckey)
        if rule is None or (mkey is not None and mkey not in full_keys):
            raise CheckpointError(f"unexpected key {ckey!r} in the checkpoint; the model has no such tensor")
        if mkey is not None:
            mapped[mkey] = ckey
    missing = sorted(full_keys - set(mapped))
    if missing:
        raise CheckpointError(f"missing key {keymap.to_checkpoint(missing[0])!r} in the checkpoint"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    full_int4 = _int4_shapes(model)

    if ep:
        apply_ep(model, ep_group, tokens=ep_tokens)
    if tp:
        apply_tp(model, tp_group)
    expected = model.state_dict()
    shards = key_shards(model)
    local_int4 = _int4_shapes(model)

    by_file: dict[str, list[str]] = {}
    for mkey in expected:
        by_file.setdefault(weight_map[mapped[mkey]], []).append(mkey)
    bytes_read = tensors_read = 0
    for file in sorted(by_file):
        part: dict[str, torch.Tensor] = {}
        with safe_open(str(folder / file), "pt", device="cpu") as f:
            for mkey in by_file[file]:
                ckey = mapped[mkey]
                t = _read(f, ckey, shards.get(mkey))
                bytes_read += t.numel() * t.element_size()
                tensors_read += 1
                if mkey.endswith(".weight_shape"):
                    owner = mkey[: -len(".weight_shape")]
                    if t.tolist() != list(full_int4[owner]):
                        raise CheckpointError(f"{ckey!r}: weight_shape {t.tolist()} does not match the layer's "
                                              f"{list(full_int4[owner])}")
                    t = torch.tensor(local_int4[owner], dtype=torch.int64)
                part[mkey] = check_and_convert(ckey, t, expected[mkey]).to(device)
        model.load_state_dict(part, strict=False, assign=True)
        del part
    materialize_buffers(model, device)
    leftover = [n for n, t in model.state_dict().items() if t.device.type == "meta"]
    if leftover:
        raise CheckpointError(f"missing key {keymap.to_checkpoint(leftover[0])!r}: not found in its shard")
    if stats is not None:
        stats.update(bytes_read=bytes_read, tensors_read=tensors_read)
    model.eval()
    if plan is not None:
        from ..formats.plan import quantize_

        quantize_(model, plan)
    return model


__all__ = ["load_sharded", "key_shards"]
