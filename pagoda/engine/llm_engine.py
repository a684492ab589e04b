"""LLMEngine: the in-process front end: prompts in, RequestOutputs out, one `step()` at a time.

It owns an `EngineCore` in this process, the `InputProcessor` that checks each request before the
core sees it, and the `OutputProcessor` that turns core outputs into RequestOutputs."""

from __future__ import annotations

import itertools
import time
from typing import Any

from pagoda.config import EngineArgs
from pagoda.engine.core import EngineCore
from pagoda.engine.devices import check_device_available
from pagoda.engine.input_processor import (
    InputProcessor,
    ModelLimits,
    Prompt,
    eos_token_id_of,
    make_core_requests,
    tokenize_prompt,
)
from pagoda.engine.generation_defaults import default_sampling_params
from pagoda.engine.model_files import generation_defaults, load_front_tokenizer, pin_model
from pagoda.engine.output_processor import OutputProcessor
from pagoda.model.loader import LoadedModel
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, args: EngineArgs, loaded: LoadedModel | None = None, tokenizer: Any = "auto") -> None:
        """`loaded` and `tokenizer` reuse an already loaded model (tests build many engines on one);
        tokenizer=None runs on token ids alone."""
        if loaded is None:
            args, _ = pin_model(args)
        self.args = args
        if args.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 is for `pagoda serve` (one engine process per replica); "
                             "offline generation runs one engine")
        check_device_available(args.device)
        self.core = EngineCore(args, loaded)
        source = self.core.loaded.source
        self.tokenizer = load_front_tokenizer(args, source) if tokenizer == "auto" else tokenizer
        self.generation_defaults = generation_defaults(args, source)
        self.core.tokenizer = self.tokenizer
        self.eos_token_id = eos_token_id_of(self.tokenizer, self.core.loaded.config)
        self.processor = OutputProcessor(self.tokenizer)
        self.max_model_len = self.core.max_model_len
        kv = self.core.kv_manager
        limits = ModelLimits(
            vocab_size=self.core.loaded.config.vocab_size,
            max_model_len=self.max_model_len,
            block_size=kv.block_size,
            num_usable_blocks=kv.num_usable_blocks,
            max_logprobs=args.max_logprobs,
        )
        # Offline, a max_tokens past the context is capped there (not strict, as the server is).
        self.inputs = InputProcessor(self.tokenizer, limits)
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
        params = default_sampling_params(self.generation_defaults) if params is None else params
        processed = self.inputs.process(prompt, params)
        prompt_ids = processed.prompt_token_ids
        request_id = request_id if request_id is not None else str(next(self._ids))
        child_ids = self.processor.add_request(request_id, processed.text, prompt_ids, params, self.eos_token_id,
                                               delta)
        for req in make_core_requests(child_ids, prompt_ids, params, self.eos_token_id, priority, time.time(),
                                      self.generation_defaults):
            self.core.add_request(req)
        return request_id

    def abort_request(self, request_id: str) -> None:
        self.core.abort_requests(self.processor.abort(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        outputs = self.core.step()
        results, stopped = self.processor.process(outputs, self.core.lifecycle.version)
        if stopped:
            self.core.finish_requests(stopped)
        return results
