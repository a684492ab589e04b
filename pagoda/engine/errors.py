"""The engine's typed errors, in one module that both front ends and their callers import: the
server maps each to its HTTP answer by type, never by message text.

- `InvalidRequestError` (from `pagoda.errors`, re-exported): a request refused for one of its
  fields (`.field`, `.code`); nothing of it reached the core.
- `ChatTemplateArgumentError`: an `InvalidRequestError` on chat_template_kwargs.
- `EngineDeadError` / `EngineConfigError`: the core process is gone / could not start with these
  arguments. `EngineNotReadyError`: still starting.
- `RequestTimeoutError`, `RequestRejectedError`, `RequestAbortedError`: how one request ended
  without finishing.
- `WeightUpdateRefused`: a weight update, sleep or wake that cannot happen now; `refusal` is its
  answer as plain data. Here rather than beside the weight lifecycle, which imports torch: the API
  process imports these and must not load torch (~200 MB of its memory).
"""

from __future__ import annotations

from pagoda.errors import InvalidRequestError

__all__ = [
    "ChatTemplateArgumentError",
    "EngineConfigError",
    "EngineDeadError",
    "EngineNotReadyError",
    "InvalidRequestError",
    "RequestAbortedError",
    "RequestRejectedError",
    "RequestTimeoutError",
    "WeightUpdateRefused",
    "refusal",
]


class EngineDeadError(RuntimeError):
    """The engine-core process is gone (crashed, killed, or failed to start)."""


class EngineConfigError(EngineDeadError):
    """The engine core could not start with these arguments (the model does not load, the KV cache
    is too small, ...): starting it again the same way fails the same way. Its text is the bare
    reason, fit for a one-line usage error."""


class EngineNotReadyError(RuntimeError):
    """The engine is still starting."""


class RequestTimeoutError(TimeoutError):
    """The request ran past its timeout; it was aborted in the core."""


class RequestRejectedError(RuntimeError):
    """The core refused the request (the front end's validation should have caught it)."""


class RequestAbortedError(RuntimeError):
    """The request was aborted through `AsyncLLM.abort`."""


class ChatTemplateArgumentError(InvalidRequestError):
    """chat_template_kwargs names one of apply_chat_template's own arguments, not a template variable."""

    def __init__(self, message: str) -> None:
        super().__init__(message, field="chat_template_kwargs")


class WeightUpdateRefused(Exception):
    """An update, sleep or wake that cannot happen now (`kind`: "invalid" for a bad checkpoint or
    argument, "conflict" for a state that forbids it)."""

    def __init__(self, message: str, kind: str = "invalid") -> None:
        super().__init__(message)
        self.kind = kind


def refusal(exc: BaseException) -> dict:
    """The answer to a refused call, as plain data."""
    kind = exc.kind if isinstance(exc, WeightUpdateRefused) else "invalid"
    return {"error": str(exc), "kind": kind}
