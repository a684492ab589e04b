"""What a front door reads from the model's files before the engine runs: the model's place (a
Hugging Face id pinned to its snapshot folder in the local cache, so that every process of the
engine loads the same files without a revision to carry), the tokenizer (`--tokenizer`), and the
generation defaults (`--generation-config`)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from pagoda.config import EngineArgs
from pagoda.model.generation_config import GenerationDefaults, load_generation_defaults
from pagoda.model.loader import load_tokenizer
from pagoda.model.model_source import DEFAULT_MODEL, ModelSource, resolve_model, tokenizer_source

logger = logging.getLogger(__name__)


def pin_model(args: EngineArgs) -> tuple[EngineArgs, ModelSource]:
    """`args` with a Hugging Face id (and revision) replaced by its snapshot folder, and the model's source."""
    source = resolve_model(args.model, args.revision)
    if args.model is not None and source.name != DEFAULT_MODEL and not Path(args.model).expanduser().exists():
        args = dataclasses.replace(args, model=str(source.path))
    return args, source


def load_front_tokenizer(args: EngineArgs, source: ModelSource) -> Any:
    return load_tokenizer(tokenizer_source(source, args.tokenizer))


def generation_defaults(args: EngineArgs, source: ModelSource) -> GenerationDefaults:
    defaults = load_generation_defaults(source, args.generation_config)
    # Said once at start (as vLLM does): a request's sampling then differs from SamplingParams' defaults.
    if defaults.sampling:
        logger.info("sampling defaults from %s (--generation-config vllm: none): %s%s", defaults.where,
                    ", ".join(f"{k}={v}" for k, v in defaults.sampling.items()),
                    f"; EOS ids {list(defaults.eos_token_ids)}" if defaults.eos_token_ids else "")
    return defaults
