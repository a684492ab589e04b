"""AsyncLLM: the server's front door to the engine. The engine core runs in its own process
(`pagoda.engine.core_proc`); this object lives in the API process's event loop.

It owns what must not run in the core's step loop: the tokenizer and chat template, the output
processor (incremental detokenization, stop strings, n > 1 groups), and the routing of the core's
outputs to one asyncio queue per request. One task reads the core's output socket; each
`generate()` call reads its own queue.

Failure handling, all without hanging a caller:
- a consumer that stops early (client disconnect: the generator is closed or its task cancelled)
  aborts the request in the core at once, so its KV blocks are freed;
- a per-request timeout does the same and raises `RequestTimeoutError`;
- a dead core (its process sentinel fires, or it reports a fatal error) fails every in-flight
  request with `EngineDeadError` at once and calls the registered dead-callbacks (the server then
  turns /health to 503 and exits non-zero).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import itertools
import logging
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from pagoda.config import EngineArgs
from pagoda.engine.core_proc import CoreClient, EngineConfigError, EngineDeadError
from pagoda.engine.input_processor import (
    Prompt,
    chat_prompt_ids,
    eos_token_id_of,
    make_core_requests,
    tokenize_prompt,
    truncate_prompt,
    validate_prompt,
)
from pagoda.contracts.messages import (
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequestType,
    EngineCoreStats,
    UtilityRequest,
    encode,
)
from pagoda.engine.output_processor import OutputProcessor
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_LAST_WORDS_S = 1.0  # how long a core that exited while starting may take to deliver its last message

__all__ = [
    "AsyncLLM",
    "ChatTemplateArgumentError",
    "EngineDeadError",
    "EngineNotReadyError",
    "RequestTimeoutError",
    "RequestRejectedError",
    "RequestAbortedError",
    "RequestStream",
]


class EngineNotReadyError(RuntimeError):
    """The engine is still starting."""


class RequestTimeoutError(TimeoutError):
    """The request ran past its timeout; it was aborted in the core."""


class RequestRejectedError(RuntimeError):
    """The core refused the request (the front end's validation should have caught it)."""


class RequestAbortedError(RuntimeError):
    """The request was aborted through `AsyncLLM.abort`."""


@dataclass
class _RequestState:
    request_id: str
    num_seqs: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False


# Called with every message from the core and the RequestOutputs it produced (hook for metrics).
OutputListener = Callable[[EngineCoreOutputs, list[RequestOutput]], None]


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
    if acc.prompt_logprobs is None:
        acc.prompt_logprobs = new.prompt_logprobs  # sent once, with the first delta that has them
    return acc


class ChatTemplateArgumentError(ValueError):
    """chat_template_kwargs names one of apply_chat_template's own arguments, not a template variable."""


@functools.lru_cache(maxsize=None)
def _chat_template_arguments(tokenizer_cls: type) -> frozenset[str]:
    """The named parameters of the tokenizer's apply_chat_template that are not conversation content
    (padding, truncation, tokenize, ...): its other keyword arguments become template variables."""
    params = inspect.signature(tokenizer_cls.apply_chat_template).parameters.values()
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return frozenset(named - {"self", "tools", "documents"})


def _limit_torch_threads() -> None:
    """If torch is loaded in the API process (a tokenizer may import it), keep it to one thread: the
    cores belong to the engine core. Importing torch only for this would cost seconds of start-up."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # only settable before the first parallel op; harmless if already fixed


class AsyncLLM:
    """Async engine client. Create, then `await start()` (or `await AsyncLLM.create(args)`)."""

    def __init__(
        self,
        args: EngineArgs,
        *,
        tokenizer: Any = "auto",
        chat_template: str | None = None,
        request_timeout: float | None = None,
        log_level: str = "info",
        log_setup: Callable[[], None] | None = None,
    ) -> None:
        from pagoda.engine.devices import check_device_available
        from pagoda.model.loader import resolve_model

        self.args = args
        # Resolve now: a bad model name or a missing device fails here, before any process is
        # spawned (and, in `pagoda serve`, before the HTTP server starts).
        self.source = resolve_model(args.model)
        check_device_available(args.device)
        self._tokenizer_arg = tokenizer
        self.chat_template = chat_template
        self.request_timeout = request_timeout
        self.client = CoreClient(args, log_level, log_setup)
        self.tokenizer: Any = None
        self.processor: OutputProcessor | None = None
        self.info: EngineCoreReady | None = None
        self.eos_token_id: int | None = None
        self.ready = False
        self.dead_reason: str | None = None
        self.latest_stats: EngineCoreStats | None = None
        self.output_listeners: list[OutputListener] = []
        # Called with a request id when a request ends without finishing (disconnect, timeout, abort).
        self.abort_listeners: list[Callable[[str], None]] = []
        self._dead_callbacks: list[Callable[[str], None]] = []
        self._requests: dict[str, _RequestState] = {}
        self._child_to_parent: dict[str, str] = {}
        self._utility_calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._request_ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead = asyncio.Event()
        self._output_task: asyncio.Task | None = None
        self._closing = False
        # Tokenizing a long prompt or rendering a long chat takes seconds: done here, off the event
        # loop, so that other requests' streams keep flowing (the Rust tokenizer releases the GIL).
        # One thread: the tokenizer is used by one encode at a time, as on the event loop before.
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="pagoda-tokenize")

    @classmethod
    async def create(cls, args: EngineArgs, **kwargs) -> "AsyncLLM":
        engine = cls(args, **kwargs)
        await engine.start()
        return engine

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        """Spawn the core, load the tokenizer meanwhile, and return once the core is ready.

        Raises EngineDeadError when the core dies or fails while loading."""
        from pagoda.model.loader import load_tokenizer

        self._loop = asyncio.get_running_loop()
        self.client.start()  # first: the core loads the model while this process loads the tokenizer
        _limit_torch_threads()
        self._watch_sentinel()
        if self._tokenizer_arg == "auto":
            tok_future = asyncio.ensure_future(asyncio.to_thread(load_tokenizer, self.source))
        else:
            tok_future = asyncio.ensure_future(asyncio.sleep(0, self._tokenizer_arg))
        try:
            info = await self._wait_ready()
            self.tokenizer = await tok_future
            _limit_torch_threads()  # again: loading the tokenizer may have imported torch
        except BaseException:
            tok_future.cancel()
            raise
        self.info = info
        self.eos_token_id = eos_token_id_of(self.tokenizer, info)
        self.processor = OutputProcessor(self.tokenizer)
        self._output_task = asyncio.create_task(self._output_loop(), name="pagoda-core-outputs")
        self.ready = True
        logger.info(
            "engine ready: %s (%s, %s on %s), max_model_len %d, %d KV blocks of %d tokens, core pid %d",
            info.model_name, info.architecture, info.dtype, info.device, info.max_model_len,
            info.num_usable_blocks, info.block_size, info.pid,
        )

    async def _wait_ready(self) -> EngineCoreReady:
        dead_wait = asyncio.ensure_future(self._dead.wait())
        try:
            while True:
                recv = asyncio.ensure_future(self.client.recv())
                done, _ = await asyncio.wait({recv, dead_wait}, return_when=asyncio.FIRST_COMPLETED)
                if recv in done:
                    msg = recv.result()
                else:
                    msg = await self._failure_after_exit(recv)
                    if msg is None:
                        raise EngineDeadError(self.dead_reason or "the engine core died while starting")
                if msg.stats is not None:
                    self.latest_stats = msg.stats
                if msg.failed is not None:
                    self._mark_dead(f"the engine core failed while starting: {msg.failed}")
                    if msg.config_error is not None:
                        # Bad arguments, not a crash: the server fails as for a usage error.
                        raise EngineConfigError(msg.config_error)
                    raise EngineDeadError(self.dead_reason)
                if msg.ready is not None:
                    return msg.ready
        finally:
            dead_wait.cancel()

    async def _failure_after_exit(self, recv: asyncio.Future) -> EngineCoreOutputs | None:
        """The core process exited while starting. Its message saying why was sent before it exited
        (the socket lingers until delivered), so it is here or about to be: find it, rather than lose
        the reason (and whether it was a usage error) to the race with the process sentinel."""
        deadline = self._loop.time() + _LAST_WORDS_S
        try:
            while True:
                msg = await asyncio.wait_for(recv, max(0.0, deadline - self._loop.time()))
                if msg.failed is not None:
                    return msg
                recv = asyncio.ensure_future(self.client.recv())
        except Exception:  # timed out (the core died without a word), or the socket is gone
            return None

    def _watch_sentinel(self) -> None:
        """Notice the core's death at once: its process sentinel becomes readable when it exits."""
        loop = self._loop
        sentinel = self.client.sentinel
        try:
            loop.add_reader(sentinel, self._on_core_exit)
            self._sentinel_in_loop = True
        except (NotImplementedError, RuntimeError):
            self._sentinel_in_loop = False

            def wait() -> None:
                from multiprocessing.connection import wait as mp_wait

                mp_wait([sentinel])
                loop.call_soon_threadsafe(self._on_core_exit)

            threading.Thread(target=wait, name="pagoda-core-sentinel", daemon=True).start()

    def _on_core_exit(self) -> None:
        if self._sentinel_in_loop:
            self._loop.remove_reader(self.client.sentinel)
        if self._closing:
            return
        self.client.proc.join(0.5)
        code = self.client.proc.exitcode
        self._mark_dead(self.dead_reason or f"the engine core process exited (exit code {code})")

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is not None and self._dead.is_set():
            return
        self.dead_reason = reason
        self.ready = False
        self._dead.set()
        logger.error("%s", reason)
        err = EngineDeadError(reason)
        for state in self._requests.values():
            state.queue.put_nowait(err)
        for fut in self._utility_calls.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))
        for cb in list(self._dead_callbacks):
            try:
                cb(reason)
            except Exception:
                logger.exception("engine-dead callback failed")

    def add_dead_callback(self, cb: Callable[[str], None]) -> None:
        """`cb(reason)` runs on the event loop when the core dies (after in-flight requests failed)."""
        self._dead_callbacks.append(cb)
        if self.dead_reason is not None and self._dead.is_set():
            cb(self.dead_reason)

    @property
    def is_dead(self) -> bool:
        return self._dead.is_set()

    async def shutdown(self) -> None:
        """Stop the core (politely, then by force) and the output task."""
        self._closing = True
        if self._output_task is not None:
            self._output_task.cancel()
            try:
                await self._output_task
            except BaseException:
                pass
        if self._loop is not None and getattr(self, "_sentinel_in_loop", False) and self.client.proc is not None:
            self._loop.remove_reader(self.client.sentinel)
        await asyncio.to_thread(self.client.shutdown)
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)
        self.ready = False

    # -- the core's outputs ----------------------------------------------------------------------
    async def _output_loop(self) -> None:
        try:
            while True:
                msg = await self.client.recv()
                self._handle_core_message(msg)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # A bug here would leave every request waiting forever: fail loudly instead.
            logger.exception("output loop failed")
            self._mark_dead(f"the engine's output loop failed: {type(exc).__name__}: {exc}")

    def _handle_core_message(self, msg: EngineCoreOutputs) -> None:
        if msg.stats is not None:
            self.latest_stats = msg.stats
        if msg.utility is not None:
            fut = self._utility_calls.pop(msg.utility.call_id, None)
            if fut is not None and not fut.done():
                if msg.utility.error is not None:
                    fut.set_exception(RuntimeError(msg.utility.error))
                else:
                    fut.set_result(msg.utility.result)
        for core_id, why in msg.rejected.items():
            parent = self._child_to_parent.get(core_id)
            state = self._requests.get(parent) if parent is not None else None
            if state is not None:
                state.queue.put_nowait(RequestRejectedError(why))
        results: list[RequestOutput] = []
        if msg.outputs:
            results, stopped = self.processor.process(msg.outputs)
            for out in msg.outputs:
                if out.finish_reason is not None:
                    self._child_to_parent.pop(out.request_id, None)
            if stopped:
                for cid in stopped:
                    self._child_to_parent.pop(cid, None)
                self._send(EngineCoreRequestType.FINISH, encode(stopped))
            for result in results:
                state = self._requests.get(result.request_id)
                if state is None:
                    continue
                if result.finished:
                    state.finished = True
                state.queue.put_nowait(result)
        if msg.failed is not None:
            self._mark_dead(f"the engine core failed: {msg.failed}")
        for listener in self.output_listeners:
            try:
                listener(msg, results)
            except Exception:
                logger.exception("output listener failed")

    def _send(self, kind: bytes, payload: bytes = b"") -> None:
        if self.is_dead:
            return
        try:
            self.client.send(kind, payload)
        except EngineDeadError as exc:
            self._mark_dead(str(exc))

    # -- model facts ----------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self.is_dead:
            raise EngineDeadError(self.dead_reason or "the engine core is dead")
        if not self.ready:
            raise EngineNotReadyError("the engine is starting")

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def model_name(self) -> str:
        return self.info.model_name

    # -- text ------------------------------------------------------------------------------------
    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return tokenize_prompt(self.tokenizer, text, add_special_tokens)[1]

    async def tokenize_async(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """tokenize() on the tokenizer thread: the event loop serves other requests meanwhile."""
        return await self._off_loop(self.tokenize, text, add_special_tokens)

    async def apply_chat_template_async(self, messages: list[dict], **kwargs: Any) -> list[int]:
        """apply_chat_template() on the tokenizer thread (same arguments, same errors)."""
        return await self._off_loop(functools.partial(self.apply_chat_template, messages, **kwargs))

    async def _off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, *args)

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer")
        vocab = self.info.vocab_size
        if any(t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"token ids must be in [0, {vocab})")
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[int]:
        """Token ids of a conversation; ValueError when the template cannot render it."""
        tok = self.tokenizer
        template = chat_template or self.chat_template
        if tok is None or not (template or getattr(tok, "chat_template", None)):
            raise ValueError("this model has no chat template; use /v1/completions")
        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
        reserved = sorted(set(chat_template_kwargs or ()) & _chat_template_arguments(type(tok)))
        if reserved:
            # They would reach the tokenizer, not the template: {"truncation": true, "max_length": 2}
            # would silently cut the prompt, {"tokenize": false} would return text.
            raise ChatTemplateArgumentError(
                f"chat_template_kwargs cannot set {', '.join(reserved)}: it holds template variables only"
            )
        return chat_prompt_ids(
            tok,
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=template,
            template_kwargs=chat_template_kwargs,
        )

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        info = self.info
        validate_prompt(
            prompt_ids,
            params,
            vocab_size=info.vocab_size,
            max_model_len=info.max_model_len,
            block_size=info.block_size,
            num_usable_blocks=info.num_usable_blocks,
            strict_max_tokens=True,
            max_logprobs=self.args.max_logprobs,
            has_tokenizer=self.tokenizer is not None,
        )

    # -- requests ----------------------------------------------------------------------------------
    def num_inflight_requests(self) -> int:
        """Requests whose stream is still open (sent to the core, or finished but not yet consumed)."""
        return len(self._requests)

    def abort_all(self) -> None:
        """Abort every request in flight (their streams end with RequestAbortedError)."""
        for request_id in list(self._requests):
            self.abort(request_id)

    def num_unfinished_sequences(self) -> int:
        """Sequences (n > 1 counts n) sent to the core and not yet finished."""
        return len(self._child_to_parent)

    def estimated_num_waiting(self) -> int:
        """Sequences in flight beyond those the core last reported running: an upper bound of its
        waiting queue (new arrivals count as waiting until the core reports them running)."""
        running = self.latest_stats.num_running if self.latest_stats is not None else 0
        return max(0, self.num_unfinished_sequences() - running)

    async def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        timeout: float | None = None,
    ) -> "RequestStream":
        """Validate and send a request; returns its stream of delta outputs.

        Raises ValueError for a bad request (nothing reaches the core), EngineDeadError,
        EngineNotReadyError. The server uses this so that a bad request gets its 400 before any
        streaming response starts. The caller must iterate the stream to its end or close it.
        """
        self._check_usable()
        if request_id is None:
            request_id = f"req-{next(self._request_ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, prompt_ids = tokenize_prompt(self.tokenizer, prompt)
        prompt_ids = truncate_prompt(prompt_ids, params, self.info.max_model_len)
        self.validate(prompt_ids, params)
        state = _RequestState(request_id, params.n)
        self._requests[request_id] = state
        child_ids: list[str] = []
        sent = 0
        try:
            child_ids = self.processor.add_request(request_id, text, prompt_ids, params, self.eos_token_id,
                                                   delta=True)
            for cid in child_ids:
                self._child_to_parent[cid] = request_id
            for req in make_core_requests(child_ids, prompt_ids, params, self.eos_token_id, priority, time.time()):
                self.client.send(EngineCoreRequestType.ADD, encode(req))
                sent += 1
        except EngineDeadError as exc:
            self._forget(request_id, child_ids, abort=False)
            self._mark_dead(str(exc))
            raise
        except BaseException:
            # Anything else (e.g. a value msgpack cannot encode): forget the request, else it stays
            # "in flight" for good (a drain waits for it, the waiting-queue bound counts it), and
            # abort any children the core already has.
            self._forget(request_id, child_ids, abort=sent > 0)
            raise
        timeout = timeout if timeout is not None else self.request_timeout
        return RequestStream(self, state, child_ids, timeout)

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        timeout: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Delta RequestOutputs of one request (each carries only new text, tokens and logprobs),
        the last one with `finished` set.

        Raises as `add_request`, and RequestTimeoutError (timeout: seconds; None: the engine's
        default). Closing the generator early, or cancelling its consumer, aborts the request in
        the core at once.
        """
        stream = await self.add_request(prompt, params, request_id, priority, timeout)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def _forget(self, request_id: str, child_ids: list[str], abort: bool) -> None:
        # Synchronous on purpose: runs in `finally` while the generator is closed or cancelled,
        # where awaiting is not allowed; the abort reaches the core at once.
        self._requests.pop(request_id, None)
        core_ids = self.processor.abort(request_id)
        for cid in child_ids:
            self._child_to_parent.pop(cid, None)
        if abort and core_ids:
            self._send(EngineCoreRequestType.ABORT, encode(core_ids))
        if abort:
            self._notify_abort(request_id)

    def _notify_abort(self, request_id: str) -> None:
        for listener in self.abort_listeners:
            try:
                listener(request_id)
            except Exception:
                logger.exception("abort listener failed")

    def abort(self, request_id: str) -> None:
        """Abort a request from outside its consumer; its generator then ends with an error."""
        state = self._requests.get(request_id)
        if state is None:
            return
        core_ids = self.processor.abort(request_id)
        if core_ids:
            self._send(EngineCoreRequestType.ABORT, encode(core_ids))
        state.queue.put_nowait(RequestAbortedError(f"request {request_id} was aborted"))

    # -- utility calls ---------------------------------------------------------------------------
    async def call_utility(self, method: str, *args: Any, timeout: float = 30.0) -> Any:
        self._check_usable()
        call_id = next(self._call_ids)
        fut = self._loop.create_future()
        self._utility_calls[call_id] = fut
        self._send(EngineCoreRequestType.UTILITY, encode(UtilityRequest(call_id, method, list(args))))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._utility_calls.pop(call_id, None)

    async def engine_stats(self) -> EngineCoreStats:
        """A fresh snapshot from the core (after every input sent before this call was handled)."""
        return EngineCoreStats(**await self.call_utility("stats"))

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block; False (nothing done) while requests hold blocks."""
        return bool(await self.call_utility("reset_prefix_cache"))


class RequestStream:
    """One request's delta outputs, as an async iterator. `close()` (idempotent, synchronous, so it
    is safe in `finally` blocks of cancelled tasks) aborts the request in the core unless it has
    finished; an error or a cancellation while waiting closes it too."""

    def __init__(self, engine: AsyncLLM, state: _RequestState, child_ids: list[str], timeout: float | None) -> None:
        self.engine = engine
        self.request_id = state.request_id
        self._state = state
        self._child_ids = child_ids
        self._timeout = timeout
        loop = asyncio.get_running_loop()
        self._deadline = loop.time() + timeout if timeout else None
        self._pending_error: BaseException | None = None
        self.finished = False
        self.closed = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
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
        # Merge whatever else already arrived: one delta for a consumer that fell behind.
        while not queue.empty():
            nxt = queue.get_nowait()
            if isinstance(nxt, BaseException):
                self._pending_error = nxt
                break
            item = merge_delta(item, nxt)
        return item

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        # A request whose final output has arrived has ended in the core, even if its consumer goes
        # away before reading that output: nothing to abort, and it must not count as aborted too.
        self.engine._forget(self.request_id, self._child_ids, abort=not (self.finished or self._state.finished))

    async def aclose(self) -> None:
        self.close()
