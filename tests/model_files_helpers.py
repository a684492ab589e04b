"""Model folders as users have them: a fake local Hugging Face hub cache (laid out as huggingface_hub
writes one: blobs named by their hash, snapshots of symlinks to them, refs naming each branch's
commit), and a tiny model whose generation_config.json sets sampling defaults and an extra EOS id."""

from __future__ import annotations

import hashlib
import os
import shutil
import json
from dataclasses import dataclass
from pathlib import Path

import torch


def add_to_hub_cache(cache: Path, repo_id: str, files_from: Path, commit: str | None = None,
                     branch: str = "main") -> Path:
    """Copy the files of `files_from` into `cache` as `repo_id` at `commit` (on `branch`); returns the snapshot."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = commit or hashlib.sha1(f"{repo_id}@{branch}".encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in sorted(files_from.iterdir()):
        if not f.is_file():
            continue
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        if not blob.exists():
            shutil.copyfile(f, blob)
        link = snapshot / f.name
        if link.is_symlink() or link.exists():
            link.unlink()
        os.symlink(os.path.relpath(blob, snapshot), link)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / branch).write_text(commit)
    return snapshot


PROMPT_IDS = [5, 9, 13, 7, 21]
MAX_TOKENS = 12
REPETITION_PENALTY = 1.3


@dataclass
class GenConfigModel:
    folder: Path
    extra_eos: int  # the generation config's second EOS id, met at `stop_at` in the penalised greedy run
    stop_at: int
    penalised: list[int]  # transformers' greedy tokens with the repetition penalty, no extra EOS, 12 tokens
    plain: list[int]  # transformers' greedy tokens without any penalty, 12 tokens
    hf_reference: list[int]  # transformers' generate() under the folder's GenerationConfig


def save_model_with_generation_config(folder: Path) -> GenConfigModel:
    """A tiny Llama with a tokenizer, and a generation_config.json of {top_k 1 (greedy), repetition
    penalty 1.3, temperature 0.7, top_p 0.9, EOS ids [2, X]}, X a token the penalised greedy run meets
    first at position >= 3 and that the plain greedy run does not have in its first 12 tokens."""
    from transformers import GenerationConfig

    from tests.tiny_models import save_tiny_model, save_tiny_tokenizer

    model = save_tiny_model("llama3", folder)
    save_tiny_tokenizer(folder)
    ids = torch.tensor([PROMPT_IDS])

    def greedy(**kw) -> list[int]:
        cfg = GenerationConfig(do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=None, pad_token_id=0, **kw)
        with torch.no_grad():
            return model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)[0, ids.shape[1]:].tolist()

    penalised, plain = greedy(repetition_penalty=REPETITION_PENALTY), greedy()
    assert penalised != plain, "the penalty must change this model's greedy output"
    assert 2 not in penalised + plain, "the tokenizer's EOS (2) would end the runs early: pick another prompt"
    stop_at = next(i for i in range(3, MAX_TOKENS) if penalised[i] not in penalised[:i] + plain + [2])
    extra = penalised[stop_at]
    (folder / "generation_config.json").write_text(json.dumps({
        "do_sample": True, "top_k": 1, "temperature": 0.7, "top_p": 0.9, "repetition_penalty": REPETITION_PENALTY,
        "bos_token_id": 1, "eos_token_id": [2, extra], "pad_token_id": 0,
    }))
    gen = GenerationConfig.from_pretrained(folder)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen,
                             max_new_tokens=MAX_TOKENS)[0, ids.shape[1]:].tolist()
    return GenConfigModel(folder, extra, stop_at, penalised, plain, ref)
