"""A model's sampling defaults from its `generation_config.json`, with vLLM's `--generation-config`.

`auto` (the default): the model folder's file, when it has one; `vllm`: none (every request samples
with SamplingParams' own defaults); any other value: a folder holding a generation_config.json.
As vLLM, the file is read by transformers' `GenerationConfig` and only the values it sets away
from transformers' defaults count (`to_diff_dict`): temperature, top_p, top_k, min_p,
repetition_penalty, which a request's own values override, and eos_token_id, whose ids all end
generation (beside the tokenizer's EOS) unless the request sets ignore_eos. (vLLM also takes
max_new_tokens as a default max_tokens; Pagoda does not: a request's length stays its own.)
Plain data: the front ends apply it (pagoda/engine/generation_defaults.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pagoda.model.errors import ModelLoadError
from pagoda.model.model_source import ModelSource

FILE = "generation_config.json"
# generation_config's name -> SamplingParams'
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty"}


@dataclass(frozen=True)
class GenerationDefaults:
    """SamplingParams field -> the model's default, and the extra ids that end generation."""

    sampling: dict[str, float | int] = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()
    where: str | None = None  # the file they came from, for logs


def _folder_for(source: ModelSource, setting: str) -> Path | None:
    if setting == "vllm":
        return None
    if setting == "auto":
        return None if source.is_gguf else source.path
    folder = Path(setting).expanduser()
    if not (folder / FILE).is_file():
        raise ModelLoadError(f"--generation-config {setting}: no {FILE} in that folder (or give auto or vllm)")
    return folder


def load_generation_defaults(source: ModelSource, setting: str = "auto") -> GenerationDefaults:
    """The defaults `setting` names for the model at `source`; ModelLoadError for a file that does not read."""
    folder = _folder_for(source, setting)
    if folder is None or not (folder / FILE).is_file():
        return GenerationDefaults()
    from transformers import GenerationConfig

    try:
        diff = GenerationConfig.from_pretrained(str(folder)).to_diff_dict()
    except Exception as exc:  # JSON or a value GenerationConfig refuses
        raise ModelLoadError(f"{folder / FILE}: cannot read it ({exc})") from None
    sampling = {ours: diff[theirs] for theirs, ours in SAMPLING_KEYS.items() if diff.get(theirs) is not None}
    eos = diff.get("eos_token_id")
    eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(int(t) for t in eos)
    return GenerationDefaults(sampling, eos_ids, str(folder / FILE))
