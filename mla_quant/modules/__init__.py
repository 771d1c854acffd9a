"""Plain nn.Modules that only call kernels, formats and cache."""
from .linear import QuantLinear, quant_linear, quant_linear_reference
from .norm import RMSNorm
from .rope import RotaryEmbedding, YarnScaling

__all__ = ["QuantLinear", "quant_linear", "quant_linear_reference", "RMSNorm", "RotaryEmbedding", "YarnScaling"]
