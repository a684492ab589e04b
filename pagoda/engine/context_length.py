"""The engine's max_model_len: the model's context length by default, and a user's value checked against it.

As in vLLM, asking for more than the model's context is an error unless an environment variable
(here PAGODA_ALLOW_LONG_MAX_MODEL_LEN=1, vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN) says the user knows
better; then it is only a warning.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

ALLOW_LONG_MAX_MODEL_LEN_ENV = "PAGODA_ALLOW_LONG_MAX_MODEL_LEN"
# The default is capped so that an unset max_model_len does not size buffers and the KV budget for a
# 128k-token context that few deployments want.
MAX_DEFAULT_MODEL_LEN = 8192
# For a config that names no context length (vLLM's fallback too).
FALLBACK_MODEL_LEN = 2048


def model_context_length(config: Any) -> int | None:
    """The model's context length: max_position_embeddings, which the loader has already capped at a
    sliding window (Pagoda's attention is full attention). None when the config does not say."""
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if value else None


def allow_long_max_model_len() -> bool:
    # vLLM's parsing of its variable: "1" or "true", any case.
    return os.environ.get(ALLOW_LONG_MAX_MODEL_LEN_ENV, "0").strip().lower() in ("1", "true")


def resolve_max_model_len(requested: int | None, config: Any) -> int:
    """`requested` (EngineArgs.max_model_len) if it fits the model's context, else a ValueError with one
    line the CLI and server can show as is; None: the model's context capped at MAX_DEFAULT_MODEL_LEN."""
    derived = model_context_length(config)
    if requested is None:
        return min(derived or FALLBACK_MODEL_LEN, MAX_DEFAULT_MODEL_LEN)
    if derived is None or requested <= derived:  # an unknown context cannot refuse anything
        return requested
    source = f"max_position_embeddings={derived} in the model's config"
    if _capped_by_sliding_window(config, derived):
        source += ", capped at its sliding window since Pagoda runs full attention"
    if allow_long_max_model_len():
        logger.warning(
            "User-specified max_model_len (%d) is greater than the derived max_model_len (%s); allowed by %s=1. "
            "Make sure the value is correct and within the model's context size.",
            requested, source, ALLOW_LONG_MAX_MODEL_LEN_ENV,
        )
        return requested
    raise ValueError(
        f"User-specified max_model_len ({requested}) is greater than the derived max_model_len ({source}). "
        f"To allow it anyway, set the environment variable {ALLOW_LONG_MAX_MODEL_LEN_ENV}=1 "
        "(with care: positions past the model's context may give wrong outputs)."
    )


def _capped_by_sliding_window(config: Any, derived: int) -> bool:
    # The loader's condition (model/loader.py, _limit_to_sliding_window): the message then names the
    # window, which is not the max_position_embeddings the user sees in config.json.
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    return bool(window) and window == derived and (layer_types is None or "sliding_attention" in layer_types)
