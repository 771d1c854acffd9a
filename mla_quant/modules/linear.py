"""``QuantLinear`` and the one chokepoint every projection goes through: :func:`quant_linear`.

The module holds its weight as the checkpoint tensors of its format (``weight`` /
``weight`` + ``weight_scale_inv`` / ``weight_packed`` + ``weight_scale`` + ``weight_shape``), so its
state_dict keys are the checkpoint's. :func:`quant_linear` picks the compute path from the format:

=====================================  ===========================================================================
format                                 compute path (each op runs its Triton kernel on CUDA, its reference on CPU)
=====================================  ===========================================================================
``BF16``                               ``F.linear`` (cuBLAS)
``FP8Block(act_quant=True)``  (W8A8)   ``act_quant_fp8`` (1×128 per token) then the block-scaled ``fp8_gemm``
``FP8Block(act_quant=False)``          weight-only: ``block_dequant_fp8`` to the activation dtype, then cuBLAS;
                                       the reference (CPU, fp32 activations) multiplies in fp32
``Int4Group``                          ``w4a16_gemm``: nibbles unpacked and scaled in registers; from
                                       ``DEQUANT_GEMM_MIN_M`` tokens (prefill) ``int4_dequantize``, then cuBLAS
=====================================  ===========================================================================

A format's ``kernel`` field set to ``"torch"`` forces the reference math on any device.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..formats import BF16, FP8Block, Int4Group, WeightFormat
from ..kernels import fp8_quant
from ..kernels._backend import use_triton
from ..kernels.fp8_gemm import fp8_gemm, fp8_gemm_reference
from ..kernels.w4a16_gemm import FRAG_AUTO_MAX_M, w4a16_gemm, w4a16_gemm_reference, w4a16_gemv_pairs


def _fp8_w8a8(x2: torch.Tensor, fmt: FP8Block, tensors: dict[str, torch.Tensor], reference: bool) -> torch.Tensor:
    """x2: [M, K] -> [M, N]: activations rounded to e4m3 per 1×act_group, products accumulated in fp32."""
    quant = fp8_quant.act_quant_fp8_reference if reference else fp8_quant.act_quant_fp8
    q, s = quant(x2.contiguous(), fmt.act_group, fmt.ue8m0)
    if fmt.act_group != fmt.block[1]:  # the block-scaled GEMM needs one K block per activation group
        xs = (q.float().unflatten(-1, (-1, fmt.act_group)) * s[..., None]).flatten(-2)
        return (xs @ fmt.dequantize(tensors, torch.float32).T).to(x2.dtype)
    gemm = fp8_gemm_reference if reference else fp8_gemm
    return gemm(q, s, tensors["weight"], tensors["weight_scale_inv"], fmt.block, out_dtype=x2.dtype)


def _fp8_weight_only(x2: torch.Tensor, fmt: FP8Block, tensors: dict[str, torch.Tensor], reference: bool) -> torch.Tensor:
    if reference or x2.dtype == torch.float32 or not use_triton(x2, tensors["weight"]):
        return (x2.float() @ fmt.dequantize(tensors, torch.float32).T).to(x2.dtype)
    return F.linear(x2, fmt.dequantize(tensors, x2.dtype))  # dequantize on the GPU, then cuBLAS


# Up to this many tokens the layer passes its N split-K counters: every w4a16_gemm path needs at most one per output
# column tile there (the fragment kernel that "auto" takes up to FRAG_AUTO_MAX_M tokens: one per 64 rows)
COUNTERS_MAX_TOKENS = FRAG_AUTO_MAX_M


def _int4(x2: torch.Tensor, fmt: Int4Group, tensors: dict[str, torch.Tensor], reference: bool,
          counters: torch.Tensor | None = None, prefetch_weights: bool = False) -> torch.Tensor:
    if reference:
        return w4a16_gemm_reference(x2, tensors["weight_packed"], tensors["weight_scale"], fmt.group_size)
    kept = counters if counters is not None and x2.shape[0] <= COUNTERS_MAX_TOKENS else None
    return w4a16_gemm(x2, tensors["weight_packed"], tensors["weight_scale"], fmt.group_size, counters=kept,
                      prefetch_weights=prefetch_weights)


def _compute(x: torch.Tensor, fmt: WeightFormat, tensors: dict[str, torch.Tensor],
             bias: torch.Tensor | None, reference: bool, counters: torch.Tensor | None = None,
             prefetch_weights: bool = False) -> torch.Tensor:
    if isinstance(fmt, BF16):
        return F.linear(x, tensors["weight"].to(x.dtype), bias)
    reference = reference or getattr(fmt, "kernel", "auto") == "torch"
    x2 = x.reshape(-1, x.shape[-1])
    if isinstance(fmt, FP8Block):
        y = (_fp8_w8a8 if fmt.act_quant else _fp8_weight_only)(x2, fmt, tensors, reference)
    elif isinstance(fmt, Int4Group):
        y = _int4(x2, fmt, tensors, reference, counters, prefetch_weights)
    else:
        raise TypeError(f"quant_linear: no compute path for format {fmt!r}")
    y = y.reshape(*x.shape[:-1], y.shape[-1])
    return y if bias is None else y + bias


def quant_linear(x: torch.Tensor, fmt: WeightFormat, tensors: dict[str, torch.Tensor],
                 bias: torch.Tensor | None = None, counters: torch.Tensor | None = None,
                 prefetch_weights: bool = False) -> torch.Tensor:
    """y = x @ W.T (+ bias) for a weight held in ``fmt``. x: [..., K] -> [..., N] in x.dtype.

    ``counters`` (``Int4Group`` only, optional): int32 zeros [N] kept by the caller, the W4A16 GEMM's split-K
    arrival counters for calls of up to ``COUNTERS_MAX_TOKENS`` tokens (each launch leaves them zero; it saves the
    ``torch.zeros`` launch of each call). Calls that may run at the same time (several streams) need their own.
    ``prefetch_weights`` (``Int4Group``, one token): ``w4a16_gemm``'s promise that the kernel launched just before
    did not write ``tensors`` (the one-token GEMV then loads them before waiting for that kernel)."""
    return _compute(x, fmt, tensors, bias, reference=False, counters=counters, prefetch_weights=prefetch_weights)


def quant_linear_reference(x: torch.Tensor, fmt: WeightFormat, tensors: dict[str, torch.Tensor],
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference math of :func:`quant_linear` (pure torch, whatever the device): what the kernels are
    checked against."""
    return _compute(x, fmt, tensors, bias, reference=True)


def _same_storage(a: WeightFormat, b: WeightFormat, n: int, k: int) -> bool:
    """The two formats hold identical tensors (they differ only in how they compute, e.g. ``act_quant``)."""
    return type(a) is type(b) and a.tensor_specs(n, k) == b.tensor_specs(n, k) and (
        not isinstance(a, FP8Block) or a.block == b.block)


class PairedActivations(NamedTuple):
    """One activation row already in the half2 GEMV's *pair order* (``w4a16_gemm.swiglu_pair_order``): ``pairs``
    int32 [1, plane_width(K) / 2], ``scales`` fp32 [1, plane_width(K) / 32]. An ``Int4Group`` :class:`QuantLinear`
    called on it runs ``w4a16_gemv_pairs`` and returns [1, out]; the call goes through ``__call__``, so forward
    hooks (tensor parallelism's all-reduce) see its output."""
    pairs: torch.Tensor
    scales: torch.Tensor


class QuantLinear(nn.Module):
    """A linear layer whose weight lives in any :class:`WeightFormat`. ``x: [..., in] -> [..., out]``.

    An ``Int4Group`` layer keeps its W4A16 split-K counters (:meth:`split_k_counters`), so a call of up to
    ``COUNTERS_MAX_TOKENS`` (32) tokens is one kernel launch; one layer must not run on two streams at the same time.
    From its second call on the same weight tensors (same objects, storage and version counter:
    :meth:`weights_settled`) a one-token call lets the GEMV load the weights before it waits for the kernel before it
    (``w4a16_gemm(prefetch_weights=True)``); the first call after the weights were set, loaded or written in place
    launches plainly."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 fmt: WeightFormat | None = None, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.dtype = dtype
        self.fmt = fmt or BF16()
        self.fmt.check_shape(out_features, in_features)
        self._make_tensors(device)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: WeightFormat | None = None,
                    dtype: torch.dtype | None = None) -> "QuantLinear":
        """A QuantLinear holding ``linear``'s weight (and bias) in ``fmt`` (BF16 keeps the values exactly)."""
        w = linear.weight
        out = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, fmt=fmt,
                  dtype=dtype or w.dtype, device=w.device)
        out.set_weight(w.detach())
        if linear.bias is not None:
            with torch.no_grad():
                out.bias.copy_(linear.bias.detach())
        return out

    def _make_tensors(self, device) -> None:
        for name, (shape, dt) in self.fmt.tensor_specs(self.out_features, self.in_features, self.dtype).items():
            t = torch.zeros(shape, dtype=dt, device=device)
            if name == "weight_shape":
                self.register_buffer(name, torch.tensor([self.out_features, self.in_features], device=device)
                                     if t.device.type != "meta" else t)
            elif dt.is_floating_point and dt.itemsize > 1:
                self.register_parameter(name, nn.Parameter(t, requires_grad=dt == self.dtype and name == "weight"))
            else:
                self.register_parameter(name, nn.Parameter(t, requires_grad=False))

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        return {n: getattr(self, n) for n in self.fmt.tensor_specs(self.out_features, self.in_features)}

    def weight_dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.fmt.dequantize(self.tensors, dtype)

    def set_weight(self, w: torch.Tensor) -> None:
        """Quantize a dense [out, in] weight into this layer's format (in place), on the layer's device: a CPU
        weight set on a CUDA layer is quantized by the CUDA kernels (also under ``MLA_QUANT_BACKEND=triton``)."""
        if tuple(w.shape) != (self.out_features, self.in_features):
            raise ValueError(f"set_weight: shape {tuple(w.shape)} != {(self.out_features, self.in_features)}")
        device = next(iter(self.tensors.values())).device
        if device.type != "meta":  # a meta layer keeps no values: quantize where the weight is
            w = w.to(device)
        tensors = (self.fmt.quantize(w, self.dtype) if isinstance(self.fmt, BF16) else self.fmt.quantize(w))
        with torch.no_grad():
            for name, t in tensors.items():
                getattr(self, name).data = t.to(getattr(self, name).device)

    def convert_format_(self, fmt: WeightFormat) -> "QuantLinear":
        """Re-hold the weight in ``fmt`` (dequantize, then quantize). Returns self.

        Formats that store the same tensors (e.g. ``FP8Block`` with and without ``act_quant``) only switch
        the compute path: the stored bits are kept."""
        fmt.check_shape(self.out_features, self.in_features)
        if _same_storage(self.fmt, fmt, self.out_features, self.in_features):
            self.fmt = fmt
            return self
        w = self.weight_dequantized(torch.float32)
        for name in self.tensors:
            delattr(self, name)
        self.fmt = fmt
        self._make_tensors(w.device)
        self.set_weight(w)
        return self

    def forward(self, x: "torch.Tensor | PairedActivations") -> torch.Tensor:
        if isinstance(x, PairedActivations):  # one token made in pair order by the kernel before (-> [1, out])
            return self._forward_pairs(x)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"QuantLinear: input has {x.shape[-1]} features, expected {self.in_features}")
        int4 = isinstance(self.fmt, Int4Group)
        counters = self.split_k_counters(x.device) if int4 else None
        prefetch = int4 and self.weights_settled()
        return quant_linear(x, self.fmt, self.tensors, self.bias, counters, prefetch_weights=prefetch)

    def _forward_pairs(self, x: "PairedActivations") -> torch.Tensor:
        if not isinstance(self.fmt, Int4Group):
            raise ValueError(f"QuantLinear: activations in pair order take an Int4Group weight (the half2 GEMV), "
                             f"not {self.fmt!r}")
        t = self.tensors
        y = w4a16_gemv_pairs(x.pairs, x.scales, t["weight_packed"], t["weight_scale"], self.fmt.group_size,
                             dtype=self.dtype, prefetch_weights=self.weights_settled())
        return y if self.bias is None else y + self.bias

    def weights_settled(self) -> bool:
        """Whether this layer's weight tensors are those of its previous call, unwritten since (the same objects,
        storages and in-place version counters): then no kernel just launched can have written them, and the
        one-token INT4 GEMV may read them early. Records the tensors for the next call."""
        key = tuple((id(t), t.data_ptr(), t._version) for t in self.tensors.values())
        settled = self.__dict__.get("_weights_seen") == key
        self.__dict__["_weights_seen"] = key
        return settled

    def split_k_counters(self, device: torch.device) -> torch.Tensor | None:
        """The W4A16 GEMM's split-K counters this layer keeps on ``device`` (int32 [out_features], left zero by every
        launch): a plain attribute, not a buffer, so it is neither saved, sharded nor counted as weight bytes. Made
        on first use outside a CUDA-graph capture; a call inside a capture that finds none gets None (the GEMM then
        zeroes its own inside the graph: memory made during a capture is not zeroed until the graph runs)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:   # "cuda" means the current device, as tensors place it
            device = torch.device("cuda", torch.cuda.current_device())
        kept = self.__dict__.get("_split_k_counters")
        if kept is not None and kept.device == device and kept.numel() >= self.out_features:
            return kept
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        kept = torch.zeros(self.out_features, dtype=torch.int32, device=device)
        self.__dict__["_split_k_counters"] = kept
        return kept

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt!r}"
