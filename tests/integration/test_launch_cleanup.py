"""`shmdisagg launch` leaves no process and no shared-memory segment behind, whether it is
stopped by a signal or fails half-way through start-up."""

from __future__ import annotations

import glob
import os
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from shmdisagg.launch import http_status
from tests.conftest import free_port
from tests.integration.harness import REPO, deployment, fake_executors, wait_until, write_config


def descendants(pid: int) -> set[int]:
    """Every live descendant of `pid` (from /proc/<pid>/task/*/children)."""
    out: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        for children in glob.glob(f"/proc/{p}/task/*/children"):
            try:
                kids = [int(x) for x in Path(children).read_text().split()]
            except OSError:
                continue
            for k in kids:
                if k not in out:
                    out.add(k)
                    todo.append(k)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _launch(cfg: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "shmdisagg.cli", "launch", "-c", str(cfg)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_stops_everything_and_unlinks_every_segment(tmp_path: Path, shm_prefix: str, sig: int) -> None:
    with fake_executors(["c0", "g0"]) as (ctx, gen):
        cfg = write_config(tmp_path, shm_prefix, [ctx.addr], [gen.addr])
        import yaml

        port = yaml.safe_load(cfg.read_text())["port"]
        proc = _launch(cfg)
        try:
            assert proc.stdout is not None
            first_line = proc.stdout.readline()  # printed once everything answers /health
            assert b"listening on" in first_line, first_line
            assert http_status(f"http://127.0.0.1:{port}/health") == 200
            children = descendants(proc.pid)
            assert len(children) >= 4  # coordinator, 2 fleet workers, a standby
            assert glob.glob(f"/dev/shm/{shm_prefix}*")
            proc.send_signal(sig)
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, err
        assert b"stopped" in out
        assert not [p for p in children if alive(p)]
        assert glob.glob(f"/dev/shm/{shm_prefix}*") == []
        assert not os.path.exists(tmp_path / "coord.sock")


def test_failed_start_leaves_nothing_behind(tmp_path: Path, shm_prefix: str) -> None:
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    cfg = write_config(
        tmp_path, shm_prefix, [dead], [f"127.0.0.1:{free_port()}"], shmdisagg={"server_start_timeout_s": 2}
    )
    proc = _launch(cfg)
    seen: set[int] = set()
    try:
        while proc.poll() is None:
            seen |= descendants(proc.pid)
            try:
                proc.wait(timeout=0.05)
            except subprocess.TimeoutExpired:
                pass
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    assert b"launch failed" in err and dead.encode() in err
    assert seen, "the coordinator was never started"
    assert not [p for p in seen if alive(p)]
    assert glob.glob(f"/dev/shm/{shm_prefix}*") == []


def test_a_second_deployment_on_the_same_table_is_refused(tmp_path: Path, shm_prefix: str) -> None:
    with fake_executors(["c0", "g0"]) as (ctx, gen):
        cfg = write_config(tmp_path, shm_prefix, [ctx.addr], [gen.addr])
        import yaml

        port = yaml.safe_load(cfg.read_text())["port"]
        first = _launch(cfg)
        try:
            wait_until(
                lambda: http_status(f"http://127.0.0.1:{port}/health") == 200, timeout_s=60, what="the deployment"
            )
            second = subprocess.run(
                [sys.executable, "-m", "shmdisagg.coordinator", "-c", str(cfg)],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert second.returncode == 1
            assert "running" in second.stderr.lower(), second.stderr
            assert http_status(f"http://127.0.0.1:{port}/health") == 200  # the first one is untouched
        finally:
            first.send_signal(signal.SIGINT)
            first.communicate(timeout=60)
        assert glob.glob(f"/dev/shm/{shm_prefix}*") == []


def _coordinator_answers(sock_path: str) -> bool:
    """Whether a coordinator serves its internal API (GET /cluster_info) on `sock_path`."""
    import http.client

    class _Unix(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(10)
            self.sock.connect(sock_path)

    conn = _Unix("coordinator")
    try:
        conn.request("GET", "/cluster_info")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def test_a_refused_second_launch_leaves_the_live_deployments_sockets(
    tmp_path: Path, shm_prefix: str, hf_tokenizer_dir: str
) -> None:
    import yaml

    kv = {"type": "kv_cache_aware", "tokenizer_dir": hf_tokenizer_dir}  # the fakes stand for real executors
    with fake_executors(["c0", "g0"]) as (ctx, gen):
        cfg = write_config(tmp_path, shm_prefix, [ctx.addr], [gen.addr], routers=(kv, kv))
        with deployment(cfg) as dep:
            sockets = [dep.config.coordinator_socket, dep.config.kv_hint_socket]
            assert all(stat.S_ISSOCK(os.stat(p).st_mode) for p in sockets)
            # the same config again, and one that shares the table and sockets on another port
            # (that one gets as far as starting a coordinator, which finds the table locked)
            other = tmp_path / "other"
            other.mkdir()
            data = yaml.safe_load(cfg.read_text())
            data["port"] = free_port()
            (other / "config.yaml").write_text(yaml.safe_dump(data))
            for second in (cfg, other / "config.yaml"):
                out = subprocess.run(
                    [sys.executable, "-m", "shmdisagg.cli", "launch", "-c", str(second)],
                    cwd=REPO,
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
                assert out.returncode == 1, out
                assert "launch failed" in out.stderr, out.stderr
                if (
                    second == cfg
                ):  # refused at once, naming the deployment that serves there, before it started anything
                    assert (
                        f"public address 127.0.0.1:{dep.config.port} is served by this deployment, which runs now "
                        f"(coordinator pid {dep.coordinator.proc.pid})" in out.stderr
                    ), out.stderr
                    assert out.stderr.count("\n") == 1, out.stderr  # that line alone: nothing started
                for path in sockets:
                    assert stat.S_ISSOCK(os.stat(path).st_mode), f"{path} removed by the launch of {second}"
                assert _coordinator_answers(dep.config.coordinator_socket)
                assert http_status(f"{dep.url}/health") == 200
    assert not os.path.exists(sockets[0]) and not os.path.exists(sockets[1])


def test_a_stop_right_after_a_hard_kill_of_the_coordinator_removes_its_sockets_segments_and_fleet(
    tmp_path: Path, shm_prefix: str, hf_tokenizer_dir: str
) -> None:
    """The launcher may be restarting the coordinator when it is told to stop: nothing stays."""
    kv = {"type": "kv_cache_aware", "tokenizer_dir": hf_tokenizer_dir}  # the fakes stand for real executors
    with fake_executors(["c0", "g0"]) as (ctx, gen):
        cfg = write_config(tmp_path, shm_prefix, [ctx.addr], [gen.addr], routers=(kv, kv))
        with deployment(cfg) as dep:
            sockets = [dep.config.coordinator_socket, dep.config.kv_hint_socket]
            assert all(os.path.exists(p) for p in sockets)
            assert dep.coordinator is not None
            fleet = descendants(dep.coordinator.proc.pid)
            dep.coordinator.proc.kill()
            dep.coordinator.proc.wait()
            assert all(os.path.exists(p) for p in sockets) and glob.glob(f"/dev/shm/{shm_prefix}*")
            dep.stop()
            assert not [p for p in sockets if os.path.exists(p)]
            assert glob.glob(f"/dev/shm/{shm_prefix}*") == []
            # the workers are stopped by then; the standby, if still importing, reads its EOF next
            assert fleet
            wait_until(
                lambda: not [p for p in fleet if alive(p)],
                timeout_s=30,
                what="the dead coordinator's fleet and standby to exit",
            )
