"""Damaged, inconsistent or unsupported model files: a ModelLoadError naming the file, never a raw
exception from deep inside a library, never a silently wrong model; the GGUF load cache never serves a
damaged or stale entry."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch

from pagoda.model import gguf_cache
from pagoda.model.errors import ModelLoadError
from pagoda.model.loader import load_config, load_model, load_tokenizer, resolve_dtype, resolve_model
from tests.model.test_gguf_and_errors import _logits, write_tiny_gguf
from tests.tiny_models import save_tiny_model

IDS = torch.tensor([list(range(40, 110))])  # 70 positions: past the llama3 model's original 64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{arch: (folder, transformers model)} for a tied Llama (linear rope) and an untied one (llama3)."""
    out = {}
    for arch in ("llama_linear", "llama3"):
        folder = tmp_path_factory.mktemp(arch)
        out[arch] = folder, save_tiny_model(arch, folder)
    return out


def _copy(src, dst, edit_tensors=None, edit_config=None):
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    if edit_config:
        edit_config(config)
    (dst / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(src / "model.safetensors"))
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def _hf_logits(hf, ids=IDS):
    with torch.no_grad():
        return hf(ids).logits[0]


# --- Hugging Face folders -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b[:-1000],  # truncated
        lambda b: b[:4],
        lambda b: b"",
        lambda b: b"this is not a safetensors file " * 20,
    ],
    ids=["truncated", "4-bytes", "empty", "text"],
)
def test_damaged_safetensors_is_a_model_load_error(tmp_path, tiny, damage):
    folder, _ = tiny["llama_linear"]
    _copy(folder, tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(damage(weights.read_bytes()))
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: not a readable safetensors file"):
        load_model(str(tmp_path), dtype="float32")


@pytest.mark.parametrize("index", ["{not json", json.dumps({"metadata": {}}), json.dumps({"weight_map": [1, 2]})])
def test_bad_index_is_a_model_load_error(tmp_path, tiny, index):
    folder, _ = tiny["llama_linear"]
    _copy(folder, tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors\.index\.json: not a valid safetensors index"):
        load_model(str(tmp_path), dtype="float32")


def test_integer_tensor_is_refused(tmp_path, tiny):
    folder, _ = tiny["llama_linear"]

    def edit(t):
        t["model.norm.weight"] = torch.ones(64, dtype=torch.int8)

    _copy(folder, tmp_path, edit)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: tensor 'model\.norm\.weight' is torch\.int8"):
        load_model(str(tmp_path), dtype="float32")


def test_tensor_in_two_shards_is_refused(tmp_path, tiny):
    """Each shard listed by the index is read whole: a tensor twice would let the later copy win."""
    from safetensors.torch import save_file

    folder, _ = tiny["llama_linear"]
    _copy(folder, tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "model-00001-of-00002.safetensors")
    save_file({"model.norm.weight": torch.zeros(64)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                  "model.norm.weight": "model-00002-of-00002.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelLoadError, match=r"'model\.norm\.weight' appears more than once"):
        load_model(str(tmp_path), dtype="float32")


def test_other_safetensors_beside_model_safetensors_are_not_read(tmp_path, tiny):
    """Without an index, model.safetensors is the model (as for transformers), whatever lies beside it."""
    from safetensors.torch import save_file

    folder, hf = tiny["llama_linear"]
    _copy(folder, tmp_path)
    save_file({"model.norm.weight": torch.zeros(64)}, str(tmp_path / "z_adapter.safetensors"))
    net = load_model(str(tmp_path), dtype="float32").model
    assert (_logits(net, IDS) - _hf_logits(hf)).abs().max().item() < 1e-4


def test_missing_merged_tensor_is_named_as_in_the_checkpoint(tmp_path, tiny):
    folder, _ = tiny["llama_linear"]
    _copy(folder, tmp_path, lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"missing tensor\(s\) model\.layers\.0\.self_attn\.k_proj\.weight$"):
        load_model(str(tmp_path), dtype="float32")


def test_tied_config_with_a_different_lm_head_uses_it_as_transformers_does(tmp_path, tiny):
    from transformers import AutoModelForCausalLM

    folder, _ = tiny["llama3"]  # untied weights, config edited to say tied
    _copy(folder, tmp_path, edit_config=lambda c: c.update(tie_word_embeddings=True))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    net = load_model(str(tmp_path), dtype="float32").model
    assert (_logits(net, IDS) - _hf_logits(hf)).abs().max().item() < 1e-4


def test_tied_config_with_an_equal_lm_head_stays_tied(tmp_path, tiny):
    folder, hf = tiny["llama_linear"]
    _copy(folder, tmp_path, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    net = load_model(str(tmp_path), dtype="float32").model
    assert net.lm_head is None
    assert (_logits(net, IDS) - _hf_logits(hf)).abs().max().item() < 1e-4


@pytest.mark.parametrize(
    "edit,message",
    [
        ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0}},
         r"unsupported rope scaling type 'yarn'"),
        ({"num_key_value_heads": 3}, r"not a multiple of num_key_value_heads"),
        ({"hidden_size": -64}, r"hidden_size must be a positive integer"),
        ({"quantization_config": {"quant_method": "awq", "bits": 4}}, r"quantized checkpoints \(awq\)"),
    ],
    ids=["gelu", "yarn", "kv-heads", "negative", "quantized"],
)
def test_config_pagoda_cannot_follow_is_a_model_load_error(tmp_path, tiny, edit, message):
    folder, _ = tiny["llama_linear"]
    _copy(folder, tmp_path, edit_config=lambda c: c.update(edit))
    with pytest.raises(ModelLoadError, match=r"config\.json: .*" + message):
        load_model(str(tmp_path), dtype="float32")


def test_sliding_window_limits_the_context(tmp_path, tiny):
    """Attention here is full attention: a Mistral sliding window caps the context instead."""
    folder, _ = tiny["llama3"]
    _copy(folder, tmp_path, edit_config=lambda c: c.update(
        architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=32, rope_parameters=None))
    assert load_model(str(tmp_path), dtype="float32").config.max_position_embeddings == 32


def test_broken_tokenizer_in_a_folder_is_a_model_load_error(tmp_path, tiny):
    from tests.tiny_models import save_tiny_tokenizer

    folder, _ = tiny["llama_linear"]
    _copy(folder, tmp_path)
    save_tiny_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(ModelLoadError, match="cannot load the tokenizer"):
        load_tokenizer(resolve_model(str(tmp_path)))


def test_torch_dtype_that_is_not_a_float_is_refused():
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype(torch.int8, torch.device("cpu"))


# --- GGUF files -----------------------------------------------------------------------------------


def _gguf(tiny, arch, path, extra=None, qtype="F32"):
    _, hf = tiny[arch]
    write_tiny_gguf(hf, path, qtype, extra)
    return path


@pytest.mark.parametrize(
    "drop,message",
    [("llama.attention.head_count", "lacks 'llama.attention.head_count'"), ("llama.block_count", "lacks 'llama.block_count'")],
)
def test_gguf_without_required_metadata(tmp_path, tiny, drop, message):
    import gguf

    src = _gguf(tiny, "llama_linear", tmp_path / "src.gguf")
    reader = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), arch="llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", drop):
            continue
        w.add_key_value(key, field.contents(), field.types[0])
    for t in reader.tensors:
        w.add_tensor(t.name, np.asarray(t.data).reshape([int(d) for d in reversed(t.shape)]))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ModelLoadError, match=r"bad\.gguf: GGUF metadata " + message):
        load_model(str(tmp_path / "bad.gguf"), dtype="float32")


def test_gguf_unknown_tensor_is_refused(tmp_path, tiny):
    path = _gguf(tiny, "llama_linear", tmp_path / "m.gguf",
                 lambda w: w.add_tensor("blk.0.ffn_gate_inp.weight", np.zeros((4, 64), np.float32)))
    with pytest.raises(ModelLoadError, match=r"m\.gguf: unexpected tensor 'blk\.0\.ffn_gate_inp\.weight'"):
        load_model(str(path), dtype="float32")


def test_gguf_unsupported_rope_scaling_is_refused(tmp_path, tiny):
    def yarn(w):
        w.add_string("llama.rope.scaling.type", "yarn")
        w.add_float32("llama.rope.scaling.factor", 4.0)

    path = _gguf(tiny, "llama_linear", tmp_path / "m.gguf", yarn)
    with pytest.raises(ModelLoadError, match=r"rope scaling type 'yarn' is not supported"):
        load_model(str(path), dtype="float32")


def test_gguf_linear_rope_scaling_is_applied(tmp_path, tiny):
    """The tiny model's rope is linear with factor 2: its GGUF says so in rope.scaling.*."""

    def linear(w):
        w.add_string("llama.rope.scaling.type", "linear")
        w.add_float32("llama.rope.scaling.factor", 2.0)

    folder, hf = tiny["llama_linear"]
    net = load_model(str(_gguf(tiny, "llama_linear", tmp_path / "m.gguf", linear)), dtype="float32").model
    assert (_logits(net, IDS) - _hf_logits(hf)).abs().max().item() < 1e-4


def test_gguf_rope_freqs_llama3_scaling_is_applied(tmp_path, tiny):
    """Llama 3.1 GGUFs carry their rope scaling as a rope_freqs tensor of per-frequency divisors,
    computed here as llama.cpp's converter computes them."""
    _, hf = tiny["llama3"]
    rope = hf.config.rope_parameters
    dim = hf.config.hidden_size // hf.config.num_attention_heads
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    factors = []
    for freq in 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(float(1 / ((1 - smooth) / factor + smooth)))

    path = _gguf(tiny, "llama3", tmp_path / "m.gguf",
                 lambda w: w.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32)))
    net = load_model(str(path), dtype="float32").model
    assert (_logits(net, IDS) - _hf_logits(hf)).abs().max().item() < 1e-4


def test_gguf_without_tokenizer_runs_on_token_ids(tmp_path, tiny):
    path = _gguf(tiny, "llama_linear", tmp_path / "m.gguf")
    assert load_tokenizer(resolve_model(str(path))) is None


# --- the GGUF load cache --------------------------------------------------------------------------


def _edit_config(key, value):
    def damage(entry):
        config = json.loads((entry / "config.json").read_text())
        config[key] = value
        (entry / "config.json").write_text(json.dumps(config))

    return damage


def _truncate(entry):
    weights = entry / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])


def _drop_hidden_size(entry):
    config = json.loads((entry / "config.json").read_text())
    del config["hidden_size"]
    (entry / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "damage",
    [_truncate, _edit_config("rms_norm_eps", 0.5), _drop_hidden_size,
     lambda e: (e / "model.safetensors").unlink(), lambda e: shutil.rmtree(e) or e.write_text("x")],
    ids=["truncated-weights", "edited-config", "config-without-key", "weights-deleted", "entry-is-a-file"],
)
def test_damaged_cache_entry_is_never_served_and_is_replaced(tmp_path, tiny, monkeypatch, damage):
    import pagoda.model.gguf_file as gguf_file

    path = _gguf(tiny, "llama_linear", tmp_path / "m.gguf", qtype="Q8_0")
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    good = _logits(load_model(str(path), dtype="float32").model, IDS)
    damage(gguf_cache.entry_dir(path, "params-float32"))
    assert torch.equal(_logits(load_model(str(path), dtype="float32").model, IDS), good)
    # The entry was written again: the next start is a cache hit, with the same result.
    assert gguf_cache.lookup(path, "params-float32") is not None

    def no_parsing(*args, **kwargs):
        raise AssertionError("the GGUF was parsed again")

    monkeypatch.setattr(gguf_file, "open_gguf", no_parsing)
    assert torch.equal(_logits(load_model(str(path), dtype="float32").model, IDS), good)


def test_cache_entry_of_a_gguf_edited_in_place_is_not_served(tmp_path, tiny, monkeypatch):
    """gguf-set-metadata rewrites a value inside the file: same size, and the sampled fingerprint of
    a large file may not cover the byte. The entry checks the whole metadata section."""
    import gguf

    path = _gguf(tiny, "llama_linear", tmp_path / "m.gguf", lambda w: w.add_eos_token_id(2))
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_cache, "fingerprint", lambda p, size: "same-key")  # as if the edit was missed
    assert load_model(str(path), dtype="float32").config.eos_token_id == 2
    reader = gguf.GGUFReader(str(path), "r+")
    reader.fields["tokenizer.ggml.eos_token_id"].parts[-1][0] = 7
    del reader
    from pagoda.model.gguf_file import _open_gguf

    _open_gguf.cache_clear()  # this process parsed it before the edit (mtime may not tick between)
    assert load_config(resolve_model(str(path))).eos_token_id == 7
    assert load_model(str(path), dtype="float32").config.eos_token_id == 7


def test_gguf_replaced_while_the_process_runs_is_parsed_again(tmp_path, tiny, monkeypatch):
    """The parsed GGUF was kept per path: a file replaced under the same name gave the old weights,
    and wrote them into the cache entry of the new file."""
    import os

    old = _gguf(tiny, "llama_linear", tmp_path / "old.gguf")
    new = _gguf(tiny, "llama3", tmp_path / "new.gguf")
    want = _logits(load_model(str(new), dtype="bfloat16").model, IDS)  # the cache is off here
    path = tmp_path / "m.gguf"
    shutil.copy(old, path)
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    load_model(str(path), dtype="float32")
    shutil.copy(new, tmp_path / "tmp.gguf")
    os.replace(tmp_path / "tmp.gguf", path)
    assert torch.equal(_logits(load_model(str(path), dtype="bfloat16").model, IDS), want)
    assert torch.equal(_logits(load_model(str(path), dtype="bfloat16").model, IDS), want)  # from the cache


def test_damaged_cached_tokenizer_is_not_served(tmp_path, smollm2_source, monkeypatch):
    """A missing chat template was served as good, a broken tokenizer.json raised from deep inside."""
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    original = load_tokenizer(smollm2_source)
    entry = gguf_cache.lookup(smollm2_source.path, "tokenizer")
    template = next(entry.glob("chat_template*"), None)
    (template or entry / "tokenizer_config.json").unlink()
    (entry / "tokenizer.json").write_text("{broken")
    again = load_tokenizer(smollm2_source)
    assert again.chat_template == original.chat_template
    assert again.encode("Hello, world") == original.encode("Hello, world")
    assert gguf_cache.lookup(smollm2_source.path, "tokenizer") is not None


def test_weights_file_with_overlapping_tensors_is_refused(tmp_path):
    """Names, shapes and dtypes right, but byte ranges that do not tile the file."""
    import struct

    from torch import nn

    from pagoda.model.mmap_weights import load_params, save_params

    path = tmp_path / "params.safetensors"
    save_params(nn.Linear(64, 32), path)
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    for meta in header.values():
        if isinstance(meta, dict) and "data_offsets" in meta:  # every tensor from byte 0: overlapping
            meta["data_offsets"] = [0, meta["data_offsets"][1] - meta["data_offsets"][0]]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length :])
    with torch.device("meta"):
        net = nn.Linear(64, 32)
    with pytest.raises(ModelLoadError, match="damaged header|truncated or damaged"):
        load_params(net, path, torch.device("cpu"))
