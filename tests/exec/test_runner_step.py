"""The model runner reads only the plain-data step: its per-request mirror of token ids, built when a
request is new or resumed and extended by each step's tokens, must hand sampling exactly the
request's history (penalties and min_tokens read it), through chunked prefill and preemption."""

from __future__ import annotations

import subprocess
import sys

from pagoda import SamplingParams
from pagoda.exec import model_runner
from tests.conftest import make_engine

PROMPTS = [[(7 * i + j) % 200 + 3 for j in range(18 + 5 * i)] for i in range(4)]


def _params(i: int) -> SamplingParams:
    # Every history-reading stage: repetition (prompt + output), presence and frequency (output),
    # min_tokens (the output count), on greedy and seeded rows.
    return SamplingParams(
        temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=24, min_tokens=6, ignore_eos=True,
        repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3 * i, stop_token_ids=[5],
    )


def _run(loaded, monkeypatch, **engine_args):
    llm = make_engine(loaded, block_size=4, **engine_args)
    core = llm.engine.core
    runner = core.runner
    checked = []
    real_build = model_runner.SamplingMetadata.build
    expected: list[tuple[list[int], list[int]]] = []

    def build(params, prompt_token_ids, output_token_ids, *args, **kwargs):
        got = [(list(p), list(o)) for p, o in zip(prompt_token_ids, output_token_ids)]
        assert got == expected
        checked.append(len(got))
        return real_build(params, prompt_token_ids, output_token_ids, *args, **kwargs)

    real_execute = runner.execute

    def execute(so):
        # The scheduler's requests before update(): the histories sampling must see, in the
        # runner's row order (decodes first, then the rest; rows that sample only).
        order = [s for s in so.scheduled if s.num_new_tokens == 1] + [s for s in so.scheduled if s.num_new_tokens != 1]
        reqs = core.scheduler.requests
        expected[:] = [
            (reqs[s.request_id].prompt_token_ids, list(reqs[s.request_id].output_token_ids))
            for s in order if s.samples
        ]
        return real_execute(so)

    monkeypatch.setattr(model_runner.SamplingMetadata, "build", staticmethod(build))
    monkeypatch.setattr(runner, "execute", execute)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], [_params(i) for i in range(4)], use_tqdm=False)
    monkeypatch.undo()
    assert sum(checked) >= sum(len(o.outputs[0].token_ids) for o in outs)
    assert runner.requests == {} and runner.block_tables.row_of == {}
    return [o.outputs[0].token_ids for o in outs], core.stats().num_preemptions


def test_sampling_sees_exact_histories_through_chunking_and_preemption(tiny_llama3_fp32, monkeypatch):
    roomy, none = _run(tiny_llama3_fp32, monkeypatch, num_gpu_blocks_override=128)
    # 16 usable blocks of 4 tokens cannot hold four requests of 42-57 tokens; 8-token steps chunk
    # every prompt.
    tight, preemptions = _run(tiny_llama3_fp32, monkeypatch, num_gpu_blocks_override=17,
                              max_num_batched_tokens=8, max_model_len=64)
    assert none == 0 and preemptions > 0
    assert tight == roomy


def test_the_runner_loads_without_the_scheduler():
    code = (
        "import sys, pagoda.exec.model_runner; "
        "bad = [m for m in sys.modules if m.startswith(('pagoda.sched', 'pagoda.kv', 'pagoda.engine'))]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
