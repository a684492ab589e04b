"""A tiny OpenAI-compatible streaming server for testing `pagoda bench serve` without an engine.

/v1/completions streams exactly `max_tokens` chunks, one token each, after `ttft_s` and then every
`itl_s`, followed by a usage chunk and [DONE]. A prompt whose first token id is `fail_token` gets an
HTTP 500; the first `unavailable_for` requests get a 503 (still starting). Every request body is recorded.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


@dataclass
class FakeServer:
    ttft_s: float = 0.02
    itl_s: float = 0.002
    fail_token: int | None = None
    send_usage: bool = True
    unavailable_for: int = 0  # answer this many completions with 503 first (a server still loading)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    url: str = ""

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            self.bodies.append(body)
            if self.unavailable_for > 0:
                self.unavailable_for -= 1
                return JSONResponse({"error": {"message": "the model is still loading"}}, status_code=503)
            prompt = body["prompt"]
            if self.fail_token is not None and isinstance(prompt, list) and prompt and prompt[0] == self.fail_token:
                return JSONResponse({"error": {"message": "boom"}}, status_code=500)
            n = int(body["max_tokens"])
            n_prompt = len(prompt) if isinstance(prompt, list) else len(prompt.split())

            async def events():
                await asyncio.sleep(self.ttft_s)
                for i in range(n):
                    if i:
                        await asyncio.sleep(self.itl_s)
                    chunk = {
                        "id": "cmpl-1",
                        "object": "text_completion",
                        "created": int(time.time()),
                        "model": body["model"],
                        "choices": [{"index": 0, "text": f" t{i}", "finish_reason": "length" if i == n - 1 else None}],
                    }
                    yield f"data: {json.dumps(chunk)}\n\n"
                if self.send_usage:
                    usage = {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n}
                    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        return app

    def start(self) -> "FakeServer":
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(self.app(), log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
