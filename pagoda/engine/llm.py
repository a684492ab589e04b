"""LLM: the offline front door, `LLM(model).generate(prompts, sampling_params)` as in vLLM."""

from __future__ import annotations

import time
from typing import Iterable, Sequence

from tqdm import tqdm

from pagoda.config import EngineArgs
from pagoda.engine.generation_defaults import default_sampling_params
from pagoda.engine.input_processor import chat_prompt_ids
from pagoda.engine.llm_engine import LLMEngine, Prompt
from pagoda.engine.errors import WeightUpdateRefused
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **kwargs) -> None:
        self.engine = LLMEngine(EngineArgs.from_kwargs(model=model, **kwargs))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        llm = cls.__new__(cls)
        llm.engine = engine
        return llm

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while requests hold blocks."""
        return self.engine.core.kv_manager.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate(prompts)` samples with: SamplingParams' defaults, but the model's
        generation_config.json values where it has them (`generation_config="vllm"`: none)."""
        return default_sampling_params(self.engine.generation_defaults)
    def update_weights(self, model_path: str, version: str | None = None) -> dict:
        """Serve the weights of another checkpoint of the same model (a Hugging Face folder or a .gguf
        file) from now on; `version` names them (default: the checkpoint's file or folder name).
        ValueError naming the problem when it does not load or does not fit; the weights served so
        far are then unchanged. Returns what the swap did (versions, seconds)."""
        try:
            return self.engine.core.lifecycle.update_now(model_path, version)
        except WeightUpdateRefused as exc:
            raise ValueError(str(exc)) from None

    @property
    def weight_version(self) -> str:
        return self.engine.core.lifecycle.version

    def sleep(self, level: int = 1) -> dict:
        """Give back the KV cache's memory (level 1) and the weights' too (level 2, kept in a mapped
        file); generate() refuses until wake_up()."""
        try:
            return self.engine.core.lifecycle.sleep(level)
        except WeightUpdateRefused as exc:
            raise ValueError(str(exc)) from None

    def wake_up(self) -> dict:
        return self.engine.core.lifecycle.wake_up()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        if not isinstance(prompts, Iterable):
            raise ValueError(
                f"prompts must be a string, a list of token ids, a dict, or a list of those; got {type(prompts).__name__}"
            )
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, Sequence) and not isinstance(sampling_params, str):
            params = list(sampling_params)
        else:
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got {type(sampling_params).__name__}")
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        for sp in params:
            if sp is not None and not isinstance(sp, SamplingParams):
                raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got a {type(sp).__name__} in the list")
        if priority is not None and (not isinstance(priority, Sequence) or len(priority) != len(prompts)):
            got = f"{len(priority)} priorities" if isinstance(priority, Sequence) else f"priority={priority!r}"
            raise ValueError(f"priority must be a list with one integer per prompt: got {len(prompts)} prompts and {got}")
        ids = []
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, params)):
                ids.append(self.engine.add_request(prompt, sp, priority=priority[i] if priority else 0))
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        start = time.perf_counter()
        out_tokens = 0
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        out_tokens += sum(len(o.token_ids) for o in out.outputs)
                        bar.update(1)
                        elapsed = time.perf_counter() - start
                        bar.set_postfix_str(f"{out_tokens / elapsed:.1f} output tok/s")
        except BaseException:
            # A failed step (or Ctrl-C) must not leave this call's requests in the engine, where the
            # next generate() would run them again (and fail the same way).
            for rid in ids:
                if rid not in done:
                    self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [done[rid] for rid in ids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        tok = self.engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError("this model has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {"prompt_token_ids": self._apply_chat_template(tok, conv, add_generation_prompt)} for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    @staticmethod
    def _apply_chat_template(tok, conversation: list[dict], add_generation_prompt: bool) -> list[int]:
        if not isinstance(conversation, (list, tuple)) or not all(isinstance(m, dict) for m in conversation):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts, or a list of such lists")
        msgs = []
        for m in conversation:
            content = m.get("content")
            if isinstance(content, list):  # OpenAI content parts: the text ones, joined as vLLM does
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                    raise ValueError("message content parts must be {'type': 'text', 'text': ...} (text only)")
                m = {**m, "content": "\n".join(p["text"] for p in content)}
            msgs.append(m)
        return chat_prompt_ids(tok, msgs, add_generation_prompt=add_generation_prompt)
