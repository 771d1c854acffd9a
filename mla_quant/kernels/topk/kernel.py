"""Triton radix select for ``topk_indices``: the k largest of each row of fp32 scores, exactly, as a set.

Each score maps to an order-preserving 32-bit key (``_order_key``), and the k-th largest key of a row (the
threshold) is found digit by digit, most significant first, in ``NR = ceil(32 / RADIX)`` histogram rounds of
``RADIX`` bits (the last round takes the bits left over): RADIX = 8 gives four rounds of 8 bits, RADIX = 11
three rounds of 11, 11 and 10. Round r counts, over the whole row split across many programs, the digit r of
the keys that agree with the threshold's digits found so far (``tl.histogram`` per tile, summed per program,
then one masked vector ``tl.atomic_add`` into the row's zeroed global histogram). No round needs a separate
scan kernel: every program of round r (and of the select pass) first re-derives the threshold's earlier digits
from the earlier histograms (``_descend``: cumulative counts from the top bin, a few hundred int32 from L2).

The digit width trades launches against work per element: ``tl.histogram`` over B bins costs each thread about
B / 32 popcount steps per element it holds (a ballot per digit bit, then one mask per owned bin), so a 2048-bin
round is ~8x the instructions of a 256-bin one, while 8-bit digits need one launch more.

After the last round the threshold key ``thr`` is exact and ``need`` = how many keys equal to it belong to
the selection (k − #keys > thr). The select pass writes the keys > thr to slots ``[0, k − need)`` and the
first ``need`` keys == thr (in whatever order the programs claim them) to ``[k − need, k)``: each tile claims
its slots with one scalar atomic per class and places its elements by an exclusive prefix sum. All buffers
have sizes fixed by the shape (no host sync, CUDA-graph safe).

Candidate finish (``_radix_compact_kernel`` + ``_radix_finish_kernel``, the launcher's ``finish="candidates"``):
instead of the rounds after the first ``CAND_ROUNDS`` = 2 and the select pass, once the threshold's top
``2·RADIX`` bits P and ``need`` are known (16 bits at RADIX = 8, 22 at 11):
1. compact (grid rows × chunks, like the select pass): keys whose top bits > P go to slots ``[0, k − need)``
   (count_gt, as the select pass does for keys > thr); keys whose top bits == P are appended as (key, column)
   to the row's candidate buffer (int32 keys and columns, capacity N, through count_cand) — except keys of
   -inf, whose columns come out as -1 whichever of them is chosen: a causally masked row (a short request in a
   long batch) would otherwise list all its masked columns.
2. finish (one program per row: its own launch, or the compact pass's last program of the row): the
   ``need``-th largest candidate key over the ``LOW = 32 − 2·RADIX`` remaining bits, then the candidates above
   it and the first ``need − #above`` equal to it to slots ``[k − need, k)``; with fewer than ``need``
   candidates, all of them and -1 for the rest. The threshold is found bit by bit (set the bit, count candidates
   at or above, keep it if that count ≥ need). Up to 128 candidates (the common case: ~90 keys of one 16-bit bin
   at one row of 64k) are searched by every warp on its own copy (``WARP_SEARCH``, ``_warp_search``: each bit's
   count is a sum inside one warp, no shared memory or barrier); up to ``CAND_BLOCK`` are loaded once and
   searched in registers with block-wide sums; more (ties or a dense bin, up to all N) are re-read in tiles of
   CAND_BLOCK per bit: slow but exact. The first chunk of the writes' keys and columns loads beside the search's.
   The per-warp search took the DSA step from 29.21 to 27.82 µs (H200 sweep, 7b448b9). Tried and removed: ranking
   up to 128 candidates at once — one [128, 128] comparison and one row sum, rank < need to slot k − need + rank
   — instead of the 16 steps (run of 199a3ae: the DSA step 30.71 vs 30.09 µs at 8 heads, 38.43 vs 38.02 at 64;
   256 candidates 46.9); a search by two 8-bit histograms instead of 16 bit steps (31.14 vs 31.22 µs in a 4-warp
   program, far slower in a one-warp one, 38.6 vs 32.2: run of 3761926).
   The finish clears the row's work buffer when done (a caller may keep the buffer: no memset per call).

Fused finish (``FUSED`` compact, the launcher's default): the finish runs in the compact pass's last program of a
row to arrive (an acq_rel arrival counter, after a barrier: every program's candidates are written and visible;
the candidates are then read through L2, ``.cg``), so the chain loses one launch and its gap.

Work buffer per row (int32, zeroed by the launcher; ``work_ints``): ``[HIST_0 | .. | HIST_{NR-1} (2^RADIX
each) | arrived | count_cand | count_gt | count_eq]``; arrived and count_cand are also one int64 (the arrival
word: the compact pass claims candidate slots in its high half, and the arrival that adds 1 to its low half
returns both), so rows are 8-byte aligned (contiguous from an aligned base: WORK is even at both widths).
"""
import triton
import triton.language as tl

from .._triton_utils import grid_dependency_sync

SIGN = tl.constexpr(-2 ** 31)               # 0x80000000 as int32
LOW31 = tl.constexpr(2 ** 31 - 1)           # 0x7FFFFFFF
NEG_INF_KEY = tl.constexpr(-2 ** 31 + 0x7FFFFF)   # _order_key(-inf), signed form
CAND_ROUNDS = 2                             # histogram rounds before the candidate finish (host side)


def rounds(radix: int) -> tuple[tuple[int, int], ...]:
    """(shift, bits) of each histogram round for ``radix``-bit digits, most significant first (host side)."""
    out, top = [], 32
    while top > 0:
        bits = min(radix, top)
        out.append((top - bits, bits))
        top -= bits
    return tuple(out)


def work_ints(radix: int) -> int:
    """int32 per row of the work buffer: one 2^radix histogram per round, arrived, count_cand, count_gt, count_eq."""
    return len(rounds(radix)) * (1 << radix) + 4


@triton.jit
def _order_key(x):
    """fp32 -> int32 key whose signed order is the order of the floats (torch.topk's: NaN above +inf; -0 sorts
    just below +0, one valid order of that tie). ``key ^ SIGN`` is the same order on the unsigned bit pattern
    (the radix digits are read from that)."""
    b = x.to(tl.int32, bitcast=True)
    b = tl.where(x != x, LOW31, b)          # NaN: the largest key
    return b ^ ((b >> 31) & LOW31)          # negatives: flip all bits but the sign


@triton.jit
def _threshold_bin(h, k, BINS: tl.constexpr):
    """Of a histogram ``h`` [BINS] (int32): the bin t holding the k-th largest of the counted keys (#keys in bins
    > t < k ≤ #keys in bins ≥ t) and k minus the keys above it."""
    b = tl.arange(0, BINS)
    at_or_above = tl.sum(h, 0) - tl.cumsum(h, 0) + h
    t = tl.max(tl.where(at_or_above >= k, b, -1), 0)
    above = tl.sum(tl.where(b > t, h, 0), 0)
    return t, k - above


@triton.jit
def _round_hist(work_ptr, r: tl.constexpr, RADIX: tl.constexpr, NR: tl.constexpr):
    """Round r's histogram from the work row (the last round's has 2^(bits left over) bins)."""
    BINS: tl.constexpr = (1 << (32 - r * RADIX)) if r == NR - 1 else (1 << RADIX)
    return tl.load(work_ptr + r * (1 << RADIX) + tl.arange(0, BINS))


@triton.jit
def _descend_step(prefix, rem, h, r: tl.constexpr, RADIX: tl.constexpr, NR: tl.constexpr):
    if r == NR - 1:     # the last digit: the bits left over
        t, rem = _threshold_bin(h, rem, 1 << (32 - r * RADIX))
        prefix = (prefix << (32 - r * RADIX)) | t   # all 32 bits (wraps negative when the top bit is set)
    else:
        t, rem = _threshold_bin(h, rem, 1 << RADIX)
        prefix = (prefix << RADIX) | t
    return prefix, rem


@triton.jit
def _descend(work_ptr, k, ROUNDS: tl.constexpr, RADIX: tl.constexpr, NR: tl.constexpr):
    """The threshold's digits found by the first ``ROUNDS`` (≤ 4) of the ``NR`` histogram rounds (as one int32,
    most significant first) and how many of the k are still to be found among keys with that prefix. Every
    histogram is loaded before the first is scanned: the scans' barriers would otherwise hold each later load
    back by one L2 round trip."""
    tl.static_assert(ROUNDS <= 4)
    prefix = tl.zeros([], dtype=tl.int32)
    rem = k
    if ROUNDS > 0:
        h0 = _round_hist(work_ptr, 0, RADIX, NR)
    if ROUNDS > 1:
        h1 = _round_hist(work_ptr, 1, RADIX, NR)
    if ROUNDS > 2:
        h2 = _round_hist(work_ptr, 2, RADIX, NR)
    if ROUNDS > 3:
        h3 = _round_hist(work_ptr, 3, RADIX, NR)
    if ROUNDS > 0:
        prefix, rem = _descend_step(prefix, rem, h0, 0, RADIX, NR)
    if ROUNDS > 1:
        prefix, rem = _descend_step(prefix, rem, h1, 1, RADIX, NR)
    if ROUNDS > 2:
        prefix, rem = _descend_step(prefix, rem, h2, 2, RADIX, NR)
    if ROUNDS > 3:
        prefix, rem = _descend_step(prefix, rem, h3, 3, RADIX, NR)
    return prefix, rem


@triton.jit
def _load_keys(row_ptr, start, n, BLOCK: tl.constexpr):
    cols = start + tl.arange(0, BLOCK)
    valid = cols < n
    x = tl.load(row_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    return cols, valid, _order_key(x)


@triton.jit
def _next_tile(row_ptr, first, i, tiles_per_chunk, n, BLOCK: tl.constexpr):
    """The keys of tile i + 1 of a chunk starting at tile ``first``, loaded while tile i is processed; nothing
    (every lane masked) past the chunk's last tile."""
    return _load_keys(row_ptr, (first + i + 1) * BLOCK, tl.where(i + 1 < tiles_per_chunk, n, 0), BLOCK)


@triton.jit
def _radix_histogram_kernel(scores_ptr, stride_row, work_ptr, n, k, tiles_per_chunk, ROUND: tl.constexpr,
                            SHIFT: tl.constexpr, BITS: tl.constexpr, RADIX: tl.constexpr, NR: tl.constexpr,
                            BLOCK: tl.constexpr, WORK: tl.constexpr, PDL: tl.constexpr = False):
    """Round ``ROUND`` of ``NR`` (its digit is bits [SHIFT, SHIFT + BITS) of the key, counted in the round's
    histogram of the work row): histogram of that digit over the keys matching the digits found before.
    Grid (rows, chunks); a chunk is ``tiles_per_chunk`` tiles of BLOCK columns."""
    grid_dependency_sync(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    row_ptr = scores_ptr + row * stride_row
    work = work_ptr + row * WORK
    first = chunk * tiles_per_chunk
    cols, valid, key = _load_keys(row_ptr, first * BLOCK, n, BLOCK)   # beside the histograms (see _descend)
    prefix, rem = _descend(work, k, ROUND, RADIX, NR)
    PREFIX_BITS: tl.constexpr = 32 - SHIFT - BITS
    acc = tl.zeros([1 << BITS], dtype=tl.int32)
    for i in range(0, tiles_per_chunk):
        u = key ^ SIGN                                   # unsigned-order bit pattern
        digit = (u >> SHIFT) & ((1 << BITS) - 1)
        counted = valid
        if PREFIX_BITS > 0:
            counted = valid & (((u >> (SHIFT + BITS)) & ((1 << PREFIX_BITS) - 1)) == prefix)
        acc += tl.histogram(digit, 1 << BITS, mask=counted)
        cols, valid, key = _next_tile(row_ptr, first, i, tiles_per_chunk, n, BLOCK)
    bins = tl.arange(0, 1 << BITS)
    tl.atomic_add(work + ROUND * (1 << RADIX) + bins, acc, mask=acc > 0, sem="relaxed")


@triton.jit
def _claim_slots(counter_ptr, flags, HIGH: tl.constexpr = False):
    """Slots for the flagged lanes of a tile in a list shared by many programs: one atomic claims the tile's
    run at the list's end, an exclusive prefix sum places each lane in it. ``HIGH``: the counter is the high half
    of an int64 word (count_cand in the arrival word, ``_arrival_word``)."""
    n_tile = tl.sum(flags, 0)
    if HIGH:
        base = (tl.atomic_add(counter_ptr, n_tile.to(tl.int64) << 32, mask=n_tile > 0, sem="relaxed") >> 32)
        base = base.to(tl.int32)
    else:
        base = tl.atomic_add(counter_ptr, n_tile, mask=n_tile > 0, sem="relaxed")
    return base + tl.cumsum(flags, 0) - flags


@triton.jit
def _radix_select_kernel(scores_ptr, stride_row, work_ptr, out_ptr, stride_out, n, k, tiles_per_chunk,
                         RADIX: tl.constexpr, NR: tl.constexpr, BLOCK: tl.constexpr, WORK: tl.constexpr,
                         PDL: tl.constexpr = False):
    """Write the selection: keys > threshold to slots [0, k - need), ``need`` keys == threshold after them;
    columns scoring -inf are written as -1."""
    grid_dependency_sync(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    row_ptr = scores_ptr + row * stride_row
    work = work_ptr + row * WORK
    out = out_ptr + row * stride_out
    first = chunk * tiles_per_chunk
    cols, valid, key = _load_keys(row_ptr, first * BLOCK, n, BLOCK)   # beside the histograms (see _descend)
    thr_u, need = _descend(work, k, NR, RADIX, NR)
    thr = thr_u ^ SIGN
    n_above = k - need
    for i in range(0, tiles_per_chunk):
        value = tl.where(key == NEG_INF_KEY, -1, cols)
        above = (valid & (key > thr)).to(tl.int32)
        slot = _claim_slots(work + (WORK - 2), above)
        tl.store(out + slot, value, mask=(above > 0) & (slot < n_above))   # always true: a guard, not a rule
        tied = (valid & (key == thr)).to(tl.int32)
        rank = _claim_slots(work + (WORK - 1), tied)
        tl.store(out + n_above + rank, value, mask=(tied > 0) & (rank < need))
        cols, valid, key = _next_tile(row_ptr, first, i, tiles_per_chunk, n, BLOCK)


@triton.jit
def _arrival_word(work, WORK: tl.constexpr):
    """arrived (low half) and count_cand (high half) of a work row as one int64, so that the fused finish's arrival
    atomic also returns the candidate count (one L2 round trip, not two); the row's offset, a multiple of 8 bytes
    at both digit widths, keeps it aligned."""
    return (work + (WORK - 4)).to(tl.pointer_type(tl.int64))


@triton.jit
def _radix_compact_kernel(scores_ptr, stride_row, work_ptr, out_ptr, stride_out, cand_ptr, n, k,
                          tiles_per_chunk, ROUNDS: tl.constexpr, RADIX: tl.constexpr, NR: tl.constexpr,
                          BLOCK: tl.constexpr, WORK: tl.constexpr, FUSED: tl.constexpr, WORK_P2: tl.constexpr,
                          CAND_BLOCK: tl.constexpr, WARP_SEARCH: tl.constexpr, WARPS: tl.constexpr,
                          PDL: tl.constexpr = False):
    """After the first ROUNDS (= CAND_ROUNDS) rounds (the threshold's top KNOWN bits P): keys whose top bits > P
    to slots [0, k - need) of the output; keys whose top bits == P appended to the row's candidates (cand_ptr:
    int32 [rows, 2, n], keys then columns; -inf columns as -1). Grid (rows, chunks), as the select pass. With
    ``FUSED`` the row's last program to arrive then runs the finish (``_finish_row``)."""
    grid_dependency_sync(PDL)
    KNOWN: tl.constexpr = ROUNDS * RADIX
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    row_ptr = scores_ptr + row * stride_row
    work = work_ptr + row * WORK
    out = out_ptr + row * stride_out
    cand_keys = cand_ptr + row * 2 * n
    first = chunk * tiles_per_chunk
    cols, valid, key = _load_keys(row_ptr, first * BLOCK, n, BLOCK)   # beside the histograms (see _descend)
    prefix, need = _descend(work, k, ROUNDS, RADIX, NR)
    n_above = k - need
    for i in range(0, tiles_per_chunk):
        value = tl.where(key == NEG_INF_KEY, -1, cols)
        top = ((key ^ SIGN) >> (32 - KNOWN)) & ((1 << KNOWN) - 1)
        above = (valid & (top > prefix)).to(tl.int32)
        slot = _claim_slots(work + (WORK - 2), above)
        tl.store(out + slot, value, mask=(above > 0) & (slot < n_above))   # always true: a guard, not a rule
        tied = (valid & (top == prefix) & (key != NEG_INF_KEY)).to(tl.int32)   # -inf: no candidate (below)
        slot = _claim_slots(_arrival_word(work, WORK), tied, HIGH=True)
        tl.store(cand_keys + slot, key, mask=tied > 0)
        tl.store(cand_keys + n + slot, value, mask=tied > 0)
        cols, valid, key = _next_tile(row_ptr, first, i, tiles_per_chunk, n, BLOCK)
    if FUSED:
        tl.debug_barrier()   # every thread's candidates are written before the release below
        seen = tl.atomic_add(_arrival_word(work, WORK), 1, sem="acq_rel")   # (arrived, count_cand) before
        if (seen & 0xFFFFFFFF) == tl.num_programs(1) - 1:   # the row's last: every candidate is listed
            c = (seen >> 32).to(tl.int32)
            _finish_row(work, out, cand_keys, n, k, need, c, ROUNDS, RADIX, WORK, WORK_P2, CAND_BLOCK, WARP_SEARCH,
                        WARPS)


@triton.jit
def _candidate_low_bits(keys_ptr, offs, c, LOW: tl.constexpr):
    """The low LOW bits of candidates ``offs`` (unsigned-order, so their order is the keys' order); -1 past c.
    Read through L2 (``.cg``): in the fused finish other programs wrote them during this launch."""
    valid = offs < c
    key = tl.load(keys_ptr + offs, mask=valid, other=0, cache_modifier=".cg")
    return tl.where(valid, (key ^ SIGN) & ((1 << LOW) - 1), -1)


@triton.jit
def _count_at_least(keys_ptr, c, t, LOW: tl.constexpr, CAND_BLOCK: tl.constexpr):
    """How many of the c candidates have low bits ≥ t, reading them in tiles of CAND_BLOCK."""
    count = tl.zeros([], dtype=tl.int32)
    for start in range(0, c, CAND_BLOCK):
        low = _candidate_low_bits(keys_ptr, start + tl.arange(0, CAND_BLOCK), c, LOW)
        count += tl.sum((low >= t).to(tl.int32), 0)
    return count


@triton.jit
def _radix_finish_kernel(work_ptr, out_ptr, stride_out, cand_ptr, n, k, ROUNDS: tl.constexpr, RADIX: tl.constexpr,
                         NR: tl.constexpr, WORK: tl.constexpr, WORK_P2: tl.constexpr, CAND_BLOCK: tl.constexpr,
                         WARP_SEARCH: tl.constexpr, WARPS: tl.constexpr, PDL: tl.constexpr = False):
    """The finish as its own launch (the unfused form), grid (rows,): ``_finish_row`` of each row."""
    grid_dependency_sync(PDL)
    row = tl.program_id(0).to(tl.int64)
    work = work_ptr + row * WORK
    _, need = _descend(work, k, ROUNDS, RADIX, NR)
    _finish_row(work, out_ptr + row * stride_out, cand_ptr + row * 2 * n, n, k, need, tl.load(work + (WORK - 3)),
                ROUNDS, RADIX, WORK, WORK_P2, CAND_BLOCK, WARP_SEARCH, WARPS)


@triton.jit
def _finish_row(work, out, cand_keys, n, k, need, c, ROUNDS: tl.constexpr, RADIX: tl.constexpr,
                WORK: tl.constexpr, WORK_P2: tl.constexpr, CAND_BLOCK: tl.constexpr, WARP_SEARCH: tl.constexpr,
                WARPS: tl.constexpr):
    """Slots [k - need, k) of one row from its c candidates: those above the need-th largest candidate key, then
    as many equal to it as still needed; then the row's work buffer is set back to zero (this program is the
    last to read it), so a kept buffer needs no memset before the next call."""
    LOW: tl.constexpr = 32 - ROUNDS * RADIX     # key bits below the ROUNDS digits found
    # the writes go in chunks of WRITE candidates; the first chunk's keys and columns load now, beside the search's
    # keys, not after the search (the common case, ~90 candidates, is that one chunk)
    WRITE: tl.constexpr = 128
    offs_w = tl.arange(0, WRITE)
    low_w = _candidate_low_bits(cand_keys, offs_w, c, LOW)
    value_w = tl.load(cand_keys + n + offs_w, mask=offs_w < c, cache_modifier=".cg")
    thr = tl.zeros([], dtype=tl.int32)          # the threshold's low bits, found from the top bit down
    if WARP_SEARCH and c <= WRITE:              # the common case: every warp searches its own copy of ≤ 128
        thr = _warp_search(cand_keys, c, need, LOW, WARPS)
        n_gt = tl.sum((low_w > thr).to(tl.int32), 0)   # low_w holds them all
    elif c <= CAND_BLOCK:                       # one tile: load once, search in registers
        low = _candidate_low_bits(cand_keys, tl.arange(0, CAND_BLOCK), c, LOW)
        for b in tl.static_range(LOW):
            t = thr | (1 << (LOW - 1 - b))
            thr = tl.where(tl.sum((low >= t).to(tl.int32), 0) >= need, t, thr)
        n_gt = tl.sum((low > thr).to(tl.int32), 0)
    else:                                       # many candidates (ties, a dense bin): one read of all per bit
        for b in range(LOW):
            t = thr | (1 << (LOW - 1 - b))
            thr = tl.where(_count_at_least(cand_keys, c, t, LOW, CAND_BLOCK) >= need, t, thr)
        n_gt = _count_at_least(cand_keys, c, thr + 1, LOW, CAND_BLOCK)
    gt_slot, eq_rank = _write_chunk(low_w, value_w, thr, out, k, need, n_gt, k - need, 0)
    for start in range(WRITE, c, WRITE):
        low_t = _candidate_low_bits(cand_keys, start + offs_w, c, LOW)
        value = tl.load(cand_keys + n + start + offs_w, mask=start + offs_w < c, cache_modifier=".cg")
        gt_slot, eq_rank = _write_chunk(low_t, value, thr, out, k, need, n_gt, gt_slot, eq_rank)
    for start in range(c, need, WRITE):         # fewer finite candidates than needed: the rest score -inf
        tl.store(out + (k - need) + start + offs_w, -1, mask=start + offs_w < need)
    clear = tl.arange(0, WORK_P2)
    tl.store(work + clear, tl.zeros([WORK_P2], dtype=tl.int32), mask=clear < WORK)


@triton.jit
def _warp_search(cand_keys, c, need, LOW: tl.constexpr, WARPS: tl.constexpr):
    """The need-th largest of ≤ 128 candidates' low bits, bit by bit, where every warp searches its own copy of
    them: four [WARPS, 32] tensors (one row per warp, one candidate per lane), so each bit's count is a sum inside
    one warp (shuffles) instead of a block-wide sum (shared memory and two barriers per bit); one cross-warp max at
    the end (the rows agree). A [WARPS, 128] copy would not do: Triton lays it out two warps wide."""
    lane = tl.arange(0, 32)[None, :] + tl.zeros([WARPS, 1], dtype=tl.int32)             # [WARPS, 32]
    low0 = _candidate_low_bits(cand_keys, lane, c, LOW)
    low1 = _candidate_low_bits(cand_keys, lane + 32, c, LOW)
    low2 = _candidate_low_bits(cand_keys, lane + 64, c, LOW)
    low3 = _candidate_low_bits(cand_keys, lane + 96, c, LOW)
    thr = tl.zeros([WARPS], dtype=tl.int32)
    for b in tl.static_range(LOW):
        t = thr | (1 << (LOW - 1 - b))
        at_least = ((low0 >= t[:, None]).to(tl.int32) + (low1 >= t[:, None]).to(tl.int32)
                    + (low2 >= t[:, None]).to(tl.int32) + (low3 >= t[:, None]).to(tl.int32))
        thr = tl.where(tl.sum(at_least, 1) >= need, t, thr)
    return tl.max(thr, 0)


@triton.jit
def _write_chunk(low, value, thr, out, k, need, n_gt, gt_slot, eq_rank):
    """One chunk of candidates (low bits ``low``, -1 past the list; columns ``value``) to the output: those above
    ``thr`` from slot ``gt_slot`` on, the first ``need - n_gt`` equal to it (counting ``eq_rank`` already seen)
    after the n_gt above. Slots come from one prefix sum with both classes packed (> thr in the low 16 bits,
    == thr in the high 16): a scan over a one-warp tile is a chain of dependent shuffles per register the tile
    takes, so the chunk is small and scanned once. Returns the updated (gt_slot, eq_rank)."""
    gt = (low > thr).to(tl.int32)
    tied = (low == thr).to(tl.int32)
    both = gt + (tied << 16)
    before = tl.cumsum(both, 0) - both
    tl.store(out + gt_slot + (before & 0xFFFF), value, mask=gt > 0)
    rank = eq_rank + (before >> 16)
    tl.store(out + (k - need + n_gt) + rank, value, mask=(tied > 0) & (rank < need - n_gt))
    return gt_slot + tl.sum(gt, 0), eq_rank + tl.sum(tied, 0)
