"""The GGUF load cache for large and split models: a split set is cached under a key of every
part (a change to any part is a miss), a file of any size is cached while the disk has room, and
an entry that would crowd the disk is not written (a log line says why)."""

from __future__ import annotations

import logging
from collections import namedtuple

import pytest
import torch

from pagoda.model import gguf_cache
from pagoda.model.loader import load_model
from tests.model.test_gguf_and_errors import write_tiny_gguf
from tests.model.test_quantized_models import _rewrite_split
from tests.tiny_models import save_tiny_model

pytest.importorskip("gguf")

GiB = 1 << 30
Usage = namedtuple("Usage", "total used free")


@pytest.fixture()
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_cache_large")
    hf = save_tiny_model("llama_linear", folder / "hf")
    path = folder / "tiny-F32.gguf"
    write_tiny_gguf(hf, path, "F32")
    return path


def _state(loaded) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in loaded.model.state_dict().items()}


def test_a_split_set_is_cached_under_every_part(tmp_path, cache_dir, tiny_gguf):
    (tmp_path / "split").mkdir()
    parts = _rewrite_split(tiny_gguf, tmp_path / "split" / "tiny-00001-of-00003.gguf", max_tensors=9)
    assert len(parts) == 3
    want = _state(load_model(str(tiny_gguf), dtype="float32"))
    first = _state(load_model(str(parts[0]), dtype="float32"))
    entry = gguf_cache.lookup(parts[0], "params-float32")
    assert entry is not None and "part_heads" in (entry / "complete").read_text()
    again = _state(load_model(str(parts[0]), dtype="float32"))  # read back from the entry
    for name in want:
        assert torch.equal(first[name], want[name]) and torch.equal(again[name], want[name]), name
    # Another weight in the last part: a different key, so the entry is not served for it.
    import gguf

    data = bytearray(parts[2].read_bytes())
    data[gguf.GGUFReader(str(parts[2])).tensors[-1].data_offset + 2] ^= 0x40  # a bit of a weight
    parts[2].write_bytes(bytes(data))
    assert gguf_cache.lookup(parts[0], "params-float32") is None
    changed = _state(load_model(str(parts[0]), dtype="float32"))
    assert any(not torch.equal(changed[n], want[n]) for n in want)
    assert gguf_cache.lookup(parts[0], "params-float32") is not None  # and it is cached in turn


def test_any_size_is_cached_while_the_disk_has_room(tmp_path, cache_dir, tiny_gguf, monkeypatch, caplog):
    big = tmp_path / "big.gguf"
    with open(big, "wb") as f:  # sparse: 1.5 GiB of size, no disk
        f.truncate(3 * GiB // 2)
    assert gguf_cache.entry_dir(big, "params-float32") is not None  # no size limit of its own

    def write(folder):
        (folder / "model.safetensors").write_bytes(b"x" * 1024)

    monkeypatch.setattr(gguf_cache.shutil, "disk_usage", lambda _: Usage(100 * GiB, 95 * GiB, 5 * GiB))
    with caplog.at_level(logging.INFO, logger="pagoda.model.gguf_cache"):
        gguf_cache.store(tiny_gguf, "params-float32", write, expected_bytes=int(4.5 * GiB))
    assert gguf_cache.lookup(tiny_gguf, "params-float32") is None  # 0.5 GiB would be left of 100
    assert "not caching params-float32 of tiny-F32.gguf: 4.5 GiB" in caplog.text
    monkeypatch.setattr(gguf_cache.shutil, "disk_usage", lambda _: Usage(100 * GiB, 50 * GiB, 50 * GiB))
    gguf_cache.store(tiny_gguf, "params-float32", write, expected_bytes=int(4.5 * GiB))
    assert gguf_cache.lookup(tiny_gguf, "params-float32") is not None
