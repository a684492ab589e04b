"""LLMEngine: the in-process front end: prompts in, RequestOutputs out, one `step()` at a time."""

from __future__ import annotations

import itertools
import time
from typing import Any

from pagoda.config import EngineArgs
from pagoda.engine.core import EngineCore
from pagoda.engine.messages import EngineCoreRequest
from pagoda.engine.output_processor import OutputProcessor
from pagoda.model.loader import LoadedModel, load_tokenizer
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams

Prompt = str | list[int] | dict[str, Any]


def eos_token_id_of(tokenizer, config) -> int | None:
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return int(tokenizer.eos_token_id)
    eos = getattr(config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        return int(eos[0]) if eos else None
    return None if eos is None else int(eos)


class LLMEngine:
    def __init__(self, args: EngineArgs, loaded: LoadedModel | None = None, tokenizer: Any = "auto") -> None:
        """`loaded` and `tokenizer` reuse an already loaded model (tests build many engines on one);
        tokenizer=None runs on token ids alone."""
        self.args = args
        self.core = EngineCore(args, loaded)
        self.tokenizer = load_tokenizer(self.core.loaded.source) if tokenizer == "auto" else tokenizer
        self.eos_token_id = eos_token_id_of(self.tokenizer, self.core.loaded.config)
        self.processor = OutputProcessor(self.tokenizer)
        self.max_model_len = self.core.max_model_len
        self._ids = itertools.count()

    def tokenize_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt token ids")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        n = len(prompt_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        vocab = self.core.loaded.config.vocab_size
        if any(t < 0 or t >= vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if n >= self.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens, which leaves no room to generate within the model's "
                f"context of {self.max_model_len} tokens"
            )

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        delta: bool = False,
    ) -> str:
        params = params or SamplingParams()
        text, prompt_ids = self.tokenize_prompt(prompt)
        self.validate(prompt_ids, params)
        request_id = request_id if request_id is not None else str(next(self._ids))
        child_ids = self.processor.add_request(request_id, text, prompt_ids, params, self.eos_token_id, delta)
        now = time.time()
        for i, cid in enumerate(child_ids):
            child_params = params
            if params.n > 1:
                seed = None if params.seed is None else params.seed + i
                child_params = params.clone(n=1, seed=seed)
            self.core.add_request(
                EngineCoreRequest(
                    request_id=cid,
                    prompt_token_ids=prompt_ids,
                    sampling_params=child_params,
                    eos_token_id=self.eos_token_id,
                    arrival_time=now,
                    priority=priority,
                    share_prompt_with=child_ids[0] if i else None,
                )
            )
        return request_id

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
