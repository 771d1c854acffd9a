"""bench ``moe`` and ``moe_layer``: Kimi K2.6's MoE (384 experts, hidden 7168, expert 2048, top-8, one
shared expert) at 1–1024 tokens, experts in bf16, fp8_block (W8A8) and int4_g32.

* ``moe`` times the routed experts alone: ``fused_moe`` (align, gate-up GEMM with SiLU·up, down GEMM with
  the routing weight, combine; at ``block_m == 1`` neither align nor combine launch: the default
  ``decode_fusion``) on a fixed routing, all experts in ``case.format``. Peer: the same routing
  through ``torch._grouped_mm`` in bf16 (sort, gather, two grouped GEMMs, SiLU·up, weighted scatter-add;
  a per-expert cuBLAS loop where ``_grouped_mm`` is missing).
* ``moe_layer`` times the module as the model runs it: router (fp32 logits, noaux_tc top-8), routed
  experts in ``case.format``, the shared expert in BF16 (as Kimi K2.6 ships it). Peer: the same layer with
  the bf16 ``_grouped_mm`` routed experts.

Every timing replays a CUDA graph of calls on ``SETS`` different routings (different experts, so the
active weights — 8 experts ≈ 200 MB even in INT4 — come from HBM, not L2), divided by ``SETS``; eager
where capture fails (the row says ``cuda_graph``). ``bytes`` = the active experts' weights read once
(+ the shared expert and router for ``moe_layer``) + activations in and out; ``frac_of_copy`` compares the
achieved rate with the copy bandwidth of the same run. Goals at one token (issue 5): INT4 ≥ 3.0× BF16 and
≥ 1.6× FP8 (ideal by bytes 3.55× and 1.78×); int4 rows say ``goal`` / ``goal_met``. For ≤ 16 tokens the
rows also carry ``alt_block_m`` / ``alt_us``: the other decode path (GEMV vs 16-row tensor-core tiles).

Rows ``int4_g32_fast`` / ``int4_g32_fast2`` in results up to 5a85563 timed ``fused_moe(..., fast_dequant=1 / 2)``,
the FAST_DEQUANT levels removed after that run (0.40-0.61x the plane tile above 16 tokens, equal below).

Where the INT4 experts run as a GEMV (``block_m == 1``: 1, 4 and 16 tokens), ``int4_g32`` is the default
(``gemv="auto"``: since session 23 the fp16x2 GEMV with a register double buffer at one token and without it from
two, for the bench's bf16 x; in a62b0c3's run the plane GEMV with the double buffer at one token), and rows
``int4_g32_prefetch`` time the plane GEMV with the double buffer (``gemv="prefetch"``; results of a62b0c3 and
before: the default itself, except 5a85563 and before, where the double buffer was opt-in), ``int4_g32_half2`` the
fp16x2 form without the double buffer (``gemv="half2"``), ``int4_g32_half2_prefetch`` with it
(``gemv="half2_prefetch"``), ``int4_g32_tile`` the previous GEMV (``gemv="tile"``), ``int4_g32_planes`` the plane
GEMV without the double buffer (``gemv="planes"``), ``int4_g32_frag`` the MMA-fragment form (``gemv="fragments"``,
the decode path at every token count), on the same experts and routings (``speedup_vs_int4_g32`` > 1 means that form
beats the default; docs/moe.md "The INT4 plane GEMV", "The half2
GEMV"). There, too, rows ``int4_g32_unfused`` time
the aligned decode path (``fused_moe(..., decode_fusion=False)``: ``moe_align``, the two GEMVs, the combine launch)
and ``int4_g32_fused`` the fused one (``decode_fusion=True``: no align; the combine done by the down GEMV's
last-arriving program of each token and tile; docs/moe.md "The decode path"); the default ``"auto"`` fuses at one
token only (run of 1a54790, where the default fused at every GEMV token count: one token 76.1 vs 80.0 µs, 16 tokens
994.6 vs 975.7). ``speedup_vs_int4_g32`` < 1 means the default is faster.

Where the INT4 experts run on the tensor cores (``block_m`` > 1), ``int4_g32`` is the default plane tile
(``int4_tile="planes"``: the words kept in their load layout, one dot per nibble plane; docs/moe.md "The INT4 plane
tile") and rows ``int4_g32_dequant_tile`` (at 16, 64, 256 and 1024 tokens) time the dequantized tile
(``fused_moe(..., int4_tile="dequant")``, the default until the H200 run of 8b4c3e0) on the same experts and
routings at ``block_m`` = max(the default's, 16) (at 16 tokens the default is the GEMV: the row then runs 16-row
tiles); ``plane_tile_us`` is the plane tile at that same ``block_m`` and ``speedup_of_planes`` the ratio.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mla_quant.formats import BF16, FP8Block, Int4Group
from mla_quant.kernels.fp8_quant import FP8
from mla_quant.kernels.fused_moe import choose_block_m, fused_moe
from mla_quant.modules import MLP, MoE, Router
from mla_quant.modules.experts import kernel_args

from .common import Context, case, graph_us

E, HIDDEN, INTER, TOP_K, SCALE = 384, 7168, 2048, 8, 2.827
TOKENS = (1, 4, 16, 64, 256, 1024)
FORMATS = {"bf16": BF16(), "fp8_block": FP8Block(), "int4_g32": Int4Group(32)}
SETS = 8  # routings cycled per timing
# row format -> fused_moe keywords, rows where block_m == 1 beside int4_g32 (the defaults: gemv="auto", for the
# bench's bf16 x "half2_prefetch" at one token and "half2" above; decode_fusion="auto": fused at one token)
GEMV_FORMATS = {"int4_g32_tile": {"gemv": "tile"}, "int4_g32_planes": {"gemv": "planes"},
                "int4_g32_unfused": {"decode_fusion": False}, "int4_g32_fused": {"decode_fusion": True},
                "int4_g32_frag": {"gemv": "fragments"}, "int4_g32_half2": {"gemv": "half2"},
                "int4_g32_prefetch": {"gemv": "prefetch"}, "int4_g32_half2_prefetch": {"gemv": "half2_prefetch"}}
# fused_moe(int4_tile="dequant") -> row format, at these token counts beside int4_g32 (the plane tile)
DEQUANT_TILE_FORMAT, DEQUANT_TILE_TOKENS = "int4_g32_dequant_tile", (16, 64, 256, 1024)


def _graph_us(fn, reps: int) -> tuple[float, bool]:
    """Median µs of one of ``reps`` calls replayed from a CUDA graph (eager if capture fails)."""
    return graph_us(fn, reps, warmup_ms=10, rep_ms=60)


def _peer_us(ctx: Context, what: str, fn) -> float | None:
    try:
        return _graph_us(fn, SETS)[0]
    except RuntimeError as e:  # a peer failing must not lose our rows
        ctx.notes.append(f"moe: peer failed at {what}: {type(e).__name__}: {str(e)[:160]}")
        return None


def _random_experts(name: str, dev) -> tuple[dict, dict]:
    """Stacked random experts in a format, gate and up as views of one fused [E, 2I, H] tensor (as engines
    store them). Returns ({proj: tensors}, {"w13": ..., "w2": ...} the fused storage)."""
    g = torch.Generator(device=dev).manual_seed(0)

    def dense(n, k, scale):
        return torch.randn(E, n, k, device=dev, dtype=torch.bfloat16, generator=g).mul_(scale)

    if name == "bf16":
        w13, w2 = {"weight": dense(2 * INTER, HIDDEN, 0.02)}, {"weight": dense(HIDDEN, INTER, 0.02)}
    elif name == "fp8_block":
        def fp8(n, k):
            q = torch.empty(E, n, k, device=dev, dtype=FP8)
            for e in range(E):  # per expert: no [E, N, K] bf16 temporary
                q[e] = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g).mul_(32).to(FP8)
            return {"weight": q,
                    "weight_scale_inv": torch.rand(E, n // 128, k // 128, device=dev, generator=g).mul_(1e-3)}
        w13, w2 = fp8(2 * INTER, HIDDEN), fp8(HIDDEN, INTER)
    else:
        def int4(n, k):
            return {"weight_packed": torch.randint(-2**31, 2**31 - 1, (E, n, k // 8), device=dev, dtype=torch.int32,
                                                   generator=g),
                    "weight_scale": torch.rand(E, n, k // 32, device=dev, generator=g).mul_(1e-3).to(torch.bfloat16)}
        w13, w2 = int4(2 * INTER, HIDDEN), int4(HIDDEN, INTER)
    if name == "fp8_block":
        split = {"weight": INTER, "weight_scale_inv": INTER // 128}
    else:
        split = {key: INTER for key in w13}
    projs = {"gate_proj": {k: v[:, :split[k]] for k, v in w13.items()},
             "up_proj": {k: v[:, split[k]:] for k, v in w13.items()},
             "down_proj": w2}
    return projs, {"w13": w13, "w2": w2}


def _routings(tokens: int, dev) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """SETS random top-8 routings (distinct experts per token, realistic weights)."""
    out = []
    for s in range(SETS):
        g = torch.Generator(device=dev).manual_seed(1000 + s)
        ids = torch.rand(tokens, E, device=dev, generator=g).argsort(dim=-1)[:, :TOP_K].to(torch.int32)
        w = torch.rand(tokens, TOP_K, device=dev, generator=g)
        out.append((w / w.sum(-1, keepdim=True) * SCALE, ids))
    return out


def _expert_bytes(name: str) -> int:
    """Bytes one expert's three projections occupy (weights and scales; not the tiny ``weight_shape``)."""
    fmt = FORMATS[name]
    return sum(math.prod(shape) * dt.itemsize for n, k in ((INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER))
               for key, (shape, dt) in fmt.tensor_specs(n, k).items() if key != "weight_shape")


def _grouped_bf16(x, w, ids, w13_t, w2_t):
    """The peer's routed experts: sort by expert, two bf16 grouped GEMMs, weighted scatter-add."""
    tokens, k = ids.shape
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat)
    counts = torch.zeros(E, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)
    tok = order // k
    gu = torch._grouped_mm(x[tok], w13_t, offs=offs)
    h = F.silu(gu[:, :INTER]) * gu[:, INTER:]
    y = torch._grouped_mm(h, w2_t, offs=offs).float() * w.reshape(-1)[order, None]
    return torch.zeros(tokens, HIDDEN, device=x.device).index_add_(0, tok, y).to(x.dtype)


def _loop_bf16(x, w, ids, w13, w2):
    """Fallback peer without ``_grouped_mm``: a cuBLAS GEMM pair per active expert (host-synchronising)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        t, j = (ids == e).nonzero(as_tuple=True)
        gu = x[t] @ w13[e].T
        y = (F.silu(gu[:, :INTER]) * gu[:, INTER:]) @ w2[e].T
        out.index_add_(0, t, y.float() * w[t, j, None])
    return out.to(x.dtype)


def _peer_fn(fused: dict, ctx: Context):
    w13, w2 = fused["w13"]["weight"], fused["w2"]["weight"]
    x = torch.randn(4, HIDDEN, device=w13.device, dtype=torch.bfloat16)
    w, ids = _routings(4, w13.device)[0]
    try:
        _grouped_bf16(x, w, ids, w13.transpose(1, 2), w2.transpose(1, 2))
        return "torch_grouped_mm_bf16", lambda x, w, ids: _grouped_bf16(x, w, ids, w13.transpose(1, 2),
                                                                        w2.transpose(1, 2))
    except (AttributeError, RuntimeError) as e:
        ctx.notes.append(f"moe: torch._grouped_mm unavailable ({type(e).__name__}: {str(e)[:120]}); "
                         "peer = per-expert cuBLAS loop")
        return "cublas_loop_bf16", lambda x, w, ids: _loop_bf16(x, w, ids, w13, w2)


def _layer(name: str, projs: dict, dev) -> MoE:
    """Kimi's MoE module holding the bench's experts (no copy); router fp32, shared expert BF16."""
    layer = MoE(HIDDEN, INTER, E, TOP_K, n_shared_experts=1, routed_scaling_factor=SCALE,
                expert_fmt=FORMATS[name], shared_fmt=BF16(), dtype=torch.bfloat16, device="meta")
    layer.gate = Router(HIDDEN, E, TOP_K, routed_scaling_factor=SCALE, device=dev)
    layer.shared_experts = MLP(HIDDEN, INTER, fmt=BF16(), dtype=torch.bfloat16, device=dev)
    with torch.no_grad():
        layer.gate.weight.normal_(0, 0.02)
        for lin in (layer.shared_experts.gate_proj, layer.shared_experts.up_proj, layer.shared_experts.down_proj):
            lin.weight.normal_(0, 0.02)
    for proj, tensors in projs.items():
        layer.experts.assign_stacked_(proj, tensors)
    return layer


def run(ctx: Context) -> list[dict]:
    dev = ctx.device
    tokens_all = (1, 16, 256, 1024) if ctx.quick else TOKENS
    rows: list[dict] = []
    times: dict[tuple[str, str, int], float] = {}
    peer: dict[tuple[str, int], float] = {}
    shared_bytes = 3 * INTER * HIDDEN * 2
    router_bytes = E * HIDDEN * 4
    with torch.inference_mode():
        for name, fmt in FORMATS.items():
            projs, fused = _random_experts(name, dev)
            args = kernel_args(fmt)
            layer = _layer(name, projs, dev)
            peer_name, peer_call = _peer_fn(fused, ctx) if name == "bf16" else (None, None)
            for t in tokens_all:
                routings = _routings(t, dev)
                xs = [torch.randn(t, HIDDEN, device=dev, dtype=torch.bfloat16) for _ in range(SETS)]
                active = sum(ids.unique().numel() for _, ids in routings) / SETS
                act_bytes = 2 * 2 * t * HIDDEN
                flops = 2 * t * TOP_K * 3 * HIDDEN * INTER
                bm = choose_block_m(t * TOP_K, E, args["kind"])

                def routed(block_m=None, **form):
                    return [fused_moe(x, w, ids, projs["gate_proj"], projs["up_proj"], projs["down_proj"],
                                      block_m=block_m, **args, **form) for x, (w, ids) in zip(xs, routings)]

                t_moe, graphed = _graph_us(routed, SETS)
                times[("moe", name, t)] = t_moe
                extra = {"cuda_graph": graphed, "block_m": bm, "active_experts": active}
                if t <= 16:
                    alt = 16 if bm == 1 else 1
                    extra["alt_block_m"] = alt
                    extra["alt_us"] = round(_graph_us(lambda: routed(alt), SETS)[0], 3)
                if name == "bf16":
                    peer[("moe", t)] = _peer_us(ctx, f"moe T={t}", lambda: [peer_call(x, w, ids) for x, (w, ids)
                                                                           in zip(xs, routings)])
                nbytes = math.ceil(active * _expert_bytes(name)) + act_bytes
                rows.append(case("moe", {"format": name, "tokens": t}, t_moe, bytes=nbytes, flops=flops,
                                 peer="torch_grouped_mm_bf16" if peer_name is None else peer_name,
                                 peer_median_us=peer.get(("moe", t)), **extra))
                for form_name, form in (GEMV_FORMATS.items() if name == "int4_g32" and bm == 1 else ()):
                    # the other INT4 GEMVs and the aligned decode path on the same experts and routings, beside the
                    # default (a failure is noted and must not lose the other rows)
                    try:
                        t_form, graphed = _graph_us(lambda: routed(**form), SETS)
                        times[("moe", form_name, t)] = t_form
                        rows.append(case("moe", {"format": form_name, "tokens": t}, t_form, bytes=nbytes,
                                         flops=flops, peer="torch_grouped_mm_bf16",
                                         peer_median_us=peer.get(("moe", t)), cuda_graph=graphed, block_m=bm,
                                         active_experts=active))
                    except Exception as e:  # noqa: BLE001
                        ctx.notes.append(f"moe: {form_name} failed at T={t}: {type(e).__name__}: {str(e)[:160]}")
                if name == "int4_g32" and t in DEQUANT_TILE_TOKENS:
                    # the dequantized tensor-core tile beside the default plane tile (a failure is noted, the
                    # other rows stay)
                    tile_bm = max(bm, 16)
                    planes_us = t_moe if bm == tile_bm else extra.get("alt_us")  # the plane tile at tile_bm
                    try:
                        t_dq, graphed = _graph_us(lambda: routed(tile_bm, int4_tile="dequant"), SETS)
                    except Exception as e:  # noqa: BLE001
                        ctx.notes.append(f"moe: {DEQUANT_TILE_FORMAT} failed at T={t}: {type(e).__name__}: "
                                         f"{str(e)[:160]}")
                    else:
                        times[("moe", DEQUANT_TILE_FORMAT, t)] = t_dq
                        rows.append(case("moe", {"format": DEQUANT_TILE_FORMAT, "tokens": t}, t_dq, bytes=nbytes,
                                         flops=flops, peer="torch_grouped_mm_bf16",
                                         peer_median_us=peer.get(("moe", t)), cuda_graph=graphed, block_m=tile_bm,
                                         active_experts=active, plane_tile_us=planes_us,
                                         speedup_of_planes=round(t_dq / planes_us, 3) if planes_us else None))

                layer_active = sum(layer.gate(x)[1].unique().numel() for x in xs) / SETS
                t_layer, graphed = _graph_us(lambda: [layer(x) for x in xs], SETS)
                times[("moe_layer", name, t)] = t_layer
                if name == "bf16":
                    def layer_peer():
                        outs = []
                        for x in xs:
                            w, ids = layer.gate(x)
                            outs.append(peer_call(x, w, ids) + layer.shared_experts(x))
                        return outs
                    peer[("moe_layer", t)] = _peer_us(ctx, f"moe_layer T={t}", layer_peer)
                nbytes = math.ceil(layer_active * _expert_bytes(name)) + shared_bytes + router_bytes + act_bytes
                rows.append(case("moe_layer", {"format": name, "tokens": t}, t_layer, bytes=nbytes,
                                 flops=flops + 2 * t * 3 * HIDDEN * INTER + 2 * t * E * HIDDEN,
                                 peer="torch_grouped_mm_bf16" if peer_name is None else peer_name,
                                 peer_median_us=peer.get(("moe_layer", t)), cuda_graph=graphed,
                                 active_experts=layer_active))
            del projs, fused, layer
            torch.cuda.empty_cache()
    for r in rows:
        r["frac_of_copy"] = round(r["tbps"] / ctx.copy_tbps, 3) if ctx.copy_tbps and r.get("tbps") else None
        bench, name, t = r["bench"], r["case"]["format"], r["case"]["tokens"]
        if name != "bf16":
            r["speedup_vs_bf16"] = round(times[(bench, "bf16", t)] / r["median_us"], 3)
        variants = (*GEMV_FORMATS, DEQUANT_TILE_FORMAT)
        if name in variants:
            r["speedup_vs_int4_g32"] = round(times[(bench, "int4_g32", t)] / r["median_us"], 3)
        if name == "int4_g32" or name in variants:
            r["speedup_vs_fp8"] = round(times[(bench, "fp8_block", t)] / r["median_us"], 3)
            if bench == "moe" and t == 1:
                r["goal"] = ">= 3.0x bf16 and >= 1.6x fp8_block at 1 token"
                r["goal_met"] = r["speedup_vs_bf16"] >= 3.0 and r["speedup_vs_fp8"] >= 1.6
    return rows
