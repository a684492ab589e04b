"""The scheduler: every step, which requests advance and by how many tokens.

One loop, no prefill/decode phases: each request's num_computed_tokens catches up with its
num_tokens. A step spends the token budget on running requests first (decodes and ongoing prefill
chunks, in admission order), then admits waiting requests in policy order. When the KV pool is full
it preempts, by recompute or (`preemption_mode="swap"`) by swapping the victim's blocks to the KV
manager's second tier. The copies the KV manager orders between the tiers travel in the step
(`kv_loads`, `kv_saves`) and are done when update() is called. update() takes the sampled tokens back, applies stop conditions and frees
finished requests.

Speculative decoding: the runner proposes draft tokens for a request (`update_draft_token_ids`); a
request whose known tokens are all scheduled takes its drafts along in the next step, counted against
the token budget and given KV slots like any token. update() gets back the accepted drafts plus one
token, counts the rejected ones out of num_computed_tokens and gives back the blocks that only they
needed; since blocks are published only up to num_computed_tokens, a block's hash enters the cache
only once all its tokens are verified.

Each schedule() must be followed by exactly one update() with that output before the next
schedule(): num_computed_tokens only advances in update().

The step it returns is plain data (`pagoda.contracts.step`): requests are named by id, a request's
prompt and sampling parameters go out once, when it is (re)admitted, and every row carries the token
ids it computes, so building a step costs O(scheduled rows + tokens computed), not O(contexts).
"""

from __future__ import annotations

from collections.abc import Iterable

from pagoda.contracts.step import NewRequestData, ScheduledRequest, SchedulerOutput, SchedulerStats
from pagoda.kv.manager import KVCacheManager
from pagoda.sched.config import SchedulerConfig
from pagoda.sched.queues import make_waiting_queue
from pagoda.sched.request import Request, RequestStatus
from pagoda.sched.spec_stats import SpecDecodeCounters

_RUNNING = RequestStatus.RUNNING


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting = make_waiting_queue(config.policy)
        self.running: list[Request] = []  # admission order
        self._finished_ids: list[str] = []  # since the last schedule()
        self.num_preemptions = 0
        self.spec_stats = SpecDecodeCounters()
        # Swap mode: (seconds to copy a block one way, seconds to compute a token), measured by the
        # engine; None: swap whenever the second tier has room.
        self.swap_costs: tuple[float, float] | None = None

    # -- requests in and out ---------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        n = request.num_prompt_tokens
        max_len = self.config.max_model_len
        if n == 0:
            raise ValueError(f"request {rid!r} has an empty prompt")
        if n > max_len:
            raise ValueError(f"request {rid!r}: prompt of {n} tokens exceeds max_model_len {max_len}")
        # A request that can never fit in the whole pool would be preempted and resumed forever.
        max_tokens = request.max_tokens
        longest = max_len if max_tokens is None else min(n + max_tokens, max_len)
        need = -(-longest // self.kv.block_size)
        if need > self.kv.num_usable_blocks:
            raise ValueError(
                f"request {rid!r} may need {need} KV blocks, the pool has {self.kv.num_usable_blocks}"
            )
        self.kv.bind(request)
        # max_tokens and max_model_len folded into one cap on output tokens, checked per token.
        request.stop_conditions = request.stop_conditions.capped(longest - n)
        request.status = RequestStatus.WAITING
        self.requests[rid] = request
        self.waiting.push(request)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """End requests from outside (a stop string matched, an abort). Unknown ids are ignored."""
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        # Deduplicated, in the caller's order (finished_request_ids reports them in that order).
        ids = dict.fromkeys(rid for rid in request_ids if rid in self.requests)
        if not ids:
            return
        ended = [self.requests[rid] for rid in ids]
        if any(r.status is _RUNNING for r in ended):
            self.running = [r for r in self.running if r.request_id not in ids]
        if any(r.status is not _RUNNING for r in ended):
            self.waiting.remove_all(ids)
        for request in ended:
            self._finish(request, status)

    def abort_requests(self, request_ids: str | Iterable[str]) -> None:
        self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Common end of a request; the caller has taken it out of running/waiting."""
        request.status = status
        request.finish_reason = status.finish_reason
        self.kv.free(request)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)

    # -- counts ------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def stats(self) -> SchedulerStats:
        pc = self.kv.prefix_cache_stats
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_usage=self.kv.usage,
            prefix_cache_queries=pc.queries,
            prefix_cache_hits=pc.hits,
            num_preemptions=self.num_preemptions,
            **self.spec_stats.as_fields(),
            **_offload_fields(self.kv),
        )

    # -- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        kv = self.kv
        budget = cfg.max_num_batched_tokens
        cap = cfg.long_prefill_token_threshold if cfg.enable_chunked_prefill else 0
        out = SchedulerOutput(finished_request_ids=self._finished_ids)
        self._finished_ids = []
        scheduled = out.scheduled
        num_scheduled = out.num_scheduled_tokens
        running = self.running

        # 1. Running requests: decodes and unfinished prefill chunks.
        bs = kv.block_size
        tables = kv.req_to_block_ids
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            rid = request.request_id
            num_computed = request.num_computed_tokens
            all_ids = request.all_token_ids
            num_tokens = len(all_ids)
            num_new = num_tokens - num_computed
            if num_new <= 0:
                i += 1  # nothing known to compute (no token was sampled for it yet)
                continue
            if cap and num_new > cap:
                num_new = cap
            if num_new > budget:
                num_new = budget
            spec = request.spec_token_ids
            if spec:
                request.spec_token_ids = []  # proposed for this step only
                if num_new == num_tokens - num_computed:
                    # All known tokens fit: the drafts follow, within the budget, and never past the
                    # output cap (a draft there could not be kept; the last token is sampled on top).
                    room = request.stop_conditions.max_output_tokens - request.num_output_tokens - 1
                    spec = spec[: max(0, min(budget - num_new, room))]
                    num_new += len(spec)
                else:
                    spec = []
            block_ids = tables[rid]
            if num_computed + num_new <= len(block_ids) * bs:
                new_block_ids: list[int] | None = []  # decode inside its last block: no call needed
            else:
                num_preempted = len(out.preempted_request_ids)
                new_block_ids, i = self._allocate_or_preempt(request, num_new, i, out)
                if len(out.preempted_request_ids) != num_preempted:
                    # Victims scheduled earlier in this step gave their tokens back.
                    budget = cfg.max_num_batched_tokens - sum(num_scheduled.values())
                if new_block_ids is None:
                    continue  # the request preempted itself; running[i] is now the next one
            num_known = num_new - len(spec)
            row = ScheduledRequest(
                rid, num_computed, num_new, all_ids[num_computed : num_computed + num_known],
                new_block_ids, block_ids[:], num_tokens, request.prompt_logprobs_from,
            )
            if spec:
                row.spec_token_ids = spec
            scheduled.append(row)
            num_scheduled[rid] = num_new
            budget -= num_new
            i += 1

        # 2. Admit waiting requests, unless this step had to preempt (the pool is full).
        if not out.preempted_request_ids:
            budget = self._admit(out, budget, cap)

        out.total_num_scheduled_tokens = cfg.max_num_batched_tokens - budget
        kv.take_transfers(out)
        return out

    def _allocate_or_preempt(
        self, request: Request, num_new: int, index: int, out: SchedulerOutput
    ) -> tuple[list[int] | None, int]:
        """Allocate for running[index], preempting victims until it fits.

        Returns (new block ids, or None when the request itself was preempted; the index in
        running of the request, or of the next one to consider when it was preempted).
        """
        running = self.running
        while True:
            new_block_ids = self.kv.allocate_slots(request, num_new)
            if new_block_ids is not None:
                return new_block_ids, index
            victim = self._pick_victim()
            vi = len(running) - 1 if victim is running[-1] else running.index(victim)
            del running[vi]
            if vi < index:
                # Scheduled earlier in this step: take it back out of the batch.
                index -= 1
                out.num_scheduled_tokens.pop(victim.request_id, None)
                vid = victim.request_id
                out.scheduled[:] = [s for s in out.scheduled if s.request_id != vid]
            self._preempt(victim, out)
            if victim is request:
                return None, index

    def _admit(self, out: SchedulerOutput, budget: int, cap: int) -> int:
        cfg = self.config
        kv = self.kv
        waiting = self.waiting
        running = self.running
        while waiting and budget > 0 and len(running) < cfg.max_num_seqs:
            request = waiting.peek()
            # Waiting requests hold no blocks and num_computed_tokens == 0 (also after preemption).
            hits, num_hit = ([], 0) if request.wants_prompt_logprobs else kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if cap and num_new > cap:
                num_new = cap
            if num_new > budget:
                if not cfg.enable_chunked_prefill:
                    break  # the head blocks the queue: no skipping ahead
                num_new = budget
            new_block_ids = kv.allocate_slots(request, num_new, hits)
            if new_block_ids is None:
                break  # no room; later requests wait too (no skipping)
            waiting.pop()
            running.append(request)
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_hit
            request.num_computed_tokens = num_hit
            request.status = _RUNNING
            rid = request.request_id
            # The runner holds no state for it: send what it rebuilds the request from, once.
            new_request = NewRequestData(
                request.prompt_token_ids, request.output_token_ids[:], request.sampling_params,
                request.eos_token_id,
            )
            out.scheduled.append(
                ScheduledRequest(
                    rid, num_hit, num_new, request.all_token_ids[num_hit : num_hit + num_new],
                    new_block_ids, kv.req_to_block_ids[rid][:], request.num_tokens,
                    request.prompt_logprobs_from, new_request,
                )
            )
            out.num_scheduled_tokens[request.request_id] = num_new
            budget -= num_new
        return budget

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            # Lowest priority (largest value), then latest arrival; among equals the latest
            # admitted (max() keeps the first maximum it meets, and we walk from the end).
            return max(reversed(self.running), key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]  # FCFS: the last admitted

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Free the blocks (swapped out first in swap mode), keep every token, wait at the front."""
        if self.config.preemption_mode == "swap" and not request.wants_prompt_logprobs and self._swap_pays(request):
            self.kv.swap_out(request)  # False: no room, so the resume recomputes
        self.kv.free(request, preempted=True)  # publishes its computed full blocks first: the resume can hit them
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_preempted(request)
        out.preempted_request_ids.append(request.request_id)

    def _swap_pays(self, request: Request) -> bool:
        """Moving the victim's blocks out and back costs less than computing its context again."""
        if self.swap_costs is None:
            return True
        per_block, per_token = self.swap_costs
        num_blocks = -(-request.num_computed_tokens // self.kv.block_size)
        return 2 * num_blocks * per_block <= request.num_computed_tokens * per_token

    # -- after the forward pass -------------------------------------------------------------
    def update(
        self, scheduler_output: SchedulerOutput, sampled_token_ids: dict[str, list[int]],
        failed_kv_saves: list[int] = (),
    ) -> list[Request]:
        """Advance computed tokens, append sampled tokens, stop and free. Returns the requests
        that got tokens this step (finished ones included). `failed_kv_saves`: slots of the step's
        second-tier saves that the runner could not write."""
        kv = self.kv
        kv.transfers_done(failed_kv_saves)
        caching = kv.enable_prefix_caching
        bs = kv.block_size
        num_cached = kv.num_cached_blocks
        requests = self.requests
        changed: list[Request] = []
        finished: list[Request] = []
        for sched in scheduler_output.scheduled:
            request = requests.get(sched.request_id)
            # None: aborted or finished between schedule() and update(); not running: its id was
            # taken since by a new request, which waits (it cannot be in this step).
            if request is None or request.status is not _RUNNING:
                continue
            if sched.spec_token_ids:
                status = self._update_speculated(request, sched, sampled_token_ids.get(request.request_id))
                changed.append(request)
                if status is not None:
                    request.status = status
                    finished.append(request)
                continue
            request.num_computed_tokens += sched.num_new_tokens
            if caching and request.num_computed_tokens // bs > num_cached[request.request_id]:
                kv.cache_blocks(request)
            if request.num_computed_tokens < sched.num_tokens:
                continue  # mid-prompt chunk: its sampled token (if any) is meaningless
            token_ids = sampled_token_ids.get(request.request_id)
            if not token_ids:
                continue
            status = request.append_until_stop(token_ids)
            changed.append(request)
            if status is not None:
                request.status = status
                finished.append(request)
        if finished:
            ids = {r.request_id for r in finished}
            self.running = [r for r in self.running if r.request_id not in ids]
            for request in finished:
                self._finish(request, request.status)
        return changed

    def _update_speculated(self, request: Request, sched: ScheduledRequest, token_ids: list[int] | None) -> RequestStatus | None:
        """A row that carried drafts: `token_ids` are the accepted drafts and one token more."""
        kv = self.kv
        spec = sched.spec_token_ids
        if not token_ids:
            raise RuntimeError(f"request {request.request_id!r} was verified but the runner returned no token")
        num_accepted = len(token_ids) - 1
        if num_accepted > len(spec) or token_ids[:num_accepted] != spec[:num_accepted]:
            raise RuntimeError(f"request {request.request_id!r}: the runner accepted tokens it was not given")
        self.spec_stats.add(len(spec), num_accepted)
        # The KV of the known tokens and of the accepted drafts is valid; that of the rejected is not.
        request.num_computed_tokens += sched.num_new_tokens - (len(spec) - num_accepted)
        status = request.append_until_stop(token_ids)
        # A stop may have cut the accepted drafts: never count more than the tokens kept.
        if request.num_computed_tokens > request.num_tokens:
            request.num_computed_tokens = request.num_tokens
        if kv.enable_prefix_caching:
            kv.cache_blocks(request)  # only verified tokens: the hashes are of all_token_ids
        if status is None:
            # The slots of the rejected drafts: blocks past the known tokens go back to the pool.
            kv.free_tail(request, request.num_tokens)
        return status

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        """The runner's proposals, for each request's next step (ended requests are ignored)."""
        requests = self.requests
        for rid, drafts in draft_token_ids.items():
            request = requests.get(rid)
            if request is not None and request.status is _RUNNING:
                request.spec_token_ids = drafts


def _offload_fields(kv: KVCacheManager) -> dict[str, int]:
    o = kv.offload_stats
    if o is None:
        return {}
    return dict(kv_offload_queries=o.queries, kv_offload_hits=o.hits, kv_offload_saved_blocks=o.saved_blocks,
                kv_offload_loaded_blocks=o.loaded_blocks, num_swaps_out=o.swaps_out, num_swaps_in=o.swaps_in)
