"""Helpers shared by the benchmarks: percentiles, the environment record, JSON and table output."""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence


class BenchError(RuntimeError):
    """A benchmark could not produce trustworthy numbers (wrong token counts, failed requests...)."""


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation, numpy's default; NaN when empty."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """mean, p50, p90, p99 (and min/max) of `values`, each multiplied by `scale` (1e3: s -> ms)."""
    if not values:
        nan = float("nan")
        return {"mean": nan, "p50": nan, "p90": nan, "p99": nan, "min": nan, "max": nan, "count": 0}
    return {
        "mean": statistics.fmean(values) * scale,
        "p50": percentile(values, 50) * scale,
        "p90": percentile(values, 90) * scale,
        "p99": percentile(values, 99) * scale,
        "min": min(values) * scale,
        "max": max(values) * scale,
        "count": len(values),
    }


def median_index(values: Sequence[float]) -> int:
    """Index of the median element (the lower median for an even count), so that all numbers of
    the reported run come from one and the same run."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    return order[(len(values) - 1) // 2]


def peak_rss_mib() -> float:
    """This process's peak resident set size so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _cpu_model() -> str | None:
    """The CPU's model name, with its x86 family and model numbers: a virtual machine's name can
    be as bare as "AMD EPYC", which two CPU generations of very different speed share."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() in ("model name", "cpu family", "model") and key.strip() not in fields:
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or None
    if name and "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name


def environment() -> dict[str, Any]:
    """What the numbers were measured on: a result without its machine is not a result."""
    env: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
    }
    try:
        import torch

        env["torch"] = torch.__version__
        env["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    try:
        from importlib.metadata import version

        env["pagoda"] = version("pagoda")
    except Exception:
        pass
    return env


def invocation(command: str) -> list[str] | None:
    """The command line as typed (after `pagoda`), when this process is `pagoda bench <command>`;
    None when called in-process (tests), where sys.argv is someone else's."""
    argv = sys.argv[1:]
    return argv if argv[:2] == ["bench", command] else None


def check_output_path(path: str | os.PathLike | None, flag: str) -> None:
    """Refuse, before a run, an output file that could not be written after it (ValueError)."""
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{flag} {path}: is a folder, give a file name")
    parent = p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent  # write_json creates missing folders: check the first one that exists
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise ValueError(f"{flag} {path}: cannot write there")


def write_json(path: str | os.PathLike, record: dict[str, Any]) -> None:
    p = Path(path)
    if p.parent and not p.parent.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
    # NaN and infinity are not JSON: write null and "inf" so that any JSON reader takes the file.
    p.write_text(json.dumps(_strict(record), indent=2, allow_nan=False) + "\n")


def _strict(x: Any) -> Any:
    if isinstance(x, float):
        if x != x:
            return None
        if x in (float("inf"), float("-inf")):
            return "inf" if x > 0 else "-inf"
    if isinstance(x, dict):
        return {k: _strict(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_strict(v) for v in x]
    return x


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned text table; floats get a precision that suits their size."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            if v != v:
                return "-"
            if abs(v) >= 100:
                return f"{v:,.1f}"
            if abs(v) >= 1:
                return f"{v:.2f}"
            return f"{v:.3f}"
        return str(v)

    table = [list(map(str, header))] + [[cell(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = []
    for j, r in enumerate(table):
        first = r[0].ljust(widths[0])
        rest = [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        lines.append("  ".join([first] + rest))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def parse_int_list(text: str) -> list[int]:
    """'16,32,64' -> [16, 32, 64]; every entry a positive integer."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"expected positive integers, got {text!r}")
    return values
