"""Page-table index tensors: CSR round trip, slots, and the checks' errors."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mla_quant.cache import block_table_to_csr, check_page_table, csr_to_block_table, slots_from_block_table
from mla_quant.testing import page_tables, ragged_lengths


@given(lengths=ragged_lengths(batch=st.integers(1, 8), min_len=0, max_len=200), page_size=st.sampled_from([1, 16, 64]),
       share=st.booleans(), data=st.data())
def test_csr_round_trip_and_flashinfer_conventions(lengths, page_size, share, data):
    table, seq_lens, _ = data.draw(page_tables(lengths, page_size, share_prefix=share))
    indptr, indices, last = block_table_to_csr(table, seq_lens, page_size)
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32
    need = [-(-n // page_size) for n in lengths]
    assert indptr.tolist() == [0] + list(torch.tensor(need).cumsum(0).tolist())
    assert indices.tolist() == [p for b, n in enumerate(need) for p in table[b, :n].tolist()]
    assert last.tolist() == [((n - 1) % page_size + 1) if n else 0 for n in lengths]
    back, lens = csr_to_block_table(indptr, indices, last, page_size, max_pages=table.shape[1])
    assert torch.equal(lens, seq_lens)
    used = torch.arange(table.shape[1])[None, :] < torch.tensor(need)[:, None]
    assert torch.equal(back[used], table[used]) and torch.all(back[~used] == -1)


@given(lengths=ragged_lengths(batch=st.integers(1, 5), min_len=0, max_len=100), page_size=st.sampled_from([1, 4, 16]),
       data=st.data())
def test_slots_follow_the_table(lengths, page_size, data):
    table, seq_lens, _ = data.draw(page_tables(lengths, page_size))
    slots, valid = slots_from_block_table(table, seq_lens, page_size)
    for b, n in enumerate(lengths):
        assert valid[b].tolist() == [j < n for j in range(slots.shape[1])]
        for j in range(n):
            assert int(slots[b, j]) == int(table[b, j // page_size]) * page_size + j % page_size


def test_check_page_table_names_the_problem():
    table = torch.tensor([[0, 1], [2, -1]], dtype=torch.int32)
    check_page_table(table, torch.tensor([5, 4], dtype=torch.int32), 4, num_pages=3)
    with pytest.raises(ValueError, match="seq_lens: request 1"):
        check_page_table(table, torch.tensor([5, 9], dtype=torch.int32), 4, num_pages=3)
    with pytest.raises(IndexError, match="page id 2 of request 1"):
        check_page_table(table, torch.tensor([5, 4], dtype=torch.int32), 4, num_pages=2)
    with pytest.raises(IndexError, match="page id -1"):
        check_page_table(torch.tensor([[0, -1]], dtype=torch.int32), torch.tensor([5], dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="negative"):
        check_page_table(table, torch.tensor([5, -1], dtype=torch.int32), 4)
    with pytest.raises(TypeError, match="block_table"):
        check_page_table(table.long(), torch.tensor([5, 4], dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="seq_lens"):
        check_page_table(table, torch.tensor([5], dtype=torch.int32), 4)
