"""The `bench serve` figure: latency CDFs and throughput over time, drawn with matplotlib (Agg)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagoda.bench.serve_types import RequestResult, ServeConfig


def _cdf(ax: Any, values: list[float], label: str) -> None:
    xs = sorted(values)
    if not xs:
        return
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=f"{label} (p50 {xs[(len(xs) - 1) // 2]:.3g})")


def check_plotting_available() -> None:
    """ValueError (one line for the command) when matplotlib, the `pagoda[bench]` extra, is missing."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib, which is not installed: pip install 'pagoda[bench]' "
                         "(or pip install matplotlib)")


def plot_serve(
    results: list["RequestResult"], metrics: dict[str, Any], timeline: dict[str, Any], cfg: "ServeConfig", model: str, path: str
) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and in tests
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.success]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    (a_ttft, a_tok), (a_e2e, a_time) = axes

    _cdf(a_ttft, [r.ttft * 1e3 for r in ok if r.ttft is not None], "TTFT")
    if cfg.slo_ttft_ms is not None:
        a_ttft.axvline(cfg.slo_ttft_ms, color="red", linestyle="--", label=f"SLO {cfg.slo_ttft_ms:g} ms")
    a_ttft.set(title="time to first token", xlabel="ms", ylabel="fraction of requests")

    _cdf(a_tok, [x * 1e3 for r in ok for x in r.itls], "ITL")
    _cdf(a_tok, [r.tpot * 1e3 for r in ok if r.tpot is not None], "TPOT")
    if cfg.slo_tpot_ms is not None:
        a_tok.axvline(cfg.slo_tpot_ms, color="red", linestyle="--", label=f"TPOT SLO {cfg.slo_tpot_ms:g} ms")
    a_tok.set(title="inter-token latency and time per output token", xlabel="ms", ylabel="fraction")

    _cdf(a_e2e, [r.e2e for r in ok], "E2E")
    a_e2e.set(title="end-to-end latency", xlabel="s", ylabel="fraction of requests")

    a_time.plot(timeline["t_s"], timeline["output_tokens_per_s"], color="tab:blue", label="output tokens/s")
    a_time.set(title="throughput over time", xlabel="s since start", ylabel="output tokens/s")
    twin = a_time.twinx()
    twin.step(timeline["t_s"], timeline["in_flight"], where="mid", color="tab:orange", label="requests in flight")
    twin.set_ylabel("requests in flight")
    lines = a_time.get_legend_handles_labels()
    lines2 = twin.get_legend_handles_labels()
    a_time.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper right", fontsize="small")

    for ax in (a_ttft, a_tok, a_e2e):
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize="small")
        ax.set_ylim(0, 1.02)
    a_time.grid(alpha=0.3)

    rate = "inf" if math.isinf(cfg.request_rate) else f"{cfg.request_rate:g}"
    fig.suptitle(
        f"{model} @ {cfg.base_url}: {cfg.num_prompts} requests, rate {rate}/s, "
        f"prompts {cfg.input_len_min}-{cfg.input_len_max}, {cfg.output_len} output tokens\n"
        f"{metrics['output_token_throughput']:.1f} output tok/s, {metrics['request_throughput']:.2f} req/s, "
        f"{metrics['failed']} failed"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
