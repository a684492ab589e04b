"""release_pages gives back a mapped weight's resident pages, keeps its values, and touches nothing else."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from pagoda.model.mmap_weights import load_params, release_pages, save_params
from tests.conftest import proc_status_kib


@pytest.mark.skipif(sys.platform != "linux", reason="madvise and /proc are Linux's")
def test_release_pages_of_a_mapped_weight(tmp_path):
    path = tmp_path / "params.safetensors"
    save_params(nn.Linear(4096, 256), path)  # a 4 MiB weight: ~1,000 whole pages
    with torch.device("meta"):
        net = nn.Linear(4096, 256)
    load_params(net, path, torch.device("cpu"))
    values = net.weight.clone()  # reading it maps its pages in
    resident = proc_status_kib("RssFile")
    assert release_pages([net.weight]) == 1
    assert resident - proc_status_kib("RssFile") >= 3 * 1024  # most of the 4 MiB left RSS
    assert torch.equal(net.weight, values)  # read back from the file when touched again
    bias = net.bias.clone()
    assert torch.equal(net.bias, bias)
    # Tensors that are not in a mapped weights file are left alone.
    heap = torch.randn(4096, 256)
    copy = heap.clone()
    assert release_pages([heap]) == 0
    assert torch.equal(heap, copy)
