"""Messages between the front ends and the engine core, as msgspec structs (cheap to send over ZMQ)."""

from __future__ import annotations

import msgspec

from pagoda.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: str | None = None
    # Defer scheduling until that request's prompt is computed, so this one reuses its prompt blocks (n > 1).
    share_prompt_with: str | None = None


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    # Per new token: (token ids, logprobs): the sampled token first, then the top-N alternatives.
    new_logprobs: list[tuple[list[int], list[float]]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # Set on a request's first output only (core clock, seconds since the epoch): for queue and
    # prefill time metrics.
    queued_time: float = 0.0
    scheduled_time: float = 0.0
    # On the first output of a request that asked for prompt_logprobs: one row per prompt position
    # p >= 0, scoring prompt token p + 1: ([that token, top-1, ..., top-N], their logprobs, its rank).
    prompt_logprobs: list[tuple[list[int], list[float], int]] | None = None
    # The request ended in the core without finishing, for this reason (a weight update in "abort"
    # mode): the front end fails its stream with this message.
    error: str | None = None


# -- between the API process and the engine-core process (pagoda.engine.core_proc) -------------------
# Inputs travel as two ZMQ frames: a one-byte kind (EngineCoreRequestType) and the msgpack payload:
# ADD -> EngineCoreRequest, ABORT and FINISH -> list[str] of core request ids, UTILITY -> UtilityRequest,
# SHUTDOWN -> empty. Outputs travel as one frame, always an EngineCoreOutputs.


class EngineCoreRequestType:
    ADD = b"A"
    ABORT = b"B"
    FINISH = b"F"  # a stop string matched in the front end
    UTILITY = b"U"
    SHUTDOWN = b"S"


class EngineCoreStats(msgspec.Struct, omit_defaults=True):
    """A snapshot of the core's scheduler and KV cache, sent with every batch of outputs."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_blocks: int = 0
    num_usable_blocks: int = 0
    num_free_blocks: int = 0
    num_steps: int = 0
    num_aborted_requests: int = 0  # aborts that found the request still in the core
    # Speculative decoding, cumulative (vLLM's spec_decode_* counters; see contracts/step.py).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_accepted_tokens_per_pos: list[int] = msgspec.field(default_factory=list)
    # The second KV tier (--kv-offloading-size), cumulative: prompt tokens looked up there and loaded
    # from there, bytes copied down and back up, swap preemptions and resumes.
    kv_offload_queries: int = 0
    kv_offload_hits: int = 0
    kv_offload_bytes_saved: int = 0
    kv_offload_bytes_loaded: int = 0
    num_swaps_out: int = 0
    num_swaps_in: int = 0
    pid: int = 0


class UtilityRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    call_id: int
    method: str
    args: list = []


class UtilityResult(msgspec.Struct, array_like=True, omit_defaults=True):
    call_id: int
    result: object = None
    error: str | None = None


class EngineCoreReady(msgspec.Struct, omit_defaults=True):
    """What the front end needs to know about the loaded model, sent once the core is ready."""

    max_model_len: int
    vocab_size: int
    num_blocks: int
    num_usable_blocks: int
    block_size: int
    model_name: str
    architecture: str = ""
    dtype: str = ""
    device: str = ""
    eos_token_id: int | None = None  # from the model config; the tokenizer's EOS wins when it has one
    pid: int = 0
    weight_version: str = ""
    weights_loaded_at: float = 0.0


class KVCacheEvents(msgspec.Struct, array_like=True, omit_defaults=True):
    """Block hashes the core's prefix cache published and dropped since its previous message (vLLM's
    KV events); `cleared`: the whole cache was reset before these."""

    stored: list[int] = []
    removed: list[int] = []
    cleared: bool = False


class EngineCoreOutputs(msgspec.Struct, omit_defaults=True):
    """Everything the core process sends: one step's outputs, and/or a utility reply, readiness,
    requests it refused, or why it failed."""

    outputs: list[EngineCoreOutput] = []
    stats: EngineCoreStats | None = None
    utility: UtilityResult | None = None
    ready: EngineCoreReady | None = None
    rejected: dict[str, str] = {}  # core request id -> why the core refused it
    failed: str | None = None  # the core hit a fatal error and is exiting
    # With `failed`, while loading: the arguments cannot work (bad model, KV cache too small). The bare
    # message, which the server prints as its one-line usage error (exit 2: a restart would fail again).
    config_error: str | None = None
    timestamp: float = 0.0
    iteration_tokens: list[int] = []  # tokens scheduled in each step since the previous message
    kv_events: KVCacheEvents | None = None
    weight_version: str = ""  # with outputs: the weights that computed them (swaps fall between steps)


_encoder = msgspec.msgpack.Encoder()


def encode(msg) -> bytes:
    return _encoder.encode(msg)


def decoder(kind):
    return msgspec.msgpack.Decoder(kind)
