"""A stand-in for msgspec on the GPU machine, which lacks it (and cannot install it): only the offline
path is run there, where `pagoda.contracts.messages` declares its structs but never encodes one.

`Struct` subclasses become dataclasses (keyword options such as array_like are accepted and ignored);
encoders and decoders exist but refuse to work, so a path that really needs msgspec fails loudly.
benchmarks/gpu_check.sh puts this folder on PYTHONPATH only when `import msgspec` fails.
"""

from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace


class Struct:
    def __init_subclass__(cls, **_options) -> None:
        super().__init_subclass__()
        # msgspec copies mutable defaults per instance; dataclasses need a factory for that.
        for name in cls.__dict__.get("__annotations__", {}):
            value = cls.__dict__.get(name)
            if isinstance(value, (list, dict, set)):
                setattr(cls, name, dataclasses.field(default_factory=lambda v=value: copy.copy(v)))
        dataclasses.dataclass(cls)


def field(*, default=dataclasses.MISSING, default_factory=dataclasses.MISSING, name: str | None = None):
    """msgspec.field: a default or a default factory (the encoded name is ignored)."""
    return dataclasses.field(default=default, default_factory=default_factory)


def _unavailable(*_args, **_kwargs):
    raise RuntimeError("msgspec is not installed (benchmarks/gpu_shims stand-in): offline use only")


class _Coder:
    def __init__(self, *_args, **_kwargs) -> None:
        pass

    encode = decode = _unavailable


msgpack = SimpleNamespace(Encoder=_Coder, Decoder=_Coder)
structs = SimpleNamespace(asdict=dataclasses.asdict, replace=dataclasses.replace)
