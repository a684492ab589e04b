"""The CPU KV pool's default size: vLLM's variable, the model's ceiling, the machine's quarter."""

from __future__ import annotations

import pytest

from pagoda.exec.cpu_kv_sizing import DEFAULT_CPU_KV_BYTES, cpu_kv_budget

GIB = 1024**3
SMOLLM2_BF16 = 23_040  # bytes per token: 30 layers x K/V x 3 heads x 64 x 2 bytes


def test_default_for_a_real_model_on_a_big_machine():
    assert cpu_kv_budget(SMOLLM2_BF16, 256, 8192, env={}, mem_total=24 * GIB) == (DEFAULT_CPU_KV_BYTES, "default")


def test_vllm_variable_wins_and_zero_means_auto():
    assert cpu_kv_budget(SMOLLM2_BF16, 256, 8192, env={"VLLM_CPU_KVCACHE_SPACE": "6"}, mem_total=8 * GIB) == (
        6 * GIB, "VLLM_CPU_KVCACHE_SPACE")
    assert cpu_kv_budget(SMOLLM2_BF16, 256, 8192, env={"VLLM_CPU_KVCACHE_SPACE": "0"}, mem_total=24 * GIB)[0] == (
        DEFAULT_CPU_KV_BYTES)
    with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE must be a number of GiB, got 'lots'"):
        cpu_kv_budget(SMOLLM2_BF16, 256, 8192, env={"VLLM_CPU_KVCACHE_SPACE": "lots"})


def test_never_more_than_every_sequence_at_full_length():
    assert cpu_kv_budget(1024, 4, 512, env={}, mem_total=24 * GIB) == (1024 * 4 * 512, "max_num_seqs x max_model_len")


def test_small_machine_gets_a_quarter_but_at_least_one_full_sequence():
    assert cpu_kv_budget(SMOLLM2_BF16, 256, 8192, env={}, mem_total=4 * GIB) == (GIB, "a quarter of the machine's memory")
    tiny_machine = cpu_kv_budget(SMOLLM2_BF16, 256, 8192, env={}, mem_total=256 * 1024**2)
    assert tiny_machine[0] == SMOLLM2_BF16 * 8192
