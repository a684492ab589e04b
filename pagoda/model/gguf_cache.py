"""A cache of what loading a GGUF file produces (config, dequantized weights, tokenizer), for fast starts.

Parsing a GGUF's metadata with gguf-py (tens of thousands of tokenizer entries) and converting its
tokenizer take several seconds each; both are done once per file and dtype, then later starts read
the results back: `params-<dtype>` holds a complete config.json (read without transformers) and the
model's parameters in pagoda's own layout, mapped into memory (see `mmap_weights`); `tokenizer`
holds tokenizer.json and its config (loaded without AutoTokenizer). Entries are keyed by
the file's content (a sampled fingerprint; of every part, for a split model), written to a temporary
folder, flushed to disk and renamed into place, so a half-written entry is never read. Set
PAGODA_CACHE_DIR to move the cache, or to an empty string to turn it off. Any size is cached while
the cache's disk has room: an entry that would leave less than a tenth of the disk (at least
1 GiB) free is not written.

An entry is served only while its `complete` manifest still holds: every file it lists is there with
its size (files up to 16 MiB also with their digest, larger ones with the digest of their first
MiB, which holds a safetensors header), and the GGUF's whole metadata section (everything before
the tensor data, where in-place editors such as gguf-set-metadata write; each part's, for a split
model) has the digest recorded when the entry was written. Anything else is a miss, and the next
store replaces the entry. (Not covered: bytes flipped inside a large cached weights file past its first MiB, or an in-place edit of
GGUF tensor data that the sampled fingerprint misses; hashing those would cost a cache hit its speed.)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import struct
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

# Dequantized weights take several times the GGUF's size: an entry is written only if the disk keeps
# this share of itself (and at least _MIN_FREE_BYTES) free after it.
_FREE_SHARE = 0.1
_MIN_FREE_BYTES = 1 << 30
_COMPLETE = "complete"
_MANIFEST_VERSION = 1
_FULL_DIGEST_BYTES = 16 << 20  # files up to this size are hashed whole; larger ones by their first MiB
_HEAD_DIGEST_BYTES = 1 << 20


def cache_root() -> Path | None:
    value = os.environ.get("PAGODA_CACHE_DIR")
    if value == "":
        return None
    return Path(value) if value else Path.home() / ".cache" / "pagoda"


def entry_dir(gguf_path: Path, kind: str) -> Path | None:
    """Where the cache keeps `kind` (e.g. 'params-float32', 'tokenizer') of this file; None when off."""
    root = cache_root()
    if root is None:
        return None
    prints = [fingerprint(p, p.stat().st_size) for p in _parts(gguf_path)]  # a split model: every part's
    key = prints[0] if len(prints) == 1 else hashlib.sha256(" ".join(prints).encode()).hexdigest()[:16]
    return root / "gguf" / f"{gguf_path.stem}-{key}" / kind


def _parts(gguf_path: Path) -> list[Path]:
    """Every file of the model whose (first) file is `gguf_path`."""
    if not re.fullmatch(r".+-\d{5}-of-\d{5}\.gguf", gguf_path.name):
        return [gguf_path]
    from pagoda.model.gguf_file import split_parts

    return split_parts(gguf_path)


def fingerprint(path: Path, size: int) -> str:
    """A content key: the size and 17 slices spread over the file (the header among them).

    Keyed by content, not by path or mtime, so every installed copy of the same file (each venv, each
    fresh clone) shares one entry, and a rewritten file gets a new one. Reads ~1 MiB whatever the size.
    (The manifest then checks the whole metadata section, which these slices may miss.)
    """
    digest = hashlib.sha256(str(size).encode())
    chunk = 64 * 1024
    with open(path, "rb") as f:
        for i in range(17):
            f.seek(max(0, (size - chunk) * i // 16))
            digest.update(f.read(chunk))
    return digest.hexdigest()[:16]


_FIXED_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value types


def metadata_end(path: Path) -> int:
    """The offset where a GGUF's tensor-info section ends: the header, every key/value and every tensor
    description lie before it. Walked with struct alone (no gguf import); ValueError if unreadable."""
    with open(path, "rb") as f:
        buf = bytearray(f.read(24))
        if len(buf) < 24 or buf[:4] != b"GGUF":
            raise ValueError("not a GGUF file")
        order = "<" if struct.unpack_from("<I", buf, 4)[0] < 0x10000 else ">"
        u32, u64 = struct.Struct(order + "I"), struct.Struct(order + "Q")
        n_tensors, n_kv = struct.unpack_from(order + "QQ", buf, 8)
        pos = 24

        def need(n: int) -> None:
            nonlocal buf
            while len(buf) < pos + n:
                more = f.read(max(1 << 20, pos + n - len(buf)))
                if not more:
                    raise ValueError("truncated metadata")
                buf += more

        def read(fmt: struct.Struct) -> int:
            nonlocal pos
            need(fmt.size)
            (value,) = fmt.unpack_from(buf, pos)
            pos += fmt.size
            return value

        # (Each length is read into a name first: `pos += read(...)` would add to pos as it was
        # before read() moved it.)
        for _ in range(n_kv):
            length = read(u64)  # the key
            pos += length
            kind = read(u32)
            if kind == 8:
                length = read(u64)
                pos += length
            elif kind == 9:
                item, count = read(u32), read(u64)
                if item == 8:
                    for _ in range(count):
                        length = read(u64)
                        pos += length
                elif item in _FIXED_SIZES:
                    pos += _FIXED_SIZES[item] * count
                else:
                    raise ValueError(f"unknown array item type {item}")
            elif kind in _FIXED_SIZES:
                pos += _FIXED_SIZES[kind]
            else:
                raise ValueError(f"unknown value type {kind}")
        for _ in range(n_tensors):
            length = read(u64)  # the name
            pos += length
            dims = read(u32)
            pos += 8 * dims + 4 + 8  # dims, type, offset
        need(0)
        return pos


def _digest(path: Path, limit: int | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        remaining = limit
        while remaining is None or remaining > 0:
            block = f.read(1 << 20 if remaining is None else min(1 << 20, remaining))
            if not block:
                break
            digest.update(block)
            if remaining is not None:
                remaining -= len(block)
    return digest.hexdigest()


def _file_record(path: Path) -> dict:
    size = path.stat().st_size
    covered = size if size <= _FULL_DIGEST_BYTES else _HEAD_DIGEST_BYTES
    return {"size": size, "sha256": _digest(path, covered), "covered": covered}


def _manifest(gguf_path: Path, folder: Path) -> dict:
    head = metadata_end(gguf_path)
    files = {
        p.relative_to(folder).as_posix(): _file_record(p)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != _COMPLETE
    }
    manifest = {"version": _MANIFEST_VERSION, "gguf_head": [head, _digest(gguf_path, head)], "files": files}
    others = _parts(gguf_path)[1:]
    if others:
        manifest["part_heads"] = [[end, _digest(p, end)] for p in others for end in [metadata_end(p)]]
    return manifest


def _valid(gguf_path: Path, folder: Path) -> bool:
    """Whether the entry's manifest still holds (see the module's docstring)."""
    try:
        manifest = json.loads((folder / _COMPLETE).read_text())
        if manifest.get("version") != _MANIFEST_VERSION:
            return False  # e.g. an empty marker from an earlier version: no way to check it
        heads = [manifest["gguf_head"], *manifest.get("part_heads", [])]
        parts = _parts(gguf_path)
        if len(heads) != len(parts):
            return False
        for part, (head, head_digest) in zip(parts, heads):
            if _digest(part, head) != head_digest:
                return False
        for name, record in manifest["files"].items():
            path = folder / name
            if not path.is_file() or path.stat().st_size != record["size"]:
                return False
            if _digest(path, record["covered"]) != record["sha256"]:
                return False
        return True
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return False


def lookup(gguf_path: Path, kind: str) -> Path | None:
    folder = entry_dir(gguf_path, kind)
    if folder is None or not (folder / _COMPLETE).is_file():
        return None
    return folder if _valid(gguf_path, folder) else None


def discard(gguf_path: Path, kind: str) -> None:
    """Remove this file's `kind` entry (one found damaged); a read-only cache is left as it is."""
    folder = entry_dir(gguf_path, kind)
    if folder is not None:
        _remove(folder)


def _remove(folder: Path) -> None:
    if not os.path.lexists(folder):
        return
    try:
        if folder.is_symlink() or not folder.is_dir():
            folder.unlink()
            return
        # Renamed away first, so no reader ever sees a half-removed entry.
        doomed = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-old-"))
    except OSError:
        return
    try:
        folder.rename(doomed / folder.name)
    except OSError:
        pass
    shutil.rmtree(doomed, ignore_errors=True)


def _fsync_dir(folder: Path) -> None:
    try:  # best effort: not every file system can sync a directory
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def _fsync_tree(folder: Path) -> None:
    """Flush the entry's files to disk before it is published: after a crash or power cut the rename
    may survive while unflushed file contents do not."""
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    _fsync_dir(folder)


def has_room(folder: Path, nbytes: int) -> bool:
    """Whether `nbytes` more on `folder`'s disk leave it the free share this cache keeps."""
    usage = shutil.disk_usage(folder)
    return usage.free - nbytes >= max(_MIN_FREE_BYTES, _FREE_SHARE * usage.total)


def store(gguf_path: Path, kind: str, write, expected_bytes: int = 0) -> None:
    """Call write(folder) on a fresh temporary folder and publish it; any failure leaves no entry.

    `expected_bytes`: about what write() will put there; nothing is written unless the disk has
    room for it (`has_room`). An entry already there is kept if it is valid (another process
    published it first) and replaced if not (damaged, or written for earlier contents of the file)."""
    folder = entry_dir(gguf_path, kind)
    if folder is None:
        return
    tmp = None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        if expected_bytes and not has_room(folder.parent, expected_bytes):
            free = shutil.disk_usage(folder.parent).free
            logger.info("not caching %s of %s: %.1f GiB would leave too little of the %.1f GiB free on %s",
                        kind, gguf_path.name, expected_bytes / 2**30, free / 2**30, folder.parent)
            return
        tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{kind}-"))
        write(tmp)
        manifest = _manifest(gguf_path, tmp)
        (tmp / _COMPLETE).write_text(json.dumps(manifest))
        _fsync_tree(tmp)
        if os.path.lexists(folder) and not _valid(gguf_path, folder):
            _remove(folder)
        try:
            tmp.rename(folder)
            tmp = None
        except OSError:  # another process published it first
            pass
        _fsync_dir(folder.parent)
    except (OSError, ValueError, struct.error):
        pass  # a read-only or full disk (or a GGUF whose metadata we cannot walk) costs only speed
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

