"""A fidelity report of one model (or recipe) against a reference: KL, top-1, error against position and per
layer, as text, a dict, or plots (matplotlib, imported only when plotting)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from .layers import layer_errors, paged_logits
from .metrics import error_by_position, kl_divergence, top1_agreement


@dataclass
class FidelityReport:
    """``kl``: mean KL(reference ‖ model) in nats per position; ``top1``: agreement fraction; ``positions``:
    how many positions; ``by_position``: ``(start, stop, kl, top1)`` ranges; ``layers``: per-layer SQNR rows
    (``layer_errors``)."""

    name: str
    kl: float
    top1: float
    positions: int
    by_position: list[tuple[int, int, float, float]] = field(default_factory=list)
    layers: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def format(self) -> str:
        lines = [f"{self.name}: KL {self.kl:.3g} nats, top-1 {100 * self.top1:.1f}% over {self.positions} positions"]
        if self.by_position:
            lines.append("  positions        KL        top-1")
            lines += [f"  {a:>6}-{b - 1:<6} {kl:9.3g}  {100 * t:6.1f}%" for a, b, kl, t in self.by_position]
        if self.layers:
            keys = [k for k in self.layers[0] if k != "layer"]
            lines.append("  layer  " + "  ".join(f"{k:>16}" for k in keys))
            lines += ["  " + f"{row['layer']:>5}  " + "  ".join(f"{row.get(k, math.nan):16.1f}" for k in keys)
                      for row in self.layers]
        return "\n".join(lines)

    def plot(self, path: str) -> str:
        """Save KL against position and per-layer SQNR as one figure (needs matplotlib). Returns ``path``."""
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:   # an optional dependency
            raise ImportError("FidelityReport.plot needs matplotlib (pip install matplotlib)") from e
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
        if self.by_position:
            mid = [(a + b - 1) / 2 for a, b, _, _ in self.by_position]
            axes[0].plot(mid, [kl for *_, kl, _ in self.by_position], marker="o")
        axes[0].set(xlabel="token position", ylabel="KL (nats)", title=f"{self.name}: KL against position")
        for key in ([k for k in self.layers[0] if k != "layer"] if self.layers else []):
            axes[1].plot([r["layer"] for r in self.layers], [r[key] for r in self.layers], marker="o", label=key)
        axes[1].set(xlabel="layer", ylabel="SQNR (dB)", title="per-layer error")
        if self.layers:
            axes[1].legend()
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        return path


@torch.no_grad()
def compare(reference: nn.Module, model: nn.Module, input_ids: torch.Tensor, name: str = "model",
            kv_format=None, page_size: int = 16, decode_from: int | None = None, bins: int | None = 8,
            layers: bool = True) -> FidelityReport:
    """Run ``reference`` (plain forward) and ``model`` on ``input_ids`` [B, T] and report how far apart their
    next-token distributions are. ``kv_format`` runs ``model`` through the paged cache in that format
    (``paged_logits``; ``decode_from`` switches to one-token decode steps from there) so that KV
    quantization counts; None runs it plainly. ``layers``: add per-layer SQNR (plain forwards)."""
    p = reference(input_ids).float()
    if kv_format is None:
        q = model(input_ids).float()
    else:
        q = paged_logits(model, input_ids, kv_format, page_size, decode_from=decode_from).to(p.device)
    rows = layer_errors(reference, model, input_ids) if layers else []
    return FidelityReport(name, float(kl_divergence(p, q)), float(top1_agreement(p, q)), p.shape[0] * p.shape[1],
                          error_by_position(p, q, bins), rows)


__all__ = ["FidelityReport", "compare"]
