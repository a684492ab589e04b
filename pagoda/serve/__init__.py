"""Layer 5, service: the OpenAI-compatible HTTP server in front of the engine (see docs/architecture.md).
It reaches the engine only through `pagoda.engine` (AsyncLLM, its errors and input processor).

- `cli`: `pagoda serve [MODEL]` and its flags (vLLM's names).
- `server`: uvicorn runner; exit code 1 when the engine core dies.
- `app`: `build_app`, the FastAPI app assembled from the pieces below.
- `state`: `ServerConfig`, `ServerState` (status and lifecycle: starting, ready, draining, dead),
  `get_state` / `get_tenant`.
- `middleware`: API-key auth and the requests-per-second limit.
- `routes`: /health, /ping, /version, /v1/models, /tokenize, /detokenize, /v1/engine/stats, /reset_prefix_cache.
- `openai_api`: /v1/completions and /v1/chat/completions, whole and streamed.
- `admission`: sampling params, prompt processing, the waiting-queue and token-budget checks, the
  engine requests, and engine errors as HTTP errors.
- `streaming`: server-sent events, merged request streams, cancellation on client disconnect.
- `protocol`: pydantic request models and their mapping to SamplingParams.
- `openai_format`: response, chunk, usage and logprobs shapes.
- `errors`: OpenAI's error shape for every failure.
- `tenants`: API keys, token buckets, tenant priorities.
- `tool_calls`: tool_choice as structured outputs, and the generated JSON as tool_calls.
- `tool_parsers`: tool_choice "auto": each family's call syntax as a grammar and as a parser.
- `reasoning_parsers`: `<think>` text into reasoning_content.
- `chat_output`: a chat choice's text split into reasoning, content and tool calls, whole or streamed.
- `request_context`: the request id that log lines carry.
"""
