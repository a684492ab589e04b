"""Benchmarks: `pagoda bench throughput | latency | serve` (see docs/benchmarks.md).

- `workloads`: the seeded request sets (random, shared-prefix, JSONL) every benchmark draws from.
- `throughput`: offline batches through `LLM.generate`, optionally side by side with transformers.
- `latency`: one request's prefill and decode speed across prompt lengths.
- `serve`: an async load generator for any OpenAI-compatible streaming server, with plots.
- `models`: random-weight models of a given shape (the tiny test model, the GPU-offline model).

Speed is judged here and never in timed unit tests (DESIGN.md, "Measuring speed").
"""
