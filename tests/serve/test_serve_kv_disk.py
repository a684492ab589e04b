"""`pagoda serve --kv-offloading-backend disk`: the prefix cache survives a restart. A repeated long
prompt, answered by a restarted server, has its prefix served from disk (the usage's cached_tokens)
with the same answer; a corrupted tier file is skipped with a warning in the server's log, and the
answer is still the same."""

from __future__ import annotations

import httpx
import pytest

from serve_helpers import SMALL_ENGINE_ARGS, ServerProcess

pytestmark = pytest.mark.slow

PROMPT = " ".join(f"Item {i} of the inventory is a box of {i * 7 % 13} red apples." for i in range(24))


def _serve_once(folder) -> tuple[dict, str]:
    """Start a server on the disk tier in `folder`, send PROMPT once, stop it; (the reply, its log)."""
    srv = ServerProcess([*SMALL_ENGINE_ARGS, "--kv-offloading-size", "0.25", "--kv-offloading-backend", "disk",
                         "--kv-offloading-dir", str(folder)]).start()
    try:
        srv.wait_ready()
        with httpx.Client(base_url=srv.url, timeout=300) as http:
            r = http.post("/v1/completions", json={"model": http.get("/v1/models").json()["data"][0]["id"],
                                                   "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            reply = r.json()
    finally:
        code = srv.stop()
    assert code == 0, f"server did not stop cleanly (exit {code}):\n{srv.log_tail()}"
    return reply, srv.log_tail(200_000)


def test_restarted_server_serves_the_prefix_from_disk_and_skips_a_corrupt_file(tmp_path):
    first, _ = _serve_once(tmp_path)
    n = first["usage"]["prompt_tokens"]
    assert n > 300 and first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    files = sorted(tmp_path.glob("*/slot-*.kvb"))
    # Every full block of the 8 + n tokens but the last sampled one (its KV is never computed).
    assert len(files) == (n + 8 - 1) // 16

    second, log = _serve_once(tmp_path)
    # A fresh process: nothing in the first tier, every full block but the last token from disk.
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 16 * ((n - 1) // 16)
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert f"{len(files)} blocks found from an earlier run" in log

    victim = files[len(files) // 2]  # slot k holds the prompt's block k
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x5A
    victim.write_bytes(bytes(data))
    third, log = _serve_once(tmp_path)
    assert f"skipping {victim}: corrupt: checksum mismatch" in log
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == 16 * (len(files) // 2)
    assert third["choices"][0]["text"] == first["choices"][0]["text"]
