"""vLLM's `serve` flags that Pagoda has no use for, or not yet: so that a vLLM launch line parses.

Accepted but meaningless here (`--trust-remote-code`: Pagoda runs no model code from the model's
folder; `--disable-log-requests`: requests are logged only with `--enable-log-requests`;
`--swap-space`: no CPU swap tier yet) are taken and warned about once, on stderr. Flags of features
Pagoda does not have yet (LoRA, CPU weight offloading, multimodal inputs, ...) stop the command with
one line naming the flag and exit code 2, rather than being silently ignored.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

# flag -> (takes a value, why it changes nothing here)
IGNORED_FLAGS: dict[str, tuple[bool, str]] = {
    "--trust-remote-code": (False, "Pagoda runs no code from a model's folder"),
    "--disable-log-requests": (False, "requests are logged only with --enable-log-requests"),
    "--swap-space": (True, "there is no CPU swap space for preempted requests; they are recomputed"),
    "--disable-custom-all-reduce": (False, "the CPU all-reduce needs no switch"),
    "--tokenizer-mode": (True, "the tokenizer is always the fast (Rust) one"),
    "--load-format": (True, "the format is read from the model's files"),
    "--download-dir": (True, "nothing is downloaded; models come from the local Hugging Face cache"),
    "--uvicorn-log-level": (True, "--log-level sets uvicorn's level too"),
    "--disable-frontend-multiprocessing": (False, "the engine core always runs in its own process"),
    "--enable-sleep-mode": (False, "POST /sleep and /wake_up are always available"),
}

# flags of vLLM features Pagoda does not have yet
UNSUPPORTED_FLAGS: dict[str, bool] = {
    "--enable-lora": False,
    "--lora-modules": True,
    "--max-loras": True,
    "--max-lora-rank": True,
    "--cpu-offload-gb": True,
    "--limit-mm-per-prompt": True,
    "--mm-processor-kwargs": True,
    "--hf-overrides": True,
    "--rope-scaling": True,
    "--pooler-config": True,
    "--task": True,
    "--runner": True,
    "--enable-prompt-embeds": False,
}


class _WarnIgnored(argparse.Action):
    """Takes the flag (and its value), says once that it has no effect, stores nothing."""

    warned: set[str] = set()

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if option_string not in self.warned:
            self.warned.add(option_string)
            print(f"pagoda: warning: {option_string} has no effect ({self.help}); accepted for vLLM's command lines",
                  file=sys.stderr)


class _RefuseUnsupported(argparse.Action):
    """Ends the command with one line naming the flag, and exit code 2 (a usage error)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"pagoda: error: {option_string} is not supported yet (a vLLM flag of a feature Pagoda does not have)",
              file=sys.stderr)
        sys.exit(2)


def add_vllm_compat_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's flags that are accepted and ignored (with a warning) or refused (in one line)."""
    group = parser.add_argument_group("vLLM compatibility (accepted, no effect here)")
    for flag, (takes_value, why) in IGNORED_FLAGS.items():
        group.add_argument(flag, action=_WarnIgnored, nargs=None if takes_value else 0, dest=argparse.SUPPRESS,
                           metavar="VALUE" if takes_value else None,
                           default=argparse.SUPPRESS, help=why)
    for flag, takes_value in UNSUPPORTED_FLAGS.items():
        parser.add_argument(flag, action=_RefuseUnsupported, nargs="?" if takes_value else 0,
                            dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=argparse.SUPPRESS)

