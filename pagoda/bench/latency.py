"""`pagoda bench latency`: one request at a time, its prefill speed and its decode speed.

For each prompt length a fresh random prompt (so no prefix-cache hit) is generated with EOS
ignored; every engine step is timestamped. Time to first token covers the prefill (plus sampling
the first token): prefill speed = prompt tokens / TTFT. Decode speed = (time of last token - time
of first token) / (tokens - 1). Medians over --runs. `--compare hf` times transformers' `generate`
the same way, through a streamer that timestamps each token as it is produced.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from pagoda.bench.common import BenchError, check_output_path, environment, format_table, invocation, parse_int_list, write_json
from pagoda.bench.throughput import HFRunner, PagodaRunner, _sync, model_info
from pagoda.bench.workloads import allowed_token_ids, special_token_ids, vocab_for


def _token_times_pagoda(runner: PagodaRunner, prompt_ids: list[int], output_len: int) -> tuple[float, list[float]]:
    """(start, time each output token became available) for one request run alone."""
    from pagoda.sampling_params import SamplingParams

    engine = runner.llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=runner.detokenize)
    _sync(runner.device)
    start = time.perf_counter()
    engine.add_request({"prompt_token_ids": prompt_ids}, params)
    times: list[float] = []
    seen = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            n = len(out.outputs[0].token_ids)
            now = time.perf_counter()
            times.extend([now] * (n - seen))  # a step may add several tokens (speculative decoding)
            seen = n
    runner.reset_prefix_cache()
    return start, times


class _TimingStreamer:
    """transformers calls put() with the prompt, then with each new token: timestamp the tokens."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        value.cpu()  # on a GPU this waits for the token, so the timestamp is when it exists
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _token_times_hf(runner: HFRunner, prompt_ids: list[int], output_len: int) -> tuple[float, list[float]]:
    import torch

    streamer = _TimingStreamer()
    ids = torch.tensor([prompt_ids], device=runner.device)
    _sync(runner.device)
    start = time.perf_counter()
    with torch.inference_mode():
        runner.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=output_len,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=runner.pad_id,
            streamer=streamer,
        )
    return start, streamer.times


def _measure(start: float, times: list[float], prompt_len: int, output_len: int, who: str) -> dict[str, float]:
    if len(times) != output_len:
        raise BenchError(f"{who}: produced {len(times)} tokens, asked for {output_len}")
    ttft = times[0] - start
    decode = (times[-1] - times[0]) / (output_len - 1)
    return {"ttft_ms": ttft * 1e3, "prefill_tokens_per_s": prompt_len / ttft, "decode_ms_per_token": decode * 1e3}


def _median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    med["decode_tokens_per_s"] = 1e3 / med["decode_ms_per_token"]
    return med


def run_latency(ns: argparse.Namespace, engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    from pagoda.engine.core import pick_device
    from pagoda.model.loader import resolve_dtype

    if ns.runs < 1:
        raise ValueError("--runs must be >= 1")
    if ns.output_len < 2:
        raise ValueError("--output-len must be >= 2 to time decoding")
    lens = parse_int_list(ns.input_lens)
    check_output_path(ns.json, "--json")
    info = model_info(ns.model)
    allowed = allowed_token_ids(vocab_for(info.tokenizer, info.config), special_token_ids(info.tokenizer, info.config))
    device = pick_device(ns.device)
    dtype = resolve_dtype(ns.dtype, device)
    dtype_name = str(dtype).removeprefix("torch.")
    engine_kwargs = {**engine_kwargs, "dtype": dtype_name}
    print(f"latency: model {info.name}, {dtype_name} on {device}, {ns.output_len} output tokens, median of {ns.runs}")

    pagoda = PagodaRunner(ns.model, engine_kwargs, detokenize=not ns.disable_detokenize)
    if max(lens) + ns.output_len > pagoda.max_model_len:
        raise BenchError(f"prompt {max(lens)} + {ns.output_len} output tokens exceed max_model_len {pagoda.max_model_len}")
    hf = HFRunner(info, dtype, device) if ns.compare else None
    rng = np.random.default_rng(ns.seed)
    warm = allowed[rng.integers(0, allowed.size, size=16)].tolist()
    _token_times_pagoda(pagoda, warm, 4)
    if hf is not None:
        _token_times_hf(hf, warm, 4)

    drafted0, accepted0 = pagoda.spec_counts()
    results = []
    for n in lens:
        p_runs, h_runs = [], []
        for _ in range(ns.runs):
            # A fresh prompt per run: a repeated one would be served from the prefix cache.
            prompt = allowed[rng.integers(0, allowed.size, size=n)].tolist()
            p_runs.append(_measure(*_token_times_pagoda(pagoda, prompt, ns.output_len), n, ns.output_len, "pagoda"))
            if hf is not None:
                h_runs.append(_measure(*_token_times_hf(hf, prompt, ns.output_len), n, ns.output_len, "transformers"))
        entry: dict[str, Any] = {"prompt_len": n, "output_len": ns.output_len, "pagoda": _median_of(p_runs), "pagoda_runs": p_runs}
        if h_runs:
            entry["hf"] = _median_of(h_runs)
            entry["hf_runs"] = h_runs
        results.append(entry)

    header = ["prompt", "TTFT ms", "prefill tok/s", "decode ms/tok", "decode tok/s"]
    if hf is not None:
        header += ["hf TTFT ms", "hf prefill tok/s", "hf decode ms/tok", "prefill x", "decode x"]
    rows = []
    for e in results:
        p = e["pagoda"]
        row: list[Any] = [e["prompt_len"], p["ttft_ms"], p["prefill_tokens_per_s"], p["decode_ms_per_token"], p["decode_tokens_per_s"]]
        if "hf" in e:
            h = e["hf"]
            row += [
                h["ttft_ms"],
                h["prefill_tokens_per_s"],
                h["decode_ms_per_token"],
                p["prefill_tokens_per_s"] / h["prefill_tokens_per_s"],
                h["decode_ms_per_token"] / p["decode_ms_per_token"],
            ]
        rows.append(row)
    print(format_table(header, rows))
    drafted, accepted = (a - b for a, b in zip(pagoda.spec_counts(), (drafted0, accepted0)))
    acceptance = accepted / drafted if drafted else None
    if acceptance is not None:
        print(f"speculative decoding: acceptance rate {100 * acceptance:.1f}% ({accepted:,} of {drafted:,} draft tokens)")
    record = {
        "benchmark": "latency",
        "argv": invocation("latency"),
        "args": {k: v for k, v in vars(ns).items() if k != "func"},
        "model": info.name,
        "dtype": dtype_name,
        "device": str(device),
        "engine_args": engine_kwargs,
        "results": results,
        "spec_decode_acceptance_rate": acceptance,
        "env": environment(),
    }
    if ns.json:
        write_json(ns.json, record)
        print(f"wrote {ns.json}")
    return record
