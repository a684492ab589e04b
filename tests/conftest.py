"""Shared fixtures: the real SmolLM2 model (loaded once per session), tiny random models, HF references."""

from __future__ import annotations

import os

import pytest
import torch

# Tests never write the user's GGUF load cache (~/.cache/pagoda); the cache's own tests point it at a
# temporary folder. Set before any server subprocess starts, so they inherit it.
os.environ["PAGODA_CACHE_DIR"] = ""

SMOLLM2_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "import numpy as np\n\nx = np.",
    "List three fruits: apple,",
    "In 1492, Christopher Columbus",
    "The quick brown fox",
    "Photosynthesis is the process by which",
    "1, 2, 3, 4, 5,",
    "My favourite book is",
    "To be or not to be,",
    "The largest planet in the solar system is",
]
CHAT_MESSAGES = [
    [{"role": "user", "content": "What is the capital of Germany?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]


@pytest.fixture(scope="session")
def smollm2_source():
    from pagoda.model.loader import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_source):
    from pagoda.model.loader import load_tokenizer

    return load_tokenizer(smollm2_source)


@pytest.fixture(scope="session")
def smollm2_fp32():
    from pagoda.model.loader import load_model

    return load_model(None, dtype="float32")


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_source):
    from transformers import AutoModelForCausalLM

    src = smollm2_source.path
    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_prompt_ids(smollm2_tokenizer):
    """Token ids of the plain prompts followed by the chat-templated ones (16 in all)."""
    ids = [smollm2_tokenizer.encode(p) for p in SMOLLM2_PROMPTS]
    for conv in CHAT_MESSAGES:
        ids.append(list(smollm2_tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=False)))
    return ids


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation from transformers, EOS ignored (so every run does the same work)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            eos_token_id=None,  # like ignore_eos: EOS may be generated but does not stop
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


@pytest.fixture(scope="session")
def smollm2_hf_greedy32(hf_smollm2, smollm2_prompt_ids):
    return [hf_greedy(hf_smollm2, ids, 32) for ids in smollm2_prompt_ids]


@pytest.fixture(scope="session")
def tiny_llama3_fp32(tmp_path_factory):
    """A tiny random Llama-3 model (no tokenizer), loaded once in float32 for engine tests."""
    from pagoda.model.loader import load_model
    from tests.tiny_models import save_tiny_model

    folder = tmp_path_factory.mktemp("tiny_llama3")
    save_tiny_model("llama3", folder)
    return load_model(str(folder), dtype="float32")


def make_engine(loaded, tokenizer=None, **kwargs):
    from pagoda.config import EngineArgs
    from pagoda.engine.llm import LLM
    from pagoda.engine.llm_engine import LLMEngine

    args = EngineArgs.from_kwargs(device="cpu", **kwargs)
    return LLM.from_engine(LLMEngine(args, loaded=loaded, tokenizer=tokenizer))


def proc_status_kib(field: str) -> int:
    """A kB field of /proc/self/status (RssAnon, RssFile, VmHWM, ...) of this process (Linux)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(f"{field}:"))
