"""AsyncLLM: the server's front door to the engine. The engine core runs in its own process, which
`CoreClient` (`pagoda.engine.core_client`) spawns, supervises and talks to; this object lives in
the API process's event loop and owns the request side of it:

- the input processor (`pagoda.engine.input_processor`: tokenizer, chat template, validation), run
  on a thread of its own (small inputs excepted) so that a long prompt does not stall other streams;
- the output processor (incremental detokenization, stop strings) and the n > 1 fan-out;
- the routing of the core's outputs to one asyncio queue per request, which its `RequestStream`
  (`pagoda.engine.request_stream`) reads.

Failure handling, all without hanging a caller:
- a consumer that stops early (client disconnect: the generator is closed or its task cancelled)
  aborts the request in the core at once, so its KV blocks are freed;
- a per-request timeout does the same and raises `RequestTimeoutError`;
- a dead core (noticed by the client) fails every in-flight request with `EngineDeadError` at once,
  then the registered dead-callbacks run (the server then turns /health to 503 and exits non-zero).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable

from pagoda.config import EngineArgs
from pagoda.contracts.messages import EngineCoreOutputs, EngineCoreReady, EngineCoreRequestType, EngineCoreStats, encode
from pagoda.engine.async_lifecycle import WeightLifecycleCalls
from pagoda.engine.core_client import CoreClient
from pagoda.engine.devices import check_device_available, limit_torch_threads
from pagoda.engine.errors import (EngineDeadError, EngineNotReadyError, InvalidRequestError, RequestAbortedError,
                                  RequestRejectedError)
from pagoda.engine.input_processor import (InputProcessor, ModelLimits, ProcessedPrompt, Prompt, eos_token_id_of,
                                           make_core_requests, quick_to_process, quick_to_render)
from pagoda.engine.output_processor import OutputProcessor
from pagoda.engine.request_stream import RequestState, RequestStream
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Its errors are in pagoda.engine.errors, its streams in pagoda.engine.request_stream.
__all__ = ["AsyncLLM"]

# Called with every message from the core and the RequestOutputs it produced (hook for metrics).
OutputListener = Callable[[EngineCoreOutputs, list[RequestOutput]], None]


class AsyncLLM(WeightLifecycleCalls):
    """Async engine front end. Create, then `await start()` (or `await AsyncLLM.create(args)`);
    weight updates and sleep come from `WeightLifecycleCalls`."""

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
        from pagoda.engine.model_files import generation_defaults, pin_model

        # Resolve now: a bad model name or a missing device fails here, before any process is
        # spawned (and, in `pagoda serve`, before the HTTP server starts).
        args, self.source = pin_model(args)
        self.args = args
        check_device_available(args.device)
        self.generation_defaults = generation_defaults(args, self.source)
        self._tokenizer_arg = tokenizer
        self.chat_template = chat_template
        self.request_timeout = request_timeout
        self.client = CoreClient(args, log_level, log_setup)
        # First of the dead-callbacks: in-flight requests fail before anyone else hears of it.
        self.client.add_dead_callback(self._on_core_dead)
        self.tokenizer: Any = None
        self.processor: OutputProcessor | None = None
        self._inputs: InputProcessor | None = None
        self.info: EngineCoreReady | None = None
        self.eos_token_id: int | None = None
        self.ready = False
        self.output_listeners: list[OutputListener] = []
        # Called with a request id when a request ends without finishing (disconnect, timeout, abort).
        self.abort_listeners: list[Callable[[str], None]] = []
        self._requests: dict[str, RequestState] = {}
        self._child_to_parent: dict[str, str] = {}
        self._request_ids = itertools.count()
        # Tokenizing a long prompt or rendering a long chat takes seconds: done here, off the event
        # loop, so that other requests' streams keep flowing (the Rust tokenizer releases the GIL).
        # One thread: the tokenizer is used by one encode at a time, as on the event loop before.
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="pagoda-tokenize")

    @classmethod
    async def create(cls, args: EngineArgs, **kwargs: Any) -> "AsyncLLM":
        engine = cls(args, **kwargs)
        await engine.start()
        return engine

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        """Spawn the core, load the tokenizer meanwhile, and return once the core is ready.

        Raises EngineConfigError for arguments the core cannot start with, EngineDeadError when it
        dies or fails otherwise while loading."""
        from pagoda.engine.model_files import load_front_tokenizer

        self.client.start()  # first: the core loads the model while this process loads the tokenizer
        limit_torch_threads()
        if self._tokenizer_arg == "auto":
            tok_future = asyncio.ensure_future(asyncio.to_thread(load_front_tokenizer, self.args, self.source))
        else:
            tok_future = asyncio.ensure_future(asyncio.sleep(0, self._tokenizer_arg))
        try:
            info = await self.client.wait_ready()
            tokenizer = await tok_future
            limit_torch_threads()  # again: loading the tokenizer may have imported torch
        except BaseException:
            tok_future.cancel()
            raise
        self._on_ready(info, tokenizer)
        self.client.start_output_loop(self._handle_core_message)
        logger.info(
            "engine ready: %s (%s, %s on %s), max_model_len %d, %d KV blocks of %d tokens, core pid %d",
            info.model_name, info.architecture, info.dtype, info.device, info.max_model_len,
            info.num_usable_blocks, info.block_size, info.pid,
        )

    def _on_ready(self, info: EngineCoreReady, tokenizer: Any) -> None:
        """Build what needs the core's facts (context, vocabulary, KV cache) and the tokenizer."""
        self.info = info
        self.weight_version, self.weights_loaded_at = info.weight_version, info.weights_loaded_at
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id_of(tokenizer, info)
        self.processor = OutputProcessor(tokenizer)
        limits = ModelLimits(vocab_size=info.vocab_size, max_model_len=info.max_model_len, block_size=info.block_size,
                             num_usable_blocks=info.num_usable_blocks, max_logprobs=self.args.max_logprobs)
        # strict_max_tokens: the server's rule (OpenAI's): a max_tokens past the context is a 400.
        self._inputs = InputProcessor(tokenizer, limits, strict_max_tokens=True, chat_template=self.chat_template)
        self.ready = True

    def _on_core_dead(self, reason: str) -> None:
        self.ready = False
        err = EngineDeadError(reason)
        for state in self._requests.values():
            state.queue.put_nowait(err)

    def add_dead_callback(self, cb: Callable[[str], None]) -> None:
        """`cb(reason)` runs on the event loop when the core dies (after in-flight requests failed)."""
        self.client.add_dead_callback(cb)

    @property
    def is_dead(self) -> bool:
        return self.client.is_dead

    @property
    def dead_reason(self) -> str | None:
        return self.client.dead_reason

    @property
    def latest_stats(self) -> EngineCoreStats | None:
        """The core's last snapshot (sent with every batch of outputs)."""
        return self.client.latest_stats

    async def shutdown(self) -> None:
        """Stop the core (politely, then by force) and the output task."""
        await self.client.close()
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)
        self.ready = False

    # -- the core's outputs ----------------------------------------------------------------------
    def _handle_core_message(self, msg: EngineCoreOutputs) -> None:
        """Route a message's outputs to their requests' queues (the client took stats and utility
        results already), then tell the output listeners."""
        for core_id, why in msg.rejected.items():
            parent = self._child_to_parent.get(core_id)
            state = self._requests.get(parent) if parent is not None else None
            if state is not None:
                state.queue.put_nowait(RequestRejectedError(why))
        results: list[RequestOutput] = []
        # Ended in the core by a weight swap (mode abort): their streams fail with the reason.
        failed = {self._child_to_parent.get(o.request_id, ""): o.error for o in msg.outputs if o.error is not None}
        for parent, why in failed.items():
            state = self._requests.get(parent)
            if state is not None:  # its stream's close aborts any sibling (n > 1) still in the core
                state.queue.put_nowait(RequestAbortedError(why))
        if msg.outputs:
            self.weight_version = msg.weight_version or self.weight_version
            results, stopped = self.processor.process(msg.outputs, msg.weight_version)
            for out in msg.outputs:
                if out.finish_reason is not None:
                    self._child_to_parent.pop(out.request_id, None)
            if stopped:
                for cid in stopped:
                    self._child_to_parent.pop(cid, None)
                self.client.send_or_mark_dead(EngineCoreRequestType.FINISH, encode(stopped))
            for result in results:
                state = self._requests.get(result.request_id)
                if state is None or result.request_id in failed:
                    continue
                state.deliver(result)
        for listener in self.output_listeners:
            try:
                listener(msg, results)
            except Exception:
                logger.exception("output listener failed")

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

    # -- inputs ------------------------------------------------------------------------------------
    @property
    def input_processor(self) -> InputProcessor:
        """The checks of this engine's requests; EngineNotReadyError until the core is ready."""
        if self._inputs is None:
            raise EngineNotReadyError("the engine is starting")
        return self._inputs

    async def _off_loop(self, fn: Callable[..., Any], *args: Any, quick: bool = False) -> Any:
        # quick (input_processor.QUICK_TEXT_CHARS): cheaper here, on the loop, than the hop to the thread
        loop = asyncio.get_running_loop()
        return fn(*args) if quick else await loop.run_in_executor(self._tokenizer_thread, fn, *args)

    async def tokenize_async(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (InvalidRequestError on "prompt"), on the tokenizer thread: the event
        loop serves other requests meanwhile."""
        return await self._off_loop(self.input_processor.tokenize, text, add_special_tokens)

    async def apply_chat_template_async(self, messages: list[dict], **kwargs: Any) -> list[int]:
        """Token ids of a conversation (InputProcessor.render_chat: same arguments, same errors), on
        the tokenizer thread unless it is small."""
        return await self._off_loop(functools.partial(self.input_processor.render_chat, messages, **kwargs),
                                    quick=quick_to_render(messages, kwargs.get("chat_template_kwargs")))

    async def process_inputs_async(self, prompt: Prompt, params: SamplingParams,
                                   add_special_tokens: bool = True) -> ProcessedPrompt:
        """The prompt tokenized, truncated and checked (InputProcessor.process) on the tokenizer
        thread unless it is small; pass the result to add_request with the same params and it is sent as is."""
        return await self._off_loop(self.input_processor.process, prompt, params, add_special_tokens,
                                    quick=quick_to_process(prompt, params))

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer")
        vocab = self.info.vocab_size
        if any(t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"token ids must be in [0, {vocab})")
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

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
        stats = self.latest_stats
        running = stats.num_running if stats is not None else 0
        return max(0, self.num_unfinished_sequences() - running)

    async def add_request(
        self,
        prompt: Prompt | ProcessedPrompt,
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        timeout: float | None = None,
        session: str | None = None,
        final_only: bool = False,
    ) -> RequestStream:
        """Check and send a request; returns its stream of delta outputs. (`session`: replicas' routing key;
        `final_only`: the stream yields one output, the whole of it, when the request ends.)

        `prompt` may be what `process_inputs_async` returned for these params: it is then sent as is.
        Raises InvalidRequestError for a bad request (nothing reaches the core), EngineDeadError,
        EngineNotReadyError. The server uses this so that a bad request gets its 400 before any
        streaming response starts. The caller must iterate the stream to its end or close it.
        """
        self._check_usable()
        if request_id is None:
            request_id = f"req-{next(self._request_ids)}"
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        processed = self.input_processor.ensure_processed(prompt, params)
        prompt_ids = processed.prompt_token_ids
        state = RequestState(request_id, params.n, final_only=final_only)
        self._requests[request_id] = state
        sent = 0
        try:
            state.child_ids = self.processor.add_request(request_id, processed.text, prompt_ids, params,
                                                         self.eos_token_id, delta=True)
            for cid in state.child_ids:
                self._child_to_parent[cid] = request_id
            for req in make_core_requests(state.child_ids, prompt_ids, params, self.eos_token_id, priority,
                                          time.time(), self.generation_defaults):
                self.client.send(EngineCoreRequestType.ADD, encode(req))
                sent += 1
        except EngineDeadError as exc:
            self._forget(request_id, abort=False)
            self.client.mark_dead(str(exc))
            raise
        except BaseException:
            # Anything else (e.g. a value msgpack cannot encode): forget the request, else it stays
            # "in flight" for good (a drain waits for it, the waiting-queue bound counts it), and
            # abort any children the core already has.
            self._forget(request_id, abort=sent > 0)
            raise
        timeout = timeout if timeout is not None else self.request_timeout
        return RequestStream(self._forget, state, timeout)

    async def generate(
        self,
        prompt: Prompt | ProcessedPrompt,
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

    def _forget(self, request_id: str, abort: bool) -> None:
        # Synchronous on purpose: runs in `finally` while the generator is closed or cancelled,
        # where awaiting is not allowed; the abort reaches the core at once.
        state = self._requests.pop(request_id, None)
        core_ids = self.processor.abort(request_id)
        for cid in state.child_ids if state is not None else ():
            self._child_to_parent.pop(cid, None)
        if abort and core_ids:
            self.client.send_or_mark_dead(EngineCoreRequestType.ABORT, encode(core_ids))
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
            self.client.send_or_mark_dead(EngineCoreRequestType.ABORT, encode(core_ids))
        state.queue.put_nowait(RequestAbortedError(f"request {request_id} was aborted"))

    # -- utility calls ---------------------------------------------------------------------------
    async def call_utility(self, method: str, *args: Any, timeout: float = 30.0) -> Any:
        """Run a utility method in the core (see CoreClient.call_utility)."""
        self._check_usable()
        return await self.client.call_utility(method, *args, timeout=timeout)

    async def engine_stats(self) -> EngineCoreStats:
        """A fresh snapshot from the core (after every input sent before this call was handled)."""
        return EngineCoreStats(**await self.call_utility("stats"))

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block; False (nothing done) while requests hold blocks."""
        return bool(await self.call_utility("reset_prefix_cache"))
