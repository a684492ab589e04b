"""The GGUF load cache's tokenizer: built without AutoTokenizer, it must be the very same tokenizer."""

from __future__ import annotations

import pytest

from tests.conftest import CHAT_MESSAGES, SMOLLM2_PROMPTS

TEXTS = [
    *SMOLLM2_PROMPTS,
    "",
    "  leading and trailing spaces  ",
    "Ünïcödé — emoji 🙂 and 中文 and tabs\tand\nnewlines\r\n",
    "<|im_start|>user\nspecial tokens inline<|im_end|><|endoftext|>",
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory, smollm2_source):
    """(converted from the GGUF by AutoTokenizer, loaded back from the cache)."""
    from pagoda.model import gguf_cache
    from pagoda.model.loader import load_tokenizer

    mp = pytest.MonkeyPatch()
    mp.setenv("PAGODA_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    try:
        original = load_tokenizer(smollm2_source)
        assert gguf_cache.lookup(smollm2_source.path, "tokenizer") is not None
        cached = load_tokenizer(smollm2_source)
    finally:
        mp.undo()
    return original, cached


def test_cached_tokenizer_tokenizes_identically(tokenizers):
    original, cached = tokenizers
    assert type(cached) is type(original)
    for text in TEXTS:
        for special in (True, False):
            ids = original.encode(text, add_special_tokens=special)
            assert cached.encode(text, add_special_tokens=special) == ids, text
            assert cached.convert_ids_to_tokens(ids) == original.convert_ids_to_tokens(ids)
            for skip in (True, False):
                assert cached.decode(ids, skip_special_tokens=skip) == original.decode(ids, skip_special_tokens=skip)
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id", "all_special_ids",
                 "all_special_tokens"):
        assert getattr(cached, attr) == getattr(original, attr), attr
    assert len(cached) == len(original)
    assert cached.get_vocab() == original.get_vocab()


def test_cached_tokenizer_applies_the_same_chat_template(tokenizers):
    original, cached = tokenizers
    assert cached.chat_template == original.chat_template
    conversations = [*CHAT_MESSAGES, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                      {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]]
    for conv in conversations:
        for gen in (True, False):
            kw = dict(add_generation_prompt=gen)
            text = original.apply_chat_template(conv, tokenize=False, **kw)
            assert cached.apply_chat_template(conv, tokenize=False, **kw) == text
            assert list(cached.apply_chat_template(conv, tokenize=True, return_dict=False, **kw)) == list(
                original.apply_chat_template(conv, tokenize=True, return_dict=False, **kw)
            )


def test_cached_tokenizer_loads_without_torch(smollm2_source, tmp_path):
    """The API server process loads it: no torch, no AutoTokenizer registry (seconds of imports)."""
    import os
    import shutil
    import subprocess
    import sys

    from pagoda.model import gguf_cache

    cache = tmp_path / "cache"
    mp = pytest.MonkeyPatch()
    mp.setenv("PAGODA_CACHE_DIR", str(cache))
    try:
        entry = gguf_cache.entry_dir(smollm2_source.path, "tokenizer")
    finally:
        mp.undo()
    env = dict(os.environ, PAGODA_CACHE_DIR=str(cache))
    # Fill the cache in one child, then load from it in another.
    fill = "from pagoda.model.loader import load_tokenizer, resolve_model; load_tokenizer(resolve_model(None))"
    subprocess.run([sys.executable, "-c", fill], env=env, check=True, capture_output=True)
    assert entry is not None and (entry / "complete").exists()
    code = (
        "import sys; from pagoda.model.loader import load_tokenizer, resolve_model; "
        "t = load_tokenizer(resolve_model(None)); assert t.encode('hi'); "
        "print('torch' in sys.modules, 'transformers.models.auto' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]
    shutil.rmtree(cache, ignore_errors=True)
