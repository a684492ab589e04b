"""The tensors that hold a runner's weights, and the two things done to all of them at once: copying a
replacement checkpoint's values in (a hot weight update) and parking them in a mapped file (sleep).

Both act on the tensors in place (`copy_`, `set_`), never by swapping modules: every holder of a
weight (the packed linears, the packed LM head, captured CUDA graphs) keeps pointing at the same
tensor objects, so nothing has to be rebuilt or re-captured.
"""

from __future__ import annotations

import os
import tempfile
from typing import Callable

import torch
from torch import nn

from pagoda.exec.cpu_linear import _pack, logits_fn, pack_linears

_ALIGN = 4096  # each parked tensor starts on a page: oneDNN's packed weights want aligned data
_HEAD_BLOCKS = "<lm head blocks>"


def weight_tensors(model: nn.Module, compute_logits: Callable | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of `model` by name: parameters, buffers and the public tensor attributes of its
    modules (a packed linear's weight), plus the packed LM head's copy. Private attributes are
    caches rebuilt on demand (the rotary table) and are left out."""
    return {name: getattr(owner, attr) for name, (owner, attr) in weight_slots(model, compute_logits).items()}


def prepare_like_runner(model: nn.Module, device: torch.device) -> Callable:
    """Give a freshly loaded model the runner's layout (packed linears and head on the CPU, as
    ModelRunner does), so that its tensors match the served ones name for name. Returns its
    logits function."""
    compute_logits = logits_fn(model, device)
    pack_linears(model, device)
    return compute_logits


def _block_copy(name: str) -> bool:
    """Whether `name` is a linear's second copy in GGUF blocks (exec/gguf_block_linears.py), which a
    replacement from another file may lack: then it is dropped (copy_weights)."""
    return name.endswith(".blocks") or name == _HEAD_BLOCKS


def _dropped(name: str, served: torch.Tensor, new: dict[str, torch.Tensor]) -> bool:
    """Whether the served tensor `name` is a block copy the replacement has none like."""
    return _block_copy(name) and (name not in new or new[name].shape != served.shape)


def check_same_layout(served: dict[str, torch.Tensor], new: dict[str, torch.Tensor], source: str) -> None:
    """ValueError naming the first tensor whose name, shape or dtype differs (but block copies, which
    copy_weights drops where the replacement has none like them)."""
    served = {name: t for name, t in served.items() if not _dropped(name, t, new)}
    new = {name: t for name, t in new.items() if not _block_copy(name) or name in served}
    missing, extra = sorted(set(served) - set(new)), sorted(set(new) - set(served))
    if missing or extra:
        raise ValueError(f"{source}: tensors differ from the served model's (missing {missing[:3]}, "
                         f"unexpected {extra[:3]})")
    for name, t in served.items():
        n = new[name]
        if n.shape != t.shape or n.dtype != t.dtype:
            raise ValueError(f"{source}: tensor {name!r} is {n.dtype} {tuple(n.shape)}, "
                             f"the served model's is {t.dtype} {tuple(t.shape)}")


@torch.no_grad()
def copy_weights(served: dict[str, tuple[object, str]], new: dict[str, torch.Tensor]) -> int:
    """Put the new values into the served model (same names, shapes and dtypes: see
    check_same_layout): copied into plain tensors in place; oneDNN's packed ones (CPU only, where no
    graph holds their address) are handed over instead, as copying one costs ~30 ms whatever its
    size. Returns the bytes taken over."""
    done: set[int] = set()
    moved = 0
    for name, (owner, attr) in served.items():
        t = getattr(owner, attr)
        if _dropped(name, t, new):
            setattr(owner, attr, None)  # the bf16 copy alone serves: the blocks would be the old weights
            continue
        if id(t) in done:  # a tied weight appears under two names
            continue
        done.add(id(t))
        if t.is_mkldnn:
            setattr(owner, attr, new[name])
        else:
            t.copy_(new[name])
        moved += t.numel() * t.element_size()
    return moved


class ParkedWeights:
    """Weights moved out of anonymous memory by `park_weights`; `restore()` makes them usable again.

    Plain tensors stay where they are, mapped from a file: their pages come back from the page
    cache (or the disk) as the next steps read them. oneDNN's packed weights are opaque (no storage
    to map): their plain form is kept in a second mapped file and packed again on restore, which
    gives the very same packed bytes."""

    def __init__(self, nbytes: int, repack: list[tuple[object, str, torch.Tensor]]) -> None:
        self.nbytes = nbytes
        self._repack = repack

    def restore(self) -> None:
        for owner, attr, dense in self._repack:
            setattr(owner, attr, _pack(dense))
        self._repack = []  # the plain copies' file is unmapped with its last view


def weight_slots(model: nn.Module, compute_logits: Callable | None = None) -> dict[str, tuple[object, str]]:
    """Where each tensor of `weight_tensors` lives: (owner, attribute name)."""
    out: dict[str, tuple[object, str]] = {}
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        for name, t in list(module._parameters.items()) + list(module._buffers.items()):
            if t is not None:
                out[dot + name] = (module, name)
        for name, t in vars(module).items():
            if isinstance(t, torch.Tensor) and not name.startswith("_"):
                out[dot + name] = (module, name)
    if isinstance(getattr(compute_logits, "packed", None), torch.Tensor):
        out["<packed lm head>"] = (compute_logits, "packed")
    if isinstance(getattr(compute_logits, "blocks", None), torch.Tensor):
        out[_HEAD_BLOCKS] = (compute_logits, "blocks")
    return out


def park_weights(slots: dict[str, tuple[object, str]], folder: str | None = None) -> ParkedWeights:
    """Move every weight's data into a file mapped back privately (copy-on-write), so that its
    anonymous memory can be freed while its values stay as they are; the files are unlinked at once
    (the mappings keep them). CPU tensors only. See ParkedWeights."""
    plain: dict[int, torch.Tensor] = {}
    opaque: list[tuple[object, str, torch.Tensor]] = []
    seen: set[int] = set()
    for owner, attr in slots.values():
        t = getattr(owner, attr)
        if t.device.type != "cpu":
            raise ValueError(f"parking weights needs CPU tensors, not {t.device}")
        if t.is_mkldnn:
            if id(t) not in seen:
                seen.add(id(t))
                opaque.append((owner, attr, t.to_dense()))
        else:
            plain.setdefault(id(t), t)
    with torch.no_grad():
        mapped = _map_copies([t.detach().contiguous() for t in plain.values()], folder)
        for t, m in zip(plain.values(), mapped):
            t.set_(m.untyped_storage(), m.storage_offset(), t.shape, m.stride())
        dense = _map_copies([d for _, _, d in opaque], folder)
        repack = [(owner, attr, d) for (owner, attr, _), d in zip(opaque, dense)]
        for owner, attr, _ in opaque:
            setattr(owner, attr, None)  # frees the packed copy; restore() packs the mapped plain one
    nbytes = sum(t.numel() * t.element_size() for t in plain.values())
    nbytes += sum(d.numel() * d.element_size() for d in dense)
    return ParkedWeights(nbytes, repack)


def _map_copies(tensors: list[torch.Tensor], folder: str | None) -> list[torch.Tensor]:
    """Contiguous copies of `tensors`, each a view of one privately mapped, already unlinked file."""
    fd, path = tempfile.mkstemp(prefix="pagoda-parked-", suffix=".bin", dir=folder)
    offsets = []
    try:
        with os.fdopen(fd, "wb") as f:
            offset = 0
            for t in tensors:
                nbytes = t.numel() * t.element_size()
                if nbytes:
                    f.write(memoryview(t.view(torch.uint8).reshape(-1).numpy()))
                offsets.append(offset)
                offset += nbytes
                pad = -offset % _ALIGN
                f.write(b"\0" * pad)
                offset += pad
            if not offset:  # a mapping cannot be empty
                f.write(b"\0" * _ALIGN)
                offset = _ALIGN
        storage = torch.UntypedStorage.from_file(path, False, offset)  # shared=False: MAP_PRIVATE
    finally:
        os.unlink(path)
    out = []
    for t, start in zip(tensors, offsets):
        view = torch.empty(0, dtype=t.dtype)
        view.set_(storage, start // t.element_size(), t.shape, t.stride())
        out.append(view)
    return out
