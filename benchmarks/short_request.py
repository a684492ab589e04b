"""One request at a time through an OpenAI-compatible server: time to first token, end to end, and
the decode rate of a single stream.

By default streams a completion of "Hello, my name is" (16 tokens, greedy) RUNS times after a
warm-up and prints the medians. `--prompt-tokens N` sends N random token ids instead (seeded, the
same ids for every server), which with `--max-tokens 256` is the single-stream workload. EOS is
ignored so every server generates the same count; the decode rate is (max_tokens - 1) / (end -
first token). Any server works (`pagoda serve`, vLLM's, llama.cpp's):

    python benchmarks/short_request.py --url http://127.0.0.1:8000 --model SmolLM2-135M-Instruct
    python benchmarks/short_request.py --prompt-tokens 128 --max-tokens 256 --runs 3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import httpx


def measure(url: str, model: str, runs: int, max_tokens: int, prompt: str | list[int] = "Hello, my name is"
            ) -> dict[str, float]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    ttfts, ends, rates = [], [], []
    for i in range(runs + 1):  # the first is a warm-up
        # A connection per request: some servers (llama.cpp's) close an idle keep-alive connection,
        # and a request sent on it fails. The connect costs well under a millisecond on loopback.
        with httpx.Client(timeout=600) as client:
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
                if max_tokens > 1:
                    rates.append((max_tokens - 1) / (end - first))
    return {"ttft_ms": statistics.median(ttfts), "e2e_ms": statistics.median(ends),
            "decode_tok_s": statistics.median(rates) if rates else None, "runs": runs,
            "prompt_tokens": len(prompt) if isinstance(prompt, list) else None, "max_tokens": max_tokens}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, help="send this many random token ids instead of the text")
    p.add_argument("--seed", type=int, default=0)
    ns = p.parse_args()
    prompt: str | list[int] = "Hello, my name is"
    if ns.prompt_tokens:
        rng = random.Random(ns.seed)
        prompt = [rng.randrange(100, 49000) for _ in range(ns.prompt_tokens)]
    print(json.dumps(measure(ns.url, ns.model, ns.runs, ns.max_tokens, prompt)))


if __name__ == "__main__":
    main()
