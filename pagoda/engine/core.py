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
from pagoda.contracts.messages import EngineCoreOutput, EngineCoreRequest, EngineCoreStats
from pagoda.contracts.step import SchedulerOutput
from pagoda.engine.prompt_logprob_store import PromptLogprobStore
from pagoda.engine.timeline import TimelineStore
from pagoda.exec.model_runner import ModelRunner
from pagoda.exec.paged_attention import PagedKVCache
from pagoda.exec.spec_setup import make_spec_decoder
from pagoda.exec.structured_output import StructuredOutputs
from pagoda.kv.manager import KVCacheManager
from pagoda.model.loader import LoadedModel, load_model, load_tokenizer
from pagoda.sched.config import SchedulerConfig
from pagoda.sched.request import Request, RequestStatus
from pagoda.sched.scheduler import Scheduler

logger = logging.getLogger(__name__)

_DEFAULT_CPU_KV_BYTES = 2 * 1024**3


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class EngineCore:
    def __init__(self, args: EngineArgs, loaded: LoadedModel | None = None) -> None:
        self.args = args
        self.device = pick_device(args.device)
        torch.manual_seed(args.seed)
        self.loaded = loaded or load_model(args.model, args.dtype, self.device)
        config = self.loaded.config
        self.max_model_len = resolve_max_model_len(args.max_model_len, config)
        self.kv_cache = self._make_kv_cache()
        self.kv_manager = KVCacheManager(
            self.kv_cache.num_blocks, args.block_size, enable_prefix_caching=args.enable_prefix_caching
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
            ),
            self.kv_manager,
        )
        self.runner = ModelRunner(
            self.loaded.model,
            self.kv_cache,
            vocab_size=config.vocab_size,
            max_num_seqs=args.max_num_seqs,
            max_model_len=self.max_model_len,
            device=self.device,
            enforce_eager=args.enforce_eager,
            structured_outputs=StructuredOutputs(self._tokenizer_and_eos, config.vocab_size),
            spec_decoder=make_spec_decoder(args, config.vocab_size, self.device, self.kv_cache, self.max_model_len,
                                           self.loaded.dtype),
        )
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

    def _tokenizer_and_eos(self) -> tuple[Any, int | None]:
        # In-process (LLMEngine) the front end's tokenizer, which may be one it was given.
        tokenizer = self.tokenizer if self.tokenizer is not None else load_tokenizer(self.loaded.source)
        return tokenizer, eos_token_id_of(tokenizer, self.loaded.config)

    def _kv_cache_dtype(self) -> torch.dtype:
        name = self.args.kv_cache_dtype
        if name == "auto":
            return self.loaded.dtype
        if self.device.type != "cpu":
            # The Triton kernels have not been checked against a cache dtype other than the model's.
            raise ValueError(f"kv_cache_dtype={name!r} is supported on the CPU only; use 'auto' on {self.device.type}")
        return getattr(torch, name)

    def _make_kv_cache(self) -> PagedKVCache:
        args, cfg = self.args, self.loaded.config
        kv_dtype = self._kv_cache_dtype()
        num_kv_heads = cfg.num_key_value_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        per_block = PagedKVCache.bytes_per_block(
            cfg.num_hidden_layers, args.block_size, num_kv_heads, head_dim, kv_dtype
        )
        if args.num_gpu_blocks_override:
            num_blocks = args.num_gpu_blocks_override
        else:
            budget = args.kv_cache_memory
            if budget is None:
                if self.device.type == "cuda":
                    from pagoda.exec.kv_sizing import profile_kv_budget  # a profiling forward at the token budget

                    budget = profile_kv_budget(self.loaded.model, args, self.max_model_len, cfg.num_hidden_layers,
                                               num_kv_heads, head_dim, kv_dtype, self.device)
                else:
                    budget = _DEFAULT_CPU_KV_BYTES
            num_blocks = budget // per_block
        if num_blocks < 2:
            raise ValueError(f"KV cache too small: {num_blocks} blocks of {per_block} bytes")
        logger.info(
            "KV cache: %d blocks of %d tokens, %s (%.1f MiB)",
            num_blocks, args.block_size, str(kv_dtype).removeprefix("torch."), num_blocks * per_block / 2**20,
        )
        return PagedKVCache(cfg.num_hidden_layers, num_blocks, args.block_size, num_kv_heads, head_dim, kv_dtype, self.device)

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
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
        self.runner.release(request_ids)
        self._end_from_outside(counts, "abort")

    def finish_requests(self, request_ids: list[str]) -> None:
        """End requests that the front end stopped (a stop string matched)."""
        counts = self._output_counts(request_ids)
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)
        self.runner.release(request_ids)
        self._end_from_outside(counts, "stop")

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
        started = time.time()
        so = self.scheduler.schedule()
        if so.is_empty:
            return []
        self._record_schedule(so, started)
        result = self.runner.execute(so)
        if result.prompt_logprobs:
            requests = self.scheduler.requests
            for rid, (start, rows) in result.prompt_logprobs.items():
                requests[rid].advance_prompt_logprobs(self.prompt_logprobs.add(rid, start, rows))
        # Tokens known when scheduled, so outputs before this step: num_tokens - num_prompt_tokens.
        known = {s.request_id: s.num_tokens for s in so.scheduled}
        changed = self.scheduler.update(so, result.sampled_token_ids)
        if result.draft_token_ids:
            self.scheduler.update_draft_token_ids(result.draft_token_ids)
        self.num_steps += 1
        if self.record_iteration_tokens:
            self.iteration_tokens.append(so.total_num_scheduled_tokens)
        now = time.time()
        ended = [r.request_id for r in changed if r.finish_reason is not None]
        if ended:
            self.runner.release(ended)
        outputs = []
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
        return outputs

    def _record_schedule(self, so: SchedulerOutput, now: float) -> None:
        """Timeline entries of one step: admissions, prefill chunks (not decodes) and preemptions."""
        timelines = self.timelines.live
        requests = self.scheduler.requests
        for s in so.scheduled:
            is_new = s.is_new
            if is_new:
                resumed = requests[s.request_id].num_preemptions > 0
                timelines[s.request_id].admitted(now, s.num_computed_tokens, resumed)
            if is_new or s.num_new_tokens - len(s.spec_token_ids) != 1 or s.num_computed_tokens + 1 < s.num_tokens:
                timelines[s.request_id].prefill_chunk(now, s.num_computed_tokens, s.num_new_tokens)
        if so.preempted_request_ids:
            for rid in so.preempted_request_ids:
                timelines[rid].preempted(now, requests[rid].num_output_tokens)

    def timeline(self, request_id: str) -> list[dict]:
        """Timelines of a live or recently finished request (several for n > 1); [] when unknown."""
        return self.timelines.lookup(request_id)

    def pop_iteration_tokens(self) -> list[int]:
        tokens, self.iteration_tokens = self.iteration_tokens, []
        return tokens

    def stats(self) -> EngineCoreStats:
        """The scheduler's and KV cache's counters (requests deferred behind a sibling count as waiting)."""
        s = self.scheduler.stats()
        kv = self.kv_manager
        return EngineCoreStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting + sum(len(v) for v in self._deferred.values()),
            kv_usage=s.kv_usage,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            spec_num_drafts=s.spec_num_drafts,
            spec_num_draft_tokens=s.spec_num_draft_tokens,
            spec_num_accepted_tokens=s.spec_num_accepted_tokens,
            spec_num_accepted_tokens_per_pos=s.spec_num_accepted_tokens_per_pos,
            num_blocks=self.kv_cache.num_blocks,
            num_usable_blocks=kv.num_usable_blocks,
            num_free_blocks=kv.num_free_blocks,
            num_steps=self.num_steps,
        )
