"""The decoder shared by Kimi K2.6 and GLM 5.2 (DeepSeek-V3 layout), with the checkpoints' module names.

::

    model.embed_tokens                          nn.Embedding [vocab, hidden]
    model.layers.{i}.input_layernorm            RMSNorm
    model.layers.{i}.self_attn                  MLAttention (Kimi) | DSAttention (GLM: + indexer on "full" layers)
    model.layers.{i}.post_attention_layernorm   RMSNorm
    model.layers.{i}.mlp                        MLP (i < first_k_dense_replace) | MoE (gate, experts, shared_experts)
    model.norm                                  RMSNorm
    lm_head                                     QuantLinear [vocab, hidden]

so ``model.state_dict()`` keys are the checkpoint keys after the key-mapping table (``layout.py``).

Two forwards:

* ``model(input_ids [B, T]) -> logits [B, T, vocab]``: the plain causal forward from position 0, no cache
  (the reference behaviour).
* ``model(input_ids [T], batch=PagedBatch, cache=ModelCache) -> logits [T, vocab]`` (or ``[len(logits_index),
  vocab]``): one step of prefill chunks and/or decode tokens through the paged cache (``docs/api.md``).
"""
from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from ..cache import PagedBatch, PagedKVCache
from ..cache.indexer_cache import IndexerKCache
from ..formats import KVFormat, WeightFormat
from ..modules import MLP, MoE, QuantLinear, RMSNorm, RotaryEmbedding
from ..modules.attention import MLAttention
from ..modules.dsa import DSAttention
from ..modules.experts import PROJECTIONS as EXPERT_PROJECTIONS
from ..modules.experts import StackedExperts
from .config import ModelConfig
from .layout import FormatFn, bf16_formats

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: the class default of the reference implementations
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _one_format(formats: FormatFn, names: Sequence[str], what: str) -> WeightFormat:
    """The single format that ``names`` share (a module holding them in one format), or a clear error."""
    found = {formats(n) for n in names}
    if len(found) != 1:
        raise ValueError(f"{what}: its weights come in several formats {sorted(map(repr, found))}; one module "
                         "holds one format")
    return found.pop()


@dataclass
class ModelCache:
    """A model's paged cache: MLA latent pages for every layer (``kv``) and, for DSA models, the indexer key
    pages of the layers that run their own indexer (``indexer``). Both share page ids, page size and the
    ``PagedBatch`` slots."""

    kv: PagedKVCache
    indexer: IndexerKCache | None = None

    @property
    def num_pages(self) -> int:
        return self.kv.num_pages

    @property
    def page_size(self) -> int:
        return self.kv.page_size

    @property
    def device(self) -> torch.device:
        return self.kv.device

    def copy_pages(self, src_pages, dst_pages) -> None:
        """Copy pages within the cache, latent and indexer keys alike (copy-on-write of a shared page)."""
        self.kv.copy_pages(src_pages, dst_pages)
        if self.indexer is not None:
            self.indexer.copy_pages(src_pages, dst_pages)

    def poison_(self) -> "ModelCache":
        self.kv.poison_()
        if self.indexer is not None:
            self.indexer.poison_()
        return self


class DecoderLayer(nn.Module):
    """Pre-norm residual block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, config: ModelConfig, layer_idx: int, self_attn: nn.Module, formats: FormatFn,
                 dtype: torch.dtype):
        super().__init__()
        c, prefix = config, f"model.layers.{layer_idx}.mlp."
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        mlp_names = [prefix + p for p in EXPERT_PROJECTIONS]
        if c.is_moe_layer(layer_idx):
            expert_names = [f"{prefix}experts.{e}.{p}" for e in range(c.n_routed_experts) for p in EXPERT_PROJECTIONS]
            shared_names = [f"{prefix}shared_experts.{p}" for p in EXPERT_PROJECTIONS]
            router_dtype = _DTYPES[getattr(c, "moe_router_dtype", "float32")]
            self.mlp = MoE(c.hidden_size, c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok,
                           c.n_shared_experts, c.n_group, c.topk_group, c.routed_scaling_factor, c.norm_topk_prob,
                           expert_fmt=_one_format(formats, expert_names, prefix + "experts"),
                           shared_fmt=_one_format(formats, shared_names, prefix + "shared_experts")
                           if c.n_shared_experts else None,
                           router_dtype=router_dtype, dtype=dtype)
        else:
            self.mlp = MLP(c.hidden_size, c.intermediate_size, fmt=_one_format(formats, mlp_names, prefix[:-1]),
                           dtype=dtype)

    @staticmethod
    def _attend(out) -> tuple[torch.Tensor, torch.Tensor | None]:
        return out if isinstance(out, tuple) else (out, None)

    @property
    def shares_topk(self) -> bool:
        """A GLM "shared" layer: it takes the previous full layer's top-k indices."""
        return isinstance(self.self_attn, DSAttention) and self.self_attn.indexer_type == "shared"

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                topk_indices: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [B, T, hidden] -> (x, the top-k indices a DSA layer selected or passed on, else None)."""
        kwargs = {"topk_indices": topk_indices} if self.shares_topk else {}
        h, topk = self._attend(self.self_attn(self.input_layernorm(x), positions, **kwargs))
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), topk

    def forward_paged(self, x: torch.Tensor, batch: PagedBatch, cache: ModelCache,
                      topk_indices: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [T, hidden] (the step's tokens) -> (x, top-k indices or None)."""
        kv = cache.kv.layer(self.layer_idx)
        h = self.input_layernorm(x)
        if not isinstance(self.self_attn, DSAttention):
            out = self.self_attn.forward_paged(h, batch, kv)
        else:
            keys = None
            if self.self_attn.indexer is not None:
                if cache.indexer is None or self.layer_idx not in cache.indexer:
                    raise ValueError(f"cache: layer {self.layer_idx} runs a DSA indexer and needs indexer key pages "
                                     "(ModelCache.indexer)")
                keys = cache.indexer.layer(self.layer_idx)
            out = self.self_attn.forward_paged(h, batch, kv, keys=keys,
                                               topk_indices=topk_indices if self.shares_topk else None)
        h, topk = self._attend(out)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), topk


class DecoderModel(nn.Module):
    """``embed_tokens``, ``layers``, ``norm`` (the checkpoints' ``model.*``)."""

    def __init__(self, config: ModelConfig, layers: list[DecoderLayer], rotary_emb: RotaryEmbedding,
                 dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.rotary_emb = rotary_emb  # shared by every attention layer (frequencies only, no state_dict keys)


class MLACausalLM(nn.Module):
    """The shared causal LM. Subclasses (``KimiK26ForCausalLM``, ``Glm52ForCausalLM``) build the attention.

    Args:
        config: the model config (``KimiK26Config`` / ``Glm52Config``).
        dtype: compute dtype of unquantized weights, norms and activations (bf16; fp32 = reference mode).
        formats: linear layer name (model key prefix, e.g. ``model.layers.3.mlp.experts.7.gate_proj``) ->
            ``WeightFormat``. Default: every linear layer BF16. ``"checkpoint"``: the formats the real release
            stores (``layout.checkpoint_formats``: INT4 routed experts for Kimi K2.6, FP8 blocks for GLM 5.2 FP8).
        device: where to allocate (``torch.device("meta")`` context or argument for loading).
    """

    config_class: type

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.bfloat16,
                 formats: FormatFn | str | None = None, device: torch.device | str | None = None):
        super().__init__()
        if not isinstance(config, self.config_class):
            raise TypeError(f"config: {type(self).__name__} takes a {self.config_class.__name__}, "
                            f"got {type(config).__name__}")
        if config.tie_word_embeddings:
            raise NotImplementedError("tie_word_embeddings=True is not supported (Kimi K2.6 and GLM 5.2 untie)")
        if formats == "checkpoint":
            from .layout import checkpoint_formats

            formats = checkpoint_formats(config)
        elif formats is None:
            formats = bf16_formats
        elif not callable(formats):
            raise TypeError(f"formats: expected None, 'checkpoint' or a function name -> WeightFormat, got {formats!r}")
        self.config, self.dtype = config, dtype
        self.validate_inputs = True  # check token ids against the vocabulary (one host sync per call)
        with torch.device(device) if device is not None else nullcontext():
            rope = self._rotary(config)
            layers = [DecoderLayer(config, i, self._attention(config, i, rope, formats, dtype), formats, dtype)
                      for i in range(config.num_hidden_layers)]
            self.model = DecoderModel(config, layers, rope, dtype)
            self.lm_head = QuantLinear(config.hidden_size, config.vocab_size, fmt=formats("lm_head"), dtype=dtype)

    # ---- construction hooks ------------------------------------------------------------------------
    @staticmethod
    def _rotary(config: ModelConfig) -> RotaryEmbedding:
        rp = config.rope_params
        return RotaryEmbedding(config.qk_rope_head_dim, rp["rope_theta"], rp if rp["rope_type"] == "yarn" else None,
                               interleaved=config.rope_interleave)

    @staticmethod
    def _attention_formats(config: ModelConfig, layer_idx: int, formats: FormatFn) -> dict[str, WeightFormat]:
        prefix = f"model.layers.{layer_idx}.self_attn."
        names = (("q_a_proj", "q_b_proj") if config.q_lora_rank else ("q_proj",)) + (
            "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
        return {n: formats(prefix + n) for n in names}

    @staticmethod
    def _mla_kwargs(config: ModelConfig, rope: RotaryEmbedding, dtype: torch.dtype) -> dict:
        c = config
        return dict(hidden_size=c.hidden_size, num_heads=c.num_attention_heads, q_lora_rank=c.q_lora_rank,
                    kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim,
                    qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim, rope=rope,
                    softmax_scale=c.softmax_scale, eps=LATENT_NORM_EPS, attention_bias=c.attention_bias, dtype=dtype)

    def _attention(self, config: ModelConfig, layer_idx: int, rope: RotaryEmbedding, formats: FormatFn,
                   dtype: torch.dtype) -> nn.Module:
        return MLAttention(**self._mla_kwargs(config, rope, dtype),
                           linear_formats=self._attention_formats(config, layer_idx, formats))

    # ---- introspection -----------------------------------------------------------------------------
    def linear_formats(self) -> dict[str, WeightFormat]:
        """Every linear layer's format, by its model key prefix (experts one entry per expert projection)."""
        out: dict[str, WeightFormat] = {}
        for name, module in self.named_modules():
            if isinstance(module, QuantLinear):
                out[name] = module.fmt
            elif isinstance(module, StackedExperts):
                for e in range(module.num_experts):
                    for p in EXPERT_PROJECTIONS:
                        out[f"{name}.{e}.{p}"] = module.fmt
        return out

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    def num_parameters(self) -> int:
        """Logical parameters of this instance (INT4 / FP8 weights count their unpacked elements)."""
        from .config import num_parameters

        return num_parameters(self.config)

    # ---- cache -------------------------------------------------------------------------------------
    def kv_formats(self) -> list[KVFormat]:
        """Each layer's KV format: its attention module's ``kv_format`` (set by a plan's KV rules) or bf16."""
        return [KVFormat.parse(getattr(layer.self_attn, "kv_format", None) or "bf16") for layer in self.model.layers]

    def allocate_cache(self, num_pages: int, page_size: int = 64,
                       kv_format: str | KVFormat | Sequence[str | KVFormat] | None = None,
                       device: torch.device | str | None = None, indexer_kind: str | None = None,
                       tensor_scales: float | Sequence[float] | None = None) -> ModelCache:
        """Pages for this model: MLA latents in ``kv_format`` (one, or one per layer; None: :meth:`kv_formats`)
        and, for a DSA model, the indexer keys of its "full" layers (``indexer_kind``: ``"fp8_e4m3"``,
        ``"bf16"`` or ``"fp32"``; default: fp32 pages for an fp32 model — the exact reference mode — else
        ``"fp8_e4m3"`` as DeepSeek ships)."""
        c = self.config
        kv_format = self.kv_formats() if kv_format is None else kv_format
        device = torch.device(device) if device is not None else self.device
        kv = PagedKVCache(c.num_hidden_layers, num_pages, page_size, c.kv_lora_rank, c.qk_rope_head_dim,
                          kv_format, device, tensor_scales)
        indexer = None
        types = getattr(c, "indexer_types", None)
        if types is not None:
            kind = indexer_kind or ("fp32" if self.dtype == torch.float32 else "fp8_e4m3")
            indexer = IndexerKCache.for_indexer_types(types, num_pages, page_size, c.index_head_dim, kind, device)
        return ModelCache(kv, indexer)

    # ---- forward -----------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, batch: PagedBatch | None = None,
                cache: ModelCache | PagedKVCache | None = None,
                logits_index: torch.Tensor | None = None) -> torch.Tensor:
        """Without ``batch``: ``input_ids`` LongTensor [B, T] -> logits [B, T, vocab], a plain causal forward
        from position 0 with no cache.

        With ``batch`` (a ``PagedBatch``) and ``cache`` (``allocate_cache``'s ``ModelCache``; a bare
        ``PagedKVCache`` for models without DSA): ``input_ids`` [T] are the step's new tokens, request after
        request (``batch.cu_seqlens_q``); their KV rows are appended at ``batch.slot_mapping`` and the logits
        [T, vocab] returned — only the rows ``logits_index`` (int [N], e.g. ``batch.cu_seqlens_q[1:] - 1``
        for each request's last token) when given.
        """
        if batch is None:
            if cache is not None or logits_index is not None:
                raise ValueError("cache / logits_index: only with a PagedBatch (batch=...)")
            return self._forward_plain(input_ids)
        return self._forward_paged(input_ids, batch, cache, logits_index)

    def _check_ids(self, input_ids: torch.Tensor, ndim: int) -> None:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != ndim or input_ids.dtype not in (
                torch.int64, torch.int32):
            shape = "[B, T]" if ndim == 2 else "[T] (the step's tokens, flattened)"
            got = (f"{input_ids.dtype} {tuple(input_ids.shape)}" if isinstance(input_ids, torch.Tensor)
                   else type(input_ids).__name__)
            raise ValueError(f"input_ids: expected an integer tensor {shape}, got {got}")
        if input_ids.numel() and self.validate_inputs:
            lo, hi = int(input_ids.min()), int(input_ids.max())
            if lo < 0 or hi >= self.config.vocab_size:
                raise ValueError(f"input_ids: token id {lo if lo < 0 else hi} outside [0, {self.config.vocab_size})")

    def _forward_plain(self, input_ids: torch.Tensor) -> torch.Tensor:
        self._check_ids(input_ids, 2)
        x = self.model.embed_tokens(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        topk = None
        for layer in self.model.layers:
            x, topk = layer(x, positions, topk)
        return self.lm_head(self.model.norm(x))

    def _forward_paged(self, input_ids: torch.Tensor, batch: PagedBatch, cache, logits_index) -> torch.Tensor:
        self._check_ids(input_ids, 1)
        if isinstance(cache, PagedKVCache):
            cache = ModelCache(cache)
        if not isinstance(cache, ModelCache):
            raise ValueError(f"cache: expected a ModelCache (model.allocate_cache) or a PagedKVCache, got "
                             f"{type(cache).__name__}")
        if len(cache.kv) != len(self.model.layers):
            raise ValueError(f"cache: {len(cache.kv)} layers of pages for a model of {len(self.model.layers)} layers")
        if input_ids.shape[0] != batch.num_tokens:
            raise ValueError(f"input_ids: {input_ids.shape[0]} tokens, the batch plans {batch.num_tokens}")
        x = self.model.embed_tokens(input_ids)
        topk = None
        for layer in self.model.layers:
            x, topk = layer.forward_paged(x, batch, cache, topk)
        x = self.model.norm(x)
        if logits_index is not None:
            x = x[logits_index]
        return self.lm_head(x)

    def extra_repr(self) -> str:
        return f"dtype={self.dtype}"


__all__ = ["MLACausalLM", "DecoderModel", "DecoderLayer", "ModelCache"]
