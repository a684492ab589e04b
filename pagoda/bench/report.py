"""Turn `pagoda bench ... --json` files into Markdown tables for docs/benchmarks.md.

    .venv/bin/python -m pagoda.bench.report benchmarks/results/*.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
from pathlib import Path
from typing import Any

from pagoda.config import EngineArgs


def _f(x: Any, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


# Engine flags that default to on (argparse.BooleanOptionalAction): off is spelled --no-<flag>.
_NEGATABLE = {f.name for f in dataclasses.fields(EngineArgs) if f.default is True}


def command_line(rec: dict[str, Any]) -> str:
    """The flags that were given, rebuilt from the record (defaults included, so it is exact)."""
    if rec.get("argv"):
        return shlex.join(["pagoda", *rec["argv"]])
    args = dict(rec.get("args", {}))
    words = ["pagoda", args.pop("command", "bench"), args.pop("bench_command", "")]
    for key, value in args.items():
        if value is None:
            continue
        if value is False:
            if key in _NEGATABLE:
                words.append("--no-" + key.replace("_", "-"))
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            words.append(flag)
        else:
            words += [flag, str(value)]
    return shlex.join(w for w in words if w)


def throughput_rows(records: list[tuple[str, dict[str, Any]]]) -> str:
    lines = [
        "| result | model | dtype | requests | prompt + output tokens | Pagoda total tok/s | Pagoda output tok/s | "
        "Pagoda req/s | transformers total tok/s (batch) | ratio | runs |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in records:
        w, p = r["workload"], r["pagoda"]["median"]
        hf = r.get("hf")
        hf_cell = f"{_f(hf['median']['total_tokens_per_s'])} (bs {hf['best_batch_size']})" if hf else "-"
        ratio = f"{r['ratio']['total_tokens_per_s']:.2f}x" if "ratio" in r else "-"
        lines.append(
            f"| {name} | {r['model']} | {r['dtype']} | {w['num_requests']} | {w['prompt_tokens']:,} + {w['output_tokens']:,} | "
            f"{_f(p['total_tokens_per_s'])} | {_f(p['output_tokens_per_s'])} | {_f(p['requests_per_s'], 2)} | {hf_cell} | {ratio} | {r['runs']} |"
        )
    return "\n".join(lines)


def serve_rows(records: list[tuple[str, dict[str, Any]]]) -> str:
    lines = [
        "| result | model | completed/failed | req/s | output tok/s | total tok/s | TTFT p50/p90/p99 ms | "
        "ITL p50/p90/p99 ms | TPOT p50 ms | E2E p50 s | goodput req/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in records:
        m = r["metrics"]
        t, i = m["ttft_ms"], m["itl_ms"]
        lines.append(
            f"| {name} | {r['model']} | {m['completed']}/{m['failed']} | {_f(m['request_throughput'], 2)} | "
            f"{_f(m['output_token_throughput'])} | {_f(m['total_token_throughput'])} | "
            f"{_f(t['p50'])}/{_f(t['p90'])}/{_f(t['p99'])} | {_f(i['p50'])}/{_f(i['p90'])}/{_f(i['p99'])} | "
            f"{_f(m['tpot_ms']['p50'])} | {_f((m['e2e_ms']['p50'] or 0) / 1e3, 2)} | {_f(m['goodput'], 2)} |"
        )
    return "\n".join(lines)


def latency_rows(records: list[tuple[str, dict[str, Any]]]) -> str:
    lines = [
        "| result | prompt tokens | TTFT ms | prefill tok/s | decode ms/token | transformers prefill tok/s | "
        "transformers decode ms/token |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in records:
        for e in r["results"]:
            p, h = e["pagoda"], e.get("hf")
            lines.append(
                f"| {name} | {e['prompt_len']} | {_f(p['ttft_ms'])} | {_f(p['prefill_tokens_per_s'])} | "
                f"{_f(p['decode_ms_per_token'], 2)} | {_f(h['prefill_tokens_per_s']) if h else '-'} | "
                f"{_f(h['decode_ms_per_token'], 2) if h else '-'} |"
            )
    return "\n".join(lines)


def render(paths: list[Path]) -> str:
    groups: dict[str, list[tuple[str, dict[str, Any]]]] = {"throughput": [], "serve": [], "latency": []}
    for path in paths:
        rec = json.loads(path.read_text())
        groups.setdefault(rec.get("benchmark", "?"), []).append((path.stem, rec))
    out = []
    for kind, render_rows in (("throughput", throughput_rows), ("serve", serve_rows), ("latency", latency_rows)):
        if groups[kind]:
            out.append(render_rows(groups[kind]))
            out.append("")
    cmds = [f"- {name}: `{command_line(rec)}`" for recs in groups.values() for name, rec in recs]
    machines = {json.dumps({k: rec.get("env", {}).get(k) for k in ("cpu", "cpu_count", "gpu", "torch", "torch_threads")}) for recs in groups.values() for _, rec in recs}
    out.append("Commands:\n\n" + "\n".join(cmds))
    out.append("")
    out.append("Measured on: " + "; ".join(sorted(machines)))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    print(render(ap.parse_args(argv).files))


if __name__ == "__main__":
    main()
