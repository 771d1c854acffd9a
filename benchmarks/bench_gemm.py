"""bench ``gemm``: dense GEMMs ``y = x @ W.T`` at Kimi / GLM widths in each weight format, with the peers
measured in the same run.

Rows (case keys ``format``, ``M``, ``N``, ``K``):

* ``bf16``      cuBLAS (``x @ W.T``) — the baseline of the others (no peer);
* ``fp8_block`` the Triton block-scaled W8A8 GEMM on pre-quantized activations, the launcher's default (on
                Hopper past 64 tokens the TMA variant with ``default_config``, else the autotuned portable
                kernel; ``benchmarks/sweep_fp8_gemm.py`` compares them); peer ``torch_scaled_mm``
                (cuBLASLt fp8 with per-tensor scales, M padded to 16 where cuBLASLt needs it); also
                ``cublas_bf16_us`` and ``act_quant_us`` (the 1×128 activation quantization it needs);
* ``int4_g32``  the Triton W4A16 GEMM (group 32, bf16 scales); peer ``tinygemm_int4``
                (``torch.ops.aten._weight_int4pack_mm``, group 32); also ``cublas_bf16_us``.
* ``int4_g32`` at 2-32 tokens is the fragment kernel (``fragments="auto"``, from session 14 — up to 16 tokens until
                session 41: mma.sync on fragments built in registers), from ``DEQUANT_GEMM_MIN_M`` (128) tokens the
                weight dequantized once, then cuBLAS (``dequant_gemm``, session 41), whose rows ``int4_g32_tiles``
                run the tiles that dequantize in their main loop (``dequant_gemm=False``, the default before);
                ``int4_g32_frag_ws`` the fragment kernel with split-K counters kept across
                calls; ``int4_g32_swap`` the swapped-operand kernel (``swap_ab=True``, the default of session 13;
                its rows with kept counters, ``int4_g32_swap_ws``, are in the results of that session);
                ``int4_g32_fast`` the default before it.
* ``int4_g32_fast``, ``int4_g32_fast2`` the same GEMM with ``fast_dequant=1`` / ``2`` (the FAST_DEQUANT
                levels, each with its own autotuned configs, docs/recipes.md), same weights, peers and goal,
                next to ``int4_g32`` (``speedup_vs_int4_g32``); ``int4_g32_fast0`` with ``fast_dequant=0`` where
                the default (``"auto"``) takes level 1 (2 to ``FAST_AUTO_MAX_M`` tokens).
* ``int4_g32`` at M = 1 is the whole-row GEMV (``gemv="rows"``, the default since session 25) launched plainly;
                ``int4_g32_prefetch`` the same with ``prefetch_weights=True`` (PDL, the weights loaded before the
                wait: what ``QuantLinear`` runs on settled weights; each call follows the previous one's GEMV);
                ``int4_g32_planes1`` the split-K plane GEMV in one launch (the default until session 25,
                docs/moe.md "W4A16 at M = 1 in one launch"), ``int4_g32_planes1_ws`` with its split-K counters
                kept across calls; ``int4_g32_tile`` the first one-token GEMV (``gemv="tile"``);
                ``int4_g32_planes`` the two-launch plane GEMV (``gemv="planes"``: ``plane_order``, then the GEMV).

Goals (issue 6 / issue 5): W4A16 ≥ 2× tinygemm at M = 1 and faster at every M ≤ 64; FP8 block ≥ 0.7×
``_scaled_mm`` and ≥ 1.4× bf16 cuBLAS at M ≥ 512 — each row says ``goal`` and ``goal_met``. Inputs are
rotated past the L2 cache (``common.rotating``) so small-M cases read their weights from HBM. ``GEMM_MS=1,2``
(comma-separated) times only those token counts.
"""
from __future__ import annotations

import os

import torch

from mla_quant.kernels.fp8_gemm import fp8_gemm
from mla_quant.kernels.fp8_quant import FP8, act_quant_fp8, block_quant_fp8
from mla_quant.kernels.int4_quant import int4_quantize
from mla_quant.kernels.w4a16_gemm import DEQUANT_GEMM_MIN_M, FAST_AUTO_MAX_M, FRAG_AUTO_MAX_M, SWAP_MAX_M, w4a16_gemm

from .common import Context, case, graph_us, rotating

M_ALL = (1, 2, 4, 8, 16, 64, 512, 2048, 8192)
M_QUICK = (1, 2, 4, 8, 16, 32, 64, 512, 4096)
# (N, K): Kimi q_a/kv_a-like 2048×7168, o_proj-like 7168×2048 (expert down), 4096×7168, the dense MLP's
# 7168×18432 (down), GLM's dense 6144×12288.
NK_ALL = ((7168, 2048), (2048, 7168), (4096, 7168), (7168, 18432), (6144, 12288))
GROUP = 32
FAST_FORMATS = {0: "int4_g32_fast0", 1: "int4_g32_fast", 2: "int4_g32_fast2"}  # FAST_DEQUANT level -> row format
FRAG_WS_FORMAT = "int4_g32_frag_ws"  # 2..FRAG_AUTO_MAX_M tokens: the default (the fragment kernel), kept counters
TILES_FORMAT = "int4_g32_tiles"  # from DEQUANT_GEMM_MIN_M tokens: the tiles the default ran before (dequant_gemm=False)
SWAP_FORMAT = "int4_g32_swap"  # 2..SWAP_MAX_M tokens: the swapped-operand kernel (swap_ab=True)
TILE_FORMAT = "int4_g32_tile"  # w4a16_gemm(gemv="tile") at M = 1: the previous GEMV
# M = 1 variants beside int4_g32 (the whole-row GEMV launched plainly): row format -> (gemv form, pass kept split-K
# counters, prefetch_weights). int4_g32_prefetch is QuantLinear's one-token call on settled weights.
GEMV_FORMATS = {"int4_g32_prefetch": ("rows", False, True), TILE_FORMAT: ("tile", False, False),
                "int4_g32_planes": ("planes", False, False), "int4_g32_planes1": ("planes1", False, False),
                "int4_g32_planes1_ws": ("planes1", True, False)}


def _tinygemm_pack(n: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """tinygemm operands: ``_convert_weight_to_int4pack`` of uint8 [N, K/2] (two nibbles per byte, the torch
    ≥ 2.5 layout) and scales-and-zeros bf16 [K/g, N, 2]. Random codes: timing only."""
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, device=device)
    u8 = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)
    packed = torch.ops.aten._convert_weight_to_int4pack(u8, 8)
    scales = torch.rand(k // GROUP, n, device=device, dtype=torch.bfloat16) * 0.02
    sz = torch.stack([scales, torch.zeros_like(scales)], dim=-1).contiguous()
    return packed, sz


def _why(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def _bytes(fmt: str, m: int, n: int, k: int) -> int:
    out = 2 * m * n
    if fmt == "bf16":
        return 2 * m * k + 2 * n * k + out
    if fmt == "fp8_block":
        return m * k + 4 * m * (k // 128) + n * k + 4 * -(-n // 128) * (k // 128) + out
    return 2 * m * k + n * k // 2 + 2 * n * (k // GROUP) + out  # int4_g32


def _goal(fmt: str, m: int, row: dict) -> tuple[str, bool] | None:
    if fmt.startswith("int4_g32") and row.get("peer_median_us"):
        need = 2.0 if m == 1 else 1.0
        if m <= 64:
            return f">= {need}x tinygemm", row["peer_median_us"] / row["median_us"] >= need
    if fmt == "fp8_block" and m >= 512 and row.get("peer_median_us"):
        ok = row["peer_median_us"] / row["median_us"] >= 0.7 and row["cublas_bf16_us"] / row["median_us"] >= 1.4
        return ">= 0.7x _scaled_mm and >= 1.4x bf16", ok
    return None


def _ms(quick: bool) -> tuple[int, ...]:
    """The token counts to time: M_QUICK / M_ALL, or those named in ``GEMM_MS`` (comma-separated) for a focused run."""
    named = tuple(int(v) for v in os.environ.get("GEMM_MS", "").split(",") if v)
    return named or (M_QUICK if quick else M_ALL)


def run(ctx: Context) -> list[dict]:
    dev = ctx.device
    ms = _ms(ctx.quick)
    nks = NK_ALL[1:3] if ctx.quick else NK_ALL
    rows: list[dict] = []
    for n, k in nks:
        tiny_error: list[str] = []

        def make_weights():
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
            q8, s8 = block_quant_fp8(w)
            p4, s4 = int4_quantize(w, GROUP)
            tiny = None
            if not tiny_error:
                try:
                    tiny = _tinygemm_pack(n, k, dev)
                except Exception as e:  # the op's signature moved between torch releases
                    tiny_error.append(f"gemm: tinygemm int4 unavailable for {n}x{k}: {_why(e)}")
            return {"w": w, "q8": q8, "s8": s8, "q8t": q8.t(), "p4": p4, "s4": s4, "tiny": tiny}

        # enough weight sets that cycling through them overflows L2 even for the smallest (INT4) weights
        nxt = rotating(make_weights, n * k // 2)
        sets = [nxt() for _ in range(max(2, -(-3 * 60 * 2**20 // (n * k // 2))))]
        ctx.notes.extend(tiny_error)
        one = torch.ones((), device=dev, dtype=torch.float32)

        def timed(fn):
            """One call per weight set, all captured in one CUDA graph (no host overhead for anyone)."""
            def all_sets():
                for s in sets:
                    fn(s)
            return graph_us(all_sets, len(sets))[0]

        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            xq, xs = act_quant_fp8(x, 128)
            m16 = -(-m // 16) * 16  # cuBLASLt fp8 wants multiples of 16
            xq16 = torch.zeros(m16, k, device=dev, dtype=FP8)
            xq16[:m] = xq
            flops = 2 * m * n * k

            t_bf16 = timed(lambda s: x @ s["w"].T)
            rows.append(case("gemm", {"format": "bf16", "M": m, "N": n, "K": k}, t_bf16,
                             bytes=_bytes("bf16", m, n, k), flops=flops, peer=None))

            t_fp8 = timed(lambda s: fp8_gemm(xq, xs, s["q8"], s["s8"]))
            t_aq = graph_us(lambda: act_quant_fp8(x, 128))[0]
            try:
                t_smm = timed(lambda s: torch._scaled_mm(xq16, s["q8t"], scale_a=one, scale_b=one,
                                                         out_dtype=torch.bfloat16))
            except Exception as e:
                t_smm = None
                ctx.notes.append(f"gemm: torch._scaled_mm failed at M={m} {n}x{k}: {_why(e)}")
            rows.append(case("gemm", {"format": "fp8_block", "M": m, "N": n, "K": k}, t_fp8,
                             bytes=_bytes("fp8_block", m, n, k), flops=flops, peer="torch_scaled_mm",
                             peer_median_us=t_smm, peer_m=m16, cublas_bf16_us=round(t_bf16, 3),
                             speedup_vs_bf16=round(t_bf16 / t_fp8, 3), act_quant_us=round(t_aq, 3)))

            t_int4 = timed(lambda s: w4a16_gemm(x, s["p4"], s["s4"], GROUP))
            t_tiny = None
            if not tiny_error:
                try:
                    t_tiny = timed(lambda s: torch.ops.aten._weight_int4pack_mm(x, s["tiny"][0], GROUP, s["tiny"][1]))
                except Exception as e:
                    ctx.notes.append(f"gemm: tinygemm failed at M={m} {n}x{k}: {_why(e)}")
            rows.append(case("gemm", {"format": "int4_g32", "M": m, "N": n, "K": k}, t_int4,
                             bytes=_bytes("int4_g32", m, n, k), flops=flops, peer="tinygemm_int4",
                             peer_median_us=t_tiny, cublas_bf16_us=round(t_bf16, 3),
                             speedup_vs_bf16=round(t_bf16 / t_int4, 3)))
            # INT4 variants beside the default: other one-token GEMVs, then the FAST_DEQUANT levels
            variants = [(fmt, {"gemv": form, "counters": torch.zeros(n, dtype=torch.int32, device=dev) if kept
                               else None, "prefetch_weights": early})  # kept counters: left zero by each call
                        for fmt, (form, kept, early) in (GEMV_FORMATS.items() if m == 1 else ())]
            variants += [(fmt, {"fast_dequant": level}) for level, fmt in FAST_FORMATS.items()
                         if level or 1 < m <= FAST_AUTO_MAX_M]  # level 0: where level 1 was the default
            if 1 < m <= FRAG_AUTO_MAX_M:  # the default there (fragments="auto"), split-K counters kept across calls
                variants.append((FRAG_WS_FORMAT, {"counters": torch.zeros(n, dtype=torch.int32, device=dev)}))
            if m >= DEQUANT_GEMM_MIN_M:
                variants.append((TILES_FORMAT, {"dequant_gemm": False}))
            if 1 < m <= SWAP_MAX_M:
                variants.append((SWAP_FORMAT, {"swap_ab": True}))
            n_fast = 0
            for fmt, kwargs in variants:
                try:  # an unmeasured variant failing must not lose the other rows
                    t_var = timed(lambda s, kw=kwargs: w4a16_gemm(x, s["p4"], s["s4"], GROUP, **kw))
                except Exception as e:  # noqa: BLE001
                    ctx.notes.append(f"gemm: {fmt} failed at M={m} {n}x{k}: {_why(e)}")
                    continue
                n_fast += 1
                rows.append(case("gemm", {"format": fmt, "M": m, "N": n, "K": k}, t_var,
                                 bytes=_bytes("int4_g32", m, n, k), flops=flops, peer="tinygemm_int4",
                                 peer_median_us=t_tiny, cublas_bf16_us=round(t_bf16, 3),
                                 speedup_vs_bf16=round(t_bf16 / t_var, 3),
                                 speedup_vs_int4_g32=round(t_int4 / t_var, 3)))
            for r in rows[-2 - n_fast:]:
                goal = _goal(r["case"]["format"], m, r)
                if goal is not None:
                    r["goal"], r["goal_met"] = goal
        del nxt, sets
        torch.cuda.empty_cache()
    return rows
