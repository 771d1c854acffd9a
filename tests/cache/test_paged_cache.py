"""PagedKVCache: layouts per format, mixed formats per layer, reads of ragged requests through shuffled and
shared tables with NaN in every unused slot, page copies and format conversion (the prefill→decode hand-off)."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mla_quant.cache import LayerKV, PagedKVCache, check_page_table
from mla_quant.formats import KVFormat
from mla_quant.kernels.kv_layout import dequantize_kv_rows, quantize_kv_rows
from mla_quant.testing import assert_bitwise_equal, kv_formats, page_tables, ragged_lengths, sqnr_db

ALL = ["bf16", "fp8_e4m3", KVFormat("fp8_e4m3", "tensor"), "fp8_ds_mla"]


def leading_shared_pages(table, b):
    """Leading page entries request b shares with request 0 (``page_tables(share_prefix=True)``)."""
    same = (table[b] == table[0]) & (table[b] >= 0)
    return int(same.int().cumprod(0).sum())


def test_storage_layout_per_format():
    cache = PagedKVCache(4, 10, 16, kv_format=ALL, tensor_scales=[1.0, 1.0, 0.5, 1.0])
    shapes = [(lk.data.dtype, tuple(lk.data.shape), None if lk.scales is None else tuple(lk.scales.shape),
               lk.scale_mode) for lk in cache.layers]
    assert shapes == [(torch.bfloat16, (10, 16, 576), None, None),
                      (torch.float8_e4m3fn, (10, 16, 576), (10, 16), "token"),
                      (torch.float8_e4m3fn, (10, 16, 576), (1,), "tensor"),
                      (torch.uint8, (10, 16, 656), None, None)]
    assert cache.layer(2).scales.item() == 0.5
    assert [cache.bytes_per_token(i) for i in range(4)] == [1152, 580, 576, 656]
    assert cache.bytes_per_token() == 1152 + 580 + 576 + 656
    assert cache.bytes_per_page(0) == 16 * 1152
    assert isinstance(cache.layer(-1), LayerKV) and cache.layer(3).fmt == KVFormat("fp8_ds_mla")
    assert cache.nbytes() == 10 * 16 * (1152 + 576 + 4 + 576 + 656) + 4


@pytest.mark.parametrize("kv", ALL, ids=str)
def test_append_then_read_equals_the_layout_reference(kv):
    cache = PagedKVCache(1, 6, 4, 512, 64, kv, tensor_scales=0.01).poison_()
    rows = torch.randn(9, 576)
    pages = [4, 0, 2]
    slots = torch.tensor([p * 4 + o for p in pages for o in range(4)][:9])
    cache.append(0, rows, slots)
    fmt = KVFormat.parse(kv)
    per_tensor = fmt.kind == "fp8_e4m3" and fmt.scale == "tensor"
    q, s = quantize_kv_rows(rows, fmt.kind, 512, cache.layer(0).scales if per_tensor else None)
    want = dequantize_kv_rows(q, s, fmt.kind, 512, 64)
    assert torch.equal(cache.read(0, pages, 9), want)


@given(lengths=ragged_lengths(batch=st.integers(1, 6), min_len=1, max_len=150),
       page_size=st.sampled_from([1, 16, 64]), fmt=kv_formats(), share=st.booleans(), data=st.data())
def test_gather_reads_requests_through_shuffled_shared_tables_never_an_unused_slot(lengths, page_size, fmt, share,
                                                                                   data):
    table, seq_lens, pool = data.draw(page_tables(lengths, page_size, share_prefix=share))
    check_page_table(table, seq_lens, page_size, pool)
    cache = PagedKVCache(1, max(pool, 1), page_size, 128, 16, fmt, tensor_scales=0.05).poison_()
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    rows = torch.randn(len(lengths), max(lengths), 144, generator=g)
    for b, n in enumerate(lengths):
        # request b shares the first k tokens (whole pages) of request 0: it holds request 0's rows there
        k = leading_shared_pages(table, b) * page_size if b else 0
        rows[b, :k] = rows[0, :k]
        pos = torch.arange(k, n)
        cache.append(0, rows[b, k:n], table[b, pos // page_size].long() * page_size + pos % page_size)
    got = cache.layer(0).gather(table, seq_lens)
    assert not torch.isnan(got).any(), "an unused (NaN) slot was read"
    for b, n in enumerate(lengths):
        want = cache.read(0, table[b, : -(-n // page_size)].tolist(), n)
        assert torch.equal(got[b, :n], want)
        assert torch.all(got[b, n:] == 0)
        assert sqnr_db(rows[b, :n], want) > (40 if fmt.kind == "bf16" else 25)


def test_poison_fills_nan_in_every_format_but_keeps_tensor_scales():
    cache = PagedKVCache(4, 2, 4, kv_format=ALL, tensor_scales=0.25).poison_()
    for i in range(4):
        assert torch.isnan(cache.read(i, [0, 1], 8)).all()
    assert cache.layer(2).scales.item() == 0.25


# ------------------------------------------------------------------------------------------- copies
def filled(kv, seed=0, num_pages=6, page_size=4, tensor_scales=0.02):
    cache = PagedKVCache(2, num_pages, page_size, 128, 16, kv, tensor_scales=tensor_scales).poison_()
    rows = torch.randn(num_pages * page_size, 144, generator=torch.Generator().manual_seed(seed))
    for layer in range(2):
        cache.append(layer, rows, torch.arange(num_pages * page_size))
    return cache, rows


@pytest.mark.parametrize("kv", ALL, ids=str)
def test_same_format_copies_are_exact(kv):
    src, _ = filled(kv)
    dst = PagedKVCache(2, 9, 4, 128, 16, kv, tensor_scales=0.02).poison_()
    src.copy_pages_to(dst, [5, 1, 3], [0, 8, 4])
    for layer in range(2):
        for s, d in [(5, 0), (1, 8), (3, 4)]:
            assert_bitwise_equal(dst.layer(layer).data[d], src.layer(layer).data[s])
            if src.layer(layer).scale_mode == "token":
                assert_bitwise_equal(dst.layer(layer).scales[d], src.layer(layer).scales[s])
        assert torch.isnan(dst.read(layer, [1, 2, 3, 5, 6, 7], 24)).all(), "an unaddressed page changed"


@pytest.mark.parametrize("kv", ["fp8_e4m3", KVFormat("fp8_e4m3", "tensor"), "fp8_ds_mla"], ids=str)
def test_bf16_to_fp8_handoff_equals_a_direct_fp8_append(kv):
    src = PagedKVCache(2, 6, 4, 128, 16, "bf16").poison_()
    direct = PagedKVCache(2, 6, 4, 128, 16, kv, tensor_scales=0.02).poison_()
    rows = torch.randn(24, 144).bfloat16()
    for layer in range(2):
        src.append(layer, rows, torch.arange(24))
        direct.append(layer, rows, torch.arange(24))
    converted = src.convert(kv, tensor_scales=0.02)
    for layer in range(2):
        assert_bitwise_equal(converted.layer(layer).data, direct.layer(layer).data)
        if direct.layer(layer).scale_mode == "token":
            assert_bitwise_equal(converted.layer(layer).scales, direct.layer(layer).scales)


def test_copy_within_a_cache_and_a_mixed_per_layer_format():
    cache = PagedKVCache(2, 6, 4, 128, 16, ["bf16", "fp8_ds_mla"]).poison_()
    rows = torch.randn(8, 144)
    for layer in range(2):
        cache.append(layer, rows, torch.arange(8))
    cache.copy_pages([0, 1], [4, 5])
    for layer in range(2):
        assert torch.equal(cache.read(layer, [4, 5], 8), cache.read(layer, [0, 1], 8))
    fp8 = PagedKVCache(2, 6, 4, 128, 16, "fp8_e4m3")
    cache.copy_pages_to(fp8, [0, 1], [2, 3])
    assert sqnr_db(rows, fp8.read(1, [2, 3], 8)) > 25


def test_copy_and_geometry_errors():
    cache, _ = filled("bf16")
    with pytest.raises(IndexError, match="src_pages"):
        cache.copy_pages([6], [0])
    with pytest.raises(IndexError, match="dst_pages"):
        cache.copy_pages([0], [-1])
    with pytest.raises(ValueError, match="overlaps"):
        cache.copy_pages([0, 1], [1, 2])
    with pytest.raises(ValueError, match="twice"):
        cache.copy_pages([0, 1], [3, 3])
    with pytest.raises(ValueError, match="dst_pages"):
        cache.copy_pages([0, 1], [3])
    with pytest.raises(ValueError, match="geometry"):
        cache.copy_pages_to(PagedKVCache(2, 6, 8, 128, 16), [0], [0])
    with pytest.raises(ValueError, match="num_tokens"):
        cache.read(0, [0, 1], 9)
    with pytest.raises(IndexError, match="layer"):
        cache.layer(2)


@pytest.mark.parametrize("page_size", [0, 3, 48, 512, 2.0])
def test_page_size_must_be_a_power_of_two_up_to_256(page_size):
    with pytest.raises(ValueError, match="page_size"):
        PagedKVCache(1, 4, page_size)


def test_constructor_errors():
    with pytest.raises(ValueError, match="kv_format"):
        PagedKVCache(3, 4, kv_format=["bf16", "bf16"])
    with pytest.raises(ValueError, match="kind"):
        PagedKVCache(1, 4, kv_format="int4")
    with pytest.raises(ValueError, match="tensor_scales"):
        PagedKVCache(1, 4, kv_format=KVFormat("fp8_e4m3", "tensor"), tensor_scales=0.0)
    with pytest.raises(ValueError, match="fp8_ds_mla"):
        PagedKVCache(1, 4, kv_lora_rank=100, kv_format="fp8_ds_mla")
    with pytest.raises(ValueError, match="num_pages"):
        PagedKVCache(1, 0)
    cache = PagedKVCache(1, 4, 4)
    with pytest.raises(ValueError, match="rows"):
        cache.append(0, torch.randn(2, 100), torch.tensor([0, 1]))
    with pytest.raises(IndexError, match="slot_mapping"):
        cache.append(0, torch.randn(2, 576), torch.tensor([0, 16]))
