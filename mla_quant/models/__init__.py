"""Kimi K2.6 and GLM 5.2 built from this library's modules, loading the real checkpoint layouts.

``from_pretrained(path, dtype=..., device=..., plan=None)`` reads a Hugging Face folder in the layout the
model makers publish; ``save_pretrained(model, path)`` writes one. See docs/models.md and docs/api.md.
"""
from .config import Glm52Config, KimiK26Config, config_from_hf, num_parameters
from .decoder import MLACausalLM, ModelCache
from .glm import Glm52ForCausalLM
from .kimi import KimiK26ForCausalLM
from .loading import CheckpointError, from_pretrained
from .random_init import init_random_weights_
from .saving import save_pretrained

__all__ = ["KimiK26Config", "Glm52Config", "KimiK26ForCausalLM", "Glm52ForCausalLM", "MLACausalLM", "ModelCache",
           "from_pretrained", "save_pretrained", "CheckpointError", "config_from_hf", "num_parameters",
           "init_random_weights_"]
