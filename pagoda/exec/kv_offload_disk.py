"""The disk tier: one file per slot in a folder named by the cache's key, read back memory-mapped.

A file is a header and the block's bytes. The header carries a magic string, the cache key (a
digest of the model's weights and of every setting that shapes a block: dtype, block size, layers,
KV heads, head dim, the block hash function), the block's hash, the payload size and its CRC-32. So
the folder survives a restart: at start-up `scan()` reads every file, and only those whose key and
checksum match are handed to the KV layer as ready entries (oldest first, by modification time); a
stale (another key) or corrupt file is skipped with a warning, and its slot is overwritten later.
A file is written under a temporary name and renamed, so a crash never leaves half a block under
a slot's name.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import struct
import sys
import zlib
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

MAGIC = b"PGKVBLK1"
_HEADER = struct.Struct("<8s32s16sQI")  # magic, cache key, block hash (signed 128-bit), nbytes, crc32
HEADER_SIZE = 128  # the header (68 bytes) padded, so the payload starts aligned
_SAMPLE = 1 << 20


def weights_fingerprint(path: Path) -> str:
    """A digest of a model's files (a .gguf file, or a folder's weights and config): their names,
    sizes, and the first and last MiB of each, which tell different weights apart without reading
    whole checkpoints."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.suffix in (".safetensors", ".gguf", ".bin", ".json") and p.is_file()
    )
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}:".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(_SAMPLE))
            if size > _SAMPLE:
                fh.seek(max(_SAMPLE, size - _SAMPLE))
                h.update(fh.read(_SAMPLE))
    return h.hexdigest()


def cache_key(weights: str, **settings: object) -> bytes:
    """The 32-byte key of one model's blocks under one set of cache settings."""
    parts = [f"format={MAGIC.decode()}", f"weights={weights}",
             # The default block hash is Python's tuple hash: it must agree across restarts.
             f"hash={sys.hash_info.algorithm}/{sys.hash_info.width}/{sys.version_info[:2]}"]
    parts += [f"{k}={settings[k]}" for k in sorted(settings)]
    return hashlib.sha256("\n".join(parts).encode()).digest()


class DiskTierStorage:
    """`num_slots` block files under `root/<key prefix>/`."""

    def __init__(self, root: str | Path, key: bytes, num_slots: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.key = key
        self.num_slots = num_slots
        self.shape = shape
        self.dtype = dtype
        self.nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        self.folder = Path(root) / key.hex()[:16]
        self.folder.mkdir(parents=True, exist_ok=True)

    def path(self, slot: int) -> Path:
        return self.folder / f"slot-{slot:07d}.kvb"

    def save(self, slot: int, key: int, block: torch.Tensor) -> None:
        data = block.detach().to("cpu").contiguous().view(torch.uint8).numpy()
        header = _HEADER.pack(MAGIC, self.key, key.to_bytes(16, "little", signed=True), self.nbytes,
                              zlib.crc32(data))
        path = self.path(slot)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(header.ljust(HEADER_SIZE, b"\0"))
            f.write(memoryview(data))
        os.replace(tmp, path)

    def load(self, slot: int, key: int, out: torch.Tensor) -> None:
        with open(self.path(slot), "rb") as f:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as m:
                magic, file_key, block_hash, nbytes, _ = _HEADER.unpack_from(m)
                if (magic, file_key, nbytes) != (MAGIC, self.key, self.nbytes) or \
                        int.from_bytes(block_hash, "little", signed=True) != key:
                    raise RuntimeError(f"{self.path(slot)} does not hold block {key}")  # checked at scan
                payload = torch.frombuffer(m, dtype=torch.uint8, count=nbytes, offset=HEADER_SIZE)
                out.copy_(payload.view(self.dtype).view(self.shape))
                del payload  # the mapping closes only once no tensor views it

    def scan(self) -> list[tuple[int, int]]:
        """The valid blocks on disk as (slot, block hash), least recently written first; skips
        (with a warning) files of another key, of another size, or whose checksum fails."""
        found = []
        for path in sorted(self.folder.glob("slot-*.kvb")):
            why = None
            try:
                slot = int(path.stem.removeprefix("slot-"))
                with open(path, "rb") as f:
                    head = f.read(HEADER_SIZE)
                    payload = f.read()
                if len(head) < _HEADER.size:
                    why = "shorter than a header"
                else:
                    magic, file_key, block_hash, nbytes, crc = _HEADER.unpack_from(head)
                    if magic != MAGIC:
                        why = "not a Pagoda KV block file"
                    elif file_key != self.key:
                        why = "stale: written for other weights or cache settings"
                    elif nbytes != self.nbytes or len(payload) != nbytes:
                        why = f"size {len(payload)} bytes, expected {self.nbytes}"
                    elif zlib.crc32(payload) != crc:
                        why = "corrupt: checksum mismatch"
                    elif slot >= self.num_slots:
                        why = f"slot {slot} beyond the tier's {self.num_slots}"
            except (OSError, ValueError) as exc:
                why = f"unreadable ({exc})"
            if why is not None:
                logger.warning("KV disk tier: skipping %s: %s", path, why)
                continue
            found.append((path.stat().st_mtime_ns, slot, int.from_bytes(block_hash, "little", signed=True)))
        found.sort()
        return [(slot, key) for _, slot, key in found]
