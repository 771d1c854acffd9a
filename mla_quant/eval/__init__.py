"""Fidelity: KL divergence and top-1 agreement of next-token distributions, error against position, per-layer
SQNR, and reports (docs/fidelity.md)."""
from .layers import calibrate_kv_scales, capture, layer_errors, paged_logits, run_paged
from .metrics import error_by_position, kl_divergence, sqnr_db, top1_agreement
from .report import FidelityReport, compare

__all__ = ["kl_divergence", "top1_agreement", "sqnr_db", "error_by_position", "capture", "layer_errors",
           "paged_logits", "run_paged", "calibrate_kv_scales", "FidelityReport", "compare"]
