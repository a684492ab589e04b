"""Mixtures of experts from GGUF files in llama.cpp's layout (Mixtral as `llama` with expert_count,
`qwen2moe`, `qwen3moe`; each projection stacked over the experts in `ffn_*_exps`): the same greedy
tokens and logits as the Hugging Face model they were converted from, also through the GGUF load
cache and when quantized (Q8_0, dequantized at load), and split over two ranks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagoda import SamplingParams
from pagoda.model.attention import AttentionContext, ContiguousKVBackend, ContiguousMetadata
from pagoda.model.loader import load_model
from tests.conftest import hf_greedy, make_engine
from tests.tiny_models import save_tiny_model

_ATTN = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
         "q_norm": "attn_q_norm", "k_norm": "attn_k_norm"}
_MLP = {"gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def _permute_like_llama_cpp(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_moe_gguf(hf_model, path, gguf_arch: str, qtype_name: str = "F32",
                   types: dict[str, str] | None = None) -> None:
    """What llama.cpp's converter writes for these models: experts stacked per projection. `types`:
    another type than `qtype_name` for some tensors, by GGUF name without the layer (`ffn_up_exps`)."""
    import gguf
    from gguf.quants import quantize

    cfg = hf_model.config
    w = gguf.GGUFWriter(str(path), arch=gguf_arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    head_dim = getattr(cfg, "head_dim", None)
    if head_dim:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_expert_count(getattr(cfg, "num_local_experts", None) or cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if gguf_arch != "llama":
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", 0):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    tensors: dict[str, np.ndarray] = {}
    for name, t in hf_model.state_dict().items():
        a = t.float().numpy()
        parts = name.split(".")
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            tensors[{"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]] = a
            continue
        layer, block, leaf = int(parts[2]), parts[3], parts[-1]
        if block in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"blk.{layer}.{'attn_norm' if block == 'input_layernorm' else 'ffn_norm'}.weight"] = a
        elif block == "self_attn":
            if gguf_arch == "llama" and parts[4] in ("q_proj", "k_proj") and leaf == "weight":
                heads = cfg.num_attention_heads if parts[4] == "q_proj" else cfg.num_key_value_heads
                a = _permute_like_llama_cpp(a, heads)
            tensors[f"blk.{layer}.{_ATTN[parts[4]]}.{leaf}"] = a
        elif parts[4] == "experts":  # transformers' stacked [E, 2I, H] gate_up_proj and [E, H, I] down_proj
            if parts[5] == "gate_up_proj":
                gate, up = np.split(a, 2, axis=1)
                tensors[f"blk.{layer}.ffn_gate_exps.weight"] = gate
                tensors[f"blk.{layer}.ffn_up_exps.weight"] = up
            else:
                tensors[f"blk.{layer}.ffn_down_exps.weight"] = a
        elif parts[4] == "gate":
            tensors[f"blk.{layer}.ffn_gate_inp.weight"] = a
        elif parts[4] == "shared_expert":
            tensors[f"blk.{layer}.{_MLP[parts[5]]}_shexp.weight"] = a
        elif parts[4] == "shared_expert_gate":
            tensors[f"blk.{layer}.ffn_gate_inp_shexp.weight"] = a.reshape(-1)
        else:  # a dense layer's MLP
            tensors[f"blk.{layer}.{_MLP[parts[4]]}.weight"] = a
    for gname, a in tensors.items():
        big = a.ndim >= 2 and a.shape[-1] % 32 == 0 and "ffn_gate_inp" not in gname
        kind = (types or {}).get(gname.split(".")[-2], qtype_name)
        if kind != "F32" and big:
            qtype = gguf.GGMLQuantizationType[kind]
            w.add_tensor(gname, quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


PROMPTS = [[5, 17, 300, 42, 7], list(range(40, 110))]
GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}


def _logits(model, ids):
    with torch.no_grad():
        h = model(torch.tensor(ids), torch.arange(len(ids)),
                  AttentionContext(ContiguousKVBackend(), ContiguousMetadata([0], [len(ids)])))
        return model.compute_logits(h)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_gguf_equals_the_model_it_was_converted_from(tmp_path, arch, monkeypatch):
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    # Every layer sparse: llama.cpp's MoE files have no dense layers.
    overrides = {"mlp_only_layers": []} if arch == "qwen3_moe" else {}
    hf = save_tiny_model(arch, tmp_path / "hf", **overrides)
    path = tmp_path / f"{arch}.gguf"
    write_moe_gguf(hf, path, GGUF_ARCH[arch])
    loaded = load_model(str(path), dtype="float32")
    assert loaded.architecture == hf.config.architectures[0]
    ref = hf(torch.tensor([PROMPTS[1]])).logits[0].detach()
    assert (_logits(loaded.model, PROMPTS[1]) - ref).abs().max().item() < 1e-4
    llm = make_engine(loaded, None, num_gpu_blocks_override=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 10)
    from pagoda.model import gguf_cache

    assert gguf_cache.lookup(path, "params-float32") is not None
    again = load_model(str(path), dtype="float32")  # from the load cache this time
    assert (_logits(again.model, PROMPTS[1]) - ref).abs().max().item() < 1e-4


def test_quantized_moe_gguf_is_close(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    hf = save_tiny_model("qwen2_moe", tmp_path / "hf")
    path = tmp_path / "q8.gguf"
    write_moe_gguf(hf, path, "qwen2moe", "Q8_0")
    ref = hf(torch.tensor([PROMPTS[1]])).logits[0].detach()
    diff = (_logits(load_model(str(path), dtype="float32").model, PROMPTS[1]) - ref).abs().max().item()
    assert 0 < diff < 0.5 * ref.abs().max().item()  # quantized (not exact), and still the same model
