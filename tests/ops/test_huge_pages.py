"""Weights moved onto huge pages keep their values, their tensor objects, and the views and ties between them."""
import torch
from torch import nn

from kvforge.models.layers import fuse_linears
from kvforge.ops import huge_pages


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(512, 768, bias=False), nn.Linear(512, 256, bias=False)
        self.head = nn.Linear(512, 1024, bias=False)
        self.embed = nn.Embedding(1024, 512)
        self.head.weight = self.embed.weight  # tied
        self.norm = nn.Parameter(torch.randn(512))  # small: stays put
        self.register_buffer("fused", fuse_linears(self.q, self.k)[0], persistent=False)


def test_move_keeps_values_views_and_ties(monkeypatch):
    monkeypatch.setenv("KVFORGE_HUGE_PAGES", "1")
    torch.manual_seed(0)
    block = _Block()
    if not huge_pages.available():
        return
    before = {name: t.clone() for name, t in block.state_dict(keep_vars=True).items()}
    head_weight, norm_ptr = block.head.weight, block.norm.data_ptr()
    moved = huge_pages.move_to_huge_pages(block)
    assert moved == (1024 * 512 + 1024 * 512) * 4  # the fused weight (q and k are views into it) and the tied one
    for name, t in block.state_dict(keep_vars=True).items():
        torch.testing.assert_close(t, before[name], rtol=0, atol=0)
    assert block.head.weight is head_weight and block.head.weight.data_ptr() == block.embed.weight.data_ptr()
    assert block.q.weight.data_ptr() == block.fused.data_ptr()
    assert block.k.weight.data_ptr() == block.fused.data_ptr() + 768 * 512 * 4
    assert block.norm.data_ptr() == norm_ptr
    fused_storage = block.fused.untyped_storage().data_ptr()
    assert block.q.weight.untyped_storage().data_ptr() == fused_storage  # views keep their storage
    assert block.embed.weight.untyped_storage().data_ptr() != fused_storage  # other weights keep their own
    first = min(block.fused.data_ptr(), block.embed.weight.data_ptr())
    assert first % huge_pages.PAGE == 0
    block.fused.add_(1.0)  # still one storage: the views see writes to the fused weight
    torch.testing.assert_close(block.q.weight, before["q.weight"] + 1.0)


def test_opt_out_moves_nothing(monkeypatch):
    monkeypatch.setenv("KVFORGE_HUGE_PAGES", "0")
    block = _Block()
    ptr = block.fused.data_ptr()
    assert huge_pages.move_to_huge_pages(block) == 0 and block.fused.data_ptr() == ptr


def test_int8_quantization_still_tells_fused_views_from_other_weights(monkeypatch):
    """models/int8_weights.py skips a Linear whose storage is a fused weight's: after the move, only q and k."""
    from kvforge.models.int8_weights import module_copy, quantize_model

    monkeypatch.setenv("KVFORGE_HUGE_PAGES", "1")
    block = _Block()
    block.register_buffer("qkv_weight", block.fused, persistent=False)  # the name the quantizer knows
    del block.fused
    expected = quantize_model(module_copy(block))
    huge_pages.move_to_huge_pages(block)
    assert quantize_model(module_copy(block)) == expected == 2  # the fused weight and the head


def test_a_dead_storage_returns_its_whole_pages_and_leaves_its_neighbours():
    import gc
    import mmap

    from kvforge.ops.huge_pages import _region

    page = mmap.PAGESIZE
    mapping = mmap.mmap(-1, 4 * page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # as huge_page_mapping
    region = _region(mapping, 100, 3 * page)
    region.fill_(7)
    del region
    gc.collect()
    data = bytes(mapping[: 4 * page])
    assert set(data[100:page]) == {7} and set(data[3 * page: 3 * page + 100]) == {7}  # partial pages: shared
    assert set(data[page: 3 * page]) == {0}  # whole pages: given back (MADV_DONTNEED reads zeros)
