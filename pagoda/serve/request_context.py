"""The id of the request an HTTP handler is serving, as a context variable, so that every log line
written while serving it can carry the id (the ops layer's log filter reads it)."""

from __future__ import annotations

import contextvars

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("pagoda_request_id", default=None)
