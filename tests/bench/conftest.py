"""Fixtures for the benchmark smoke tests: a tiny random model, one torch thread, a fake server."""

from __future__ import annotations

import pytest
import torch

from tests.bench.fake_openai import FakeServer


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """Llama, hidden 64, 2 layers, 4 heads (2 KV), vocab 512, random weights from seed 0; no tokenizer."""
    from pagoda.bench.models import make_random_model

    return str(make_random_model("tiny-llama", tmp_path_factory.mktemp("tiny-llama"), seed=0, dtype="float32"))


@pytest.fixture(autouse=True)
def one_thread():
    # The tiny model's matmuls are microseconds; with one OpenMP thread per core on a shared
    # machine each one can wait a scheduler tick for a busy core. One thread keeps tests fast.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def fake_server():
    servers: list[FakeServer] = []

    def start(**kwargs) -> FakeServer:
        servers.append(FakeServer(**kwargs).start())
        return servers[-1]

    yield start
    for s in servers:
        s.stop()
