"""Models named by their Hugging Face id (`Qwen/Qwen3-0.6B`), found in the local Hugging Face cache.

Nothing is downloaded: the id is looked up, at a revision (a branch, tag or commit; default
main), in the hub cache that `huggingface_hub` would use: `$HF_HUB_CACHE`, else `$HF_HOME/hub`,
else `~/.cache/huggingface/hub`. A model that is not there is a `ModelLoadError` naming the folder
searched and how to fill it. A path inside that cache (`.../models--org--name/snapshots/<commit>`) is
named by its id again, so that the engine's processes, which receive the path, report the id.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from pagoda.model.errors import ModelLoadError

# A Hugging Face repository id, "org/name" (letters, digits, -, _, .). A bare "name" is taken as a path:
# a mistyped folder should say "no such folder", not send anyone to the cache.
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}")
_SNAPSHOT = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/[^/]+/?$")


def hub_cache_dir() -> tuple[Path, str]:
    """The hub cache huggingface_hub reads, from the environment as it is now, and which setting named it."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser(), "HF_HUB_CACHE"
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub", "HF_HOME/hub"
    home = os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub", "the default; HF_HUB_CACHE and HF_HOME are unset"


def looks_like_repo_id(name: str) -> bool:
    return bool(_REPO_ID.fullmatch(name)) and not name.startswith((".", "/", "~"))


def find_in_hub_cache(repo_id: str, revision: str | None = None) -> Path:
    """The snapshot folder of `repo_id` at `revision` in the local cache; ModelLoadError when absent."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache, named_by = hub_cache_dir()
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    try:
        folder = snapshot_download(repo_id, revision=revision, cache_dir=str(cache), local_files_only=True)
    except (LocalEntryNotFoundError, OSError, ValueError) as exc:
        why = "" if isinstance(exc, LocalEntryNotFoundError) else f" ({exc})"
        if repo.is_dir():
            raise ModelLoadError(
                f"{repo_id}: no revision {revision or 'main'!r} in the local Hugging Face cache ({repo}){why}"
            ) from None
        raise ModelLoadError(
            f"{repo_id}: not a file or folder, and not in the local Hugging Face cache: searched {repo} "
            f"(cache {cache}: {named_by}{'' if cache.is_dir() else '; no such folder'}); nothing is downloaded: "
            f"set HF_HUB_CACHE or HF_HOME, or fetch it with `huggingface-cli download {repo_id}`{why}"
        ) from None
    return Path(folder)


def repo_id_of_snapshot(path: Path) -> str | None:
    """`org/name` when `path` is a snapshot folder of the hub cache's layout, else None."""
    match = _SNAPSHOT.search(path.as_posix())
    return f"{match['org']}/{match['name']}" if match else None


def single_gguf(folder: Path) -> Path | None:
    """The one .gguf file of a folder without config.json (a GGUF repository), or None."""
    files = sorted(folder.glob("*.gguf"))
    return files[0] if len(files) == 1 else None
