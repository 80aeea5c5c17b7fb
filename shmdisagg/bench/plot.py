"""PNG plots of one or more bench runs (their summary JSON with a `timeline`), for comparing
routers or runs at a glance:

- `ttft_cdf.png`, `e2e_cdf.png`: the distribution of TTFT and E2E latency, one line per run;
- `throughput.png`: completed requests/s and output tokens/s over time, one line per run;
- `hit_rate.png`: KV-cache hit rate (cached / prompt tokens of the requests finishing in each
  time bin) over time, one line per run;
- `server_load.png`: active requests per server over time, one panel per run (when the run
  sampled a shmdisagg `/metrics`).

matplotlib is imported here only (with the Agg backend, no display needed).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from shmdisagg.bench import BenchError


def load_runs(paths: Sequence[str]) -> list[tuple[str, dict[str, Any]]]:
    """(label, summary) for each summary JSON path; label: the run's `label`, else the file stem."""
    runs = []
    for p in paths:
        try:
            summary = orjson.loads(Path(p).read_bytes())
        except (OSError, orjson.JSONDecodeError) as err:
            raise BenchError(f"cannot read run {p}: {err}") from None
        if not isinstance(summary, dict) or not isinstance(summary.get("timeline"), dict):
            raise BenchError(f"{p} has no timeline (written by an older shmdisagg bench): run the bench again with "
                             f"--json FILE, which now records one in every summary (--plot DIR adds the per-server load)")
        runs.append((str(summary.get("label") or Path(p).stem), summary))
    return runs


def _cdf(values: list[float]) -> tuple[list[float], list[float]]:
    xs = sorted(values)
    n = len(xs)
    return xs, [(i + 1) / n for i in range(n)]


def _bin_width(duration: float) -> float:
    """About 60 bins over the run, at least 1 s."""
    return max(1.0, math.ceil(duration / 60.0))


def _binned(ends: list[float], weights: list[float], width: float) -> tuple[list[float], list[float]]:
    if not ends:
        return [], []
    nbins = int(max(ends) // width) + 1
    sums = [0.0] * nbins
    for t, w in zip(ends, weights):
        sums[int(t // width)] += w
    return [(i + 0.5) * width for i in range(nbins)], [s / width for s in sums]


def plot_runs(runs: list[tuple[str, dict[str, Any]]], out_dir: str | Path) -> list[Path]:
    """Write the PNGs for `runs` into `out_dir` (created); returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def save(fig: Any, name: str) -> None:
        path = out / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    for key, title, name in (("ttft_ms", "Time to first token", "ttft_cdf.png"), ("e2e_ms", "End-to-end latency", "e2e_cdf.png")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, summary in runs:
            values = [v for v in summary["timeline"]["requests"][key] if v is not None]
            if values:
                xs, ys = _cdf(values)
                ax.plot(xs, ys, label=f"{label} (p50 {xs[len(xs) // 2]:.0f} ms, n={len(xs)})", drawstyle="steps-post")
        ax.set_xlabel(f"{title} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{title}: CDF")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        save(fig, name)

    fig, (ax_r, ax_t) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    fig_h, ax_h = plt.subplots(figsize=(8, 3.8))
    for label, summary in runs:
        req = summary["timeline"]["requests"]
        done = [(e, o or 0, p or 0, c) for e, ok, o, p, c in zip(req["end_s"], req["ok"], req["output_tokens"], req["prompt_tokens"], req["cached_tokens"]) if ok and e is not None]
        if not done:
            continue
        ends = [d[0] for d in done]
        width = _bin_width(max(ends))
        xs, rps = _binned(ends, [1.0] * len(done), width)
        ax_r.plot(xs, rps, label=label)
        xs, tps = _binned(ends, [float(d[1]) for d in done], width)
        ax_t.plot(xs, tps, label=label)
        reported = [d for d in done if d[3] is not None]
        if reported:
            ends_h = [d[0] for d in reported]
            xs, cached = _binned(ends_h, [float(d[3]) for d in reported], width)
            _, prompt = _binned(ends_h, [float(d[2]) for d in reported], width)
            points = [(x, 100.0 * c / p) for x, c, p in zip(xs, cached, prompt) if p > 0]
            ax_h.plot([x for x, _ in points], [y for _, y in points], label=label, marker=".")
    ax_r.set_ylabel("completed requests/s")
    ax_t.set_ylabel("output tokens/s")
    ax_t.set_xlabel("time since start (s)")
    ax_r.set_title("Throughput over time")
    for ax in (ax_r, ax_t):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save(fig, "throughput.png")
    ax_h.set_ylabel("KV cache hit rate (%)")
    ax_h.set_xlabel("time since start (s)")
    ax_h.set_ylim(0, 100)
    ax_h.set_title("KV cache hit rate over time (cached / prompt tokens, by completion time)")
    ax_h.grid(alpha=0.3)
    ax_h.legend(fontsize=8)
    save(fig_h, "hit_rate.png")

    loaded = [(label, s["timeline"]["server_load"]) for label, s in runs if s["timeline"].get("server_load")]
    if loaded:
        fig, axes = plt.subplots(len(loaded), 1, figsize=(8, 3.2 * len(loaded)), squeeze=False)
        for ax, (label, load) in zip(axes[:, 0], loaded):
            for server, series in load["servers"].items():
                role = series.get("role", "")
                ax.plot(load["t_s"], [v if v is not None else float("nan") for v in series["active_requests"]],
                        label=f"{server} ({'ctx' if role == 'context' else 'gen'})", linestyle="-" if role == "context" else "--")
            ax.set_title(f"{label}: active requests per server")
            ax.set_ylabel("active requests")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, ncol=2)
        axes[-1, 0].set_xlabel("time since start (s)")
        save(fig, "server_load.png")
    return written
