"""One-program-per-row Triton select for ``topk_indices(method="row")``: the k largest of a row of scores, exactly,
as a set, in ONE launch with no memset and no atomics (one program owns its row and keeps every counter in
registers). Keys are ``kernel._order_key``'s order-preserving int32 form of the scores.

Why not a full-row histogram: ``tl.histogram`` lowers to one warp ballot per digit bit plus, per element, a
mask and a popcount for every bin the thread owns (Triton 3.6, sm_90 PTX): ~110 instructions per element at
256 bins, ~50 at 32, ~128 popcounts alone at 4096. One program (one SM, ≤ 4 warp instructions per cycle) over
a 64k row at 256 bins would issue ~2048 warp-slots × 110 / 4 ≈ 56k cycles ≈ 30 µs per round, and an 11-12-bit
first digit (the natural width for fp32 scores: the top 8 bits are sign + 7 exponent bits, a handful of bins
for real scores) is 16x worse. So the full row is read only by passes of a few compares per element, and the
histograms run on a sample and on the short candidate list:

1. **Pivot from a sample** (``SAMPLE`` keys at evenly spaced columns, in registers): two 8-bit histogram rounds
   find the top 16 bits of the sample's ``sample_rank``-th largest key (the host sets that rank ~3σ above the
   k·SAMPLE/N expected above the true threshold); ``lo`` = the smallest key with those 16 bits, so that for
   scores spread like the indexer's about 50·N/SAMPLE keys of a row are ≥ lo (≈ 3k of 64k at SAMPLE 1024),
   and k of them with overwhelming probability. ``lo`` never falls below the smallest key above -inf
   (``FLOOR``): masked columns never become candidates.
2. **Candidate pass** over the row in ``TILE``-column tiles: the columns of keys ≥ lo are appended to the
   row's list (a [N] int32 row of scratch: an exclusive prefix sum within the tile plus a running count; sized
   N, so a row of equal keys still fits; fixed by the shape, so CUDA-graph safe), tracking their max. If
   fewer than k keys are ≥ lo and lo was above FLOOR (the sample misjudged the row, e.g. a period that
   aliases with the sample's stride), the pass is repeated with lo = FLOOR: slower, still exact.
3. **Rounds on the list** (``LIST_TILE`` entries at a time, scores gathered from L2 by column): with [lo, hi]
   bounding the list's keys, the digit is the 8 bits below their common prefix (at most 4 rounds for 32 bits,
   usually 3); one pass histograms it, a second writes the columns of keys in bins above the threshold bin
   straight to the output (running slot counter) and compacts the threshold bin's columns in place to the
   front of the list (an entry only moves to an index ≤ its own, and each tile is loaded before the scan
   that places it), tracking the new exact min and max. When the list's keys are all equal (min = max: the
   threshold is exact), or the candidate pass found ≤ k keys, the first ``need`` list entries fill the
   remaining slots; slots left after that (rows with fewer than k scores above -inf) get -1.

Expected cost at one 64k row (k = 2048, 16 warps, not yet measured): the candidate pass reads 256 KB (from
L2, once the scores kernel wrote it) at ~14 instructions per element, ~7k cycles ≈ 4 µs; the sample's two
histograms ~1 µs; the list rounds ~2-3 µs (~3k entries, then ~50, then a few); one launch. About 9 µs where the
multi-program radix (``kernel.py``) measured 19.5 µs, and no memset. Many rows: one program per row (64 rows of
64k: 64 SMs at once), the SGLang / vLLM DSA design.
"""
import triton
import triton.language as tl

from .kernel import SIGN, _order_key

FLOOR = tl.constexpr(-2 ** 31 + 0x7FFFFF + 1)   # _order_key(-FLT_MAX): the smallest key above -inf
KEY_MIN = tl.constexpr(-2 ** 31)
KEY_MAX = tl.constexpr(2 ** 31 - 1)
BINS = tl.constexpr(256)                         # 8-bit digits
DIGIT = tl.constexpr(8)


@triton.jit
def _bin_of_rank(hist, r, B: tl.constexpr):
    """For digit counts ``hist`` [B] and 1 ≤ r ≤ sum(hist): the bin t holding the r-th largest counted key and
    r minus the count in bins above t (the rank it has inside bin t)."""
    b = tl.arange(0, B)
    at_or_above = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist
    t = tl.max(tl.where(at_or_above >= r, b, -1), 0)
    return t, r - tl.sum(tl.where(b > t, hist, 0), 0)


@triton.jit
def _bit_length(x):
    """Significant bits of the int32 scalar x read as unsigned (0 for 0)."""
    u = x.to(tl.uint32, bitcast=True)
    bits = tl.zeros([], dtype=tl.int32)
    for s in tl.static_range(5):
        high = u >> (16 >> s)
        big = high != 0
        bits += tl.where(big, 16 >> s, 0)
        u = tl.where(big, high, u)
    return bits + (u != 0).to(tl.int32)


@triton.jit
def _list_keys(src, lst, start, count, LIST_TILE: tl.constexpr):
    """Entries [start, start + LIST_TILE) of the candidate list: (index, valid, column, key)."""
    i = start + tl.arange(0, LIST_TILE)
    valid = i < count
    col = tl.load(lst + i, mask=valid, other=0, cache_modifier=".cg")   # written by this program: read from L2
    key = _order_key(tl.load(src + col, mask=valid, other=0.0).to(tl.float32))
    return i, valid, col, key


@triton.jit
def _row_topk_kernel(scores_ptr, stride_row, list_ptr, out_ptr, stride_out, n, k, sample_rank,
                     TILE: tl.constexpr, LIST_TILE: tl.constexpr, SAMPLE: tl.constexpr):
    """Grid (rows,): the top-k columns of row ``program_id`` (N = n > k) into out[row, :k] (unordered);
    ``list_ptr``: int32 [rows, n] scratch (uninitialised)."""
    row = tl.program_id(0).to(tl.int64)
    src = scores_ptr + row * stride_row
    lst = list_ptr + row * n
    out = out_ptr + row * stride_out

    # 1. pivot: the top 16 bits of the sample's sample_rank-th largest key
    pick = (tl.arange(0, SAMPLE).to(tl.int64) * n) // SAMPLE
    su = _order_key(tl.load(src + pick).to(tl.float32)) ^ SIGN       # unsigned-order bit patterns
    top = (su >> 24) & 255
    t1, rem = _bin_of_rank(tl.histogram(top, BINS), sample_rank, BINS)
    t2, rem = _bin_of_rank(tl.histogram((su >> 16) & 255, BINS, mask=top == t1), rem, BINS)
    lo = tl.maximum(((t1 << 24) | (t2 << 16)) ^ SIGN, FLOOR)

    # 2. candidate pass: the list = the columns of keys >= lo (again with lo = FLOOR if fewer than k were)
    m = tl.zeros([], dtype=tl.int32)
    hi = tl.full([], KEY_MIN, tl.int32)
    scan = tl.zeros([], dtype=tl.int32) + n
    offs = tl.arange(0, TILE)
    for attempt in range(2):
        for start in range(0, scan, TILE):
            cols = start + offs
            valid = cols < n
            key = _order_key(tl.load(src + cols, mask=valid, other=0.0).to(tl.float32))
            take = valid & (key >= lo)
            t = take.to(tl.int32)
            tl.store(lst + m + tl.cumsum(t, 0) - t, cols, mask=take)
            m += tl.sum(t, 0)
            hi = tl.maximum(hi, tl.max(tl.where(take, key, KEY_MIN), 0))
        retry = (m < k) & (lo > FLOOR)
        scan = tl.where(retry, n, 0)
        m = tl.where(retry, 0, m)
        hi = tl.where(retry, KEY_MIN, hi)
        lo = tl.where(retry, FLOOR, lo)
    tl.debug_barrier()   # the list is read below by other threads than the ones that wrote it

    # 3. rounds on the list: invariant lo <= every list key <= hi, 1 <= need <= m (unless taking all)
    take_all = m <= k                           # the pass found at most k keys above -inf: all selected
    select = m > k                              # not take_all
    need = tl.where(take_all, m, tl.zeros([], dtype=tl.int32) + k)
    pos = tl.zeros([], dtype=tl.int32)          # output slots written
    done = tl.zeros([], dtype=tl.int32)
    for it in range(5):                         # ≤ 4 digit rounds (8 bits each) + the final write
        active = done == 0
        final = take_all | (lo == hi)
        cont = select & (lo != hi)              # not final
        shift = tl.maximum(_bit_length(lo ^ hi) - DIGIT, 0)   # the 8 bits below the common prefix
        hist = tl.zeros([BINS], dtype=tl.int32)
        hist_n = tl.where(active & cont, m, 0)
        for start in range(0, hist_n, LIST_TILE):
            i, valid, col, key = _list_keys(src, lst, start, hist_n, LIST_TILE)
            hist += tl.histogram(((key ^ SIGN) >> shift) & 255, BINS, mask=valid)
        t, need_in_t = _bin_of_rank(hist, need, BINS)
        # scalar flags enter the masks only as thresholds of vector compares (the interpreter mis-broadcasts
        # i1 scalars): when final, no digit is above and every digit is "in the bin"
        t_above = tl.where(cont, t, 255)
        t_lo = tl.where(cont, t, 0)
        need_out = tl.where(final, need, 0)       # final: the first `need` entries fill the output
        list_cap = tl.where(cont, m, 0)           # else: bin t is the next list, compacted in place
        split_n = tl.where(active, m, 0)
        n_above = tl.zeros([], dtype=tl.int32)
        n_eq = tl.zeros([], dtype=tl.int32)
        lo2 = tl.full([], KEY_MAX, tl.int32)
        hi2 = tl.full([], KEY_MIN, tl.int32)
        for start in range(0, split_n, LIST_TILE):
            i, valid, col, key = _list_keys(src, lst, start, split_n, LIST_TILE)
            d = ((key ^ SIGN) >> shift) & 255
            above = valid & (d > t_above)
            eq = valid & (d >= t_lo) & (d <= t_above)     # d == t, or any d when final
            a = above.to(tl.int32)
            e = eq.to(tl.int32)
            tl.store(out + pos + n_above + tl.cumsum(a, 0) - a, col, mask=above)
            rank = n_eq + tl.cumsum(e, 0) - e
            tl.store(out + pos + rank, col, mask=eq & (rank < need_out))
            tl.store(lst + rank, col, mask=eq & (rank < list_cap))
            n_above += tl.sum(a, 0)
            n_eq += tl.sum(e, 0)
            lo2 = tl.minimum(lo2, tl.min(tl.where(eq, key, KEY_MAX), 0))
            hi2 = tl.maximum(hi2, tl.max(tl.where(eq, key, KEY_MIN), 0))
        tl.debug_barrier()
        pos += tl.where(active & final, need, n_above)
        more = active & cont
        m = tl.where(more, n_eq, m)
        need = tl.where(more, need_in_t, need)
        lo = tl.where(more, lo2, lo)
        hi = tl.where(more, hi2, hi)
        done = tl.where(active & final, 1, done)

    # slots past the keys above -inf (rows with fewer than k of them)
    for start in range(pos, k, LIST_TILE):
        i = start + tl.arange(0, LIST_TILE)
        tl.store(out + i, tl.full([LIST_TILE], -1, tl.int32), mask=i < k)
