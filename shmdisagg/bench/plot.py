"""PNG plots of one or more bench runs (their summary JSON with a `timeline`), for comparing
routers or runs at a glance:

- `ttft_cdf.png`, `e2e_cdf.png`: the distribution of TTFT and E2E latency, one line per run;
- `throughput.png`: completed requests/s and output tokens/s over time, one line per run;
- `hit_rate.png`: KV-cache hit rate (cached / prompt tokens of the requests finishing in each
  time bin) over time, one line per run;
- `server_load.png`: active requests per server over time, one panel per run (when the run
  sampled a shmdisagg `/metrics`).

Every legend sits right of its axes, off the data. A run that cannot be drawn in a plot (no
completed request, no `cached_tokens` reported, no server load recorded) is named with the
reason in `Plots.not_drawn`, which the CLI prints.

matplotlib is imported here only (with the Agg backend, no display needed).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
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
            raise BenchError(
                f"{p} has no timeline (written by an older shmdisagg bench): run the bench again with "
                f"--json FILE, which now records one in every summary (--plot DIR adds the per-server load)"
            )
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
    for t, w in zip(ends, weights, strict=True):
        sums[int(t // width)] += w
    return [(i + 0.5) * width for i in range(nbins)], [s / width for s in sums]


@dataclass
class Plots:
    """What `plot_runs` wrote, and `not_drawn`: one line per run left out of some plots, naming
    the plots and why ("run 'b' is not in hit_rate.png: its server reported no cached_tokens")."""

    files: list[Path] = field(default_factory=list)
    not_drawn: list[str] = field(default_factory=list)


def plot_runs(runs: list[tuple[str, dict[str, Any]]], out_dir: str | Path) -> Plots:
    """Write the PNGs for `runs` into `out_dir` (created); returns the files and the runs left out."""
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    figures, not_drawn = draw(runs)
    plots = Plots(not_drawn=not_drawn)
    for name, fig in figures.items():
        path = out / name
        fig.tight_layout()
        legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
        # the legends sit right of the axes, outside tight_layout: the saved image takes them in
        fig.savefig(path, dpi=110, bbox_inches="tight", bbox_extra_artists=legends)
        plt.close(fig)
        plots.files.append(path)
    return plots


def draw(runs: list[tuple[str, dict[str, Any]]]) -> tuple[dict[str, Any], list[str]]:
    """The figures by file name (matplotlib `Figure`s, not saved: the caller closes them), and
    the `Plots.not_drawn` lines. Labels that repeat get their position appended ("demo #2")."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = _unique_labels(runs)
    figures: dict[str, Any] = {}
    missing: dict[tuple[str, str], list[str]] = {}  # (label, why) -> files it is not in

    def skip(label: str, name: str, why: str) -> None:
        missing.setdefault((label, why), []).append(name)

    for key, title, name in (
        ("ttft_ms", "Time to first token", "ttft_cdf.png"),
        ("e2e_ms", "End-to-end latency", "e2e_cdf.png"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, summary in runs:
            values = [v for v in summary["timeline"]["requests"][key] if v is not None]
            if not values:
                skip(label, name, "no request completed")
                continue
            xs, ys = _cdf(values)
            ax.plot(xs, ys, label=f"{label} (p50 {xs[len(xs) // 2]:.0f} ms, n={len(xs)})", drawstyle="steps-post")
        ax.set_xlabel(f"{title} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{title}: CDF")
        ax.grid(alpha=0.3)
        _legend_outside(ax, fontsize=8)
        figures[name] = fig

    fig, (ax_r, ax_t) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    fig_h, ax_h = plt.subplots(figsize=(8, 3.8))
    for label, summary in runs:
        req = summary["timeline"]["requests"]
        # columns of a summary file read back (maybe edited or older): plot the rows they share, not raise
        done = [
            (e, o or 0, p or 0, c)
            for e, ok, o, p, c in zip(
                req["end_s"], req["ok"], req["output_tokens"], req["prompt_tokens"], req["cached_tokens"], strict=False
            )
            if ok and e is not None
        ]
        if not done:
            skip(label, "throughput.png", "no request completed")
            skip(label, "hit_rate.png", "no request completed")
            continue
        ends = [d[0] for d in done]
        width = _bin_width(max(ends))
        xs, rps = _binned(ends, [1.0] * len(done), width)
        ax_r.plot(xs, rps, label=label)
        xs, tps = _binned(ends, [float(d[1]) for d in done], width)
        ax_t.plot(xs, tps, label=label)
        reported = [d for d in done if d[3] is not None]
        if not reported:
            skip(label, "hit_rate.png", "its server reported no cached_tokens")
            continue
        ends_h = [d[0] for d in reported]
        xs, cached = _binned(ends_h, [float(d[3]) for d in reported], width)
        _, prompt = _binned(ends_h, [float(d[2]) for d in reported], width)
        points = [(x, 100.0 * c / p) for x, c, p in zip(xs, cached, prompt, strict=True) if p > 0]
        # unclipped: a marker at 0 % or 100 % is drawn whole over the axes' edge, not cut in half
        ax_h.plot([x for x, _ in points], [y for _, y in points], label=label, marker=".", clip_on=False)
    ax_r.set_ylabel("completed requests/s")
    ax_t.set_ylabel("output tokens/s")
    ax_t.set_xlabel("time since start (s)")
    ax_r.set_title("Throughput over time")
    for ax in (ax_r, ax_t):
        ax.grid(alpha=0.3)
        _legend_outside(ax, fontsize=8)
    figures["throughput.png"] = fig
    ax_h.set_ylabel("KV cache hit rate (%)")
    ax_h.set_xlabel("time since start (s)")
    ax_h.set_ylim(0, 100)
    ax_h.set_title("KV cache hit rate over time (cached / prompt tokens, by completion time)")
    ax_h.grid(alpha=0.3)
    _legend_outside(ax_h, fontsize=8)
    figures["hit_rate.png"] = fig_h

    loaded = []
    for label, s in runs:
        if s["timeline"].get("server_load"):
            loaded.append((label, s["timeline"]["server_load"]))
        else:
            skip(
                label,
                "server_load.png",
                "no per-server load recorded (a run without --plot, or a server without shmdisagg's /metrics)",
            )
    if loaded:
        fig, axes = plt.subplots(len(loaded), 1, figsize=(8, 3.2 * len(loaded)), squeeze=False)
        for ax, (label, load) in zip(axes[:, 0], loaded, strict=True):
            for server, series in load["servers"].items():
                role = series.get("role", "")
                ax.plot(
                    load["t_s"],
                    [v if v is not None else float("nan") for v in series["active_requests"]],
                    label=f"{server} ({'ctx' if role == 'context' else 'gen'})",
                    linestyle="-" if role == "context" else "--",
                )
            ax.set_title(f"{label}: active requests per server")
            ax.set_ylabel("active requests")
            ax.grid(alpha=0.3)
            _legend_outside(ax, fontsize=7)
        axes[-1, 0].set_xlabel("time since start (s)")
        figures["server_load.png"] = fig
    not_drawn = [f"run {label!r} is not in {', '.join(names)}: {why}" for (label, why), names in missing.items()]
    return figures, not_drawn


def _legend_outside(ax: Any, **kwargs: Any) -> None:
    """The legend right of the axes, off the data (none for axes without a labelled line)."""
    if ax.get_legend_handles_labels()[1]:
        legend = ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, **kwargs)
        # out of tight_layout, which would squeeze the axes to make room: the axes keep the figure's
        # size, and savefig(bbox_inches="tight") widens the image to take the legend in
        legend.set_in_layout(False)


def _unique_labels(runs: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    seen: dict[str, int] = {}
    out = []
    for label, summary in runs:
        seen[label] = seen.get(label, 0) + 1
        out.append((label if seen[label] == 1 else f"{label} #{seen[label]}", summary))
    return out
