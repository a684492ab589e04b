"""Models by Hugging Face id from the local hub cache: found at a revision without any download,
named by their id, and a missing one refused in one line naming the folders searched."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagoda.model.errors import ModelLoadError
from pagoda.model.loader import load_config, load_tokenizer
from pagoda.model.model_source import resolve_model, resolve_tokenizer
from tests.model_files_helpers import add_to_hub_cache
from tests.tiny_models import save_tiny_model, save_tiny_tokenizer


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_hf_files")
    save_tiny_model("llama3", folder)
    save_tiny_tokenizer(folder)
    return folder


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HOME", raising=False)
    return cache


def test_an_id_in_the_cache_resolves_to_its_snapshot_by_revision(hub, tiny_files):
    main = add_to_hub_cache(hub, "acme/tiny-llama", tiny_files)
    other = add_to_hub_cache(hub, "acme/tiny-llama", tiny_files, commit="b" * 40, branch="v2")
    src = resolve_model("acme/tiny-llama")
    assert (src.path, src.is_gguf, src.name) == (main, False, "acme/tiny-llama")
    assert resolve_model("acme/tiny-llama", "v2").path == other
    assert resolve_model("acme/tiny-llama", "b" * 40).path == other
    # The snapshot path itself (what the engine's other processes receive) is named by the id too.
    assert resolve_model(str(main)).name == "acme/tiny-llama"
    assert load_config(src).model_type == "llama"
    assert load_tokenizer(src).encode("w5 w6", add_special_tokens=False) == [5, 6]


def test_hf_home_is_searched_when_hf_hub_cache_is_unset(tmp_path, monkeypatch, tiny_files):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    snap = add_to_hub_cache(tmp_path / "hf" / "hub", "acme/tiny-llama", tiny_files)
    assert resolve_model("acme/tiny-llama").path == snap


def test_a_missing_id_names_the_folders_searched(hub):
    hub.mkdir()
    with pytest.raises(ModelLoadError) as err:
        resolve_model("acme/absent")
    msg = str(err.value)
    assert "\n" not in msg
    assert str(hub / "models--acme--absent") in msg and "HF_HUB_CACHE" in msg and "huggingface-cli download" in msg


def test_a_missing_revision_is_named(hub, tiny_files):
    add_to_hub_cache(hub, "acme/tiny-llama", tiny_files)
    with pytest.raises(ModelLoadError, match="no revision 'nope'"):
        resolve_model("acme/tiny-llama", "nope")


def test_a_missing_plain_name_is_still_a_missing_path(hub):
    with pytest.raises(ModelLoadError, match="no such file or folder"):
        resolve_model("no-such-model-folder")


def test_a_gguf_repository_resolves_to_its_file(hub, tmp_path, smollm2_source):
    files = tmp_path / "gguf_repo"
    files.mkdir()
    (files / "model.gguf").symlink_to(smollm2_source.path)
    add_to_hub_cache(hub, "acme/smol-gguf", files)
    src = resolve_model("acme/smol-gguf")
    assert src.is_gguf and src.path.suffix == ".gguf" and src.name == "acme/smol-gguf"


def test_tokenizer_by_id_needs_no_config(hub, tmp_path):
    tok_files = tmp_path / "tok"
    tok_files.mkdir()
    save_tiny_tokenizer(tok_files, vocab_size=64)
    add_to_hub_cache(hub, "acme/tok", tok_files)
    src = resolve_tokenizer("acme/tok")
    assert not (src.path / "config.json").exists()
    assert load_tokenizer(src).encode("w63", add_special_tokens=False) == [63]
