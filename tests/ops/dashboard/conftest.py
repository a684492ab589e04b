"""One real `pagoda serve` on a tiny random model for the dashboard's end-to-end tests (the page in
Chromium, the Grafana board's series, `pagoda top`): two tenants' API keys, at most two requests
running (so that others wait), a 16-token cap on a prompt's chunk per step (so that prefills come in
chunks), and n-gram speculative decoding (so that its counters exist)."""

from __future__ import annotations

import json

import pytest

from tests.ops.dashboard.server_helpers import PREFILL_CHUNK, TENANT_KEYS, auth
from tests.serve.serve_helpers import ServerProcess
from tests.tiny_models import save_tiny_model, save_tiny_tokenizer


@pytest.fixture(scope="package")
def dashboard_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_dashboard")
    save_tiny_model("llama3", folder, max_position_embeddings=4096)
    save_tiny_tokenizer(folder)
    keys = folder / "api_keys.json"
    keys.write_text(json.dumps([{"key": key, "name": name} for name, key in TENANT_KEYS.items()]))
    srv = ServerProcess([
        str(folder), "--dtype", "float32", "--max-model-len", "4096", "--num-gpu-blocks-override", "600",
        "--max-num-seqs", "2", "--long-prefill-token-threshold", str(PREFILL_CHUNK), "--api-keys-file", str(keys),
        "--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 2}),
        "--log-stats-interval", "0",
    ]).start()
    try:
        srv.wait_ready(probe_headers=auth("team-a"))
        yield srv
    finally:
        srv.stop()
