"""DeepSeek Sparse Attention (DeepSeek V3.2, GLM 5.x): MLA where each query attends only to the ``index_topk``
cached tokens its lightning indexer ranks highest (docs/dsa.md).

``DSAttention`` is an :class:`MLAttention` (same projections, names, cache rows) plus, on ``"full"`` layers, a
:class:`LightningIndexer` (``self_attn.indexer.*``). GLM 5.2's ``"shared"`` layers have no indexer: they take
the top-k indices of the previous full layer, which every forward returns for that purpose.

Paths:

* ``forward`` (plain causal, no cache — the reference): the naive/expanded form restricted to each query's
  top-k by a -inf mask, exactly the Hugging Face eager computation. A sequence no longer than ``index_topk``
  selects every visible token, so it runs ``MLAttention.forward`` (dense).
* ``forward_paged`` (prefill chunks and decode over a paged cache): the step's latent rows and indexer keys
  are appended, the indexer scores every visible cached key, and ``sparse_mla_decode`` attends in the
  absorbed form over the gathered top-k rows. The absorbed form serves prefill too (as FlashMLA's sparse
  prefill): the gathered 576-value row is shared by all heads, where the expanded form would gather H
  expanded key/value rows per selected token. When the block table cannot hold more than ``index_topk``
  tokens (a host-side bound), every visible token is selected: the layer runs MLA's dense kernels and the
  indexer only writes its keys.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from ..cache.batch import PagedBatch
from ..cache.indexer_cache import IndexerKeys
from ..cache.paged import LayerKV
from ..formats import WeightFormat
from ..kernels.indexer_scores import req_ids_from_cu_seqlens
from ..kernels.sparse_mla_decode import sparse_mla_decode
from .attention import MLAttention
from .indexer import LightningIndexer

INDEXER_TYPES = ("full", "shared")
MASKED_ATTENTION_BYTES = 1 << 28  # fp32 logits held at once by the plain forward's masked attention


def topk_mask(topk_indices: torch.Tensor, num_keys: int) -> torch.Tensor:
    """int [..., T, K] key positions (-1 unused) -> bool [..., T, num_keys], True at the selected keys."""
    idx = topk_indices.long()
    hit = torch.zeros(*idx.shape[:-1], num_keys + 1, dtype=torch.bool, device=idx.device)
    hit.scatter_(-1, torch.where(idx >= 0, idx, num_keys), True)     # -1 lands in a spare last column
    return hit[..., :num_keys]


def sparse_attention_expanded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, topk_indices: torch.Tensor,
                              softmax_scale: float) -> torch.Tensor:
    """Causal attention restricted to each query's top-k keys (the reference's eager form, chunked over
    queries to bound memory): q, k [B, T, H, Dqk], v [B, T, H, Dv], topk_indices [B, T, K] -> [B, T, H, Dv]
    in v's dtype. Logits and softmax in fp32."""
    b, t, h, _ = q.shape
    out = torch.empty(b, t, h, v.shape[-1], dtype=v.dtype, device=v.device)
    chunk = max(1, MASKED_ATTENTION_BYTES // (4 * b * h * t))
    kf, vf = k.float(), v.float()
    keys = torch.arange(t, device=q.device)
    for s in range(0, t, chunk):
        rows = slice(s, min(t, s + chunk))
        logits = torch.einsum("bqhd,bkhd->bhqk", q[:, rows].float(), kf) * softmax_scale
        allowed = topk_mask(topk_indices[:, rows], t) & (keys[None, :] <= keys[rows, None])   # [B, q, T]
        logits = logits.masked_fill(~allowed[:, None], float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        probs = torch.where(allowed.any(-1)[:, None, :, None], probs, 0.0)   # a query selecting nothing gets 0
        out[:, rows] = torch.einsum("bhqk,bkhd->bqhd", probs, vf).to(v.dtype)
    return out


def causal_indices(positions: torch.Tensor, width: int) -> torch.Tensor:
    """The selection "every visible token": int32 [T, width] with 0 .. position, -1 after."""
    cols = torch.arange(width, device=positions.device)
    return torch.where(cols[None, :] <= positions[:, None], cols[None, :], -1).to(torch.int32)


class DSAttention(MLAttention):
    """MLA with DSA. The MLA arguments are :class:`MLAttention`'s; in addition:

    Args:
        index_n_heads, index_head_dim, index_topk: the indexer (32, 128, 2048 for GLM 5.2).
        indexer_type: ``"full"`` (own indexer) or ``"shared"`` (no indexer weights; takes the previous full
            layer's indices).
        indexer_rope_interleave: the indexer's RoPE convention (True for GLM 5.x, False for DeepSeek V3.2);
            it shares the MLA rope's frequencies.
        indexer_fmt: ``"bf16"`` or ``"fp8"`` (see :class:`LightningIndexer`).
        linear_formats: as MLAttention's, plus ``"indexer.wq_b"``, ``"indexer.wk"``, ``"indexer.weights_proj"``.

    ``forward(x, positions=None, topk_indices=None) -> (y, topk_indices)`` and
    ``forward_paged(x, batch, kv, keys=None, topk_indices=None) -> (y, topk_indices)``: pass the returned
    indices to the following shared layers.
    """

    def __init__(self, hidden_size: int, num_heads: int, q_lora_rank: int, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, *, index_n_heads: int = 32,
                 index_head_dim: int = 128, index_topk: int = 2048, indexer_type: str = "full",
                 indexer_rope_interleave: bool = True, indexer_fmt: str = "bf16",
                 linear_formats: Mapping[str, WeightFormat] | None = None, **mla_kwargs):
        if q_lora_rank is None:
            raise ValueError("q_lora_rank: DSA's indexer reads the q latent, it cannot be None")
        if indexer_type not in INDEXER_TYPES:
            raise ValueError(f"indexer_type: {indexer_type!r} not in {INDEXER_TYPES}")
        formats = dict(linear_formats or {})
        indexer_formats = {k[len("indexer."):]: formats.pop(k) for k in list(formats) if k.startswith("indexer.")}
        super().__init__(hidden_size, num_heads, q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
                         v_head_dim, linear_formats=formats, **mla_kwargs)
        self.indexer_type, self.index_topk = indexer_type, index_topk
        if indexer_type == "full":
            self.indexer = LightningIndexer(
                hidden_size, q_lora_rank, index_n_heads, index_head_dim, qk_rope_head_dim, index_topk,
                rope=self.rotary_emb, rope_interleave=indexer_rope_interleave, fmt=indexer_fmt, dtype=self.dtype,
                device=mla_kwargs.get("device"), linear_formats=indexer_formats)
        else:
            if indexer_formats:
                raise ValueError(f"linear_formats: a shared layer has no indexer ({sorted(indexer_formats)})")
            self.indexer = None

    # ------------------------------------------------------------------------------------ no cache
    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                topk_indices: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Plain causal DSA from position 0: x [B, T, hidden] -> (y [B, T, hidden], int32 [B, T, K]).
        ``topk_indices`` (shared layers only, required there): the previous full layer's selection."""
        positions = self.plain_positions(x, positions)
        bsz, t, _ = x.shape
        q_latent = self.q_latent(x)
        dense = t <= self.index_topk                 # every visible token is selected
        if self.indexer is not None:
            if topk_indices is not None:
                raise ValueError("topk_indices: a full layer selects its own tokens")
            if dense:
                topk_indices = causal_indices(torch.arange(t, device=x.device), t).expand(bsz, t, t)
            else:
                topk_indices = self.indexer(x, q_latent, positions)
        else:
            self._check_given_indices(topk_indices, (bsz, t))
        if dense:
            return super().forward(x, positions), topk_indices
        q_nope, q_pe = self.project_q(x, positions, q_latent)
        latent, k_pe = self.project_kv(x, positions)
        k_nope, v = self.expand_kv(latent)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe[..., None, :].expand(*k_nope.shape[:-1], self.qk_rope_head_dim)], dim=-1)
        o = sparse_attention_expanded(q, k, v, topk_indices, self.softmax_scale)
        return self.output(o), topk_indices

    # ------------------------------------------------------------------------------------ paged cache
    def forward_paged(self, x: torch.Tensor, batch: PagedBatch, kv: LayerKV, keys: IndexerKeys | None = None,
                      topk_indices: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One step over a paged cache: x [T, hidden] -> (y [T, hidden], int32 [T, K] logical positions).
        Full layers need their indexer ``keys`` (``IndexerKCache.layer(i)``); shared layers need
        ``topk_indices`` from the previous full layer of the same step."""
        self._check_paged(x, batch, kv)
        t = x.shape[0]
        q_latent = self.q_latent(x)
        q_nope, q_pe = self.project_q(x, batch.positions, q_latent)
        latent, k_pe = self.project_kv(x, batch.positions)
        kv.append(torch.cat([latent, k_pe], dim=-1), batch.slot_mapping)
        max_ctx = batch.block_table.shape[1] * batch.page_size
        dense = max_ctx <= self.index_topk          # host-side: no request can hold more than topk tokens
        req_ids = None
        if self.indexer is not None:
            if keys is None:
                raise ValueError("keys: a full DSA layer needs its indexer key pages (IndexerKCache.layer(i))")
            if topk_indices is not None:
                raise ValueError("topk_indices: a full layer selects its own tokens")
            if dense:
                self.indexer.append_keys(x, batch, keys)
                topk_indices = causal_indices(batch.positions, max_ctx)
            else:
                req_ids = req_ids_from_cu_seqlens(batch.cu_seqlens_q, t)
                topk_indices = self.indexer.forward_paged(x, q_latent, batch, keys, req_ids,
                                                          validate=self.validate_tables)
        else:
            self._check_given_indices(topk_indices, (t,))
        if dense:
            if self.uses_decode_kernel(batch):
                o = self.attend_decode(q_nope, q_pe, batch, kv)
            else:
                o = self.attend_prefill(q_nope, q_pe, batch, kv)
            return self.output(o), topk_indices
        if req_ids is None:
            req_ids = req_ids_from_cu_seqlens(batch.cu_seqlens_q, t)
        o_lat, _ = sparse_mla_decode(self.absorb_q(q_nope), q_pe.to(self.dtype), kv.data, kv.scales, kv.kind,
                                     batch.block_table, batch.seq_lens, req_ids, topk_indices, self.softmax_scale,
                                     validate=self.validate_tables)
        return self.output(self.latent_to_v(o_lat)), topk_indices

    def _check_given_indices(self, topk_indices: torch.Tensor | None, lead: tuple[int, ...]) -> None:
        if topk_indices is None:
            raise ValueError("topk_indices: a shared DSA layer needs the previous full layer's top-k indices")
        if (not isinstance(topk_indices, torch.Tensor) or topk_indices.dtype != torch.int32
                or tuple(topk_indices.shape[:-1]) != lead or topk_indices.dim() != len(lead) + 1):
            got = (f"{topk_indices.dtype} {tuple(topk_indices.shape)}" if isinstance(topk_indices, torch.Tensor)
                   else type(topk_indices).__name__)
            raise ValueError(f"topk_indices: expected int32 [{', '.join(map(str, lead))}, K], got {got}")

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, indexer_type={self.indexer_type!r}, index_topk={self.index_topk}"
