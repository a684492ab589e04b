"""Messages between the front end and the engine core, as msgspec structs (cheap to send over ZMQ)."""

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


_encoder = msgspec.msgpack.Encoder()


def encode(msg) -> bytes:
    return _encoder.encode(msg)


def decoder(kind):
    return msgspec.msgpack.Decoder(kind)
