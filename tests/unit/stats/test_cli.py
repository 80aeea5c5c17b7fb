"""`shmdisagg stats` options and exit codes."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from shmdisagg.cli import main
from shmdisagg.metrics.rows import MetricsSegment
from shmdisagg.shm.table import ControlTable, process_starttime


def test_no_deployment_exits_1(shm_prefix: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats", "--prefix", shm_prefix, "--once", "--json"]) == 1
    assert "no running deployment" in capsys.readouterr().err


def test_json_needs_once(shm_prefix: str) -> None:
    assert main(["stats", "--prefix", shm_prefix, "--json"]) == 2


@pytest.mark.parametrize("interval", ["0", "-1", "nan", "inf", "abc", "1e9", "3600.5", "1e-9", "0.049"])
def test_an_interval_that_never_refreshes_is_a_one_line_usage_error(
    interval: str, shm_prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["stats", "--prefix", shm_prefix, "--once", "--interval", interval])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --interval:" in err and repr(interval) in err and "Traceback" not in err


def test_the_longest_interval_is_an_hour_and_the_help_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    """--interval 1e9 was taken: a view that would never refresh."""
    from shmdisagg.cli import build_parser

    assert build_parser().parse_args(["stats", "--interval", "3600"]).interval == 3600
    with pytest.raises(SystemExit):
        main(["stats", "--interval", "1e9"])
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "shmdisagg stats: error: argument --interval: must be a number of seconds from 0.05 to 3600, not '1e9'"
    )
    with pytest.raises(SystemExit):
        main(["stats", "--help"])
    assert "0.05 to 3600" in " ".join(capsys.readouterr().out.split())


def test_once_json_prints_one_snapshot(shm_prefix: str, capsys: pytest.CaptureFixture[str]) -> None:
    coord = ControlTable.create(shm_prefix, max_workers=2)
    seg = MetricsSegment.create(shm_prefix, 1)
    try:
        coord.set_coordinator(os.getpid(), process_starttime(os.getpid()), 1)
        assert main(["stats", "--prefix", shm_prefix, "--once", "--json", "--interval", "0.05"]) == 0
    finally:
        seg.close()
        coord.unlink()
        coord.close()
    snap = orjson.loads(capsys.readouterr().out)
    assert snap["schema"] == "shmdisagg.stats/1" and snap["prefix"] == shm_prefix and snap["interval_s"] > 0


def test_a_port_names_the_default_prefix() -> None:
    from shmdisagg.cli import build_parser
    from shmdisagg.stats.cli import resolve_prefix

    args = build_parser().parse_args(["stats", "--port", "9123"])
    assert resolve_prefix(args, None) == f"shmdisagg-{os.getuid()}-9123"


def _watch_until(shm_prefix: str, end: Callable[[ControlTable, Callable[[bytes], None]], None]) -> tuple[int, str]:
    """Run the live view (piped) on a table this test owns until `end(table, wait_for)` ends the
    deployment (`wait_for(text)` returns once the view printed a line holding `text`); (exit
    status, stderr)."""
    import select
    import subprocess
    import sys

    coord = ControlTable.create(shm_prefix, max_workers=2)
    seg = MetricsSegment.create(shm_prefix, 1)
    coord.set_coordinator(os.getpid(), process_starttime(os.getpid()), 1)
    proc = subprocess.Popen(
        [sys.executable, "-m", "shmdisagg.cli", "stats", "--prefix", shm_prefix, "--interval", "0.05"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "COLUMNS": "120"},
    )

    def wait_for(text: bytes) -> None:
        assert proc.stdout is not None
        deadline = time.monotonic() + 30  # never hang the suite
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            assert ready, f"the view printed no line with {text!r}"
            if text in proc.stdout.readline():
                return

    try:
        wait_for(b"shmdisagg stats")  # a frame, printed (not a terminal)
    finally:
        seg.close()
        end(coord, wait_for)
        coord.close()
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
    return proc.returncode, err.decode()


def test_the_live_view_runs_until_the_deployment_stops_and_says_why(shm_prefix: str) -> None:
    def stop(coord: ControlTable, wait_for: Callable[[bytes], None]) -> None:
        coord.set_coord_state(2)  # what a stopping coordinator does: say so, stop the fleet, unlink
        wait_for(b"stopping")
        coord.unlink()

    rc, err = _watch_until(shm_prefix, stop)
    assert rc == 0 and err.count("\n") == 1
    assert f"the deployment {shm_prefix} stopped: its coordinator (pid {os.getpid()}) was asked to stop" in err
    assert "removed its shared memory" in err


def test_the_live_view_says_when_the_segments_vanish_without_a_stop(shm_prefix: str) -> None:
    rc, err = _watch_until(shm_prefix, lambda coord, _: coord.unlink())  # removed by hand, coordinator running
    assert rc == 0 and f"its shared memory was removed; its coordinator (pid {os.getpid()}) still runs" in err


def test_the_live_view_says_when_a_new_deployment_replaced_the_watched_one(shm_prefix: str) -> None:
    newer: list[ControlTable] = []

    def replace(coord: ControlTable, _: Callable[[bytes], None]) -> None:
        coord.unlink()
        newer.append(ControlTable.create(shm_prefix, max_workers=2))  # a new launch under the same prefix

    try:
        rc, err = _watch_until(shm_prefix, replace)
    finally:
        for table in newer:
            table.unlink()
            table.close()
    assert rc == 0 and "stopped and a new one now runs under this prefix" in err


@pytest.mark.parametrize("prefix", ["../etc", "a" * 300, "x/y", ""])
def test_an_invalid_prefix_is_a_one_line_usage_error(prefix: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats", "--prefix", prefix, "--once"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "invalid shared-memory prefix" in err and prefix[:40] in err
    assert "Traceback" not in err


def _serving_table(prefix: str) -> tuple[ControlTable, MetricsSegment]:
    from shmdisagg.shm.table import ROLE_CONTEXT, ROLE_GENERATION

    coord = ControlTable.create(prefix, max_workers=2)
    seg = MetricsSegment.create(prefix, 1)
    coord.set_coordinator(os.getpid(), process_starttime(os.getpid()), 1)
    coord.publish_server(0, "127.0.0.1:18101", ROLE_CONTEXT, True)
    coord.publish_server(1, "127.0.0.1:18201", ROLE_GENERATION, True)
    return coord, seg


def test_a_piped_snapshot_is_not_cut_to_80_columns(shm_prefix: str) -> None:
    import subprocess
    import sys

    coord, seg = _serving_table(shm_prefix)
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "FORCE_COLOR", "TTY_COMPATIBLE")}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "shmdisagg.cli", "stats", "--prefix", shm_prefix, "--once", "--interval", "0.05"],
            capture_output=True,
            env=env,
            timeout=60,
        )
    finally:
        seg.close()
        coord.unlink()
        coord.close()
    out = proc.stdout.decode()
    assert proc.returncode == 0, proc.stderr
    assert "127.0.0.1:18101" in out and "127.0.0.1:18201" in out and "KV blocks" in out
    assert "…" not in out
    assert max(len(line) for line in out.splitlines()) > 80  # the table is wider than rich's default


def test_a_piped_snapshot_respects_columns(
    shm_prefix: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", "70")
    for var in ("FORCE_COLOR", "TTY_COMPATIBLE"):
        monkeypatch.delenv(var, raising=False)
    coord, seg = _serving_table(shm_prefix)
    try:
        assert main(["stats", "--prefix", shm_prefix, "--once", "--interval", "0.05"]) == 0
    finally:
        seg.close()
        coord.unlink()
        coord.close()
    out = capsys.readouterr().out
    assert "shmdisagg stats" in out and max(len(line) for line in out.splitlines()) <= 70


def _dead_pid() -> tuple[int, int]:
    """The pid and start time of a process that has exited (and been reaped)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    pid, starttime = proc.pid, process_starttime(proc.pid)
    proc.communicate()
    return pid, starttime


@pytest.mark.parametrize("as_json", [True, False])
def test_once_on_the_segments_of_a_killed_deployment_says_stale_and_exits_1(
    shm_prefix: str, as_json: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    coord, seg = _serving_table(shm_prefix)  # servers published healthy, as a kill -9 leaves them
    try:
        coord.set_coord_state(1)  # "running"
        pid, starttime = _dead_pid()
        coord.set_coordinator(pid, starttime, 7)
        rc = main(["stats", "--prefix", shm_prefix, "--once", "--interval", "0.05", *(["--json"] if as_json else [])])
    finally:
        seg.close()
        coord.unlink()
        coord.close()
    out, err = capsys.readouterr()
    reason = (
        f"coordinator pid {pid} is gone: stale segments; the next `shmdisagg launch` or `shmdisagg serve` "
        "of this deployment removes them"
    )
    assert rc == 1 and reason in err
    if as_json:
        snap = orjson.loads(out)
        assert snap["state"] == "stale" and snap["coordinator"]["state"] == "stale" and snap["stale_reason"] == reason
    else:
        assert "STALE" in out and f"coordinator pid {pid} is gone" in out and "running" not in out


def test_the_live_view_of_a_killed_deployment_says_stale_and_exits_1(shm_prefix: str) -> None:
    import subprocess
    import sys

    coord, seg = _serving_table(shm_prefix)
    pid, starttime = _dead_pid()
    coord.set_coordinator(pid, starttime, 7)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "shmdisagg.cli", "stats", "--prefix", shm_prefix, "--interval", "0.05"],
            capture_output=True,
            timeout=60,
            env={**os.environ, "COLUMNS": "120"},
        )
    finally:
        seg.close()
        coord.unlink()
        coord.close()
    assert proc.returncode == 1 and b"STALE" in proc.stdout
    assert f"coordinator pid {pid} is gone".encode() in proc.stderr


def test_the_prefix_error_states_the_configs_rule(capsys: pytest.CaptureFixture[str]) -> None:
    from shmdisagg.config import ConfigError, parse_config

    too_long = "p" * 25
    assert main(["stats", "--prefix", too_long, "--once"]) == 2
    assert "use 1-24 letters" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="shm.prefix"):  # what the config refuses too
        parse_config(
            {
                "port": 8000,
                "context_servers": {"urls": ["127.0.0.1:1"]},
                "generation_servers": {"urls": ["127.0.0.1:2"]},
                "shmdisagg": {"shm": {"prefix": too_long}},
            },
            "cfg.yaml",
        )
    # the default prefix of a config without one (a large uid makes it longer) is still accepted
    assert main(["stats", "--prefix", "shmdisagg-4294967294-65535", "--once"]) == 1
    assert "no running deployment" in capsys.readouterr().err


@pytest.mark.parametrize("port", ["0", "99999", "x"])
def test_a_port_no_deployment_can_have_is_a_usage_error(port: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--port 0 looked for port 8000's deployment; 99999 said no deployment runs there (exit 1)."""
    with pytest.raises(SystemExit) as exit_:
        main(["stats", "--port", port, "--once"])
    assert exit_.value.code == 2
    assert "argument --port:" in capsys.readouterr().err


def test_a_config_of_port_0_asks_for_the_bound_port(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Its deployment's segments are named after the port the kernel picked: the config's prefix
    (shmdisagg-<uid>-0) names nothing, and stats said no deployment ran."""
    path = tmp_path / "p0.yaml"
    path.write_text(
        "hostname: 127.0.0.1\nport: 0\ncontext_servers: {urls: ['127.0.0.1:18201']}\n"
        "generation_servers: {urls: ['127.0.0.1:18202']}\n"
    )
    assert main(["stats", "-c", str(path), "--once"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == (
        f"shmdisagg stats: {path} has port: 0, and its deployment's shared memory is named after the port it "
        "bound: give that port (--port, from the --report_addr file) or set shmdisagg.shm.prefix"
    )
