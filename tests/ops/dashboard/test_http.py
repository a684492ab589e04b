"""The dashboard's HTTP side on the shared tiny-model server: what is public and what needs a key,
one-line errors for unknown requests and assets, the snapshot's figures against /metrics and /load,
and a page that loads nothing from elsewhere."""

from __future__ import annotations

import re

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pagoda.ops.dashboard.routes import STATIC
from tests.ops.dashboard.server_helpers import auth, complete, wait_idle


def test_the_page_is_public_and_its_data_needs_a_key(dashboard_server):
    url = dashboard_server.url
    page = httpx.get(f"{url}/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for asset, kind in (("dashboard.js", "text/javascript"), ("dashboard.css", "text/css")):
        r = httpx.get(f"{url}/dashboard/static/{asset}")
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind)
    for path in ("/dashboard/snapshot", "/dashboard/requests/x/waterfall"):
        r = httpx.get(url + path)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", path
        assert httpx.get(url + path, headers={"Authorization": "Bearer sk-wrong"}).status_code == 401


def test_unknown_requests_and_assets_get_a_one_line_404(dashboard_server):
    url = dashboard_server.url
    r = httpx.get(f"{url}/dashboard/requests/cmpl-nope/waterfall", headers=auth("team-a"))
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["param"] == "request_id" and "cmpl-nope" in err["message"] and "\n" not in err["message"]
    for name in ("nope.js", "..%2Froutes.py", "figures.py"):
        # Only the shipped assets are public: any other path needs a key like every unknown path.
        assert httpx.get(f"{url}/dashboard/static/{name}").status_code == 401, name
        r = httpx.get(f"{url}/dashboard/static/{name}", headers=auth("team-a"))
        assert r.status_code == 404 and "Traceback" not in r.text, name


def test_snapshot_agrees_with_metrics_and_load(dashboard_server):
    complete(dashboard_server, "team-b", list(range(400, 430)), 3)
    wait_idle(dashboard_server)
    snap = httpx.get(f"{dashboard_server.url}/dashboard/snapshot", headers=auth("team-b")).json()
    text = httpx.get(f"{dashboard_server.url}/metrics").text
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
              if not s.labels.keys() - {"model_name", "engine"}}
    load = httpx.get(f"{dashboard_server.url}/load").json()
    assert (snap["running"], snap["waiting"]) == (load["num_requests_running"], load["num_requests_waiting"])
    assert snap["totals"]["prompt_tokens"] == values["pagoda:prompt_tokens_total"]
    assert snap["totals"]["generation_tokens"] == values["pagoda:generation_tokens_total"]
    assert snap["totals"]["prefix_cache_queries"] == values["pagoda:prefix_cache_queries_total"]
    assert snap["latency"]["e2e"]["count"] >= 1 and snap["latency"]["e2e"]["p50"] > 0
    assert snap["spec_decode"] is not None  # the server speculates
    newest = snap["recent_requests"][0]
    assert (newest["tenant"], newest["prompt_tokens"], newest["generation_tokens"]) == ("team-b", 30, 3)


def test_the_page_loads_nothing_from_elsewhere():
    for path in STATIC.iterdir():
        text = path.read_text()
        assert not re.search(r"(src|href)\s*=\s*[\"'](https?:)?//", text), path.name
        assert not re.search(r"(fetch|import)\s*\(\s*[\"'`]https?://", text), path.name
        assert "@import" not in text, path.name
