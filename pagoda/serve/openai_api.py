"""POST /v1/completions and /v1/chat/completions: validation, admission (queue bound, token
budgets), the engine requests, and the responses, streamed as server-sent events or whole.

A request's path: body validated by pydantic (400 on failure) -> model checked (404) -> server
accepting (503) -> sampling params built and prompts tokenized and checked against the context and
the KV cache, once, by the engine's input processor (400) -> admission: waiting-queue bound and the
tenant's token bucket (429) -> one engine request per prompt -> stream or collect. Nothing reaches the
engine before every check has passed, so a bad request never disturbs another.

Each refusal arrives as an `InvalidRequestError` naming its field as the engine knows it; `Fields`
turns that into the endpoint's own name for it (OpenAI's `param`): chat's prompt is its messages,
its logprobs count is top_logprobs.

Cancellation: a streaming response is cancelled by Starlette when the client disconnects; a whole
response is raced against the client's disconnect here. Either way the engine streams are closed,
which aborts their requests in the core at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Mapping

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from pagoda.engine.errors import (EngineDeadError, EngineNotReadyError, InvalidRequestError, RequestAbortedError,
                                  RequestRejectedError, RequestTimeoutError)
from pagoda.engine.input_processor import ProcessedPrompt, Prompt
from pagoda.engine.request_stream import RequestStream, merge_delta
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.serve.state import ServerState, get_state, get_tenant
from pagoda.serve.errors import APIError, bad_request, rate_limited, unavailable
from pagoda.serve.openai_format import SSE_DONE, CompletionLogprobs, chat_logprobs, prompt_logprobs_json, sse, usage
from pagoda.serve.protocol import ChatCompletionRequest, CompletionRequest
from pagoda.serve.request_context import request_id_var
from pagoda.serve.tenants import Tenant
from pagoda.serve.tool_calls import parse_tool_calls

logger = logging.getLogger(__name__)
router = APIRouter()

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

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p.prompt_token_ids) for p in self.prompts)


def sampling_params(body: Any, fields: Fields) -> SamplingParams:
    """The body's SamplingParams; a 400 naming the field its checks refused."""
    try:
        return body.to_sampling_params()
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


async def start(state: ServerState, prep: Prepared, request_id: str) -> list[RequestStream]:
    """Send the engine requests (`request_id`, or `request_id-i` for prompt i of several)."""
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
            streams.append(await state.engine.add_request(prompt, prep.params, rid, prep.priority))
    except BaseException as exc:
        for s in streams:
            s.close()
        # Nothing of it ran (children already sent are aborted at once): its tokens were not used.
        prep.tenant.refund_prompt_tokens(prep.num_prompt_tokens)
        if isinstance(exc, Exception):
            raise engine_error(exc) from None
        raise
    return streams


# -- responses ------------------------------------------------------------------------------------
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class SSEResponse(StreamingResponse):
    """A streaming response that always closes its body iterator, however the stream ends
    (client gone, server stopping), so the engine requests behind it are aborted at once."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, delta output) from several request streams, as they come."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out, None))
            queue.put_nowait((i, None, None))
        except Exception as exc:
            queue.put_nowait((i, None, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, out, err = await queue.get()
            if err is not None:
                raise err
            if out is None:
                remaining -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.close()


async def collect(streams: list[RequestStream]) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for i, out in merge_streams(streams):
        finals[i] = out if finals[i] is None else merge_delta(finals[i], out)
    return finals  # type: ignore[return-value]


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_cancellable(request: Request, work: Awaitable[Any]) -> Any:
    """Run `work`, cancelling it if the client disconnects first (a whole response otherwise
    keeps generating for nobody). Returns its result, or an empty 499 response."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except BaseException:
        pass
    return Response(status_code=499)  # nginx's "client closed request"; nobody reads it


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage_event(request_id: str, obj: str, created: int, prep: Prepared, completion_tokens: int, cached: int) -> str:
    """The last event of a stream asked with stream_options.include_usage: no choices, the totals."""
    return sse(
        {
            "id": request_id,
            "object": obj,
            "created": created,
            "model": prep.model,
            "choices": [],
            "usage": usage(prep.num_prompt_tokens, completion_tokens, cached),
        }
    )


# -- /v1/completions -------------------------------------------------------------------------------
@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    state = get_state(request)
    model = state.check_model(body.model)
    state.check_accepting()
    tenant = get_tenant(request)
    params = sampling_params(body, COMPLETION_FIELDS)
    prompts = await process_prompts(state, body.prompts(), params, COMPLETION_FIELDS, body.add_special_tokens)
    prep = Prepared(model, params, prompts, tenant.effective_priority(body.priority), tenant)
    admit(state, prep)
    request_id = new_id("cmpl")
    streams = await start(state, prep, request_id)
    headers = {"x-request-id": request_id}
    if body.stream:
        return SSEResponse(_completion_events(state, body, prep, request_id, streams), headers={**SSE_HEADERS, **headers})
    result = await run_cancellable(request, _completion_whole(state, body, prep, request_id, streams))
    if isinstance(result, Response):
        return result
    return JSONResponse(result, headers=headers)


def _echo_texts(state: ServerState, prep: Prepared) -> list[str]:
    """What each prompt echoes: the text that runs (a cut prompt, the text of its remaining tokens)."""
    return [p.text if p.text is not None and not p.truncated else state.engine.detokenize(p.prompt_token_ids)
            for p in prep.prompts]


def _generated(body: CompletionRequest, seq: CompletionOutput) -> tuple[list[int], list | None, str, str | None, Any]:
    """A choice's (token ids, logprobs, text, finish reason, stop reason) as the client sees them:
    with echo and max_tokens=0 the one token the engine sampled is dropped, and the length limit is
    what ended the choice."""
    if body.echo_only:
        return [], [], "", None if seq.finish_reason is None else "length", None
    return seq.token_ids, seq.logprobs, seq.text, seq.finish_reason, seq.stop_reason


def _echo_logprobs_prompt(state: ServerState, prep: Prepared, i: int, entries: list | None) -> tuple | None:
    """The prompt part of an echoing choice's logprobs (see CompletionLogprobs.make)."""
    if entries is None:
        return None
    ids = prep.prompts[i].prompt_token_ids
    return ids, entries, state.engine.detokenize(ids[:1])


async def _completion_whole(state: ServerState, body: CompletionRequest, prep: Prepared, request_id: str,
                            streams: list[RequestStream]) -> dict:
    completion_tokens = 0
    try:
        finals = await collect(streams)
    except Exception as exc:
        raise engine_error(exc) from None
    finally:
        for s in streams:
            s.close()
    n = prep.params.n
    echo = _echo_texts(state, prep) if body.echo else None
    choices = []
    cached = 0
    for i, out in enumerate(finals):
        cached += out.num_cached_tokens
        for seq in out.outputs:
            token_ids, seq_logprobs, text, reason, stop_reason = _generated(body, seq)
            completion_tokens += len(token_ids)
            logprobs = None
            if body.logprobs is not None:
                prompt = _echo_logprobs_prompt(state, prep, i, out.prompt_logprobs) if body.echo_logprobs else None
                logprobs = CompletionLogprobs(body.logprobs, 0, body.return_tokens_as_token_ids).make(
                    token_ids, seq_logprobs, prompt
                )
            choice = {
                "index": i * n + seq.index,
                "text": (echo[i] if echo else "") + text,
                "logprobs": logprobs,
                "finish_reason": reason,
                "stop_reason": stop_reason,
            }
            if body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs, body.prompt_logprobs)
            choices.append(choice)
    prep.tenant.charge_tokens(completion_tokens)
    choices.sort(key=lambda c: c["index"])
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": prep.model,
        "choices": choices,
        "usage": usage(prep.num_prompt_tokens, completion_tokens, cached),
        "system_fingerprint": None,
    }


async def _completion_events(state: ServerState, body: CompletionRequest, prep: Prepared, request_id: str,
                             streams: list[RequestStream]) -> AsyncIterator[str]:
    n = prep.params.n
    created = int(time.time())
    echo = _echo_texts(state, prep) if body.echo else None
    echoed: set[int] = set()
    finished: set[int] = set()
    lp_state: dict[int, CompletionLogprobs] = {}
    prompt_entries: dict[int, list] = {}  # per prompt: its prompt_logprobs, which come with its first delta
    completion_tokens = 0
    cached: dict[int, int] = {}  # per prompt; the usage sums them, as the whole response does
    include_usage = body.include_usage
    try:
        async for i, out in merge_streams(streams):
            cached[i] = max(cached.get(i, 0), out.num_cached_tokens)
            if out.prompt_logprobs is not None:
                prompt_entries.setdefault(i, out.prompt_logprobs)
            for seq in out.outputs:
                idx = i * n + seq.index
                if idx in finished:
                    continue
                token_ids, seq_logprobs, text, reason, stop_reason = _generated(body, seq)
                completion_tokens += len(token_ids)
                prompt = None
                if echo is not None and idx not in echoed:
                    echoed.add(idx)
                    text = echo[i] + text
                    if body.echo_logprobs:
                        prompt = _echo_logprobs_prompt(state, prep, i, prompt_entries.get(i))
                if not text and reason is None and (body.logprobs is None or not token_ids):
                    continue  # nothing to show yet (text held back until it is certain)
                logprobs = None
                if body.logprobs is not None:
                    lp = lp_state.setdefault(idx, CompletionLogprobs(body.logprobs, 0, body.return_tokens_as_token_ids))
                    logprobs = lp.make(token_ids, seq_logprobs, prompt)
                if reason is not None:
                    finished.add(idx)
                chunk: dict[str, Any] = {
                    "id": request_id,
                    "object": "text_completion",
                    "created": created,
                    "model": prep.model,
                    "choices": [
                        {
                            "index": idx,
                            "text": text,
                            "logprobs": logprobs,
                            "finish_reason": reason,
                            "stop_reason": stop_reason if reason is not None else None,
                        }
                    ],
                }
                if include_usage:
                    chunk["usage"] = (
                        usage(prep.num_prompt_tokens, completion_tokens) if body.continuous_usage else None
                    )
                yield sse(chunk)
        if include_usage:
            yield usage_event(request_id, "text_completion", created, prep, completion_tokens, sum(cached.values()))
        yield SSE_DONE
    except Exception as exc:
        yield sse(engine_error(exc).body())
        yield SSE_DONE
    finally:
        for s in streams:
            s.close()
        prep.tenant.charge_tokens(completion_tokens)


# -- /v1/chat/completions --------------------------------------------------------------------------
@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state = get_state(request)
    model = state.check_model(body.model)
    state.check_accepting()
    tenant = get_tenant(request)
    params = sampling_params(body, CHAT_FIELDS)
    try:
        ids = await state.engine.apply_chat_template_async(
            [m.to_template_dict() for m in body.messages],
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            chat_template_kwargs=body.template_kwargs(),
        )
    except InvalidRequestError as exc:  # on messages or chat_template_kwargs
        raise invalid_request(exc, CHAT_FIELDS) from None
    prompts = await process_prompts(state, [{"prompt_token_ids": ids}], params, CHAT_FIELDS)
    prep = Prepared(model, params, prompts, tenant.effective_priority(body.priority), tenant)
    admit(state, prep)
    request_id = new_id("chatcmpl")
    streams = await start(state, prep, request_id)
    headers = {"x-request-id": request_id}
    if body.stream:
        return SSEResponse(_chat_events(body, prep, request_id, streams), headers={**SSE_HEADERS, **headers})
    result = await run_cancellable(request, _chat_whole(body, prep, request_id, streams))
    if isinstance(result, Response):
        return result
    return JSONResponse(result, headers=headers)


def _assistant_message(body: ChatCompletionRequest, text: str, reason: str | None) -> tuple[dict, str | None]:
    """The assistant message of a finished choice and its finish reason: with tool_choice named or
    "required", the generated JSON as tool_calls ("required" ends with finish_reason "tool_calls"; a
    named function, as OpenAI's forced calls, with "stop")."""
    mode = body.tool_call_mode
    calls = parse_tool_calls(mode, body.tool_choice, text) if mode is not None and reason is not None else None
    if calls is None:
        return {"role": "assistant", "content": text}, reason
    return ({"role": "assistant", "content": "", "tool_calls": calls},
            "tool_calls" if mode == "required" and reason == "stop" else reason)


async def _chat_whole(body: ChatCompletionRequest, prep: Prepared, request_id: str,
                      streams: list[RequestStream]) -> dict:
    try:
        (final,) = await collect(streams)
    except Exception as exc:
        raise engine_error(exc) from None
    finally:
        for s in streams:
            s.close()
    completion_tokens = sum(len(seq.token_ids) for seq in final.outputs)
    prep.tenant.charge_tokens(completion_tokens)
    choices = []
    for seq in final.outputs:
        message, reason = _assistant_message(body, seq.text, seq.finish_reason)
        choices.append({
            "index": seq.index,
            "message": message,
            "logprobs": chat_logprobs(seq.token_ids, seq.logprobs, body.num_top_logprobs, body.return_tokens_as_token_ids) if body.logprobs else None,
            "finish_reason": reason,
            "stop_reason": seq.stop_reason,
        })
    response = {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": prep.model,
        "choices": choices,
        "usage": usage(prep.num_prompt_tokens, completion_tokens, final.num_cached_tokens),
        "system_fingerprint": None,
    }
    if body.prompt_logprobs is not None:
        response["prompt_logprobs"] = prompt_logprobs_json(final.prompt_logprobs, body.prompt_logprobs)
    return response


async def _chat_events(body: ChatCompletionRequest, prep: Prepared, request_id: str,
                       streams: list[RequestStream]) -> AsyncIterator[str]:
    created = int(time.time())
    include_usage = body.include_usage
    completion_tokens = 0
    cached = 0
    finished: set[int] = set()

    def chunk(index: int, delta: dict, logprobs: dict | None = None, reason: str | None = None,
              stop_reason: Any = None) -> str:
        data: dict[str, Any] = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": prep.model,
            "choices": [
                {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason,
                 "stop_reason": stop_reason}
            ],
        }
        if include_usage:
            data["usage"] = usage(prep.num_prompt_tokens, completion_tokens) if body.continuous_usage else None
        return sse(data)

    held: dict[int, tuple[list, list, list]] = {}  # tool calls: each choice's ids, logprobs and text so far
    try:
        # OpenAI opens every choice with the assistant role before any content.
        for index in range(prep.params.n):
            yield chunk(index, {"role": "assistant", "content": ""})
        async for _, out in merge_streams(streams):
            cached = max(cached, out.num_cached_tokens)
            for seq in out.outputs:
                if seq.index in finished:
                    continue
                completion_tokens += len(seq.token_ids)
                reason = seq.finish_reason
                if body.tool_call_mode is not None:
                    # Tool calls go out whole, in one delta when the choice ends (OpenAI's clients
                    # join the deltas of a call by its index, so one delta is a valid stream).
                    held_ids, held_lps, held_text = held.setdefault(seq.index, ([], [], []))
                    held_ids.extend(seq.token_ids)
                    held_lps.extend(seq.logprobs or [])
                    held_text.append(seq.text)
                    if reason is None:
                        continue
                    finished.add(seq.index)
                    message, reason = _assistant_message(body, "".join(held_text), reason)
                    message.pop("role")
                    if "tool_calls" in message:
                        message = {"tool_calls": [{"index": k, **c} for k, c in enumerate(message["tool_calls"])]}
                    logprobs = chat_logprobs(held_ids, held_lps, body.num_top_logprobs, body.return_tokens_as_token_ids) if body.logprobs else None
                    yield chunk(seq.index, message, logprobs, reason, seq.stop_reason)
                    continue
                if not seq.text and reason is None and (not body.logprobs or not seq.token_ids):
                    continue
                logprobs = chat_logprobs(seq.token_ids, seq.logprobs, body.num_top_logprobs, body.return_tokens_as_token_ids) if body.logprobs else None
                if reason is not None:
                    finished.add(seq.index)
                delta = {"content": seq.text} if seq.text or reason is None else {}
                yield chunk(seq.index, delta, logprobs, reason, seq.stop_reason if reason is not None else None)
        if include_usage:
            yield usage_event(request_id, "chat.completion.chunk", created, prep, completion_tokens, cached)
        yield SSE_DONE
    except Exception as exc:
        yield sse(engine_error(exc).body())
        yield SSE_DONE
    finally:
        for s in streams:
            s.close()
        prep.tenant.charge_tokens(completion_tokens)
