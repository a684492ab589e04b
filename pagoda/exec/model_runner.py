"""The model runner: turns one scheduling step into a flattened batch, runs the model and samples.

It reads only the plain-data step (`pagoda.contracts.step`), never a scheduler object. Per-request
state lives here between steps: its row in a persistent block-table array, its seeded generator, and a
mirror of its token ids and sampling parameters (`runner_state.CachedRequest`), built when the step
says the request is new and extended by the token ids each step computes; so a decode step copies
only the blocks and tokens that are new, and sampling reads exact token histories (penalties, min_tokens)
without the scheduler sending them again. On CUDA the attention backend is the Triton one and
pure-decode steps replay CUDA graphs (`pagoda.exec.cuda_graphs`) unless `enforce_eager`; the only host
sync of a step is copying the sampled token ids back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from pagoda.contracts.step import ScheduledRequest, SchedulerOutput
from pagoda.exec.attn_metadata import PagedAttentionMetadata
from pagoda.exec.cpu_linear import decode_block_rows, decode_step, logits_fn, pack_linears
from pagoda.exec.quant_linear import install_quant_kernels
from pagoda.exec.runner_state import BlockTables, CachedRequest
from pagoda.exec.cpu_moe import prepare_experts
from pagoda.exec.cpu_memory import keep_freed_memory
from pagoda.exec.cuda_graphs import CUDAGraphDecoder
from pagoda.exec.fused_decode import FusedCPUDecoder
from pagoda.exec.attention_backend import make_attention_backend
from pagoda.exec.paged_attention import PagedKVCache, TorchPagedAttention
from pagoda.exec.prompt_logprobs import PromptLogprobRow, prompt_logprob_rows
from pagoda.exec.sampler import Sampler, SamplingMetadata, make_generator
from pagoda.exec.spec_decode import SpecDecoder
from pagoda.exec.structured_output import StructuredOutputs
from pagoda.model.attention import AttentionContext

logger = logging.getLogger(__name__)


@dataclass
class ModelRunnerOutput:
    # request id -> the tokens it gained: one, or with speculation the accepted drafts and one more.
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # request id -> one (token ids, logprobs) per sampled token: that token first, then the top-N.
    logprobs: dict[str, list[tuple[list[int], list[float]]]] = field(default_factory=dict)
    # request id -> (first prompt position, one row per position from there): see prompt_logprobs.py.
    prompt_logprobs: dict[str, tuple[int, list[PromptLogprobRow]]] = field(default_factory=dict)
    # Speculative decoding: request id -> draft tokens to follow its sampled ones, for the next step.
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Slots of the step's second-tier saves that could not be written (pagoda.exec.kv_offload).
    kv_failed_saves: list[int] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: PagedKVCache,
        vocab_size: int,
        max_num_seqs: int,
        max_model_len: int,
        device: torch.device,
        enforce_eager: bool = False,
        structured_outputs: StructuredOutputs | None = None,
        spec_decoder: SpecDecoder | None = None,
    ) -> None:
        self.model = model
        self.structured_outputs = structured_outputs
        self.spec = spec_decoder
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.vocab_size = vocab_size
        self.device = device
        self.backend = make_attention_backend(kv_cache)
        if device.type == "cpu":
            keep_freed_memory()  # each step's activations reuse resident pages instead of faulting
        self.sampler = Sampler()
        install_quant_kernels(model, device)  # weights kept quantized: their CPU kernels, or the GPU's
        self.compute_logits = logits_fn(model, device)
        pack_linears(model, device)  # after logits_fn, which reads the head's weight
        prepare_experts(model, device, triton_ok=not isinstance(self.backend, TorchPagedAttention))
        max_blocks = (max_model_len + self.block_size - 1) // self.block_size
        # Rows for running requests plus those finishing in the same step as others are admitted.
        self.block_tables = BlockTables(2 * max_num_seqs, max_blocks)
        self.generators: dict[str, torch.Generator] = {}
        self.requests: dict[str, CachedRequest] = {}
        self.graphs: CUDAGraphDecoder | None = None
        self.fused_decode = FusedCPUDecoder.create(model, self.backend, device)  # CPU decodes of a few rows
        # Graphs need launches that read no device value on the host: the Triton backend's.
        if (device.type == "cuda" and not enforce_eager and not isinstance(self.backend, TorchPagedAttention)
                and getattr(model, "cuda_graphs_ok", True)):
            self.graphs = CUDAGraphDecoder(model, self.backend, max_num_seqs, max_model_len, self.block_size, device)
            self.graphs.capture()

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        if self.device.type != "cuda":
            return torch.from_numpy(array).to(self.device)
        # From pinned memory the copy is asynchronous; from pageable memory it may wait for the stream.
        return torch.from_numpy(array).pin_memory().to(self.device, non_blocking=True)

    def release(self, request_ids: list[str]) -> None:
        """Drop the state of requests that ended (idempotent)."""
        self._forget(request_ids)

    def _decodes_only(self, order: list[ScheduledRequest]) -> bool:
        """Whether no row of the step is a prompt's (its rows may then read a linear's GGUF blocks
        rounding apart from oneDNN: cpu_linear.decode_step, block_rows); asked only of as many
        requests as such a step reads the blocks for."""
        states = self.requests
        return len(order) <= decode_block_rows() and all(
            s.num_computed_tokens >= len(states[s.request_id].prompt_token_ids) for s in order)

    def _forget(self, request_ids: list[str], keep_generator: bool = False) -> None:
        for rid in request_ids:
            self.block_tables.drop(rid)
            self.requests.pop(rid, None)  # a resumed request comes back with its tokens
            if self.spec is not None:
                self.spec.drop(rid)
            if not keep_generator:
                self.generators.pop(rid, None)
                if self.structured_outputs is not None:
                    self.structured_outputs.drop(rid)

    def _generator(self, request_id: str, state: CachedRequest) -> torch.Generator | None:
        seed = state.sampling_params.seed
        if seed is None:
            return None
        gen = self.generators.get(request_id)
        if gen is None:
            gen = make_generator(seed, self.device)
            self.generators[request_id] = gen
        return gen

    def _sync_requests(self, order: list[ScheduledRequest]) -> list[int]:
        """Bring the per-request mirrors up to this step; returns their block-table rows.

        New and resumed requests get a fresh mirror. The others are extended by the tokens this step
        computes that they have not seen (execute() adds those it samples), so at sampling time a row's
        history is exactly its request's tokens. Block tables get the step's new blocks.
        """
        states = self.requests
        tables = self.block_tables
        table = tables.table
        rows = []
        for s in order:
            new = s.new_request
            if new is not None:
                rid = s.request_id
                state = CachedRequest(new.prompt_token_ids, new.output_token_ids, new.sampling_params,
                                       new.eos_token_id, tables.assign(rid))
                states[rid] = state
            else:
                state = states[s.request_id]
                c = s.num_computed_tokens
                end = c + len(s.new_token_ids)
                if end > state.num_tokens:
                    state.output_token_ids.extend(s.new_token_ids[state.num_tokens - c :])
                    state.num_tokens = end
                if state.had_drafts:
                    state.num_blocks = min(state.num_blocks, c // self.block_size)
            state.had_drafts = bool(s.spec_token_ids)
            block_ids = s.block_ids
            nb = len(block_ids)
            if nb > state.num_blocks:
                table[state.row, state.num_blocks : nb] = block_ids[state.num_blocks :]
                state.num_blocks = nb
            rows.append(state.row)
        return rows

    def prepare(self, so: SchedulerOutput) -> tuple[list[ScheduledRequest], torch.Tensor, torch.Tensor, PagedAttentionMetadata]:
        # Decodes first: the backend runs them as one batched attention.
        decodes = [s for s in so.scheduled if s.num_new_tokens == 1]
        prefills = [s for s in so.scheduled if s.num_new_tokens != 1]
        order = decodes + prefills
        bs = self.block_size
        rows = self._sync_requests(order)
        table = self.block_tables.table
        if not prefills:
            # Pure decode: one token per request, built without per-request arrays.
            starts = np.fromiter((s.num_computed_tokens for s in order), dtype=np.int64, count=len(order))
            tokens = [s.new_token_ids[0] for s in order]
            positions = starts
            slots = table[rows, starts // bs] * bs + starts % bs
            query_lens = np.ones(len(order), dtype=np.int64)
            max_query_len = 1
        else:
            tokens = []
            pos_parts, slot_parts = [], []
            for s, row in zip(order, rows):
                c, n = s.num_computed_tokens, s.num_new_tokens
                tokens.extend(s.new_token_ids)
                if s.spec_token_ids:
                    tokens.extend(s.spec_token_ids)
                pos = np.arange(c, c + n, dtype=np.int64)
                pos_parts.append(pos)
                slot_parts.append(table[row, pos // bs] * bs + pos % bs)
            positions = np.concatenate(pos_parts)
            slots = np.concatenate(slot_parts)
            query_lens = np.fromiter((s.num_new_tokens for s in order), dtype=np.int64, count=len(order))
            max_query_len = int(query_lens.max())
        seq_lens = np.fromiter(
            (s.num_computed_tokens + s.num_new_tokens for s in order), dtype=np.int64, count=len(order)
        )
        qsl = np.zeros(len(order) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=qsl[1:])
        max_seq = int(seq_lens.max())
        nb = (max_seq + bs - 1) // bs
        dev = self.device
        to_dev = self._to_device
        meta = PagedAttentionMetadata(
            num_decodes=len(decodes),
            slot_mapping=to_dev(slots),
            query_start_loc=to_dev(qsl),
            seq_lens=to_dev(seq_lens),
            block_tables=to_dev(table[rows, :nb]),
            query_start_loc_cpu=qsl.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            max_seq_len=max_seq,
            block_size=bs,
            max_query_len=max_query_len,
        )
        if dev.type == "cuda":
            input_ids = to_dev(np.asarray(tokens, dtype=np.int64))
        else:
            input_ids = torch.tensor(tokens, dtype=torch.long, device=dev)
        return order, input_ids, to_dev(positions), meta

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._forget(so.finished_request_ids)
        # A preempted request keeps its generator so that, resumed, it draws what it would have (and
        # its grammar matcher, which has consumed its tokens).
        self._forget(so.preempted_request_ids, keep_generator=True)
        out = ModelRunnerOutput()
        if not so.scheduled:
            return out
        order, input_ids, positions, meta = self.prepare(so)
        with decode_step(self._decodes_only(order)):
            if not self._forward_and_sample(order, input_ids, positions, meta, out):
                return out
        # The mirrors learn the sampled tokens now (the next step's rows carry them again), so a
        # proposer reads each request's whole history.
        states = self.requests
        for rid, toks in out.sampled_token_ids.items():
            st = states[rid]
            st.output_token_ids.extend(toks)
            st.num_tokens += len(toks)
        if self.spec is not None and self.spec.enabled_for(len(order)):
            out.draft_token_ids = self.spec.propose([(rid, states[rid]) for rid in out.sampled_token_ids],
                                                    self.structured_outputs)
        return out

    def _forward_and_sample(self, order: list[ScheduledRequest], input_ids: torch.Tensor, positions: torch.Tensor,
                            meta: PagedAttentionMetadata, out: ModelRunnerOutput) -> bool:
        """The model's step, then prompt logprobs, verification and sampling into `out`; False when
        nothing was sampled (a pipeline stage before the last, or every request mid-prompt)."""
        if self.graphs is not None and self.graphs.can_run(meta.num_decodes, meta.num_reqs):
            hidden = self.graphs.run(input_ids, positions, meta)  # padding rows already dropped
        elif self.fused_decode is not None and self.fused_decode.can_run(meta, input_ids.shape[0]):
            hidden = self.fused_decode.run(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, AttentionContext(self.backend, meta))
        if hidden is None:
            return False  # a pipeline stage before the last: the next stage has its hidden states
        wanted = [(i, s) for i, s in enumerate(order) if s.prompt_logprobs_from is not None]
        if wanted:
            self._prompt_logprobs(wanted, hidden, meta, out)
        sampling = [i for i, s in enumerate(order) if s.samples]
        if not sampling:
            return False  # every request is mid-prompt: nothing to sample
        speculated = [i for i in sampling if order[i].spec_token_ids] if self.spec is not None else []
        if speculated:
            sampling = [i for i in sampling if not order[i].spec_token_ids]
            self._verify(speculated, order, hidden, meta, out)
        if sampling:
            self._sample(sampling, order, hidden, meta, out)
        return True

    def _verify(self, idx: list[int], order: list[ScheduledRequest], hidden: torch.Tensor,
                meta: PagedAttentionMetadata, out: ModelRunnerOutput) -> None:
        """Rows that carried drafts: score every drafted position, keep what verification accepts."""
        qsl = meta.query_start_loc_cpu
        rows = []
        for i in idx:
            k = len(order[i].spec_token_ids)
            rows.extend(range(qsl[i + 1] - 1 - k, qsl[i + 1]))
        logits = self.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        reqs = [order[i] for i in idx]
        states = [self.requests[s.request_id] for s in reqs]
        first = np.cumsum([0] + [len(s.spec_token_ids) + 1 for s in reqs]).tolist()
        constrained = [(first[n], s.request_id, st.sampling_params.structured_outputs, s.spec_token_ids)
                       for n, (s, st) in enumerate(zip(reqs, states)) if st.sampling_params.structured_outputs]
        if constrained:
            self.structured_outputs.mask_drafted(logits, constrained)
        emitted, logprobs = self.spec.verify(
            logits, [(s, st, self._generator(s.request_id, st)) for s, st in zip(reqs, states)]
        )
        for s, toks, lps in zip(reqs, emitted, logprobs):
            out.sampled_token_ids[s.request_id] = toks
            if lps is not None:
                out.logprobs[s.request_id] = lps
        for _, rid, _, _ in constrained:
            for tok in out.sampled_token_ids[rid]:
                self.structured_outputs.accept(rid, tok)

    def _sample(self, sampling: list[int], order: list[ScheduledRequest], hidden: torch.Tensor,
                meta: PagedAttentionMetadata, out: ModelRunnerOutput) -> None:
        """Rows without drafts: one token each from the last position's logits."""
        if len(sampling) == meta.num_decodes == len(order):
            logits = self.compute_logits(hidden)  # one row per request, all sampled: no gather
        else:
            last_rows = torch.tensor([meta.query_start_loc_cpu[i + 1] - 1 for i in sampling], device=self.device)
            logits = self.compute_logits(hidden[last_rows])
        reqs = [order[i] for i in sampling]
        states = [self.requests[s.request_id] for s in reqs]
        constrained = [
            (row, s.request_id, st.sampling_params.structured_outputs, st.eos_token_id)
            for row, (s, st) in enumerate(zip(reqs, states))
            if st.sampling_params.structured_outputs is not None
        ]
        if constrained:
            if self.structured_outputs is None:
                raise ValueError("this engine runs no structured outputs")
            self.structured_outputs.mask(logits, constrained)
        sampling_meta = SamplingMetadata.build(
            [st.sampling_params for st in states],
            [st.prompt_token_ids for st in states],
            [st.output_token_ids for st in states],
            [self._generator(s.request_id, st) for s, st in zip(reqs, states)],
            self.vocab_size,
            self.device,
            [st.eos_token_id for st in states],
        )
        result = self.sampler(logits, sampling_meta)
        token_ids = result.token_ids.tolist()
        for s, tok in zip(reqs, token_ids):
            out.sampled_token_ids[s.request_id] = [tok]
        for row, rid, _, _ in constrained:
            self.structured_outputs.accept(rid, token_ids[row])
        if result.logprobs is not None:
            lps, ids = result.logprobs.tolist(), result.logprob_token_ids.tolist()
            for row, (s, st) in enumerate(zip(reqs, states)):
                n = st.sampling_params.logprobs
                if n is not None:
                    out.logprobs[s.request_id] = [(ids[row][: 1 + n], lps[row][: 1 + n])]

    def _prompt_logprobs(self, wanted: list[tuple[int, ScheduledRequest]], hidden: torch.Tensor,
                         meta: PagedAttentionMetadata, out: ModelRunnerOutput) -> None:
        """Logprobs of the prompt tokens this step's rows score, skipping positions already known
        (a preempted request computes its prompt again)."""
        qsl = meta.query_start_loc_cpu
        for i, s in wanted:
            state = self.requests[s.request_id]
            prompt = state.prompt_token_ids
            c = s.num_computed_tokens
            lo = max(c, s.prompt_logprobs_from)
            hi = min(c + s.num_new_tokens, len(prompt) - 1)
            if lo >= hi:
                continue
            first = qsl[i] + lo - c
            rows = prompt_logprob_rows(
                self.compute_logits,
                hidden[first : first + hi - lo],
                prompt[lo + 1 : hi + 1],
                state.sampling_params.prompt_logprobs,
            )
            out.prompt_logprobs[s.request_id] = (lo, rows)
