"""From a validated request body to engine streams, for both generation endpoints: the sampling
params, the prompts (tokenized, truncated and checked once, by the engine's input processor),
admission (the waiting-queue bound and the tenant's token bucket), and the engine requests. Also the
mapping of every engine exception to its HTTP error.

Each refusal arrives as an `InvalidRequestError` naming its field as the engine knows it; `Fields`
turns that into the endpoint's own name for it (OpenAI's `param`): chat's prompt is its messages,
its logprobs count is top_logprobs.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from pagoda.engine.errors import (EngineDeadError, EngineNotReadyError, InvalidRequestError, RequestAbortedError,
                                  RequestRejectedError, RequestTimeoutError)
from pagoda.engine.generation_defaults import GenerationDefaults, fill_unset
from pagoda.engine.input_processor import ProcessedPrompt, Prompt
from pagoda.engine.request_stream import RequestStream
from pagoda.sampling_params import SamplingParams
from pagoda.serve.errors import APIError, bad_request, rate_limited, unavailable
from pagoda.serve.request_context import request_id_var
from pagoda.serve.state import ServerState
from pagoda.serve.tenants import Tenant

logger = logging.getLogger(__name__)

# The engine's name of a field -> the endpoint's (absent: the same name).
Fields = Mapping[str, str]
COMPLETION_FIELDS: Fields = {}
CHAT_FIELDS: Fields = {"prompt": "messages", "logprobs": "top_logprobs"}


def invalid_request(exc: InvalidRequestError, fields: Fields) -> APIError:
    """The 400 of a refused request, naming the endpoint's field the error names."""
    param = fields.get(exc.field, exc.field) if exc.field is not None else None
    return bad_request(str(exc), param=param, code=exc.code)


def engine_error(exc: BaseException) -> APIError:
    """The HTTP error for an exception out of the engine."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestTimeoutError):
        logger.warning("timed out: %s", exc)
        return APIError(504, str(exc), code="request_timeout")
    if isinstance(exc, (EngineDeadError, EngineNotReadyError)):
        return unavailable(f"the engine is not running: {exc}")
    if isinstance(exc, (RequestRejectedError, ValueError)):
        return bad_request(str(exc))
    if isinstance(exc, RequestAbortedError):
        return APIError(503, str(exc), code="aborted")
    logger.error("internal error: %s: %s", type(exc).__name__, exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}")


class Prepared:
    """A checked request, ready to be sent to the engine: one engine request per prompt."""

    def __init__(self, model: str, params: SamplingParams, prompts: list[ProcessedPrompt], priority: int,
                 tenant: Tenant) -> None:
        self.model = model
        self.params = params
        self.prompts = prompts
        self.priority = priority
        self.tenant = tenant
        self.session: str | None = None  # routing key for data-parallel replicas (`user` or a header)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p.prompt_token_ids) for p in self.prompts)


def sampling_params(body: Any, fields: Fields, defaults: GenerationDefaults | None = None) -> SamplingParams:
    """The body's SamplingParams, the model's defaults (`--generation-config`) filling the sampling
    fields it left unset or null; a 400 naming the field its checks refused."""
    try:
        params = body.to_sampling_params()
        if defaults is None or not defaults.sampling:
            return params
        unset = [name for name in defaults.sampling if getattr(body, name, None) is None]
        return fill_unset(params, defaults, unset)
    except InvalidRequestError as exc:
        raise invalid_request(exc, fields) from None
    except ValueError as exc:  # no field named: none is guessed
        raise bad_request(str(exc)) from None


async def process_prompts(state: ServerState, prompts: list[Prompt], params: SamplingParams, fields: Fields,
                          add_special_tokens: bool = True) -> list[ProcessedPrompt]:
    """Each prompt tokenized, truncated and checked against the context and the KV cache, once (the
    engine sends these as they are). A truncated prompt's usage and echo show what runs."""
    out = []
    for prompt in prompts:
        try:
            out.append(await state.engine.process_inputs_async(prompt, params, add_special_tokens))
        except InvalidRequestError as exc:
            raise invalid_request(exc, fields) from None
    return out


SESSION_HEADER = "x-session-id"


def session_key(headers: Any, user: str | None) -> str | None:
    """What keeps a conversation on one replica under the `session` routing policy: the
    `X-Session-Id` header, else the body's `user` field."""
    return headers.get(SESSION_HEADER) or user or None


def admit(state: ServerState, prep: Prepared) -> None:
    """Refuse (429) when the waiting queue is full or the tenant is out of prompt tokens."""
    bound = state.config.max_waiting_requests
    if bound is not None and state.engine.estimated_num_waiting() >= bound:
        raise rate_limited(f"the server's waiting queue is full ({bound} requests); retry later", 1.0,
                           code="queue_full")
    wait = prep.tenant.take_prompt_tokens(prep.num_prompt_tokens)
    if wait > 0:
        raise rate_limited(
            f"Rate limit reached for {prep.tenant.name}: {prep.tenant.tokens_per_minute:g} tokens per minute",
            wait,
        )


async def start(state: ServerState, prep: Prepared, request_id: str, final_only: bool = False) -> list[RequestStream]:
    """Send the engine requests (`request_id`, or `request_id-i` for prompt i of several);
    `final_only` for a response that is not streamed (each stream yields its whole output once)."""
    # From here on, log lines written while serving this request carry its id.
    request_id_var.set(request_id)
    logger.debug(
        "received: %d prompt(s), %d prompt tokens, max_tokens=%s, tenant=%s, priority=%d",
        len(prep.prompts), prep.num_prompt_tokens, prep.params.max_tokens, prep.tenant.name, prep.priority,
    )
    streams: list[RequestStream] = []
    try:
        for i, prompt in enumerate(prep.prompts):
            rid = request_id if len(prep.prompts) == 1 else f"{request_id}-{i}"
            streams.append(await state.engine.add_request(prompt, prep.params, rid, prep.priority,
                                                          session=prep.session, final_only=final_only))
            for listener in state.on_request_started:
                try:
                    listener(rid, prep.tenant.name, len(prompt.prompt_token_ids))
                except Exception:
                    logger.exception("request listener failed")
    except BaseException as exc:
        for s in streams:
            s.close()
        # Nothing of it ran (children already sent are aborted at once): its tokens were not used.
        prep.tenant.refund_prompt_tokens(prep.num_prompt_tokens)
        if isinstance(exc, Exception):
            raise engine_error(exc) from None
        raise
    return streams
