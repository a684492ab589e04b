"""Front-end request preparation shared by both front doors (`LLMEngine` in-process, `AsyncLLM` for the
server): prompt tokenization, chat rendering, request validation, and the fan-out of one request into its n core
requests.

Pure functions over a tokenizer and a few model numbers, so they run on either side of the process
split without the model or torch.
"""

from __future__ import annotations

import numbers
from typing import Any

from pagoda.contracts.messages import EngineCoreRequest
from pagoda.exec.structured_output import check_structured_outputs
from pagoda.sampling_params import SamplingParams

Prompt = str | list[int] | dict[str, Any]


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
                raise ValueError("prompt_token_ids must be a list of integers")
            return prompt.get("prompt"), [int(t) for t in ids]
        if "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompt token ids")
        return prompt, list(tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return None, list(prompt)
    raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")


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
    ValueError, with the template's own message, when it cannot be rendered."""
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
    except ValueError:
        raise
    except Exception as exc:  # jinja errors (roles that do not alternate, a message without content), TypeError
        raise ValueError(f"cannot apply the chat template: {type(exc).__name__}: {exc}") from None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def truncate_prompt(prompt_ids: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    """The prompt's last `truncate_prompt_tokens` tokens (vLLM's left truncation), or all of it."""
    k = params.truncate_prompt_tokens
    if k is None:
        return prompt_ids
    if k == -1:
        k = max_model_len
    elif k > max_model_len:
        raise ValueError(f"truncate_prompt_tokens ({k}) is larger than max_model_len ({max_model_len})")
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
    """Raise ValueError (with a message fit for a user) when the request cannot run.

    `strict_max_tokens`: a max_tokens that does not fit the context is an error (the server's rule,
    as OpenAI's) rather than silently capped at the context (the offline engine's rule).
    With `block_size` and `num_usable_blocks` a request that could never fit the KV cache is refused
    here rather than by the core. `max_logprobs` caps logprobs and prompt_logprobs (-1: the vocabulary).
    """
    limit = vocab_size if max_logprobs == -1 else min(max_logprobs, vocab_size)
    for name, what in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
        value = getattr(params, name)
        if value is not None and value > limit:
            raise ValueError(f"Requested {what} logprobs of {value}, which is greater than max allowed: {limit}")
    n = len(prompt_ids)
    if n == 0:
        raise ValueError("the prompt is empty")
    if any(t < 0 or t >= vocab_size for t in prompt_ids):
        raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
    if params.logit_bias and max(params.logit_bias) >= vocab_size:
        raise ValueError(f"logit_bias token ids must be in [0, {vocab_size})")
    if params.structured_outputs is not None:
        if not has_tokenizer:
            raise ValueError("structured outputs need the model's tokenizer, and this model has none")
        try:
            check_structured_outputs(params.structured_outputs)
        except ValueError as exc:
            raise ValueError(f"structured outputs: {exc}") from None
    if n >= max_model_len:
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens, and the prompt has {n} "
            f"tokens, which leaves no room to generate. Please shorten the prompt."
        )
    max_tokens = params.max_tokens
    if strict_max_tokens and max_tokens is not None and n + max_tokens > max_model_len:
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{n + max_tokens} tokens ({n} in the prompt, {max_tokens} in the completion). Please reduce "
            f"the length of the prompt or of max_tokens."
        )
    if block_size and num_usable_blocks is not None:
        longest = max_model_len if max_tokens is None else min(n + max_tokens, max_model_len)
        need = -(-longest // block_size)
        if need > num_usable_blocks:
            raise ValueError(
                f"This request may need {longest} tokens of KV cache but the cache holds "
                f"{num_usable_blocks * block_size}. Please reduce the length of the prompt or of max_tokens."
            )


def make_core_requests(
    child_ids: list[str],
    prompt_ids: list[int],
    params: SamplingParams,
    eos_token_id: int | None,
    priority: int,
    arrival_time: float,
) -> list[EngineCoreRequest]:
    """One core request per sequence of an n > 1 request: child i samples with seed + i (else the
    children would sample alike), and children after the first share the first one's prompt blocks."""
    n = len(child_ids)
    reqs = []
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
