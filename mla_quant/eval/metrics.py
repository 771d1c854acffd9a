"""Distances between a reference's and a quantized model's outputs (docs/fidelity.md).

All metrics compute in fp64 from logits (log-softmax, no probabilities underflowing to 0), on any device.
``p`` is the reference, ``q`` the model under test; the vocabulary is the last dimension.
"""
from __future__ import annotations

import math

import torch


def _check_pair(p_logits: torch.Tensor, q_logits: torch.Tensor) -> None:
    if p_logits.shape != q_logits.shape:
        raise ValueError(f"q_logits: shape {tuple(q_logits.shape)} != p_logits {tuple(p_logits.shape)}")
    if p_logits.dim() < 1 or p_logits.shape[-1] < 1:
        raise ValueError(f"p_logits: expected [..., V] with V >= 1, got {tuple(p_logits.shape)}")


def _reduce(x: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return x
    if reduction == "mean":
        return x.mean()
    raise ValueError(f"reduction: {reduction!r} must be 'mean' or 'none'")


def kl_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """KL(P ‖ Q) = Σ_v P(v) (log P(v) − log Q(v)) in nats, per position, for P = softmax(p_logits) (the
    reference) and Q = softmax(q_logits). [..., V] -> [...] (``"none"``) or their mean (``"mean"``), fp64.
    Tokens the reference gives probability 0 (logit -inf) contribute 0."""
    _check_pair(p_logits, q_logits)
    log_p = torch.log_softmax(p_logits.double(), dim=-1)
    log_q = torch.log_softmax(q_logits.double(), dim=-1)
    terms = torch.where(log_p.isneginf(), torch.zeros_like(log_p), log_p.exp() * (log_p - log_q))
    return _reduce(terms.sum(-1), reduction)


def top1_agreement(p_logits: torch.Tensor, q_logits: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Whether the argmax tokens agree, per position: [..., V] -> bool [...] (``"none"``) or the fraction
    (``"mean"``, fp64)."""
    _check_pair(p_logits, q_logits)
    same = p_logits.argmax(-1) == q_logits.argmax(-1)
    return same if reduction == "none" else _reduce(same.double(), reduction)


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio 10·log10(Σ ref² / Σ (ref − approx)²) in dB (inf when equal)."""
    if reference.shape != approx.shape:
        raise ValueError(f"approx: shape {tuple(approx.shape)} != reference {tuple(reference.shape)}")
    ref = reference.detach().double()
    noise = float(((ref - approx.detach().double()) ** 2).sum())
    signal = float((ref ** 2).sum())
    if noise == 0:
        return math.inf
    return 10 * math.log10(signal / noise) if signal > 0 else -math.inf


def error_by_position(p_logits: torch.Tensor, q_logits: torch.Tensor, bins: int | None = None
                      ) -> list[tuple[int, int, float, float]]:
    """KL and top-1 agreement against token position, to see error accumulate along the context.

    p_logits, q_logits: [B, T, V] (or [T, V]). Returns ``(start, stop, mean KL, top-1 fraction)`` per
    position range, averaged over the batch: one range per position, or ``bins`` equal ranges."""
    if p_logits.dim() == 2:
        p_logits, q_logits = p_logits[None], q_logits[None]
    _check_pair(p_logits, q_logits)
    if p_logits.dim() != 3:
        raise ValueError(f"p_logits: expected [B, T, V] or [T, V], got {tuple(p_logits.shape)}")
    t = p_logits.shape[1]
    kl = kl_divergence(p_logits, q_logits, "none").mean(0)                  # [T]
    top1 = top1_agreement(p_logits, q_logits, "none").double().mean(0)      # [T]
    n = t if bins is None else max(1, min(int(bins), t))
    edges = [round(i * t / n) for i in range(n + 1)]
    return [(a, b, float(kl[a:b].mean()), float(top1[a:b].mean())) for a, b in zip(edges[:-1], edges[1:]) if b > a]


__all__ = ["kl_divergence", "top1_agreement", "sqnr_db", "error_by_position"]
