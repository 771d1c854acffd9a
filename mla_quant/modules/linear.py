"""``QuantLinear`` and the one chokepoint every projection goes through: :func:`quant_linear`.

The module holds its weight as the checkpoint tensors of its format (``weight`` /
``weight`` + ``weight_scale_inv`` / ``weight_packed`` + ``weight_scale`` + ``weight_shape``), so its
state_dict keys are the checkpoint's. :func:`quant_linear` picks the compute path from the format.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..formats import BF16, FP8Block, Int4Group, WeightFormat
from ..kernels import fp8_quant


def quant_linear(x: torch.Tensor, fmt: WeightFormat, tensors: dict[str, torch.Tensor],
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W.T (+ bias) for a weight held in ``fmt``. x: [..., K] -> [..., N] in x.dtype."""
    if isinstance(fmt, BF16):
        return F.linear(x, tensors["weight"].to(x.dtype), bias)
    if isinstance(fmt, FP8Block):
        w = fmt.dequantize(tensors, torch.float32)
        if fmt.act_quant:  # W8A8: x is rounded to e4m3 per 1×group, products accumulate in fp32
            q, s = fp8_quant.act_quant_fp8(x.contiguous(), fmt.act_group, fmt.ue8m0)
            xs = (q.float().unflatten(-1, (-1, fmt.act_group)) * s[..., None]).flatten(-2)
            y = xs @ w.T
        else:
            y = x.float() @ w.T
        y = y.to(x.dtype)
        return y if bias is None else y + bias
    if isinstance(fmt, Int4Group):
        return F.linear(x, fmt.dequantize(tensors, x.dtype), bias)
    raise TypeError(f"quant_linear: no compute path for format {fmt!r}")


class QuantLinear(nn.Module):
    """A linear layer whose weight lives in any :class:`WeightFormat`. ``x: [..., in] -> [..., out]``."""

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
        """Quantize a dense [out, in] weight into this layer's format (in place)."""
        if tuple(w.shape) != (self.out_features, self.in_features):
            raise ValueError(f"set_weight: shape {tuple(w.shape)} != {(self.out_features, self.in_features)}")
        tensors = (self.fmt.quantize(w, self.dtype) if isinstance(self.fmt, BF16) else self.fmt.quantize(w))
        with torch.no_grad():
            for name, t in tensors.items():
                getattr(self, name).data = t.to(getattr(self, name).device)

    def convert_format_(self, fmt: WeightFormat) -> "QuantLinear":
        """Re-hold the weight in ``fmt`` (dequantize, then quantize). Returns self."""
        w = self.weight_dequantized(torch.float32)
        for name in self.tensors:
            delattr(self, name)
        fmt.check_shape(self.out_features, self.in_features)
        self.fmt = fmt
        self._make_tensors(w.device)
        self.set_weight(w)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"QuantLinear: input has {x.shape[-1]} features, expected {self.in_features}")
        return quant_linear(x, self.fmt, self.tensors, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt!r}"
