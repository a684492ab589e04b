"""docs/grafana/pagoda.json: a Grafana dashboard over our Prometheus names. Every series a panel
queries exists in the /metrics of a real server (with the labels the query uses), so a renamed
metric breaks this test rather than a board in production."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.ops.dashboard.server_helpers import complete

BOARD = Path(__file__).resolve().parents[3] / "docs" / "grafana" / "pagoda.json"
SERIES = re.compile(r"\bpagoda:[A-Za-z0-9_]+")
# A series and its label matchers, e.g. pagoda:x_bucket{model_name=~"$model_name"}.
SELECTOR = re.compile(r"(\bpagoda:[A-Za-z0-9_]+)\{([^}]*)\}")
GROUPING = re.compile(r"\bby \(([^)]*)\)")


def board_queries() -> list[str]:
    board = json.loads(BOARD.read_text())
    exprs: list[str] = []

    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("expr", "definition") and isinstance(value, str):
                    exprs.append(value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(board)
    return exprs


def served_series(text: str) -> dict[str, set[str]]:
    """Sample name -> the label names it carries, from a /metrics body."""
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, set()).update(s.labels)
    return out


def test_board_is_an_importable_dashboard():
    board = json.loads(BOARD.read_text())
    assert board["uid"] and board["title"] == "Pagoda"
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert len(panels) >= 15
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for p in panels:
        assert p["targets"], p["title"]
        assert p["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]
        for t in p["targets"]:
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
    variables = {v["name"] for v in board["templating"]["list"]}
    assert {"DS_PROMETHEUS", "model_name"} <= variables


def test_every_series_the_board_queries_exists_in_metrics(dashboard_server):
    # Tenant series exist once a tenant sent a request; the per-position draft counter once a draft
    # was verified (a repeating prompt gives the n-gram proposer something to propose).
    complete(dashboard_server, "team-a", [5, 6, 7, 8] * 6, 12)
    text = httpx.get(f"{dashboard_server.url}/metrics", timeout=10).text
    served = served_series(text)
    queries = board_queries()
    wanted = {name for q in queries for name in SERIES.findall(q)}
    assert len(wanted) >= 25
    missing = sorted(wanted - served.keys())
    assert missing == [], f"queried by docs/grafana/pagoda.json but not in /metrics: {missing}"
    for q in queries:
        for name, matchers in SELECTOR.findall(q):
            for label in re.findall(r"([A-Za-z_]+)\s*=~?", matchers):
                assert label in served[name], f"{name} has no label {label} (in {q})"
        names = SERIES.findall(q)
        for group in GROUPING.findall(q):
            for label in (g.strip() for g in group.split(",")):
                assert any(label in served[n] for n in names), f"no series of {q!r} has the label {label}"
