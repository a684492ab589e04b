"""POST /v1/completions and /v1/chat/completions: each endpoint's path from its body to its response,
streamed as server-sent events or whole.

A request's path: body validated by pydantic (400 on failure) -> model checked (404) -> server
accepting (503) -> sampling params built and prompts tokenized and checked against the context and
the KV cache, once, by the engine's input processor (400) -> admission: waiting-queue bound and the
tenant's token bucket (429) -> one engine request per prompt -> stream or collect. Nothing reaches the
engine before every check has passed, so a bad request never disturbs another. The shared steps are
in `pagoda.serve.admission`, the response machinery in `pagoda.serve.streaming`.
"""

from __future__ import annotations

import logging
import time
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pagoda.engine.request_stream import RequestStream
from pagoda.errors import InvalidRequestError
from pagoda.outputs import CompletionOutput
from pagoda.serve.admission import (CHAT_FIELDS, COMPLETION_FIELDS, Prepared, admit, engine_error, invalid_request,
                                    process_prompts, sampling_params, session_key, start)
from pagoda.serve.chat_output import ChatParsers, ChoiceStream, apply_auto_tools, whole_message
from pagoda.serve.openai_format import (SSE_DONE, CompletionLogprobs, chat_logprobs, prompt_logprobs_json, sse, usage,
                                        weight_version_of)
from pagoda.serve.protocol import ChatCompletionRequest, CompletionRequest
from pagoda.serve.state import ServerState, get_state, get_tenant
from pagoda.serve.streaming import (SSE_HEADERS, SSEResponse, collect, merge_streams, new_id, peek_weight_version,
                                    run_cancellable, usage_event)
from pagoda.serve.tool_calls import parse_tool_calls

logger = logging.getLogger(__name__)
router = APIRouter()


# -- /v1/completions -------------------------------------------------------------------------------
@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    state = get_state(request)
    model = state.check_model(body.model)
    state.check_accepting()
    tenant = get_tenant(request)
    params = sampling_params(body, COMPLETION_FIELDS, state.engine.generation_defaults)
    prompts = await process_prompts(state, body.prompts(), params, COMPLETION_FIELDS, body.add_special_tokens)
    prep = Prepared(model, params, prompts, tenant.effective_priority(body.priority), tenant)
    prep.session = session_key(request.headers, body.user)
    admit(state, prep)
    request_id = new_id("cmpl")
    streams = await start(state, prep, request_id, final_only=not body.stream)
    headers = {"x-request-id": request_id}
    if body.stream:
        headers["x-weight-version"] = await peek_weight_version(streams) or ""
        return SSEResponse(_completion_events(state, body, prep, request_id, streams), headers={**SSE_HEADERS, **headers})
    result = await run_cancellable(request, _completion_whole(state, body, prep, request_id, streams))
    if isinstance(result, Response):
        return result
    return JSONResponse(result, headers={**headers, "x-weight-version": result["system_fingerprint"] or ""})


def _echo_texts(state: ServerState, prep: Prepared) -> list[str]:
    """What each prompt echoes: the text that runs (a cut prompt, the text of its remaining tokens)."""
    return [p.text if p.text is not None and not p.truncated else state.engine.detokenize(p.prompt_token_ids)
            for p in prep.prompts]


def _generated(echo_only: bool, seq: CompletionOutput) -> tuple[list[int], list | None, str, str | None, Any]:
    """A choice's (token ids, logprobs, text, finish reason, stop reason) as the client sees them:
    with echo and max_tokens=0 (`echo_only`) the one token the engine sampled is dropped, and the
    length limit is what ended the choice."""
    if echo_only:
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
            token_ids, seq_logprobs, text, reason, stop_reason = _generated(body.echo_only, seq)
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
        "system_fingerprint": weight_version_of(finals),
    }


async def _completion_events(state: ServerState, body: CompletionRequest, prep: Prepared, request_id: str,
                             streams: list[RequestStream]) -> AsyncIterator[bytes]:
    n = prep.params.n
    created = int(time.time())
    echo = _echo_texts(state, prep) if body.echo else None
    echoed: set[int] = set()
    finished: set[int] = set()
    lp_state: dict[int, CompletionLogprobs] = {}
    prompt_entries: dict[int, list] = {}  # per prompt: its prompt_logprobs, which come with its first delta
    completion_tokens = 0
    cached: dict[int, int] = {}  # per prompt; the usage sums them, as the whole response does
    # Read once: each is a property of the request model, and this loop runs for every token.
    include_usage, continuous_usage, echo_only = body.include_usage, body.continuous_usage, body.echo_only
    want_logprobs = body.logprobs is not None
    try:
        async for i, out in merge_streams(streams):
            cached[i] = max(cached.get(i, 0), out.num_cached_tokens)
            if out.prompt_logprobs is not None:
                prompt_entries.setdefault(i, out.prompt_logprobs)
            for seq in out.outputs:
                idx = i * n + seq.index
                if idx in finished:
                    continue
                token_ids, seq_logprobs, text, reason, stop_reason = _generated(echo_only, seq)
                completion_tokens += len(token_ids)
                prompt = None
                if echo is not None and idx not in echoed:
                    echoed.add(idx)
                    text = echo[i] + text
                    if body.echo_logprobs:
                        prompt = _echo_logprobs_prompt(state, prep, i, prompt_entries.get(i))
                if not text and reason is None and (not want_logprobs or not token_ids):
                    continue  # nothing to show yet (text held back until it is certain)
                logprobs = None
                if want_logprobs:
                    lp = lp_state.setdefault(idx, CompletionLogprobs(body.logprobs, 0, body.return_tokens_as_token_ids))
                    logprobs = lp.make(token_ids, seq_logprobs, prompt)
                if reason is not None:
                    finished.add(idx)
                chunk: dict[str, Any] = {
                    "id": request_id,
                    "object": "text_completion",
                    "created": created,
                    "model": prep.model,
                    "system_fingerprint": out.weight_version,
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
                        usage(prep.num_prompt_tokens, completion_tokens) if continuous_usage else None
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
    params = sampling_params(body, CHAT_FIELDS, state.engine.generation_defaults)
    parsers = state.config.chat_parsers
    try:
        if body.tool_call_mode == "auto":
            apply_auto_tools(params, parsers.tools, body.tools, state.engine.tokenizer)
        ids = await state.engine.apply_chat_template_async(
            [m.to_template_dict() for m in body.messages],
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            chat_template_kwargs=body.template_kwargs(),
        )
    except InvalidRequestError as exc:  # on tool_choice, tools, messages or chat_template_kwargs
        raise invalid_request(exc, CHAT_FIELDS) from None
    prompts = await process_prompts(state, [{"prompt_token_ids": ids}], params, CHAT_FIELDS)
    prep = Prepared(model, params, prompts, tenant.effective_priority(body.priority), tenant)
    prep.session = session_key(request.headers, body.user)
    admit(state, prep)
    request_id = new_id("chatcmpl")
    streams = await start(state, prep, request_id, final_only=not body.stream)
    headers = {"x-request-id": request_id}
    if body.stream:
        headers["x-weight-version"] = version = await peek_weight_version(streams) or ""
        return SSEResponse(_chat_events(body, parsers, prep, request_id, streams, version),
                           headers={**SSE_HEADERS, **headers})
    result = await run_cancellable(request, _chat_whole(body, parsers, prep, request_id, streams))
    if isinstance(result, Response):
        return result
    return JSONResponse(result, headers={**headers, "x-weight-version": result["system_fingerprint"] or ""})


def _assistant_message(body: ChatCompletionRequest, parsers: ChatParsers, text: str,
                       reason: str | None) -> tuple[dict, str | None]:
    """The assistant message of a finished choice and its finish reason: with tool_choice named or
    "required", the generated JSON as tool_calls ("required" ends with finish_reason "tool_calls"; a
    named function, as OpenAI's forced calls, with "stop"); otherwise what the server's parsers make
    of the text (calls of tool_choice "auto" end with "tool_calls", as vLLM's)."""
    mode = body.tool_call_mode
    if not body.forced_tool_call:
        message, called = whole_message(text, parsers, mode == "auto")
        return message, "tool_calls" if called and reason is not None else reason
    calls = parse_tool_calls(mode, body.tool_choice, text) if reason is not None else None
    if calls is None:
        return {"role": "assistant", "content": text}, reason
    return ({"role": "assistant", "content": "", "tool_calls": calls},
            "tool_calls" if mode == "required" and reason == "stop" else reason)


async def _chat_whole(body: ChatCompletionRequest, parsers: ChatParsers, prep: Prepared, request_id: str,
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
        message, reason = _assistant_message(body, parsers, seq.text, seq.finish_reason)
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
        "system_fingerprint": weight_version_of([final]),
    }
    if body.prompt_logprobs is not None:
        response["prompt_logprobs"] = prompt_logprobs_json(final.prompt_logprobs, body.prompt_logprobs)
    return response


async def _chat_events(body: ChatCompletionRequest, parsers: ChatParsers, prep: Prepared, request_id: str,
                       streams: list[RequestStream], weight_version: str | None = None) -> AsyncIterator[bytes]:
    created = int(time.time())
    include_usage, continuous_usage = body.include_usage, body.continuous_usage  # read once, not per token
    completion_tokens = 0
    cached = 0
    finished: set[int] = set()

    def chunk(index: int, delta: dict, logprobs: dict | None = None, reason: str | None = None,
              stop_reason: Any = None) -> bytes:
        data: dict[str, Any] = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": prep.model,
            "system_fingerprint": weight_version or None,
            "choices": [
                {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason,
                 "stop_reason": stop_reason}
            ],
        }
        if include_usage:
            data["usage"] = usage(prep.num_prompt_tokens, completion_tokens) if continuous_usage else None
        return sse(data)

    held: dict[int, tuple[list, list, list]] = {}  # tool calls: each choice's ids, logprobs and text so far
    parsed = parsers.reasoning is not None or (parsers.tools is not None and body.tool_call_mode == "auto")
    choice_streams = {i: ChoiceStream(parsers, body.tool_call_mode == "auto") for i in range(prep.params.n)}
    try:
        # OpenAI opens every choice with the assistant role before any content.
        for index in range(prep.params.n):
            yield chunk(index, {"role": "assistant", "content": ""})
        async for _, out in merge_streams(streams):
            cached = max(cached, out.num_cached_tokens)
            weight_version = out.weight_version or weight_version
            for seq in out.outputs:
                if seq.index in finished:
                    continue
                completion_tokens += len(seq.token_ids)
                reason = seq.finish_reason
                if body.forced_tool_call:
                    # Tool calls go out whole, in one delta when the choice ends (OpenAI's clients
                    # join the deltas of a call by its index, so one delta is a valid stream).
                    held_ids, held_lps, held_text = held.setdefault(seq.index, ([], [], []))
                    held_ids.extend(seq.token_ids)
                    held_lps.extend(seq.logprobs or [])
                    held_text.append(seq.text)
                    if reason is None:
                        continue
                    finished.add(seq.index)
                    message, reason = _assistant_message(body, parsers, "".join(held_text), reason)
                    message.pop("role")
                    if "tool_calls" in message:
                        message = {"tool_calls": [{"index": k, **c} for k, c in enumerate(message["tool_calls"])]}
                    logprobs = chat_logprobs(held_ids, held_lps, body.num_top_logprobs, body.return_tokens_as_token_ids) if body.logprobs else None
                    yield chunk(seq.index, message, logprobs, reason, seq.stop_reason)
                    continue
                if parsed:  # reasoning and auto tool calls split out of the text; some held back
                    choice = choice_streams[seq.index]
                    delta = choice.feed(seq.text)
                    if reason is not None:
                        delta = _merge_deltas(delta, choice.finish())
                        reason = "tool_calls" if choice.called else reason
                else:
                    delta = {"content": seq.text} if seq.text or reason is None else {}
                if not any(delta.values()) and reason is None and (not body.logprobs or not seq.token_ids):
                    continue
                logprobs = chat_logprobs(seq.token_ids, seq.logprobs, body.num_top_logprobs, body.return_tokens_as_token_ids) if body.logprobs else None
                if reason is not None:
                    finished.add(seq.index)
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


def _merge_deltas(a: dict, b: dict) -> dict:
    out = dict(a)
    for key, value in b.items():
        out[key] = out[key] + value if key in out else value  # text joins, tool-call lists concatenate
    return out
