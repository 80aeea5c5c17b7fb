"""Helpers to bring up real deployments in tests: fake or simulated executors, the coordinator
and its fleet, all on ports and shared-memory names unique to the test."""

from __future__ import annotations

import contextlib
import http.client
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import yaml

from shmdisagg.config import load_config
from shmdisagg.launch import Deployment, http_status
from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[2]


def wait_until(predicate: Any, timeout_s: float = 20.0, what: str = "condition") -> None:
    """Poll `predicate` until it is true; fail the test after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.02)


@dataclass
class FakeExecutor:
    name: str
    port: int
    proc: subprocess.Popen[bytes]

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def recorded(self) -> list[dict[str, Any]]:
        return request_json("127.0.0.1", self.port, "GET", "/_recorded")[1]

    def script(self, **kw: Any) -> None:
        request_json("127.0.0.1", self.port, "POST", "/_script", kw)

    def events(self) -> list[str]:
        return request_json("127.0.0.1", self.port, "GET", "/_events")[1]

    def release(self) -> None:
        request_json("127.0.0.1", self.port, "POST", "/_release", {})


@contextlib.contextmanager
def fake_executors(names: list[str]) -> Iterator[list[FakeExecutor]]:
    fakes = []
    try:
        for name in names:
            port = free_port()
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.fakes.executor", "--port", str(port), "--name", name], cwd=REPO
            )
            fakes.append(FakeExecutor(name, port, proc))
        for f in fakes:
            wait_until(lambda f=f: http_status(f"http://{f.addr}/health") == 200, what=f"fake {f.name}")
        yield fakes
    finally:
        for f in fakes:
            f.proc.terminate()
        for f in fakes:
            try:
                f.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:  # a held stream keeps uvicorn's graceful shutdown waiting
                f.proc.kill()
                f.proc.wait()


def write_config(tmp: Path, shm_prefix: str, ctx: list[str], gen: list[str], **top: Any) -> Path:
    """A config file for a deployment on a fresh port; `top` overrides top-level keys."""
    routers = top.pop("routers", ("round_robin", "round_robin"))
    cfg: dict[str, Any] = {
        "hostname": "127.0.0.1",
        "port": next(
            p for p in iter(free_port, None) if f"127.0.0.1:{p}" not in (*ctx, *gen)
        ),  # free_port may repeat an executor's
        "num_workers": 2,
        "context_servers": {"num_instances": len(ctx), "urls": ctx, "router": _router(routers[0])},
        "generation_servers": {"num_instances": len(gen), "urls": gen, "router": _router(routers[1])},
        "shmdisagg": {
            "shm": {"prefix": shm_prefix},
            "coordinator_socket": str(tmp / "coord.sock"),
            "request_timeout_s": 30,
            "health_check_interval_s": 0.2,
            "health_check_timeout_s": 1.0,  # a stopped executor is found in about 2 s, not 10
            **top.pop("shmdisagg", {}),
        },
        **top,
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _router(spec: str | dict[str, Any]) -> dict[str, Any]:
    return {"type": spec} if isinstance(spec, str) else spec


@contextlib.contextmanager
def deployment(config_path: Path) -> Iterator[Deployment]:
    dep = Deployment(load_config(config_path), str(config_path), str(config_path.parent / "logs"))
    dep.start()  # ready: every fleet worker listens (test_fleet_ready.py)
    try:
        yield dep
    finally:
        dep.stop()


def request_json(
    host: str, port: int, method: str, path: str, body: Any = None, conn: http.client.HTTPConnection | None = None
) -> tuple[int, Any]:
    own = conn is None
    c = conn or http.client.HTTPConnection(host, port, timeout=30)
    try:
        data = orjson.dumps(body) if body is not None else None
        c.request(method, path, body=data, headers={"content-type": "application/json"} if data else {})
        r = c.getresponse()
        raw = r.read()
        try:
            return r.status, (orjson.loads(raw) if raw else None)
        except orjson.JSONDecodeError as e:  # name what came back: a bare decode error says nothing
            raise AssertionError(f"{method} {path} on {host}:{port}: {r.status}, not JSON: {raw[:200]!r}") from e
    finally:
        if own:
            c.close()


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float = 10.0) -> None:
        super().__init__("coordinator", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def coordinator_info(dep: Deployment) -> dict[str, Any]:
    """The coordinator's own `/cluster_info` (its internal API, on its Unix socket)."""
    c = _UnixHTTPConnection(dep.config.coordinator_socket)
    try:
        c.request("GET", "/cluster_info")
        r = c.getresponse()
        assert r.status == 200
        return orjson.loads(r.read())  # type: ignore[no-any-return]
    finally:
        c.close()


def post(dep: Deployment, path: str, body: Any, conn: http.client.HTTPConnection | None = None) -> tuple[int, Any]:
    cfg = dep.config
    return request_json("127.0.0.1", cfg.port, "POST", path, body, conn)


def post_raw(dep: Deployment, path: str, raw: bytes) -> tuple[int, Any]:
    c = http.client.HTTPConnection("127.0.0.1", dep.config.port, timeout=30)
    try:
        c.request("POST", path, body=raw, headers={"content-type": "application/json"})
        r = c.getresponse()
        return r.status, orjson.loads(r.read())
    finally:
        c.close()


def stream_lines(
    dep: Deployment, path: str, body: Any, conn: http.client.HTTPConnection | None = None
) -> tuple[int, list[bytes], dict[str, str]]:
    """POST a streaming request and return (status, SSE data payloads, headers)."""
    c = conn or http.client.HTTPConnection("127.0.0.1", dep.config.port, timeout=30)
    try:
        c.request("POST", path, body=orjson.dumps(body), headers={"content-type": "application/json"})
        r = c.getresponse()
        raw = r.read()
        events = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]
        return r.status, events, {k.lower(): v for k, v in r.getheaders()}
    finally:
        if conn is None:
            c.close()


def connection_to_worker(
    dep: Deployment, index: int, attempts: int = 200, timeout_s: float = 20.0
) -> http.client.HTTPConnection:
    """A keep-alive connection that the kernel's SO_REUSEPORT hash gave to fleet worker `index`.
    Tries `attempts` connections, and keeps trying until `timeout_s` (a replacement worker may
    still be starting)."""
    deadline = time.monotonic() + timeout_s
    tried = 0
    while tried < attempts or time.monotonic() < deadline:
        tried += 1
        c = http.client.HTTPConnection("127.0.0.1", dep.config.port, timeout=30)
        status, info = request_json("", 0, "GET", "/cluster_info", conn=c)
        if status == 200 and info["worker_index"] == index:
            return c
        c.close()
    raise AssertionError(f"no connection reached fleet worker {index}")
