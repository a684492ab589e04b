"""Speculative decoding on CPU: single-stream decode speed on an input-grounded workload, and batch
throughput at 64 concurrent requests, each with speculation off and on, in one invocation.

Input-grounded prompts ask for an answer that copies much of the prompt (a code edit, an extraction,
quoting a passage), the workload where n-gram lookup pays. Everything is greedy, so every mode must
produce the same tokens; the script checks that and fails otherwise. Modes are interleaved run by
run (drift hits all alike) and medians are reported.

Single stream: each prompt is generated alone; decode tok/s = (output tokens - 1) / (time of the
last token - time of the first), summed over the prompts. Batch: the prompts repeated to 64
requests (each with a distinct first user line, so the prefix cache does not serve whole prompts),
all submitted at once; output tok/s over the whole generate call.

    python benchmarks/spec_decode.py --dtype float32 --runs 3 [--modes off,ngram,ngram-gated,own-draft] [--batch 64]

float32, because greedy equality across modes is exact there; in bfloat16, scoring several positions
in one forward adds in another order than decoding them one by one, and near-ties may flip.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

CODE = '''def total_price(items, tax_rate):
    total = 0
    for item in items:
        price = item["price"] * item["quantity"]
        if item.get("discount"):
            price = price - price * item["discount"]
        total = total + price
    return total + total * tax_rate
'''
PASSAGE = (
    "The committee met on Tuesday to review the budget. Ms. Alvarez said the library would need new "
    "shelves before the winter term. Mr. Chen reported that the road repairs on Elm Street were two "
    "weeks behind schedule because of the rain. The committee agreed to meet again on the first "
    "Monday of next month."
)
PROMPTS = [
    f"Rename the variable `total` to `subtotal` in this Python function and print the whole function:\n\n{CODE}",
    f"Add a docstring to this function and return the complete code:\n\n{CODE}",
    f"Copy the following text exactly, then say how many sentences it has:\n\n{PASSAGE}",
    f"Quote the sentence about the road repairs from this text word for word:\n\n{PASSAGE}",
    f"Rewrite this function with type hints, keeping everything else the same:\n\n{CODE}",
    f"Repeat this text, replacing 'committee' with 'board':\n\n{PASSAGE}",
]

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
MODES = {
    "off": None,
    "ngram": {**NGRAM, "disable_by_batch_size": None},  # never gated
    "ngram-gated": NGRAM,  # the default gate
    "own-draft": "own-draft",
}


def _engine(spec, args):
    from pagoda.engine.llm import LLM
    from pagoda.model.loader import resolve_model

    if spec == "own-draft":  # the target model as its own draft: every draft stands, at full price
        spec = {"method": "draft_model", "model": str(resolve_model(args.model).path), "num_speculative_tokens": 4,
                "disable_by_batch_size": None}

    return LLM(args.model, dtype=args.dtype, speculative_config=spec, max_num_seqs=args.batch,
               enable_prefix_caching=True)


def _prompt_ids(tokenizer, text: str, tag: str = "") -> list[int]:
    messages = [{"role": "user", "content": (tag + text) if tag else text}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def single_stream(llm, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    """Decode tok/s of the prompts run one at a time, and their outputs."""
    from pagoda.sampling_params import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    decode_tokens, decode_time, outputs = 0, 0.0, []
    for ids in prompts:
        engine.add_request({"prompt_token_ids": ids}, params)
        first = last = None
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                now = time.perf_counter()
                if first is None:
                    first = now
                last = now
                tokens = list(out.outputs[0].token_ids)
        llm.reset_prefix_cache()
        decode_tokens += len(tokens) - 1
        decode_time += last - first
        outputs.append(tokens)
    return decode_tokens / decode_time, outputs


def batch(llm, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    from pagoda.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    llm.reset_prefix_cache()
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return sum(map(len, tokens)) / elapsed, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--batch-max-tokens", type=int, default=64)
    ap.add_argument("--modes", default="off,ngram,ngram-gated")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: single, batch")
    ap.add_argument("--json", default=None)
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="pin torch to N threads (on a shared machine a busy core stalls every parallel region)")
    args = ap.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    modes = args.modes.split(",")
    skip = set(filter(None, args.skip.split(",")))

    engines = {m: _engine(MODES[m], args) for m in modes}
    tokenizer = next(iter(engines.values())).get_tokenizer()
    single = [_prompt_ids(tokenizer, p) for p in PROMPTS]
    many = [_prompt_ids(tokenizer, PROMPTS[i % len(PROMPTS)], f"(request {i})\n") for i in range(args.batch)]

    results: dict[str, dict] = {m: {"single_decode_tok_s": [], "batch_output_tok_s": []} for m in modes}
    reference: dict[str, list] = {}
    for part, fn, prompts, max_tokens in (("single", single_stream, single, args.max_tokens),
                                           ("batch", batch, many, args.batch_max_tokens)):
        if part in skip:
            continue
        key = "single_decode_tok_s" if part == "single" else "batch_output_tok_s"
        for m in modes:  # warm-up, and the outputs every mode must equal
            _, out = fn(engines[m], prompts[:2], 16)
        for run in range(args.runs):
            for m in modes:
                core = engines[m].engine.core
                before = core.stats()
                rate, out = fn(engines[m], prompts, max_tokens)
                after = core.stats()
                if part not in reference:
                    reference[part] = out
                elif out != reference[part]:
                    raise SystemExit(f"{m}: greedy output differs from {modes[0]}'s ({part})")
                drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
                accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
                results[m][key].append(rate)
                results[m].setdefault(part + "_acceptance", []).append(accepted / drafted if drafted else None)
                results[m].setdefault(part + "_output_tokens", sum(map(len, out)))
                acc = f", acceptance {100 * accepted / drafted:.1f}% of {drafted} draft tokens" if drafted else ""
                print(f"run {run + 1}/{args.runs} {part} {m}: {rate:.1f} tok/s{acc}", flush=True)

    print(f"\ntorch threads {torch.get_num_threads()}; medians of {args.runs} runs")
    base = results[modes[0]]
    for m in modes:
        r = results[m]
        cells = [m]
        for key, part in (("single_decode_tok_s", "single"), ("batch_output_tok_s", "batch")):
            if r[key]:
                med = statistics.median(r[key])
                ratio = med / statistics.median(base[key])
                accs = [a for a in r.get(part + "_acceptance", []) if a is not None]
                acc = f" acc {100 * statistics.median(accs):.1f}%" if accs else ""
                cells.append(f"{part}: {med:.1f} tok/s ({ratio:.2f}x){acc}")
        print(" | ".join(cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
