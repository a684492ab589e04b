"""Typed engine configuration, with vLLM's argument names and defaults where they exist.

`EngineArgs` is the one home of every engine setting's name, default and help text: the command
line (pagoda/entrypoints/engine_args.py) generates its flags from these fields, `--name-with-dashes`
for `name`, with the help and choices given in each field's metadata. A field whose metadata says
`"cli": "subcommand"` is declared by each subcommand itself (`model` is positional for `serve`;
`--served-model-name` takes several names); `"short"` adds vLLM's short alias (`-tp`, `-pp`).
"""

from __future__ import annotations

import json
import re
import typing
from dataclasses import dataclass, field, fields


KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "int8", "fp8", "fp8_e4m3")
# `--quantization`: weights kept quantized in memory (pagoda/model/quant_loader.py).
QUANTIZATION_METHODS = ("gguf", "int8", "fp8")
# The names `--dtype` takes (vLLM's) and the short ones the loader also accepts.
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
_DTYPE_ALIASES = ("fp16", "bf16", "fp32")
SCHEDULING_POLICIES = ("fcfs", "priority")
EXECUTOR_BACKENDS = ("uni", "mp", "ray")
KV_OFFLOADING_BACKENDS = ("cpu", "disk")
PREEMPTION_MODES = ("recompute", "swap")

SPECULATIVE_METHODS = ("ngram", "draft_model")
# Above this many requests in a step a CPU forward of B * (k + 1) tokens costs more than the drafts
# save at ordinary acceptance rates: with k = 4, a batch of 4 costs 2.0x a plain decode step, a batch
# of 8 2.7x, of 32 3.9x (docs/perf-notes.md, benchmarks/forward_cost.py).
DEFAULT_DISABLE_BY_BATCH_SIZE = 4


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, vLLM's `--speculative-config` keys: `method` proposes up to
    `num_speculative_tokens` draft tokens per request and step, which one target forward verifies.

    ngram (prompt lookup): the longest suffix of the context, between `prompt_lookup_min` and
    `prompt_lookup_max` tokens, found earlier in the request proposes the tokens that followed it
    (both default to 5, vLLM's choice, when neither is given). draft_model: `model`, a smaller model
    with the target's tokenizer. `disable_by_batch_size`: a step with more requests than this
    proposes nothing (speculation costs more than it saves at large batches); default
    DEFAULT_DISABLE_BY_BATCH_SIZE, measured on CPU; null (None): never off.
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    disable_by_batch_size: int | None = None

    @classmethod
    def parse(cls, value: "str | dict | SpeculativeConfig") -> "SpeculativeConfig":
        """From JSON text, a dict or a config; raises ValueError with one line saying what is wrong."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        method = value.get("method")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: method must be one of {', '.join(SPECULATIVE_METHODS)}; got {method!r}")
        k = value.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer >= 1, got {k!r}")
        for key in ("prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            v = value.get(key)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"speculative_config: {key} must be an integer >= 1, got {v!r}")
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if method == "ngram":
            if lo is None and hi is None:
                lo = hi = 5
            lo = hi if lo is None else lo
            hi = lo if hi is None else hi
            if lo > hi:
                raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) exceeds prompt_lookup_max ({hi})")
        model = value.get("model")
        if method == "draft_model" and not isinstance(model, str):
            raise ValueError("speculative_config: method draft_model needs \"model\", the draft model's path")
        gate = value.get("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE)
        return cls(method, k, model, lo, hi, gate)


_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgtKMGT]?)(?:i?[bB])?\s*")
# vLLM's human-readable sizes: lower-case suffixes are powers of 1000, upper-case ones of 1024 ("4G" = 4 GiB).
_SIZE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
               "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(value: "str | int") -> int:
    """Bytes from an integer or vLLM's size text: "4G" (GiB), "512M" (MiB), "1.5g" (10^9), "4096"."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = _SIZE.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError(f"not a size: {value!r} (give bytes, or a number with K, M, G or T, e.g. 4G)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2)])


def _arg(default: object, help: str, **meta: object) -> object:
    """A field with its command-line help (and choices, or "cli": "subcommand") in its metadata."""
    return field(default=default, metadata={"help": help, **meta})


@dataclass
class EngineArgs:
    model: str | None = _arg(
        None, "HF folder, .gguf file, a Hugging Face id in the local HF cache, or SmolLM2-135M-Instruct (default)",
        cli="subcommand",
    )
    revision: str | None = _arg(None, "the model's branch, tag or commit in the local HF cache; default: main")
    tokenizer: str | None = _arg(None, "tokenizer folder or Hugging Face id; default: the model's")
    generation_config: str = _arg(
        "auto",
        "sampling defaults: auto: the model's generation_config.json; vllm: none (vLLM's own); "
        "or a folder holding a generation_config.json",
    )
    dtype: str = _arg("auto", "model weights and activations dtype; auto: the model's", choices=DTYPES)
    kv_cache_dtype: str = _arg(
        "auto",
        "KV cache dtype; auto: the model's. bfloat16/float16 store an fp32 model's K/V in half the memory "
        "(CPU only; float16 keeps more precision, bfloat16 fp32's range); int8 in half a 16-bit cache's, "
        "with a scale per block and KV head (CPU only); fp8 (= fp8_e4m3) in half a 16-bit cache's, e4m3 "
        "with a scale per layer (a CUDA GPU)",
        choices=KV_CACHE_DTYPES,
    )
    device: str = _arg("auto", "auto, cpu, cuda or cuda:N; auto: cuda when available, else cpu")
    seed: int = _arg(0, "random seed for sampling")
    max_model_len: int | None = _arg(None, "longest prompt + output in tokens; default: the model's context, capped at 8192")
    max_num_seqs: int = _arg(256, "the most requests in one batch")
    max_num_batched_tokens: int = _arg(2048, "the most tokens one engine step processes")
    block_size: int = _arg(16, "tokens per KV cache block (a power of two)")
    enable_prefix_caching: bool = _arg(True, "reuse the KV cache of prompts' shared prefixes")
    enable_chunked_prefill: bool = _arg(True, "split long prompts' prefill over several steps")
    long_prefill_token_threshold: int = _arg(0, "per-request cap on prefill tokens per step (chunked prefill); 0: none")
    scheduling_policy: str = _arg(
        "fcfs", "fcfs: first come, first served; priority: by the request's priority", choices=SCHEDULING_POLICIES
    )
    kv_cache_memory: int | None = _arg(
        None,
        "bytes for the KV cache (4G, 512M, or a number); default: on CUDA what the profile leaves, on the CPU VLLM_CPU_KVCACHE_SPACE "
        "(GiB) or up to 2 GiB, less for short models or small machines",
        aliases=("--kv-cache-memory-bytes",), cli="size",
    )
    num_gpu_blocks_override: int | None = _arg(None, "exact number of KV blocks (wins over memory sizing)")
    gpu_memory_utilization: float = _arg(0.9, "fraction of GPU memory the engine may use (KV cache sizing)")
    enforce_eager: bool = _arg(False, "never capture CUDA graphs")
    served_model_name: str | None = _arg(None, "the name clients use for the model", cli="subcommand")
    tensor_parallel_size: int = _arg(1, "ranks each layer is split over (tensor parallelism)", short="-tp")
    pipeline_parallel_size: int = _arg(1, "stages the layers are split into (pipeline parallelism)", short="-pp")
    enable_expert_parallel: bool = _arg(
        False, "mixture-of-experts layers under tensor parallelism: each rank holds whole experts (E / tp of "
        "them) instead of a slice of every expert",
    )
    data_parallel_size: int = _arg(
        1, "engine replicas, each its own process with its own KV cache (and TP/PP ranks), behind one server",
        short="-dp",
    )
    distributed_executor_backend: str | None = _arg(
        None, "how the ranks run: uni (this process, one rank), mp (a worker process per rank on this machine) "
        "or ray; default: uni for one rank, else mp", choices=EXECUTOR_BACKENDS,
    )
    max_logprobs: int = _arg(20, "the most logprobs (and prompt logprobs) a request may ask for; -1: the vocabulary")
    # JSON on the command line, a dict (or SpeculativeConfig) from Python; a SpeculativeConfig after __post_init__.
    speculative_config: SpeculativeConfig | dict | str | None = _arg(
        None,
        'speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
        "(keys: method ngram|draft_model, num_speculative_tokens, model, prompt_lookup_min, prompt_lookup_max, "
        "disable_by_batch_size); default: off",
        cli="json",
    )
    kv_offloading_size: float | None = _arg(
        None, "GiB of a second KV tier below the KV cache: evicted prefix blocks are copied there and "
        "loaded back instead of recomputed; default: none")
    kv_offloading_backend: str = _arg(
        "cpu", "the second KV tier: cpu (host memory) or disk (files in --kv-offloading-dir, kept across "
        "restarts for the same weights and cache settings)", choices=KV_OFFLOADING_BACKENDS)
    kv_offloading_dir: str | None = _arg(None, "folder of the disk tier; default: $XDG_CACHE_HOME/pagoda/kv "
                                         "(~/.cache/pagoda/kv)")
    preemption_mode: str = _arg(
        "recompute", "recompute: a preempted request's KV is computed again on resume; swap: its blocks go to "
        "the second KV tier (--kv-offloading-size) and come back", choices=PREEMPTION_MODES)
    weight_version: str = _arg("default", "the version name of the weights loaded at start (POST /update_weights names later ones)")
    quantization: str | None = _arg(
        None,
        "keep the weights quantized in memory: gguf (a .gguf file's Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K blocks as they "
        "are: about the file's size, fastest single streams), int8 (any model's linears, per-channel scales), "
        "fp8 (a CUDA GPU: e4m3 linears, per-channel scales, torch._scaled_mm); default: none (a GGUF is dequantized to --dtype: best batch throughput)",
        choices=QUANTIZATION_METHODS,
    )

    def __post_init__(self) -> None:
        if isinstance(self.kv_cache_memory, str):
            self.kv_cache_memory = parse_size(self.kv_cache_memory)
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(f"generation_config must be auto, vllm or a folder, got {self.generation_config!r}")
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.seed is None:
            raise ValueError("seed must be an integer, got None")
        if isinstance(self.dtype, str) and self.dtype not in DTYPES + _DTYPE_ALIASES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if not isinstance(self.device, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1 (or unset for the model's), got {self.max_model_len}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be a positive number of bytes (or unset), got {self.kv_cache_memory}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1 (or unset), got {self.num_gpu_blocks_override}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be >= 0, or -1 for no limit; got {self.max_logprobs}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}; got {self.quantization!r}")
        if self.quantization is not None and (self.tensor_parallel_size * self.pipeline_parallel_size > 1
                                              or self.distributed_executor_backend not in (None, "uni")):
            raise ValueError(f"quantization {self.quantization} runs on one rank in this process only so far "
                             "(tensor and pipeline parallel size 1, executor uni)")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.distributed_executor_backend not in (None,) + EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}, "
                f"got {self.distributed_executor_backend!r}"
            )

        if self.kv_offloading_size is not None and not self.kv_offloading_size > 0:
            raise ValueError(f"kv_offloading_size must be a positive number of GiB (or unset), got {self.kv_offloading_size}")
        if self.kv_offloading_backend not in KV_OFFLOADING_BACKENDS:
            raise ValueError(f"kv_offloading_backend must be one of {', '.join(KV_OFFLOADING_BACKENDS)}; "
                             f"got {self.kv_offloading_backend!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.preemption_mode == "swap" and self.kv_offloading_size is None:
            raise ValueError("preemption_mode 'swap' needs a second KV tier to swap to: set kv_offloading_size (GiB)")
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineArgs":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(**kwargs)


# The fields __post_init__ checks are integers (not floats, strings or bools), from their annotations,
# so that a new integer field is checked too.
_INT_FIELDS = tuple(name for name, hint in typing.get_type_hints(EngineArgs).items() if hint in (int, int | None))
