"""Helpers for tests that run simulators as subprocesses (ours and other parts' tests).

`SimProcess` starts `python -m shmdisagg.executors.sim ...`, waits for `/health` by polling
with a deadline, and stops the process (SIGTERM, then SIGKILL) on exit. `post_json`,
`get_json` and `stream_sse` are small synchronous HTTP clients (http.client, one connection per
call) so tests need no event loop.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any


class SimProcess:
    def __init__(
        self,
        args: Sequence[str],
        port: int,
        host: str = "127.0.0.1",
        startup_timeout: float = 30.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.args = list(args)
        self.env = env or {}  # added to this process's environment
        self.port = port
        self.host = host
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self._stderr: Any = None  # a temporary file: a pipe nobody reads could fill and block the child

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, wait: bool = True) -> SimProcess:
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
        self._stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shmdisagg.executors.sim", *self.args],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=self._stderr,
        )
        if wait:
            try:
                self.wait_healthy()
            except BaseException:
                self.stop()
                raise
        return self

    def wait_healthy(self, timeout: float | None = None) -> None:
        """Poll GET /health until 200; raise with the process's stderr if it dies or times out."""
        deadline = time.monotonic() + (self.startup_timeout if timeout is None else timeout)
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"simulator exited with {self.proc.returncode}: {self.stderr()}")
            try:
                status, _, _ = request(self.endpoint, "GET", "/health", timeout=1.0)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.02)
        raise TimeoutError(f"simulator on {self.endpoint} not healthy within the deadline: {self.stderr()}")

    def stderr(self) -> str:
        """The last 4000 characters the process wrote to stderr so far."""
        if self._stderr is None:
            return ""
        fd = self._stderr.fileno()
        size = os.fstat(fd).st_size
        # pread leaves the shared file offset alone, so the child keeps appending where it was
        return os.pread(fd, 4000, max(size - 4000, 0)).decode(errors="replace")

    def wait_exit(self, timeout: float = 10.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    def __enter__(self) -> SimProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def request(
    endpoint: str, method: str, path: str, body: Any = None, timeout: float = 30.0
) -> tuple[int, dict[str, str], bytes]:
    host, _, port = endpoint.rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        headers = {"content-type": "application/json"} if data is not None else {}
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def post_json(endpoint: str, path: str, body: Any, timeout: float = 30.0) -> tuple[int, Any]:
    status, _, raw = request(endpoint, "POST", path, body, timeout)
    return status, json.loads(raw) if raw else None


def get_json(endpoint: str, path: str, timeout: float = 30.0) -> tuple[int, Any]:
    status, _, raw = request(endpoint, "GET", path, None, timeout)
    return status, json.loads(raw) if raw else None


def stream_sse(endpoint: str, path: str, body: Any, timeout: float = 30.0) -> Iterator[str]:
    """POST and yield each SSE `data:` payload as a string (including "[DONE]"). Raises
    http.client.IncompleteRead / OSError if the server cuts the stream."""
    host, _, port = endpoint.rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(), headers={"content-type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"stream answered {resp.status}: {resp.read()!r}")
        buf = b""
        while True:
            chunk = resp.read1(65536)
            if not chunk:
                if buf.strip():
                    raise http.client.IncompleteRead(buf)
                return
            buf += chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                for line in event.split(b"\n"):
                    if line.startswith(b"data: "):
                        yield line[6:].decode()
    finally:
        conn.close()
