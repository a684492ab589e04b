"""A model config read straight from a config.json, without importing transformers.

Used for the GGUF load cache's folders, whose config.json pagoda itself wrote from a complete
transformers config (`to_dict()`, every default filled in), so nothing needs transformers'
defaulting or legacy-key handling any more. Importing transformers' config classes costs over a
second (they pull in torch.distributed), which is most of what a cache hit would otherwise spend.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any


class PlainConfig(SimpleNamespace):
    """Attribute access to a config.json's keys; a missing key raises AttributeError (so
    `getattr(config, key, default)` works as it does on a transformers config)."""

    @classmethod
    def from_json_file(cls, path: str | Path) -> "PlainConfig":
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, dict):
            raise ValueError(f"{path}: not a JSON object")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))
