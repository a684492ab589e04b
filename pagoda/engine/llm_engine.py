"""LLMEngine: the in-process front end: prompts in, RequestOutputs out, one `step()` at a time."""

from __future__ import annotations

import itertools
import time
from typing import Any

from pagoda.config import EngineArgs
from pagoda.engine.core import EngineCore
from pagoda.engine.devices import check_device_available
from pagoda.engine.input_processor import (
    Prompt,
    eos_token_id_of,
    make_core_requests,
    tokenize_prompt,
    truncate_prompt,
    validate_prompt,
)
from pagoda.engine.output_processor import OutputProcessor
from pagoda.model.loader import LoadedModel, load_tokenizer
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, args: EngineArgs, loaded: LoadedModel | None = None, tokenizer: Any = "auto") -> None:
        """`loaded` and `tokenizer` reuse an already loaded model (tests build many engines on one);
        tokenizer=None runs on token ids alone."""
        self.args = args
        check_device_available(args.device)
        self.core = EngineCore(args, loaded)
        self.tokenizer = load_tokenizer(self.core.loaded.source) if tokenizer == "auto" else tokenizer
        self.core.tokenizer = self.tokenizer
        self.eos_token_id = eos_token_id_of(self.tokenizer, self.core.loaded.config)
        self.processor = OutputProcessor(self.tokenizer)
        self.max_model_len = self.core.max_model_len
        self._ids = itertools.count()

    def tokenize_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        return tokenize_prompt(self.tokenizer, prompt)

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        delta: bool = False,
    ) -> str:
        params = SamplingParams() if params is None else params
        self._check_params(params)
        text, prompt_ids = tokenize_prompt(self.tokenizer, prompt)
        prompt_ids = truncate_prompt(prompt_ids, params, self.max_model_len)
        validate_prompt(
            prompt_ids,
            params,
            vocab_size=self.core.loaded.config.vocab_size,
            max_model_len=self.max_model_len,
            block_size=self.core.kv_manager.block_size,
            num_usable_blocks=self.core.kv_manager.num_usable_blocks,
            max_logprobs=self.args.max_logprobs,
            has_tokenizer=self.tokenizer is not None,
        )
        request_id = request_id if request_id is not None else str(next(self._ids))
        child_ids = self.processor.add_request(request_id, text, prompt_ids, params, self.eos_token_id, delta)
        for req in make_core_requests(child_ids, prompt_ids, params, self.eos_token_id, priority, time.time()):
            self.core.add_request(req)
        return request_id

    def _check_params(self, params: SamplingParams) -> None:
        """Refuse here what would otherwise fail inside a step, taking the whole batch down with it."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        seed = params.seed
        if seed is not None:
            # torch generators take seeds in [-2**63, 2**64); child i of an n > 1 request uses seed + i.
            if not isinstance(seed, int) or isinstance(seed, bool) or not -(2**63) <= seed <= 2**64 - params.n:
                raise ValueError(f"seed must be an integer in [-2**63, 2**64 - n], got {seed!r}")

    def abort_request(self, request_id: str) -> None:
        self.core.abort_requests(self.processor.abort(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        outputs = self.core.step()
        results, stopped = self.processor.process(outputs)
        if stopped:
            self.core.finish_requests(stopped)
        return results
