"""Supervising `trtllm-serve` instances (through the shim): a failed or slow start stops
everything and says why, a stop takes what each instance started with it, and the real
`shmdisagg launch` command leaves nothing behind."""

from __future__ import annotations

import glob
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from shmdisagg.config import load_config
from shmdisagg.launch import Deployment, LaunchError, http_status
from tests.fakes.trtllm_shim import REPO, localize, put_shim_on_path, shim_env, small_config, write


def _group_members(pgid: int) -> set[int]:
    out = set()
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = Path(stat).read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.add(int(stat.split("/")[2]))
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _deployment(tmp_path: Path, shm_prefix: str, cfg: dict[str, Any]) -> Deployment:
    path = write(localize(cfg, tmp_path, shm_prefix), tmp_path)
    return Deployment(load_config(path), str(path), str(tmp_path / "logs"))


def test_an_instance_that_exits_during_start_up_fails_the_launch_and_stops_the_others(
    tmp_path: Path, shm_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    put_shim_on_path(monkeypatch)
    # an option trtllm-serve (and its stand-in) refuses: that instance exits at once
    dep = _deployment(tmp_path, shm_prefix, small_config(generation_servers={"warp_factor": 9}))
    with pytest.raises(LaunchError) as info:
        dep.start()
    msg = str(info.value)
    assert msg.startswith("generation-0 ended during start-up (exit 2) (log: ")
    assert "generation-0.log; last line: " in msg and "warp_factor" in msg
    assert dep.executors == [] and dep.coordinator is None
    assert dep.plan is not None
    # the healthy context instance was stopped with it
    assert http_status(f"http://{dep.plan.instances[0].addr}/health") is None


def test_an_instance_still_loading_at_the_deadline_fails_the_launch_naming_its_state(
    tmp_path: Path, shm_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    put_shim_on_path(monkeypatch)
    cfg = localize(small_config(generation_servers={"sim": {"startup_delay": 120.0}}), tmp_path, shm_prefix)
    cfg["shmdisagg"]["executors"]["startup_timeout_s"] = 3
    path = write(cfg, tmp_path)
    dep = Deployment(load_config(path), str(path), str(tmp_path / "logs"))
    with pytest.raises(
        LaunchError,
        match=r"^generation-0 not healthy at http://127\.0\.0\.1:\d+/health within 3 s: "
        r"still starting \(HTTP 503, x-trtllm-server-state: starting\)",
    ):
        dep.start()
    assert dep.executors == []


def test_stop_takes_down_what_each_instance_started(
    tmp_path: Path, shm_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    put_shim_on_path(monkeypatch)
    # like trtllm-serve starting its MPI ranks: each instance leaves a helper process behind it
    command = ["sh", "-c", 'sleep 300 & exec trtllm-serve "$@"', "trtllm-serve"]
    dep = _deployment(tmp_path, shm_prefix, small_config(executors={"trtllm": {"command": command}}))
    dep.start()
    try:
        members = {c.name: _group_members(c.proc.pid) for c in dep.executors}
        assert all(len(m) == 2 for m in members.values()), members  # the server and its sleep
    finally:
        dep.stop()
    assert not [p for m in members.values() for p in m if _alive(p)]


def test_the_launch_command_runs_trtllm_serve_instances_and_stops_them_all(tmp_path: Path, shm_prefix: str) -> None:
    path = write(localize(small_config(), tmp_path, shm_prefix), tmp_path)
    port = load_config(path).port
    proc = subprocess.Popen(
        [sys.executable, "-m", "shmdisagg.cli", "launch", "-c", str(path), "--log-dir", str(tmp_path / "logs")],
        cwd=REPO,
        env=shim_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # printed once everything answers /health
        assert b"listening on" in line, line
        assert http_status(f"http://127.0.0.1:{port}/health") == 200
        groups = [_group_members(p) for p in _group_leading_children(proc.pid)]
        assert len(groups) == 2 and all(groups)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()  # closes the pipes too
    assert proc.returncode == 0, err
    assert b"stopped" in out
    assert not [p for g in groups for p in g if _alive(p)]
    assert glob.glob(f"/dev/shm/{shm_prefix}*") == []


def _group_leading_children(pid: int) -> list[int]:
    """The children of `pid` that lead their own process group, the coordinator left out (it
    has a session of its own, so that a terminal's Ctrl-C reaches the launcher alone): the
    executor instances."""
    kids = [int(k) for f in glob.glob(f"/proc/{pid}/task/*/children") for k in Path(f).read_text().split()]
    return [k for k in kids if _pgid(k) == k and b"shmdisagg.coordinator" not in _cmdline(k)]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _pgid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2])
    except OSError:
        return -1
