"""Perplexity of quantized execution against float32, and against llama.cpp on the same file and text.

    .venv/bin/python benchmarks/perplexity.py                      # every config, llama.cpp if built
    .venv/bin/python benchmarks/perplexity.py --configs fp32 gguf  # a subset

The text is tests/data/opticks_excerpt.txt (about 4,000 SmolLM2 tokens; see tests/data/README.md).
It is scored as llama.cpp's `llama-perplexity` scores it: the tokens are cut into chunks of --ctx
(512), each chunk is evaluated on its own (BOS first only where the GGUF asks for one; SmolLM2's does
not), and the second half of each chunk is scored, so every scored token has at least ctx/2 tokens
of context. Perplexity = exp(mean negative log-likelihood over the scored tokens).

Configs (all on the default model, SmolLM2-135M-Instruct, whose only weights are its Q4_1 GGUF: its
float32 dequantization is the reference):
  fp32   the GGUF dequantized to float32 (the unquantized path)
  gguf   the Q4_1 blocks kept packed (--quantization gguf), activations in float32
  gguf-8 the same, the prompts fed 8 tokens a step (--max-num-batched-tokens 8): every linear takes
         the few-rows path that decoding takes, by default the integer dot products (activations
         rounded to int8 per 32-block); PAGODA_QUANT_ISA=avx512 (or avx2) scores its float path
  int8   the float32 weights made int8 per output channel (--quantization int8)
  q8_0   a Q8_0 GGUF written from the float32 weights with gguf-py, run packed
  llama.cpp  `llama-perplexity` on the Q4_1 file (PEER_CACHE/llama.cpp-build/bin, built beside the
         llama-server of benchmarks/compare_cpu.sh with `cmake --build <build> --target llama-perplexity`)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TEXT = ROOT / "tests" / "data" / "opticks_excerpt.txt"
CONFIGS = ("fp32", "gguf", "gguf-8", "int8", "q8_0")


def chunks(ids: list[int], ctx: int) -> list[list[int]]:
    return [ids[i * ctx:(i + 1) * ctx] for i in range(len(ids) // ctx)]


def pagoda_perplexity(model: str | None, ids: list[int], ctx: int, quantization: str | None, bos: int | None,
                      **engine_args) -> float:
    from pagoda import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", quantization=quantization, max_model_len=max(ctx + 8, 1024),
              enable_prefix_caching=False, **engine_args)
    prompts = []
    for chunk in chunks(ids, ctx):
        chunk = list(chunk)
        if bos is not None:
            chunk[0] = bos
        prompts.append({"prompt_token_ids": chunk})
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    nll, count = 0.0, 0
    for out in llm.generate(prompts, params, use_tqdm=False):
        tokens = out.prompt_token_ids
        # llama.cpp scores logits[j] against token j + 1 for j in [ctx/2, ctx - 1): tokens ctx/2 + 1 ...
        for pos in range(ctx // 2 + 1, len(tokens)):
            nll -= out.prompt_logprobs[pos][tokens[pos]].logprob
            count += 1
    return math.exp(nll / count)


def write_q8_0(src: Path, dst: Path) -> None:
    """The GGUF at `src` with every quantized 2-D tensor re-quantized to Q8_0 from its float32
    dequantization (metadata copied as it is)."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize, quantize

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch=arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        kind = field.types[0]
        sub = field.types[1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), kind, sub_type=sub)
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        if t.tensor_type.name in ("F32", "F16") or len(shape) != 2:
            writer.add_tensor(t.name, np.asarray(t.data).reshape(shape))
            continue
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        writer.add_tensor(t.name, quantize(w, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def llama_cpp_perplexity(binary: Path, gguf_path: Path, text: Path, ctx: int, threads: int) -> float | None:
    proc = subprocess.run([str(binary), "-m", str(gguf_path), "-f", str(text), "-c", str(ctx), "-b", str(ctx),
                           "-t", str(threads), "--no-warmup"], capture_output=True, text=True)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", proc.stdout + proc.stderr)
    if proc.returncode != 0 or not found:
        print(f"llama-perplexity failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-2000:]}", file=sys.stderr)
        return None
    return float(found.group(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--text", type=Path, default=TEXT)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--peer-cache", type=Path, default=Path(os.environ.get("PEER_CACHE", Path.home() / ".cache/pagoda-peers")))
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/perplexity.json")
    args = p.parse_args()

    import gguf

    from pagoda.model.loader import default_model_path, load_tokenizer, resolve_model

    model_path = default_model_path()
    reader = gguf.GGUFReader(str(model_path))
    add_bos = reader.fields.get("tokenizer.ggml.add_bos_token")
    bos = reader.fields["tokenizer.ggml.bos_token_id"].contents() if add_bos and add_bos.contents() else None
    tokenizer = load_tokenizer(resolve_model(None))
    ids = tokenizer.encode(args.text.read_text(encoding="utf-8"), add_special_tokens=False)
    n_chunks = len(ids) // args.ctx
    print(f"{args.text.name}: {len(ids)} tokens, {n_chunks} chunks of {args.ctx}, "
          f"{n_chunks * (args.ctx // 2 - 1)} scored")
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for config in args.configs:
            start = time.perf_counter()
            if config == "fp32":
                ppl = pagoda_perplexity(None, ids, args.ctx, None, bos)
            elif config == "gguf":
                ppl = pagoda_perplexity(None, ids, args.ctx, "gguf", bos)
            elif config == "gguf-8":
                ppl = pagoda_perplexity(None, ids, args.ctx, "gguf", bos, max_num_batched_tokens=8)
            elif config == "int8":
                ppl = pagoda_perplexity(None, ids, args.ctx, "int8", bos)
            else:
                q8 = Path(tmp) / "model-Q8_0.gguf"
                write_q8_0(model_path, q8)
                ppl = pagoda_perplexity(str(q8), ids, args.ctx, "gguf", bos)
            results[config] = ppl
            print(f"{config:10s} PPL {ppl:.4f}  ({time.perf_counter() - start:.0f} s)", flush=True)
    binary = args.peer_cache / "llama.cpp-build" / "bin" / "llama-perplexity"
    if binary.is_file():
        ppl = llama_cpp_perplexity(binary, model_path, args.text, args.ctx, args.threads)
        if ppl is not None:
            results["llama.cpp"] = ppl
            print(f"{'llama.cpp':10s} PPL {ppl:.4f}  (Q4_1 file, llama-perplexity -c {args.ctx})")
    else:
        print(f"no {binary}: llama.cpp's perplexity not measured", file=sys.stderr)
    base = results.get("fp32")
    if base:
        for name, ppl in results.items():
            print(f"{name:10s} {100 * (ppl / base - 1):+.2f} % against fp32")
    if "gguf" in results and "llama.cpp" in results:
        print(f"gguf (Q4_1 packed) against llama.cpp on the same file: {100 * (results['gguf'] / results['llama.cpp'] - 1):+.2f} %")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"text": args.text.name, "tokens": len(ids), "ctx": args.ctx, "ppl": results}, indent=1))


if __name__ == "__main__":
    main()
