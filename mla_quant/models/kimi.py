"""Kimi K2.6 (text model): the DeepSeek-V3 architecture — MLA in every layer, one dense layer, then MoE
layers with 384 routed experts (INT4 in the release) and one shared expert."""
from __future__ import annotations

from .config import KimiK26Config
from .decoder import MLACausalLM


class KimiK26ForCausalLM(MLACausalLM):
    """``KimiK26ForCausalLM(config, dtype=torch.bfloat16, formats=None | "checkpoint" | fn, device=None)``.

    ``model(input_ids [B, T]) -> logits [B, T, vocab]``; the cached path is in ``docs/api.md``. Load the
    released weights with ``mla_quant.models.from_pretrained``.
    """

    config_class = KimiK26Config
