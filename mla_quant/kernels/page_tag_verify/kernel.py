"""Triton kernel of ``page_tag_verify``: one program per request, looping over its page entries (and new tokens)."""
import triton
import triton.language as tl


@triton.jit
def _page_tag_verify_kernel(bt_ptr, seq_ptr, rec_ptr, tags_ptr, cu_ptr, slot_ptr, holders_ptr, failed_ptr, first_ptr,
                            num_pages, P, stride_bt, stride_rec,
                            PAGE_SIZE: tl.constexpr, CHECK_SLOTS: tl.constexpr, CHECK_HOLDERS: tl.constexpr,
                            BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr):
    b = tl.program_id(0)
    seq = tl.load(seq_ptr + b).to(tl.int64)
    n_pages = (seq + PAGE_SIZE - 1) // PAGE_SIZE
    length_bad = (seq < 0) | (n_pages > P)
    n_used = tl.minimum(tl.maximum(n_pages, 0), P).to(tl.int32)
    first = tl.zeros([BLOCK_P], dtype=tl.int64) + P                    # per-lane running minimum
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    rec_row = rec_ptr + b.to(tl.int64) * stride_rec
    for start in range(0, n_used, BLOCK_P):
        i = start + tl.arange(0, BLOCK_P)
        m = i < n_used
        page = tl.load(bt_row + i, mask=m, other=0).to(tl.int64)
        want = tl.load(rec_row + i, mask=m, other=0)
        in_range = (page >= 0) & (page < num_pages)
        have = tl.load(tags_ptr + page, mask=m & in_range, other=0)
        bad = m & ((~in_range) | (have != want))
        first = tl.minimum(first, tl.where(bad, i.to(tl.int64), P))
    if CHECK_SLOTS:
        q0 = tl.load(cu_ptr + b).to(tl.int64)
        q1 = tl.load(cu_ptr + b + 1).to(tl.int64)
        base = seq - (q1 - q0)                                          # position of the first new token
        for start in range(0, (q1 - q0).to(tl.int32), BLOCK_Q):
            j = start + tl.arange(0, BLOCK_Q)
            m = j < q1 - q0
            pos = base + j
            page_idx = tl.where(pos >= 0, pos // PAGE_SIZE, 0)
            in_table = (pos >= 0) & (page_idx < P)
            page = tl.load(bt_row + page_idx, mask=m & in_table, other=0).to(tl.int64)
            expect = tl.where(in_table, page * PAGE_SIZE + pos % PAGE_SIZE, -1)
            slot = tl.load(slot_ptr + q0 + j, mask=m, other=0).to(tl.int64)
            bad = m & (slot != expect) & ((pos < 0) | in_table)
            if CHECK_HOLDERS:  # a write into a page that another request or prefix still holds
                ok_page = m & in_table & (page >= 0) & (page < num_pages)
                bad = bad | (ok_page & (tl.load(holders_ptr + page, mask=ok_page, other=0) > 1))
            tok_first = tl.where(bad, tl.minimum(page_idx, P), P)
            first = tl.minimum(first, tl.min(tok_first, axis=0))
    first_b = tl.min(first, axis=0)
    failed = length_bad | (first_b < P)
    first_b = tl.where(length_bad, P, first_b)
    tl.store(failed_ptr + b, failed)
    tl.store(first_ptr + b, tl.where(failed, first_b, -1).to(tl.int32))
