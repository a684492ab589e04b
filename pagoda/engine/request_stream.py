"""RequestStream: one request's delta outputs as the server reads them, and `merge_delta`, which
folds later deltas into earlier ones. The stream reads the per-request queue that `AsyncLLM` fills
from the core's outputs; closing it early aborts the request (through `AsyncLLM`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from typing import Callable

from pagoda.engine.errors import RequestTimeoutError
from pagoda.outputs import RequestOutput


def merge_delta(acc: RequestOutput, new: RequestOutput) -> RequestOutput:
    """Fold a later delta output into an earlier one (a slow consumer gets one combined delta)."""
    for a, b in zip(acc.outputs, new.outputs):
        a.text += b.text
        a.token_ids.extend(b.token_ids)
        if b.logprobs:
            if a.logprobs is None:
                a.logprobs = []
            a.logprobs.extend(b.logprobs)
        a.cumulative_logprob = b.cumulative_logprob
        a.finish_reason = b.finish_reason
        a.stop_reason = b.stop_reason
    acc.finished = new.finished
    acc.num_cached_tokens = new.num_cached_tokens
    acc.metrics = new.metrics
    acc.weight_version = new.weight_version or acc.weight_version
    if acc.prompt_logprobs is None:
        acc.prompt_logprobs = new.prompt_logprobs  # sent once, with the first delta that has them
    return acc


def _own_copy(out: RequestOutput) -> RequestOutput:
    """`out` with its own lists, so that folding later deltas into it leaves `out` as it was."""
    outputs = [replace(o, token_ids=list(o.token_ids), logprobs=None if o.logprobs is None else list(o.logprobs))
               for o in out.outputs]
    return replace(out, outputs=outputs)


@dataclass
class RequestState:
    """What the front end keeps of one request in flight: its queue of outputs and errors."""

    request_id: str
    num_seqs: int
    child_ids: list[str] = field(default_factory=list)  # its sequences' ids in the core
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False  # its final output was queued (it ended in the core)
    # The consumer reads the whole output once, at the end (a response that is not streamed, as
    # vLLM's FINAL_ONLY): its deltas are folded here rather than queued, which spares a wake-up of
    # its consumer every step.
    final_only: bool = False
    _folded: RequestOutput | None = field(default=None, init=False, repr=False)  # its deltas so far

    def deliver(self, out: RequestOutput) -> None:
        """Hand one step's delta output to the consumer (a final-only request's: at its end)."""
        if self.final_only:
            # A copy: the output listeners see each step's delta as it came.
            self._folded = _own_copy(out) if self._folded is None else merge_delta(self._folded, out)
            if not out.finished:
                return
            out, self._folded = self._folded, None
        if out.finished:
            self.finished = True
        self.queue.put_nowait(out)


# Called with (request id, whether the request must be aborted in the core) when a stream closes.
ForgetFn = Callable[[str, bool], None]


class RequestStream:
    """One request's delta outputs, as an async iterator. `close()` (idempotent, synchronous, so it
    is safe in `finally` blocks of cancelled tasks) aborts the request in the core unless it has
    finished; an error or a cancellation while waiting closes it too."""

    def __init__(self, forget: ForgetFn, state: RequestState, timeout: float | None) -> None:
        self.request_id = state.request_id
        self._forget = forget
        self._state = state
        self._timeout = timeout
        loop = asyncio.get_running_loop()
        self._deadline = loop.time() + timeout if timeout else None
        self._pending_error: BaseException | None = None
        self._peeked: RequestOutput | None = None
        self.finished = False
        self.closed = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def peek(self) -> RequestOutput:
        """The first output (raising as iterating would), which iterating then yields first."""
        if self._peeked is None:
            self._peeked = await self.__anext__()
        return self._peeked

    async def __anext__(self) -> RequestOutput:
        if self._peeked is not None:
            item, self._peeked = self._peeked, None
            return item
        if self.closed:
            raise StopAsyncIteration
        try:
            item = await self._next_item()
        except BaseException:
            self.close()  # abort in the core at once: cancellation, timeout, engine error
            raise
        if item.finished:
            self.finished = True
            self.close()
        return item

    async def _next_item(self) -> RequestOutput:
        if self._pending_error is not None:
            raise self._pending_error
        queue = self._state.queue
        if self._deadline is None:
            item = await queue.get()
        else:
            remaining = self._deadline - asyncio.get_running_loop().time()
            try:
                if remaining <= 0:
                    raise asyncio.TimeoutError
                item = await asyncio.wait_for(queue.get(), remaining)
            except asyncio.TimeoutError:
                raise RequestTimeoutError(
                    f"the request did not finish within its timeout of {self._timeout:g} s"
                ) from None
        if isinstance(item, BaseException):
            raise item
        # Merge whatever else already arrived: one delta for a consumer that fell behind, folded
        # into a copy (the output listeners were handed `item` itself).
        first = item
        while not queue.empty():
            nxt = queue.get_nowait()
            if isinstance(nxt, BaseException):
                self._pending_error = nxt
                break
            item = merge_delta(_own_copy(item) if item is first else item, nxt)
        return item

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        # A request whose final output has arrived has ended in the core, even if its consumer goes
        # away before reading that output: nothing to abort, and it must not count as aborted too.
        self._forget(self.request_id, not (self.finished or self._state.finished))

    async def aclose(self) -> None:
        self.close()
