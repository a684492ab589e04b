"""The engine flags, generated from `EngineArgs`'s dataclass fields (pagoda/config.py).

Each field `name` becomes `--name-with-dashes` with the field's default, its metadata's help and
choices, and a type taken from the annotation (`int`, `float`, `str`, or one of them `| None`);
a `bool` becomes `--name / --no-name` (argparse.BooleanOptionalAction), so `--enforce-eager` and
`--no-enable-prefix-caching` read as vLLM's. Fields marked `"cli": "subcommand"` (`model`,
`served_model_name`) are declared by the subcommands themselves; `"cli": "json"` fields
(`--speculative-config`) take JSON text, which `EngineArgs` parses; `"cli": "size"` fields take
`4G`/`512M` as vLLM's. `--help` groups the flags as vLLM's does (model, load, cache, parallel,
scheduler, speculative); `engine_kwargs` reads the same fields back from the parsed namespace.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

from pagoda.config import EngineArgs, parse_size

# The `--help` group of each field, vLLM's grouping; a field not named here goes to "engine".
FLAG_GROUPS: dict[str, tuple[str, ...]] = {
    "model": ("revision", "tokenizer", "generation_config", "dtype", "seed", "max_model_len", "max_logprobs"),
    "load and device": ("device", "enforce_eager"),
    "cache": ("block_size", "kv_cache_dtype", "enable_prefix_caching", "kv_cache_memory", "num_gpu_blocks_override",
              "gpu_memory_utilization"),
    "parallel": ("tensor_parallel_size", "pipeline_parallel_size", "distributed_executor_backend"),
    "scheduler": ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill", "long_prefill_token_threshold",
                  "scheduling_policy"),
    "speculative decoding": ("speculative_config",),
}
_GROUP_OF = {name: group for group, names in FLAG_GROUPS.items() for name in names}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` shows each flag's default, but not a None or empty one: the help text says what unset means.
    Every parser takes it through `formatter_class` (subcommand parsers do not inherit it)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default == "":
            return action.help
        return super()._get_help_string(action)


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def field_help(name: str) -> str:
    """The help text `EngineArgs` gives a field (for the subcommands that declare it themselves)."""
    return next(f.metadata["help"] for f in dataclasses.fields(EngineArgs) if f.name == name)


def engine_flag_fields() -> list[dataclasses.Field]:
    """The fields that are shared engine flags: all but those each subcommand declares itself."""
    return [f for f in dataclasses.fields(EngineArgs) if f.metadata.get("cli") != "subcommand"]


def _value_type(annotation: Any) -> type:
    """`int`, `float`, `str` or `bool`, from `X` or `X | None` (Optional[X])."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        kinds = [a for a in args if a is not type(None)]
        if len(kinds) != 1:
            raise TypeError(f"an engine flag needs one value type, got {annotation!r}")
        annotation = kinds[0]
    if annotation not in (int, float, str, bool):
        raise TypeError(f"no command-line type for {annotation!r}")
    return annotation


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add one flag per shared `EngineArgs` field (vLLM's names), in vLLM's groups."""
    hints = typing.get_type_hints(EngineArgs)
    # An empty group prints nothing in --help.
    groups = {title: parser.add_argument_group(title) for title in (*FLAG_GROUPS, "engine")}
    for f in engine_flag_fields():
        group = groups[_GROUP_OF.get(f.name, "engine")]
        cli = f.metadata.get("cli")
        # A JSON flag's text is parsed by EngineArgs itself, which names what is wrong in one line.
        kind = str if cli == "json" else _size if cli == "size" else _value_type(hints[f.name])
        help_text = f.metadata.get("help")
        if help_text is None:
            raise TypeError(f"EngineArgs.{f.name} has no help text in its metadata")
        if kind is bool:
            group.add_argument(flag_name(f.name), action=argparse.BooleanOptionalAction, default=f.default,
                               help=help_text)
        else:
            names = [flag_name(f.name)] + ([f.metadata["short"]] if "short" in f.metadata else [])
            group.add_argument(*names, *f.metadata.get("aliases", ()), type=kind, default=f.default,
                               choices=f.metadata.get("choices"), help=help_text)


def engine_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    """The shared engine flags' values, keyed by `EngineArgs` field name."""
    return {f.name: getattr(ns, f.name) for f in engine_flag_fields()}
