"""A coordinator that dies does not stop the service (`coordinator/keeper.py`,
`coordinator/adoption.py`): under load it is SIGKILLed, the fleet keeps serving from the table,
the launcher starts a new coordinator that adopts the segments (the KV index keeps its blocks)
and the same fleet workers, events flow again, and no request fails. A worker that dies while
no coordinator runs is reclaimed and replaced by the next one; a coordinator that cannot be
restarted ends the launch in one line; nothing is left behind either way."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml

from shmdisagg.launch import Deployment
from shmdisagg.processes import ProcessId
from shmdisagg.shm.index import server_blocks
from shmdisagg.shm.layout import COORD_RUNNING
from shmdisagg.shm.table import ControlTable
from tests.conftest import free_port
from tests.integration.harness import (
    REPO,
    deployment,
    fake_executors,
    post,
    request_json,
    stream_lines,
    wait_until,
    write_config,
)
from tests.integration.test_launch_cleanup import alive, descendants

MODEL = "sim-llama-3.1-8b"
SIM = {"backend": "sim", "model": MODEL, "sim": {"speedup": 20.0}}


class Load:
    """Threads sending completions (streaming and not, token-list prompts) until stopped; every
    outcome recorded: "ok" for a complete answer, else what went wrong."""

    def __init__(self, dep: Deployment, threads: int = 4) -> None:
        self.dep = dep
        self.outcomes: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)

    def done(self) -> int:
        with self._lock:
            return len(self.outcomes)

    def _run(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            prompt = list(range(1000 * (n % 5), 1000 * (n % 5) + 200))  # five shared prefixes
            body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
            try:
                if n % 2:
                    status, events, _ = stream_lines(self.dep, "/v1/completions", {**body, "stream": True})
                    bad = [e for e in events if b'"error"' in e]
                    outcome = (
                        "ok"
                        if status == 200 and events and events[-1] == b"[DONE]" and not bad
                        else f"stream {status} {events[-2:]}"
                    )
                else:
                    status, answer = post(self.dep, "/v1/completions", body)
                    outcome = "ok" if status == 200 and answer["choices"][0]["text"] else f"{status} {answer}"
            except Exception as err:  # a reset or a timeout: a failed request
                outcome = f"{type(err).__name__}: {err}"
            with self._lock:
                self.outcomes.append(outcome)


def _table(dep: Deployment) -> ControlTable:
    return ControlTable.attach(dep.config.shm_prefix, read_only=True)


def _restarted(table: ControlTable, old_pid: int) -> bool:
    coord = table.coordinator()
    return (
        coord["pid"] != old_pid
        and coord["state"] == COORD_RUNNING
        and ProcessId(coord["pid"], coord["starttime"]).alive()
    )


def test_a_coordinator_sigkilled_under_load_is_replaced_and_no_request_fails(tmp_path: Path, shm_prefix: str) -> None:
    ctx = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    gen = [f"127.0.0.1:{free_port()}"]
    router = {"type": "kv_cache_aware", "track_routed_blocks": False}  # only KV events fill the index
    cfg = write_config(tmp_path, shm_prefix, ctx, gen, routers=(router, "round_robin"), shmdisagg={"executors": SIM})
    with deployment(cfg) as dep, _table(dep) as table:
        assert (
            post(dep, "/v1/completions", {"model": MODEL, "prompt": list(range(7000, 7320)), "max_tokens": 2})[0] == 200
        )
        wait_until(
            lambda: sum((server_blocks(table) or {}).values()) >= 10, what="the first prompt's KV events in the index"
        )
        before = server_blocks(table) or {}
        old = table.coordinator()
        fleet = sorted(r.pid for r in table.rows())
        with Load(dep) as load:
            wait_until(lambda: load.done() >= 20, what="load before the kill")
            os.kill(old["pid"], signal.SIGKILL)
            wait_until(lambda: _restarted(table, old["pid"]), timeout_s=60, what="a new coordinator")
            after_restart = load.done()
            wait_until(lambda: load.done() >= after_restart + 20, timeout_s=60, what="load after the restart")
        failed = [o for o in load.outcomes if o != "ok"]
        assert not failed, f"{len(failed)} of {len(load.outcomes)} requests failed: {failed[:3]}"
        assert table.coordinator()["incarnation"] != old["incarnation"]
        assert sorted(r.pid for r in table.rows()) == fleet  # the same workers, adopted
        kept = server_blocks(table) or {}
        assert all(kept.get(slot, 0) >= n for slot, n in before.items()), (before, kept)  # the index was not rebuilt
        # the new coordinator drains KV events: a new prompt's blocks reach the index
        total = sum(kept.values())
        assert (
            post(dep, "/v1/completions", {"model": MODEL, "prompt": list(range(20000, 20640)), "max_tokens": 2})[0]
            == 200
        )
        wait_until(
            lambda: sum((server_blocks(table) or {}).values()) >= total + 20,
            what="events from the new coordinator's drains",
        )
        wait_until(
            lambda: all(table.load(s.slot) == (0, 0) for s in table.servers()), what="every load counter back to 0"
        )
    assert glob.glob(f"/dev/shm/{shm_prefix}*") == []


def _coordinator(config: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "shmdisagg.coordinator", "-c", str(config)],
        cwd=REPO,
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def test_a_worker_that_died_while_no_coordinator_ran_is_reclaimed_and_replaced(tmp_path: Path, shm_prefix: str) -> None:
    """Without a keeper, so that nothing restarts the coordinator before the worker dies: this
    test process plays the supervisor (its identity in SHMDISAGG_SUPERVISOR), as the launcher does."""
    supervised = {"SHMDISAGG_SUPERVISOR": str(ProcessId.of(os.getpid()))}
    with fake_executors(["c0", "g0"]) as (c0, g0):
        cfg = write_config(tmp_path, shm_prefix, [c0.addr], [g0.addr])
        first = _coordinator(cfg, supervised)
        port = int(yaml.safe_load(cfg.read_text())["port"])
        second = None
        try:
            wait_until(lambda: _fleet(port) == 2, timeout_s=60, what="the first coordinator's fleet")
            with ControlTable.attach(shm_prefix, read_only=True) as table:
                rows = {r.fleet_index: r for r in table.rows()}
                first.kill()
                first.wait()
                os.kill(rows[0].pid, signal.SIGKILL)
                wait_until(lambda: not alive(rows[0].pid), what="worker 0 to die")
                wait_until(lambda: _health(port) == 200, what="worker 1 serving alone, without a coordinator")
                assert 0 in {r.fleet_index for r in table.rows()}  # nobody has reclaimed the dead worker's row yet
                second = _coordinator(cfg, {**supervised, "SHMDISAGG_ADOPT": "1"})
                wait_until(lambda: _restarted(table, first.pid), timeout_s=60, what="the second coordinator")
                wait_until(
                    lambda: (
                        {r.fleet_index: r.pid for r in table.rows()}.keys() == {0, 1}
                        and {r.fleet_index: r.pid for r in table.rows()}[0] != rows[0].pid
                    ),
                    timeout_s=60,
                    what="worker 0 replaced",
                )
                assert {r.fleet_index: r.pid for r in table.rows()}[1] == rows[1].pid  # worker 1 adopted, not restarted
        finally:
            for proc in (second, first):
                if proc is not None and proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                    proc.wait(timeout=30)
        assert second is not None and second.returncode == 0
    wait_until(lambda: not glob.glob(f"/dev/shm/{shm_prefix}*"), what="the segments to go")


def _health(port: int) -> int | None:
    try:
        return request_json("127.0.0.1", port, "GET", "/health")[0]
    except OSError:  # a connection the dying worker's listener had queued is reset
        return None


def _fleet(port: int) -> int:
    try:
        status, info = request_json("127.0.0.1", port, "GET", "/cluster_info")
    except OSError:
        return 0
    return len(info["fleet_pids"]) if status == 200 else 0


def _launch(cfg: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "shmdisagg.cli", "launch", "-c", str(cfg)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _coordinator_pid(prefix: str) -> int | None:
    """The running coordinator as its table says (not the warm standby waiting to replace it)."""
    try:
        with ControlTable.attach(prefix, timeout=0.0, read_only=True) as table:
            coord = table.coordinator()
    except (FileNotFoundError, OSError):
        return None
    return (
        coord["pid"]
        if coord["state"] == COORD_RUNNING and ProcessId(coord["pid"], coord["starttime"]).alive()
        else None
    )


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_under_launch_a_sigkilled_coordinator_is_replaced_and_a_stop_leaves_nothing(
    tmp_path: Path, shm_prefix: str
) -> None:
    with fake_executors(["c0", "g0"]) as (ctx, gen):
        cfg = write_config(tmp_path, shm_prefix, [ctx.addr], [gen.addr])
        port = int(yaml.safe_load(cfg.read_text())["port"])
        proc = _launch(cfg)
        try:
            assert proc.stdout is not None and b"listening on" in proc.stdout.readline()
            wait_until(lambda: _fleet(port) == 2, what="the fleet")
            old = _coordinator_pid(shm_prefix)
            assert old is not None and old in descendants(proc.pid)
            workers = {p for p in descendants(proc.pid) if b"shmdisagg.fleet.worker" in _cmdline(p)}
            os.kill(old, signal.SIGKILL)
            wait_until(lambda: _coordinator_pid(shm_prefix) not in (None, old), timeout_s=60, what="a new coordinator")
            assert request_json("127.0.0.1", port, "GET", "/health")[0] == 200
            everything = descendants(proc.pid) | workers
            wait_until(
                lambda: request_json("127.0.0.1", port, "GET", "/cluster_info")[1]["coordinator_pid"] != old,
                what="the fleet to see it",
            )
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, err
        assert b"shmdisagg stopped" in out
        assert [p for p in everything if alive(p)] == []
        assert glob.glob(f"/dev/shm/{shm_prefix}*") == []
        assert not os.path.exists(tmp_path / "coord.sock")


def test_a_coordinator_that_cannot_be_restarted_ends_the_launch_in_one_line(tmp_path: Path, shm_prefix: str) -> None:
    with fake_executors(["c0", "g0"]) as (ctx, gen):
        cfg = write_config(tmp_path, shm_prefix, [ctx.addr], [gen.addr])
        proc = _launch(cfg)
        try:
            assert proc.stdout is not None and b"listening on" in proc.stdout.readline()
            old = _coordinator_pid(shm_prefix)
            assert old is not None
            everything = descendants(proc.pid)
            assert "num_workers: 2\n" in cfg.read_text()
            cfg.write_text(
                cfg.read_text().replace("num_workers: 2\n", "num_workers: two\n")
            )  # every replacement exits 2 at once
            os.kill(old, signal.SIGKILL)
            out, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 1, err
        errors = [line for line in err.decode().splitlines() if line.startswith("shmdisagg: the coordinator")]
        assert errors == [
            "shmdisagg: the coordinator ended (exit code 1) and could not be restarted; the deployment is stopped"
        ], err
        wait_until(
            lambda: not [p for p in everything if alive(p)], timeout_s=30, what="every process of the launch to exit"
        )
        assert glob.glob(f"/dev/shm/{shm_prefix}*") == []


@pytest.mark.parametrize("command", ["serve", "launch"])
def test_a_sigkilled_supervisor_leaves_no_process_and_no_segment(tmp_path: Path, shm_prefix: str, command: str) -> None:
    with fake_executors(["c0", "g0"]) as (ctx, gen):
        cfg = write_config(tmp_path, shm_prefix, [ctx.addr], [gen.addr])
        port = int(yaml.safe_load(cfg.read_text())["port"])
        proc = subprocess.Popen(
            [sys.executable, "-m", "shmdisagg.cli", command, "-c", str(cfg)],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_until(lambda: _fleet(port) == 2, timeout_s=60, what="the fleet")
            everything = descendants(proc.pid)
            assert len([p for p in everything if b"shmdisagg.fleet.worker" in _cmdline(p)]) >= 2
            proc.kill()
            proc.wait()
            wait_until(
                lambda: not [p for p in everything if alive(p)],
                timeout_s=30,
                what="every process of the deployment to exit",
            )
            wait_until(lambda: not glob.glob(f"/dev/shm/{shm_prefix}*"), timeout_s=30, what="every segment to go")
        finally:
            if proc.poll() is None:
                proc.kill()


def test_a_refused_second_serve_of_the_same_prefix_leaves_the_running_fleet_serving(
    tmp_path: Path, shm_prefix: str
) -> None:
    """A second `serve` of a running deployment's shared-memory prefix (another port) is refused,
    and its stop must not take the running deployment's fleet for a dead coordinator's."""
    with fake_executors(["c0", "g0"]) as (ctx, gen):
        cfg = write_config(tmp_path, shm_prefix, [ctx.addr], [gen.addr])
        with deployment(cfg) as dep:
            _, info = request_json("127.0.0.1", dep.config.port, "GET", "/cluster_info")
            fleet = [ProcessId.of(p) for p in info["fleet_pids"]]
            other = yaml.safe_load(cfg.read_text())
            other["port"] = next(p for p in iter(free_port, None) if p != dep.config.port)
            other["shmdisagg"]["coordinator_socket"] = str(tmp_path / "second.sock")
            second = tmp_path / "second.yaml"
            second.write_text(yaml.safe_dump(other))
            done = subprocess.run(
                [sys.executable, "-m", "shmdisagg.cli", "serve", "-c", str(second)],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert done.returncode == 1 and "is locked by a running coordinator" in done.stderr, done.stderr
            assert "stopped" not in done.stderr, done.stderr
            assert all(p.alive() for p in fleet)
            status, _ = request_json(
                "127.0.0.1", dep.config.port, "POST", "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2}
            )
            assert status == 200
