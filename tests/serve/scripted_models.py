"""A tiny model whose greedy next token is scripted, for tests of tool-call and reasoning parsers.

The tokenizer is byte-level (one token per byte, so any text, JSON included, can be spelled) plus
added tokens for the markers. The model is a tiny Llama whose layers add nothing (their output
projections are zero), so the last hidden state is the current token's embedding: the designated
tokens get orthogonal embeddings and `lm_head` maps each one to its scripted successor with a large
logit. Where the script says nothing (inside a grammar-held call), the grammar's mask decides among
the allowed tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.tiny_models import save_tiny_model

EOS = "<|end|>"
ASSISTANT = "<|assistant|>"
SPECIAL = [EOS, "[TOOL_CALLS]", "<|python_tag|>"]  # dropped by the detokenizer unless asked
ADDED = ["<tool_call>", "</tool_call>", "<think>", "</think>", ASSISTANT]
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}")


def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"eos_token": EOS, "additional_special_tokens": SPECIAL[1:]})
    fast.add_tokens(ADDED)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_scripted_model(folder: Path, successors: dict[str, str]) -> None:
    """A model and tokenizer in `folder` whose greedy next token after each key of `successors` (a
    marker, or one character) is its value; the chat prompt ends with ASSISTANT."""
    tokenizer = byte_tokenizer()
    tokenizer.save_pretrained(folder)

    def tid(token: str) -> int:
        ids = tokenizer.encode(token, add_special_tokens=False)
        assert len(ids) == 1, f"{token!r} is not one token"
        return ids[0]

    successor = {tid(a): tid(b) for a, b in successors.items()}
    save_tiny_model("llama3", folder)
    model_file = folder / "model.safetensors"
    from safetensors.torch import load_file, save_file

    weights = load_file(model_file)
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name].zero_()  # the layers add nothing: the hidden state is the embedding
    emb, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    hidden = emb.shape[1]
    assert len(successor) <= hidden
    head.mul_(0.05)
    for k, (a, b) in enumerate(sorted(successor.items())):
        emb[a] = torch.zeros(hidden)
        emb[a, k] = 1.0
        head[b, k] = 50.0
    save_file(weights, model_file, metadata={"format": "pt"})
    for name in ("config.json", "generation_config.json"):  # EOS is the tokenizer's, nothing else
        path = folder / name
        if path.exists():
            config = json.loads(path.read_text())
            config.update(eos_token_id=tid(EOS), bos_token_id=None)
            path.write_text(json.dumps(config))
