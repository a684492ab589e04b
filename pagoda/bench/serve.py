"""`pagoda bench serve`: a load generator for any OpenAI-compatible streaming server.

Requests go to `/v1/completions` with `stream=true`, `ignore_eos=true` and `max_tokens` = the output
length, at Poisson arrivals of a given rate (`inf`: all at once) and/or with a cap on requests in
flight. Each server-sent event is timestamped on arrival:

- TTFT, time to first token: from sending the request to the first token's event;
- ITL, inter-token latency: the gaps between consecutive token events, over all requests;
- TPOT, time per output token: per request, (E2E - TTFT) / (output tokens - 1);
- E2E: from sending to the last event.

Throughput divides by the span from the first send to the last completion. Goodput counts only
requests that met every SLO given (`--slo-ttft-ms`, `--slo-tpot-ms`, `--slo-e2e-ms`).
Output tokens are the server's `usage.completion_tokens` when it reports usage, else the number of
token events (exact for servers that send one token per event).

This module owns the workload, the client and the run; the records it fills are in `serve_types`,
the numbers over them in `serve_metrics`, the figure in `plot`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from typing import Any

from pagoda.bench.common import BenchError, check_output_path, environment, invocation, write_json
from pagoda.bench.serve_metrics import compute_metrics, print_report, timeline
from pagoda.bench.serve_types import Prompt, RequestResult, ServeConfig


# -- workload ------------------------------------------------------------------------------------
def make_prompts(cfg: ServeConfig, tokenizer: Any = None, vocab_size: int | None = None) -> list[Prompt]:
    """Random prompts, lengths uniform in [min, max], seeded; the same draw as `bench throughput`."""
    from pagoda.bench.workloads import allowed_token_ids, random_workload, special_token_ids, vocab_for

    if vocab_size is None:
        vocab_size = vocab_for(tokenizer, None)
    allowed = allowed_token_ids(vocab_size, special_token_ids(tokenizer, None))
    work = random_workload(cfg.num_prompts, cfg.input_len_min, cfg.input_len_max, cfg.output_len, allowed, cfg.seed)
    if cfg.prompt_format == "ids":
        return [Prompt(r.prompt_ids, len(r.prompt_ids)) for r in work.requests]
    if tokenizer is None:
        raise ValueError("--prompt-format text needs a tokenizer")
    prompts = []
    for r in work.requests:
        # Decoding random ids and encoding again does not round-trip exactly: count the re-encoding.
        text = tokenizer.decode(r.prompt_ids)
        prompts.append(Prompt(text, len(tokenizer.encode(text, add_special_tokens=False))))
    return prompts


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times in seconds from the start: a Poisson process of `rate` requests/s (exponential
    gaps), or all at 0 for an infinite rate."""
    import numpy as np

    if rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    # Its own stream: changing the rate must not change the prompts, which use `seed` directly.
    gaps = np.random.default_rng([seed, 1]).exponential(1.0 / rate, size=n)
    gaps[0] = 0.0  # the first request goes at once; the clock starts with it
    return np.cumsum(gaps).tolist()


# -- client --------------------------------------------------------------------------------------
_NOT_CONNECTED = "connection failed"  # a failed request's error when the server was not reached


def _base(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


async def discover_model(session: Any, base_url: str) -> str:
    try:
        async with session.get(f"{_base(base_url)}/v1/models") as resp:
            resp.raise_for_status()
            return (await resp.json(content_type=None))["data"][0]["id"]  # whatever its Content-Type
    except Exception as exc:
        raise BenchError(f"could not list models at {base_url}/v1/models ({exc!r}); pass --model") from None


def _payload(cfg: ServeConfig, model: str, prompt: list[int] | str, output_len: int) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
        **cfg.extra_body,
    }


async def stream_completion(session: Any, url: str, payload: dict[str, Any], result: RequestResult, t0: float) -> RequestResult:
    """Send one streaming request, timestamping each token event; never raises."""
    import aiohttp
    import msgspec

    decode = msgspec.json.decode
    clock = time.perf_counter
    result.send_time = clock() - t0
    events = 0
    try:
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                body = (await resp.read()).decode(errors="replace")
                result.error = f"HTTP {resp.status}: {body[:200]}"
                return result
            async for raw in resp.content:  # one line at a time
                if not raw.startswith(b"data:"):
                    continue  # blank separators, SSE comments, event: lines
                data = raw[5:].strip()
                if data == b"[DONE]":
                    break
                now = clock() - t0
                chunk = decode(data)
                if "error" in chunk:
                    result.error = f"server error: {json.dumps(chunk['error'])[:200]}"
                    return result
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    result.output_tokens = int(usage["completion_tokens"])
                    result.usage_reported = True
                    if usage.get("prompt_tokens") is not None:
                        result.prompt_len = int(usage["prompt_tokens"])
                for choice in chunk.get("choices") or []:
                    # A token event carries text, or is any chunk before the finish; a last chunk
                    # with no text and a finish_reason only says "done" (llama.cpp, others),
                    # unless nothing came before it: then it is when the output arrived.
                    if choice.get("text") or choice.get("finish_reason") is None or not events:
                        result.token_times.append(now)
                        events += 1
        if not result.usage_reported:
            result.output_tokens = events
        if not result.token_times:
            result.error = "no tokens in the stream"
            return result
        result.success = True
    except aiohttp.ClientConnectorError as exc:  # not reached (a starting server, a wrong port)
        result.error = f"{_NOT_CONNECTED}: {exc}"
    except Exception as exc:  # a benchmark reports failures, it does not stop at the first
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        # Every request, failed or not, has an end: the duration and in-flight counts need it.
        result.end_time = clock() - t0
    return result


async def run_load(cfg: ServeConfig, prompts: list[Prompt]) -> tuple[list[RequestResult], float, str]:
    """Send every prompt on its schedule; returns the results, the benchmark's duration and the
    model name used."""
    import aiohttp

    url = _base(cfg.base_url) + cfg.endpoint
    # aiohttp caps a session at 100 connections by default, which would silently cap concurrency.
    # The client shares the machine with the server it measures: aiohttp's C parser takes a
    # fraction of the CPU a pure-Python client spends on each event.
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
    # Lines of up to 2 MiB (twice the read buffer): one event with logprobs may be long, and
    # aiohttp's default buffer (64 KiB: lines to 128 KiB) refuses such a line.
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, read_bufsize=1 << 20) as session:
        model = cfg.model or await discover_model(session, cfg.base_url)
        deadline = time.monotonic() + cfg.ready_timeout_s
        for i in range(cfg.num_warmups):
            # Not measured: a cold server may compile or allocate on its first request. A server
            # still loading its model may answer 503 (or not yet accept): wait for it.
            while True:
                warm = RequestResult(-1, 0, 4)
                payload = _payload(cfg, model, prompts[i % len(prompts)].prompt, 4)
                await stream_completion(session, url, payload, warm, time.perf_counter())
                if warm.success:
                    break
                starting = (warm.error or "").startswith(("HTTP 503", _NOT_CONNECTED))
                if not starting or time.monotonic() > deadline:
                    raise BenchError(f"warm-up request to {url} failed: {warm.error}")
                await asyncio.sleep(0.5)
        offsets = arrival_offsets(len(prompts), cfg.request_rate, cfg.seed)
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        t0 = time.perf_counter()

        async def one(i: int, p: Prompt) -> RequestResult:
            delay = offsets[i] - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            result = RequestResult(i, p.prompt_len, cfg.output_len)
            payload = _payload(cfg, model, p.prompt, cfg.output_len)
            if sem is None:
                return await stream_completion(session, url, payload, result, t0)
            async with sem:
                return await stream_completion(session, url, payload, result, t0)

        results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        duration = max((r.end_time for r in results), default=0.0) - min((r.send_time for r in results), default=0.0)
    return list(results), duration, model


def config_from_args(ns: argparse.Namespace) -> ServeConfig:
    try:
        extra = json.loads(ns.extra_body) if ns.extra_body else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"--extra-body is not valid JSON: {exc}") from None
    if not isinstance(extra, dict):
        raise ValueError("--extra-body must be a JSON object")
    if ns.vocab_size is not None and ns.vocab_size < 1:
        raise ValueError("--vocab-size must be >= 1")
    if ns.num_warmups < 0:
        raise ValueError("--num-warmups must be >= 0")
    if ns.request_timeout is not None and not ns.request_timeout > 0:
        raise ValueError("--request-timeout must be > 0")
    if not ns.ready_timeout >= 0:
        raise ValueError("--ready-timeout must be >= 0")
    for flag in ("slo_ttft_ms", "slo_tpot_ms", "slo_e2e_ms"):
        value = getattr(ns, flag)
        if value is not None and not value > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0")
    check_output_path(ns.json, "--json")
    check_output_path(ns.plot, "--plot")
    if ns.plot:
        from pagoda.bench.plot import check_plotting_available

        check_plotting_available()  # before the run, not after it
    if ns.max_concurrency is not None and ns.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if ns.output_len < 1 or ns.num_prompts < 1:
        raise ValueError("--output-len and --num-prompts must be >= 1")
    return ServeConfig(
        base_url=ns.base_url,
        model=ns.model,
        endpoint=ns.endpoint,
        num_prompts=ns.num_prompts,
        request_rate=ns.request_rate,
        max_concurrency=ns.max_concurrency,
        input_len_min=ns.input_len_min,
        input_len_max=ns.input_len_max,
        output_len=ns.output_len,
        seed=ns.seed,
        prompt_format=ns.prompt_format,
        slo_ttft_ms=ns.slo_ttft_ms,
        slo_tpot_ms=ns.slo_tpot_ms,
        slo_e2e_ms=ns.slo_e2e_ms,
        num_warmups=ns.num_warmups,
        extra_body=extra,
        timeout_s=ns.request_timeout,
        ready_timeout_s=ns.ready_timeout,
    )


def load_tokenizer_for(name: str | None) -> Any:
    from pagoda.model.loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(name))


def run_serve(ns: argparse.Namespace) -> dict[str, Any]:
    cfg = config_from_args(ns)
    # Token ids need only the vocabulary; text prompts need the tokenizer itself.
    tokenizer = None if (ns.vocab_size and cfg.prompt_format == "ids") else load_tokenizer_for(ns.tokenizer)
    prompts = make_prompts(cfg, tokenizer, ns.vocab_size)
    results, duration, model = asyncio.run(run_load(cfg, prompts))
    metrics = compute_metrics(results, duration, cfg)
    print_report(metrics, cfg, model)
    record = {
        "benchmark": "serve",
        "argv": invocation("serve"),
        "args": {k: v for k, v in vars(ns).items() if k != "func"},
        "model": model,
        "config": {**cfg.__dict__, "request_rate": None if math.isinf(cfg.request_rate) else cfg.request_rate},
        "metrics": metrics,
        "timeline": timeline(results, duration),
        "requests": [
            {
                "prompt_len": r.prompt_len,
                "output_tokens": r.output_tokens,
                "send_time_s": r.send_time,
                "ttft_ms": None if r.ttft is None else r.ttft * 1e3,
                "tpot_ms": None if r.tpot is None else r.tpot * 1e3,
                "e2e_ms": r.e2e * 1e3,
                "success": r.success,
                "error": r.error,
            }
            for r in results
        ],
        "env": environment(),
    }
    if ns.json:
        write_json(ns.json, record)
        print(f"wrote {ns.json}")
    if ns.plot:
        from pagoda.bench.plot import plot_serve

        plot_serve(results, metrics, record["timeline"], cfg, model, ns.plot)
        print(f"wrote {ns.plot}")
    return record
