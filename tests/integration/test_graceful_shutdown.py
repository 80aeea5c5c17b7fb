"""Stopping a deployment or one fleet worker: requests in flight get `timeout_graceful_shutdown_s`
to finish; after it a live stream ends with an SSE error event then `[DONE]`, a pending
non-streaming request gets a 503 error body, and every pick is released by the worker itself."""

from __future__ import annotations

import glob
import http.client
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from shmdisagg.launch import Deployment
from shmdisagg.shm.table import ControlTable
from tests.integration.harness import (
    FakeExecutor,
    deployment,
    fake_executors,
    post,
    request_json,
    wait_until,
    write_config,
)
from tests.integration.test_launch_cleanup import alive

COMPLETION = {"model": "fake-model", "prompt": "hello", "max_tokens": 4}
GRACE_S = 1.0


@pytest.fixture
def deployed(
    tmp_path: Path, shm_prefix: str, request: pytest.FixtureRequest
) -> Iterator[tuple[Deployment, FakeExecutor]]:
    """A deployment of 2 fleet workers over one context and one generation fake executor, with
    the grace period `request.param` (default GRACE_S)."""
    grace = getattr(request, "param", GRACE_S)
    with fake_executors(["c0", "g0"]) as (ctx, gen):
        cfg = write_config(
            tmp_path, shm_prefix, [ctx.addr], [gen.addr], shmdisagg={"timeout_graceful_shutdown_s": grace}
        )
        with deployment(cfg) as dep:
            yield dep, gen


def _hold(gen: FakeExecutor, stream: bool) -> None:
    """Make the generation leg wait: a stream after its first chunk, a plain answer for 30 s."""
    gen.script(hold=True) if stream else gen.script(delay_s=30)


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run `fn` in a thread; its result (or exception) and end time land in the dict."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except Exception as err:  # reported by the asserting test
            out["error"] = err
        out["ended"] = time.monotonic()

    t = threading.Thread(target=run)
    t.start()
    return t, out


def _request(dep: Deployment, stream: bool, conn: http.client.HTTPConnection) -> Callable[[], Any]:
    """Send a request on `conn` and return what reads its answer: (status, SSE data payloads) of
    a stream, whose first chunk has arrived by then, or (status, JSON body)."""
    if not stream:
        return lambda: post(dep, "/v1/completions", COMPLETION, conn)
    conn.request(
        "POST",
        "/v1/completions",
        body=orjson.dumps({**COMPLETION, "stream": True}),
        headers={"content-type": "application/json"},
    )
    resp = conn.getresponse()
    first = resp.readline()
    assert resp.status == 200 and first.startswith(b"data: ") and b"t0" in first, first

    def rest() -> tuple[int, list[bytes]]:
        raw = first + resp.read()
        return resp.status, [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]

    return rest


def _worker_connection(dep: Deployment, timeout_s: float) -> tuple[http.client.HTTPConnection, int]:
    """A keep-alive connection to the public port and the pid of the fleet worker serving it."""
    conn = http.client.HTTPConnection("127.0.0.1", dep.config.port, timeout=timeout_s)
    status, info = request_json("", 0, "GET", "/cluster_info", conn=conn)
    assert status == 200
    return conn, info["worker_pid"]


def _assert_ended_by_shutdown(out: dict[str, Any], stream: bool) -> None:
    """A stream: its chunk, then an SSE error event (503, `shutting_down`), then `[DONE]`.
    A plain request: a 503 OpenAI error body."""
    assert "error" not in out, f"the client saw {out['error']!r}"
    if stream:
        status, events = out["result"]
        assert status == 200 and b"t0" in events[0]
        error = orjson.loads(events[-2])["error"]
        assert error["code"] == 503 and error["type"] == "ServiceUnavailableError" and error["object"] == "error"
        assert events[-1] == b"[DONE]" and len(events) == 3
    else:
        status, body = out["result"]
        assert status == 503 and body["object"] == "error" and body["code"] == 503


def _listens(pid: int, port: int) -> bool:
    """Whether process `pid` holds a TCP socket listening on `port` (its socket fds looked up in
    /proc/net/tcp*, state 0A = LISTEN)."""
    inodes = set()
    for fd in glob.glob(f"/proc/{pid}/fd/*"):
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port and f[9] in inodes:
                return True
    return False


def _released_everything(dep: Deployment, pid: int) -> None:
    """Wait until fleet worker `pid` has exited and its row was reclaimed, then check that it had
    released every pick itself (the reclaimed totals balance) and that no server carries load."""
    wait_until(lambda: not alive(pid), timeout_s=GRACE_S + 10, what="the worker to exit")
    with ControlTable.attach(dep.config.shm_prefix) as table:
        wait_until(lambda: all(r.pid != pid for r in table.rows()), timeout_s=5, what="its row reclaimed")
        dispatched, completed = table.retired()
        assert dispatched == completed == 2  # its context and generation picks, both released
        assert all(table.load(s.slot) == (0, 0) for s in table.servers())


@pytest.mark.parametrize("stream", [True, False])
def test_stopping_the_deployment_ends_requests_still_running_after_the_grace_period(
    deployed: tuple[Deployment, FakeExecutor], stream: bool
) -> None:
    dep, gen = deployed
    _hold(gen, stream)
    conn = http.client.HTTPConnection("127.0.0.1", dep.config.port, timeout=30)
    client, out = _in_thread(_request(dep, stream, conn))
    wait_until(lambda: len(gen.recorded()) == 1, what="the generation leg")
    stopping = time.monotonic()
    dep.stop()  # what `shmdisagg launch` does on SIGTERM or Ctrl-C
    client.join(timeout=30)
    conn.close()
    assert not client.is_alive()
    _assert_ended_by_shutdown(out, stream)
    assert GRACE_S <= out["ended"] - stopping < GRACE_S + 5  # in flight for the whole grace period, not longer
    assert glob.glob(f"/dev/shm/{dep.config.shm_prefix}*") == []
    if stream:  # the upstream stream was closed too
        wait_until(
            lambda: any(e.startswith("cancelled") for e in gen.events()),
            timeout_s=5,
            what="the upstream stream cancelled",
        )


@pytest.mark.parametrize("stream", [True, False])
def test_a_stopped_fleet_worker_ends_its_requests_and_releases_every_pick_itself(
    deployed: tuple[Deployment, FakeExecutor], stream: bool
) -> None:
    dep, gen = deployed
    _hold(gen, stream)
    conn, pid = _worker_connection(dep, GRACE_S + 15)
    client, out = _in_thread(_request(dep, stream, conn))
    wait_until(lambda: len(gen.recorded()) == 1, what="the generation leg")
    signalled = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    client.join(timeout=GRACE_S + 20)
    conn.close()
    assert not client.is_alive()
    _assert_ended_by_shutdown(out, stream)
    assert out["ended"] - signalled >= GRACE_S - 0.005  # uvloop timers fire on a 1 ms grid
    _released_everything(dep, pid)
    gen.script(hold=False, delay_s=0)
    assert post(dep, "/v1/completions", COMPLETION)[0] == 200  # the rest of the fleet serves on


@pytest.mark.parametrize("deployed", [30.0], indirect=True)
def test_a_stream_that_finishes_within_the_grace_period_completes_normally(
    deployed: tuple[Deployment, FakeExecutor],
) -> None:
    dep, gen = deployed
    gen.script(hold=True)
    conn, pid = _worker_connection(dep, 60)
    client, out = _in_thread(_request(dep, True, conn))
    wait_until(lambda: len(gen.recorded()) == 1, what="the generation leg")
    os.kill(pid, signal.SIGTERM)
    wait_until(lambda: not _listens(pid, dep.config.port), what="the stopping worker to close its listener")
    assert alive(pid)
    assert post(dep, "/v1/completions", COMPLETION)[0] == 200  # new connections go to the other worker
    gen.release()
    client.join(timeout=20)
    conn.close()
    assert "error" not in out, f"the client saw {out['error']!r}"
    status, events = out["result"]
    assert status == 200 and events == [
        orjson.dumps(
            {
                "id": "cmpl-g0",
                "model": "fake-model",
                "choices": [{"index": 0, "text": f"t{i}", "finish_reason": "length" if i == 3 else None}],
            }
        )
        for i in range(4)
    ] + [b"[DONE]"]
    # it exits once its last request ended, not at the end of its 30 s grace period
    wait_until(lambda: not alive(pid), timeout_s=10, what="the worker to exit once its last request ended")
    _released_everything(dep, pid)


@pytest.mark.parametrize("deployed", [30.0], indirect=True)
def test_a_sigint_to_a_stopping_fleet_worker_ends_its_requests_at_once(
    deployed: tuple[Deployment, FakeExecutor],
) -> None:
    """uvicorn says "(CTRL+C to force quit)" once a stop waits for open connections; a Ctrl-C
    then changed nothing and the whole grace period (here 30 s) still ran."""
    dep, gen = deployed
    _hold(gen, True)
    conn, pid = _worker_connection(dep, 60)
    client, out = _in_thread(_request(dep, True, conn))
    wait_until(lambda: len(gen.recorded()) == 1, what="the generation leg")
    os.kill(pid, signal.SIGTERM)
    wait_until(lambda: not _listens(pid, dep.config.port), 10, "the worker stopping (its listener closed)")
    forced = time.monotonic()
    os.kill(pid, signal.SIGINT)
    client.join(timeout=60)
    conn.close()
    assert not client.is_alive()
    _assert_ended_by_shutdown(out, True)
    assert out["ended"] - forced < 10  # not the 30 s grace period
    _released_everything(dep, pid)


def test_a_second_ctrl_c_to_launch_ends_the_requests_still_running(tmp_path: Path, shm_prefix: str) -> None:
    """Under `launch` the fleet is in the coordinator's own process group: the launcher passes a
    second Ctrl-C on to it (the first one stops the deployment in order, over its 30 s grace)."""
    from tests.integration.test_interrupted_start import Command

    with fake_executors(["c0", "g0"]) as (ctx, gen):
        cfg = write_config(
            tmp_path, shm_prefix, [ctx.addr], [gen.addr], num_workers=1, shmdisagg={"timeout_graceful_shutdown_s": 30}
        )
        cmd = Command("launch", "-c", str(cfg), with_stdout=True)
        cmd.wait_for_line("shmdisagg listening on")  # started: a Ctrl-C now stops a serving deployment
        conn, resp = _held_stream(gen, yaml_port(cfg))
        os.killpg(cmd.proc.pid, signal.SIGINT)
        cmd.wait_for_line("Waiting for connections to close")
        forced = time.monotonic()
        status, stderr = cmd.interrupt(signal.SIGINT)
        rest = resp.read()
        conn.close()
    assert status == 0, stderr
    assert time.monotonic() - forced < 15, stderr  # not the 30 s grace period
    assert b"ServiceUnavailableError" in rest and rest.rstrip().endswith(b"data: [DONE]"), rest
    assert "Traceback" not in "".join(stderr)
    assert glob.glob(f"/dev/shm/{shm_prefix}*") == []


def _held_stream(gen: FakeExecutor, port: int) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A stream on `port` whose generation leg holds after its first chunk (read already)."""
    _hold(gen, True)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request(
        "POST", "/v1/completions", body=orjson.dumps({**COMPLETION, "stream": True}),
        headers={"content-type": "application/json"},
    )  # fmt: skip
    resp = conn.getresponse()
    assert resp.status == 200 and b"t0" in resp.readline()
    return conn, resp


def yaml_port(cfg: Path) -> int:
    import yaml

    return int(yaml.safe_load(cfg.read_text())["port"])


@pytest.mark.parametrize("command", ["serve", "launch"])
@pytest.mark.parametrize("first", [signal.SIGTERM, signal.SIGINT])
def test_a_second_sigint_to_the_commands_pid_alone_ends_the_requests_still_running(
    tmp_path: Path, shm_prefix: str, first: int, command: str
) -> None:
    """`kill -INT` twice (or a SIGTERM, then a SIGINT) to `shmdisagg serve`'s or `launch`'s own
    pid, as a script or supervisor signals it: the second one goes on to the coordinator, whose
    fleet then ends its requests at once, as a second Ctrl-C in the terminal (which reaches every
    process of the group) does."""
    from tests.integration.test_interrupted_start import Command

    with fake_executors(["c0", "g0"]) as (ctx, gen):
        cfg = write_config(
            tmp_path, shm_prefix, [ctx.addr], [gen.addr], num_workers=2, shmdisagg={"timeout_graceful_shutdown_s": 30}
        )
        cmd = Command(command, "-c", str(cfg), with_stdout=command == "launch")
        cmd.wait_for_line("coordinator ready" if command == "serve" else "shmdisagg listening on")
        conn, resp = _held_stream(gen, yaml_port(cfg))
        os.kill(cmd.proc.pid, first)  # the command's process alone, not its group
        cmd.wait_for_line("Waiting for connections to close")
        forced = time.monotonic()
        os.kill(cmd.proc.pid, signal.SIGINT)
        rest = resp.read()
        ended = time.monotonic() - forced
        conn.close()
        status, stderr = cmd.interrupt(None)
    assert ended < 15, "".join(stderr)  # not the 30 s grace period
    assert b"ServiceUnavailableError" in rest and rest.rstrip().endswith(b"data: [DONE]"), rest
    assert status == 0, "".join(stderr)  # a stop after start-up is a clean exit
    assert any("a second Ctrl-C" in line for line in stderr), "".join(stderr)
    assert "Traceback" not in "".join(stderr)
    assert glob.glob(f"/dev/shm/{shm_prefix}*") == []
    assert [pid for pid in cmd.seen if alive(pid)] == []
