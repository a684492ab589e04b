"""Layer 1, model: architectures (Llama family, Qwen2, Qwen3, Mistral), layers and their fused CPU ops,
weight loading (safetensors, GGUF, the GGUF load cache) and tokenizers (docs/architecture.md)."""
