"""InvalidRequestError: a request refused because of one of its fields. DistributedInitError and
WorkerDiedError: a distributed executor whose ranks did not meet, or lost one.

InvalidRequestError is in the base layer because `SamplingParams` raises it as well as the engine's input processor: the
server turns it into a 400 whose OpenAI `param` is the field named here, instead of guessing the field
from the message's text. A ValueError, so callers that catch ValueError see no change. The two
distributed errors are here because the executor raises them and the engine core (and its process)
report them as one line, without a traceback.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """`field`: the name of what was wrong, as the raiser knows it (a `SamplingParams` field, "prompt",
    "messages", "chat_template_kwargs", ...), or None when no one field is to blame. `code`: a
    machine-readable reason (OpenAI's error `code`, e.g. "context_length_exceeded"), or None."""

    def __init__(self, message: str, field: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.code = code


class DistributedInitError(RuntimeError):
    """The ranks of a distributed executor did not meet (or one failed before meeting). Its text is
    one line naming the rank and the executor backend; no traceback adds to it."""


class WorkerDiedError(RuntimeError):
    """A worker process (or Ray actor) of a distributed executor exited or failed: the engine cannot
    go on with one rank missing. Its text names the rank."""
