"""FailoverStream: a request's stream that moves to another replica when its replica dies before
the request yielded anything (`pagoda.engine.replica_set`).

Once the consumer has had an output, the request cannot move (the client has seen tokens another
replica would not repeat exactly under sampling): a death then ends the stream with
`EngineDeadError`, which the server turns into an error event.
"""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable

from pagoda.engine.errors import EngineDeadError, EngineNotReadyError
from pagoda.outputs import RequestOutput

logger = logging.getLogger(__name__)

# Sends the request again to a replica not in the set given; returns (replica, its RequestStream).
Resubmit = Callable[[set[int]], Awaitable[tuple[int, Any]]]


class FailoverStream:
    """Same interface as `RequestStream`: async iterator of delta outputs, `close()` aborts."""

    def __init__(self, request_id: str, replica: int, inner: Any, resubmit: Resubmit) -> None:
        self.request_id = request_id
        self.replica = replica
        self.num_retries = 0
        self._inner = inner
        self._resubmit = resubmit
        self._tried = {replica}
        self._yielded = False
        self._peeked: RequestOutput | None = None

    @property
    def finished(self) -> bool:
        return self._inner.finished

    @property
    def closed(self) -> bool:
        return self._inner.closed

    def __aiter__(self) -> "FailoverStream":
        return self

    async def peek(self) -> RequestOutput:
        """The first output (failing over as iterating would), which iterating then yields first: a
        streamed response's headers wait for it (they name the weight version)."""
        if self._peeked is None:
            self._peeked = await self.__anext__()
        return self._peeked

    async def __anext__(self) -> RequestOutput:
        if self._peeked is not None:
            item, self._peeked = self._peeked, None
            return item
        while True:
            try:
                item = await self._inner.__anext__()
            except EngineDeadError as exc:
                if self._yielded:
                    raise
                await self._move(exc)
                continue
            self._yielded = True
            return item

    async def _move(self, cause: EngineDeadError) -> None:
        dead = self.replica
        try:
            self.replica, self._inner = await self._resubmit(self._tried)
        except (EngineDeadError, EngineNotReadyError):
            raise cause from None
        self._tried.add(self.replica)
        self.num_retries += 1
        logger.warning("replica %d died before the request streamed anything; retried on replica %d",
                       dead, self.replica, extra={"request_id": self.request_id})

    def close(self) -> None:
        self._inner.close()

    async def aclose(self) -> None:
        self.close()
