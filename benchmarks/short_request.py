"""A short request through an OpenAI-compatible server: time to first token and end to end.

Streams one completion of "Hello, my name is" (16 tokens, greedy) RUNS times after a warm-up and
prints the medians. Any server works (`pagoda serve`, vLLM's, llama.cpp's):

    python benchmarks/short_request.py --url http://127.0.0.1:8000 --model SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import httpx


def measure(url: str, model: str, runs: int, max_tokens: int) -> dict[str, float]:
    body = {"model": model, "prompt": "Hello, my name is", "max_tokens": max_tokens, "temperature": 0,
            "stream": True}
    ttfts, ends = [], []
    with httpx.Client(timeout=60) as client:
        for i in range(runs + 1):  # the first is a warm-up
            start = time.perf_counter()
            first = None
            with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if first is None and line.startswith("data: ") and line != "data: [DONE]":
                        first = time.perf_counter()
            end = time.perf_counter()
            if first is None:
                raise RuntimeError("the stream carried no data event")
            if i:
                ttfts.append((first - start) * 1e3)
                ends.append((end - start) * 1e3)
    return {"ttft_ms": statistics.median(ttfts), "e2e_ms": statistics.median(ends), "runs": runs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=16)
    ns = p.parse_args()
    print(json.dumps(measure(ns.url, ns.model, ns.runs, ns.max_tokens)))


if __name__ == "__main__":
    main()
