"""Request preparation for both front doors (`LLMEngine` in-process, `AsyncLLM` for the server):
`InputProcessor` tokenizes a prompt (or renders a chat), truncates it (truncate_prompt_tokens) and
checks it against the model once, and `make_core_requests` fans one request out into its n core
requests.

Every refusal is an `InvalidRequestError` naming the field to blame (`.field`: a SamplingParams field,
"prompt", "messages" or "chat_template_kwargs"; `.code` for a context overflow), so the server answers
with OpenAI's `param` without reading messages. Pure Python over a tokenizer and a few model numbers:
it runs in either process without the model or torch.
"""

from __future__ import annotations

import functools
import inspect
import numbers
from dataclasses import dataclass
from typing import Any

from pagoda.contracts.messages import EngineCoreRequest
from pagoda.engine.errors import ChatTemplateArgumentError, InvalidRequestError
from pagoda.engine.generation_defaults import GenerationDefaults, stop_ids_with_model_eos
from pagoda.exec.structured_output import check_structured_outputs
from pagoda.sampling_params import SamplingParams

__all__ = [
    "InputProcessor", "ModelLimits", "ProcessedPrompt", "Prompt", "chat_prompt_ids", "check_params",
    "check_structured_outputs", "eos_token_id_of", "make_core_requests", "quick_to_process", "quick_to_render",
    "tokenize_prompt", "truncate_prompt", "validate_prompt",
]

Prompt = str | list[int] | dict[str, Any]
_CONTEXT_CODE = "context_length_exceeded"  # OpenAI's code for a request longer than the context

# Inputs this small are prepared where they arrive, on the server's event loop: tokenizing 512
# characters takes ~0.2 ms (a chat template over them ~0.15 ms more), less than the hop to the
# tokenizer's thread and back, which a short request otherwise pays in its time to first token
# (0.5-1.5 ms with the core's threads on every core). Larger inputs go to the thread, so that the
# other requests' streams never wait behind a long prompt.
QUICK_TEXT_CHARS = 512
QUICK_TOKEN_IDS = 8192  # a list of ids is only checked: ~50 ns an id
_PLAIN_MESSAGE_KEYS = {"role", "content", "name"}


def quick_to_process(prompt: Any, params: SamplingParams) -> bool:
    """Whether InputProcessor.process of this prompt is cheap enough for the event loop."""
    if getattr(params, "structured_outputs", None) is not None:
        return False  # its grammar is compiled to be checked
    if isinstance(prompt, dict):
        prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))
    if isinstance(prompt, str):
        return len(prompt) <= QUICK_TEXT_CHARS
    return isinstance(prompt, (list, tuple)) and len(prompt) <= QUICK_TOKEN_IDS


def quick_to_render(messages: Any, chat_template_kwargs: dict | None = None) -> bool:
    """Whether rendering this conversation (InputProcessor.render_chat) is cheap enough for the
    event loop: plain-text messages of QUICK_TEXT_CHARS in all, no tools or other template inputs."""
    if chat_template_kwargs or not isinstance(messages, list):
        return False
    chars = 0
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or set(m) - _PLAIN_MESSAGE_KEYS:
            return False  # parts, tool calls and their results
        chars += len(m["content"])
    return chars <= QUICK_TEXT_CHARS


def eos_token_id_of(tokenizer: Any, config: Any) -> int | None:
    """The tokenizer's EOS id, else the config's (the first one when it lists several).

    `config` is anything with an `eos_token_id` attribute: a model config or an `EngineCoreReady`.
    """
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        return int(tokenizer.eos_token_id)
    eos = getattr(config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        return int(eos[0]) if eos else None
    return None if eos is None else int(eos)


def tokenize_prompt(tokenizer: Any, prompt: Prompt, add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
    """(prompt text or None, prompt token ids) for a string, a list of token ids, or a dict with
    'prompt' or 'prompt_token_ids'."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(
                isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids
            ):
                raise InvalidRequestError("prompt_token_ids must be a list of integers", "prompt")
            return prompt.get("prompt"), [int(t) for t in ids]
        if "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'", "prompt")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: pass prompt token ids", "prompt")
        try:
            return prompt, list(tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
        except InvalidRequestError:
            raise
        except ValueError as exc:  # the tokenizer's own refusal: still about the prompt
            raise InvalidRequestError(str(exc), "prompt") from None
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return None, list(prompt)
    raise InvalidRequestError(
        f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}", "prompt"
    )


def chat_prompt_ids(
    tokenizer: Any,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    template_kwargs: dict | None = None,
) -> list[int]:
    """Token ids of a conversation rendered by the tokenizer's chat template (or `chat_template`);
    InvalidRequestError on "messages", with the template's own message, when it cannot be rendered."""
    try:
        ids = tokenizer.apply_chat_template(
            messages,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=True,
            return_dict=False,
            **(template_kwargs or {}),
        )
    except InvalidRequestError:
        raise
    except ValueError as exc:
        raise InvalidRequestError(str(exc), "messages") from None
    except Exception as exc:  # jinja errors (roles that do not alternate, a message without content), TypeError
        raise InvalidRequestError(f"cannot apply the chat template: {type(exc).__name__}: {exc}", "messages") from None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


@functools.lru_cache(maxsize=None)
def _chat_template_arguments(tokenizer_cls: type) -> frozenset[str]:
    """The named parameters of the tokenizer's apply_chat_template that are not conversation content
    (padding, truncation, tokenize, ...): its other keyword arguments become template variables."""
    params = inspect.signature(tokenizer_cls.apply_chat_template).parameters.values()
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return frozenset(named - {"self", "tools", "documents"})


def check_params(params: SamplingParams) -> None:
    """Refuse what would otherwise fail inside a step, taking the whole batch down with it."""
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
    seed = params.seed
    if seed is not None:
        # torch generators take seeds in [-2**63, 2**64); child i of an n > 1 request uses seed + i.
        if not isinstance(seed, int) or isinstance(seed, bool) or not -(2**63) <= seed <= 2**64 - params.n:
            raise InvalidRequestError(f"seed must be an integer in [-2**63, 2**64 - n], got {seed!r}", "seed")


def truncate_prompt(prompt_ids: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    """The prompt's last `truncate_prompt_tokens` tokens (vLLM's left truncation), or all of it."""
    k = params.truncate_prompt_tokens
    if k is None:
        return prompt_ids
    if k == -1:
        k = max_model_len
    elif k > max_model_len:
        raise InvalidRequestError(
            f"truncate_prompt_tokens ({k}) is larger than max_model_len ({max_model_len})", "truncate_prompt_tokens"
        )
    return prompt_ids[-k:] if len(prompt_ids) > k else prompt_ids


def validate_prompt(
    prompt_ids: list[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_model_len: int,
    block_size: int | None = None,
    num_usable_blocks: int | None = None,
    strict_max_tokens: bool = False,
    max_logprobs: int = -1,
    has_tokenizer: bool = True,
) -> None:
    """Raise InvalidRequestError (with a message fit for a user) when the request cannot run.

    `strict_max_tokens`: a max_tokens that does not fit the context is an error (the server's rule,
    as OpenAI's) rather than silently capped at the context (the offline engine's rule).
    With `block_size` and `num_usable_blocks` a request that could never fit the KV cache is refused
    here rather than by the core. `max_logprobs` caps logprobs and prompt_logprobs (-1: the vocabulary).
    """
    limit = vocab_size if max_logprobs == -1 else min(max_logprobs, vocab_size)
    for name, what in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
        value = getattr(params, name)
        if value is not None and value > limit:
            raise InvalidRequestError(
                f"Requested {what} logprobs of {value}, which is greater than max allowed: {limit}", name
            )
    n = len(prompt_ids)
    if n == 0:
        raise InvalidRequestError("the prompt is empty", "prompt")
    if any(t < 0 or t >= vocab_size for t in prompt_ids):
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab_size})", "prompt")
    if params.logit_bias and max(params.logit_bias) >= vocab_size:
        raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab_size})", "logit_bias")
    if params.structured_outputs is not None:
        if not has_tokenizer:
            raise InvalidRequestError(
                "structured outputs need the model's tokenizer, and this model has none", "structured_outputs"
            )
        try:
            check_structured_outputs(params.structured_outputs)
        except ValueError as exc:
            raise InvalidRequestError(f"structured outputs: {exc}", "structured_outputs") from None
    if n >= max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens, and the prompt has {n} "
            f"tokens, which leaves no room to generate. Please shorten the prompt.",
            "prompt", _CONTEXT_CODE,
        )
    max_tokens = params.max_tokens
    if strict_max_tokens and max_tokens is not None and n + max_tokens > max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{n + max_tokens} tokens ({n} in the prompt, {max_tokens} in the completion). Please reduce "
            f"the length of the prompt or of max_tokens.",
            "max_tokens", _CONTEXT_CODE,
        )
    if block_size and num_usable_blocks is not None:
        longest = max_model_len if max_tokens is None else min(n + max_tokens, max_model_len)
        need = -(-longest // block_size)
        if need > num_usable_blocks:
            raise InvalidRequestError(
                f"This request may need {longest} tokens of KV cache but the cache holds "
                f"{num_usable_blocks * block_size}. Please reduce the length of the prompt or of max_tokens.",
                "max_tokens",
            )


@dataclass(frozen=True)
class ModelLimits:
    """What the checks need to know of the model and its KV cache."""

    vocab_size: int
    max_model_len: int
    block_size: int | None = None  # with num_usable_blocks: refuse requests the cache can never hold
    num_usable_blocks: int | None = None
    max_logprobs: int = -1  # the cap on logprobs and prompt_logprobs; -1: the vocabulary


@dataclass(frozen=True)
class ProcessedPrompt:
    """A prompt as the engine will run it: tokenized, truncated, and checked against `params`."""

    text: str | None  # as given (None for token ids); longer than what runs when `truncated`
    prompt_token_ids: list[int]
    params: SamplingParams  # what it was checked against: other params must check it again
    truncated: bool = False  # truncate_prompt_tokens cut its start


class InputProcessor:
    """Tokenize, truncate and validate a request once, for either front door.

    `strict_max_tokens` is the server's rule (a max_tokens past the context is an error, as OpenAI's);
    offline it is capped at the context. `chat_template` overrides the tokenizer's.
    """

    def __init__(self, tokenizer: Any, limits: ModelLimits, *, strict_max_tokens: bool = False,
                 chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.strict_max_tokens = strict_max_tokens
        self.chat_template = chat_template

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return tokenize_prompt(self.tokenizer, text, add_special_tokens)[1]

    def render_chat(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[int]:
        """Token ids of a conversation; InvalidRequestError on "messages" when the template cannot
        render it, ChatTemplateArgumentError when chat_template_kwargs is not template variables."""
        tok = self.tokenizer
        template = chat_template or self.chat_template
        if tok is None or not (template or getattr(tok, "chat_template", None)):
            raise InvalidRequestError("this model has no chat template; use /v1/completions", "messages")
        if add_generation_prompt and continue_final_message:
            raise InvalidRequestError("add_generation_prompt and continue_final_message cannot both be true",
                                      "messages")
        reserved = sorted(set(chat_template_kwargs or ()) & _chat_template_arguments(type(tok)))
        if reserved:
            # They would reach the tokenizer, not the template: {"truncation": true, "max_length": 2}
            # would silently cut the prompt, {"tokenize": false} would return text.
            raise ChatTemplateArgumentError(
                f"chat_template_kwargs cannot set {', '.join(reserved)}: it holds template variables only"
            )
        return chat_prompt_ids(
            tok,
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=template,
            template_kwargs=chat_template_kwargs,
        )

    def process(self, prompt: Prompt, params: SamplingParams, add_special_tokens: bool = True) -> ProcessedPrompt:
        """The prompt tokenized, cut to its last truncate_prompt_tokens tokens and checked; raises
        InvalidRequestError (nothing of the request may then reach the core)."""
        check_params(params)
        text, ids = tokenize_prompt(self.tokenizer, prompt, add_special_tokens)
        lim = self.limits
        kept = truncate_prompt(ids, params, lim.max_model_len)
        validate_prompt(
            kept,
            params,
            vocab_size=lim.vocab_size,
            max_model_len=lim.max_model_len,
            block_size=lim.block_size,
            num_usable_blocks=lim.num_usable_blocks,
            strict_max_tokens=self.strict_max_tokens,
            max_logprobs=lim.max_logprobs,
            has_tokenizer=self.tokenizer is not None,
        )
        return ProcessedPrompt(text, kept, params, truncated=len(kept) != len(ids))

    def ensure_processed(self, prompt: Prompt | ProcessedPrompt, params: SamplingParams) -> ProcessedPrompt:
        """`prompt` as processed for `params`: a ProcessedPrompt already checked against these very
        params is taken as is (the server processes before admission; no second pass)."""
        if isinstance(prompt, ProcessedPrompt):
            if prompt.params is params:
                return prompt
            text = None if prompt.truncated else prompt.text  # the text of a cut prompt is not what runs
            return self.process({"prompt": text, "prompt_token_ids": prompt.prompt_token_ids}, params)
        return self.process(prompt, params)


def make_core_requests(
    child_ids: list[str],
    prompt_ids: list[int],
    params: SamplingParams,
    eos_token_id: int | None,
    priority: int,
    arrival_time: float,
    generation: GenerationDefaults | None = None,
) -> list[EngineCoreRequest]:
    """One core request per sequence of an n > 1 request: child i samples with seed + i (else the
    children would sample alike), and children after the first share the first one's prompt blocks.
    The model's extra EOS ids (`generation`) join the stop token ids."""
    n = len(child_ids)
    reqs = []
    if generation is not None and generation.eos_token_ids:
        stops = stop_ids_with_model_eos(params, generation, eos_token_id)
        if stops != params.stop_token_ids:
            params = params.clone(stop_token_ids=stops)
    for i, cid in enumerate(child_ids):
        child_params = params
        if n > 1:
            seed = None if params.seed is None else params.seed + i
            # The prompt's logprobs are the same for every child: the first computes them, and the
            # others reuse its prompt blocks (a request with prompt_logprobs reads no cached prefix).
            child_params = params.clone(n=1, seed=seed, prompt_logprobs=params.prompt_logprobs if i == 0 else None)
        reqs.append(
            EngineCoreRequest(
                request_id=cid,
                prompt_token_ids=prompt_ids,
                sampling_params=child_params,
                eos_token_id=eos_token_id,
                arrival_time=arrival_time,
                priority=priority,
                share_prompt_with=child_ids[0] if i else None,
            )
        )
    return reqs
