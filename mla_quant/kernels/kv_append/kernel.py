"""Triton kernel of ``kv_append``: each program quantizes BLOCK_T rows and stores them at their slots.
Rounding follows ``kv_layout.quantize_kv_rows`` op for op: the scale by ``div_rn``, then each value times the
scale's reciprocal rounded once per row / tile (not a per-element division, which rounds differently), saturating
e4m3 casts, ue8m0 tile scales."""
import triton
import triton.language as tl

from .._triton_utils import cast_fp8_saturating, finite_abs, fp8_scale, reciprocal

KIND_BF16 = tl.constexpr(0)  # index in kv_layout.KV_KINDS
KIND_FP8_E4M3 = tl.constexpr(1)
KIND_FP8_DS_MLA = tl.constexpr(2)


@triton.jit
def _kv_append_kernel(rows_ptr, slot_ptr, data_ptr, scale_ptr, T, stride_row, num_slots,
                      D_LATENT: tl.constexpr, D_ROPE: tl.constexpr, WIDTH: tl.constexpr,
                      KIND: tl.constexpr, PER_TOKEN: tl.constexpr, TILE: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_ptr + t, mask=t < T, other=-1).to(tl.int64)
    valid = (t < T) & (slot >= 0) & (slot < num_slots)  # out-of-range slots are never written
    cl = tl.arange(0, BLOCK_L)
    cr = tl.arange(0, BLOCK_R)
    m_lat = valid[:, None] & (cl < D_LATENT)[None, :]
    m_rope = valid[:, None] & (cr < D_ROPE)[None, :]
    src = rows_ptr + t[:, None] * stride_row
    lat = tl.load(src + cl[None, :], mask=m_lat, other=0.0).to(tl.float32)      # [BLOCK_T, BLOCK_L]
    rope = tl.load(src + D_LATENT + cr[None, :], mask=m_rope, other=0.0).to(tl.float32)  # [BLOCK_T, BLOCK_R]
    dst = data_ptr + slot[:, None] * WIDTH

    if KIND == KIND_BF16:
        tl.store(dst + cl[None, :], lat.to(tl.bfloat16), mask=m_lat)
        tl.store(dst + D_LATENT + cr[None, :], rope.to(tl.bfloat16), mask=m_rope)
    elif KIND == KIND_FP8_E4M3:
        if PER_TOKEN:  # one scale over the whole row (latent and rope)
            amax = tl.maximum(tl.max(finite_abs(lat), axis=1), tl.max(finite_abs(rope), axis=1))
            s = fp8_scale(amax, False)
            tl.store(scale_ptr + slot, s, mask=valid)
            r = reciprocal(s)[:, None]
        else:
            r = reciprocal(tl.load(scale_ptr))
        tl.store(dst + cl[None, :], cast_fp8_saturating(lat * r), mask=m_lat)
        tl.store(dst + D_LATENT + cr[None, :], cast_fp8_saturating(rope * r), mask=m_rope)
    else:  # fp8_ds_mla: [e4m3 latent | fp32 ue8m0 tile scales | bf16 rope], bytes
        N_TILES: tl.constexpr = BLOCK_L // TILE
        tiles = tl.reshape(lat, (BLOCK_T, N_TILES, TILE))
        s = fp8_scale(tl.max(finite_abs(tiles), axis=2), True)                     # [BLOCK_T, N_TILES]
        q = tl.reshape(cast_fp8_saturating(tiles * reciprocal(s)[:, :, None]), (BLOCK_T, BLOCK_L))
        tl.store(dst + cl[None, :], q.to(tl.uint8, bitcast=True), mask=m_lat)
        ct = tl.arange(0, N_TILES)
        scale_dst = (dst + D_LATENT).to(tl.pointer_type(tl.float32))
        tl.store(scale_dst + ct[None, :], s, mask=valid[:, None] & (ct * TILE < D_LATENT)[None, :])
        rope_dst = (dst + D_LATENT + 4 * (D_LATENT // TILE)).to(tl.pointer_type(tl.bfloat16))
        tl.store(rope_dst + cr[None, :], rope.to(tl.bfloat16), mask=m_rope)
