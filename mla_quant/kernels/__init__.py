"""Kernels: one folder per op with a Triton kernel (``kernel.py``), a pure-torch reference of the same
signature (``reference.py``) and a public launcher (``__init__.py``) that checks inputs and dispatches
(see ``_backend.py``). No nn.Module lives here; only torch and triton are imported.

Ops (import them by module path, e.g. ``from mla_quant.kernels.mla_decode import mla_decode``):

- quantization: ``fp8_quant`` (activations 1×128, 128×128 weight blocks, KV rows), ``int4_quant``
  (compressed-tensors pack-quantized), ``kv_layout`` (byte layout of a KV row, reference only)
- KV cache: ``kv_append``, ``page_tag_verify``, ``page_table`` (table checks and CSR helpers)
- attention: ``mla_decode``, ``mla_prefill``, ``sparse_mla_decode``, ``indexer_k_append``, ``indexer_scores``,
  ``topk``, ``hadamard``
- GEMMs: ``fp8_gemm`` (W8A8 block-scaled), ``w4a16_gemm``, ``moe_align``, ``fused_moe``
"""
from . import fp8_quant, int4_quant
from ._backend import forced_backend, use_triton

__all__ = ["fp8_quant", "int4_quant", "use_triton", "forced_backend"]
