"""Plain nn.Modules that only call kernels, formats and cache."""
from .linear import QuantLinear, quant_linear

__all__ = ["QuantLinear", "quant_linear"]
