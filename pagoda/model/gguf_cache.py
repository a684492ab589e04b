"""A cache of what loading a GGUF file produces (config, dequantized weights, tokenizer), for fast starts.

Parsing a GGUF's metadata with gguf-py (tens of thousands of tokenizer entries) and converting its
tokenizer take several seconds each; both are done once per file and dtype, then later starts read
the results back: `params-<dtype>` holds a complete config.json (read without transformers) and the
model's parameters in pagoda's own layout, mapped into memory (see `mmap_weights`); `tokenizer`
holds tokenizer.json and its config (loaded without AutoTokenizer). Entries are keyed by
the file's content (a sampled fingerprint), written to a temporary folder and renamed into place,
so a half-written entry is never read. Set PAGODA_CACHE_DIR to move the cache, or to an empty
string to turn it off.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

# Dequantized weights take several times the GGUF's size; past this the cache would cost too much disk.
MAX_CACHED_GGUF_BYTES = 1 << 30
_COMPLETE = "complete"


def cache_root() -> Path | None:
    value = os.environ.get("PAGODA_CACHE_DIR")
    if value == "":
        return None
    return Path(value) if value else Path.home() / ".cache" / "pagoda"


def entry_dir(gguf_path: Path, kind: str) -> Path | None:
    """Where the cache keeps `kind` (e.g. 'weights-float32', 'tokenizer') of this file; None when off."""
    root = cache_root()
    if root is None:
        return None
    size = gguf_path.stat().st_size
    if size > MAX_CACHED_GGUF_BYTES and kind != "tokenizer":
        return None
    return root / "gguf" / f"{gguf_path.stem}-{fingerprint(gguf_path, size)}" / kind


def fingerprint(path: Path, size: int) -> str:
    """A content key: the size and 17 slices spread over the file (the header among them).

    Keyed by content, not by path or mtime, so every installed copy of the same file (each venv, each
    fresh clone) shares one entry, and a rewritten file gets a new one. Reads ~1 MiB whatever the size.
    """
    digest = hashlib.sha256(str(size).encode())
    chunk = 64 * 1024
    with open(path, "rb") as f:
        for i in range(17):
            f.seek(max(0, (size - chunk) * i // 16))
            digest.update(f.read(chunk))
    return digest.hexdigest()[:16]


def lookup(gguf_path: Path, kind: str) -> Path | None:
    folder = entry_dir(gguf_path, kind)
    return folder if folder is not None and (folder / _COMPLETE).exists() else None


def store(gguf_path: Path, kind: str, write) -> None:
    """Call write(folder) on a fresh temporary folder and publish it; any failure leaves no entry."""
    folder = entry_dir(gguf_path, kind)
    if folder is None:
        return
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{kind}-"))
        write(tmp)
        (tmp / _COMPLETE).touch()
        try:
            tmp.rename(folder)
        except OSError:  # another process published it first
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        pass  # a read-only or full disk only costs the next start its speed
