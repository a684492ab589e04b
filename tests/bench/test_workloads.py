"""Workloads: seeded, within bounds, free of special tokens; the shared prefix is shared."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from pagoda.bench.workloads import (
    allowed_token_ids,
    jsonl_workload,
    prefix_workload,
    random_workload,
    special_token_ids,
    vocab_for,
)


class FakeTokenizer:
    all_special_ids = [0, 1, 2]
    added_tokens_decoder = {100: "<|im_start|>", 101: "<|im_end|>"}

    def __len__(self) -> int:
        return 200

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [3 + (ord(c) % 90) for c in text]


def test_special_tokens_are_excluded():
    tok = FakeTokenizer()
    config = SimpleNamespace(vocab_size=256, bos_token_id=5, eos_token_id=[6, 7], pad_token_id=None)
    excluded = special_token_ids(tok, config)
    assert excluded == {0, 1, 2, 5, 6, 7, 100, 101}
    # The tokenizer's 200 ids, not the config's 256 embedding rows.
    assert vocab_for(tok, config) == 200
    allowed = allowed_token_ids(200, excluded)
    w = random_workload(50, 10, 40, 3, allowed, seed=1)
    used = {t for r in w.requests for t in r.prompt_ids}
    assert not used & excluded
    assert max(used) < 200


def test_random_workload_bounds_and_seed():
    allowed = allowed_token_ids(512, {1, 2})
    w = random_workload(64, 32, 512, 128, allowed, seed=0)
    lens = [len(r.prompt_ids) for r in w.requests]
    assert len(lens) == 64 and min(lens) >= 32 and max(lens) <= 512
    assert all(r.output_len == 128 for r in w.requests)
    assert w.num_output_tokens == 64 * 128
    assert w.num_prompt_tokens == sum(lens)
    again = random_workload(64, 32, 512, 128, allowed, seed=0)
    assert [r.prompt_ids for r in again.requests] == [r.prompt_ids for r in w.requests]
    other = random_workload(64, 32, 512, 128, allowed, seed=1)
    assert [r.prompt_ids for r in other.requests] != [r.prompt_ids for r in w.requests]
    d = w.describe()
    assert d["total_tokens"] == d["prompt_tokens"] + d["output_tokens"]


def test_random_workload_covers_both_ends():
    w = random_workload(400, 3, 5, 1, allowed_token_ids(50, set()), seed=0)
    assert {len(r.prompt_ids) for r in w.requests} == {3, 4, 5}  # inclusive bounds


def test_prefix_workload_shares_prefix():
    allowed = allowed_token_ids(512, {1, 2})
    w = prefix_workload(8, 100, 7, 5, allowed, seed=0)
    prefix = w.requests[0].prompt_ids[:100]
    assert all(r.prompt_ids[:100] == prefix and len(r.prompt_ids) == 107 for r in w.requests)
    assert len({tuple(r.prompt_ids[100:]) for r in w.requests}) == 8


def test_jsonl_workload(tmp_path):
    path = tmp_path / "w.jsonl"
    lines = [{"prompt": [5, 6, 7], "max_tokens": 4}, {"prompt": "hello"}, {"prompt": [9] * 10, "max_tokens": 2}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    w = jsonl_workload(path, FakeTokenizer(), default_output_len=9)
    assert [r.output_len for r in w.requests] == [4, 9, 2]
    assert w.requests[0].prompt_ids == [5, 6, 7]
    assert w.requests[1].prompt_ids == FakeTokenizer().encode("hello")
    assert len(jsonl_workload(path, FakeTokenizer(), num_prompts=2).requests) == 2
    with pytest.raises(ValueError, match="tokenizer"):
        jsonl_workload(path, None)
    path.write_text('{"prompt": [1], "max_tokens": 0}\n')
    with pytest.raises(ValueError, match="max_tokens"):
        jsonl_workload(path, None)


def test_bad_arguments():
    allowed = np.arange(10)
    with pytest.raises(ValueError):
        random_workload(4, 10, 5, 1, allowed, seed=0)
    with pytest.raises(ValueError):
        random_workload(4, 1, 5, 0, allowed, seed=0)
    with pytest.raises(ValueError):
        allowed_token_ids(3, {0, 1, 2})
