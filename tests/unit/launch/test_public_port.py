"""A public port something else already listens on stops `shmdisagg launch` and `shmdisagg
serve` at once with one line, before any executor or fleet worker starts (the fleet could only
crash-loop on "Address already in use"); `shmdisagg check-config` says so beforehand, and by whom."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from shmdisagg.config import load_config
from shmdisagg.launch import Deployment
from tests.conftest import free_port
from tests.fakes.trtllm_shim import REPO


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port another server listens on (a plain listener, no SO_REUSEPORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        yield other.getsockname()[1]


def _config(tmp_path: Path, shm_prefix: str, port: int) -> tuple[Path, list[int]]:
    executor_ports = [free_port(), free_port()]
    cfg = {
        "hostname": "127.0.0.1",
        "port": port,
        "context_servers": {"urls": [f"127.0.0.1:{executor_ports[0]}"]},
        "generation_servers": {"urls": [f"127.0.0.1:{executor_ports[1]}"]},
        "shmdisagg": {
            "executors": {"backend": "sim", "startup_timeout_s": 30},
            "shm": {"prefix": shm_prefix},
            "coordinator_socket": str(tmp_path / "coord.sock"),
            "server_start_timeout_s": 2,
        },
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, executor_ports


def _config_on(tmp_path: Path, shm_prefix: str, section: str, port: int) -> tuple[Path, dict[str, Any]]:
    """`_config` on a free public port with `section`'s one executor on 127.0.0.1:`port`."""
    path = tmp_path / "config.yaml"
    cfg = yaml.safe_load(_config(tmp_path, shm_prefix, free_port())[0].read_text())
    cfg[section]["urls"] = [f"127.0.0.1:{port}"]
    path.write_text(yaml.safe_dump(cfg))
    return path, cfg


@contextlib.contextmanager
def _fleet_worker_of(config: Path) -> Iterator[int]:
    """A process that looks like another deployment's fleet worker in /proc (its command line
    and SHMDISAGG_CONFIG, what a coordinator gives its workers), listening: its port."""
    import select

    code = (
        "import socket, sys; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
        "print(s.getsockname()[1], flush=True); sys.stdin.read()"
    )
    worker = subprocess.Popen(
        [sys.executable, "-c", code, "-m", "shmdisagg.fleet.worker"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "SHMDISAGG_CONFIG": str(config)},
        text=True,
    )
    try:
        assert worker.stdout is not None
        ready, _, _ = select.select([worker.stdout], [], [], 30)
        assert ready
        yield int(worker.stdout.readline())
    finally:
        worker.communicate("")


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("shmdisagg:")]


def test_launch_refuses_a_busy_public_port_before_starting_anything(
    tmp_path: Path, shm_prefix: str, busy_port: int
) -> None:
    path, executor_ports = _config(tmp_path, shm_prefix, busy_port)
    logs = tmp_path / "logs"
    out = subprocess.run(
        [sys.executable, "-m", "shmdisagg.cli", "launch", "-c", str(path), "--log-dir", str(logs)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1, out
    errors = _errors(out.stderr)  # names the holder, as check-config does: this test's process
    assert len(errors) == 1 and errors[0].startswith(
        f"shmdisagg: launch failed: public address 127.0.0.1:{busy_port} already in use by pid {os.getpid()} ("
    ), out.stderr
    assert "Traceback" not in out.stderr
    assert not list(logs.glob("*.log")), "an executor was started"
    assert "started" not in out.stderr


def test_serve_refuses_a_busy_public_port(tmp_path: Path, shm_prefix: str, busy_port: int) -> None:
    path, _ = _config(tmp_path, shm_prefix, busy_port)
    out = subprocess.run(
        [sys.executable, "-m", "shmdisagg.cli", "serve", "-c", str(path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1, out
    errors = _errors(out.stderr)  # names the holder, as launch and check-config do
    assert len(errors) == 1 and errors[0].startswith(
        f"shmdisagg: serve failed: public address 127.0.0.1:{busy_port} already in use by pid {os.getpid()} ("
    ), out.stderr
    assert "fleet worker" not in out.stderr and "coordinator" not in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "coord.sock").exists()


@pytest.mark.parametrize(
    ("hostname", "url"),
    [
        ("localhost", "http://localhost:8000"),
        ("0.0.0.0", "http://127.0.0.1:8000"),
        ("::1", "http://[::1]:8000"),
        ("::", "http://127.0.0.1:8000"),
    ],
)
def test_the_launchers_url_of_the_public_address(hostname: str, url: str) -> None:
    from shmdisagg.config import parse_config
    from shmdisagg.launch import public_url

    cfg = parse_config(
        {
            "hostname": hostname,
            "port": 8000,
            "context_servers": {"urls": ["localhost:8001"]},
            "generation_servers": {"urls": ["localhost:8002"]},
        }
    )
    assert public_url(cfg) == url


def test_a_second_launch_while_the_first_is_starting_is_refused_at_once(tmp_path: Path, shm_prefix: str) -> None:
    """Two launches of one deployment started together: both pass the port checks (nothing
    listens yet), so the first one's claim on its shared-memory prefix must refuse the second
    before it starts any executor."""
    path, _ = _config(tmp_path, shm_prefix, free_port())
    first = Deployment(load_config(path), str(path), str(tmp_path / "logs1"))
    first._claim()  # the first launch, between its checks and its executors
    try:
        logs = tmp_path / "logs2"
        out = subprocess.run(
            [sys.executable, "-m", "shmdisagg.cli", "launch", "-c", str(path), "--log-dir", str(logs)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 1, out
        assert _errors(out.stderr) == [
            f"shmdisagg: launch failed: another launch with shared-memory prefix {shm_prefix} (of this config or "
            "another) is starting or running: stop it, or give this deployment another shmdisagg.shm.prefix"
        ], out.stderr
        assert not list(logs.glob("*.log")), "an executor was started"
    finally:
        first.stop()
    second = Deployment(load_config(path), str(path), str(tmp_path / "logs3"))
    second._claim()  # released by the first one's stop
    second.stop()


def test_a_launch_refused_for_a_busy_executor_port_leaves_no_log_directory(
    tmp_path: Path, shm_prefix: str, busy_port: int
) -> None:
    path, _ = _config_on(tmp_path, shm_prefix, "context_servers", busy_port)
    logs = tmp_path / "logs"
    out = subprocess.run(
        [sys.executable, "-m", "shmdisagg.cli", "launch", "-c", str(path), "--log-dir", str(logs)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1 and f"executor address already in use: 127.0.0.1:{busy_port}" in out.stderr, out
    assert not logs.exists()


def test_check_config_names_the_process_on_a_busy_public_port(
    tmp_path: Path, shm_prefix: str, busy_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    from shmdisagg.cli import main

    path, _ = _config(tmp_path, shm_prefix, busy_port)
    assert main(["check-config", "-c", str(path)]) == 1  # launch and serve would fail now (exit 1 too)
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(
        f"shmdisagg: {path}: public address 127.0.0.1:{busy_port} already in use by pid {os.getpid()} ("
    )
    assert err.rstrip().endswith("; launch and serve need it free")


def test_check_config_refuses_a_busy_executor_port_that_launch_would_refuse(
    tmp_path: Path, shm_prefix: str, busy_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """With a `shmdisagg.executors` section launch starts the executors on their addresses, so
    check-config says "ok" only when they are free (it said ok, then launch failed)."""
    from shmdisagg.cli import main

    path, cfg = _config_on(tmp_path, shm_prefix, "generation_servers", busy_port)
    assert main(["check-config", "-c", str(path)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err == (
        f"shmdisagg: {path}: executor address already in use: 127.0.0.1:{busy_port}; launch starts the "
        "executors there and needs them free (for serve, with these executors running: check-config --serve)\n"
    )
    # serve with that config: the section says what the running executors are (it said exit 1 here)
    assert main(["check-config", "-c", str(path), "--serve"]) == 0
    del cfg["shmdisagg"]["executors"]  # executors started elsewhere (serve, or launch without them): not ours to check
    path.write_text(yaml.safe_dump(cfg))
    assert main(["check-config", "-c", str(path)]) == 0


def test_check_config_on_its_own_running_deployment_is_ok_and_says_it_runs(
    tmp_path: Path, shm_prefix: str, busy_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    from shmdisagg.cli import main
    from shmdisagg.shm.table import ControlTable, process_starttime

    path, _ = _config(tmp_path, shm_prefix, busy_port)
    coord = ControlTable.create(shm_prefix, max_workers=2)  # this config's coordinator (this process) is up
    try:
        coord.set_coordinator(os.getpid(), process_starttime(os.getpid()), 1)
        assert main(["check-config", "-c", str(path)]) == 0
    finally:
        coord.unlink()
        coord.close()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and ": ok — " in lines[0]
    assert lines[1] == (
        f"{path}: public address 127.0.0.1:{busy_port} is served by this deployment, which runs now "
        f"(coordinator pid {os.getpid()}); launch and serve refuse a second one while it runs"
    )


def test_check_config_names_another_deployment_on_its_public_port(
    tmp_path: Path, shm_prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A fleet worker of another config listens there (its command line and SHMDISAGG_CONFIG are
    what a coordinator gives its workers)."""
    from shmdisagg.cli import main

    other = tmp_path / "other.yaml"
    other.write_text("# another deployment's config\n")
    with _fleet_worker_of(other) as port:
        path, _ = _config(tmp_path, shm_prefix, port)
        assert main(["check-config", "-c", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"already in use by another shmdisagg deployment (config {other}, coordinator pid {os.getpid()})" in err


def test_check_config_refuses_a_prefix_another_running_deployment_holds(
    tmp_path: Path, shm_prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two configs with one `shmdisagg.shm.prefix` on two ports: check-config said ok for the
    second while the first ran, then serve failed on the locked table."""
    from shmdisagg.cli import main
    from shmdisagg.shm.table import ControlTable, process_starttime

    path, _ = _config(tmp_path, shm_prefix, free_port())
    coord = ControlTable.create(shm_prefix, max_workers=2)  # the other deployment's coordinator holds its lock
    try:
        coord.set_coordinator(os.getpid(), process_starttime(os.getpid()), 1)
        assert main(["check-config", "-c", str(path)]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"shmdisagg: {path}: shmdisagg.shm.prefix {shm_prefix!r} is in use: /{shm_prefix}-ctl ")
        assert f"locked by a running coordinator (pid {os.getpid()})" in err and len(err.splitlines()) == 1
    finally:
        coord.unlink()
        coord.close()
    assert main(["check-config", "-c", str(path)]) == 0  # gone: the prefix is free again


def test_check_config_names_another_config_on_the_same_port_and_default_prefix(
    tmp_path: Path, shm_prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two config files on one port share the default prefix, so the running one's coordinator
    looked like this config's own deployment ("served by this deployment", exit 0); its fleet
    workers name their file, which is not this one."""
    from shmdisagg.cli import main
    from shmdisagg.shm.table import ControlTable, process_starttime

    other = tmp_path / "other.yaml"
    other.write_text("# the running deployment's config\n")
    coord = ControlTable.create(shm_prefix, max_workers=2)  # the prefix both configs name
    try:
        coord.set_coordinator(os.getpid(), process_starttime(os.getpid()), 1)
        with _fleet_worker_of(other) as port:
            path, _ = _config(tmp_path, shm_prefix, port)
            assert main(["check-config", "-c", str(path)]) == 1
    finally:
        coord.unlink()
        coord.close()
    err = capsys.readouterr().err
    assert f"already in use by another shmdisagg deployment (config {other}, coordinator pid {os.getpid()})" in err
    assert "served by this deployment" not in err


def test_a_port_holder_this_process_cannot_see_is_named_by_its_uid_without_blaming_permissions() -> None:
    # a socket listed in /proc/net/tcp that no /proc/<pid>/fd here holds: another user's process,
    # or one in another pid namespace, which even root cannot see from inside its container
    from shmdisagg.portuser import _describe
    from shmdisagg.procutil import Listener

    line = _describe([Listener(uid=0)])
    assert "uid 0" in line
    assert "not visible from here" in line and "container" in line
