"""Triton kernel for ``moe_align`` (layout in ``reference.py``): one program does the whole batch.

Steps: histogram of the expert ids -> per-expert counts, padded counts and their exclusive prefix sums;
fill ``sorted_ids`` with the sentinel and write each block's expert; barrier; sort the keys
``expert * BLOCK_A + assignment`` (one bitonic sort, so assignments stay in increasing order inside an
expert) and scatter each assignment to ``pad_start[e] + (rank inside e)``. Used while all assignments
fit one program (``MAX_ASSIGNMENTS``); larger batches take the torch path, where the GEMMs dominate.
"""
import triton
import triton.language as tl


@triton.jit
def _moe_align_kernel(ids_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr, A, E, CAP,
                      BLOCK_M: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_E: tl.constexpr,
                      BLOCK_FILL: tl.constexpr, BLOCK_B: tl.constexpr):
    offs = tl.arange(0, BLOCK_A)
    ids = tl.load(ids_ptr + offs, mask=offs < A, other=-1).to(tl.int32)
    valid = (ids >= 0) & (ids < E) & (offs < A)
    bucket = tl.where(valid, ids, E)  # dropped assignments and the tail go to bucket E (< BLOCK_E)

    e_offs = tl.arange(0, BLOCK_E)
    counts = tl.where(e_offs < E, tl.histogram(bucket, BLOCK_E), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, 0)
    pad_start = pad_end - padded
    cnt_start = tl.cumsum(counts, 0) - counts
    total = tl.sum(padded, 0)

    for p in range(0, CAP, BLOCK_FILL):
        po = p + tl.arange(0, BLOCK_FILL)
        tl.store(sorted_ptr + po, tl.zeros([BLOCK_FILL], tl.int32) + A, mask=po < CAP)
    n_blocks = CAP // BLOCK_M
    for b in range(0, n_blocks, BLOCK_B):
        bo = b + tl.arange(0, BLOCK_B)
        row0 = bo * BLOCK_M
        # the expert whose padded range holds row0: the number of ranges that end at or before it
        owner = tl.sum((pad_end[None, :] <= row0[:, None]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + bo, tl.where(row0 < total, owner, -1), mask=bo < n_blocks)
    tl.debug_barrier()  # the sentinel fill above must land before the scatter below

    key = tl.sort(bucket * BLOCK_A + offs)
    s_expert = key // BLOCK_A
    s_assign = key % BLOCK_A
    rank = offs - tl.gather(cnt_start, s_expert, 0)  # position inside its expert (sorted valid keys come first)
    dest = tl.gather(pad_start, s_expert, 0) + rank
    tl.store(sorted_ptr + dest, s_assign, mask=s_expert < E)
    tl.store(num_padded_ptr, total)
