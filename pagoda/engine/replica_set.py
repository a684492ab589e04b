"""DataParallelLLM: N engine replicas behind one front door (`--data-parallel-size N`).

Each replica is an `AsyncLLM` with its own engine-core process, KV cache and (for TP/PP) its own
ranks. This object offers the `AsyncLLM` interface the server uses, and owns what is about several:

- routing: each request goes to the replica the `Router` (`pagoda.engine.routing`) picks from the
  replicas' loads (sequences in flight, known here at once) and the prefix index, which the
  replicas keep up to date with the KV events of their prefix caches; the decision is logged and
  shown as the first event of the request's timeline;
- failover: a replica whose core dies fails its requests (`EngineDeadError`); those that had not
  yielded anything yet are sent again to another replica (`FailoverStream`), those mid-stream end
  with the error. The dead replica is restarted with exponential back-off, up to `max_restarts`
  times in a row; the set is dead (and the server exits) only when no replica is left.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from pagoda.config import EngineArgs
from pagoda.contracts.messages import EngineCoreOutputs, EngineCoreStats
from pagoda.engine.async_llm import AsyncLLM
from pagoda.engine.errors import EngineDeadError, EngineNotReadyError
from pagoda.engine.failover_stream import FailoverStream
from pagoda.engine.input_processor import InputProcessor, ProcessedPrompt, Prompt
from pagoda.engine.prefix_index import block_hashes
from pagoda.engine.routing import RouteDecision, Router
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_MAX_ROUTES_KEPT = 10_000  # request id -> replica, for timelines of recently finished requests


@dataclass
class Replica:
    index: int
    engine: AsyncLLM
    status: str = "starting"  # starting, up, restarting, failed
    restarts: int = 0  # in a row, since it last served
    last_error: str | None = None

    def to_dict(self) -> dict:
        stats = self.engine.latest_stats if self.status == "up" else None
        return {"engine": str(self.index), "status": self.status, "restarts": self.restarts,
                "last_error": self.last_error, "pid": stats.pid if stats else None}


def sum_stats(stats: list[EngineCoreStats]) -> EngineCoreStats:
    """Counts added over replicas; KV usage as the mean."""
    out = EngineCoreStats()
    for s in stats:
        for name in ("num_running", "num_waiting", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions",
                     "num_blocks", "num_usable_blocks", "num_free_blocks", "num_steps", "num_aborted_requests",
                     "spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens"):
            setattr(out, name, getattr(out, name) + getattr(s, name))
    if stats:
        out.kv_usage = sum(s.kv_usage for s in stats) / len(stats)
    return out


class DataParallelLLM:
    """N `AsyncLLM` replicas behind the `AsyncLLM` interface."""

    def __init__(self, args: EngineArgs, *, routing_policy: str = "cache_aware", max_restarts: int = 5,
                 restart_backoff_s: float = 0.5, **engine_kwargs: Any) -> None:
        if args.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {args.data_parallel_size}")
        self.args = args
        self.router = Router(routing_policy)
        self.max_restarts = max_restarts
        self.restart_backoff_s = restart_backoff_s
        self._tokenizer = engine_kwargs.pop("tokenizer", "auto")
        self._engine_kwargs = engine_kwargs
        # Every replica's engine is built here, so that a bad model or device fails before any
        # process starts; they get the tokenizer, loaded once, at start().
        self.replicas = [Replica(i, self._new_engine(i)) for i in range(args.data_parallel_size)]
        self.source = self.replicas[0].engine.source
        self.generation_defaults = self.replicas[0].engine.generation_defaults  # the same model's, for all
        self.output_listeners: list[Callable[[EngineCoreOutputs, list[RequestOutput]], None]] = []
        self.abort_listeners: list[Callable[[str], None]] = []
        self._dead_callbacks: list[Callable[[str], None]] = []
        self.dead_reason: str | None = None
        self.ready = False
        self._info = None
        self.routes: OrderedDict[str, RouteDecision] = OrderedDict()
        self._tasks: set[asyncio.Task] = set()
        self._closing = False
        self._request_ids = itertools.count()

    def _new_engine(self, index: int, tokenizer: Any = "auto") -> AsyncLLM:
        engine = AsyncLLM(self.args, tokenizer=tokenizer, **self._engine_kwargs)
        engine.output_listeners.append(lambda msg, results: self._on_output(index, msg, results))
        engine.abort_listeners.append(self._on_abort)
        return engine

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start every replica at once; raises as AsyncLLM.start if any cannot start."""
        from pagoda.model.loader import load_tokenizer

        if self._tokenizer == "auto":
            # Once for all (concurrent first imports of transformers race), then shared by the replicas.
            self._tokenizer = await asyncio.to_thread(load_tokenizer, self.source)
        self.replicas = [Replica(r.index, self._new_engine(r.index, self._tokenizer)) for r in self.replicas]
        results = await asyncio.gather(*(r.engine.start() for r in self.replicas), return_exceptions=True)
        errors = [e for e in results if isinstance(e, BaseException)]
        if errors:
            await asyncio.gather(*(r.engine.shutdown() for r in self.replicas), return_exceptions=True)
            raise errors[0]
        for r in self.replicas:
            self._mark_up(r)
        self._info = self.replicas[0].engine.info
        self.ready = True
        logger.info("%d data-parallel replicas ready, routing %s", len(self.replicas), self.router.policy)

    def _mark_up(self, r: Replica) -> None:
        r.status, r.restarts = "up", 0
        engine = r.engine
        engine.add_dead_callback(lambda reason: self._on_replica_dead(r, engine, reason))

    def _on_replica_dead(self, r: Replica, engine: AsyncLLM, reason: str) -> None:
        if self._closing or r.engine is not engine or r.status not in ("up", "starting"):
            return
        r.status, r.last_error = "restarting", reason
        self.router.forget_replica(r.index)
        logger.error("replica %d died (%s); restarting it, %d replica(s) still serving",
                     r.index, reason, len(self._live()))
        task = asyncio.get_running_loop().create_task(self._restart(r), name=f"pagoda-replica-{r.index}-restart")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _restart(self, r: Replica) -> None:
        old = r.engine
        await old.shutdown()
        while not self._closing:
            if r.restarts >= self.max_restarts:
                r.status = "failed"
                logger.error("replica %d failed %d restarts in a row; giving up on it", r.index, r.restarts)
                if not self._live() and not any(x.status == "restarting" for x in self.replicas):
                    self._set_dead(f"every replica failed; the last: {r.last_error}")
                return
            await asyncio.sleep(self.restart_backoff_s * (2 ** r.restarts))
            r.restarts += 1
            engine = self._new_engine(r.index, self._tokenizer)
            r.engine = engine
            try:
                await engine.start()
            except Exception as exc:
                r.last_error = str(exc)
                logger.error("replica %d restart %d failed: %s", r.index, r.restarts, exc)
                await engine.shutdown()
                continue
            if self._closing:
                await engine.shutdown()
                return
            logger.info("replica %d serves again (restart %d)", r.index, r.restarts)
            self._mark_up(r)
            return

    def _set_dead(self, reason: str) -> None:
        self.dead_reason = reason
        self.ready = False
        for cb in list(self._dead_callbacks):
            try:
                cb(reason)
            except Exception:
                logger.exception("engine-dead callback failed")

    def add_dead_callback(self, cb: Callable[[str], None]) -> None:
        """`cb(reason)` runs when no replica serves any more and none will again."""
        self._dead_callbacks.append(cb)
        if self.dead_reason is not None:
            cb(self.dead_reason)

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    async def shutdown(self) -> None:
        self._closing = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*(r.engine.shutdown() for r in self.replicas), return_exceptions=True)
        self.ready = False

    # -- replicas ------------------------------------------------------------------------------
    def _live(self) -> list[Replica]:
        return [r for r in self.replicas if r.status == "up" and not r.engine.is_dead]

    def _first(self) -> AsyncLLM:
        live = self._live()
        if not live:
            if self.is_dead:
                raise EngineDeadError(self.dead_reason)
            raise EngineNotReadyError("no replica is serving (restarting)")
        return live[0].engine

    def replica_loads(self) -> dict[int, int]:
        """Sequences in flight per live replica (running + waiting in its core, as sent from here)."""
        return {r.index: r.engine.num_unfinished_sequences() for r in self._live()}

    def replica_status(self) -> list[dict]:
        return [r.to_dict() for r in self.replicas]

    def stats_by_replica(self) -> dict[str, EngineCoreStats]:
        """Each serving replica's latest snapshot, by its `engine` label."""
        return {str(r.index): r.engine.latest_stats for r in self._live() if r.engine.latest_stats is not None}

    @property
    def latest_stats(self) -> EngineCoreStats | None:
        stats = list(self.stats_by_replica().values())
        return sum_stats(stats) if stats else None

    def _on_output(self, index: int, msg: EngineCoreOutputs, results: list[RequestOutput]) -> None:
        if msg.kv_events is not None:
            self.router.index.apply_events(index, msg.kv_events)
        for listener in self.output_listeners:
            try:
                listener(msg, results)
            except Exception:
                logger.exception("output listener failed")

    def _on_abort(self, request_id: str) -> None:
        for listener in self.abort_listeners:
            try:
                listener(request_id)
            except Exception:
                logger.exception("abort listener failed")

    # -- model facts and inputs: any replica's (they serve the same model) -----------------------
    @property
    def info(self):
        """The model's facts, from the first start (a replica restarting has none until it is ready)."""
        return self._info

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer if self._tokenizer != "auto" else None

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def model_name(self) -> str:
        return self.info.model_name

    @property
    def input_processor(self) -> InputProcessor:
        return self._first().input_processor

    async def tokenize_async(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._first().tokenize_async(text, add_special_tokens)

    async def apply_chat_template_async(self, messages: list[dict], **kwargs: Any) -> list[int]:
        return await self._first().apply_chat_template_async(messages, **kwargs)

    async def process_inputs_async(self, prompt: Prompt, params: SamplingParams,
                                   add_special_tokens: bool = True) -> ProcessedPrompt:
        return await self._first().process_inputs_async(prompt, params, add_special_tokens)

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._first().detokenize(token_ids, skip_special_tokens)

    # -- requests --------------------------------------------------------------------------------
    def num_inflight_requests(self) -> int:
        return sum(r.engine.num_inflight_requests() for r in self.replicas)

    def num_unfinished_sequences(self) -> int:
        return sum(r.engine.num_unfinished_sequences() for r in self._live())

    def estimated_num_waiting(self) -> int:
        return sum(r.engine.estimated_num_waiting() for r in self._live())

    def abort_all(self) -> None:
        for r in self.replicas:
            r.engine.abort_all()

    def abort(self, request_id: str) -> None:
        route = self.routes.get(request_id)
        if route is not None:
            self.replicas[route.replica].engine.abort(request_id)

    async def add_request(self, prompt: Prompt | ProcessedPrompt, params: SamplingParams,
                          request_id: str | None = None, priority: int = 0, timeout: float | None = None,
                          session: str | None = None, final_only: bool = False) -> FailoverStream:
        """Route and send a request (see AsyncLLM.add_request); its stream moves to another replica
        if its replica dies before it yielded anything."""
        engine = self._first()
        if request_id is None:
            request_id = f"req-{next(self._request_ids)}"
        processed = engine.input_processor.ensure_processed(prompt, params)

        async def submit(exclude: set[int]) -> tuple[int, Any]:
            loads = {i: n for i, n in self.replica_loads().items() if i not in exclude}
            if not loads:
                raise EngineDeadError(self.dead_reason or "no replica is serving")
            hashes = []
            if self.router.policy in ("cache_aware", "session") and processed.prompt_token_ids:
                hashes = block_hashes(processed.prompt_token_ids, self.info.block_size)
            decision = self.router.choose(loads, hashes, session)
            self._remember(request_id, decision)
            logger.info("routed to replica %d (%s, %s): %d/%d prompt blocks matched, loads %s",
                        decision.replica, decision.policy, decision.reason, decision.matched_blocks,
                        decision.prompt_blocks, decision.loads, extra={"request_id": request_id})
            replica = self.replicas[decision.replica]
            stream = await replica.engine.add_request(processed, params, request_id, priority, timeout,
                                                      final_only=final_only)
            return decision.replica, stream

        replica, stream = await submit(set())
        return FailoverStream(request_id, replica, stream, submit)

    def _remember(self, request_id: str, decision: RouteDecision) -> None:
        self.routes[request_id] = decision
        self.routes.move_to_end(request_id)
        while len(self.routes) > _MAX_ROUTES_KEPT:
            self.routes.popitem(last=False)

    async def generate(self, prompt: Prompt | ProcessedPrompt, params: SamplingParams, request_id: str | None = None,
                       priority: int = 0, timeout: float | None = None, session: str | None = None):
        stream = await self.add_request(prompt, params, request_id, priority, timeout, session)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    # -- utility calls -------------------------------------------------------------------------------
    async def call_utility(self, method: str, *args: Any, timeout: float = 30.0) -> Any:
        """A request's timeline comes from its replica, with the routing decision first; any other
        call goes to the first serving replica."""
        if method == "timeline" and args:
            return await self._timeline(args[0], timeout)
        return await self._first().call_utility(method, *args, timeout=timeout)

    async def _timeline(self, request_id: str, timeout: float) -> list[dict]:
        # A completion of several prompts sent them as `id-0`, `id-1`, ..., each routed by itself.
        parts = [(rid, d) for rid, d in self.routes.items()
                 if rid == request_id or (rid.startswith(request_id + "-") and rid[len(request_id) + 1:].isdigit())]
        out: list[dict] = []
        for rid, route in parts:
            replica = self.replicas[route.replica]
            if replica.status != "up":
                continue
            for seq in await replica.engine.call_utility("timeline", rid, timeout=timeout):
                seq.setdefault("events", []).insert(0, route.to_dict())
                out.append(seq)
        return out

    async def engine_stats(self) -> EngineCoreStats:
        stats = await asyncio.gather(*(r.engine.engine_stats() for r in self._live()))
        return sum_stats(list(stats))

    async def reset_prefix_cache(self) -> bool:
        done = await asyncio.gather(*(r.engine.reset_prefix_cache() for r in self._live()))
        return all(done)
