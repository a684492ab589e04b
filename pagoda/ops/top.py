"""`pagoda top`: the dashboard's figures in a terminal, redrawn every interval, for a server without
a browser at hand. It reads the same `/dashboard/snapshot` the page polls (with the API key as a
Bearer token when the server has keys) and draws plain text, clearing the screen between frames.
"""

from __future__ import annotations

import shutil
import sys
import time
from typing import Any, TextIO

import httpx

CLEAR = "\x1b[H\x1b[2J"
ALT_SCREEN_ON, ALT_SCREEN_OFF = "\x1b[?1049h\x1b[?25l", "\x1b[?25h\x1b[?1049l"


class TopError(Exception):
    """A refusal that waiting will not cure (a wrong key, no dashboard at that URL)."""


def fetch_snapshot(client: httpx.Client, url: str, api_key: str | None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = client.get(url.rstrip("/") + "/dashboard/snapshot", headers=headers)
    if r.status_code == 401:
        raise TopError(f"{url} refused the API key (401): pass --api-key or set PAGODA_API_KEY")
    if r.status_code == 404:
        raise TopError(f"{url} has no /dashboard/snapshot (404): is it a pagoda server?")
    r.raise_for_status()
    return r.json()


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _secs(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{1000 * s:.1f}ms" if s < 1 else f"{s:.2f}s"


def render(s: dict[str, Any], url: str, rows: int = 40) -> list[str]:
    """The frame's lines for one snapshot, the recent requests cut to fit `rows` lines."""
    t = s["totals"]
    by = t["requests_by_reason"]
    lines = [
        f"pagoda top  {url}  model: {s['model']}  status: {s['status']}  "
        f"{time.strftime('%H:%M:%S', time.localtime(s['time']))}",
        f"running {s['running']}   waiting {s['waiting']}   KV cache {_pct(s['kv_cache_usage_perc'])}   "
        f"prompt {s['prompt_tokens_per_s']:.1f} tok/s   generated {s['generation_tokens_per_s']:.1f} tok/s "
        f"(last {s['rate_window_s']:.0f} s)",
        f"prefix-cache hit rate {_pct(s['prefix_cache_hit_rate'])} (last {s['window_s']:.0f} s), "
        f"{_pct(s['prefix_cache_hit_rate_total'])} all time   preemptions {t['preemptions']} "
        f"({s['preemptions_in_window']} in the last {s['window_s']:.0f} s)",
    ]
    spec = s.get("spec_decode")
    if spec:
        lines.append(f"draft acceptance {_pct(spec['acceptance_rate'])} (last {s['window_s']:.0f} s), "
                     f"{_pct(spec['acceptance_rate_total'])} all time")
    lines += [
        f"requests finished {t['requests_finished']} (stop {by['stop']}, length {by['length']}, "
        f"abort {by['abort']})   prompt tokens {t['prompt_tokens']}   generated tokens {t['generation_tokens']}",
        "",
        f"{'latency (last %.0f s)' % s['window_s']:<22}{'p50':>10}{'p90':>10}{'p99':>10}{'n':>8}",
    ]
    for name, label in (("ttft", "TTFT"), ("itl", "ITL"), ("e2e", "E2E")):
        q = s["latency"][name]
        lines.append(f"{label:<22}{_secs(q['p50']):>10}{_secs(q['p90']):>10}{_secs(q['p99']):>10}{q['count']:>8}")
    lines += ["", f"{'tenant':<20}{'in flight':>10}{'requests':>10}{'prompt tok':>12}{'gen tok':>10}{'gen tok/s':>11}"]
    for ten in s["tenants"]:
        lines.append(f"{ten['tenant'][:19]:<20}{ten['in_flight']:>10}{ten['requests']:>10}{ten['prompt_tokens']:>12}"
                     f"{ten['generation_tokens']:>10}{ten['generation_tokens_per_s']:>11.1f}")
    lines += ["", f"{'recent requests':<40}{'tenant':<14}{'status':<10}{'prompt':>7}{'gen':>6}{'TTFT':>10}"
                  f"{'E2E':>10}  finish"]
    room = max(0, rows - len(lines) - 1)
    for r in s["recent_requests"][:room]:
        lines.append(f"{r['request_id'][:39]:<40}{(r['tenant'] or '-')[:13]:<14}{r['status']:<10}"
                     f"{r['prompt_tokens']:>7}{r['generation_tokens']:>6}{_secs(r['ttft']):>10}{_secs(r['e2e']):>10}"
                     f"  {r['finish_reason'] or '-'}")
    return lines


def run_top(url: str, api_key: str | None, interval: float, once: bool = False, out: TextIO = sys.stdout) -> int:
    """Redraw until interrupted (or one frame with `once`); a refused key or a wrong URL ends it
    with TopError, an unreachable server is retried (it may be restarting)."""
    interactive = not once and out.isatty()
    if interactive:
        out.write(ALT_SCREEN_ON)
    try:
        with httpx.Client(timeout=max(interval, 2.0)) as client:
            while True:
                size = shutil.get_terminal_size()
                try:
                    lines = render(fetch_snapshot(client, url, api_key), url, size.lines)
                except httpx.HTTPError as exc:
                    if once:
                        raise TopError(f"cannot reach {url}: {exc}") from None
                    lines = [f"pagoda top  {url}", f"cannot reach the server: {exc} (retrying)"]
                frame = "\n".join(line[: size.columns] for line in lines)
                out.write((CLEAR if interactive else "") + frame + "\n")
                out.flush()
                if once:
                    return 0
                time.sleep(interval)
    except KeyboardInterrupt:
        return 0
    finally:
        if interactive:
            out.write(ALT_SCREEN_OFF)
            out.flush()
