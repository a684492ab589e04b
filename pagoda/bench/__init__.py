"""Benchmarks: `pagoda bench throughput | latency | serve` (see docs/benchmarks.md).

- `workloads`: the seeded request sets (random, shared-prefix, JSONL) every benchmark draws from.
- `throughput`: offline batches through `LLM.generate`, optionally side by side with transformers.
- `latency`: one request's prefill and decode speed across prompt lengths.
- `serve`: an async load generator for any OpenAI-compatible streaming server; its records are in
  `serve_types`, its metrics and report in `serve_metrics`, its figure in `plot`.
- `report`: Markdown tables from the `--json` records.
- `models`: random-weight models of a given shape (the tiny test model, the GPU-offline model).

The flags live in pagoda/entrypoints/bench.py. Speed is judged here and never in timed unit tests
(docs/architecture.md, "Measuring speed").
"""
