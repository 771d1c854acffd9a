"""Per-layer error of a quantized model against a reference on the same inputs, through forward hooks, and
logits through the paged cache (where KV formats act)."""
from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from .metrics import sqnr_db

LAYER = r"model\.layers\.(\d+)"
CAPTURE = {"hidden": LAYER + "$", "attn": LAYER + r"\.self_attn$"}   # what -> module name regex


def _first(out) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


@contextmanager
def capture(model: nn.Module, pattern: str) -> Iterator[dict[str, torch.Tensor]]:
    """Record the output (the first element of a tuple output) of every module whose name fully matches
    ``pattern``, detached in fp32, while the context is open: ``{name: tensor}`` (the last call's)."""
    rx = re.compile(pattern)
    outputs: dict[str, torch.Tensor] = {}
    handles = []
    for name, module in model.named_modules():
        if rx.fullmatch(name):
            def hook(_m, _inp, out, name=name):
                outputs[name] = _first(out).detach().float()
            handles.append(module.register_forward_hook(hook))
    if not handles:
        raise ValueError(f"pattern: no module of {type(model).__name__} matches {pattern!r}")
    try:
        yield outputs
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def layer_errors(reference: nn.Module, model: nn.Module, input_ids: torch.Tensor,
                 what: Sequence[str] = ("attn", "hidden")) -> list[dict]:
    """SQNR (dB) of each decoder layer's attention output (``"attn"``) and output hidden state
    (``"hidden"``) of ``model`` against ``reference``, both run plainly on ``input_ids`` [B, T].
    Returns ``[{"layer": i, "attn_sqnr_db": ..., "hidden_sqnr_db": ...}, ...]``."""
    unknown = set(what) - set(CAPTURE)
    if unknown:
        raise ValueError(f"what: unknown {sorted(unknown)}; expected some of {sorted(CAPTURE)}")
    rows: dict[int, dict] = {}
    for key in what:
        with capture(reference, CAPTURE[key]) as ref_out:
            reference(input_ids)
        with capture(model, CAPTURE[key]) as out:
            model(input_ids)
        for name, ref in ref_out.items():
            if name not in out:
                raise ValueError(f"model: has no module {name!r} (the reference has)")
            i = int(re.match(LAYER, name).group(1))
            rows.setdefault(i, {"layer": i})[f"{key}_sqnr_db"] = sqnr_db(ref, out[name])
    return [rows[i] for i in sorted(rows)]


@torch.no_grad()
def run_paged(model: nn.Module, input_ids: torch.Tensor, kv_format="bf16", page_size: int = 16,
              chunk: int | None = None, decode_from: int | None = None, keep_from: int = 0,
              tensor_scales: float | Sequence[float] | None = None):
    """:func:`paged_logits` that also returns the filled ``ModelCache`` and the ``PageAllocator`` (requests
    ``0 .. B-1``), e.g. to read the cached rows back."""
    from ..cache import NoopTagTracker, PageAllocator

    if input_ids.dim() != 2 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids: expected [B, T] with T >= 1, got {tuple(input_ids.shape)}")
    b, t = input_ids.shape
    decode_from = t if decode_from is None else decode_from
    if not 1 <= decode_from <= t:
        raise ValueError(f"decode_from: {decode_from} outside [1, {t}]")
    if not 0 <= keep_from < t:
        raise ValueError(f"keep_from: {keep_from} outside [0, {t})")
    chunk = decode_from if chunk is None else chunk
    if chunk < 1:
        raise ValueError(f"chunk: {chunk} must be >= 1")
    cache = model.allocate_cache(b * -(-t // page_size), page_size, kv_format, tensor_scales=tensor_scales)
    alloc = PageAllocator(cache=cache, tracker=NoopTagTracker())
    for r in range(b):
        alloc.add_request(r)
    ids = input_ids.to(cache.device)
    out = torch.empty(b, t - keep_from, model.config.vocab_size, dtype=torch.float32, device=cache.device)
    pos = 0
    while pos < t:
        n = min(chunk, decode_from - pos) if pos < decode_from else 1
        batch = alloc.plan(list(range(b)), n)
        lo = max(pos, keep_from)
        if lo < pos + n:    # only the rows kept: the LM head runs on those alone
            rows = torch.arange(b, device=cache.device)[:, None] * n + torch.arange(lo - pos, n, device=cache.device)
            logits = model(ids[:, pos:pos + n].reshape(-1), batch=batch, cache=cache, logits_index=rows.reshape(-1))
            out[:, lo - keep_from:pos + n - keep_from] = logits.float().view(b, pos + n - lo, -1)
        else:
            model(ids[:, pos:pos + n].reshape(-1), batch=batch, cache=cache, logits_index=batch.cu_seqlens_q[1:] - 1)
        pos += n
    return out, cache, alloc


def paged_logits(model: nn.Module, input_ids: torch.Tensor, kv_format="bf16", page_size: int = 16,
                 chunk: int | None = None, decode_from: int | None = None, keep_from: int = 0,
                 tensor_scales: float | Sequence[float] | None = None) -> torch.Tensor:
    """Logits of ``input_ids`` [B, T] run through the paged cache in ``kv_format`` (one, or one per layer;
    ``tensor_scales`` for per-tensor FP8), so KV quantization acts as when serving: positions
    ``[0, decode_from)`` as a prefill in chunks of ``chunk`` tokens (default: one chunk), the rest one token
    per step through the decode path (teacher forcing). Returns [B, T - keep_from, vocab] fp32: the positions
    from ``keep_from`` on (the LM head runs on those only — long contexts)."""
    return run_paged(model, input_ids, kv_format, page_size, chunk, decode_from, keep_from, tensor_scales)[0]


@torch.no_grad()
def calibrate_kv_scales(model: nn.Module, input_ids: torch.Tensor, page_size: int = 16,
                        margin: float = 1.0) -> list[float]:
    """Per-layer scales for per-tensor FP8 KV (``KVFormat("fp8_e4m3", "tensor")``): ``margin · amax / 448``
    of each layer's cached rows over ``input_ids`` [B, T] (run with BF16 pages)."""
    _, cache, alloc = run_paged(model, input_ids, "bf16", page_size, keep_from=input_ids.shape[1] - 1)
    table, seq_lens = alloc.block_table(list(range(input_ids.shape[0])), cache.device)
    return [margin * float(cache.kv.layer(i).gather(table, seq_lens).abs().amax()) / 448.0
            for i in range(len(cache.kv))]


__all__ = ["capture", "layer_errors", "paged_logits", "run_paged", "calibrate_kv_scales"]
