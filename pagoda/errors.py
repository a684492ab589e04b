"""InvalidRequestError: a request refused because of one of its fields.

In the base layer because `SamplingParams` raises it as well as the engine's input processor: the
server turns it into a 400 whose OpenAI `param` is the field named here, instead of guessing the field
from the message's text. A ValueError, so callers that catch ValueError see no change.
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
