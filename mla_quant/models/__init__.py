"""Kimi K2.6 and GLM 5.2 built from this library's modules, loading the real checkpoint layouts."""
from .config import Glm52Config, KimiK26Config, config_from_hf, num_parameters

__all__ = ["KimiK26Config", "Glm52Config", "config_from_hf", "num_parameters"]
