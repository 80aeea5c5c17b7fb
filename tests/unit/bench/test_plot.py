"""`--plot`: the recorded timeline, the PNGs, comparing runs and `--plot-only`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from shmdisagg.bench import BenchError
from shmdisagg.bench.cli import run_cli
from shmdisagg.bench.client import RequestRecord
from shmdisagg.bench.plot import draw, load_runs, plot_runs
from shmdisagg.bench.timeline import parse_server_load, timeline
from tests.unit.bench.test_cli import bench, parse

PNGS = {"ttft_cdf.png", "e2e_cdf.png", "throughput.png", "hit_rate.png", "server_load.png"}


def records(n: int, ttft: float) -> list[RequestRecord]:
    out = []
    for i in range(n):
        r = RequestRecord(index=i, input_length=100, max_tokens=10, send=10.0 + i * 0.5)
        r.first_token = r.send + ttft
        r.end = r.send + ttft + 0.2
        r.chunk_times = [r.first_token, r.end]
        r.status, r.prompt_tokens, r.output_tokens, r.cached_tokens = 200, 100, 10, 25 * (i % 3)
        out.append(r)
    return out


class FakeSampler:
    times = [10.0, 11.0, 12.0]
    roles = {"127.0.0.1:1": "context", "127.0.0.1:2": "generation"}
    loads: dict[str, list[float | None]] = {"127.0.0.1:1": [0.0, 3.0, 1.0], "127.0.0.1:2": [None, 2.0, 2.0]}


def summary(label: str, ttft: float, sampler: Any = None) -> dict[str, Any]:
    return {"label": label, "timeline": timeline(records(40, ttft), 10.0, sampler)}


def test_timeline_is_relative_to_the_origin_in_send_order() -> None:
    t = timeline(records(3, 0.1), 10.0, FakeSampler())
    req = t["requests"]
    assert req["send_s"] == [0.0, 0.5, 1.0] and req["ttft_ms"][0] == pytest.approx(100.0)
    assert req["e2e_ms"][0] == pytest.approx(300.0) and req["cached_tokens"] == [0, 25, 50]
    assert t["server_load"]["t_s"] == [0.0, 1.0, 2.0]
    assert t["server_load"]["servers"]["127.0.0.1:1"] == {"role": "context", "active_requests": [0.0, 3.0, 1.0]}


def test_two_runs_are_drawn_into_every_plot(tmp_path: Path) -> None:
    plots = plot_runs([("a", summary("a", 0.1, FakeSampler())), ("b", summary("b", 0.3))], tmp_path / "plots")
    files = plots.files
    assert {f.name for f in files} == PNGS
    assert all(f.stat().st_size > 1000 for f in files)
    import matplotlib.image

    # the legend right of the axes is in the image: wider than the 7-inch figure at 110 dpi
    assert matplotlib.image.imread(tmp_path / "plots" / "ttft_cdf.png").shape[1] > 7 * 110


def test_a_run_without_a_timeline_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "old.json"
    p.write_bytes(orjson.dumps({"schema": "shmdisagg.bench/1"}))
    with pytest.raises(BenchError, match="no timeline") as err:
        load_runs([str(p)])
    assert "--json FILE" in str(err.value)  # how to record a comparable run (demo.sh's runs/demo.json is one)


def test_plot_only_draws_saved_runs_without_sending_load(tmp_path: Path) -> None:
    paths = []
    for name, ttft in (("rr", 0.1), ("lb", 0.2)):
        p = tmp_path / f"{name}.json"
        p.write_bytes(orjson.dumps(summary(name, ttft)))
        paths.append(str(p))
    out = tmp_path / "cmp"
    assert run_cli(parse(["--url", "http://127.0.0.1:9", "--plot-only", "--plot", str(out), "--compare", *paths])) == 0
    assert {f.name for f in out.iterdir()} == PNGS - {"server_load.png"}
    assert run_cli(parse(["--plot-only", "--plot", str(out)])) == 2


def test_a_run_with_plot_records_its_timeline_and_draws(tmp_path: Path) -> None:
    out = tmp_path / "plots"
    result, _ = bench(
        [
            "--input-len",
            "64",
            "--output-len",
            "4",
            "--concurrency",
            "2",
            "--num-requests",
            "6",
            "--plot",
            str(out),
            "--json",
            str(tmp_path / "run.json"),
        ]
    )
    assert result["label"] == "run" and len(result["timeline"]["requests"]["ttft_ms"]) == 6
    assert result["timeline"]["server_load"] is None  # the fake server has no shmdisagg /metrics
    assert (out / "ttft_cdf.png").exists() and load_runs([str(tmp_path / "run.json")])[0][0] == "run"


def test_server_load_is_parsed_from_an_exposition() -> None:
    text = (
        "# HELP shmdisagg_server_active_requests x\n"
        'shmdisagg_server_active_requests{role="context",server="127.0.0.1:8101"} 3.0\n'
        'shmdisagg_server_active_tokens{role="context",server="127.0.0.1:8101"} 300.0\n'
    )
    assert parse_server_load(text) == {"127.0.0.1:8101": ("context", 3.0)}


def _hit_rates(cached: list[int]) -> dict[str, Any]:
    """A run whose i-th request (one per second) found `cached[i]` of its 100 prompt tokens cached."""
    recs = records(len(cached), 0.1)
    for r, c in zip(recs, cached, strict=True):
        r.end = r.send + 1.0
        r.cached_tokens = c
    return {"label": "hits", "timeline": timeline(recs, 10.0, None)}


def test_hit_rate_markers_at_100_and_0_percent_are_drawn_whole() -> None:
    import matplotlib.pyplot as plt

    figures, _ = draw([("hits", _hit_rates([100, 100, 0, 0, 50, 100]))])
    try:
        ax = figures["hit_rate.png"].axes[0]
        (line,) = ax.get_lines()
        assert max(line.get_ydata()) == 100.0 and min(line.get_ydata()) == 0.0 and ax.get_ylim() == (0.0, 100.0)
        assert line.get_marker() == "." and line.get_clip_on() is False  # before: clipped to the axes, half a marker
    finally:
        for fig in figures.values():
            plt.close(fig)


def test_every_legend_is_off_the_data() -> None:
    import matplotlib.pyplot as plt

    runs = [("a", summary("a", 0.1, FakeSampler())), ("b", summary("b", 0.3, FakeSampler()))]
    figures, _ = draw(runs)
    try:
        legends = 0
        for name, fig in figures.items():
            fig.tight_layout()
            fig.canvas.draw()
            for ax in fig.axes:
                legend = ax.get_legend()
                assert legend is not None, name
                legends += 1
                box, plot_area = legend.get_window_extent(), ax.get_window_extent()
                # right of the axes' data area, not over it (before: loc "best", inside the axes)
                assert box.x0 >= plot_area.x1 and not box.overlaps(plot_area), name
        assert legends == 7  # 2 CDFs, 2 throughput panels, hit rate, 2 server-load panels
    finally:
        for fig in figures.values():
            plt.close(fig)


def test_compare_says_which_runs_it_could_not_draw_and_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    failed = summary("failed", 0.1)
    req = failed["timeline"]["requests"]
    req["ok"] = [False] * len(req["ok"])
    req["ttft_ms"] = [None] * len(req["ttft_ms"])
    req["e2e_ms"] = [None] * len(req["e2e_ms"])
    unreported = summary("no-cache-info", 0.2)
    unreported["timeline"]["requests"]["cached_tokens"] = [None] * len(req["ok"])
    paths = []
    for s in (summary("good", 0.1, FakeSampler()), failed, unreported):
        p = tmp_path / f"{s['label']}.json"
        p.write_bytes(orjson.dumps(s))
        paths.append(str(p))
    assert run_cli(parse(["--plot-only", "--plot", str(tmp_path / "cmp"), "--compare", *paths])) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("plots: run ")]
    assert lines == [
        "plots: run 'failed' is not in ttft_cdf.png, e2e_cdf.png, throughput.png, hit_rate.png: no request completed",
        "plots: run 'no-cache-info' is not in hit_rate.png: its server reported no cached_tokens",
        "plots: run 'failed' is not in server_load.png: no per-server load recorded (a run without --plot, or a server "
        "without shmdisagg's /metrics)",
        "plots: run 'no-cache-info' is not in server_load.png: no per-server load recorded (a run without --plot, or a "
        "server without shmdisagg's /metrics)",
    ]


def test_runs_of_the_same_name_are_told_apart() -> None:
    import matplotlib.pyplot as plt

    figures, _ = draw([("demo", summary("demo", 0.1)), ("demo", summary("demo", 0.2))])
    try:
        labels = [t.get_text() for t in figures["throughput.png"].axes[0].get_legend().get_texts()]
        assert labels == ["demo", "demo #2"]
    finally:
        for fig in figures.values():
            plt.close(fig)
