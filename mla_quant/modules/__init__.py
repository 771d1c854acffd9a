"""Plain nn.Modules that only call kernels, formats and cache."""
from .linear import QuantLinear, quant_linear
from .norm import RMSNorm
from .rope import RotaryEmbedding, YarnScaling

__all__ = ["QuantLinear", "quant_linear", "RMSNorm", "RotaryEmbedding", "YarnScaling"]
