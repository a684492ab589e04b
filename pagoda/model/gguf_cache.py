"""A cache of what loading a GGUF file produces (config, dequantized weights, tokenizer), for fast starts.

Parsing a GGUF's metadata with gguf-py (tens of thousands of tokenizer entries) and converting its
tokenizer take several seconds each; both are done once per file and dtype, then later starts read
a Hugging Face folder (config.json, model.safetensors by mmap, tokenizer.json). Entries are keyed by
the file's path, size and modification time, written to a temporary folder and renamed into place,
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
    st = gguf_path.stat()
    if st.st_size > MAX_CACHED_GGUF_BYTES and kind != "tokenizer":
        return None
    key = hashlib.sha256(f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return root / "gguf" / f"{gguf_path.stem}-{key}" / kind


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
