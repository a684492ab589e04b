"""The dashboard tests' server settings and small clients (the server itself: conftest.py)."""

from __future__ import annotations

import httpx

from tests.serve.serve_helpers import ServerProcess, wait_for

TENANT_KEYS = {"team-a": "sk-dashboard-team-a", "team-b": "sk-dashboard-team-b"}
PREFILL_CHUNK = 16


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TENANT_KEYS[tenant]}"}


def complete(srv: ServerProcess, tenant: str, prompt: list[int], max_tokens: int) -> dict:
    r = httpx.post(f"{srv.base_url}/completions", headers=auth(tenant), timeout=120,
                   json={"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def load(srv: ServerProcess) -> dict:
    return httpx.get(f"{srv.url}/load", timeout=10).json()


def wait_idle(srv: ServerProcess) -> None:
    def idle():
        body = load(srv)
        return body["num_requests_running"] == 0 and body["num_requests_waiting"] == 0 and body["server_load"] == 0

    wait_for(idle, 60, what="the server to be idle")
