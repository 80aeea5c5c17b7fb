"""`--plot`: the recorded timeline, the PNGs, comparing runs and `--plot-only`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from shmdisagg.bench import BenchError
from shmdisagg.bench.cli import run_cli
from shmdisagg.bench.client import RequestRecord
from shmdisagg.bench.plot import load_runs, plot_runs
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
    files = plot_runs([("a", summary("a", 0.1, FakeSampler())), ("b", summary("b", 0.3))], tmp_path / "plots")
    assert {f.name for f in files} == PNGS
    assert all(f.stat().st_size > 1000 for f in files)


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
    result, _ = bench(["--input-len", "64", "--output-len", "4", "--concurrency", "2", "--num-requests", "6",
                       "--plot", str(out), "--json", str(tmp_path / "run.json")])
    assert result["label"] == "run" and len(result["timeline"]["requests"]["ttft_ms"]) == 6
    assert result["timeline"]["server_load"] is None  # the fake server has no shmdisagg /metrics
    assert (out / "ttft_cdf.png").exists() and load_runs([str(tmp_path / "run.json")])[0][0] == "run"


def test_server_load_is_parsed_from_an_exposition() -> None:
    text = ('# HELP shmdisagg_server_active_requests x\n'
            'shmdisagg_server_active_requests{role="context",server="127.0.0.1:8101"} 3.0\n'
            'shmdisagg_server_active_tokens{role="context",server="127.0.0.1:8101"} 300.0\n')
    assert parse_server_load(text) == {"127.0.0.1:8101": ("context", 3.0)}
