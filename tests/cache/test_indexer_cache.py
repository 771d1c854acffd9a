import pytest
import torch

from mla_quant.cache.indexer_cache import IndexerKCache
from mla_quant.kernels.hadamard import hadamard_transform
from mla_quant.testing import rel_err


def test_layout_and_bytes():
    c = IndexerKCache([0, 3, 7], num_pages=5, page_size=16, head_dim=128, kind="fp8_e4m3")
    lk = c.layer(3)
    assert lk.k.shape == (5, 16, 128) and lk.k.dtype == torch.float8_e4m3fn
    assert lk.scale.shape == (5, 16) and lk.scale.dtype == torch.float32
    assert c.bytes_per_token(per_layer=True) == 132 and c.bytes_per_token() == 3 * 132
    assert c.nbytes() == 3 * 5 * 16 * 132
    assert IndexerKCache(1, 2, 4, 128, "bf16").bytes_per_token() == 256
    assert IndexerKCache(1, 2, 4, 128, "bf16").layer(0).scale is None
    assert 3 in c and 1 not in c and len(c) == 3
    with pytest.raises(KeyError, match="layer"):
        c.layer(1)


def test_for_indexer_types_keeps_full_layers():
    c = IndexerKCache.for_indexer_types(["full", "full", "shared", "shared", "full"], 4, 8, 64)
    assert c.layer_ids == (0, 1, 4)


@pytest.mark.parametrize("kind", ["fp8_e4m3", "bf16", "fp32"])
def test_append_writes_only_the_given_slots_and_fp8_pages_hold_rotated_keys(kind):
    c = IndexerKCache([2], num_pages=4, page_size=8, head_dim=64, kind=kind).poison_()
    k = torch.randn(10, 64)
    slots = torch.tensor([3, 4, 5, 8, 9, 30, 31, -1, 0, 17])
    c.append(2, k, slots)
    lk = c.layer(2)
    stored = lk.dequantize(slots[slots >= 0])
    want = hadamard_transform(k[slots >= 0]) if lk.rotated else k[slots >= 0]
    assert lk.rotated == (kind == "fp8_e4m3")
    assert rel_err(stored, want) < {"fp8_e4m3": 0.05, "bf16": 4e-3, "fp32": 0.0}[kind] + 1e-7
    written = torch.zeros(32, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    assert torch.isnan(lk.k.float().reshape(32, 64)[~written]).all()


def test_copy_pages_between_kinds_keeps_the_keys():
    src = IndexerKCache([0, 1], 4, 8, 64, "bf16")
    k = torch.randn(32, 64)
    for i in (0, 1):
        src.append(i, k * (i + 1), torch.arange(32))
    fp8 = IndexerKCache([0, 1], 4, 8, 64, "fp8_e4m3").poison_()
    src.copy_pages_to(fp8, [1, 2], [3, 0])
    back = IndexerKCache([0, 1], 4, 8, 64, "bf16").poison_()
    fp8.copy_pages_to(back, [3, 0], [1, 2])
    for i in (0, 1):
        moved = back.layer(i).dequantize(torch.arange(8, 24))
        assert rel_err(moved, src.layer(i).dequantize(torch.arange(8, 24))) < 0.06
    same = IndexerKCache([0, 1], 4, 8, 64, "bf16").poison_()
    src.copy_pages(0, 3)
    assert torch.equal(src.layer(1).k[3], src.layer(1).k[0])
    src.copy_pages_to(same, [0], [0])
    assert torch.equal(same.layer(0).k[0], src.layer(0).k[0])


def test_bad_arguments():
    with pytest.raises(ValueError, match="kind"):
        IndexerKCache(1, 2, 4, 128, "int8")
    with pytest.raises(ValueError, match="page_size"):
        IndexerKCache(1, 2, 6, 128)
    with pytest.raises(ValueError, match="layers"):
        IndexerKCache([1, 1], 2, 4, 128)
    c = IndexerKCache(1, 2, 4, 64)
    with pytest.raises(IndexError, match="dst_pages"):
        c.copy_pages(0, 5)
    with pytest.raises(ValueError, match="overlaps"):
        c.copy_pages([0, 1], [1, 0])
    with pytest.raises(ValueError, match="geometry"):
        c.copy_pages_to(IndexerKCache(1, 2, 4, 128), [0], [0])
    with pytest.raises(IndexError, match="slot_mapping"):
        c.append(0, torch.randn(1, 64), torch.tensor([8]))
