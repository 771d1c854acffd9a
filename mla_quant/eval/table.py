"""The fidelity table of docs/fidelity.md: KL and top-1 of each format against the fp32 model, by context.

    python -m mla_quant.eval.table --checkpoint PATH --contexts 1024 4096 16384 --json out.json

For each variant and context length L, a batch of token sequences of length L (from ``--tokens``, a
``torch.save``d 1-D int tensor of real text, or random ids) is run through the fp32 reference (plain forward)
and through the variant; the last ``--eval-tokens`` positions are compared. KV variants prefill
``L - eval_tokens`` tokens into pages of their format, then decode the rest one token per step (teacher
forcing) — the error that accumulates over a long context shows up here. Weight and indexer variants change
only that format (fp32 compute otherwise) and run the plain forward. Without ``--checkpoint``, a tiny random
Kimi K2.6-shaped model, or GLM 5.2-shaped with ``--arch glm`` (a smoke run: random weights say little about
real fidelity). ``fidelity_run`` is the full pipeline on a trained model (dense and sparse references of a
DSA model, top-k overlap, KL against position).
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
from collections.abc import Callable

import torch

from ..formats import FP8Block, Int4Group, KVFormat
from ..formats.plan import QuantPlan, quantize_
from .layers import calibrate_kv_scales, paged_logits
from .metrics import kl_divergence, top1_agreement

EXPERTS = r"re:.*mlp\.experts"


def _kv(kind: str, scale: str = "token"):
    fmt = KVFormat(kind, scale)

    def run(ctx: dict, ids: torch.Tensor, keep_from: int) -> torch.Tensor:
        scales = calibrate_kv_scales(ctx["reference"], ids, ctx["page_size"]) if scale == "tensor" else None
        return paged_logits(ctx["reference"], ids, fmt, ctx["page_size"], chunk=ctx["chunk"], decode_from=keep_from,
                            keep_from=keep_from, tensor_scales=scales)
    return run


def _weights(plan: QuantPlan | Callable[[dict], torch.nn.Module]):
    def run(ctx: dict, ids: torch.Tensor, keep_from: int) -> torch.Tensor:
        key = id(plan)
        if key not in ctx["models"]:
            ctx["models"][key] = plan(ctx) if callable(plan) else quantize_(copy.deepcopy(ctx["reference"]), plan)
        with torch.no_grad():
            return ctx["models"][key](ids)[:, keep_from:].float()
    return run


def _int4_mse(ctx: dict) -> torch.nn.Module:
    """INT4 experts by the error-minimising clipping search of ``mla_quant.convert`` (through a checkpoint)."""
    from ..convert import convert_checkpoint
    from ..models import from_pretrained, save_pretrained

    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(ctx["reference"], f"{tmp}/src")
        convert_checkpoint(f"{tmp}/src", f"{tmp}/dst", None, method="mse", progress=False)   # routed experts, g32
        return from_pretrained(f"{tmp}/dst", dtype=torch.float32, device=ctx["device"])


def _load(path: str, device: torch.device) -> torch.nn.Module:
    from ..models import from_pretrained

    return from_pretrained(path, dtype=torch.float32, device=device).eval()


VARIANTS = {
    "kv bf16": _kv("bf16"),
    "kv fp8_e4m3 per-token": _kv("fp8_e4m3"),
    "kv fp8_e4m3 per-tensor": _kv("fp8_e4m3", "tensor"),
    "kv fp8_ds_mla": _kv("fp8_ds_mla"),
    "experts int4 rtn": _weights(QuantPlan({EXPERTS: Int4Group(32)})),
    "experts int4 mse": _weights(_int4_mse),
    "weights fp8 block w8a8": _weights(QuantPlan({"lm_head": None, "_default": FP8Block()})),
    "indexer fp8": _weights(QuantPlan({r"re:.*indexer$": FP8Block()})),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mla_quant.eval.table", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", help="model folder (from_pretrained); default: a tiny random model (--arch)")
    p.add_argument("--arch", default="kimi", choices=("kimi", "glm"), help="the tiny random model's family")
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 512])
    p.add_argument("--eval-tokens", type=int, default=64, help="positions compared at the end of each context")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--variants", nargs="+", default=[v for v in VARIANTS if v != "indexer fp8"],
                   choices=list(VARIANTS), help="'indexer fp8' applies to DSA models (GLM 5.2)")
    p.add_argument("--extra", nargs="+", default=[], metavar="NAME=PATH",
                   help="more variants: checkpoints of the same model made elsewhere (e.g. QAT-exported INT4 "
                        "experts), loaded in fp32 and run plainly")
    p.add_argument("--tokens", help="torch.save'd 1-D int tensor of real text token ids (default: random ids)")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--chunk", type=int, default=4096, help="prefill chunk tokens")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the rows here too")
    return p.parse_args(argv)


def load_reference(args, device: torch.device) -> torch.nn.Module:
    from ..models import Glm52Config, Glm52ForCausalLM, KimiK26Config, KimiK26ForCausalLM, init_random_weights_

    if args.checkpoint:
        return _load(args.checkpoint, device)
    if getattr(args, "arch", "kimi") == "glm":
        model = Glm52ForCausalLM(Glm52Config.tiny(), dtype=torch.float32, device=device)
    else:
        model = KimiK26ForCausalLM(KimiK26Config.tiny(), dtype=torch.float32, device=device)
    return init_random_weights_(model, args.seed).eval()


def sequences(args, vocab: int, length: int, device: torch.device) -> torch.Tensor:
    """[batch, length] token ids: windows of the given text, or random ids."""
    g = torch.Generator().manual_seed(args.seed + length)
    if args.tokens is None:
        return torch.randint(0, vocab, (args.batch, length), generator=g).to(device)
    text = torch.load(args.tokens).long().reshape(-1)
    if text.numel() < length:
        raise ValueError(f"--tokens: {text.numel()} tokens, a context of {length} needs more")
    starts = torch.randint(0, text.numel() - length + 1, (args.batch,), generator=g)
    return torch.stack([text[s:s + length] for s in starts.tolist()]).to(device)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    reference = load_reference(args, device)
    ctx = {"reference": reference, "device": device, "page_size": args.page_size, "chunk": args.chunk, "models": {}}
    variants = {name: VARIANTS[name] for name in args.variants}
    for spec in args.extra:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--extra: {spec!r} is not NAME=PATH")
        variants[name] = _weights(lambda c, path=path: _load(path, c["device"]))
    rows = []
    print("| variant | context | KL (nats) | top-1 |\n|---|---:|---:|---:|")
    for length in args.contexts:
        if length <= args.eval_tokens:
            raise ValueError(f"--contexts: {length} must exceed --eval-tokens {args.eval_tokens}")
        ids = sequences(args, reference.config.vocab_size, length, device)
        keep_from = length - args.eval_tokens
        with torch.no_grad():
            ref = reference(ids)[:, keep_from:].float()
        for name, run in variants.items():
            q = run(ctx, ids, keep_from).to(ref.device)
            row = {"variant": name, "context": length, "kl": float(kl_divergence(ref, q)),
                   "top1": float(top1_agreement(ref, q)), "positions": q.shape[0] * q.shape[1]}
            rows.append(row)
            print(f"| {name} | {length} | {row['kl']:.4g} | {100 * row['top1']:.1f}% |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"checkpoint": args.checkpoint, "tokens": args.tokens, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
