"""Giving the memory of free KV blocks back to the OS: whole pages only, neighbours untouched."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch

from pagoda.exec.paged_attention import PagedKVCache

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise page release is Linux-only")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


def test_released_blocks_read_zero_leave_the_rest_and_leave_rss():
    # 16 KiB per block and plane (16 x 4 x 64 fp32): whole pages, so every released byte goes.
    cache = PagedKVCache(num_layers=2, num_blocks=1024, block_size=16, num_kv_heads=4, head_dim=64,
                         dtype=torch.float32, device=torch.device("cpu"))
    cache.tensor.fill_(1.0)
    before = _rss_bytes()
    released = cache.release_blocks(list(range(100, 900)))
    assert released == 800 * 16 * 1024 * 4  # 4 planes: 2 layers x K/V
    assert before - _rss_bytes() >= 0.9 * released
    t = cache.tensor
    assert torch.all(t[:, :, 100:900] == 0)
    assert torch.all(t[:, :, :100] == 1) and torch.all(t[:, :, 900:] == 1)
    t[:, :, 100:900] = 2.0  # released memory is usable again
    assert torch.all(t[:, :, 500] == 2)


def test_partial_pages_are_kept_so_neighbours_survive():
    # 6 KiB per block and plane (bf16, as SmolLM2's): a lone block owns at most one whole page.
    cache = PagedKVCache(num_layers=1, num_blocks=64, block_size=16, num_kv_heads=3, head_dim=64,
                         dtype=torch.bfloat16, device=torch.device("cpu"))
    cache.tensor.fill_(1.0)
    released = cache.release_blocks([5, 9, 10])
    assert 0 < released < 3 * 6144 * 2
    assert released % 4096 == 0
    t = cache.tensor
    for b in (4, 6, 8, 11):
        assert torch.all(t[:, :, b] == 1), f"neighbour block {b} lost data"
    assert cache.release_blocks([]) == 0
