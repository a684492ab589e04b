"""The request sets every benchmark draws from: random prompts, a shared prefix, or a JSONL file.

All of them are plain token ids with a fixed output length per request, built before any engine
runs, so Pagoda and the transformers reference (or a remote server) see exactly the same work.
Random token ids are drawn uniformly from the vocabulary minus special tokens: a special token in
the middle of a prompt (BOS, EOS, chat markers) is both unrealistic and may change the work done.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class BenchRequest:
    prompt_ids: list[int]
    output_len: int


@dataclass
class Workload:
    name: str
    requests: list[BenchRequest]
    params: dict[str, Any] = field(default_factory=dict)  # how it was built, for the report

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_ids) for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    def describe(self) -> dict[str, Any]:
        lens = [len(r.prompt_ids) for r in self.requests]
        return {
            "name": self.name,
            **self.params,
            "num_requests": self.num_requests,
            "prompt_tokens": self.num_prompt_tokens,
            "output_tokens": self.num_output_tokens,
            "total_tokens": self.num_prompt_tokens + self.num_output_tokens,
            "prompt_len_min": min(lens) if lens else 0,
            "prompt_len_max": max(lens) if lens else 0,
        }


def special_token_ids(tokenizer: Any = None, config: Any = None) -> set[int]:
    """Ids a random prompt must not contain: the tokenizer's special and added tokens (chat
    markers are added tokens) and the config's bos/eos/pad ids (models without a tokenizer)."""
    ids: set[int] = set()
    if tokenizer is not None:
        ids.update(int(i) for i in getattr(tokenizer, "all_special_ids", []) or [])
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        ids.update(int(i) for i in added)
    if config is not None:
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(config, name, None)
            if isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
            elif value is not None:
                ids.add(int(value))
    return ids


def allowed_token_ids(vocab_size: int, excluded: set[int]) -> np.ndarray:
    allowed = np.setdiff1d(np.arange(vocab_size, dtype=np.int64), np.fromiter(excluded, dtype=np.int64))
    if allowed.size == 0:
        raise ValueError("no token ids left to draw prompts from")
    return allowed


def vocab_for(tokenizer: Any = None, config: Any = None) -> int:
    """The ids a prompt may use: the model's embedding rows, but not past the tokenizer's own
    vocabulary (embeddings are often padded, e.g. Qwen's 151,936 rows for ~151,669 tokens)."""
    sizes = []
    if config is not None and getattr(config, "vocab_size", None):
        sizes.append(int(config.vocab_size))
    if tokenizer is not None:
        sizes.append(len(tokenizer))
    if not sizes:
        raise ValueError("need a tokenizer or a model config to know the vocabulary")
    return min(sizes)


def _draw(rng: np.random.Generator, allowed: np.ndarray, n: int) -> list[int]:
    return allowed[rng.integers(0, allowed.size, size=n)].tolist()


def random_workload(
    num_prompts: int, input_len_min: int, input_len_max: int, output_len: int, allowed: np.ndarray, seed: int
) -> Workload:
    """N prompts of random ids, lengths uniform in [min, max] (inclusive), a fixed output length."""
    if not 1 <= input_len_min <= input_len_max:
        raise ValueError(f"need 1 <= input_len_min <= input_len_max, got {input_len_min}, {input_len_max}")
    _check_counts(num_prompts, output_len)
    rng = np.random.default_rng(seed)
    lens = rng.integers(input_len_min, input_len_max + 1, size=num_prompts)
    requests = [BenchRequest(_draw(rng, allowed, int(n)), output_len) for n in lens]
    params = {"input_len_min": input_len_min, "input_len_max": input_len_max, "output_len": output_len, "seed": seed}
    return Workload("random", requests, params)


def prefix_workload(
    num_prompts: int, prefix_len: int, suffix_len: int, output_len: int, allowed: np.ndarray, seed: int
) -> Workload:
    """A shared prefix of P tokens (a system prompt) plus a unique S-token suffix per request."""
    if prefix_len < 0 or suffix_len < 1:
        raise ValueError(f"need prefix_len >= 0 and suffix_len >= 1, got {prefix_len}, {suffix_len}")
    _check_counts(num_prompts, output_len)
    rng = np.random.default_rng(seed)
    prefix = _draw(rng, allowed, prefix_len)
    requests = [BenchRequest(prefix + _draw(rng, allowed, suffix_len), output_len) for _ in range(num_prompts)]
    params = {"prefix_len": prefix_len, "suffix_len": suffix_len, "output_len": output_len, "seed": seed}
    return Workload("prefix", requests, params)


def jsonl_workload(
    path: str | Path, tokenizer: Any = None, default_output_len: int = 128, num_prompts: int | None = None
) -> Workload:
    """One request per line: {"prompt": "text" | [ids...], "max_tokens": N}. Text is tokenized once
    here (with the tokenizer's defaults, e.g. a BOS) so every engine gets the same ids."""
    requests: list[BenchRequest] = []
    p = Path(path)
    if num_prompts is not None and num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if p.suffix != ".jsonl" and not p.is_file():
        raise ValueError(f"workload must be 'random', 'prefix' or a .jsonl file, got {str(path)!r}")
    try:
        f = p.open()
    except OSError as exc:
        raise ValueError(f"cannot read the workload file {p}: {exc.strerror or exc}") from None
    with f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                prompt = item["prompt"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{p}:{lineno}: expected a JSON object with a 'prompt'") from None
            if isinstance(prompt, str):
                if tokenizer is None:
                    raise ValueError(f"{p}:{lineno}: a text prompt needs a model with a tokenizer")
                ids = list(tokenizer.encode(prompt))
            elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                ids = list(prompt)
            else:
                raise ValueError(f"{p}:{lineno}: 'prompt' must be a string or a list of token ids")
            out = item.get("max_tokens", default_output_len)
            if not isinstance(out, int) or out < 1:
                raise ValueError(f"{p}:{lineno}: 'max_tokens' must be a positive integer")
            if not ids:
                raise ValueError(f"{p}:{lineno}: empty prompt")
            requests.append(BenchRequest(ids, out))
            if num_prompts is not None and len(requests) >= num_prompts:
                break
    if not requests:
        raise ValueError(f"{p}: no requests")
    return Workload("jsonl", requests, {"file": str(p)})


def _check_counts(num_prompts: int, output_len: int) -> None:
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if output_len < 1:
        raise ValueError(f"output_len must be >= 1, got {output_len}")
