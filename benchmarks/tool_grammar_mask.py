"""What holding `tool_choice: "auto"` to a grammar costs a row per step: llguidance's token-mask time
over SmolLM2's vocabulary (49,152 tokens) for each tool-call parser's grammar, while the model
writes free text (the common case) and while it writes a call, against a plain JSON-schema request.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/tool_grammar_mask.py [--steps 200]

Prints microseconds per mask: the mean over the steps of each part (most of a call's tokens are
forced, which costs little; its arguments cost what a JSON schema does). The text is fed token by token as a model
would write it; each step computes the mask of the next token, as the runner does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}
PROSE = ("Sure. The weather in Paris depends on the season: summers are warm and winters are mild, with "
         "rain spread over the year. Let me check today's forecast for you. ") * 3
CALLS = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]',
}


def mask_times(llg_tokenizer, grammar: str, ids: list[int], steps: int) -> list[float]:
    import llguidance

    matcher = llguidance.LLMatcher(llg_tokenizer, grammar, log_level=1)
    words = (llg_tokenizer.vocab_size + 31) // 32
    mask = np.zeros(words, dtype=np.int32)
    out = []
    for tok in ids[:steps]:
        t = time.perf_counter()
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, words * 4)
        out.append((time.perf_counter() - t) * 1e6)
        if not matcher.consume_token(tok):
            raise RuntimeError(f"the grammar refused token {tok}: {matcher.get_error()}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    import llguidance
    import llguidance.hf

    from pagoda.model.loader import load_tokenizer, resolve_model
    from pagoda.serve.tool_parsers import TOOL_PARSERS, Vocabulary

    tokenizer = load_tokenizer(resolve_model(None))
    llg = llguidance.hf.from_tokenizer(tokenizer)
    vocab = Vocabulary(tokenizer)
    rows = []
    schema = llguidance.grammar_from("json_schema", json.dumps(WEATHER))
    json_ids = tokenizer.encode('{"city": "Paris", "days": 2}', add_special_tokens=False)
    rows.append(("json schema (response_format)", "-", statistics.mean(mask_times(llg, schema, json_ids, args.steps))))
    for name, parser in sorted(TOOL_PARSERS.items()):
        grammar = llguidance.grammar_from("lark", parser().grammar({"get_weather": WEATHER}, vocab))
        prose = tokenizer.encode(PROSE, add_special_tokens=False)
        call = tokenizer.encode(PROSE + CALLS[name], add_special_tokens=False)[len(prose):]
        free = mask_times(llg, grammar, prose, args.steps)
        whole = mask_times(llg, grammar, prose + call, len(prose) + len(call))
        rows.append((name, f"{statistics.mean(free):.0f}", statistics.mean(whole[len(prose):])))
    print(f"{'grammar':32} {'free text us':>13} {'in the call us':>15}")
    for name, free, in_call in rows:
        print(f"{name:32} {free:>13} {in_call:>15.0f}")


if __name__ == "__main__":
    main()
