"""Backend dispatch: which implementation a public op runs.

Rule (DESIGN.md): Triton on CUDA tensors, the pure-torch reference on CPU tensors.
``MLA_QUANT_BACKEND=torch`` forces the reference everywhere; ``MLA_QUANT_BACKEND=triton`` forces the
Triton kernel (on CPU tensors this only works under ``TRITON_INTERPRET=1``); ``TRITON_INTERPRET=1`` alone
also selects Triton for CPU tensors, so the kernels' code can be checked without a GPU.
"""
from __future__ import annotations

import functools
import importlib.util
import os

import torch

BACKENDS = ("torch", "triton")


def forced_backend() -> str | None:
    """The backend named by ``MLA_QUANT_BACKEND`` (read on every call, so tests may set it), or None."""
    value = os.environ.get("MLA_QUANT_BACKEND", "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in BACKENDS:
        raise ValueError(f"MLA_QUANT_BACKEND={value!r}: expected one of {BACKENDS} or 'auto'")
    return value


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when the op should launch its Triton kernel for these tensors."""
    forced = forced_backend()
    if forced is not None:
        if forced == "triton" and not triton_interpreted() and not all(t.is_cuda for t in tensors):
            raise RuntimeError("MLA_QUANT_BACKEND=triton needs CUDA tensors or TRITON_INTERPRET=1")
        return forced == "triton"
    if triton_interpreted():
        return True
    return all(t.is_cuda for t in tensors)


def is_hopper(device: torch.device) -> bool:
    """Whether ``device`` is a CUDA GPU of compute capability 9.x (the Gluon kernels' and TMA paths' target)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


@functools.lru_cache(maxsize=None)
def gluon_available() -> bool:
    """Triton's Gluon front end for Hopper ships with Triton 3.5 and later."""
    try:
        return importlib.util.find_spec("triton.experimental.gluon.nvidia.hopper") is not None
    except ImportError:
        return False
