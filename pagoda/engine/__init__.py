"""Layer package: the engine's front ends and the loop around the engine core (see docs/architecture.md).

In-process (offline):
- `llm`: `LLM`, `LLM(model).generate(prompts, params)` and `chat()`, as in vLLM.
- `llm_engine`: `LLMEngine`, prompts in and RequestOutputs out, one `step()` at a time, with an
  `EngineCore` in the same process.

Served (the API process and the engine-core process):
- `async_llm`: `AsyncLLM`, the server's front door: add_request/generate, the n > 1 fan-out, and the
  routing of the core's outputs to one queue per request.
- `request_stream`: `RequestStream`, one request's delta outputs as an async iterator; `merge_delta`.
- `core_client`: `CoreClient`, the API side of the core process: spawning and supervising it
  (sentinel, dead-core handling), the ZMQ sockets, requests/aborts, utility calls, receiving outputs.
- `core_proc`: the core process itself: `run_engine_core` and the `EngineCoreProc` loop.
- `replica_set`: `DataParallelLLM`, N `AsyncLLM` replicas behind the same interface
  (`--data-parallel-size`): routing, restarts of dead replicas; `failover_stream`: a request's stream
  that moves to another replica when its replica dies before it streamed anything.
- `routing` and `prefix_index`: the routing policies (cache_aware, least_load, round_robin,
  session) and the bounded per-replica index of block hashes they read.

Shared by both:
- `core`: `EngineCore`, the scheduler, KV cache and model runner behind one `step()`.
- `input_processor`: tokenization, chat templates, truncation and validation, once per request,
  raising `InvalidRequestError` with the field to blame; the fan-out into core requests.
- `output_processor` and `detokenizer`: core outputs to RequestOutputs (incremental text, stop strings).
- `errors`: the typed errors callers handle (dead core, timeouts, invalid requests).
- `context_length`: the model's maximum context length; `devices`: the device check before start-up.
- `timeline`: per-request timelines (arrival, admissions, prefill chunks, decode runs, finish).
"""
