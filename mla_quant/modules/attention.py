"""Multi-head Latent Attention (DeepSeek-V3 / Kimi K2.x / GLM-5.x) with the real checkpoints' parameter names.

Math (docs/mla.md; reference/model_specs.md §6), per token with H heads::

    c_q      = q_a_layernorm(q_a_proj(x))                      [q_lora_rank]   (or none: q_proj(x))
    q        = q_b_proj(c_q) -> [H, nope + rope] = q_nope ; q_pe, RoPE on q_pe
    c_kv;k_pe = kv_a_proj_with_mqa(x) -> [kv_lora_rank ; rope]; c_kv = kv_a_layernorm(c_kv), RoPE on k_pe
    naive:    k_nope ; v = kv_b_proj(c_kv) -> [H, nope + v];  k = k_nope ; k_pe (k_pe shared by all heads)
              o = softmax(q·kᵀ · scale) v
    absorbed: W_UK, W_UV = kv_b_proj viewed [H, nope + v, kv_lora_rank]
              q_abs = q_nope W_UK  [H, kv_lora_rank];  score = q_abs·c_kv + q_pe·k_pe
              o = (softmax(score · scale) c_kv) W_UVᵀ
    y = o_proj(o)

The cache holds one row per token: ``[c_kv ; k_pe]`` (normalised latent, post-RoPE rope), quantized by
the layer's KV format. ``forward`` is the plain causal reference (naive form, no cache); ``forward_paged``
appends the step's rows, then runs the absorbed decode kernel (uniform query lengths ≤
``max_decode_query_len``: decode and speculative decode) or the naive prefill kernel over the cached
prefix plus the new tokens (chunked prefill, mixed batches).
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ..cache.batch import PagedBatch
from ..cache.paged import LayerKV
from ..cache.tables import slots_from_block_table
from ..formats import BF16, KVFormat, WeightFormat
from ..kernels.mla_decode import mla_decode
from ..kernels.mla_prefill import mla_prefill
from .linear import QuantLinear
from .norm import RMSNorm
from .rope import RotaryEmbedding

PROJECTIONS = ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


class MLAttention(nn.Module):
    """MLA with explicit dimensions (the config's field names).

    Args:
        hidden_size, num_heads: model width and (per-GPU) heads.
        q_lora_rank: rank of the q latent (1536 Kimi, 2048 GLM); None: a direct ``q_proj``.
        kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim: 512, 128/192, 64, 128/256.
        rope: a shared ``RotaryEmbedding`` over ``qk_rope_head_dim``; None builds one from ``rope_theta``,
            ``rope_scaling`` and ``rope_interleave``.
        softmax_scale: None = ``(nope + rope)^-0.5 · mscale²`` from the rope's YaRN scaling.
        eps: the latent norms' epsilon (1e-6 in the HF code for both models).
        linear_formats: weight format per projection name (default BF16); ``attention_bias``: biases on
            ``q_a_proj`` / ``q_proj``, ``kv_a_proj_with_mqa``, ``o_proj`` (HF; false for Kimi and GLM).
        dtype: compute dtype (bf16 when serving, fp32 for the exact reference mode).
    """

    def __init__(self, hidden_size: int, num_heads: int, q_lora_rank: int | None, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                 rope: RotaryEmbedding | None = None, rope_theta: float = 10000.0, rope_scaling: dict | None = None,
                 rope_interleave: bool = True, softmax_scale: float | None = None, eps: float = 1e-6,
                 linear_formats: Mapping[str, WeightFormat] | None = None, attention_bias: bool = False,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None):
        super().__init__()
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.q_lora_rank, self.kv_lora_rank = q_lora_rank, kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.dtype = dtype
        formats = dict(linear_formats or {})
        unknown = set(formats) - set(PROJECTIONS)
        if unknown:
            raise ValueError(f"linear_formats: unknown projections {sorted(unknown)}; expected {PROJECTIONS}")

        def linear(name: str, n_in: int, n_out: int, bias: bool = False) -> QuantLinear:
            return QuantLinear(n_in, n_out, bias=bias, fmt=formats.get(name, BF16()), dtype=dtype, device=device)

        if q_lora_rank is None:
            self.q_proj = linear("q_proj", hidden_size, num_heads * self.qk_head_dim, attention_bias)
        else:
            self.q_a_proj = linear("q_a_proj", hidden_size, q_lora_rank, attention_bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps, dtype=dtype, device=device)
            self.q_b_proj = linear("q_b_proj", q_lora_rank, num_heads * self.qk_head_dim)
        self.kv_a_proj_with_mqa = linear("kv_a_proj_with_mqa", hidden_size, kv_lora_rank + qk_rope_head_dim,
                                         attention_bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps, dtype=dtype, device=device)
        self.kv_b_proj = linear("kv_b_proj", kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim))
        self.o_proj = linear("o_proj", num_heads * v_head_dim, hidden_size, attention_bias)
        if rope is None:
            rope = RotaryEmbedding.from_config(qk_rope_head_dim, rope_theta, rope_scaling, rope_interleave, device)
        if rope.dim != qk_rope_head_dim:
            raise ValueError(f"rope: rotates {rope.dim} dims, qk_rope_head_dim is {qk_rope_head_dim}")
        self.rotary_emb = rope
        self.softmax_scale = rope.softmax_scale(self.qk_head_dim) if softmax_scale is None else float(softmax_scale)
        self.max_decode_query_len = 8    # uniform query runs up to this length use the absorbed decode kernel
        self.validate_tables = True      # check block tables / lengths in the kernels (one sync per call)
        self.kv_format = KVFormat("bf16")  # the format of the KV rows this layer writes; a plan's KV rules set it
        self._absorbed: tuple[torch.Tensor, torch.Tensor] | None = None
        self._absorbed_key: tuple | None = None
        self._absorbed_src: list[torch.Tensor] = []

    # ------------------------------------------------------------------------------------ projections
    def q_latent(self, x: torch.Tensor) -> torch.Tensor:
        """The normalised q latent ``c_q = q_a_layernorm(q_a_proj(x))``: [..., hidden] -> [..., q_lora_rank]
        (the DSA indexer's ``qr``)."""
        if self.q_lora_rank is None:
            raise ValueError("q_latent: this layer has no q latent (q_lora_rank is None)")
        return self.q_a_layernorm(self.q_a_proj(x))

    def project_q(self, x: torch.Tensor, positions: torch.Tensor,
                  q_latent: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [*P, hidden] with positions [*P] -> (q_nope [*P, H, nope], q_pe [*P, H, rope] after RoPE).
        ``q_latent`` reuses an already computed :meth:`q_latent`."""
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_latent(x) if q_latent is None else q_latent)
        q = q.unflatten(-1, (self.num_heads, self.qk_head_dim))
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        return q_nope, self.rotary_emb(q_pe, positions)

    def project_kv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [*P, hidden] -> (c_kv [*P, kv_lora_rank] normalised, k_pe [*P, rope] after RoPE): what the
        cache stores."""
        kv = self.kv_a_proj_with_mqa(x)
        latent, k_pe = kv.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        return self.kv_a_layernorm(latent), self.rotary_emb(k_pe, positions)

    def expand_kv(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The naive form's up-projection: c_kv [*P, kv_lora_rank] -> (k_nope [*P, H, nope], v [*P, H, v])."""
        kv = self.kv_b_proj(latent).unflatten(-1, (self.num_heads, self.qk_nope_head_dim + self.v_head_dim))
        return kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, kv_lora_rank], W_UV [H, v, kv_lora_rank]) in the compute dtype: ``kv_b_proj``
        dequantized once and cached until its format or tensors change (new tensors, in-place writes)."""
        tensors = list(self.kv_b_proj.tensors.values())
        key = (self.kv_b_proj.fmt, self.dtype, tuple((t.device, t.data_ptr(), t._version) for t in tensors))
        if self._absorbed is None or key != self._absorbed_key:
            w = self.kv_b_proj.weight_dequantized(torch.float32)
            w = w.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
            self._absorbed = (w[:, :self.qk_nope_head_dim].to(self.dtype).contiguous(),
                              w[:, self.qk_nope_head_dim:].to(self.dtype).contiguous())
            self._absorbed_key = key
            # hold the source storages so their addresses cannot be reused by new tensors behind our back
            self._absorbed_src = [t.detach() for t in tensors]
        return self._absorbed

    def absorb_q(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [*P, H, nope] -> q_abs [*P, H, kv_lora_rank] (= q_nope W_UK per head)."""
        w_uk, _ = self.absorbed_weights()
        return torch.einsum("...hd,hdc->...hc", q_nope, w_uk)

    def latent_to_v(self, o_latent: torch.Tensor) -> torch.Tensor:
        """Latent-space attention output [*P, H, kv_lora_rank] -> [*P, H, v] (through W_UV)."""
        _, w_uv = self.absorbed_weights()
        return torch.einsum("...hc,hvc->...hv", o_latent.to(w_uv.dtype), w_uv)

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """o [*P, H, v] -> [*P, hidden] through ``o_proj``."""
        return self.o_proj(o.flatten(-2))

    # ------------------------------------------------------------------------------------ no cache
    def plain_positions(self, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """Checks x [B, T, hidden] and returns positions as [B, T] (default ``arange(T)``)."""
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x: expected [B, T, {self.hidden_size}], got {tuple(x.shape)}")
        bsz, t, _ = x.shape
        if positions is None:
            positions = torch.arange(t, device=x.device)
        return positions.expand(bsz, t) if positions.dim() == 1 else positions

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Plain causal attention from position 0 (naive form, no cache): x [B, T, hidden] -> [B, T, hidden].
        ``positions``: [T] or [B, T] (default ``arange(T)``), used for RoPE only."""
        positions = self.plain_positions(x, positions)
        bsz, t, _ = x.shape
        q_nope, q_pe = self.project_q(x, positions)
        latent, k_pe = self.project_kv(x, positions)
        k_nope, v = self.expand_kv(latent)
        q = torch.cat([q_nope, q_pe], dim=-1).reshape(bsz * t, self.num_heads, self.qk_head_dim)
        k = torch.cat([k_nope, k_pe[..., None, :].expand(*k_nope.shape[:-1], self.qk_rope_head_dim)], dim=-1)
        k = k.reshape(bsz * t, self.num_heads, self.qk_head_dim)
        cu = torch.arange(0, (bsz + 1) * t, t, dtype=torch.int32, device=x.device)
        o, _ = mla_prefill(q, k, v.reshape(bsz * t, self.num_heads, self.v_head_dim), cu, cu, t,
                           self.softmax_scale, causal=True, validate=False)
        return self.output(o.reshape(bsz, t, self.num_heads, self.v_head_dim))

    # ------------------------------------------------------------------------------------ paged cache
    def forward_paged(self, x: torch.Tensor, batch: PagedBatch, kv: LayerKV) -> torch.Tensor:
        """One step over a paged cache: x [T, hidden] (the step's new tokens, request after request) ->
        [T, hidden]. Writes the tokens' rows into ``kv`` at ``batch.slot_mapping`` first."""
        self._check_paged(x, batch, kv)
        q_nope, q_pe = self.project_q(x, batch.positions)
        latent, k_pe = self.project_kv(x, batch.positions)
        kv.append(torch.cat([latent, k_pe], dim=-1), batch.slot_mapping)
        if self.uses_decode_kernel(batch):
            o = self.attend_decode(q_nope, q_pe, batch, kv)
        else:
            o = self.attend_prefill(q_nope, q_pe, batch, kv)
        return self.output(o)

    def uses_decode_kernel(self, batch: PagedBatch) -> bool:
        """Every request adds the same number of tokens (host ints only: T == B · max_query_len), at most
        ``max_decode_query_len``: plain or speculative decode, served by the absorbed kernel."""
        return (1 <= batch.max_query_len <= self.max_decode_query_len
                and batch.num_tokens == batch.batch_size * batch.max_query_len)

    def attend_decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, batch: PagedBatch,
                      kv: LayerKV) -> torch.Tensor:
        """Absorbed attention over the pages: q_nope [T, H, nope], q_pe [T, H, rope] with T = B·S ->
        o [T, H, v]."""
        bsz, s = batch.batch_size, batch.max_query_len
        q = torch.cat([self.absorb_q(q_nope), q_pe.to(self.dtype)], dim=-1)
        q = q.reshape(bsz, s, self.num_heads, self.kv_lora_rank + self.qk_rope_head_dim)
        o_lat, _ = mla_decode(q, kv.data, kv.scales, batch.block_table, batch.seq_lens, self.softmax_scale,
                              kv.kind, kv.d_latent, validate=self.validate_tables)
        return self.latent_to_v(o_lat.reshape(bsz * s, self.num_heads, self.kv_lora_rank))

    def attend_prefill(self, q_nope: torch.Tensor, q_pe: torch.Tensor, batch: PagedBatch,
                       kv: LayerKV) -> torch.Tensor:
        """Naive attention of the new tokens over each request's cached rows (prefix + new, read back
        dequantized from the pages): q_nope [T, H, nope], q_pe [T, H, rope] -> o [T, H, v]."""
        slots, valid = slots_from_block_table(batch.block_table, batch.seq_lens, batch.page_size)
        rows = kv.dequantize(slots[valid])                                     # [T_kv, d] fp32, request order
        latent = rows[:, :self.kv_lora_rank].to(self.dtype)
        k_pe = rows[:, self.kv_lora_rank:].to(self.dtype)
        k_nope, v = self.expand_kv(latent)
        k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, self.num_heads, -1)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        cu_kv = torch.zeros(batch.batch_size + 1, dtype=torch.int32, device=q.device)
        cu_kv[1:] = batch.seq_lens.cumsum(0)
        o, _ = mla_prefill(q, k, v, batch.cu_seqlens_q, cu_kv, batch.max_query_len, self.softmax_scale,
                           causal=True, validate=self.validate_tables)
        return o

    def _check_paged(self, x: torch.Tensor, batch: PagedBatch, kv: LayerKV) -> None:
        if x.dim() != 2 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x: expected [T, {self.hidden_size}], got {tuple(x.shape)}")
        if x.shape[0] != batch.num_tokens:
            raise ValueError(f"x: {x.shape[0]} tokens, batch.positions has {batch.num_tokens}")
        if (kv.d_latent, kv.d_rope) != (self.kv_lora_rank, self.qk_rope_head_dim):
            raise ValueError(f"kv: rows of {kv.d_latent} + {kv.d_rope}, this layer needs "
                             f"{self.kv_lora_rank} + {self.qk_rope_head_dim}")
        if kv.page_size != batch.page_size:
            raise ValueError(f"batch: page_size {batch.page_size} != the cache's {kv.page_size}")

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, q_lora_rank={self.q_lora_rank}, kv_lora_rank={self.kv_lora_rank}, "
                f"qk=({self.qk_nope_head_dim}+{self.qk_rope_head_dim}), v={self.v_head_dim}, "
                f"softmax_scale={self.softmax_scale:.6g}")
