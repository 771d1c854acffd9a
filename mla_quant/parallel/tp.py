"""Tensor parallelism as a transform on a built model (gpt-fast ``tp.py``): the model code stays
single-device; :func:`apply_tp` slices weights in place (scales with them) and adds the collectives as
forward hooks. The sharding table and its costs are in ``docs/parallel.md``.

=========================================  ====================================  ===============================
module (found by type)                     each rank keeps                       collective
=========================================  ====================================  ===============================
``MLAttention`` / ``DSAttention``          heads ``[r·H/W, (r+1)·H/W)``:         all-reduce of ``o_proj``'s
                                           ``q_b_proj`` (``q_proj``), ``kv_b_proj``  output (sum over heads)
                                           output rows; ``o_proj`` input columns
  latent path: ``q_a_proj``, ``q_a_layernorm``, ``kv_a_proj_with_mqa``,       replicated (no collective)
  ``kv_a_layernorm``, the KV cache rows, the DSA indexer
``MLP`` (dense layers)                     ``gate_proj``/``up_proj`` rows,        all-reduce of ``down_proj``'s
                                           ``down_proj`` columns                  output
``MoE``: ``shared_experts``, routed        the same split of the (expert)        one all-reduce of the MoE
experts (``StackedExperts``)               intermediate dimension                output (routed + shared
                                                                                  partial sums)
``MoE`` with expert-parallel experts       shared experts as above; routed        all-reduce of the shared
(:func:`~mla_quant.parallel.apply_ep`)     experts left to EP                    ``down_proj``'s output
``Router`` (``mlp.gate``), norms           replicated                             —
``nn.Embedding``                           vocabulary rows ``[r·V/W, (r+1)·V/W)``  masked lookup, all-reduce
``lm_head``                                vocabulary rows                        all-gather of the logits
=========================================  ====================================  ===============================
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..modules.attention import MLAttention
from ..modules.linear import QuantLinear
from ..modules.mlp import MLP
from ..modules.moe import MoE
from .comm import GroupInfo, ProcessGroup, all_gather_last_dim, all_reduce_, group_info
from .ep import ExpertParallelExperts
from .shard import (COLS, ROWS, TP_ATTR, Split, narrow_copy, record_split, shard_experts_intermediate_,
                    shard_linear_, split_range)


def _mark(module: nn.Module, what: str, info: GroupInfo, dry: bool) -> None:
    if getattr(module, TP_ATTR, None) is not None:
        raise RuntimeError(f"apply_tp: {what} is already tensor-parallel (apply_tp was applied twice)")
    if not dry:
        module.__dict__[TP_ATTR] = info


def _all_reduce_hook(group: ProcessGroup | None):
    def hook(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        return all_reduce_(output, group)

    return hook


def _all_gather_hook(info: GroupInfo):
    def hook(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        return all_gather_last_dim(output, info)

    return hook


class VocabParallelEmbedding(nn.Embedding):
    """An embedding table split by vocabulary rows: this rank holds rows ``[vocab_start, vocab_start +
    num_embeddings)``. ``forward(ids [...]) -> [..., dim]``: looks up the ids it holds, zeros elsewhere, and
    sums over the group (every id is held by exactly one rank, so the sum is exact in any dtype)."""

    def __init__(self, weight: torch.Tensor, vocab_start: int, vocab_size: int, info: GroupInfo):
        super().__init__(weight.shape[0], weight.shape[1], _weight=weight, _freeze=not weight.requires_grad,
                         device=weight.device, dtype=weight.dtype)
        self.vocab_start, self.vocab_size = vocab_start, vocab_size
        self.__dict__[TP_ATTR] = info

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside[..., None], 0)
        return all_reduce_(out, getattr(self, TP_ATTR).group)

    def extra_repr(self) -> str:
        return (f"rows [{self.vocab_start}, {self.vocab_start + self.num_embeddings}) of {self.vocab_size}, "
                f"dim={self.embedding_dim}")


def _shard_attention(attn: MLAttention, name: str, info: GroupInfo, dry: bool) -> None:
    heads = attn.num_heads
    split_range(heads, info, 1, f"{name}: num_heads", unit=" heads")
    q_name = "q_proj" if attn.q_lora_rank is None else "q_b_proj"
    for proj, axis in ((q_name, ROWS), ("kv_b_proj", ROWS), ("o_proj", COLS)):
        linear = getattr(attn, proj)
        _mark(linear, f"{name}.{proj}", info, dry)
        shard_linear_(linear, axis, info, f"{name}.{proj} ({heads} heads)", dry)
    if dry:
        return
    attn.num_heads = heads // info.world
    attn._absorbed, attn._absorbed_key, attn._absorbed_src = None, None, []  # W_UK / W_UV of the old heads
    attn.o_proj.register_forward_hook(_all_reduce_hook(info.group))


def _shard_mlp(mlp: MLP, name: str, info: GroupInfo, dry: bool) -> None:
    for proj, axis in (("gate_proj", ROWS), ("up_proj", ROWS), ("down_proj", COLS)):
        linear = getattr(mlp, proj)
        _mark(linear, f"{name}.{proj}", info, dry)
        shard_linear_(linear, axis, info, f"{name}.{proj}", dry)
    if not dry:
        mlp.intermediate_size = mlp.gate_proj.out_features


def _shard_moe(moe: MoE, name: str, info: GroupInfo, dry: bool) -> None:
    if moe.shared_experts is not None:
        _shard_mlp(moe.shared_experts, f"{name}.shared_experts", info, dry)
    if isinstance(moe.experts, ExpertParallelExperts):
        # Routed experts are expert-parallel and return full sums: only the shared experts' partials are summed.
        if moe.shared_experts is not None and not dry:
            moe.shared_experts.down_proj.register_forward_hook(_all_reduce_hook(info.group))
        return
    _mark(moe.experts, f"{name}.experts", info, dry)
    shard_experts_intermediate_(moe.experts, info, f"{name}.experts", dry)
    if not dry:  # routed and shared experts both produce partial sums of the same output: one all-reduce
        moe.register_forward_hook(_all_reduce_hook(info.group))


def _shard_embedding(model: nn.Module, name: str, emb: nn.Embedding, info: GroupInfo, dry: bool) -> None:
    if emb.padding_idx is not None or emb.max_norm is not None:
        raise NotImplementedError(f"apply_tp: {name} uses padding_idx / max_norm, not supported when sharded")
    vocab = emb.num_embeddings
    start, stop = split_range(vocab, info, 1, f"{name}: vocab_size", unit=" rows")
    if dry:
        return
    weight = narrow_copy(emb.weight, 0, start, stop)
    new = VocabParallelEmbedding(nn.Parameter(weight, requires_grad=emb.weight.requires_grad), start, vocab, info)
    record_split(new, Split(ROWS, start, stop, vocab))
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent), attr, new)


def _walk(model: nn.Module, info: GroupInfo, dry: bool) -> None:
    modules = list(model.named_modules())
    in_moe = {id(m.shared_experts) for _, m in modules if isinstance(m, MoE) and m.shared_experts is not None}
    for name, module in modules:
        if isinstance(module, MLAttention):
            _shard_attention(module, name, info, dry)
        elif isinstance(module, MoE):
            _shard_moe(module, name, info, dry)
        elif isinstance(module, MLP) and id(module) not in in_moe:
            _shard_mlp(module, name, info, dry)
            if not dry:
                module.down_proj.register_forward_hook(_all_reduce_hook(info.group))
        elif type(module) is nn.Embedding:
            _shard_embedding(model, name, module, info, dry)
    head = getattr(model, "lm_head", None)
    if isinstance(head, QuantLinear):
        _mark(head, "lm_head", info, dry)
        shard_linear_(head, ROWS, info, "lm_head (vocab_size)", dry)
        if not dry:
            head.register_forward_hook(_all_gather_hook(info))


def apply_tp(model: nn.Module, group: ProcessGroup | None = None) -> nn.Module:
    """Shard ``model`` in place for tensor parallelism over ``group`` (None = the default process group) and
    return it. Every rank must hold the same full model before the call (same seed or the same checkpoint)
    and feed the same inputs after it; the logits then equal the single-device model's on every rank.

    Modules are found by type (table in the module docstring), anywhere in the model. Call
    :func:`~mla_quant.parallel.apply_ep` first to keep the routed experts expert-parallel (TP+EP); the KV
    cache needs no change (the latent rows are replicated: allocate the same cache on every rank).

    Raises ValueError (naming the layer, format and sizes) when a dimension does not split evenly, or a
    shard boundary would cut an FP8 block or an INT4 group; every split is checked before any weight is
    touched, so a model that raises is left unchanged.

    The collectives run in forward hooks (``torch.distributed``, gloo or NCCL) and do not propagate
    gradients: this is an inference transform.
    """
    info = group_info(group, "apply_tp")
    if getattr(model, TP_ATTR, None) is not None:
        raise RuntimeError("apply_tp: the model is already tensor-parallel (apply_tp was applied twice)")
    _walk(model, info, dry=True)   # every split is checked before any weight changes
    _walk(model, info, dry=False)
    model.__dict__[TP_ATTR] = info
    return model


__all__ = ["apply_tp", "VocabParallelEmbedding"]
