"""Layer 5, service: the OpenAI-compatible HTTP server in front of the engine (see DESIGN.md).

- `cli`: `pagoda serve [MODEL]` and its flags (vLLM's names).
- `server`: uvicorn runner; exit code 1 when the engine core dies.
- `app`: FastAPI app, server state and lifecycle, auth and rate-limit middleware, small endpoints.
- `openai_api`: /v1/completions and /v1/chat/completions (admission, streaming, cancellation).
- `protocol`: pydantic request models and their mapping to SamplingParams.
- `openai_format`: response, chunk, usage and logprobs shapes.
- `errors`: OpenAI's error shape for every failure.
- `tenants`: API keys, token buckets, tenant priorities.

The engine side (core process, AsyncLLM) lives in `pagoda.engine`.
"""
