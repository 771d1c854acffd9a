"""The DSA lightning indexer (DeepSeek V3.2, GLM 5.x): which ``topk`` cached tokens each query attends to.

Math (``reference/model_specs.md`` §5.2; the Hugging Face ``GlmMoeDsaIndexer`` / ``DeepseekV32Indexer``):

    q      = wq_b(q_latent)                       [.., H, D]   (q_latent: MLA's normalised q latent)
    k      = k_norm(wk(x))                        [.., D]      (x: the layer input; LayerNorm with bias)
    q, k  <- RoPE on the FIRST rope_dim dims (interleaved pairs for GLM, half-split for DeepSeek V3.2)
    w      = weights_proj(x) · H^-0.5             [.., H]      (fp32, as HF keeps it)
    I[t,s] = Σ_h w[t,h] · ReLU(q[t,h] · k[s] · D^-0.5)        s ≤ t (causal), -inf after
    top-k  = the min(topk, context) largest I[t, ·]

Precision is a format (``fmt``): ``"bf16"`` computes the scores in fp32 from q and k in the module dtype (the
reference implementations); ``"fp8"`` rotates q and k by an orthonormal Hadamard transform (q·k unchanged,
outliers spread) and rounds both to e4m3 with one scale per head vector / per token, as DeepSeek ships it.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ..cache.batch import PagedBatch
from ..cache.indexer_cache import IndexerKeys
from ..formats import BF16, WeightFormat
from ..kernels.fp8_quant import act_quant_fp8
from ..kernels.hadamard import hadamard_transform
from ..kernels.indexer_k_append import quantize_indexer_keys_reference
from ..kernels.indexer_scores import indexer_topk, req_ids_from_cu_seqlens, topk_work_buffer
from .linear import QuantLinear
from .rope import RotaryEmbedding, apply_rotary

INDEXER_FORMATS = ("bf16", "fp8")
HF_MASK = torch.finfo(torch.float32).min  # the reference's additive mask value above the diagonal
SCORE_BYTES_BUDGET = 1 << 30  # fp32 scores held at once in the paged path (queries are chunked to fit)



def _qk(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q [B, S, H, D] · k [B, T, D] -> [B, S, H, T], as one batched GEMM per sequence. (``torch.matmul`` of q
    against k [B, 1, D, T], broadcast over S, copies k once per query row when B > 1: 256 GiB at two 16k
    sequences.)"""
    b, s, h, d = q.shape
    return torch.bmm(q.reshape(b, s * h, d), k.transpose(-1, -2)).view(b, s, h, -1)

class LightningIndexer(nn.Module):
    """DSA indexer with the checkpoint's names: ``wq_b``, ``wk``, ``k_norm`` (weight, bias), ``weights_proj``.

    Args:
        hidden_size, q_lora_rank: model dims (x and the q latent).
        n_heads, head_dim, rope_dim, topk: ``index_n_heads`` (32 for GLM 5.2), ``index_head_dim`` (128),
            ``qk_rope_head_dim`` (64, the first dims of each head), ``index_topk`` (2048).
        rope: the model's ``RotaryEmbedding`` (its frequencies are shared); None builds one from
            ``rope_theta`` / ``rope_scaling``. ``rope_interleave`` is the indexer's own convention
            (``indexer_rope_interleave``: True for GLM 5.x, False for DeepSeek V3.2).
        fmt: ``"bf16"`` (full precision) or ``"fp8"`` (Hadamard + e4m3 q and k); ``ue8m0``: power-of-two
            FP8 scales for q (and k in the plain forward; paged keys follow their cache's own flag).
        linear_formats: weight formats of the projections by child name (``wq_b``, ``wk``, ``weights_proj``);
            default BF16. ``weights_proj`` is held in fp32 (HF ``_keep_in_fp32_modules``).
    """

    def __init__(self, hidden_size: int, q_lora_rank: int, n_heads: int = 32, head_dim: int = 128,
                 rope_dim: int = 64, topk: int = 2048, rope: RotaryEmbedding | None = None,
                 rope_interleave: bool = True, rope_theta: float = 10000.0, rope_scaling: dict | None = None,
                 fmt: str = "bf16", ue8m0: bool = False, eps: float = 1e-6, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str | None = None,
                 linear_formats: Mapping[str, WeightFormat] | None = None):
        super().__init__()
        if not 0 < rope_dim <= head_dim or rope_dim % 2:
            raise ValueError(f"rope_dim: {rope_dim} must be even and within head_dim {head_dim}")
        if head_dim & (head_dim - 1):
            raise ValueError(f"head_dim: {head_dim} must be a power of two (Hadamard transform, kernels)")
        if topk < 1 or n_heads < 1:
            raise ValueError(f"topk {topk} and n_heads {n_heads} must be positive")
        self.hidden_size, self.q_lora_rank = hidden_size, q_lora_rank
        self.n_heads, self.head_dim, self.rope_dim, self.topk = n_heads, head_dim, rope_dim, topk
        self.rope_interleave, self.ue8m0, self.dtype = rope_interleave, ue8m0, dtype
        self.softmax_scale = head_dim ** -0.5
        self.fmt = self._check_fmt(fmt)
        formats = dict(linear_formats or {})
        unknown = set(formats) - {"wq_b", "wk", "weights_proj"}
        if unknown:
            raise ValueError(f"linear_formats: unknown projections {sorted(unknown)}")
        self.wq_b = QuantLinear(q_lora_rank, n_heads * head_dim, fmt=formats.get("wq_b", BF16()), dtype=dtype,
                                device=device)
        self.wk = QuantLinear(hidden_size, head_dim, fmt=formats.get("wk", BF16()), dtype=dtype, device=device)
        self.k_norm = nn.LayerNorm(head_dim, eps=eps, dtype=dtype, device=device)
        self.weights_proj = QuantLinear(hidden_size, n_heads, fmt=formats.get("weights_proj", BF16()),
                                        dtype=torch.float32, device=device)
        if rope is None:
            rope = RotaryEmbedding(rope_dim, rope_theta, rope_scaling, interleaved=rope_interleave, device=device)
        elif rope.dim != rope_dim:
            raise ValueError(f"rope: rotates {rope.dim} dims, the indexer's rope part has {rope_dim}")
        self.rope = rope
        self._topk_work: torch.Tensor | None = None   # the fused top-k's kept work buffer (indexer_topk)

    def _work_buffer(self, device: torch.device) -> torch.Tensor:
        """The fused top-k's work buffer on ``device``, kept across calls: every call leaves it zero, so no
        memset per step (a call that raised drops it, see forward_paged)."""
        if self._topk_work is None or self._topk_work.device != device:
            self._topk_work = topk_work_buffer(device)
        return self._topk_work

    @staticmethod
    def _check_fmt(fmt: str) -> str:
        if fmt not in INDEXER_FORMATS:
            raise ValueError(f"fmt: {fmt!r} not in {INDEXER_FORMATS}")
        return fmt

    def convert_format_(self, fmt: str) -> "LightningIndexer":
        """Switch the score precision (``"bf16"`` / ``"fp8"``); the weights are untouched. Returns self."""
        self.fmt = self._check_fmt(fmt)
        return self

    def extra_repr(self) -> str:
        return (f"n_heads={self.n_heads}, head_dim={self.head_dim}, rope_dim={self.rope_dim}, topk={self.topk}, "
                f"rope_interleave={self.rope_interleave}, fmt={self.fmt!r}")

    # ------------------------------------------------------------------------------------- projections
    def _rope_first(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rope_dim
        return torch.cat((apply_rotary(x[..., :r], cos, sin, self.rope_interleave), x[..., r:]), dim=-1)

    def project_k(self, x: torch.Tensor, positions: torch.Tensor,
                  cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The key: x [*P, hidden], positions [*P] -> k [*P, D] = RoPE(k_norm(wk(x))) in x's dtype."""
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"x: {x.shape[-1]} features, expected {self.hidden_size}")
        if tuple(positions.shape) != tuple(x.shape[:-1]):
            raise ValueError(f"positions: shape {tuple(positions.shape)} must match x {tuple(x.shape)} without "
                             f"its last dimension")
        cos, sin = self.rope.cos_sin(positions) if cos_sin is None else cos_sin
        k = self.wk(x)
        k = F.layer_norm(k.float(), (self.head_dim,), self.k_norm.weight.float(), self.k_norm.bias.float(),
                         self.k_norm.eps).to(k.dtype)
        return self._rope_first(k, cos, sin)

    def project(self, x: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [*P, hidden], q_latent [*P, q_lora_rank], positions int [*P] ->
        (q [*P, H, D], k [*P, D], w [*P, H] fp32 = weights_proj(x) · H^-0.5), q and k after RoPE in x's
        dtype (the module dtype)."""
        if q_latent.shape[-1] != self.q_lora_rank or tuple(q_latent.shape[:-1]) != tuple(x.shape[:-1]):
            raise ValueError(f"q_latent: shape {tuple(q_latent.shape)}, expected {(*x.shape[:-1], self.q_lora_rank)}")
        cos, sin = self.rope.cos_sin(positions)                                   # [*P, rope_dim / 2]
        k = self.project_k(x, positions, (cos, sin))
        q = self.wq_b(q_latent).unflatten(-1, (self.n_heads, self.head_dim))
        q = self._rope_first(q, cos.unsqueeze(-2), sin.unsqueeze(-2))
        w = self.weights_proj(x.float()).float() * self.n_heads ** -0.5
        return q, k, w

    # ------------------------------------------------------------------------- plain causal (no cache)
    def scores(self, x: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Index scores of a plain causal forward: x [B, S, hidden], q_latent [B, S, q_lora_rank]
        -> fp32 [B, S, S] with -inf above the diagonal (query t sees keys 0 .. t)."""
        index = self._masked_scores(x, q_latent, positions)
        return index.masked_fill(index <= HF_MASK / 2, float("-inf"))

    def _masked_scores(self, x: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """Scores [B, S, S] plus the reference's additive causal mask (0, or fp32's lowest value above the
        diagonal). The full-precision format repeats the Hugging Face computation op for op — the rope
        halves in its half-split order, ReLU(q·k · D^-0.5), the weighted head sum, the mask added — so that
        the top-k breaks exact ties (ReLU zeros) as it does."""
        b, s = x.shape[:2]
        if positions is None:
            positions = torch.arange(s, device=x.device).expand(b, s)
        q, k, w = self.project(x, q_latent, positions)
        if self.fmt == "bf16":
            q, k = self._half_split_order(q), self._half_split_order(k)
            logits = torch.relu(_qk(q.float(), k.float()) * self.softmax_scale)
            index = torch.matmul(w.unsqueeze(-2), logits).squeeze(-2)             # [B, S, S]
        else:
            q8, qs, k8, ks = self.quantize_qk(q, k)
            logits = torch.relu(_qk(q8.float(), k8.float()))
            wq = w * qs * self.softmax_scale                                      # [B, S, H]
            index = torch.matmul(wq.unsqueeze(-2), logits).squeeze(-2) * ks.unsqueeze(-2)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        return index + torch.where(causal, 0.0, HF_MASK)

    def _half_split_order(self, x: torch.Tensor) -> torch.Tensor:
        """Interleaved rope pairs (x0, x1), (x2, x3) .. reordered to (x0, x2, .., x1, x3, ..) — HF's layout
        after its interleaved rotation; q·k is unchanged, only the summation order follows HF."""
        if not self.rope_interleave:
            return x
        r = x[..., :self.rope_dim]
        return torch.cat((r[..., 0::2], r[..., 1::2], x[..., self.rope_dim:]), dim=-1)

    def quantize_qk(self, q: torch.Tensor, k: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """FP8 mode: Hadamard-rotate, then e4m3 with one scale per head vector (q) / per token (k).
        Returns (q8 [.., H, D], q_scale [.., H], k8 [.., D], k_scale [..])."""
        q8, qs = act_quant_fp8(hadamard_transform(q).contiguous(), self.head_dim, self.ue8m0)
        kr = hadamard_transform(k)
        k8, ks = quantize_indexer_keys_reference(kr.reshape(-1, self.head_dim), self.ue8m0)
        return q8, qs.squeeze(-1), k8.reshape(kr.shape), ks.reshape(kr.shape[:-1])

    @torch.no_grad()
    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Top-k of a plain causal forward: int32 [B, S, min(topk, S)] key positions per query, -1 where a
        query has fewer than topk visible keys (compare as sets). Selected as the reference does (a sorted
        ``topk`` over the masked scores), so exact ties resolve alike. No gradients (as the reference);
        :meth:`scores` is differentiable."""
        index = self._masked_scores(x, q_latent, positions)
        values, idx = index.topk(min(self.topk, index.shape[-1]), dim=-1)
        return torch.where(values <= HF_MASK / 2, -1, idx).to(torch.int32)

    # ------------------------------------------------------------------------------------ paged cache
    @torch.no_grad()
    def append_keys(self, x: torch.Tensor, batch: PagedBatch, keys: IndexerKeys) -> None:
        """Write the step's keys only (x [T, hidden]): for steps that need no selection (every visible token
        is selected when the block table holds at most ``topk`` tokens)."""
        self._check_keys(keys, batch)
        keys.append(self.project_k(x, batch.positions), batch.slot_mapping)

    def _check_keys(self, keys: IndexerKeys, batch: PagedBatch) -> None:
        if keys.head_dim != self.head_dim or keys.page_size != batch.page_size:
            raise ValueError(f"keys: head_dim {keys.head_dim} / page_size {keys.page_size}, expected "
                             f"{self.head_dim} / {batch.page_size}")

    @torch.no_grad()
    def forward_paged(self, x: torch.Tensor, q_latent: torch.Tensor, batch: PagedBatch, keys: IndexerKeys,
                      req_ids: torch.Tensor | None = None, validate: bool = False) -> torch.Tensor:
        """One step over a paged cache: write this step's keys, score every query token against its visible
        cached keys, select. x [T, hidden], q_latent [T, q_lora_rank] (tokens flattened over requests, as in
        ``batch``) -> int32 [T, min(topk, max_ctx)] logical key positions (-1 unused), with
        ``max_ctx = block_table.shape[1] · page_size``. ``validate``: check the tables on CUDA too (a sync)."""
        if x.dim() != 2:
            raise ValueError(f"x: expected [T, hidden] (tokens flattened over the batch), got {tuple(x.shape)}")
        self._check_keys(keys, batch)
        t = x.shape[0]
        if req_ids is None:
            req_ids = req_ids_from_cu_seqlens(batch.cu_seqlens_q, t)
        q, k, w = self.project(x, q_latent, batch.positions)
        keys.append(k, batch.slot_mapping)        # FP8 pages rotate and quantize the keys themselves
        w = w * self.softmax_scale
        if keys.rotated:
            q = hadamard_transform(q).to(q.dtype)
        if self.fmt == "fp8":
            q, qs = act_quant_fp8(q.float().contiguous(), self.head_dim, self.ue8m0)
            w = w * qs.squeeze(-1)
        max_ctx = batch.block_table.shape[1] * batch.page_size
        chunk = max(1, SCORE_BYTES_BUDGET // (4 * max_ctx))
        out, work = [], self._work_buffer(x.device)
        try:
            for s in range(0, t, chunk):
                part = slice(s, min(t, s + chunk))
                out.append(indexer_topk(q[part], w[part], keys.k, keys.scale, batch.block_table, req_ids[part],
                                        batch.positions[part], self.topk, max_ctx, validate=validate, work=work))
        except Exception:
            self._topk_work = None   # a select that stopped midway may have left counts in it
            raise
        if not out:
            return torch.empty((0, min(self.topk, max_ctx)), dtype=torch.int32, device=x.device)
        return out[0] if len(out) == 1 else torch.cat(out)
