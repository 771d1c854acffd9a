"""Fidelity of every format on the model that ``mla_quant.eval.train`` trained, on held-out stdlib text.

    python -m mla_quant.eval.fidelity_run --checkpoint RUN/model --qat-checkpoint RUN/model_qat \\
        --contexts 1024 2048 4096 --out RUN/fidelity
    python -m mla_quant.eval.fidelity_run --smoke --out /tmp/fid            # CPU, seconds

For each context length L, ``--batch`` windows of L bytes of the *validation* files (the training split's
held-out files, ``eval.train.load_corpus``) run through the fp32 reference (plain forward: the checkpoint's
weights in fp32, no KV rounding) and through each variant:

* KV variants (``kv ...``): the reference's weights through the paged cache in that KV format
  (``paged_logits``): the first ``L - eval_tokens`` positions as a chunked prefill (``--chunk``, so later
  chunks attend to the quantized pages of earlier ones), the last ``eval_tokens`` decoded one byte per step
  (teacher forcing). Per-tensor FP8 uses per-layer scales calibrated (``calibrate_kv_scales``) on other
  validation windows.
* Weight variants: INT4 routed experts by round-to-nearest (``quantize_``), by the MSE clipping search
  (``mla_quant.convert``, ``method="mse"``), by GPTQ (``gptq.gptq_``, layer by layer, on ``--calib-windows``
  windows of ``--calib-context`` bytes of the *training* split; also in activation order),
  by QAT (``--qat-checkpoint``, exported by ``eval.train``); FP8 128×128 block weights with 1×128 FP8 activations
  (W8A8) on every linear layer but ``lm_head``. Plain forward (no KV rounding): the weight format alone.

A DSA model (GLM 5.2-shaped, ``eval.train --arch glm``) has two references: **dense** (every visible
token attended: ``sparse.dense_attention``) and **sparse** (the checkpoint as served: each query attends to
the ``index_topk`` tokens its full-precision indexer selects). Its variants: ``indexer bf16 sparse`` (the
sparse reference itself, against the dense one: what the selection costs), ``indexer fp8 sparse`` (the
FP8 indexer — Hadamard-rotated e4m3 q and k — against the sparse reference, and against the dense one; plus
the overlap of its top-k with the full-precision indexer's, per full layer), and the KV and weight formats
against the sparse reference. ``--max-tokens`` caps the windows per context (batch · L), so long contexts
(16k, 32k) run one window; the plain forwards' attention runs in query chunks there
(``sparse.chunked_prefill``).

Per (variant, L): KL(reference ‖ variant) and top-1 agreement over the decoded tail and over all positions,
the variant's and the reference's next-byte cross-entropy on the tail (nats/byte), KL against position
(bins of ``--bin`` positions), and per-layer SQNR of the hidden states (weight variants, first context).
Writes ``fidelity.json`` and ``fidelity.md`` under ``--out`` after every context (a time-out keeps what
finished), and ``fidelity.png`` (matplotlib, when installed).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import tempfile
import time
import traceback
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..formats import FP8Block, Int4Group, KVFormat
from ..formats.plan import QuantPlan, quantize_
from .layers import calibrate_kv_scales, capture, layer_errors, paged_logits
from .metrics import error_by_position, kl_divergence, top1_agreement
from .sparse import SELECTION, chunked_prefill, dense_attention, is_dsa, selection_overlap
from .table import EXPERTS

KV_VARIANTS = {
    "kv bf16": KVFormat("bf16"),
    "kv fp8_e4m3 per-token": KVFormat("fp8_e4m3"),
    "kv fp8_e4m3 per-tensor": KVFormat("fp8_e4m3", "tensor"),
    "kv fp8_ds_mla": KVFormat("fp8_ds_mla"),
}
WEIGHT_VARIANTS = ("experts int4 rtn", "experts int4 mse", "experts int4 gptq", "experts int4 gptq act-order",
                   "experts int4 gptq all-experts", "experts int4 qat", "weights fp8 block w8a8")
INDEXER_VARIANTS = ("indexer bf16 sparse", "indexer fp8 sparse")   # DSA models only
# a DSA model's default rows, run in this order (under a time budget the last ones may not run)
DSA_DEFAULT = INDEXER_VARIANTS + ("experts int4 rtn", "weights fp8 block w8a8", "kv fp8_ds_mla",
                                  "kv fp8_e4m3 per-token", "kv bf16")
ALL_VARIANTS = list(INDEXER_VARIANTS) + list(KV_VARIANTS) + list(WEIGHT_VARIANTS)   # the tables' row order


def _load(path, device: torch.device) -> nn.Module:
    from ..models import from_pretrained

    return from_pretrained(path, dtype=torch.float32, device=device).eval()


def weight_variant(name: str, reference: nn.Module, args, device: torch.device,
                   calib: torch.Tensor | None = None) -> nn.Module | None:
    """The model of one weight variant (None: not available, e.g. no QAT checkpoint). ``calib``: ids [B, L] of
    training text, the GPTQ variant's calibration windows."""
    if name == "experts int4 rtn":
        return quantize_(copy.deepcopy(reference), QuantPlan({EXPERTS: Int4Group(32)})).eval()
    if name == "weights fp8 block w8a8":   # a DSA indexer (its precision, its projections) stays as it is
        plan = QuantPlan({"lm_head": None, r"re:.*indexer(\..*)?": None, "_default": FP8Block()})
        return quantize_(copy.deepcopy(reference), plan).eval()
    if name == "experts int4 mse":
        from ..convert import convert_checkpoint
        from ..models import save_pretrained

        with tempfile.TemporaryDirectory() as tmp:
            save_pretrained(reference, f"{tmp}/src")
            convert_checkpoint(f"{tmp}/src", f"{tmp}/dst", None, method="mse", device=device, progress=False)
            return _load(f"{tmp}/dst", device)
    if name.startswith("experts int4 gptq"):   # layer by layer on training text (gptq.gptq_), a window per forward
        from ..gptq import gptq_

        model = copy.deepcopy(reference)
        gptq_(model, calib.split(1), act_order=name.endswith("act-order"), all_experts=name.endswith("all-experts"))
        return model.eval()
    if name == "experts int4 qat":
        return _load(args.qat_checkpoint, device) if args.qat_checkpoint else None
    if name == "indexer fp8 sparse":
        return quantize_(copy.deepcopy(reference), QuantPlan({r"re:.*indexer$": FP8Block()})).eval()
    if name == "indexer bf16 sparse":
        return reference     # the sparse reference itself (compared with the dense one)
    raise ValueError(f"variants: unknown {name!r}")


def run_variant(name: str, reference: nn.Module, model: nn.Module | None, ids: torch.Tensor, args,
                scales: list[float] | None) -> torch.Tensor:
    """Logits [B, L, V] of one variant on ids [B, L]: KV formats through the paged cache (prefill, then the
    last ``eval_tokens`` decoded one per step), weight formats by the plain forward of their model."""
    if name in KV_VARIANTS:
        fmt = KV_VARIANTS[name]
        return paged_logits(reference, ids, fmt, args.page_size, chunk=args.chunk,
                            decode_from=ids.shape[1] - args.eval_tokens,
                            tensor_scales=scales if fmt.scale == "tensor" else None)
    with torch.no_grad():
        return model(ids).float()


def _nll(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Mean next-byte cross-entropy: logits [B, T, V] predict targets [B, T]."""
    return float(F.cross_entropy(logits.double().reshape(-1, logits.shape[-1]), targets.reshape(-1)))


def score(name: str, ref: torch.Tensor, q: torch.Tensor, ids: torch.Tensor, eval_tokens: int, bin_size: int) -> dict:
    """One row: ref, q [B, L, V] logits of ids [B, L]; the tail is the last ``eval_tokens`` positions (the last
    position has no next byte in the window, so the cross-entropy uses the tail minus it)."""
    length = ids.shape[1]
    tail = slice(length - eval_tokens, length)
    nxt = slice(length - eval_tokens, length - 1)
    return {"variant": name, "context": length, "positions": ids.shape[0] * eval_tokens,
            "kl": float(kl_divergence(ref[:, tail], q[:, tail])), "top1": float(top1_agreement(ref[:, tail], q[:, tail])),
            "nll": _nll(q[:, nxt], ids[:, nxt.start + 1:]), "nll_ref": _nll(ref[:, nxt], ids[:, nxt.start + 1:]),
            "kl_all": float(kl_divergence(ref, q)), "top1_all": float(top1_agreement(ref, q)),
            "by_position": error_by_position(ref, q, bins=max(1, length // bin_size))}


def markdown(result: dict) -> str:
    """The table of docs/fidelity.md from the JSON result."""
    s = result["setting"]
    lines = [f"Model: `{s['checkpoint']}` ({s.get('parameters', '?')} parameters; {s.get('trained', '')}). "
             f"Text: up to {s['batch']} windows per context (column 'windows') of the held-out files ({s['data']}). "
             f"KL and top-1 over the last {s['eval_tokens']} positions of each context (decoded one byte per "
             f"step for KV formats), all positions too; NLL: next-byte cross-entropy on the tail "
             f"(reference {'/'.join(f'{r:.3f}' for r in s.get('nll_ref', []))} by context). Device: {s['device']}.",
             "", "| variant | against | context | windows | KL tail (nats) | top-1 tail | NLL tail (nats/byte) | "
             "KL all | top-1 all |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    rows = sorted(result["rows"], key=lambda r: (ALL_VARIANTS.index(r["variant"]) if r["variant"] in ALL_VARIANTS
                                                 else len(ALL_VARIANTS), r["context"]))
    for r in rows:
        lines.append(f"| {r['variant']} | {r.get('reference', 'fp32')} | {r['context']} | "
                     f"{r.get('windows', s['batch'])} | {r['kl']:.3g} | {100 * r['top1']:.2f}% | {r['nll']:.4f} | "
                     f"{r['kl_all']:.3g} | {100 * r['top1_all']:.2f}% |")
    if s.get("nll_ref_by_context"):
        lines += ["", "Reference NLL tail (nats/byte) by context: " + "; ".join(
            f"{c}: " + ", ".join(f"{k} {v:.4f}" for k, v in d.items()) for c, d in s["nll_ref_by_context"].items())]
    extra = [r for r in rows if "vs_dense" in r]
    if extra:
        n = max(len(r.get("selection_overlap", [])) for r in extra)
        lines += ["", "FP8 indexer against the **dense** reference, and the overlap of its top-k with the "
                  "full-precision indexer's (per full layer: the fraction of its selected keys that the "
                  "full-precision indexer selects too, mean over queries):", "",
                  "| variant | context | KL tail vs dense | top-1 tail vs dense | KL all vs dense | "
                  + " | ".join(f"overlap layer {i}" for i, _ in (extra[0].get("selection_overlap") or [])) + " |",
                  "|---|---:|---:|---:|---:|" + "---:|" * n]
        for r in extra:
            d = r["vs_dense"]
            overlap = [f"{100 * o:.2f}%" for _, o in r.get("selection_overlap", [])]
            lines.append(f"| {r['variant']} | {r['context']} | {d['kl']:.3g} | {100 * d['top1']:.2f}% | "
                         f"{d['kl_all']:.3g} | " + " | ".join(overlap) + " |")
    layered = [r for r in result["rows"] if r.get("layers")]
    if layered:
        n = len(layered[0]["layers"])
        lines += ["", f"Per-layer SQNR (dB) of the hidden states, context {layered[0]['context']}:", "",
                  "| variant | " + " | ".join(f"layer {i}" for i in range(n)) + " |", "|---|" + "---:|" * n]
        lines += [f"| {r['variant']} | " + " | ".join(f"{x['hidden_sqnr_db']:.1f}" for x in r["layers"]) + " |"
                  for r in layered]
    if result.get("skipped"):
        lines += ["", "Not run: " + "; ".join(result["skipped"])]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> Path | None:
    """KL (tail) against context per variant, and KL against position at the longest context."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = result["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    longest = max(r["context"] for r in rows)
    for name in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == name]
        against = mine[0].get("reference", "fp32")
        label = name if against == "fp32" else f"{name} vs {against}"
        axes[0].plot([r["context"] for r in mine], [max(r["kl"], 1e-9) for r in mine], marker="o", label=label)
        last = [r for r in mine if r["context"] == longest]
        if last:
            pos = last[0]["by_position"]
            axes[1].plot([(a + b - 1) / 2 for a, b, _, _ in pos], [max(kl, 1e-9) for _, _, kl, _ in pos], label=label)
    axes[0].set(xscale="log", yscale="log", xlabel="context (bytes)", ylabel="KL tail (nats)",
                title="KL against context")
    axes[1].set(yscale="log", xlabel="position", ylabel="KL (nats)", title=f"KL against position, context {longest}")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mla_quant.eval.fidelity_run", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", help="eval.train's model/ (default with --smoke: a random smoke-size model)")
    p.add_argument("--qat-checkpoint", help="eval.train's model_qat/ (INT4 experts by QAT)")
    p.add_argument("--out", required=True)
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--eval-tokens", type=int, default=128, help="tail positions decoded one per step")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--variants", nargs="+", choices=ALL_VARIANTS,
                   help="default: every KV and weight variant; on a DSA model " + ", ".join(DSA_DEFAULT))
    p.add_argument("--kv-contexts", type=int, nargs="+", help="contexts of the KV variants (default: --contexts)")
    p.add_argument("--max-tokens", type=int, default=1 << 62,
                   help="windows per context: min(--batch, max-tokens // L), at least 1 (long contexts)")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (later chunks read quantized pages)")
    p.add_argument("--bin", type=int, default=128, help="positions per bin of the KL-against-position curve")
    p.add_argument("--calib-windows", type=int, default=16, help="GPTQ: calibration windows of training text")
    p.add_argument("--calib-context", type=int, default=1024, help="GPTQ: bytes per calibration window")
    p.add_argument("--time-budget", type=float, default=float("inf"), help="start no new context after this (s)")
    p.add_argument("--val-every", type=int, default=20, help="as eval.train (the same held-out files)")
    p.add_argument("--max-files", type=int)
    p.add_argument("--stdlib")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--smoke", action="store_true", help="tiny contexts on the CPU (a test runs it)")
    args = p.parse_args(argv)
    if args.smoke:
        args.contexts = [c for c in args.contexts if c <= 96] or [48, 96]
        args.kv_contexts = [c for c in (args.kv_contexts or args.contexts) if c <= 96] or None
        args.eval_tokens, args.batch, args.page_size, args.chunk, args.bin = 8, 1, 16, 32, 16
        args.calib_windows, args.calib_context = 2, 64
        args.max_files, args.val_every, args.device = args.max_files or 60, min(args.val_every, 5), "cpu"
    return args


def references(reference: nn.Module, ids: torch.Tensor, dsa: bool) -> dict:
    """The reference logits of ids [B, L]: ``"exact"`` (the plain fp32 forward; for a DSA model the sparse
    one, with each full layer's top-k in ``"selection"``) and, for a DSA model, ``"dense"``."""
    out = {"ids": ids}
    if not dsa:
        out["exact"], _ = forward_windows(reference, ids)
        return out
    out["exact"], out["selection"] = forward_windows(reference, ids, record=True)
    with dense_attention(reference):
        out["dense"], _ = forward_windows(reference, ids)
    return out


@torch.no_grad()
def forward_windows(model: nn.Module, ids: torch.Tensor, record: bool = False) -> tuple[torch.Tensor, dict]:
    """fp32 logits [B, L, vocab] of ids [B, L], one window at a time, and with ``record`` each full layer's top-k
    (``SELECTION``) stacked over the windows. One at a time bounds the peak memory of the pure-torch references
    to one window's (the indexer's fp32 [L, H, L] scores: 17 GB at 32k with 4 heads); the logits are a batched
    forward's. (A batched forward once needed 256 GiB at two 16k windows: the indexer's q·k broadcast k per
    query row, since ``indexer._qk``.)"""
    logits, picks = [], {}
    for window in ids.split(1):
        with capture(model, SELECTION) if record else nullcontext({}) as sel:
            logits.append(model(window).float())
        for layer, top in sel.items():
            picks.setdefault(layer, []).append(top)
    return torch.cat(logits), {layer: torch.cat(tops) for layer, tops in picks.items()}


def run_job(name: str, reference: nn.Module, model: nn.Module | None, refs: dict, args, scales, dsa: bool) -> dict:
    """One (variant, context) row against its reference (module docstring)."""
    ids = refs["ids"]
    against = "sparse" if dsa else "fp32"
    selection = None
    if name == "indexer bf16 sparse":
        q, ref, against = refs["exact"], refs["dense"], "dense"
    elif name in KV_VARIANTS:
        q, ref = run_variant(name, reference, None, ids, args, scales), refs["exact"]
    else:
        q, selection = forward_windows(model, ids, record=name in INDEXER_VARIANTS)
        ref = refs["exact"]
    row = score(name, ref, q.to(ref.device), ids, args.eval_tokens, args.bin)
    row.update(reference=against, windows=ids.shape[0])
    if name == "indexer fp8 sparse":
        dense = score(name, refs["dense"], q.to(ref.device), ids, args.eval_tokens, args.bin)
        row["vs_dense"] = {k: dense[k] for k in ("kl", "top1", "kl_all", "top1_all", "nll")}
        row["vs_dense"]["by_position"] = dense["by_position"]
        row["selection_overlap"] = [(int(k.split(".")[2]), selection_overlap(refs["selection"][k], v))
                                    for k, v in sorted(selection.items(), key=lambda kv: int(kv[0].split(".")[2]))
                                    if k in refs["selection"]]
    return row


def main(argv=None) -> int:
    from .train import build_model, load_corpus, windows

    args = parse_args(argv)
    t0 = time.time()
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.checkpoint:
        reference = _load(args.checkpoint, device)
    elif args.smoke:
        reference = build_model("smoke", args.seed, device).eval()
    else:
        raise ValueError("--checkpoint: required (eval.train's model/ folder) unless --smoke")
    dsa = is_dsa(reference)
    variants = args.variants or (list(DSA_DEFAULT) if dsa else list(KV_VARIANTS) + list(WEIGHT_VARIANTS))
    if not dsa and set(variants) & set(INDEXER_VARIANTS):
        raise ValueError(f"--variants: {sorted(set(variants) & set(INDEXER_VARIANTS))} need a DSA model (GLM 5.2)")
    corpus = load_corpus(args.stdlib, args.val_every, args.max_files)
    val = corpus.val
    kv_contexts = args.kv_contexts or args.contexts
    for length in sorted(set(args.contexts) | set(kv_contexts)):
        if length <= args.eval_tokens:
            raise ValueError(f"--contexts: {length} must exceed --eval-tokens {args.eval_tokens}")
    trained = ""
    info = Path(args.checkpoint).parent / "train.json" if args.checkpoint else None
    if info is not None and info.is_file():
        t = json.loads(info.read_text())
        trained = (f"trained {t['train']['steps']} steps, {t['train']['tokens'] / 1e6:.3g} M bytes at context "
                   f"{t['args']['context']}, validation loss {t.get('val_loss_saved', math.nan):.3f} nats/byte "
                   f"(unigram {t['unigram_val_loss']:.3f})")
    setting = {"checkpoint": args.checkpoint or "random smoke model", "trained": trained,
               "parameters": sum(p.numel() for p in reference.parameters()), "batch": args.batch,
               "max_tokens": args.max_tokens, "eval_tokens": args.eval_tokens, "page_size": args.page_size,
               "chunk": args.chunk, "bin": args.bin,
               "data": f"{corpus.info['val_files']} files of {corpus.info['root']}, {corpus.info['val_bytes']} "
                       f"bytes, Python {corpus.info['python']}", "device": torch.cuda.get_device_name(device)
               if device.type == "cuda" else "cpu", "nll_ref": [], "nll_ref_by_context": {}}
    if dsa:
        c = reference.config
        setting["dsa"] = {"index_topk": c.index_topk, "index_n_heads": c.index_n_heads,
                          "index_head_dim": c.index_head_dim, "indexer_types": list(c.indexer_types)}
    result = {"setting": setting, "rows": [], "skipped": [], "timings_s": {}}

    def save() -> None:
        (out / "fidelity.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / "fidelity.md").write_text(markdown(result))

    gen = torch.Generator().manual_seed(args.seed)
    scales = None
    print(f"[fidelity] {setting['parameters'] / 1e6:.1f} M parameters on {setting['device']}"
          f"{' (DSA, top-k %d)' % reference.config.index_topk if dsa else ''}, contexts {args.contexts}, "
          f"{len(variants)} variants ({time.time() - t0:.0f}s)", flush=True)
    with chunked_prefill():
        if "kv fp8_e4m3 per-tensor" in variants:
            calib = windows(val, args.batch, max(kv_contexts), gen).to(device)
            scales = calibrate_kv_scales(reference, calib, args.page_size)
            setting["kv_tensor_scales"] = scales
            print(f"[fidelity] per-tensor KV scales calibrated ({time.time() - t0:.0f}s)", flush=True)
        models: dict[str, nn.Module | None] = {}
        for name in variants:
            if name in KV_VARIANTS:
                continue
            t = time.time()
            calib = None
            if name.startswith("experts int4 gptq"):   # training text, its own generator (later windows unchanged)
                calib = windows(corpus.train, args.calib_windows, args.calib_context,
                                torch.Generator().manual_seed(args.seed + 1)).to(device)
                setting["gptq_calibration"] = f"{args.calib_windows} training windows of {args.calib_context} bytes"
            try:
                models[name] = weight_variant(name, reference, args, device, calib)
            except Exception as e:   # one failing format must not lose the others' rows (one-shot GPU runs)
                traceback.print_exc()
                models[name] = None
                result["skipped"].append(f"{name} (build failed: {type(e).__name__}: {e})")
            result["timings_s"][f"build {name}"] = time.time() - t
            if models[name] is None and name == "experts int4 qat" and not args.qat_checkpoint:
                result["skipped"].append(f"{name} (no --qat-checkpoint)")
        print(f"[fidelity] variants built ({time.time() - t0:.0f}s)", flush=True)
        # Plain variants first over every context (the indexer's rows first), then the slower paged KV ones.
        ordered = [v for v in variants if v not in KV_VARIANTS] + [v for v in variants if v in KV_VARIANTS]
        jobs = [(v, c) for v in ordered for c in (kv_contexts if v in KV_VARIANTS else args.contexts)]
        refs: dict[int, dict] = {}
        for ji, (name, length) in enumerate(jobs):
            if time.time() - t0 > args.time_budget:
                result["skipped"].append("; ".join(f"{v} at {c}" for v, c in jobs[ji:])
                                         + f" (time budget {args.time_budget:.0f}s)")
                break
            if name not in KV_VARIANTS and models.get(name) is None:
                continue
            t = time.time()
            try:
                if length not in refs:
                    batch = max(1, min(args.batch, args.max_tokens // length))
                    refs[length] = references(reference, windows(val, batch, length, gen).to(device), dsa)
                    r = refs[length]
                    tail = slice(length - args.eval_tokens, length - 1)
                    nll = {k: _nll(r[k][:, tail], r["ids"][:, tail.start + 1:]) for k in ("exact", "dense") if k in r}
                    setting["nll_ref"].append(nll["exact"])
                    setting["nll_ref_by_context"][str(length)] = nll
                    result["timings_s"][f"references {length}"] = time.time() - t
                    print(f"[fidelity] context {length}: {batch} windows, reference logits, NLL tail "
                          f"{nll} ({time.time() - t0:.0f}s)", flush=True)
                row = run_job(name, reference, models.get(name), refs[length], args, scales, dsa)
                if length == args.contexts[0] and name in models and name not in INDEXER_VARIANTS:
                    row["layers"] = layer_errors(reference, models[name], refs[length]["ids"][:1], what=("hidden",))
            except Exception as e:   # recorded in the output; the other jobs still run
                traceback.print_exc()
                result["skipped"].append(f"{name} at {length} ({type(e).__name__}: {e})")
                continue
            row["seconds"] = time.time() - t
            result["rows"].append(row)
            print(f"| {name} | vs {row['reference']} | {length} | KL {row['kl']:.3g} | top-1 {100 * row['top1']:.2f}% "
                  f"| KL all {row['kl_all']:.3g} | NLL {row['nll']:.4f} (ref {row['nll_ref']:.4f}) | "
                  f"{time.time() - t0:.0f}s", flush=True)
            if "selection_overlap" in row:
                print(f"    vs dense: KL {row['vs_dense']['kl']:.3g}, top-1 {100 * row['vs_dense']['top1']:.2f}%; "
                      f"top-k overlap {[(i, round(o, 4)) for i, o in row['selection_overlap']]}", flush=True)
            save()
    result["timings_s"]["total"] = time.time() - t0
    save()
    png = plot(result, out / "fidelity.png") if result["rows"] else None
    print(f"wrote {out / 'fidelity.md'}, {out / 'fidelity.json'}" + (f", {png}" if png else " (no matplotlib: no plot)"),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
