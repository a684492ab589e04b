"""One entry point that turns a model name or path into a pagoda model, its config and its tokenizer.

Models are found by pagoda/model/model_source.py: the default SmolLM2-135M-Instruct, a
Hugging Face folder (config.json plus one or sharded safetensors files), a `.gguf` file, or a Hugging
Face id found in the local Hugging Face cache (pagoda/model/hf_cache.py).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from pagoda.progress import iterate as with_progress
from pagoda.cpp_build import cpu_flags
from pagoda.model import gguf_cache
from pagoda.model.errors import ModelLoadError
from pagoda.model.model_source import (DEFAULT_MODEL, ModelSource, default_model_path,  # noqa: F401 (re-exported)
                                       resolve_model, resolve_tokenizer)

if TYPE_CHECKING:
    import torch

# torch (2-3 s to import) is imported inside the functions that load weights, not at module level:
# the API server process imports this module only to resolve the model's path and load its tokenizer.

logger = logging.getLogger(__name__)

_DTYPE_NAMES = ("float32", "bfloat16", "float16")


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    import torch

    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {dtype}")
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


def cpu_has_bf16() -> bool:
    """True on CPUs with native bf16 matrix instructions (AVX512-BF16 or AMX), where bf16 is fast."""
    return not {"avx512_bf16", "amx_bf16"}.isdisjoint(cpu_flags().split())


def cpu_has_amx() -> bool:
    """True on CPUs with AMX bf16 tiles that oneDNN may use (ONEDNN_MAX_CPU_ISA, where set, names an
    AMX level or all of them)."""
    limit = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    return "amx_bf16" in cpu_flags().split() and (limit in ("ALL", "DEFAULT") or "AMX" in limit)


def load_config(source: ModelSource, use_cache: bool = True, light: bool = False):
    """The model's config: from GGUF metadata (`light`: read without its tokenizer, gguf_index), a
    Hugging Face folder's config.json, or (for a GGUF whose conversion is cached) the cache's
    complete config.json read without transformers."""
    if source.is_gguf:
        if use_cache:
            # Any dtype's entry will do: the config does not depend on the dtype.
            entries = (gguf_cache.lookup(source.path, _weights_kind(d)) for d in _DTYPE_NAMES)
            cached = next((e for e in entries if e is not None), None)
            if cached is not None:
                try:
                    return _cached_config(cached)
                except ModelLoadError as exc:  # damaged: the GGUF itself still says
                    logger.warning("ignoring the load cache entry %s: %s", cached, exc)
        from pagoda.model.gguf_file import gguf_config, open_gguf

        return gguf_config(open_gguf(source.path, light), source.path)
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(source.path))
    except Exception as exc:
        raise ModelLoadError(f"{source.path / 'config.json'}: cannot read config ({exc})") from None
    quant = getattr(config, "quantization_config", None)
    if quant:
        method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else type(quant).__name__
        raise ModelLoadError(
            f"{source.path / 'config.json'}: quantized checkpoints ({method}) are not supported; "
            "give unquantized safetensors or a .gguf file"
        )
    _limit_to_sliding_window(config, source.path / "config.json")
    return config


def _limit_to_sliding_window(config, where: Path) -> None:
    """Pagoda's attention is full attention. Where transformers would attend over a sliding window,
    the two agree only while a sequence fits the window: cap the model's context there."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if not window or (layer_types is not None and "sliding_attention" not in layer_types):
        return
    limit = getattr(config, "max_position_embeddings", None)
    if limit is None or window < limit:
        logger.warning(
            "%s: sliding-window attention (window %d) is not implemented; limiting the context to %d tokens, "
            "where full attention gives the same result", where, window, window
        )
        config.max_position_embeddings = window


def _weights_kind(dtype: torch.dtype | str) -> str:
    # "params": pagoda's own parameter layout (see mmap_weights); earlier "weights-*" entries held
    # Hugging Face names and are no longer read.
    return f"params-{dtype}".replace("torch.", "")


def _cached_config(folder: Path):
    from pagoda.model.plain_config import PlainConfig

    try:
        return PlainConfig.from_json_file(folder / "config.json")
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{folder / 'config.json'}: cannot read the cached config ({exc})") from None


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = [folder / f for f in dict.fromkeys(weight_map.values())]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({exc!r})") from None
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{f}: listed in the index but missing")
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]  # as transformers: other .safetensors beside it are not the model
    else:
        files = sorted(f for f in folder.glob("*.safetensors") if f.is_file())
    if not files:
        raise ModelLoadError(f"{folder}: no .safetensors files")
    return files


def source_tensors(source: ModelSource, config: object, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, name by name, in `dtype`: a GGUF's (dequantized) or a folder's safetensors."""
    if source.is_gguf:
        from pagoda.model.gguf_file import gguf_tensors, open_gguf

        reader = open_gguf(source.path)
        return with_progress(gguf_tensors(reader, source.path, config, dtype), len(reader.tensors),
                                f"converting {source.path.name} (once; cached afterwards)", "tensors")
    total = _count_safetensors(source.path)
    return with_progress(_safetensors_tensors(source.path, dtype), total, f"loading {source.name}", "tensors")


def _count_safetensors(folder: Path) -> int | None:
    from safetensors import safe_open

    try:
        return sum(len(safe_open(str(f), framework="pt").keys()) for f in _safetensors_files(folder))
    except Exception:  # unreadable: _safetensors_tensors names the file when it gets there
        return None


def _safetensors_tensors(folder: Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for f in _safetensors_files(folder):
        try:
            st = safe_open(str(f), framework="pt")
        except Exception as exc:  # SafetensorError, OSError: a damaged, truncated or foreign file
            raise ModelLoadError(f"{f}: not a readable safetensors file ({exc})") from None
        with st:
            for name in st.keys():
                try:
                    tensor = st.get_tensor(name)
                except Exception as exc:
                    raise ModelLoadError(f"{f}: cannot read tensor {name!r} ({exc})") from None
                if not tensor.is_floating_point():
                    raise ModelLoadError(
                        f"{f}: tensor {name!r} is {tensor.dtype}, not floating point "
                        "(quantized checkpoints are not supported)"
                    )
                yield name, tensor.to(dtype)


def _store_converted(path: Path, dtype: torch.dtype, config, net: torch.nn.Module) -> None:
    from pagoda.model.mmap_weights import save_params

    def write(folder: Path) -> None:
        # Every key, defaults included (not save_pretrained's diff), so that a cache hit can read it
        # as a PlainConfig without transformers filling in defaults.
        config.to_json_file(folder / "config.json", use_diff=False)
        save_params(net, folder / "model.safetensors")

    nbytes = sum(t.numel() * t.element_size() for t in net.state_dict().values())
    gguf_cache.store(path, _weights_kind(dtype), write, expected_bytes=nbytes)
    # The Hugging Face-named entry earlier versions wrote is never read again: free its disk.
    legacy = gguf_cache.entry_dir(path, f"weights-{dtype}".replace("torch.", ""))
    if legacy is not None and legacy.exists():
        import shutil

        shutil.rmtree(legacy, ignore_errors=True)


@dataclass
class LoadedModel:
    model: torch.nn.Module
    config: object
    architecture: str
    source: ModelSource
    dtype: torch.dtype


def _build_on_meta(cls, config, arch: str, dtype: torch.dtype, where: Path | str, **parallel) -> torch.nn.Module:
    """The model without storage: no memory or time is spent on random init that weights overwrite.
    A config the model cannot follow is a ModelLoadError naming `where` (the file that says it)."""
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            return cls(config, arch, **parallel)  # parallel: tp, pp (a rank's shard, shard_loader)
    except (ValueError, TypeError, KeyError, AttributeError, ZeroDivisionError, RuntimeError) as exc:
        raise ModelLoadError(f"{where}: cannot build {arch} from this config ({exc})") from None
    finally:
        torch.set_default_dtype(previous)


def _materialize_rotary(net: torch.nn.Module, device: torch.device) -> None:
    from pagoda.model.layers import RotaryEmbedding

    for module in net.modules():
        if isinstance(module, RotaryEmbedding):
            module.materialize(device)


def _load_cached(folder: Path, source: ModelSource, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    """A cache hit: config.json without transformers, parameters mapped from the file (no copy)."""
    from pagoda.model.mmap_weights import load_params
    from pagoda.model.registry import resolve_architecture

    config = _cached_config(folder)
    arch, cls = resolve_architecture(config, str(source.path))
    net = _build_on_meta(cls, config, arch, dtype, folder / "config.json")
    load_params(net, folder / "model.safetensors", device)
    _materialize_rotary(net, device)
    return LoadedModel(net.eval(), config, arch, source, dtype)


def describe_model(model: str | None = None, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu") -> LoadedModel:
    """What load_model would return, without the weights (`model` is None): for a process that
    sizes and schedules but leaves the weights to its workers."""
    import torch

    from pagoda.model.registry import resolve_architecture

    device = torch.device(device)
    source = resolve_model(model)
    torch_dtype = resolve_dtype(dtype, device)
    config = load_config(source)
    arch, _ = resolve_architecture(config, str(source.path))
    return LoadedModel(None, config, arch, source, torch_dtype)


def load_model(model: str | None = None, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu",
               quantization: str | None = None) -> LoadedModel:
    """`quantization` (None, "gguf", "int8"): weights kept quantized in memory (quant_loader)."""
    import torch

    from pagoda.model import quant_loader
    from pagoda.model.registry import resolve_architecture

    device = torch.device(device)
    source = resolve_model(model)
    quant_loader.check_quantization(quantization, device, source.is_gguf)
    torch_dtype = resolve_dtype(dtype, device)
    # Packed GGUF blocks need no load cache: the file is already the compact form.
    use_cache = source.is_gguf and quantization != "gguf"
    cached = gguf_cache.lookup(source.path, _weights_kind(torch_dtype)) if use_cache else None
    if cached:
        try:
            return _noted(quant_loader.requantize(_load_cached(cached, source, torch_dtype, device), quantization),
                          quantization)
        except (MemoryError, torch.cuda.OutOfMemoryError):
            raise  # not the entry's fault
        except Exception as exc:  # a damaged entry only costs this start its speed, and is replaced
            logger.warning("ignoring the load cache entry %s: %s", cached, exc)
            gguf_cache.discard(source.path, _weights_kind(torch_dtype))
    config = load_config(source, use_cache=False, light=quantization == "gguf")
    arch, cls = resolve_architecture(config, str(source.path))
    where = source.path if source.is_gguf else source.path / "config.json"
    net = _build_on_meta(cls, config, arch, torch_dtype, where)
    if quantization == "gguf":
        net = quant_loader.load_packed_gguf(net, source.path, config, torch_dtype, device, _materialize_rotary)
        return LoadedModel(net.eval(), config, arch, source, torch_dtype)
    net = net.to_empty(device=device)
    _materialize_rotary(net, device)
    weights = source_tensors(source, config, torch_dtype)
    with torch.no_grad():
        net.load_weights(weights, source=str(source.path))
    net.eval()
    if source.is_gguf:
        _store_converted(source.path, torch_dtype, config, net)
    return _noted(quant_loader.requantize(LoadedModel(net, config, arch, source, torch_dtype), quantization),
                  quantization)


def _noted(loaded: LoadedModel, quantization: str | None) -> LoadedModel:
    """`loaded` with its model's `gguf_file` set: the GGUF its float weights were dequantized from,
    whose blocks the execution layer may keep beside them (exec/gguf_block_linears.py); else None."""
    dequantized = loaded.source.is_gguf and quantization is None
    loaded.model.gguf_file = str(loaded.source.path) if dequantized else None
    return loaded


def load_tokenizer(source: ModelSource):
    """The tokenizer (with its chat template) from transformers; None when the folder (or the GGUF's
    metadata) has none, ModelLoadError when it has one that does not load."""
    if not source.is_gguf and not any(
        (source.path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    ):
        return None  # e.g. a random-weight model saved without one: run on token ids
    if source.is_gguf:
        cached = gguf_cache.lookup(source.path, "tokenizer")
        if cached:
            try:
                return _load_cached_tokenizer(cached)
            except Exception as exc:  # damaged: convert again, and replace the entry
                logger.warning("ignoring the load cache entry %s: %s", cached, exc)
                gguf_cache.discard(source.path, "tokenizer")
    from transformers import AutoTokenizer

    try:
        if source.is_gguf:
            tokenizer = AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
        else:
            return AutoTokenizer.from_pretrained(str(source.path))
    except Exception as exc:
        if source.is_gguf and not _gguf_has_tokenizer(source.path):
            return None  # e.g. a converted random-weight model: run on token ids
        raise ModelLoadError(f"{source.path}: cannot load the tokenizer ({exc})") from None
    gguf_cache.store(source.path, "tokenizer", tokenizer.save_pretrained)
    return tokenizer


def _gguf_has_tokenizer(path: Path) -> bool:
    from pagoda.model.gguf_file import open_gguf

    return "tokenizer.ggml.model" in open_gguf(path).fields


# The classes that are a plain `tokenizers` backend; transformers 5 names it TokenizersBackend
# (PreTrainedTokenizerFast is an alias of it).
_FAST_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _load_cached_tokenizer(folder: Path):
    """The cached tokenizer, built by the class its tokenizer_config.json names.

    AutoTokenizer would build the very same object, but importing it pulls in torch and the model
    registry (about 2.5 s in the API process, which needs neither); the backend class alone imports
    in about a second. Same class, same files: identical tokenization and chat template.
    """
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        config = {}
    if config.get("tokenizer_class") in _FAST_TOKENIZER_CLASSES:
        try:
            from transformers.tokenization_utils_tokenizers import TokenizersBackend
        except ImportError:  # another transformers layout: take the general path
            pass
        else:
            return TokenizersBackend.from_pretrained(str(folder))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))
