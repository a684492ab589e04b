"""Loading one rank's shard of a model: its pipeline stage's layers, and of those its tensor-parallel
slice. Every weight is read one checkpoint tensor at a time, skipped when the stage does not hold it
and cut down to the rank's slice (`tensor_parallel.shard_tensor`), so no rank holds the whole model. The GGUF load cache is read when it holds the model (its merged projections are split
back first) and never written: a shard is not the model the cache describes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from pagoda.model import gguf_cache
from pagoda.model.loader import (
    LoadedModel, _build_on_meta, _cached_config, _materialize_rotary, _weights_kind,
    load_config, resolve_dtype, resolve_model, source_tensors,
)
from pagoda.model.pipeline import SINGLE_STAGE, PPStage
from pagoda.model.registry import resolve_architecture
from pagoda.model.tensor_parallel import TPGroup, unmerge_params


def _cached_tensors(folder: Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as st:
        for name in st.keys():
            yield name, st.get_tensor(name).to(dtype)


def load_model_shard(model: str | None, dtype: str | torch.dtype, device: str | torch.device, tp: TPGroup,
                     pp: PPStage = SINGLE_STAGE) -> LoadedModel:
    device = torch.device(device)
    source = resolve_model(model)
    torch_dtype = resolve_dtype(dtype, device)
    cached = gguf_cache.lookup(source.path, _weights_kind(torch_dtype)) if source.is_gguf else None
    config = _cached_config(cached) if cached else load_config(source, use_cache=False)
    arch, cls = resolve_architecture(config, str(source.path))
    where = source.path if source.is_gguf else source.path / "config.json"
    net = _build_on_meta(cls, config, arch, torch_dtype, where, tp=tp, pp=pp).to_empty(device=device)
    _materialize_rotary(net, device)
    if cached:
        weights = unmerge_params(_cached_tensors(cached, torch_dtype), config)
    else:
        weights = source_tensors(source, config, torch_dtype)
    with torch.no_grad():
        net.load_weights(weights, source=str(source.path))
    return LoadedModel(net.eval(), config, arch, source, torch_dtype)
