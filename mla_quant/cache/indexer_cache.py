"""Paged storage of DSA indexer keys, beside the MLA latent pages (docs/dsa.md).

Only the layers that run their own lightning indexer have keys (GLM 5.2: the 21 "full" of 78 layers; the
"shared" ones reuse the top-k of the previous full layer). Page ``p`` here is page ``p`` of the
``PagedKVCache``: the same page ids, page size, block tables and ``PagedBatch.slot_mapping`` serve both.

=============  ===============================================  ==========================================
kind           ``k`` (one layer)                                ``scale``
=============  ===============================================  ==========================================
``fp8_e4m3``   e4m3 ``[num_pages, page_size, head_dim]``        fp32 ``[num_pages, page_size]`` (per token)
``bf16``       bf16 ``[num_pages, page_size, head_dim]``        None
``fp32``       fp32 ``[num_pages, page_size, head_dim]``        None (the exact reference mode)
=============  ===============================================  ==========================================

FP8 pages hold keys **rotated** by the orthonormal Hadamard transform (``kernels/hadamard.py``) before
rounding, as DeepSeek does (``IndexerKeys.rotated``); float pages hold the plain post-RoPE keys. Queries are
rotated to match the pages they score against (``H(q)·H(k) = q·k``), so the rule is the cache's, not the
indexer format's, and a prefill in one kind hands off to a decode in another (:meth:`copy_pages_to`).

FP8 is what DeepSeek V3.2 ships (132 bytes per token and layer for head_dim 128): one scale per token,
``scale = max(amax, 1e-4) / 448`` (``ue8m0=True`` rounds it up to a power of two, as DeepSeek's
``scale_fmt="ue8m0"``). vLLM keeps the same bytes interleaved per block (``[page_size · 128]`` e4m3 then
``[page_size]`` fp32); here they are two tensors, so each is a plain strided array for the kernels.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..kernels.hadamard import hadamard_transform
from ..kernels.indexer_k_append import indexer_k_append
from .tables import copy_page_ids, page_ids

INDEXER_K_KINDS = ("fp8_e4m3", "bf16", "fp32")
_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True, eq=False)
class IndexerKeys:
    """One layer's indexer key pages, as the kernels take them (the cache's own tensors)."""

    k: torch.Tensor               # [num_pages, page_size, head_dim]: e4m3 | bf16 | fp32
    scale: torch.Tensor | None    # fp32 [num_pages, page_size] for e4m3, else None
    kind: str
    ue8m0: bool = False

    @property
    def page_size(self) -> int:
        return self.k.shape[1]

    @property
    def head_dim(self) -> int:
        return self.k.shape[2]

    @property
    def num_slots(self) -> int:
        return self.k.shape[0] * self.k.shape[1]

    @property
    def rotated(self) -> bool:
        """True when the pages hold Hadamard-rotated keys (FP8 pages): rotate queries to match."""
        return self.kind == "fp8_e4m3"

    def append(self, k_rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write a step's post-RoPE keys ``[T, head_dim]`` at ``slot_mapping [T]`` (negative = skip):
        rotated and quantized for FP8 pages, cast for float pages."""
        if self.rotated:
            k_rows = hadamard_transform(k_rows)
        indexer_k_append(k_rows, slot_mapping, self.k, self.scale, self.ue8m0)

    def dequantize(self, slots: torch.Tensor) -> torch.Tensor:
        """fp32 keys ``[*slots.shape, head_dim]`` as stored at flat ``slots`` (still rotated for FP8 pages;
        for references and tests)."""
        slots = slots.to(device=self.k.device, dtype=torch.long)
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= self.num_slots):
            raise IndexError(f"slots: outside [0, {self.num_slots})")
        flat = slots.reshape(-1)
        k = self.k.reshape(-1, self.head_dim)[flat].float()
        if self.scale is not None:
            k = k * self.scale.reshape(-1)[flat][:, None]
        return k.reshape(*slots.shape, self.head_dim)


class IndexerKCache:
    """Indexer key pages for the layers ``layers`` (model layer ids, or a count: layers 0 .. n-1).

    ``IndexerKCache.for_indexer_types(config.indexer_types, ...)`` keeps the "full" layers only.
    Storage is uninitialised (``torch.empty``); :meth:`poison_` fills it with NaN for tests.
    """

    def __init__(self, layers: int | Sequence[int], num_pages: int, page_size: int = 64, head_dim: int = 128,
                 kind: str = "fp8_e4m3", device: torch.device | str = "cpu", ue8m0: bool = False):
        ids = list(range(layers)) if isinstance(layers, int) else [int(i) for i in layers]
        if not ids or len(set(ids)) != len(ids) or min(ids) < 0:
            raise ValueError(f"layers: {layers!r} must name at least one distinct non-negative layer id")
        if kind not in INDEXER_K_KINDS:
            raise ValueError(f"kind: {kind!r} not in {INDEXER_K_KINDS}")
        if num_pages < 1:
            raise ValueError(f"num_pages: {num_pages} must be at least 1")
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"page_size: {page_size} must be a positive power of two")
        if head_dim < 16 or head_dim & (head_dim - 1):
            raise ValueError(f"head_dim: {head_dim} must be a power of two ≥ 16")
        self.layer_ids = tuple(ids)
        self.num_pages, self.page_size, self.head_dim, self.kind = num_pages, page_size, head_dim, kind
        self.device = torch.device(device)
        self.ue8m0 = ue8m0
        self._layers = {}
        for i in ids:
            k = torch.empty(num_pages, page_size, head_dim, dtype=_DTYPES[kind], device=self.device)
            scale = (torch.empty(num_pages, page_size, dtype=torch.float32, device=self.device)
                     if kind == "fp8_e4m3" else None)
            self._layers[i] = IndexerKeys(k, scale, kind, ue8m0)

    @classmethod
    def for_indexer_types(cls, indexer_types: Sequence[str], num_pages: int, page_size: int = 64,
                          head_dim: int = 128, kind: str = "fp8_e4m3", device: torch.device | str = "cpu",
                          ue8m0: bool = False) -> "IndexerKCache":
        """Keys for every layer whose type is ``"full"`` (GLM 5.2's ``indexer_types``)."""
        full = [i for i, t in enumerate(indexer_types) if t == "full"]
        return cls(full, num_pages, page_size, head_dim, kind, device, ue8m0)

    # ------------------------------------------------------------------------------------------ views
    def layer(self, layer_id: int) -> IndexerKeys:
        if layer_id not in self._layers:
            raise KeyError(f"layer: {layer_id} has no indexer keys (layers with keys: {list(self.layer_ids)})")
        return self._layers[layer_id]

    def __contains__(self, layer_id: int) -> bool:
        return layer_id in self._layers

    def __len__(self) -> int:
        return len(self.layer_ids)

    def __repr__(self) -> str:
        return (f"IndexerKCache(layers={len(self)}, num_pages={self.num_pages}, page_size={self.page_size}, "
                f"head_dim={self.head_dim}, kind={self.kind!r}, device={self.device})")

    # ------------------------------------------------------------------------------------------ sizes
    def bytes_per_token(self, per_layer: bool = False) -> int:
        """Bytes one token takes in one layer (``per_layer``) or summed over the layers with keys."""
        one = self.head_dim * _DTYPES[self.kind].itemsize + (4 if self.kind == "fp8_e4m3" else 0)
        return one if per_layer else one * len(self)

    def nbytes(self) -> int:
        return sum(lk.k.nbytes + (lk.scale.nbytes if lk.scale is not None else 0) for lk in self._layers.values())

    # ------------------------------------------------------------------------------------------ writes
    def append(self, layer_id: int, k_rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        self.layer(layer_id).append(k_rows, slot_mapping)

    def poison_(self, pages: torch.Tensor | Sequence[int] | None = None) -> "IndexerKCache":
        """Fill pages (all by default) with NaN (all bytes 0xFF), scales too."""
        idx = slice(None) if pages is None else self._pages("pages", pages)
        for lk in self._layers.values():
            lk.k.view(torch.uint8)[idx] = 0xFF
            if lk.scale is not None:
                lk.scale[idx] = float("nan")
        return self

    def _pages(self, name: str, pages) -> torch.Tensor:
        return page_ids(name, pages, self.num_pages).to(self.device)

    def copy_pages_to(self, other: "IndexerKCache", src_pages, dst_pages) -> None:
        """Copy pages ``src_pages`` into pages ``dst_pages`` of ``other`` (this cache or another, possibly of
        another kind or device) in every layer: bytes when the kinds match, else dequantize and re-append.
        Call it wherever the latent pages are copied (copy-on-write, prefill→decode hand-off)."""
        if (other.layer_ids, other.page_size, other.head_dim) != (self.layer_ids, self.page_size, self.head_dim):
            raise ValueError(f"other: {other!r} has another geometry than {self!r}")
        src, dst = copy_page_ids(src_pages, dst_pages, self.num_pages, other.num_pages, other is self)
        src, dst = src.to(self.device), dst.to(other.device)
        if src.numel() == 0:
            return
        offs = torch.arange(self.page_size, device=self.device)
        for i in self.layer_ids:
            a, b = self.layer(i), other.layer(i)
            if (a.kind, a.ue8m0) == (b.kind, b.ue8m0):
                b.k[dst] = a.k[src].to(b.k.device)
                if a.scale is not None:
                    b.scale[dst] = a.scale[src].to(b.scale.device)
                continue
            rows = a.dequantize((src[:, None] * self.page_size + offs).reshape(-1))
            if a.rotated:  # the normalised Hadamard transform is its own inverse
                rows = hadamard_transform(rows)
            dst_slots = (dst[:, None] * self.page_size + offs.to(dst.device)).reshape(-1)
            b.append(rows.to(b.k.device), dst_slots)

    def copy_pages(self, src_pages, dst_pages) -> None:
        self.copy_pages_to(self, src_pages, dst_pages)
