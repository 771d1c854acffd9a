"""The INT4 *half2 GEMV* core: one activation row against INT4 words with fp16x2 arithmetic (``HFMA2``),
about half the instructions per weight of the fp32 plane GEMV (``_gemm_utils``; docs/moe.md "The half2 GEMV").

Activations in *pair order* (``pair_order``), per row:

* ``pairs`` int32 ``[R, plane_width(K) / 2]``: in block b of 256 K (32 words), *pair plane* i (i = 0..3) holds,
  for each of the block's words w, the fp16 pair ``(x[8w + i], x[8w + i + 4]) · 2^-e(r)`` (low lane first) at
  ``128b + 32i + w % 32``; zeros past K. A run of 4 words (32 K) is 16 contiguous bytes in every pair plane.
* ``scales`` fp32 ``[R, plane_width(K) / 32]``: ``2^e(r)`` of each run r = k // 32, the power of two that puts
  the run's largest magnitude m in [128, 256) (``e = floor(log2 m) - 7``, clamped to [-126, 121]).

Why the pairs: nibbles i and i + 4 of a word sit in bits 4i and 16 + 4i, the two 16-bit lanes of
``w >> 4i``; ``(w & 0x000F000F) | 0x64006400`` read as f16x2 is (1024 + n_i, 1024 + n_{i+4}) and one
``sub.f16x2`` of 1032 makes the codes n - 8 exactly (``0x00F000F0``: 1024 + 16n, one ``fma.f16x2`` by 1/16 and
-72), so a pair of weights costs one LOP3, one conversion and one HFMA2 against the pair of activations.

Numerics: each run's 16 products per lane (|n - 8| ≤ 8, |x · 2^-e| < 256, so every partial sum stays below
2^15, far from fp16's 65504) accumulate in fp16 in two chains of 8 (words 0-1 and 2-3), which add in f16x2;
the two lanes then add in fp32, and the run sum is scaled by ``2^e · group scale`` in fp32. The products are
exact; each fp16 addition rounds to 11 significant bits (the fp32 plane GEMV rounds at 24), so a row's result
carries a relative error of about 2^-11 · √16 of its runs' magnitudes: bf16-level, for bf16 / fp16 activations
(fp32 activations keep the plane GEMV). bf16 activations become fp16 pair lanes exactly unless they are below
2^-24 of their run's largest (fp16 subnormals).
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from ._gemm_utils import PLANE_BLOCK_K, ld4, plane_width
from ._pdl import pdl_launch
from ._triton_utils import grid_dependency_sync, rounded_to

PAIR_BLOCK = tl.constexpr(PLANE_BLOCK_K // 2)  # int32 pairs per block of 256 K (4 pair planes of 32 words)
RUN_K = 32  # K per run: 4 words, the unit of one run sum and one activation scale
PAIR_ORDER_PDL = True  # pair_order launched with PDL (where _pdl allows it); a sweep setting


@triton.jit
def pair_offsets(run):
    """Position (int32 units) of pair plane 0 of run ``run``'s first word in a :func:`pair_order` row; pair plane
    i is 32·i further, the run's 4 words are consecutive."""
    return run // 8 * PAIR_BLOCK + run % 8 * 4


@triton.jit
def run_exponent(m):
    """For the largest magnitude ``m`` (fp32) of a run: ``(2^-e, 2^e)`` in fp32 with ``m · 2^-e`` in [128, 256),
    e = floor(log2 m) - 7 clamped to [-126, 121] (zero and subnormal m take 2^126; inf / NaN stay so)."""
    biased = (m.to(tl.int32, bitcast=True) >> 23) & 0xFF
    e = tl.minimum(tl.maximum(biased - 134, -126), 121)
    return ((127 - e) << 23).to(tl.float32, bitcast=True), ((127 + e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def f16_pairs(v):
    """fp32 ``v`` [..., 2] -> int32 [...]: the two values rounded to fp16, element 0 in the low lane."""
    bits = v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    lo, hi = tl.split(bits)
    return lo | (hi << 16)


@triton.jit
def _pair_order_kernel(src_ptr, up_ptr, dst_ptr, scale_ptr, K, stride_src, stride_up, stride_dst, stride_scale,
                       PDL: tl.constexpr, SWIGLU: tl.constexpr = False):
    # program (row, block b of 256 K): x as [run r, plane i, word u, lane l], k = 256b + 8(4r + u) + i + 4l.
    # SWIGLU: x = silu(src) * up in fp32, rounded once to src's dtype (the h of a SwiGLU MLP).
    grid_dependency_sync(PDL)
    row = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    r = tl.arange(0, 8)[:, None, None, None]
    i = tl.arange(0, 4)[None, :, None, None]
    u = tl.arange(0, 4)[None, None, :, None]
    lane = tl.arange(0, 2)[None, None, None, :]
    k = b * 256 + 8 * (4 * r + u) + i + 4 * lane
    x = tl.load(src_ptr + row * stride_src + k, mask=k < K, other=0.0).to(tl.float32)
    if SWIGLU:
        up = tl.load(up_ptr + row * stride_up + k, mask=k < K, other=0.0).to(tl.float32)
        x = rounded_to(x * tl.sigmoid(x) * up, src_ptr.dtype.element_ty)
    m = tl.max(tl.max(tl.max(tl.abs(x), axis=3), axis=2), axis=1)  # [8]: each run's largest magnitude
    down, up = run_exponent(m)
    pairs = f16_pairs(x * down[:, None, None, None])  # [8, 4, 4] (r, i, u)
    pos = b * PAIR_BLOCK + 32 * tl.arange(0, 4)[None, :, None] + 4 * tl.arange(0, 8)[:, None, None] \
        + tl.arange(0, 4)[None, None, :]
    tl.store(dst_ptr + row * stride_dst + pos, pairs)
    tl.store(scale_ptr + row * stride_scale + b * 8 + tl.arange(0, 8), up)


def pair_order(a: torch.Tensor, hold_next: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, K] activations (last dim contiguous) -> ``(pairs, scales)`` in pair order (module docstring):
    int32 [R, plane_width(K) / 2] and fp32 [R, plane_width(K) / 32]. One small Triton launch, with PDL on Hopper
    (``_pdl``: scheduled while the kernel before it runs, e.g. the gate-up GEMV whose h it orders).
    ``hold_next``: its programs let the next kernel be scheduled only after their wait has returned, so that
    kernel starts after every kernel before this launch has finished (it may then read their outputs, e.g. the
    routing, before its own wait)."""
    return _pair_order_launch(a, None, hold_next)


def pair_order_swiglu(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``pair_order(h)`` of a SwiGLU MLP's h = silu(gate) · up, in the same launch (the launcher of
    ``w4a16_gemm.swiglu_pair_order``, which checks its inputs): gate, up [R, K] bf16 / fp16
    (same shape and dtype, last dim contiguous); h is computed in fp32 and rounded once to gate's dtype, then put
    in pair order (what the down projection's half2 GEMV reads). ``swiglu_pair_order_reference`` is its torch form."""
    return _pair_order_launch(gate, up, False)


def _pair_order_launch(a: torch.Tensor, up: torch.Tensor | None, hold_next: bool):
    rows, k = a.shape
    width = plane_width(k)
    pairs = torch.empty((rows, width // 2), dtype=torch.int32, device=a.device)
    scales = torch.empty((rows, width // RUN_K), dtype=torch.float32, device=a.device)
    if rows and k:
        pdl = pdl_launch(a.device, "pair_order") if PAIR_ORDER_PDL else {"PDL": False}
        if hold_next and pdl["PDL"]:
            pdl = {**pdl, "PDL": 1}  # wait, then signal (_triton_utils.grid_dependency_sync)
        src_up = a if up is None else up
        _pair_order_kernel[(rows, width // PLANE_BLOCK_K)](a, src_up, pairs, scales, k, a.stride(0), src_up.stride(0),
                                                           pairs.stride(0), scales.stride(0), num_warps=2,
                                                           SWIGLU=up is not None, **pdl)
    return pairs, scales


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """h = silu(gate) · up in fp32, rounded once to gate's dtype (the h that ``swiglu_pair_order`` orders)."""
    g = gate.float()
    return (g * torch.sigmoid(g) * up.float()).to(gate.dtype)


def swiglu_pair_order_reference(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch form of :func:`swiglu_pair_order` (for tests; the sigmoid's exp may differ from the kernel's in the
    last fp32 bit, which moves an h value by one unit of its dtype where it rounds across a tie)."""
    return pair_order_reference(swiglu_reference(gate, up))


def pair_values(pairs: torch.Tensor, scales: torch.Tensor, k: int) -> torch.Tensor:
    """fp32 [R, K] values that ``(pairs, scales)`` hold (the inverse of :func:`pair_order_reference`, exact for
    any x whose runs hold no fp16 subnormals after their scaling)."""
    rows, width = pairs.shape[0], 2 * pairs.shape[1]
    blocks = pairs.view(rows, width // PLANE_BLOCK_K, 4, 8, 4).permute(0, 1, 3, 4, 2)  # block, r, u, i
    lanes = torch.stack([blocks & 0xFFFF, (blocks >> 16) & 0xFFFF], dim=-2)  # block, r, u, lane, i
    half = (lanes - (lanes >> 15 << 16)).to(torch.int16).view(torch.float16).float()  # the lanes' fp16 bits
    x = half.reshape(rows, width // RUN_K, 32) * scales[..., None]
    return x.reshape(rows, width)[:, :k]


def pair_order_reference(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch form of :func:`pair_order` (bit-exact; for tests)."""
    rows, k = a.shape
    width = plane_width(k)
    x = torch.nn.functional.pad(a.float(), (0, width - k)).view(rows, width // RUN_K, 4, 2, 4)  # run, u, lane, i
    m = x.abs().amax(dim=(2, 3, 4))
    biased = (m.view(torch.int32) >> 23) & 0xFF
    e = (biased - 134).clamp(-126, 121)
    down = ((127 - e) << 23).view(torch.float32)
    up = ((127 + e) << 23).view(torch.float32)
    h = (x * down[..., None, None, None]).to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    pairs = h[:, :, :, 0, :] | (h[:, :, :, 1, :] << 16)  # [R, runs, u, i]
    blocks = pairs.view(rows, width // PLANE_BLOCK_K, 8, 4, 4).permute(0, 1, 4, 2, 3)  # block, i, r, u
    return blocks.reshape(rows, width // 2).contiguous(), up


def _run_asm() -> str:
    """PTX of one run: inputs $1-$4 the run's 4 words, $5 + 4i + u pair plane i of word u; output the run sum
    Σ (n - 8) · x' in fp32 (two fp16 chains: words 0-1, words 2-3)."""
    lines = ["{", ".reg .b32 t, s, q, a0, a1, lo4, hi4, magic, c1032, inv16, m72;", ".reg .b16 l, h;",
             ".reg .f32 fl, fh;", "mov.b32 lo4, 0x000F000F;", "mov.b32 hi4, 0x00F000F0;", "mov.b32 magic, 0x64006400;",
             "mov.b32 c1032, 0x64086408;", "mov.b32 inv16, 0x2C002C00;", "mov.b32 m72, 0xD480D480;",
             "mov.b32 a0, 0;", "mov.b32 a1, 0;"]
    for u in range(4):
        acc, word = ("a0" if u < 2 else "a1"), f"${1 + u}"
        for i in range(4):
            if i == 2:
                lines.append(f"shr.u32 s, {word}, 8;")
            src = word if i < 2 else "s"
            lines.append(f"lop3.b32 t, {src}, {'lo4' if i % 2 == 0 else 'hi4'}, magic, 0xEA;")  # (a & b) | c
            lines.append("sub.rn.f16x2 q, t, c1032;" if i % 2 == 0 else "fma.rn.f16x2 q, t, inv16, m72;")
            lines.append(f"fma.rn.f16x2 {acc}, q, ${5 + 4 * i + u}, {acc};")
    lines += ["add.rn.f16x2 a0, a0, a1;", "mov.b32 {l, h}, a0;", "cvt.f32.f16 fl, l;", "cvt.f32.f16 fh, h;",
              "add.f32 $0, fl, fh;", "}"]
    return "\n".join(lines)


RUN_ASM = tl.constexpr(_run_asm())


def run_dot_reference(words: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """What the PTX of :func:`run_dot` computes, bit for bit, in numpy (for the GPU test of that block).

    ``words`` int32 [R, 4] (a run's 4 words), ``pairs`` int32 [R, 16] (pair plane i of word u at 4i + u) -> fp32
    [R]. Each ``fma.rn.f16x2`` is one rounding of the exact a·b + c to fp16 (exact in float64, then numpy's
    direct float64 -> float16 rounding), lane by lane: chain 0 takes words 0-1, chain 1 words 2-3, each word's
    planes i = 0..3 in turn; the chains add in fp16, the two lanes in fp32."""
    w = words.cpu().numpy().astype(np.int64) & 0xFFFFFFFF
    p = pairs.cpu().numpy().astype(np.int64) & 0xFFFFFFFF
    lanes = [(p & 0xFFFF).astype(np.uint16).view(np.float16), (p >> 16).astype(np.uint16).view(np.float16)]
    total = np.zeros(w.shape[0], dtype=np.float32)
    for lane, x in enumerate(lanes):
        chains = []
        for words_of_chain in ((0, 1), (2, 3)):
            acc = np.zeros(w.shape[0], dtype=np.float16)
            for u in words_of_chain:
                for i in range(4):
                    code = ((w[:, u] >> (4 * i + 16 * lane)) & 0xF).astype(np.float64) - 8.0
                    acc = (code * x[:, 4 * i + u].astype(np.float64) + acc.astype(np.float64)).astype(np.float16)
            chains.append(acc)
        run = (chains[0].astype(np.float64) + chains[1].astype(np.float64)).astype(np.float16)
        total = total + run.astype(np.float32)
    return torch.from_numpy(total)


@triton.jit
def load_pairs(ptrs, INTERPRET: tl.constexpr):
    """The 4 pair planes of a run's 4 words (``ptrs``: :func:`pair_offsets` of the run in a pair-order row) as
    16 int32 tensors, pair plane i of word u at index 4i + u."""
    if INTERPRET:
        p0 = (tl.load(ptrs), tl.load(ptrs + 1), tl.load(ptrs + 2), tl.load(ptrs + 3))
        p1 = (tl.load(ptrs + 32), tl.load(ptrs + 33), tl.load(ptrs + 34), tl.load(ptrs + 35))
        p2 = (tl.load(ptrs + 64), tl.load(ptrs + 65), tl.load(ptrs + 66), tl.load(ptrs + 67))
        p3 = (tl.load(ptrs + 96), tl.load(ptrs + 97), tl.load(ptrs + 98), tl.load(ptrs + 99))
    else:
        p0 = ld4(ptrs, CONSTANT=False)
        p1 = ld4(ptrs + 32, CONSTANT=False)
        p2 = ld4(ptrs + 64, CONSTANT=False)
        p3 = ld4(ptrs + 96, CONSTANT=False)
    return p0 + p1 + p2 + p3


def _inline_pairs_asm(fp16: bool) -> str:
    """PTX of :func:`inline_pairs` for one run: inputs $17-$32 the run's 32 activations as 16 words (two bf16 /
    fp16 each, element 2j low in word j); outputs $0-$15 pair plane i of word u at 4i + u (as :func:`load_pairs`)
    and $16 the run scale 2^e (fp32 bits), computed as :func:`pair_order` does: fp32 values, their largest
    magnitude (``max.f32`` skips NaN, as ``tl.max``), e from its exponent, x · 2^-e rounded to fp16."""
    lines = ["{", ".reg .b32 v<32>, m, a, e, t, dn, lo, hi;"] + ([".reg .b16 h0, h1;"] if fp16 else [])
    for j in range(16):  # unpack: v[2j] = element 2j (low half of word j), v[2j + 1] = element 2j + 1
        w = f"${17 + j}"
        if fp16:
            lines += [f"mov.b32 {{h0, h1}}, {w};", f"cvt.f32.f16 v{2 * j}, h0;", f"cvt.f32.f16 v{2 * j + 1}, h1;"]
        else:
            lines += [f"shl.b32 v{2 * j}, {w}, 16;", f"and.b32 v{2 * j + 1}, {w}, 0xFFFF0000;"]
    lines.append("abs.f32 m, v0;")
    for q in range(1, 32):
        lines += [f"abs.f32 a, v{q};", "max.f32 m, m, a;"]
    lines += ["bfe.u32 e, m, 23, 8;", "sub.s32 e, e, 134;", "max.s32 e, e, -126;", "min.s32 e, e, 121;",
              "neg.s32 t, e;", "add.s32 t, t, 127;", "shl.b32 dn, t, 23;", "add.s32 t, e, 127;", "shl.b32 $16, t, 23;"]
    for u in range(4):
        for i in range(4):  # the pair (x[8u + i], x[8u + i + 4]) · 2^-e, low lane first
            lines += [f"mul.f32 lo, v{8 * u + i}, dn;", f"mul.f32 hi, v{8 * u + i + 4}, dn;",
                      f"cvt.rn.f16x2.f32 ${4 * i + u}, hi, lo;"]
    lines.append("}")
    return "\n".join(lines)


INLINE_PAIRS_BF16 = tl.constexpr(_inline_pairs_asm(False))
INLINE_PAIRS_FP16 = tl.constexpr(_inline_pairs_asm(True))
INLINE_PAIRS_CONSTRAINTS = tl.constexpr("=r," * 17 + ",".join(["r"] * 16))


@triton.jit
def _interpreted_pair(bits, k, down, Q: tl.constexpr):
    """Interpreter form of one pair of :func:`inline_pairs`: elements Q and Q + 4 of each run (``bits``: the fp32
    values' bits [..., 32], ``k`` its last index; picked by an integer sum, which keeps -0 and NaN as they are) times
    ``down``, as fp16 lanes of an int32."""
    lo = tl.sum(tl.where(k == Q, bits, 0), axis=2).to(tl.float32, bitcast=True) * down
    hi = tl.sum(tl.where(k == Q + 4, bits, 0), axis=2).to(tl.float32, bitcast=True) * down
    lo16 = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi16 = hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return lo16 | (hi16 << 16)


def inline_pairs_ok(a: torch.Tensor) -> bool:
    """Whether :func:`inline_pairs` can read the rows of ``a`` [R, K] as they are: bf16 / fp16, last dim contiguous,
    every row at a 16-byte aligned address, K a multiple of 32 (whole runs). Otherwise :func:`pair_order` first."""
    return (a.dtype in (torch.bfloat16, torch.float16) and a.dim() == 2 and a.stride(1) == 1
            and a.data_ptr() % 16 == 0 and (a.stride(0) * a.element_size()) % 16 == 0 and a.shape[1] % RUN_K == 0)


@triton.jit
def inline_pairs(x_ptr, run, INTERPRET: tl.constexpr):
    """Run ``run`` of the activation row at ``x_ptr`` (bf16 / fp16, 16-byte aligned) in pair order, made in
    registers: 17 tensors, the 16 pair planes of :func:`load_pairs` (index 4i + u) and at 16 the run scale 2^e
    (fp32), bit for bit what :func:`pair_order` writes for that run — so a GEMV needs no pair-order launch.
    The run's 64 bytes come in four coherent 128-bit loads (they are activations: read after any PDL wait)."""
    if INTERPRET:
        k = tl.arange(0, 32)[None, None, :]
        x = tl.load(x_ptr + 32 * run[:, :, None] + k).to(tl.float32)
        down, up = run_exponent(tl.max(tl.abs(x), axis=2))
        x = x.to(tl.int32, bitcast=True)
        pairs = (_interpreted_pair(x, k, down, 0), _interpreted_pair(x, k, down, 8),
                 _interpreted_pair(x, k, down, 16), _interpreted_pair(x, k, down, 24),
                 _interpreted_pair(x, k, down, 1), _interpreted_pair(x, k, down, 9),
                 _interpreted_pair(x, k, down, 17), _interpreted_pair(x, k, down, 25),
                 _interpreted_pair(x, k, down, 2), _interpreted_pair(x, k, down, 10),
                 _interpreted_pair(x, k, down, 18), _interpreted_pair(x, k, down, 26),
                 _interpreted_pair(x, k, down, 3), _interpreted_pair(x, k, down, 11),
                 _interpreted_pair(x, k, down, 19), _interpreted_pair(x, k, down, 27), up)
        return pairs
    words = x_ptr.to(tl.pointer_type(tl.int32)) + 16 * run
    w0 = ld4(words, CONSTANT=False)
    w1 = ld4(words + 4, CONSTANT=False)
    w2 = ld4(words + 8, CONSTANT=False)
    w3 = ld4(words + 12, CONSTANT=False)
    ASM: tl.constexpr = INLINE_PAIRS_FP16 if x_ptr.dtype.element_ty == tl.float16 else INLINE_PAIRS_BF16
    return tl.inline_asm_elementwise(ASM, INLINE_PAIRS_CONSTRAINTS,
                                     [w0[0], w0[1], w0[2], w0[3], w1[0], w1[1], w1[2], w1[3],
                                      w2[0], w2[1], w2[2], w2[3], w3[0], w3[1], w3[2], w3[3]],
                                     dtype=(tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32,
                                            tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32,
                                            tl.int32, tl.int32, tl.float32), is_pure=True, pack=1)


@triton.jit
def _lane(p, HIGH: tl.constexpr):
    """fp16 lane of int32 pairs ``p`` as fp32 (interpreter path)."""
    bits = (p >> 16) & 0xFFFF if HIGH else p & 0xFFFF
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def run_dot(w, x, INTERPRET: tl.constexpr):
    """Σ over a run's 32 K of (n - 8) · x' in fp32, for words ``w`` (4 tensors, ``_gemm_utils.four_words``) and pairs
    ``x`` (16 tensors, :func:`load_pairs`, broadcastable to the words). On the GPU one inline-PTX block of
    fp16x2 arithmetic (module docstring); interpreted, the same products summed in fp32."""
    if INTERPRET:
        acc = tl.zeros(w[0].shape, dtype=tl.float32)
        for u in tl.static_range(4):
            for i in tl.static_range(4):
                lo = ((w[u] >> (4 * i)) & 0xF).to(tl.float32) - 8.0
                hi = ((w[u] >> (4 * i + 16)) & 0xF).to(tl.float32) - 8.0
                acc += lo * _lane(x[4 * i + u], False) + hi * _lane(x[4 * i + u], True)
        return acc
    return tl.inline_asm_elementwise(RUN_ASM, "=r" + ",r" * 20, [w[0], w[1], w[2], w[3], x[0], x[1], x[2], x[3],
                                                              x[4], x[5], x[6], x[7], x[8], x[9], x[10], x[11],
                                                              x[12], x[13], x[14], x[15]],
                                     dtype=tl.float32, is_pure=True, pack=1)
