"""KV sizing from gpu_memory_utilization after a profiling forward, with injected memory readings."""

from __future__ import annotations

import pytest
import torch

from pagoda.config import EngineArgs
from pagoda.exec.kv_sizing import dummy_prefill, kv_cache_bytes, peak_usage, profile_kv_budget
from pagoda.model.loader import load_model
from tests.tiny_models import save_tiny_model

GiB = 1024**3


def test_arithmetic():
    # 80 GiB device; 30 GiB used when read, of which PyTorch reserves 28: 2 GiB outside PyTorch.
    usage = peak_usage(total=80 * GiB, free=50 * GiB, reserved=28 * GiB, peak_allocated=20 * GiB, profile_kv_bytes=GiB)
    assert usage == 20 * GiB - GiB + 2 * GiB
    assert kv_cache_bytes(80 * GiB, 0.9, usage) == int(72 * GiB) - 21 * GiB


def test_dummy_prefill_splits_at_max_model_len():
    ids, pos, meta, blocks = dummy_prefill(100, 40, 16, torch.device("cpu"))
    assert meta.seq_lens_cpu == [40, 40, 20] and meta.query_start_loc_cpu == [0, 40, 80, 100]
    assert ids.shape == (100,) and pos[:3].tolist() == [0, 1, 2] and pos[40] == 0
    assert blocks == 1 + 3 + 3 + 2  # block 0 stays the null block
    assert meta.slot_mapping.unique().numel() == 100 and meta.slot_mapping.min() == 16
    assert meta.max_query_len == 40 and meta.num_decodes == 0


class FakeMemory:
    """Readings of a pretend 10 GiB device; records that a peak reset preceded the reading."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def reset_peak(self) -> None:
        self.calls.append("reset")

    def synchronize(self) -> None:
        self.calls.append("sync")

    def peak_allocated(self) -> int:
        self.calls.append("peak")
        return 3 * GiB

    def reserved(self) -> int:
        return 4 * GiB

    def mem_get_info(self) -> tuple[int, int]:
        return 5 * GiB, 10 * GiB  # 5 GiB used: 4 reserved by PyTorch, 1 outside


@pytest.mark.parametrize("chunked", [True, False])
def test_profile_runs_a_forward_and_sizes_from_the_peak(tmp_path, chunked, monkeypatch):
    save_tiny_model("qwen3", tmp_path)
    loaded = load_model(str(tmp_path), dtype="float32")
    seen = []
    model = loaded.model
    original = model.forward

    def spy(input_ids, positions, attn):
        seen.append(input_ids.shape[0])
        return original(input_ids, positions, attn)

    monkeypatch.setattr(model, "forward", spy)
    args = EngineArgs(max_num_batched_tokens=96, max_num_seqs=4, enable_chunked_prefill=chunked, gpu_memory_utilization=0.8)
    cfg = loaded.config
    mem = FakeMemory()
    budget = profile_kv_budget(
        model, args, 128, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, torch.float32, torch.device("cpu"), mem
    )
    # Without chunking a whole max_model_len prompt is one step.
    assert seen == [96 if chunked else 128]
    assert mem.calls.index("reset") < mem.calls.index("peak")
    blocks = (96 if chunked else 128) // 16 + 1
    profile_kv = cfg.num_hidden_layers * 2 * blocks * 16 * cfg.num_key_value_heads * cfg.head_dim * 4
    assert budget == int(10 * GiB * 0.8) - (3 * GiB - profile_kv + GiB)
