"""GLM 5.2 (``glm_moe_dsa``): MLA with DeepSeek Sparse Attention in every layer — a lightning indexer on
the ``"full"`` layers of ``indexer_types``, the previous full layer's top-k reused on the ``"shared"`` ones
(IndexShare) — three dense layers, then MoE layers with 256 routed experts and one shared expert."""
from __future__ import annotations

import torch
from torch import nn

from ..modules.dsa import DSAttention
from ..modules.rope import RotaryEmbedding
from .config import Glm52Config
from .decoder import MLACausalLM
from .layout import FormatFn


class Glm52ForCausalLM(MLACausalLM):
    """``Glm52ForCausalLM(config, dtype=torch.bfloat16, formats=None | "checkpoint" | fn, device=None)``.

    ``model(input_ids [B, T]) -> logits [B, T, vocab]``: each shared layer receives the top-k indices of
    the previous full layer. The indexer computes in full precision (``"bf16"`` format of
    ``LightningIndexer``, the reference behaviour); an FP8 indexer is a plan choice.
    """

    config_class = Glm52Config

    def _attention(self, config: Glm52Config, layer_idx: int, rope: RotaryEmbedding, formats: FormatFn,
                   dtype: torch.dtype) -> nn.Module:
        indexer_type = config.indexer_types[layer_idx]
        linear_formats = self._attention_formats(config, layer_idx, formats)
        if indexer_type == "full":
            prefix = f"model.layers.{layer_idx}.self_attn.indexer."
            linear_formats.update({f"indexer.{n}": formats(prefix + n) for n in ("wq_b", "wk", "weights_proj")})
        return DSAttention(**self._mla_kwargs(config, rope, dtype), index_n_heads=config.index_n_heads,
                           index_head_dim=config.index_head_dim, index_topk=config.index_topk,
                           indexer_type=indexer_type, indexer_rope_interleave=config.indexer_rope_interleave,
                           linear_formats=linear_formats)
