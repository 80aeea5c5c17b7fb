"""`shmdisagg bench --launch`: a SIGTERM to the bench's process group (what `timeout` sends, like
a terminal's Ctrl-C reaching every process of the foreground group) stops the run as Ctrl-C does:
the summary is printed and written with the cancelled requests, exit 143, and only then is the
deployment stopped, leaving nothing behind. The deployment's own log lines stay out of the
bench's output, and --port moves the deployment without editing its config."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import orjson
import yaml

from shmdisagg.bench.timeline import parse_server_load
from tests.conftest import free_port
from tests.integration.harness import REPO, wait_until
from tests.integration.test_launch_cleanup import alive, descendants

MODEL = "sim-llama-3.1-8b"
OFFSET = 7  # the config's ports; --port moves them all back by this much


def _active_requests(port: int) -> float:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return 0.0
    return sum(load for _, load in parse_server_load(text).values())


def test_sigterm_to_the_process_group_reports_then_stops_the_deployment(tmp_path: Path, shm_prefix: str) -> None:
    port, ctx, gen = free_port(), free_port(), free_port()  # where the deployment will run
    logs = tmp_path / "logs"
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "hostname": "127.0.0.1",
                "port": port + OFFSET,
                "num_workers": 2,
                "context_servers": {
                    "num_instances": 1,
                    "urls": [f"127.0.0.1:{ctx + OFFSET}"],
                    "router": {"type": "load_balancing"},
                },
                "generation_servers": {
                    "num_instances": 1,
                    "urls": [f"127.0.0.1:{gen + OFFSET}"],
                    "router": {"type": "load_balancing"},
                },
                "shmdisagg": {
                    "shm": {"prefix": shm_prefix},
                    "coordinator_socket": str(tmp_path / "coord.sock"),
                    "health_check_interval_s": 0.2,
                    # slow decoding: the requests are still streaming when the signal comes
                    "executors": {
                        "backend": "sim",
                        "model": MODEL,
                        "log_dir": str(logs),
                        "sim": {"speedup": 1.0, "num_blocks": 4096},
                    },
                },
            }
        )
    )
    out = tmp_path / "run.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shmdisagg.cli",
            "bench",
            "--launch",
            "-c",
            str(cfg),
            "--port",
            str(port),
            "--concurrency",
            "2",
            "--input-len",
            "64",
            "--output-len",
            "4000",
            "--num-requests",
            "8",
            "--no-progress",
            "--json",
            str(out),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )  # its own process group, as under timeout(1)
    try:
        wait_until(
            lambda: proc.poll() is not None or _active_requests(port) >= 2, timeout_s=120, what="two requests in flight"
        )
        assert proc.poll() is None, proc.communicate()
        children = descendants(proc.pid)
        assert len(children) >= 5  # 2 executors, the coordinator, 2 fleet workers (and a standby)
        os.killpg(proc.pid, signal.SIGTERM)  # what `timeout` does: the whole group
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    err = stderr.decode()
    assert proc.returncode == 143, err

    # the summary, as after Ctrl-C
    assert b"shmdisagg bench (interrupted)" in stdout
    summary = orjson.loads(out.read_bytes())
    assert summary["was_cancelled"] is True
    req = summary["requests"]
    assert req["cancelled"] == 2 and req["failed"] == 0  # cancelled by the bench, not failed by a stopping deployment
    assert summary["config"]["url"] == f"http://127.0.0.1:{port}"

    # then the deployment stopped, in order, leaving nothing
    lines = err.splitlines()
    said = [i for i, line in enumerate(lines) if "SIGTERM received; cancelling requests in flight" in line]
    reported = [i for i, line in enumerate(lines) if "interrupted: 2 of 8 requests sent, 2 cancelled in flight" in line]
    stopped = [i for i, line in enumerate(lines) if line == "shmdisagg bench: deployment stopped"]
    assert said and reported and stopped and said[0] < reported[0] < stopped[0], err
    assert not [p for p in children if alive(p)]
    assert glob.glob(f"/dev/shm/{shm_prefix}*") == []
    assert not glob.glob(
        os.path.join(tempfile.gettempdir(), f"shmdisagg-{os.getuid()}-bench-{port}-*.yaml")
    )  # the moved config

    # the coordinator's and fleet's log lines went to the deployment's log, not between the bench's
    assert "Started server process" not in err + stdout.decode()
    coordinator_log = (logs / "coordinator.log").read_text()
    assert "Started server process" in coordinator_log and "fleet worker 0 started" in coordinator_log
