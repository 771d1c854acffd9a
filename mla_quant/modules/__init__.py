"""Plain nn.Modules that only call kernels, formats and cache."""
from .attention import MLAttention
from .dsa import DSAttention
from .indexer import LightningIndexer
from .linear import PairedActivations, QuantLinear, quant_linear, quant_linear_reference
from .mlp import MLP
from .moe import MoE, Router, StackedExperts
from .norm import RMSNorm
from .rope import RotaryEmbedding, YarnScaling

__all__ = ["QuantLinear", "PairedActivations", "quant_linear", "quant_linear_reference", "RMSNorm", "RotaryEmbedding",
           "YarnScaling"]
__all__ += ["MLP", "MoE", "Router", "StackedExperts"]
__all__ += ["LightningIndexer"]
__all__ += ["MLAttention"]
__all__ += ["DSAttention"]
