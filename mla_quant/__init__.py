"""mla_quant: composable PyTorch modules backed by Triton kernels for quantized MLA models.

Subpackages load on first use (``mq.models``, ``mq.cache`` …) so that ``import mla_quant`` stays cheap.
"""
from __future__ import annotations

import importlib

from . import formats, kernels

__version__ = "0.1.0"

_SUBPACKAGES = ("cache", "modules", "models", "parallel", "engine", "eval", "testing")
# Top-level names that live in a subpackage: name -> module path.
_EXPORTS = {
    "QuantPlan": "mla_quant.formats.plan",
    "quantize_": "mla_quant.formats.plan",
    "PhaseRecipe": "mla_quant.formats.plan",
    "Phase": "mla_quant.formats.plan",
}


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        return importlib.import_module(f"mla_quant.{name}")
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'mla_quant' has no attribute {name!r}")


__all__ = ["formats", "kernels", *_SUBPACKAGES, *_EXPORTS]
