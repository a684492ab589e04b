"""Layer 2, execution: the model runner, paged attention (C++ on CPU, Triton on GPU), the KV cache tensors,
the sampler, structured-output masks, prompt logprobs, CUDA graphs and KV sizing (docs/architecture.md)."""
