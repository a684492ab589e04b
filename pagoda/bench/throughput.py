"""`pagoda bench throughput`: a workload through `LLM.generate`, optionally also through transformers.

Both engines get the same token ids and are asked for the same number of new tokens with EOS
ignored, so the same work is done; token counts are checked, not assumed. With `--runs K` each
engine runs the workload K times, interleaved (Pagoda, transformers, Pagoda, ...) so that slow
drift of a noisy machine hits both alike, and the run with the median elapsed time is reported.

transformers runs static batches in arrival order with left padding (how `generate` batches), on
each of the given batch sizes in the first run; later runs use the fastest of them. The prefix
cache is reset between Pagoda runs so a run never reuses blocks computed by the previous one.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass
from typing import Any

from pagoda.bench.common import (
    BenchError,
    check_output_path,
    environment,
    format_table,
    invocation,
    median_index,
    parse_int_list,
    peak_rss_mib,
    write_json,
)
from pagoda.bench.workloads import (
    BenchRequest,
    Workload,
    allowed_token_ids,
    jsonl_workload,
    prefix_workload,
    random_workload,
    special_token_ids,
    vocab_for,
)


@dataclass
class RunStats:
    elapsed_s: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    cached_prompt_tokens: int = 0  # prefix-cache hits (Pagoda only)
    # Speculative decoding (Pagoda only): draft tokens verified and accepted during the run.
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "requests_per_s": self.requests_per_s,
            "output_tokens_per_s": self.output_tokens_per_s,
            "total_tokens_per_s": self.total_tokens_per_s,
            "acceptance_rate": self.acceptance_rate,
        }


@dataclass
class ModelInfo:
    """What a workload needs to know about a model, without loading its weights."""

    name: str
    source: Any  # pagoda.model.loader.ModelSource
    config: Any
    tokenizer: Any


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def model_info(model: str | None) -> ModelInfo:
    from pagoda.model.loader import load_config, load_tokenizer, resolve_model

    source = resolve_model(model)
    tokenizer = None
    # Without tokenizer files transformers may still build an empty tokenizer (Qwen folders do),
    # which would leave no ids to draw from: such a model is driven by token ids alone.
    if source.is_gguf or any((source.path / f).exists() for f in _TOKENIZER_FILES):
        tokenizer = load_tokenizer(source)
    return ModelInfo(source.name, source, load_config(source), tokenizer)


def build_workload(ns: argparse.Namespace, info: ModelInfo) -> Workload:
    """The workload named by --workload: 'random', 'prefix' or a .jsonl file."""
    if ns.workload in ("random", "prefix"):
        allowed = allowed_token_ids(vocab_for(info.tokenizer, info.config), special_token_ids(info.tokenizer, info.config))
        n = 64 if ns.num_prompts is None else ns.num_prompts
        if ns.workload == "random":
            return random_workload(n, ns.input_len_min, ns.input_len_max, ns.output_len, allowed, ns.seed)
        return prefix_workload(n, ns.prefix_len, ns.suffix_len, ns.output_len, allowed, ns.seed)
    return jsonl_workload(ns.workload, info.tokenizer, ns.output_len, ns.num_prompts)


def _sync(device: Any) -> None:
    import torch

    if getattr(device, "type", None) == "cuda":
        torch.cuda.synchronize(device)


class PagodaRunner:
    """Pagoda's `LLM` built once; each run is one `generate` call over the whole workload."""

    def __init__(self, model: str | None, engine_kwargs: dict[str, Any], detokenize: bool = True) -> None:
        from pagoda.engine.llm import LLM

        t0 = time.perf_counter()
        self.llm = LLM(model, **engine_kwargs)
        self.startup_s = time.perf_counter() - t0
        self.detokenize = detokenize
        self.max_model_len: int = self.llm.engine.max_model_len
        self.device = self.llm.engine.core.device

    def check_fits(self, workload: Workload) -> None:
        worst = max(len(r.prompt_ids) + r.output_len for r in workload.requests)
        if worst > self.max_model_len:
            raise BenchError(
                f"a request needs {worst} tokens (prompt + output) but the engine's max_model_len is "
                f"{self.max_model_len}; shorten the workload or raise --max-model-len"
            )

    def reset_prefix_cache(self) -> None:
        # Without it a repeated run would find the previous run's prompts cached.
        if not self.llm.reset_prefix_cache():
            raise BenchError("could not reset the prefix cache between runs (blocks still in use)")

    def _generate(self, requests: list[BenchRequest]) -> list[Any]:
        from pagoda.sampling_params import SamplingParams

        prompts = [{"prompt_token_ids": r.prompt_ids} for r in requests]
        params = [
            SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True, detokenize=self.detokenize)
            for r in requests
        ]
        return self.llm.generate(prompts, params, use_tqdm=False)

    def warmup(self, workload: Workload) -> None:
        """A short batch first: the first forward passes pay one-off costs (allocations, kernels)."""
        reqs = [BenchRequest(r.prompt_ids[:16], min(4, r.output_len)) for r in workload.requests[:2]]
        self._generate(reqs)
        self.reset_prefix_cache()

    def spec_counts(self) -> tuple[int, int]:
        """(draft tokens verified, accepted) since the engine started."""
        s = self.llm.engine.core.stats()
        return s.spec_num_draft_tokens, s.spec_num_accepted_tokens

    def run(self, workload: Workload) -> tuple[RunStats, list[list[int]]]:
        drafted0, accepted0 = self.spec_counts()
        _sync(self.device)
        t0 = time.perf_counter()
        outs = self._generate(workload.requests)
        elapsed = time.perf_counter() - t0
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        for i, (req, out, toks) in enumerate(zip(workload.requests, outs, tokens)):
            # Every request must do exactly the asked work, or tokens/s would be meaningless.
            if len(toks) != req.output_len:
                raise BenchError(f"pagoda: request {i} produced {len(toks)} tokens, asked for {req.output_len}")
            if len(out.prompt_token_ids) != len(req.prompt_ids):
                raise BenchError(f"pagoda: request {i} has {len(out.prompt_token_ids)} prompt tokens, sent {len(req.prompt_ids)}")
        cached = sum(int(getattr(o, "num_cached_tokens", 0) or 0) for o in outs)
        drafted, accepted = self.spec_counts()
        stats = RunStats(elapsed, len(outs), workload.num_prompt_tokens, sum(map(len, tokens)), cached,
                         drafted - drafted0, accepted - accepted0)
        self.reset_prefix_cache()
        return stats, tokens


def load_hf_model(source: Any, dtype: Any, device: Any) -> Any:
    """The same weights through transformers (GGUF files are dequantised by transformers itself)."""
    import transformers
    from transformers import AutoModelForCausalLM

    # generate() warns on every call about sampling flags in generation_config: noise here.
    transformers.logging.set_verbosity_error()
    if source.is_gguf:
        model = AutoModelForCausalLM.from_pretrained(str(source.path.parent), gguf_file=source.path.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(source.path), dtype=dtype)
    return model.to(device).eval()


def hf_pad_id(tokenizer: Any, config: Any) -> int:
    for value in (
        getattr(tokenizer, "pad_token_id", None),
        getattr(config, "pad_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
        getattr(config, "eos_token_id", None),
    ):
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0  # masked out by the attention mask anyway


class HFRunner:
    """transformers' `generate`: static batches in arrival order, left padding, greedy, EOS ignored."""

    def __init__(self, info: ModelInfo, dtype: Any, device: Any) -> None:
        t0 = time.perf_counter()
        self.model = load_hf_model(info.source, dtype, device)
        self.startup_s = time.perf_counter() - t0
        self.device = device
        self.pad_id = hf_pad_id(info.tokenizer, info.config)

    def _batch(self, requests: list[BenchRequest]) -> list[list[int]]:
        import torch

        width = max(len(r.prompt_ids) for r in requests)
        new = max(r.output_len for r in requests)
        ids = torch.full((len(requests), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(requests), width), dtype=torch.long)
        for i, r in enumerate(requests):
            ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[i, width - len(r.prompt_ids) :] = 1
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                max_new_tokens=new,
                do_sample=False,
                eos_token_id=None,  # like ignore_eos: EOS may come out but does not stop a row
                pad_token_id=self.pad_id,
            )
        gen = out[:, width:].tolist()
        if any(len(g) != new for g in gen):
            raise BenchError(f"transformers: a batch produced {len(gen[0])} tokens per row, asked for {new}")
        # A batch runs to its longest request; only the tokens each request asked for count.
        return [g[: r.output_len] for g, r in zip(gen, requests)]

    def warmup(self, workload: Workload) -> None:
        self._batch([BenchRequest(r.prompt_ids[:16], min(4, r.output_len)) for r in workload.requests[:2]])

    def run(self, workload: Workload, batch_size: int) -> tuple[RunStats, list[list[int]]]:
        reqs = workload.requests
        _sync(self.device)
        t0 = time.perf_counter()
        tokens: list[list[int]] = []
        for start in range(0, len(reqs), batch_size):
            tokens.extend(self._batch(reqs[start : start + batch_size]))
        elapsed = time.perf_counter() - t0
        return RunStats(elapsed, len(reqs), workload.num_prompt_tokens, sum(map(len, tokens))), tokens


def _row(label: str, s: RunStats) -> list[Any]:
    return [label, s.requests_per_s, s.output_tokens_per_s, s.total_tokens_per_s, s.elapsed_s]


def run_throughput(ns: argparse.Namespace, engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Run the benchmark described by the parsed flags; print a table and return the JSON record."""
    from pagoda.engine.core import pick_device
    from pagoda.model.loader import resolve_dtype

    if ns.runs < 1:
        raise ValueError("--runs must be >= 1")
    check_output_path(ns.json, "--json")
    hf_batch_sizes = parse_int_list(ns.hf_batch_sizes) if ns.compare else []
    info = model_info(ns.model)
    workload = build_workload(ns, info)
    device = pick_device(ns.device)
    dtype = resolve_dtype(ns.dtype, device)
    dtype_name = str(dtype).removeprefix("torch.")
    engine_kwargs = {**engine_kwargs, "dtype": dtype_name}
    desc = workload.describe()
    print(
        f"workload {workload.name}: {desc['num_requests']} requests, {desc['prompt_tokens']:,} prompt + "
        f"{desc['output_tokens']:,} output tokens; model {info.name}, {dtype_name} on {device}"
    )

    pagoda = PagodaRunner(ns.model, engine_kwargs, detokenize=not ns.disable_detokenize)
    pagoda.check_fits(workload)
    pagoda.warmup(workload)
    hf: HFRunner | None = None
    sizes = sorted({min(b, workload.num_requests) for b in hf_batch_sizes})

    pagoda_runs: list[RunStats] = []
    hf_runs: list[RunStats] = []
    hf_first: dict[int, RunStats] = {}
    hf_agree: dict[int, int] = {}
    best_bs: int | None = None
    rss_pagoda = None
    for k in range(ns.runs):
        stats, pagoda_tokens = pagoda.run(workload)
        pagoda_runs.append(stats)
        print(f"run {k + 1}/{ns.runs} pagoda: {stats.total_tokens_per_s:,.1f} total tok/s ({stats.elapsed_s:.2f} s)")
        if rss_pagoda is None:
            rss_pagoda = peak_rss_mib()  # before transformers loads, so it is Pagoda's alone
        if not ns.compare:
            continue
        if hf is None:
            hf = HFRunner(info, dtype, device)
            hf.warmup(workload)
        for bs in sizes if k == 0 else [best_bs]:
            hs, hf_tokens = hf.run(workload, bs)
            print(f"run {k + 1}/{ns.runs} transformers bs={bs}: {hs.total_tokens_per_s:,.1f} total tok/s ({hs.elapsed_s:.2f} s)")
            if k == 0:
                hf_first[bs] = hs
                # Same weights, same greedy decoding: a sanity check that the work is the same.
                hf_agree[bs] = sum(a == b for a, b in zip(hf_tokens, pagoda_tokens))
        if k == 0:
            best_bs = min(hf_first, key=lambda b: hf_first[b].elapsed_s)
            hf_runs.append(hf_first[best_bs])
        else:
            hf_runs.append(hs)

    p_med = pagoda_runs[median_index([s.elapsed_s for s in pagoda_runs])]
    record: dict[str, Any] = {
        "benchmark": "throughput",
        "argv": invocation("throughput"),
        "args": {k: v for k, v in vars(ns).items() if k != "func"},
        "model": info.name,
        "dtype": dtype_name,
        "device": str(device),
        "engine_args": engine_kwargs,
        "workload": desc,
        "runs": ns.runs,
        "pagoda": {
            "startup_s": pagoda.startup_s,
            "peak_rss_mib": rss_pagoda,
            "runs": [s.to_dict() for s in pagoda_runs],
            "median": p_med.to_dict(),
        },
        "env": environment(),
    }
    rows = [_row("pagoda", p_med)]
    if hf is not None:
        h_med = hf_runs[median_index([s.elapsed_s for s in hf_runs])]
        record["hf"] = {
            "startup_s": hf.startup_s,
            "batch_sizes": sizes,
            "first_run_by_batch_size": {str(b): s.to_dict() for b, s in hf_first.items()},
            "outputs_identical_to_pagoda": {str(b): n for b, n in hf_agree.items()},
            "best_batch_size": best_bs,
            "runs": [s.to_dict() for s in hf_runs],
            "median": h_med.to_dict(),
        }
        record["ratio"] = {
            "total_tokens_per_s": p_med.total_tokens_per_s / h_med.total_tokens_per_s,
            "output_tokens_per_s": p_med.output_tokens_per_s / h_med.output_tokens_per_s,
        }
        rows.append(_row(f"transformers bs={best_bs}", h_med))
    print()
    print(format_table(["engine", "requests/s", "output tok/s", "total tok/s", "elapsed s"], rows))
    if "ratio" in record:
        print(
            f"pagoda / transformers: {record['ratio']['total_tokens_per_s']:.2f}x total tokens/s "
            f"(median of {ns.runs} run{'s' if ns.runs > 1 else ''}; transformers at its fastest batch size)"
        )
    if p_med.acceptance_rate is not None:
        print(f"speculative decoding: acceptance rate {100 * p_med.acceptance_rate:.1f}% "
              f"({p_med.accepted_draft_tokens:,} of {p_med.draft_tokens:,} draft tokens)")
    if p_med.cached_prompt_tokens:
        print(f"prefix cache: {p_med.cached_prompt_tokens:,} of {p_med.prompt_tokens:,} prompt tokens reused")
    if ns.json:
        write_json(ns.json, record)
        print(f"wrote {ns.json}")
    return record
