"""Sweep of ``mla_decode(fp8_dequant="gluon")``'s launch settings against the bitcast and BF16 pages, in one GPU call.

    python -m benchmarks.sweep_mla_gluon [--out sweep_mla_gluon.json] [--shapes 64x4096,64x65536,1x4096]
        [--settings gluon_w4s2p2ws,gluon_w4s2p2,bitcast,bf16] [--heads 16]

16 heads (``--heads``), one query token, fp8_e4m3 pages with per-token scales (``random_kv_pool``), page size 64, each
request's pages a shuffled run. A setting ``gluon_w{W}s{S}p{P}[ws][sw]`` runs the Gluon kernel (kernel_gluon.py) with
``W`` attention warps (``GLUON_WARPS``), ``S`` tile slots (``GLUON_STAGES``), the KV split planned for ``P`` programs
per SM (``GLUON_PER_SM`` and ``GLUON_PER_SM_SHORT``, whatever the split length), ``ws``: the warp-specialized form
(``GLUON_WS``), ``sw``: the transposed score dot (``GLUON_SWAP_QK``); ``gluon`` runs the launcher's own settings and
split plan; ``bitcast`` runs ``fp8_dequant="bitcast"`` (the default before the Gluon kernel), ``bf16`` the launcher on
BF16 pages of the same shape (the goals' peer); ``ds_mla`` the launcher on fp8_ds_mla pages (FlashMLA's 656-byte rows;
the Gluon kernel since session 21) and ``ds_mla_convert`` those pages through the Triton kernel's conversion (their
default before); ``groups{G}`` runs the launcher on the fp8_e4m3 pages with ``head_groups=G`` (the heads as G requests
of H/G heads over the same pages: the Gluon kernel at 16-row groups), ``bf16_groups{G}`` the same on BF16 pages and
``ds_groups{G}`` on fp8_ds_mla pages (error against ``ds_mla_convert``'s);
``--heads`` sets H (16 unless given). Every setting is captured once in a CUDA graph and timed in interleaved rounds
(``common.interleaved_graph_us``). Reports per shape the median µs of the rounds, TB/s of the pages read, each FP8
setting's time over BF16's (goal of issue #3: ≤ 0.65 at batch ≥ 8) and each Gluon setting's relative error against the
bitcast's output (both read the same e4m3 bytes: ~2.5e-3 is the bf16 output rounding); ``ds_mla``'s against
``ds_mla_convert``'s.
"""
from __future__ import annotations

import json
import re
import statistics

import torch

from .common import interleaved_graph_us, module_attrs, random_kv_pool, sweep_args

HEADS, D, D_LATENT, PAGE, SCALE = 16, 576, 512, 64, 0.1
GROUPS = re.compile(r"(bf16_|ds_)?groups(\d+)$")
SETTING = re.compile(r"gluon_w(\d)s(\d)p(\d)(ws)?(sw)?$")


def _settings_for(name: str) -> dict:
    """The launcher's module constants of a ``gluon_...`` setting name."""
    m = SETTING.match(name)
    if m is None:
        raise ValueError(f"setting {name!r}: expected gluon_w<warps>s<slots>p<per SM>[ws][sw], gluon, bitcast or "
                         "bf16")
    warps, stages, per_sm = (int(x) for x in m.groups()[:3])
    return {"GLUON_WARPS": warps, "GLUON_STAGES": stages, "GLUON_PER_SM": per_sm, "GLUON_PER_SM_SHORT": per_sm,
            "GLUON_WS": bool(m.group(4)), "GLUON_SWAP_QK": bool(m.group(5))}


def sweep_shape(batch: int, ctx: int, settings: list[str], dev: str = "cuda", heads: int = HEADS) -> dict:
    import mla_quant.kernels.mla_decode as md
    from mla_quant.kernels.mla_decode import mla_decode

    pages = ctx // PAGE
    table = torch.randperm(batch * pages, device=dev).to(torch.int32).view(batch, pages)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(batch, 1, heads, D, device=dev, dtype=torch.bfloat16)
    kv8, sc8 = random_kv_pool("fp8_e4m3", batch * pages, PAGE, D_LATENT, D - D_LATENT, dev)
    use_bf16 = any(name.startswith("bf16") for name in settings)
    kv16 = random_kv_pool("bf16", batch * pages, PAGE, D_LATENT, D - D_LATENT, dev)[0] if use_bf16 else None
    use_ds = any(name.startswith("ds_") for name in settings)
    kvds = random_kv_pool("fp8_ds_mla", batch * pages, PAGE, D_LATENT, D - D_LATENT, dev)[0] if use_ds else None

    def ds(dequant, groups=1):
        return lambda: mla_decode(q, kvds, None, table, lens, SCALE, "fp8_ds_mla", D_LATENT, validate=False,
                                  max_seq_len=ctx, fp8_dequant=dequant, head_groups=groups)

    def fp8(dequant, attrs=None, groups=1):
        def call():
            with module_attrs(md, attrs or {}):
                return mla_decode(q, kv8, sc8, table, lens, SCALE, "fp8_e4m3", D_LATENT, validate=False,
                                  max_seq_len=ctx, fp8_dequant=dequant, head_groups=groups)
        return call

    def bf16(groups=1):
        return lambda: mla_decode(q, kv16, None, table, lens, SCALE, "bf16", D_LATENT, validate=False,
                                  max_seq_len=ctx, head_groups=groups)

    fns = {}
    for name in settings:
        if name == "bf16":
            fns[name] = bf16()
        elif m := GROUPS.match(name):
            pages, g = m.group(1), int(m.group(2))
            fns[name] = bf16(g) if pages == "bf16_" else ds("auto", g) if pages == "ds_" else fp8("auto", groups=g)
        elif name == "bitcast":
            fns[name] = fp8("bitcast")
        elif name == "ds_mla":
            fns[name] = ds("auto")
        elif name == "ds_mla_convert":
            fns[name] = ds("convert")
        elif name == "gluon":
            fns[name] = fp8("gluon")
        else:
            fns[name] = fp8("gluon", _settings_for(name))
    o_bit = fp8("bitcast")()[0].float()
    errs = {name: float((fns[name]()[0].float() - o_bit).norm() / o_bit.norm())
            for name in settings if name.startswith(("gluon", "groups"))}
    if "bf16" in settings:  # BF16 in head groups against the ungrouped BF16 call
        o16 = fns["bf16"]()[0].float()
        errs.update({name: float((fns[name]()[0].float() - o16).norm() / o16.norm())
                     for name in settings if name.startswith("bf16_groups")})
    if "ds_mla" in settings and "ds_mla_convert" in settings:
        o_conv = fns["ds_mla_convert"]()[0].float()
        errs.update({name: float((fns[name]()[0].float() - o_conv).norm() / o_conv.norm())
                     for name in settings if name == "ds_mla" or name.startswith("ds_groups")})
    times = interleaved_graph_us(fns, rounds=5)
    row = {"batch": batch, "ctx": ctx, "heads": heads, "rel_err_vs_bitcast": errs}
    for name, t in times.items():
        if isinstance(t, str):
            row[name] = t
            continue
        row[name] = round(statistics.median(t), 2)
        page_bytes = batch * ctx * (2 * D if name.startswith("bf16") else 656 if name.startswith("ds_") else D + 4)
        row[name + "_TBps"] = round(page_bytes / row[name] / 1e6, 3)
    if isinstance(row.get("bf16"), float):
        for name in settings:
            if name != "bf16" and isinstance(row.get(name), float):
                row[name + "_vs_bf16"] = round(row[name] / row["bf16"], 3)
    return row


def main(argv: list[str] | None = None) -> int:
    def extra(ap):
        ap.add_argument("--shapes", default="64x4096,64x65536,32x4096,1x65536,1x4096",
                        help="batch x context, comma-separated")
        ap.add_argument("--settings", default="gluon_w4s2p2ws,gluon_w4s2p2,bitcast,bf16")
        ap.add_argument("--heads", type=int, default=HEADS, help="query heads (the gluon_* settings need <= 16)")

    args = sweep_args(__doc__, "sweep_mla_gluon.json", None, argv, extra)
    if args is None:
        return 0
    rows = []
    for shape in args.shapes.split(","):
        batch, ctx = (int(x) for x in shape.split("x"))
        rows.append(sweep_shape(batch, ctx, args.settings.split(","), heads=args.heads))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
