"""Block-scaled FP8 GEMM (W8A8, the prefill path of FP8 checkpoints): e4m3 activations with per-token 1×bk
scales (from ``fp8_quant.act_quant_fp8``) times e4m3 weights with bn×bk block scales (``weight_scale_inv``),
fp32 accumulation per scale block, bf16 out. Reference in ``reference.py``; kernels in ``kernel.py`` (portable:
pointer loads, autotuned; the interpreter runs it), ``kernel_tma.py`` (Hopper: TMA descriptors, optional
persistent grid; configuration from ``default_config``) and ``kernel_ws.py`` (Hopper, Gluon: warp-specialized,
a TMA producer warp and two consumer warp groups; configuration from ``ws_default_config``)."""
from __future__ import annotations

import torch

from .._backend import gluon_available as _gluon_available
from .._backend import is_hopper as _is_hopper
from .._backend import triton_interpreted, use_triton
from .._checks import check_divisible, check_same_device, check_tensor
from .._gemm_utils import m_bucket, num_sms, split_k_workspace
from .._host import cdiv
from ..fp8_quant import FP8
from .reference import fp8_gemm_reference

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CONFIG_KEYS = ("BM", "BN", "GROUP_M", "num_warps", "num_stages")  # the portable kernel's; SPLIT_K optional
TMA_CONFIG_KEYS = CONFIG_KEYS + ("PERSISTENT",)  # the "tma" variant: 0 / 1, a grid of one program per SM
# the "ws" variant (BM is 128: two consumer warp groups of 64 rows; TMA_STORE 0 / 1: the epilogue by plain stores
# / by TMA from shared memory where the output allows it; KSPLIT 0 / 1 (optional, BN 128): [64, BN] tiles, the two
# groups on alternate K blocks of each, each group on its own half of the STAGES slots (an even count), for shapes
# whose 128-row tiles leave SMs idle; AHEAD 0 / 1 (optional, BN 64 / 128): each group's K blocks in pairs, the
# second's wgmma running through the first one's promotion; PAIR_SLOTS 0 / 1 (optional, with AHEAD): a ring slot
# holds the pair, one ready and one empty barrier per pair, STAGES counting slots)
WS_CONFIG_KEYS = ("BN", "GROUP_M", "STAGES", "TMA_STORE", "KSPLIT", "AHEAD", "PAIR_SLOTS")
VARIANTS = ("auto", "portable", "tma", "ws")
WS_CANDIDATES = tuple({"BN": bn, "GROUP_M": 8, "STAGES": st, "TMA_STORE": ts, **({"KSPLIT": 1} if ks else {}),
                       **({"AHEAD": 1} if ah else {}), **({"PAIR_SLOTS": 1} if ah == 2 else {})}
                      for bn, st, ts, ks, ah in (  # ah: 1 AHEAD, 2 AHEAD with PAIR_SLOTS
                          (128, 4, 1, 0, 1), (128, 5, 1, 0, 1), (128, 4, 0, 0, 1), (128, 6, 1, 1, 1), (128, 6, 0, 1, 1),
                          (128, 2, 1, 0, 2), (128, 3, 1, 0, 2), (128, 3, 0, 0, 2), (128, 2, 1, 1, 2), (128, 4, 0, 1, 2),
                          (128, 4, 1, 0, 0), (128, 5, 1, 0, 0), (128, 6, 1, 0, 0), (128, 5, 0, 0, 0), (64, 8, 1, 0, 0),
                          (256, 3, 1, 0, 0), (256, 4, 1, 0, 0), (128, 4, 1, 1, 0), (128, 6, 1, 1, 0),
                          (128, 6, 0, 1, 0)))
# the "tma" configurations worth measuring (benchmarks/sweep_fp8_gemm.py; compile_check compiles them all):
# 128 × 128 in two warp groups (one program per SM: 154-183 registers), and 64 × 128 / 128 × 64 in one warp
# group (two programs per SM: 4 stages of 24 KB each)
TMA_CANDIDATES = tuple(
    {"BM": bm, "BN": bn, "GROUP_M": 8, "num_warps": w, "num_stages": st, "PERSISTENT": p}
    for bm, bn, w, st, p in ((64, 128, 4, 4, 0), (64, 128, 4, 5, 0), (64, 128, 4, 3, 0), (128, 128, 8, 4, 1),
                             (128, 128, 8, 5, 1), (128, 64, 4, 4, 0)))

__all__ = ["fp8_gemm", "fp8_gemm_reference", "default_config", "CONFIG_KEYS", "TMA_CONFIG_KEYS", "TMA_CANDIDATES",
           "VARIANTS", "WS_CONFIG_KEYS", "WS_CANDIDATES", "ws_default_config", "ws_config"]


def default_config(m: int) -> dict:
    """The "tma" variant's configuration for M tokens (keys ``TMA_CONFIG_KEYS``): 64 × 128 tiles in one warp
    group, 4 stages of 24 KB, one tile per program (two programs per SM, so one's scale-adds overlap the other's
    tensor-core work). Best or within 4 % of the best candidate at all 9 shapes of the H200 sweep of 71d17aa
    (``benchmarks/results/sweep_fp8_gemm_h200.json``: 0.63-0.88x ``_scaled_mm``, 1.10-1.35x bf16; the 128 × 128
    persistent tile, the first default, 0.59-0.79x)."""
    return {"BM": 64, "BN": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 4, "PERSISTENT": 0}


def _ksplit_fills(m: int, n: int, sms: int) -> bool:
    """Where the ws kernel takes ``KSPLIT``: its 128 × 128 tiles would fill under 90 % of the ``sms`` SMs, while
    [64, 128] tiles fill 90-100 % of them in one wave."""
    return cdiv(m, 128) * cdiv(n, 128) < 0.9 * sms and 0.9 * sms <= cdiv(m, 64) * cdiv(n, 128) <= sms


def ws_default_config(m: int, n: int | None = None, sms: int | None = None, bn_s: int = 128) -> dict:
    """The "ws" variant's configuration (keys ``WS_CONFIG_KEYS``): 128 × 128 tiles, the output stored by TMA, each
    group's K blocks in pairs (``AHEAD``), a ring of 3 slots of one pair each (``PAIR_SLOTS``); ``KSPLIT`` [64, 128]
    tiles where 128-row tiles would leave SMs idle and 64-row tiles fill one wave (:func:`_ksplit_fills`; needs ``n``
    and ``sms``), with 4 pair slots (2 per group's ring) and plain stores (a TMA staging buffer would not fit beside
    them and the groups' hand-over buffer).

    H200, sweep of 518d14e: 4 stages best at 7 of 9 prefill shapes (5 or 6 within 2 % at the other two);
    TMA_STORE=0 1.04-1.37x the time; 128 × 64 tiles 1.2-1.5x. Session 23 (results/sweep_fp8_gemm_ws_h200.json):
    AHEAD with 4 stages (fdc5f24) the fastest setting at 11 of the 12 prefill shapes of M = 512 / 2048 / 8192,
    0.88-0.98x the time of the previous rule's choice (128 × 256 tiles where they added no wave — which AHEAD cannot
    take: the 256-column form already holds two accumulators — else 128 × 128). KSPLIT at 512 × 2048 × 7168 (128
    tiles of 64 rows) 19.6 µs with 7 shared stages against 25.0 for the tma kernel "auto" took before and 29.0 for
    128 × 128; at the other prefill shapes (256-1536 tiles of 64 rows) 1.1-1.5x the time of 128-row tiles.
    Session 24 (same file; interleaved rounds): PAIR_SLOTS with 3 slots took 0.97-1.04x (median 0.985) the time
    of AHEAD with 4 stages at the 11 shapes of 128-row tiles, 0.97-1.00x (median 0.975) in a call where each
    followed a kernel of its own kind. Each KSPLIT group now has its own half of the ring (a shared ring let a group
    wait on a slot whose previous use, the other group's, could still be in flight): with 6 stages that was
    20.5-21.4 µs at 512 × 2048 × 7168, with 4 pair slots 19.2-19.5."""
    if n is not None and sms and bn_s % 128 == 0 and _ksplit_fills(m, n, sms):
        return {"BN": 128, "GROUP_M": 8, "STAGES": 4, "TMA_STORE": 0, "KSPLIT": 1, "AHEAD": 1, "PAIR_SLOTS": 1}
    return {"BN": 128, "GROUP_M": 8, "STAGES": 3, "TMA_STORE": 1, "AHEAD": 1, "PAIR_SLOTS": 1}


WS_PINNED_BASE = {"BN": 128, "GROUP_M": 8, "STAGES": 4, "TMA_STORE": 1}  # what a pinned ws config leaves out


def ws_config(m: int, n: int, sms: int, block: tuple[int, int], config: dict | None) -> dict:
    """The "ws" launch's configuration: ``config`` (keys of ``WS_CONFIG_KEYS``) over :func:`ws_default_config`,
    checked. A pinned ``config`` is its own: the keys it leaves out come from ``WS_PINNED_BASE`` (128 × 128 tiles,
    4 stages, TMA store), not from the shape's default, so ``KSPLIT`` / ``AHEAD`` / ``PAIR_SLOTS`` apply only where it
    names them (a default's KSPLIT or slot count would otherwise land on, say, a pinned BN 256). Raises ValueError
    naming the problem: unknown keys, bk ≠ 128, BN not in (64, 128, 256) or not dividing into the weight blocks,
    KSPLIT / AHEAD with BN 256, fewer ring slots than one group holds at once (AHEAD: 2 without PAIR_SLOTS; KSPLIT:
    twice that, an even count), PAIR_SLOTS without AHEAD."""
    bn_s, bk = int(block[0]), int(block[1])
    defaults = ws_default_config(m, n, sms, bn_s) if config is None else WS_PINNED_BASE
    cfg = _over_defaults(defaults, config, WS_CONFIG_KEYS)
    if bk != 128 or cfg["BN"] not in (64, 128, 256) or bn_s % min(cfg["BN"], 128):
        raise ValueError(f"variant 'ws': needs bk = 128 and BN in (64, 128, 256) with min(BN, 128) dividing bn; "
                         f"got block {tuple(block)}, BN {cfg['BN']}")
    if (cfg.get("KSPLIT") or cfg.get("AHEAD")) and cfg["BN"] == 256:
        raise ValueError("config: KSPLIT and AHEAD take BN 64 or 128 (the 256-column form holds two accumulators)")
    if cfg.get("PAIR_SLOTS") and not cfg.get("AHEAD"):
        raise ValueError("config: PAIR_SLOTS needs AHEAD (a slot holds the pair of K blocks an AHEAD group takes)")
    if cfg.get("KSPLIT") and cfg["STAGES"] % 2:
        raise ValueError(f"config: KSPLIT splits the ring between the two groups; STAGES {cfg['STAGES']} must be even")
    # ring slots a group holds at once: a pair of K blocks (AHEAD), one slot with PAIR_SLOTS; under KSPLIT each group
    # has half of the STAGES slots
    need = (2 if cfg.get("AHEAD") and not cfg.get("PAIR_SLOTS") else 1) * (2 if cfg.get("KSPLIT") else 1)
    if cfg["STAGES"] < need:
        raise ValueError(f"config: STAGES {cfg['STAGES']} < {need}: the ring cannot hold the K blocks one group waits "
                         f"for at once (AHEAD pairs{', KSPLIT' if cfg.get('KSPLIT') else ''}); it would deadlock")
    return cfg


def _auto_variant(m, a, b, block, config, interpreted) -> str:
    """``variant="auto"``: on Hopper past 64 tokens with TMA-aligned operands "ws" when its 128 × 128 tiles fill
    ~90 % of the SMs or more, or its KSPLIT 64-row tiles fill one wave (:func:`_ksplit_fills`) (bk = 128, bn a
    multiple of 128, no configuration of another variant pinned), else "tma"; "portable" otherwise (and under the
    interpreter). H200: "ws" took 0.79-0.97x the time of "tma"'s default at all 9 prefill shapes of the sweep of
    518d14e (128-1536 tiles; results/sweep_fp8_gemm_ws_h200.json), but 1.23x at 512 x 2048 x 7168 (64 tiles: half
    the SMs idle; bench gemm of 15dad33), where KSPLIT took 0.78x (session 23: 19.6 against 25.0 µs)."""
    if m <= 64 or interpreted or not _tma_ok(a, b) or not _is_hopper(a.device):
        return "portable"
    n, sms = b.shape[0], num_sms(a.device)
    fills = cdiv(m, 128) * cdiv(n, 128) >= 0.9 * sms or _ksplit_fills(m, n, sms)
    ws_ok = fills and int(block[1]) == 128 and int(block[0]) % 128 == 0 and _gluon_available()
    return "ws" if ws_ok and set(config or {}) <= set(WS_CONFIG_KEYS) else "tma"


def _tma_ok(a, b) -> bool:
    """TMA descriptors need 16-byte aligned bases and row strides (the output is stored with plain stores)."""
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in (a, b))


def _check(a, a_scale, b, b_scale, block, out_dtype) -> tuple[int, int, int]:
    check_tensor("a", a, dtype=FP8, ndim=2, contiguous=True)
    check_tensor("a_scale", a_scale, dtype=torch.float32, ndim=2, contiguous=True)
    check_tensor("b", b, dtype=FP8, ndim=2)
    check_tensor("b_scale", b_scale, dtype=torch.float32, ndim=2, contiguous=True)
    check_same_device(a=a, a_scale=a_scale, b=b, b_scale=b_scale)
    if b.stride(-1) != 1:
        raise ValueError("b: the last dimension must be contiguous")
    bn, bk = (int(v) for v in block)
    if bn <= 0 or bk < 16 or bn & (bn - 1) or bk & (bk - 1):
        raise ValueError(f"block: {block} must be powers of two with bk >= 16")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype: {out_dtype} not supported, expected one of {OUT_DTYPES}")
    m, k = a.shape
    n = b.shape[0]
    if b.shape[1] != k:
        raise ValueError(f"b: shape {tuple(b.shape)} does not match a {tuple(a.shape)} (K differs)")
    check_divisible("K", k, bk, "the block width bk")
    if tuple(a_scale.shape) != (m, k // bk):
        raise ValueError(f"a_scale: shape {tuple(a_scale.shape)}, expected {(m, k // bk)}")
    if tuple(b_scale.shape) != (cdiv(n, bn), k // bk):
        raise ValueError(f"b_scale: shape {tuple(b_scale.shape)}, expected {(cdiv(n, bn), k // bk)}")
    return m, n, k


def fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
             block: tuple[int, int] = (128, 128), out_dtype: torch.dtype = torch.bfloat16, *,
             out: torch.Tensor | None = None, config: dict | None = None, variant: str = "auto") -> torch.Tensor:
    """C = A @ B.T with per-block scales.

    a: e4m3 [M, K] (contiguous); a_scale: fp32 [M, K/bk] (one scale per token and bk-wide group);
    b: e4m3 [N, K] (last dim contiguous); b_scale: fp32 [⌈N/bn⌉, K/bk]; K % bk == 0.
    Returns C: [M, N] ``out_dtype`` (written into ``out`` if given: contiguous, that shape and dtype).
    ``config`` (keys of ``CONFIG_KEYS``; for the portable kernel optionally ``SPLIT_K``, else ``kernel.split_k``
    of the config: K splits while the tiles give fewer than ~2 programs per SM; for ``variant="tma"`` optionally
    ``PERSISTENT``; for ``variant="ws"`` the keys of ``WS_CONFIG_KEYS``)
    pins a kernel configuration instead of the autotuned (portable) or default (``default_config``,
    ``ws_default_config``) one.
    ``variant``: "portable" (``kernel.py``), "tma" (``kernel_tma.py``: TMA-aligned a and b, CUDA sm_90 or the
    interpreter), "ws" (``kernel_ws.py``: TMA-aligned a and b, bk = 128, CUDA sm_90 only), or "auto": on Hopper
    for M > 64 with TMA-aligned a and b "ws" where its tiles fill the SMs (else "tma"), else "portable".
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant: {variant!r}, expected one of {VARIANTS}")
    m, n, k = _check(a, a_scale, b, b_scale, block, out_dtype)
    if out is not None:
        check_tensor("out", out, dtype=out_dtype, ndim=2, contiguous=True)
        check_same_device(a=a, out=out)
        if tuple(out.shape) != (m, n):
            raise ValueError(f"out: shape {tuple(out.shape)}, expected {(m, n)}")
    if not use_triton(a, a_scale, b, b_scale):
        c = fp8_gemm_reference(a, a_scale, b, b_scale, block, out_dtype)
        return c if out is None else out.copy_(c)
    c = torch.empty((m, n), dtype=out_dtype, device=a.device) if out is None else out
    if m == 0 or n == 0:
        return c
    interpreted = triton_interpreted()
    if variant == "auto":
        variant = _auto_variant(m, a, b, block, config, interpreted)
    if variant == "ws":
        return _launch_ws(a, a_scale, b, b_scale, c, block, config)
    if variant == "tma":
        return _launch_tma(a, a_scale, b, b_scale, c, block, config, interpreted)
    from .kernel import _fp8_gemm_kernel, fp8_gemm_autotuned, split_k, workspace_bounds

    if config is None and interpreted:
        config = {"BM": 32, "BN": 32, "GROUP_M": 4, "num_warps": 4, "num_stages": 1}
    bk, sms = int(block[1]), num_sms(a.device)
    if config is not None:
        config = dict(config)
        split = config.pop("SPLIT_K", None) or split_k(m, n, k, config["BM"], config["BN"], bk, sms)
        max_split, max_tiles = split, cdiv(m, config["BM"]) * cdiv(n, config["BN"])
    else:
        max_split, max_tiles = workspace_bounds(m, n, k, bk, sms)
    part, count = split_k_workspace(m, n, max_split, max_tiles, a.device)
    args = (a, a_scale, b, b_scale, c, part, count, m, n, k, a.stride(0), b.stride(0), c.stride(0), m * n,
            m_bucket(m), sms)
    common = dict(BN_S=int(block[0]), BK=bk, INTERPRET=interpreted)

    def grid(meta):
        return (cdiv(m, meta["BM"]) * cdiv(n, meta["BN"]), meta["SPLIT_K"])

    if config is None:
        fp8_gemm_autotuned[grid](*args, **common)
    else:
        meta = {**config, "SPLIT_K": split}
        _fp8_gemm_kernel[grid(meta)](*args, **common, **meta)
    return c


def _require_tma_aligned(variant: str, a, b) -> None:
    """The TMA variants' operand check: a and b TMA-aligned (:func:`_tma_ok`), else a ValueError naming it."""
    if not _tma_ok(a, b):
        raise ValueError(f"variant: '{variant}' needs a and b with 16-byte aligned data and row strides")


def _over_defaults(defaults: dict, config: dict | None, keys: tuple) -> dict:
    """``config`` over ``defaults``, its keys among ``keys`` (else a ValueError naming the unknown ones)."""
    cfg = {**defaults, **(config or {})}
    unknown = set(cfg) - set(keys)
    if unknown:
        raise ValueError(f"config: unknown keys {sorted(unknown)}, expected {keys}")
    return cfg


def _launch_tma(a, a_scale, b, b_scale, c, block, config, interpreted) -> torch.Tensor:
    from triton.tools.tensor_descriptor import TensorDescriptor

    from .kernel_tma import _fp8_gemm_tma_kernel

    m, k = a.shape
    n = b.shape[0]
    _require_tma_aligned("tma", a, b)
    cfg = _over_defaults(default_config(m), config, TMA_CONFIG_KEYS)
    bn_s, bk = int(block[0]), int(block[1])
    a_desc = TensorDescriptor.from_tensor(a, [cfg["BM"], bk])
    b_desc = TensorDescriptor.from_tensor(b, [cfg["BN"], bk])
    tiles = cdiv(m, cfg["BM"]) * cdiv(n, cfg["BN"])
    programs = min(tiles, num_sms(a.device)) if cfg["PERSISTENT"] else tiles
    _fp8_gemm_tma_kernel[(programs,)](
        a_desc, a_scale, b_desc, b_scale, c, m, n, k, c.stride(0), programs, BN_S=bn_s, BK=bk, BM=cfg["BM"],
        BN=cfg["BN"], GROUP_M=cfg["GROUP_M"], PERSISTENT=bool(cfg["PERSISTENT"]), STAGES=cfg["num_stages"],
        INTERPRET=interpreted,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return c


def _launch_ws(a, a_scale, b, b_scale, c, block, config) -> torch.Tensor:
    """The warp-specialized Gluon kernel (``kernel_ws.py``): Hopper only, TMA-aligned a and b, bn >= min(BN, 128)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .kernel_ws import _fp8_gemm_ws_kernel

    if not (_is_hopper(a.device) and not triton_interpreted()):
        raise ValueError("variant: 'ws' is a Gluon kernel for Hopper (sm_90) GPUs; the interpreter cannot run it")
    _require_tma_aligned("ws", a, b)
    m, k = a.shape
    n = b.shape[0]
    bn_s, bk = int(block[0]), int(block[1])
    cfg = ws_config(m, n, num_sms(a.device), block, config)
    sub_n = min(cfg["BN"], 128)  # one wgmma's columns: BN = 256 runs two 128-column halves
    ksplit, ahead, pairs = (bool(cfg.get(key, 0)) for key in ("KSPLIT", "AHEAD", "PAIR_SLOTS"))
    bm = 64 if ksplit else 128
    a_layout = gl.NVMMASharedLayout.get_default_for([bm, bk], gl.float8e4nv)
    b_layout = gl.NVMMASharedLayout.get_default_for([sub_n, bk], gl.float8e4nv)
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk], a_layout)
    b_desc = TensorDescriptor.from_tensor(b, [sub_n, bk], b_layout)  # BN = 256: two boxes per K block
    # 16-bit outputs with TMA-aligned rows leave through shared memory by TMA (64 rows per consumer warp group)
    tma_store = c.element_size() == 2 and cfg["TMA_STORE"] and _tma_ok(c, c)
    c_desc = None
    if tma_store:
        c_gl = gl.bfloat16 if c.dtype == torch.bfloat16 else gl.float16
        c_desc = TensorDescriptor.from_tensor(c, [64, sub_n], gl.NVMMASharedLayout.get_default_for([64, sub_n], c_gl))
    tiles = cdiv(m, bm) * cdiv(n, cfg["BN"])
    _fp8_gemm_ws_kernel[(min(tiles, num_sms(a.device)),)](
        a_desc, a_scale, b_desc, b_scale, c, c_desc, m, n, k, c.stride(0), BN_S=bn_s, BM=bm, BN=cfg["BN"], BK=bk,
        GROUP_M=cfg["GROUP_M"], STAGES=cfg["STAGES"], TMA_STORE=bool(tma_store), KSPLIT=ksplit, AHEAD=ahead,
        PAIR_SLOTS=pairs, num_warps=4)
    return c

