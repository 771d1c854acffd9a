"""Weight formats as data: frozen dataclasses that know their checkpoint tensors, bytes, and reference
quantize / dequantize. Which kernel runs a format is a separate field (``kernel``), not the format itself.

A quantized weight is a dict of tensors keyed by the checkpoint suffixes of the real models, so a module's
state_dict is the checkpoint layout:

==========  =======================================================================================
BF16        ``weight`` [N, K] in the model dtype (bf16 when serving, fp32 in the exact reference mode)
FP8Block    ``weight`` [N, K] e4m3 + ``weight_scale_inv`` [⌈N/128⌉, ⌈K/128⌉] fp32 (DeepSeek / GLM FP8)
Int4Group   ``weight_packed`` int32 [N, K/8] + ``weight_scale`` [N, K/g] + ``weight_shape`` int64 [2]
            (compressed-tensors ``pack-quantized``, symmetric, Kimi K2.6 routed experts)
==========  =======================================================================================
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..kernels import fp8_quant, int4_quant

TensorSpec = tuple[tuple[int, ...], torch.dtype]
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class WeightFormat:
    """Base of the weight formats: serialisation and byte accounting shared by all."""

    name: ClassVar[str]

    def to_dict(self) -> dict:
        return {"format": type(self).__name__, **dataclasses.asdict(self)}

    def tensor_specs(self, n: int, k: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, TensorSpec]:
        raise NotImplementedError

    def nbytes(self, n: int, k: int, dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes of one [N, K] weight in this format, scales included."""
        total = 0
        for shape, dt in self.tensor_specs(n, k, dtype).values():
            numel = 1
            for s in shape:
                numel *= s
            total += numel * dt.itemsize
        return total

    def bits_per_weight(self, n: int = 4096, k: int = 7168) -> float:
        return 8.0 * self.nbytes(n, k) / (n * k)

    def check_shape(self, n: int, k: int) -> None:
        """Raise if an [N, K] weight cannot be held in this format."""

    def quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def dequantize(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raise NotImplementedError


@dataclass(frozen=True)
class BF16(WeightFormat):
    """Unquantized: the weight in the model's compute dtype (bf16 serving, fp32 reference mode)."""

    name: ClassVar[str] = "bf16"

    def tensor_specs(self, n, k, dtype=torch.bfloat16):
        return {"weight": ((n, k), dtype)}

    def quantize(self, w, dtype: torch.dtype | None = None):
        return {"weight": w.to(dtype or w.dtype)}

    def dequantize(self, tensors, dtype=torch.float32):
        return tensors["weight"].to(dtype)


@dataclass(frozen=True)
class FP8Block(WeightFormat):
    """e4m3 weights with one fp32 scale per ``block`` (DeepSeek-V3 / GLM 5.x FP8 checkpoints).

    ``act_quant``: also quantize activations per token in 1×``act_group`` groups (W8A8, the serving path);
    False computes with the dequantized weight (weight-only, the exact mode for a loaded checkpoint).
    ``ue8m0``: power-of-two activation scales (DeepSeek V3.1+ ``scale_fmt``).
    """

    block: tuple[int, int] = (128, 128)
    act_quant: bool = True
    act_group: int = 128
    ue8m0: bool = False
    kernel: str = "auto"
    name: ClassVar[str] = "fp8_block"

    def __post_init__(self):
        object.__setattr__(self, "block", tuple(int(b) for b in self.block))

    def tensor_specs(self, n, k, dtype=torch.bfloat16):
        bn, bk = self.block
        return {"weight": ((n, k), fp8_quant.FP8),
                "weight_scale_inv": ((-(-n // bn), -(-k // bk)), torch.float32)}

    def check_shape(self, n, k):
        if self.act_quant and k % self.act_group:
            raise ValueError(f"FP8Block: K={k} is not divisible by the activation group {self.act_group}")

    def quantize(self, w):
        q, s = fp8_quant.block_quant_fp8(w.contiguous(), self.block)
        return {"weight": q, "weight_scale_inv": s}

    def dequantize(self, tensors, dtype=torch.float32):
        return fp8_quant.block_dequant_fp8(tensors["weight"], tensors["weight_scale_inv"], self.block, dtype)


@dataclass(frozen=True)
class Int4Group(WeightFormat):
    """Symmetric INT4, one scale per ``group_size`` input columns, compressed-tensors ``pack-quantized``."""

    group_size: int = 32
    scale_dtype: str = "bfloat16"
    packing: str = "pack-quantized"
    kernel: str = "auto"
    name: ClassVar[str] = "int4_g"

    def __post_init__(self):
        if self.group_size not in int4_quant.GROUP_SIZES:
            raise ValueError(f"Int4Group: group_size {self.group_size} not in {int4_quant.GROUP_SIZES}")
        if self.scale_dtype not in _DTYPES:
            raise ValueError(f"Int4Group: scale_dtype {self.scale_dtype!r} not in {tuple(_DTYPES)}")
        if self.packing != "pack-quantized":
            raise ValueError(f"Int4Group: packing {self.packing!r} not supported (only 'pack-quantized')")

    @property
    def torch_scale_dtype(self) -> torch.dtype:
        return _DTYPES[self.scale_dtype]

    def tensor_specs(self, n, k, dtype=torch.bfloat16):
        return {"weight_packed": ((n, k // 8), torch.int32),
                "weight_scale": ((n, k // self.group_size), self.torch_scale_dtype),
                "weight_shape": ((2,), torch.int64)}

    def check_shape(self, n, k):
        if k % self.group_size:
            raise ValueError(f"Int4Group: K={k} is not divisible by group_size {self.group_size}")

    def quantize(self, w):
        self.check_shape(*w.shape)
        packed, scale = int4_quant.int4_quantize(w.contiguous(), self.group_size, self.torch_scale_dtype)
        return {"weight_packed": packed, "weight_scale": scale,
                "weight_shape": torch.tensor(list(w.shape), dtype=torch.int64, device=w.device)}

    def dequantize(self, tensors, dtype=torch.float32):
        return int4_quant.int4_dequantize(tensors["weight_packed"], tensors["weight_scale"], self.group_size, dtype)


WEIGHT_FORMATS: dict[str, type[WeightFormat]] = {cls.__name__: cls for cls in (BF16, FP8Block, Int4Group)}
