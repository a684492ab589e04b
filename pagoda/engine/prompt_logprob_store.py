"""Prompt-logprob rows of live requests, kept by the engine core by request id.

A request that asks for `prompt_logprobs` gets one row per prompt position, computed over however
many steps its prompt takes (chunked prefill), and all of them travel on its first output. The rows
wait here until then. A preempted request computes its prompt again, so rows arrive for positions
already known: they are dropped (each position is reported once), and rows that would leave a gap
are an error. The scheduler is told how far the rows reach (`Request.advance_prompt_logprobs`),
since until they are complete the request must not read cached prefix blocks.
"""

from __future__ import annotations

from pagoda.exec.prompt_logprobs import PromptLogprobRow


class PromptLogprobStore:
    def __init__(self) -> None:
        # request id -> rows of prompt positions [0, len(rows)), for requests that asked for them.
        self._rows: dict[str, list[PromptLogprobRow]] = {}

    def start(self, request_id: str) -> None:
        """The request asks for prompt logprobs (an id reused after it finished starts afresh)."""
        self._rows[request_id] = []

    def add(self, request_id: str, start: int, rows: list[PromptLogprobRow]) -> int:
        """Keep the rows of prompt positions [start, start + len(rows)) not seen before.
        Returns how many leading positions are known now."""
        known = self._rows[request_id]
        skip = len(known) - start
        if skip < 0:
            raise ValueError(f"prompt logprobs of {request_id!r} from position {start}, "
                             f"{len(known)} known: a gap")
        known.extend(rows[skip:])
        return len(known)

    def take(self, request_id: str) -> list[PromptLogprobRow] | None:
        """The rows, once (for the first output); None when the request did not ask for them."""
        return self._rows.pop(request_id, None)

    def drop(self, request_id: str) -> None:
        self._rows.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._rows)
