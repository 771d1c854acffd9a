"""Paged storage of MLA latents: per layer, pages of ``page_size`` token rows in a KV format.

One page id names the same page in every layer (the allocator hands out ids for all layers at once). A row is
``[latent (kv_lora_rank) ; rope (rope_dim)]``, laid out as ``mla_quant.kernels.kv_layout`` says:

===================  ==========================================  ==================================
format               ``data``                                    ``scales``
===================  ==========================================  ==================================
``bf16``             bf16 ``[num_pages, page_size, 576]``         None
``fp8_e4m3``/token   e4m3 ``[num_pages, page_size, 576]``         fp32 ``[num_pages, page_size]``
``fp8_e4m3``/tensor  e4m3 ``[num_pages, page_size, 576]``         fp32 ``[1]`` (fixed per layer)
``fp8_ds_mla``       uint8 ``[num_pages, page_size, 656]``        None (inside each 656-byte row)
===================  ==========================================  ==================================

(576 = 512 + 64 and 656 for the real models; both follow ``kv_lora_rank`` and ``rope_dim``.)
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..formats import KVFormat
from ..kernels.kv_append import kv_append
from ..kernels.kv_layout import dequantize_kv_rows, kv_data_dtype, kv_row_width
from ._rows import to_device
from .tables import copy_page_ids, page_ids

MAX_PAGE_SIZE = 256


@dataclass(frozen=True, eq=False)
class LayerKV:
    """One layer's pages, as the attention kernels take them (a view: the tensors are the cache's own)."""

    data: torch.Tensor             # [num_pages, page_size, width]: bf16 | e4m3 | uint8 (fp8_ds_mla bytes)
    scales: torch.Tensor | None    # fp32 [num_pages, page_size] (per token) | [1] (per tensor) | None
    kind: str                      # "bf16" | "fp8_e4m3" | "fp8_ds_mla"
    scale_mode: str | None         # "token" | "tensor" for fp8_e4m3, None otherwise
    d_latent: int                  # kv_lora_rank (512)
    d_rope: int                    # qk_rope_head_dim (64)
    page_size: int

    @property
    def num_pages(self) -> int:
        return self.data.shape[0]

    @property
    def num_slots(self) -> int:
        return self.data.shape[0] * self.data.shape[1]

    @property
    def width(self) -> int:
        return self.data.shape[-1]

    @property
    def fmt(self) -> KVFormat:
        return KVFormat(self.kind, self.scale_mode or "token")

    def append(self, rows: torch.Tensor, slot_mapping: torch.Tensor, check_slots: bool | None = None) -> None:
        """Write ``rows [T, d_latent + d_rope]`` at ``slot_mapping [T]`` (negative = skip), quantizing."""
        if rows.dim() != 2 or rows.shape[-1] != self.d_latent + self.d_rope:
            raise ValueError(f"rows: shape {tuple(rows.shape)}, expected [T, {self.d_latent + self.d_rope}]")
        kv_append(rows, slot_mapping, self.data, self.scales, self.kind, self.scale_mode or "token",
                  self.d_latent, check_slots=check_slots)

    def dequantize(self, slots: torch.Tensor) -> torch.Tensor:
        """fp32 rows ``[*slots.shape, d_latent + d_rope]`` stored at flat ``slots`` (page · page_size + offset)."""
        slots = slots.to(device=self.data.device, dtype=torch.long)
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= self.num_slots):
            raise IndexError(f"slots: outside [0, {self.num_slots}) for {self.num_pages} pages of {self.page_size}")
        flat = slots.reshape(-1)
        data = self.data.view(-1, self.width)[flat]
        scales = self.scales
        if self.scale_mode == "token":
            scales = scales.view(-1)[flat]
        rows = dequantize_kv_rows(data, scales, self.kind, self.d_latent, self.d_rope)
        return rows.reshape(*slots.shape, self.d_latent + self.d_rope)

    def gather(self, block_table: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """Contiguous fp32 copy ``[B, max(seq_lens), d]`` of each request's rows, zero past its length
        (for references and tests: reads only the slots below each length)."""
        from .tables import slots_from_block_table

        slots, valid = slots_from_block_table(block_table, seq_lens, self.page_size)
        out = self.dequantize(torch.where(valid, slots, torch.zeros_like(slots)))
        return out.masked_fill(~valid[..., None], 0.0)


def _parse_formats(kv_format, num_layers: int) -> tuple[KVFormat, ...]:
    if isinstance(kv_format, (str, KVFormat)):
        return (KVFormat.parse(kv_format),) * num_layers
    formats = tuple(KVFormat.parse(f) for f in kv_format)
    if len(formats) != num_layers:
        raise ValueError(f"kv_format: {len(formats)} formats for {num_layers} layers")
    return formats


def _parse_tensor_scales(tensor_scales, num_layers: int) -> list[float]:
    if tensor_scales is None:
        return [1.0] * num_layers
    if isinstance(tensor_scales, (int, float)):
        return [float(tensor_scales)] * num_layers
    values = [float(s) for s in tensor_scales]
    if len(values) != num_layers:
        raise ValueError(f"tensor_scales: {len(values)} scales for {num_layers} layers")
    return values


def check_page_size(page_size: int) -> None:
    if not (isinstance(page_size, int) and 1 <= page_size <= MAX_PAGE_SIZE and page_size & (page_size - 1) == 0):
        raise ValueError(f"page_size: {page_size!r} must be a power of two from 1 to {MAX_PAGE_SIZE}")


class PagedKVCache:
    """Per-layer paged latent storage. Layers may use different ``KVFormat``s.

    Args:
        num_layers, num_pages: pages are shared by all layers (page ``p`` exists in each layer).
        page_size: tokens per page, a power of two from 1 to 256 (default 64, as FlashMLA).
        kv_lora_rank, rope_dim: the row is ``[latent ; rope]`` (512 + 64 for Kimi K2.6 / GLM 5.2).
        kv_format: one format for all layers (``"bf16"``, ``"fp8_e4m3"``, ``"fp8_ds_mla"`` or a
            ``KVFormat``) or one per layer.
        tensor_scales: the fixed scales of per-tensor ``fp8_e4m3`` layers (a float, or one per layer;
            ``real = q · scale``, values past ``448 · scale`` saturate). None means 1.0. Ignored elsewhere.
    Storage is uninitialised (``torch.empty``); slots that were never written hold garbage that correct
    readers never read (:meth:`poison_` fills them with NaN for tests).
    """

    def __init__(self, num_layers: int, num_pages: int, page_size: int = 64, kv_lora_rank: int = 512,
                 rope_dim: int = 64, kv_format: str | KVFormat | Sequence[str | KVFormat] = "bf16",
                 device: torch.device | str = "cpu", tensor_scales: float | Sequence[float] | None = None):
        if num_layers < 1:
            raise ValueError(f"num_layers: {num_layers} must be at least 1")
        if num_pages < 1:
            raise ValueError(f"num_pages: {num_pages} must be at least 1")
        check_page_size(page_size)
        if kv_lora_rank < 1 or rope_dim < 1:
            raise ValueError(f"kv_lora_rank {kv_lora_rank} and rope_dim {rope_dim} must be positive")
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.kv_lora_rank, self.rope_dim = kv_lora_rank, rope_dim
        self.device = torch.device(device)
        self.formats = _parse_formats(kv_format, num_layers)
        scales = _parse_tensor_scales(tensor_scales, num_layers)
        self.tensor_scales = tuple(scales)   # host copies of the per-tensor scales (fixed for the cache's life)
        layers = []
        for fmt, tensor_scale in zip(self.formats, scales):
            width = kv_row_width(fmt.kind, kv_lora_rank, rope_dim)
            data = torch.empty(num_pages, page_size, width, dtype=kv_data_dtype(fmt.kind), device=self.device)
            scale_mode, s = None, None
            if fmt.kind == "fp8_e4m3":
                scale_mode = fmt.scale
                if scale_mode == "token":
                    s = torch.empty(num_pages, page_size, dtype=torch.float32, device=self.device)
                else:
                    if not tensor_scale > 0:
                        raise ValueError(f"tensor_scales: {tensor_scale} must be positive")
                    s = torch.full((1,), tensor_scale, dtype=torch.float32, device=self.device)
            layers.append(LayerKV(data, s, fmt.kind, scale_mode, kv_lora_rank, rope_dim, page_size))
        self.layers: tuple[LayerKV, ...] = tuple(layers)

    # ------------------------------------------------------------------------------------------ views
    def layer(self, i: int) -> LayerKV:
        if not -self.num_layers <= i < self.num_layers:
            raise IndexError(f"layer: {i} out of range for {self.num_layers} layers")
        return self.layers[i]

    def __len__(self) -> int:
        return self.num_layers

    def __repr__(self) -> str:
        kinds = sorted({f"{f.kind}/{f.scale}" if f.kind == "fp8_e4m3" else f.kind for f in self.formats})
        return (f"PagedKVCache(num_layers={self.num_layers}, num_pages={self.num_pages}, page_size={self.page_size}, "
                f"kv_lora_rank={self.kv_lora_rank}, rope_dim={self.rope_dim}, formats={kinds}, device={self.device})")

    # ------------------------------------------------------------------------------------------ sizes
    def bytes_per_token(self, layer: int | None = None) -> int:
        """Bytes one token takes in one layer (``layer``) or summed over all layers (None)."""
        fmts = self.formats if layer is None else (self.formats[layer],)
        return sum(f.bytes_per_token(self.kv_lora_rank, self.rope_dim) for f in fmts)

    def bytes_per_page(self, layer: int | None = None) -> int:
        return self.page_size * self.bytes_per_token(layer)

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def nbytes(self) -> int:
        """Bytes held by the pages of all layers (per-tensor scales included)."""
        return sum(lk.data.nbytes + (lk.scales.nbytes if lk.scales is not None else 0) for lk in self.layers)

    # ------------------------------------------------------------------------------------------ writes
    def append(self, layer: int, rows: torch.Tensor, slot_mapping: torch.Tensor,
               check_slots: bool | None = None) -> None:
        """Write a step's new rows ``[T, kv_lora_rank + rope_dim]`` of ``layer`` at ``slot_mapping [T]``."""
        self.layer(layer).append(rows, slot_mapping, check_slots=check_slots)

    def poison_(self, pages: torch.Tensor | Sequence[int] | None = None) -> "PagedKVCache":
        """Fill pages (all by default) with NaN in every format (all bytes 0xFF: NaN in bf16, e4m3 and fp32);
        per-token scales too. Per-tensor scales are kept."""
        idx = slice(None) if pages is None else self._pages("pages", pages)
        for lk in self.layers:
            lk.data.view(torch.uint8)[idx] = 0xFF
            if lk.scale_mode == "token":
                lk.scales[idx] = float("nan")
        return self

    # ------------------------------------------------------------------------------------------ reads
    def read(self, layer: int, pages: torch.Tensor | Sequence[int], num_tokens: int) -> torch.Tensor:
        """fp32 rows ``[num_tokens, kv_lora_rank + rope_dim]`` of one request whose pages are ``pages``
        (in order), dequantized: for tests and hand-off checks."""
        pages = self._pages("pages", pages)
        if not 0 <= num_tokens <= pages.numel() * self.page_size:
            raise ValueError(f"num_tokens: {num_tokens} does not fit in {pages.numel()} pages of {self.page_size}")
        pos = torch.arange(num_tokens)
        slots = pages[pos // self.page_size] * self.page_size + pos % self.page_size
        return self.layer(layer).dequantize(slots)

    # ------------------------------------------------------------------------------------------ copies
    def _pages(self, name: str, pages) -> torch.Tensor:
        return page_ids(name, pages, self.num_pages)

    def compatible(self, other: "PagedKVCache") -> bool:
        return (self.num_layers, self.page_size, self.kv_lora_rank, self.rope_dim) == \
            (other.num_layers, other.page_size, other.kv_lora_rank, other.rope_dim)

    def copy_pages_to(self, other: "PagedKVCache", src_pages, dst_pages) -> None:
        """Copy pages ``src_pages`` of this cache into pages ``dst_pages`` of ``other`` (which may be this
        cache, another device, or another format), in every layer.

        Same format (and, per tensor, the same scale): the bytes are copied (exact). Otherwise each row is
        dequantized to fp32 and re-quantized by ``kv_append`` into the other layer's format — the BF16→FP8
        prefill→decode hand-off gives the very bytes a direct FP8 append of the same rows would. Whole pages
        are copied, including slots past a request's length (garbage there stays unread).
        """
        if not self.compatible(other):
            raise ValueError(f"other: {other!r} has another geometry than {self!r}")
        src, dst = copy_page_ids(src_pages, dst_pages, self.num_pages, other.num_pages, other is self)
        if src.numel() == 0:
            return
        dst_slots = (dst[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)
        src, dst, dst_slots = to_device(src, self.device), to_device(dst, other.device), \
            to_device(dst_slots, other.device)
        for i, (a, b) in enumerate(zip(self.layers, other.layers)):
            same = (a.kind, a.scale_mode) == (b.kind, b.scale_mode) and (
                a.scale_mode != "tensor" or self.tensor_scales[i] == other.tensor_scales[i])
            if same:
                b.data[dst] = a.data[src].to(b.data.device)
                if a.scale_mode == "token":
                    b.scales[dst] = a.scales[src].to(b.scales.device)
                continue
            rows = dequantize_kv_rows(a.data[src], a.scales[src] if a.scale_mode == "token" else a.scales,
                                      a.kind, a.d_latent, a.d_rope)          # [n, page_size, d] fp32
            b.append(rows.reshape(-1, rows.shape[-1]).to(b.data.device), dst_slots, check_slots=False)

    def copy_pages(self, src_pages, dst_pages) -> None:
        """Copy pages within this cache, in every layer (copy-on-write of a shared partial page)."""
        self.copy_pages_to(self, src_pages, dst_pages)

    def convert(self, kv_format, tensor_scales: float | Sequence[float] | None = None,
                device: torch.device | str | None = None) -> "PagedKVCache":
        """A new cache of the same geometry in ``kv_format`` holding every page of this one, converted."""
        out = PagedKVCache(self.num_layers, self.num_pages, self.page_size, self.kv_lora_rank, self.rope_dim,
                           kv_format, self.device if device is None else device, tensor_scales)
        all_pages = torch.arange(self.num_pages)
        self.copy_pages_to(out, all_pages, all_pages)
        return out
