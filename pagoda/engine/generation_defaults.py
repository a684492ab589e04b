"""The model's generation defaults (`--generation-config`, pagoda/model/generation_config.py) applied
to requests, with vLLM's rules, by both front doors:

- a request's own value always wins; the model's default fills only what the request left unset
  (offline: `sampling_params=None`; over HTTP: a field absent or null);
- the model's extra EOS ids end every request (as stop token ids) unless it sets ignore_eos.
"""

from __future__ import annotations

from typing import Iterable

from pagoda.model.generation_config import GenerationDefaults
from pagoda.sampling_params import SamplingParams

__all__ = ["GenerationDefaults", "default_sampling_params", "fill_unset", "stop_ids_with_model_eos"]


def default_sampling_params(defaults: GenerationDefaults) -> SamplingParams:
    """SamplingParams() with the model's defaults (vLLM's `LLM.get_default_sampling_params`)."""
    return SamplingParams(**defaults.sampling)


def fill_unset(params: SamplingParams, defaults: GenerationDefaults, unset: Iterable[str]) -> SamplingParams:
    """`params` with the model's default for each field in `unset` that the model has one for."""
    changes = {name: defaults.sampling[name] for name in unset if name in defaults.sampling}
    return params.clone(**changes) if changes else params


def stop_ids_with_model_eos(params: SamplingParams, defaults: GenerationDefaults,
                            eos_token_id: int | None) -> list[int]:
    """The stop token ids a request runs with: its own, plus the model's extra EOS ids."""
    if params.ignore_eos:
        return params.stop_token_ids
    extra = [t for t in defaults.eos_token_ids if t != eos_token_id and t not in params.stop_token_ids]
    return params.stop_token_ids + extra if extra else params.stop_token_ids
