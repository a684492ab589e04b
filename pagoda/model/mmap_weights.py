"""A model's parameters saved as one safetensors file in pagoda's own layout, and loaded back by mmap.

The GGUF load cache keeps converted weights this way: names and shapes are exactly the model's
state_dict (merged qkv_proj / gate_up_proj), so loading needs no renaming, no merging and no copy:
each parameter becomes a view into a private (copy-on-write) mapping of the file. On the CPU that
costs next to nothing at load time, and the first forward pass reads the pages from the page cache,
which the kernel maps many pages per fault (anonymous memory that a copy would fill is faulted in one
4 KiB page at a time, and page faults are what a fresh process on a small VM spends most time on).
"""

from __future__ import annotations

import ctypes
import json
import mmap
import struct
import sys
from pathlib import Path
from typing import Iterable

import torch
from torch import nn

from pagoda.model.errors import ModelLoadError

_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_MADV_DONTNEED = 4
# (address, bytes) of every weights file load_params has mapped: release_pages acts only inside these.
_MAPPED: set[tuple[int, int]] = set()


def save_params(net: nn.Module, path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous() for k, v in net.state_dict().items()}, str(path))


def _read_header(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > path.stat().st_size:
            raise ValueError(f"header length {length} exceeds the file")
        header = json.loads(f.read(length))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    header.pop("__metadata__", None)
    return 8 + length, header


def load_params(net: nn.Module, path: Path, device: torch.device) -> None:
    """Replace every parameter and persistent buffer of `net` (built on the meta device) by the
    file's tensor of the same name; raise ModelLoadError unless names, shapes and dtypes all match
    and the tensors' byte ranges exactly tile the file's data (as safetensors requires)."""
    try:
        data_start, header = _read_header(path)
        size = path.stat().st_size
    except (OSError, ValueError, struct.error) as exc:
        raise ModelLoadError(f"{path}: unreadable weights file ({exc})") from None
    expected = net.state_dict(keep_vars=True)
    if set(header) != set(expected):
        missing, extra = sorted(set(expected) - set(header)), sorted(set(header) - set(expected))
        raise ModelLoadError(f"{path}: tensors do not match the model (missing {missing[:3]}, unexpected {extra[:3]})")
    layout = []  # (begin, end, name, dtype, shape), checked in full before anything is mapped
    for name, meta in header.items():
        want = expected[name]
        try:
            dtype = _DTYPES.get(meta["dtype"])
            shape = tuple(int(d) for d in meta["shape"])
            begin, end = (data_start + int(o) for o in meta["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"{path}: malformed header entry for {name!r} ({exc!r})") from None
        if dtype != want.dtype or shape != tuple(want.shape):
            raise ModelLoadError(
                f"{path}: tensor {name!r} is {meta['dtype']} {list(shape)}, "
                f"expected {want.dtype} {tuple(want.shape)}"
            )
        if end - begin != want.numel() * want.element_size():
            raise ModelLoadError(f"{path}: tensor {name!r} spans {end - begin} bytes, expected {want.numel() * want.element_size()}")
        layout.append((begin, end, name, dtype, shape))
    layout.sort()
    covered = data_start
    for begin, end, name, _, _ in layout:
        if begin != covered:
            raise ModelLoadError(f"{path}: tensor {name!r} starts at byte {begin}, expected {covered} (damaged header)")
        covered = end
    if covered != size:
        raise ModelLoadError(f"{path}: the tensors cover {covered} bytes of a {size}-byte file (truncated or damaged)")
    storage = torch.UntypedStorage.from_file(str(path), False, size)  # shared=False: MAP_PRIVATE
    _MAPPED.add((storage.data_ptr(), storage.nbytes()))
    for begin, end, name, dtype, shape in layout:
        itemsize = torch.empty((), dtype=dtype).element_size()
        if begin % itemsize == 0:
            tensor = torch.empty(0, dtype=dtype).set_(storage, begin // itemsize, shape)
        else:  # safetensors pads its header to 8 bytes, so this is only a safety net
            raw = torch.empty(0, dtype=torch.uint8).set_(storage, begin, (end - begin,))
            tensor = raw.clone().view(dtype).reshape(shape)
        if tensor.device != device:
            tensor = tensor.to(device)
        _assign(net, name, tensor)


def _assign(net: nn.Module, name: str, tensor: torch.Tensor) -> None:
    prefix, _, leaf = name.rpartition(".")
    module = net.get_submodule(prefix) if prefix else net
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
    else:
        module._buffers[leaf] = tensor


def _file_mapped_ranges() -> list[tuple[int, int]]:
    """[start, end) of this process's file-backed mappings, from /proc/self/maps."""
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/"):
                lo, hi = fields[0].split("-")
                ranges.append((int(lo, 16), int(hi, 16)))
    return ranges


def release_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Give back the resident pages of parameters that live in a weights file mapped by load_params
    and are no longer used (linears whose weights were repacked), so they stop counting in RSS.

    Harmless even if something reads them again: the mapping is private and weights are never
    written, so a dropped page is read back from the file. Only whole pages inside a tensor are
    dropped, and only while the range is still a file mapping (a recorded mapping may have been
    unmapped and its addresses reused). Other tensors are left alone. Returns how many were released.
    """
    if sys.platform != "linux":
        return 0
    ours = [t for t in tensors if (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) in _MAPPED]
    if not ours:
        return 0
    mapped = _file_mapped_ranges()  # read once: a torch process has about a thousand mappings
    libc = ctypes.CDLL(None, use_errno=True)
    released = 0
    for tensor in ours:
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        if not any(lo <= start and end <= hi for lo, hi in mapped):
            continue
        first, last = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
        if last > first and libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED) == 0:
            released += 1
    return released
