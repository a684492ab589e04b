"""How generation responses go out: server-sent events that always close their engine streams
(`SSEResponse`), several request streams merged as they come (`merge_streams`, `collect`), a whole
response raced against the client's disconnect (`run_cancellable`), and a stream's last usage event.

Cancellation: a streaming response is cancelled by Starlette when the client disconnects; a whole
response is raced against the client's disconnect here. Either way the engine streams are closed,
which aborts their requests in the core at once.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, AsyncIterator, Awaitable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from pagoda.engine.request_stream import RequestStream, merge_delta
from pagoda.outputs import RequestOutput
from pagoda.serve.admission import Prepared, engine_error
from pagoda.serve.openai_format import sse, usage

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


async def peek_weight_version(streams: list[RequestStream]) -> str | None:
    """The weight version of the first stream's first output, for a streamed response's header
    (sent before its body). An error before that output is raised as the response's HTTP error."""
    try:
        return (await streams[0].peek()).weight_version
    except Exception as exc:
        for s in streams:
            s.close()
        raise engine_error(exc) from None


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
