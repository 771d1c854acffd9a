"""Kernels: one folder per op with a Triton kernel (``kernel.py``), a pure-torch reference of the same
signature (``reference.py``) and a public launcher (``__init__.py``) that checks inputs and dispatches
(see ``_backend.py``). No nn.Module lives here."""
from . import fp8_quant, int4_quant
from ._backend import forced_backend, use_triton

__all__ = ["fp8_quant", "int4_quant", "use_triton", "forced_backend"]
