"""Structured outputs: each constrained row's logits are masked to the tokens its grammar allows.

Importing this module costs neither torch nor llguidance: the API process checks grammars with
`check_structured_outputs` without ever loading torch.

Grammars (JSON schema, regex, choice, Lark/GBNF) are compiled and matched by llguidance, whose token
masks take a few hundred microseconds per row: only rows that ask for structured outputs pay. One
matcher per sequence lives here between steps and consumes each token the row samples, so it is kept
across a preemption (the recomputed tokens are not sampled again) and dropped when the request ends.

With speculative decoding, drafts are cut to the prefix the grammar allows (`valid_drafts`) and each
drafted position is masked with the grammar's state after the drafts before it (`mask_drafted`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from pagoda.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


def apply_bitmask_(logits: torch.Tensor, bitmask: np.ndarray, rows: list[int]) -> None:
    """-inf on the tokens whose bit is 0 in the given rows of `bitmask` ([B, words] int32, token t is
    bit t % 32 of word t // 32, llguidance's layout). Unpacked with numpy: llguidance's own helper is
    a torch.compile kernel, which imports torch._dynamo (~5 s) and compiles on first use."""
    import torch

    bits = np.unpackbits(bitmask[rows].view(np.uint8), axis=1, bitorder="little")[:, : logits.shape[1]]
    banned = torch.from_numpy(bits == 0).to(logits.device)
    for k, row in enumerate(rows):  # in place on each row's view: no gather and scatter of [R, V]
        logits[row].masked_fill_(banned[k], float("-inf"))


def grammar_of(params: StructuredOutputsParams) -> str:
    """llguidance's grammar definition for these parameters."""
    import llguidance

    if params.json_object:
        return llguidance.grammar_from("json_schema", json.dumps({"type": "object"}))
    if params.json is not None:
        return llguidance.grammar_from("json_schema", params.json)
    if params.regex is not None:
        return llguidance.grammar_from("regex", params.regex)
    if params.choice is not None:
        return llguidance.grammar_from("choice", json.dumps(params.choice))
    return llguidance.grammar_from("grammar", params.grammar)


def check_structured_outputs(params: StructuredOutputsParams) -> None:
    """Raise ValueError (a message fit for a user) when the grammar does not compile."""
    import llguidance

    try:
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar_of(params))
    except Exception as exc:  # e.g. a JSON schema that is not JSON
        failed, messages = True, [str(exc)]
    if failed:
        # llguidance's messages quote the grammar over several lines; keep the ones that say why.
        lines = [line.strip() for line in (messages[0] if messages else "invalid").splitlines() if line.strip()]
        why = " ".join([lines[0], *[line for line in lines[1:] if line.startswith("error:")]])
        raise ValueError(f"the grammar does not compile: {why}")


class StructuredOutputs:
    """The matchers of the sequences that asked for structured outputs (execution layer state)."""

    def __init__(self, load_tokenizer: Callable[[], tuple[Any, int | None]], vocab_size: int) -> None:
        """`load_tokenizer`: () -> (the model's Hugging Face tokenizer or None, its EOS id), called on
        the first structured request (most servers never see one)."""
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self._tokenizer: Any = None  # llguidance's view of the model's tokenizer
        self.matchers: dict[str, Any] = {}

    def _llg_tokenizer(self) -> Any:
        if self._tokenizer is None:
            import llguidance.hf

            hf, eos = self._load_tokenizer()
            if hf is None:
                raise ValueError("structured outputs need the model's tokenizer, and this model has none")
            # ~0.5 s once: the vocabulary's byte strings, for token masks. A complete output allows
            # only EOS, which ends the request.
            self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size, eos_token=eos)
        return self._tokenizer

    def matcher(self, request_id: str, params: StructuredOutputsParams) -> Any:
        m = self.matchers.get(request_id)
        if m is None:
            import llguidance

            m = llguidance.LLMatcher(self._llg_tokenizer(), grammar_of(params), log_level=1)
            self.matchers[request_id] = m
        return m

    def mask(self, logits: torch.Tensor, rows: list[tuple[int, str, StructuredOutputsParams, int | None]]) -> None:
        """Mask (in place, to -inf) the tokens each row's grammar does not allow next. Rows are
        (row, request id, params, the request's EOS id)."""
        words = (self.vocab_size + 31) // 32
        bitmask = np.zeros((logits.shape[0], words), dtype=np.int32)
        masked = []
        for row, request_id, params, eos in rows:
            try:
                matcher = self.matcher(request_id, params)
            except Exception as exc:
                # The grammar was checked before the request was sent, so this is rare (the
                # tokenizer, say). Ending this request with EOS keeps the rest of the batch running.
                logger.error("structured outputs of %s: no matcher (%s: %s); ending it", request_id,
                             type(exc).__name__, exc)
                if eos is None or eos >= self.vocab_size:
                    continue
                bitmask[row].view(np.uint32)[eos // 32] = 1 << (eos % 32)  # EOS alone
            else:
                # A complete grammar allows EOS alone, which ends the request (unless ignore_eos).
                matcher.unsafe_compute_mask_ptr(bitmask[row].ctypes.data, words * 4)
            masked.append(row)
        if masked:
            apply_bitmask_(logits, bitmask, masked)

    def valid_drafts(self, request_id: str, params: StructuredOutputsParams, drafts: list[int]) -> list[int]:
        """The longest prefix of `drafts` the grammar allows after the request's tokens."""
        try:
            m = self.matcher(request_id, params)
        except Exception:
            return []  # mask() reports it and ends the request
        return [] if m.is_stopped() else drafts[: m.validate_tokens(drafts)]

    def mask_drafted(self, logits: torch.Tensor, rows: list[tuple[int, str, StructuredOutputsParams, list[int]]]) -> None:
        """Speculative rows: rows (first, request id, params, drafts); logits row first + j gets the
        mask after the request's tokens and drafts[:j]. The matcher consumes the drafts to compute
        the masks and rolls them back: accept() then takes the tokens verification keeps."""
        words = (self.vocab_size + 31) // 32
        bitmask = np.zeros((logits.shape[0], words), dtype=np.int32)
        masked = []
        for first, request_id, params, drafts in rows:
            m = self.matcher(request_id, params)  # it exists: the drafts were checked against it
            consumed = 0
            for j in range(len(drafts) + 1):
                if consumed == j:
                    m.unsafe_compute_mask_ptr(bitmask[first + j].ctypes.data, words * 4)
                    if j < len(drafts) and m.consume_token(drafts[j]):
                        consumed += 1
                else:
                    # Past a draft the grammar refuses, which is masked out above, so verification
                    # never reaches this row; the previous mask keeps its logits finite.
                    bitmask[first + j] = bitmask[first + j - 1]
                masked.append(first + j)
            if consumed:
                m.rollback(consumed)
        if masked:
            apply_bitmask_(logits, bitmask, masked)

    def accept(self, request_id: str, token_id: int) -> None:
        m = self.matchers.get(request_id)
        if m is not None and not m.is_stopped() and not m.consume_token(token_id):
            logger.warning("structured outputs of %s: the grammar refused token %d (%s)", request_id, token_id,
                           m.get_error())

    def drop(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)
