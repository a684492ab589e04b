"""The engine core: model, KV cache, scheduler and runner, and the one loop that drives them.

Each `step()` takes the scheduler's decision, runs it, feeds the sampled tokens back and returns
plain `EngineCoreOutput`s (token ids, no text). The core runs in-process for `LLM` and in its own
process behind the server.

What the engine keeps per request lives here, by request id, not on the scheduler's `Request`: its
timeline (`TimelineStore`) and its prompt-logprob rows until the first output (`PromptLogprobStore`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from pagoda.config import EngineArgs
from pagoda.engine.context_length import resolve_max_model_len
from pagoda.engine.input_processor import eos_token_id_of
from pagoda.engine.kv_layout import bytes_per_block, kv_cache_dtype, make_kv_cache, num_kv_blocks
from pagoda.engine.kv_tiers import (SwapCostMeter, attach_offloader, check_offload_config, offload_stats, second_tier,
                                    tier_sources)
from pagoda.contracts.messages import EngineCoreOutput, EngineCoreRequest, EngineCoreStats, KVCacheEvents
from pagoda.contracts.step import SchedulerOutput
from pagoda.engine.prompt_logprob_store import PromptLogprobStore
from pagoda.engine.timeline import TimelineStore
from pagoda.engine.weight_lifecycle import WeightLifecycle
from pagoda.exec.cpu_kv_sizing import max_cached_free_blocks
from pagoda.exec.cpu_memory import heap_free_bytes, trim_heap
from pagoda.exec.executor import Executor, UniExecutor, check_parallel_config, resolve_backend
from pagoda.exec.model_runner import ModelRunner
from pagoda.exec.paged_attention import PagedKVCache
from pagoda.exec.spec_setup import make_spec_decoder
from pagoda.exec.structured_output import StructuredOutputs
from pagoda.kv.manager import KVCacheManager
from pagoda.kv.working_set import WorkingSetTrimmer
from pagoda.model.loader import LoadedModel, describe_model, load_model, load_tokenizer
from pagoda.model.model_source import tokenizer_source
from pagoda.sched.config import SchedulerConfig
from pagoda.sched.request import Request, RequestStatus
from pagoda.sched.scheduler import Scheduler

logger = logging.getLogger(__name__)

# Free heap memory kept for the next steps' activations (faulting it in again costs ~10 us a page).
_HEAP_FREE_KEPT = 256 * 1024**2


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class EngineCore:
    def __init__(self, args: EngineArgs, loaded: LoadedModel | None = None) -> None:
        self.args = args
        self.device = pick_device(args.device)
        torch.manual_seed(args.seed)
        tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
        backend = resolve_backend(args.distributed_executor_backend, tp * pp)
        check_parallel_config(tp, pp, backend, self.device)
        check_offload_config(args, backend)
        if backend == "uni":
            self.loaded = loaded or load_model(args.model, args.dtype, self.device, args.quantization)
        elif args.speculative_config is not None:
            raise ValueError(f"speculative decoding runs in one process only (--distributed-executor-backend uni), "
                             f"not with {backend!r}")
        else:  # the workers load their shards; this process needs the config only
            self.loaded = describe_model(args.model, args.dtype, self.device)
            check_parallel_config(tp, pp, backend, self.device, self.loaded.config, args.enable_expert_parallel)
        config = self.loaded.config
        self.max_model_len = resolve_max_model_len(args.max_model_len, config)
        num_blocks = num_kv_blocks(args, self.loaded, self.device, self.max_model_len)
        # On the CPU the pool is lazily resident: bound what cached prefixes keep (pagoda.kv.block_pool).
        on_cpu = self.device.type == "cpu"
        self.kv_manager = KVCacheManager(
            num_blocks, args.block_size, enable_prefix_caching=args.enable_prefix_caching,
            max_cached_free_blocks=max_cached_free_blocks(num_blocks) if on_cpu else None,
            offload=second_tier(args, bytes_per_block(self.args, self.loaded, self.device)),
        )
        # Without chunking a prompt must fit one step.
        budget = args.max_num_batched_tokens
        if not args.enable_chunked_prefill:
            budget = max(budget, self.max_model_len)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=budget,
                max_model_len=self.max_model_len,
                enable_chunked_prefill=args.enable_chunked_prefill,
                long_prefill_token_threshold=args.long_prefill_token_threshold,
                policy=args.scheduling_policy,
                preemption_mode=args.preemption_mode,
            ),
            self.kv_manager,
        )
        # In-process (uni) the runner and the KV cache are here too; else each worker holds its own.
        self.kv_cache: PagedKVCache | None = None
        self.runner: ModelRunner | None = None
        self.swap_meter: SwapCostMeter | None = None
        self.executor: Executor
        if backend == "uni":
            self.kv_cache = make_kv_cache(self.args, self.loaded, self.device, num_blocks)
            self.runner = ModelRunner(
                self.loaded.model,
                self.kv_cache,
                vocab_size=config.vocab_size,
                max_num_seqs=args.max_num_seqs,
                max_model_len=self.max_model_len,
                device=self.device,
                enforce_eager=args.enforce_eager,
                structured_outputs=StructuredOutputs(self._tokenizer_and_eos, config.vocab_size),
                spec_decoder=make_spec_decoder(args, config.vocab_size, self.device, self.kv_cache,
                                               self.max_model_len, self.loaded.dtype),
            )
            offloader = None
            if self.kv_manager.tier is not None:
                offloader = attach_offloader(args, self.loaded.source.path, self.kv_cache, self.kv_manager, "builtin")
            self.swap_meter = SwapCostMeter(self.scheduler, offloader) if args.preemption_mode == "swap" else None
            self.executor = UniExecutor(self.runner, offloader)
        else:
            from pagoda.exec.executor import make_distributed_executor

            self.executor = make_distributed_executor(args, backend, num_blocks, self.max_model_len,
                                                      str(kv_cache_dtype(self.args, self.loaded, self.device)).removeprefix("torch."))
        # Giving free blocks' pages back needs the cache in this process: in-process (uni) on the CPU.
        # (The workers of mp and ray hold their shards; their pages are not given back yet.)
        local_cache = self.kv_cache is not None and self.kv_cache.can_release
        self.kv_trimmer = WorkingSetTrimmer(self.kv_manager.block_pool, now=time.monotonic()) if local_cache else None
        self._next_heap_check = 0.0
        # The front end's tokenizer when it runs in this process (set by LLMEngine); structured
        # outputs need one, and otherwise load their own on first use.
        self.tokenizer: Any = None
        # Requests waiting for another request's prompt to be computed (n > 1 siblings).
        self._deferred: dict[str, list[Request]] = {}
        self.num_steps = 0
        self.timelines = TimelineStore()
        self.prompt_logprobs = PromptLogprobStore()
        # Tokens scheduled per step, for the tokens-per-iteration histogram; the core process drains
        # it with every message (offline, nothing reads it, so it stays off).
        self.record_iteration_tokens = False
        self.iteration_tokens: list[int] = []
        self.lifecycle = WeightLifecycle(self, args.weight_version)  # version, hot updates, sleep

    def _tokenizer_and_eos(self) -> tuple[Any, int | None]:
        # In-process (LLMEngine) the front end's tokenizer, which may be one it was given.
        tokenizer = self.tokenizer if self.tokenizer is not None else load_tokenizer(
            tokenizer_source(self.loaded.source, self.args.tokenizer))
        return tokenizer, eos_token_id_of(tokenizer, self.loaded.config)

    def runner_is_local(self) -> bool:
        return self.loaded.model is not None

    def check_health(self) -> None:
        """Raise WorkerDiedError when a rank of the executor is gone."""
        self.executor.check_health()

    def shutdown(self) -> None:
        self.executor.shutdown()

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
        if self.lifecycle.hold(req):  # arrived while a weight update drains: runs on the new weights
            return
        extra = (req.cache_salt,) if req.cache_salt else ()
        request = Request(
            req.request_id,
            req.prompt_token_ids,
            req.sampling_params,
            eos_token_id=req.eos_token_id,
            arrival_time=req.arrival_time or time.time(),
            priority=req.priority,
            extra_keys=extra,
        )
        rid = request.request_id
        if self.has_request(rid):
            raise ValueError(f"request id {rid!r} is already in use")
        self.timelines.start(rid, time.time())
        if req.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs.start(rid)
        try:
            leader = req.share_prompt_with
            if leader is not None and self.kv_manager.enable_prefix_caching and leader in self.scheduler.requests:
                lead = self.scheduler.requests[leader]
                if lead.num_computed_tokens < lead.num_prompt_tokens:
                    self._deferred.setdefault(leader, []).append(request)
                    return
            self.scheduler.add_request(request)
        except Exception:
            self.timelines.live.pop(rid, None)  # refused: no timeline to keep
            self.prompt_logprobs.drop(rid)
            raise

    def abort_requests(self, request_ids: list[str]) -> None:
        ids = set(request_ids)
        for leader, followers in list(self._deferred.items()):
            self._deferred[leader] = [r for r in followers if r.request_id not in ids]
        counts = self._output_counts(request_ids)
        self.scheduler.abort_requests(request_ids)
        self.executor.release(request_ids)
        self._end_from_outside(counts, "abort")
        self.flush_kv_transfers()

    def finish_requests(self, request_ids: list[str]) -> None:
        """End requests that the front end stopped (a stop string matched)."""
        counts = self._output_counts(request_ids)
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)
        self.executor.release(request_ids)
        self._end_from_outside(counts, "stop")
        self.flush_kv_transfers()

    def _output_counts(self, request_ids: list[str]) -> dict[str, int]:
        reqs = self.scheduler.requests
        return {rid: reqs[rid].num_output_tokens if rid in reqs else 0 for rid in request_ids}

    def _end_from_outside(self, output_counts: dict[str, int], reason: str) -> None:
        """Ended from outside (abort, stop string): close their timelines, drop their rows."""
        now = time.time()
        for rid, n_out in output_counts.items():
            self.timelines.end(rid, now, reason, n_out)
            self.prompt_logprobs.drop(rid)

    def has_request(self, request_id: str) -> bool:
        """True while the request is unfinished (scheduled, waiting, or deferred behind a sibling)."""
        if request_id in self.scheduler.requests:
            return True
        return any(r.request_id == request_id for reqs in self._deferred.values() for r in reqs)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or any(self._deferred.values())

    def flush_kv_transfers(self) -> None:
        """Run the copies between the KV tiers ordered while no request runs (the last ones' saves)."""
        if self.kv_manager.has_pending_transfers() and not self.scheduler.has_unfinished_requests():
            so = self.scheduler.schedule()
            result = self.executor.execute(so)
            self.scheduler.update(so, {}, result.kv_failed_saves)
    def has_work(self) -> bool:
        """Requests to step, held ones, or a weight update to finish."""
        return self.has_unfinished_requests() or self.lifecycle.busy

    def _release_deferred(self) -> None:
        for leader in list(self._deferred):
            lead = self.scheduler.requests.get(leader)
            if lead is None or lead.num_computed_tokens >= lead.num_prompt_tokens:
                for request in self._deferred.pop(leader):
                    self.scheduler.add_request(request)

    # -- the loop ------------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        if self._deferred:
            self._release_deferred()
        outputs = self.lifecycle.poll() if self.lifecycle.busy else []  # a weight swap falls between steps
        started = time.time()
        so = self.scheduler.schedule()
        if so.is_empty:
            return outputs
        self.timelines.record_step(so, self.scheduler.requests, started, tier_sources(self.kv_manager))
        result = self.executor.execute(so)
        if self.swap_meter is not None:
            self.swap_meter.observe(so.total_num_scheduled_tokens, len(so.scheduled), time.time() - started)
        if result.prompt_logprobs:
            requests = self.scheduler.requests
            for rid, (start, rows) in result.prompt_logprobs.items():
                requests[rid].advance_prompt_logprobs(self.prompt_logprobs.add(rid, start, rows))
        # Tokens known when scheduled, so outputs before this step: num_tokens - num_prompt_tokens.
        known = {s.request_id: s.num_tokens for s in so.scheduled}
        changed = self.scheduler.update(so, result.sampled_token_ids, result.kv_failed_saves)
        if result.draft_token_ids:
            self.scheduler.update_draft_token_ids(result.draft_token_ids)
        self.num_steps += 1
        if self.kv_trimmer is not None:
            self.trim_kv_memory()
        if self.record_iteration_tokens:
            self.iteration_tokens.append(so.total_num_scheduled_tokens)
        now = time.time()
        ended = [r.request_id for r in changed if r.finish_reason is not None]
        if ended:
            self.executor.release(ended)
        timelines = self.timelines.live
        for request in changed:
            rid = request.request_id
            # Stop handling may cut tokens of a multi-token step: report what was appended.
            n_before = known[rid] - request.num_prompt_tokens
            new_ids = request.output_token_ids[n_before:]
            n_out = n_before + len(new_ids)
            tl = timelines[rid]
            tl.token(now, n_out, len(new_ids))
            lp = result.logprobs.get(rid)
            out = EngineCoreOutput(
                request_id=rid,
                new_token_ids=list(new_ids),
                new_logprobs=lp[: len(new_ids)] if lp is not None and new_ids else None,
                finish_reason=request.finish_reason,
                stop_reason=request.stop_reason,
                num_cached_tokens=request.num_cached_tokens,
            )
            if n_before == 0:  # the first output: when the request was queued and first scheduled
                out.queued_time = tl.arrival_time
                out.scheduled_time = tl.first_scheduled or 0.0
                out.prompt_logprobs = self.prompt_logprobs.take(rid)
            if request.finish_reason is not None:
                self.timelines.end(rid, now, request.finish_reason, n_out)
            outputs.append(out)
        self.flush_kv_transfers()
        return outputs

    def timeline(self, request_id: str) -> list[dict]:
        """Timelines of a live or recently finished request (several for n > 1); [] when unknown."""
        return self.timelines.lookup(request_id)

    def trim_kv_memory(self, now: float | None = None) -> int:
        """Give back the memory of free KV blocks beyond the recent peak in use (CPU; a no-op until a
        trim window has passed) and, at most once a window, the heap's free memory when it exceeds
        `_HEAP_FREE_KEPT`. Returns the KV bytes released. Called between steps and when idle."""
        if self.kv_trimmer is None:
            return 0
        now = time.monotonic() if now is None else now
        ids = self.kv_trimmer.blocks_to_release(now)
        released = self.kv_cache.release_blocks(ids) if ids else 0
        if now >= self._next_heap_check:
            self._next_heap_check = now + self.kv_trimmer.window_s
            # Steps of ever-different shapes fragment the heap, which malloc (kept from trimming,
            # cpu_memory.keep_freed_memory) would otherwise let grow for as long as the server runs.
            free = heap_free_bytes()
            if ids or (free is not None and free > _HEAP_FREE_KEPT):
                trim_heap()
        return released

    def pop_kv_events(self) -> KVCacheEvents | None:
        """What the prefix cache published and dropped since the last call (None: nothing); the core
        process records them (`BlockPool.record_events`) and sends them with its next message."""
        stored, removed, cleared = self.kv_manager.block_pool.pop_events()
        if not (stored or removed or cleared):
            return None
        return KVCacheEvents(stored=stored, removed=removed, cleared=cleared)

    def pop_iteration_tokens(self) -> list[int]:
        tokens, self.iteration_tokens = self.iteration_tokens, []
        return tokens

    def stats(self) -> EngineCoreStats:
        """The scheduler's and KV cache's counters (requests deferred behind a sibling count as waiting)."""
        s = self.scheduler.stats()
        kv = self.kv_manager
        return EngineCoreStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting + sum(len(v) for v in self._deferred.values()) + self.lifecycle.num_held,
            kv_usage=s.kv_usage,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            spec_num_drafts=s.spec_num_drafts,
            spec_num_draft_tokens=s.spec_num_draft_tokens,
            spec_num_accepted_tokens=s.spec_num_accepted_tokens,
            spec_num_accepted_tokens_per_pos=s.spec_num_accepted_tokens_per_pos,
            **offload_stats(s, bytes_per_block(self.args, self.loaded, self.device)),
            num_blocks=kv.num_blocks,
            num_usable_blocks=kv.num_usable_blocks,
            num_free_blocks=kv.num_free_blocks,
            num_steps=self.num_steps,
        )
