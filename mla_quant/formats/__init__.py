"""Weight and KV formats as frozen, serialisable dataclasses (see docs/formats.md)."""
from __future__ import annotations

from .kv import KV_KINDS, KVFormat
from .weight import BF16, WEIGHT_FORMATS, FP8Block, Int4Group, WeightFormat


def format_from_dict(d: dict) -> WeightFormat | KVFormat:
    """Inverse of ``fmt.to_dict()`` (formats are stored this way in checkpoint metadata)."""
    d = dict(d)
    name = d.pop("format")
    if name == "KVFormat":
        return KVFormat(**d)
    if name not in WEIGHT_FORMATS:
        raise ValueError(f"unknown format {name!r}; expected one of {sorted(WEIGHT_FORMATS)} or 'KVFormat'")
    return WEIGHT_FORMATS[name](**d)


__all__ = ["BF16", "FP8Block", "Int4Group", "KVFormat", "KV_KINDS", "WeightFormat", "WEIGHT_FORMATS",
           "format_from_dict"]
