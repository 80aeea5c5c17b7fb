"""TensorRT-LLM worker processes for the conformance suite, and plain HTTP to them and to a
deployment.

A worker is the worker copy's `serve_worker.py` under its venv's python, as its `run_worker.sh`
starts it (`TRTLLM_SERVE_ENABLE_MSGSPEC=1`, a free port, its log in the run directory), forked
from `forkserver.py` after the imports, which cost seconds of CPU each. Parent-death signals
chain pytest -> fork server -> workers, so a pytest process that dies (even SIGKILLed) takes its
workers with it; `WorkerSet.stop` stops them at teardown, `ForkServer.close` whatever is left.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import select
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from shmdisagg.procutil import die_with_parent
from tests.conformance.worker_copy import STATE, WorkerCopy
from tests.conftest import free_port

START_TIMEOUT_S = 180.0  # a loaded 2-core machine imports transformers slowly
FORKSERVER = Path(__file__).with_name("forkserver.py")
PORT_ATTEMPTS = 3  # a free port can be taken between free_port() and the worker's bind


@dataclass
class Answer:
    """One HTTP answer: status, headers (lower-case names), raw body; for SSE the data payloads."""

    status: int
    headers: dict[str, str]
    raw: bytes

    @property
    def json(self) -> Any:
        return orjson.loads(self.raw)

    @property
    def events(self) -> list[bytes]:
        """The `data:` payloads of an SSE body, `[DONE]` included."""
        return [line[6:] for line in self.raw.split(b"\n") if line.startswith(b"data: ")]

    @property
    def chunks(self) -> list[Any]:
        """The parsed JSON chunks of an SSE body (without `[DONE]`)."""
        return [orjson.loads(e) for e in self.events if e != b"[DONE]"]


def call(port: int, method: str, path: str, body: Any = None, timeout_s: float = 60.0) -> Answer:
    """One request to 127.0.0.1:port on a fresh connection; the whole body read."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        data = orjson.dumps(body) if body is not None else None
        c.request(method, path, body=data, headers={"content-type": "application/json"} if data is not None else {})
        r = c.getresponse()
        return Answer(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
    finally:
        c.close()


def _health(port: int) -> int | None:
    try:
        return call(port, "GET", "/health", timeout_s=2.0).status
    except OSError:
        return None


@dataclass
class Worker:
    role: str  # "context" or "generation"
    port: int
    pid: int
    log: Path

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return _alive(self.pid)

    def post(self, path: str, body: Any) -> Answer:
        return call(self.port, "POST", path, body)

    def drain_events(self) -> list[dict[str, Any]]:
        """The KV cache events since the last drain (`POST /kv_cache_events`, which empties them)."""
        answer = call(self.port, "POST", "/kv_cache_events", {})
        assert answer.status == 200, answer.raw
        return answer.json  # type: ignore[no-any-return]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


class ForkServer:
    """`forkserver.py` under the worker venv's python: it imports the worker copy once, then
    forks each worker. Started with a parent-death signal (and its workers with one on it)."""

    def __init__(self, copy: WorkerCopy) -> None:
        env = {
            **os.environ,
            "TRTLLM_SERVE_ENABLE_MSGSPEC": "1",  # as run_worker.sh: msgpack bodies decoded
            "PYTHONUNBUFFERED": "1",
            # The worker copy is read-only in CI: its bytecode goes under the ignored state folder.
            "PYTHONPYCACHEPREFIX": str(STATE / "pycache"),
        }
        self.proc = subprocess.Popen(
            [str(copy.python), str(FORKSERVER), str(copy.root)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=copy.root,
            preexec_fn=die_with_parent,
        )
        self._read(START_TIMEOUT_S)  # {"ready": true} once the imports are done

    def _read(self, timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            raise AssertionError(f"the worker fork server did not answer (exit status {self.proc.poll()})")
        return orjson.loads(line)  # type: ignore[no-any-return]

    def spawn(self, argv: list[str], log: Path) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write(orjson.dumps({"argv": argv, "log": str(log)}) + b"\n")
        self.proc.stdin.flush()
        return int(self._read(30.0)["pid"])

    def close(self) -> None:
        """Stop it and every worker it forked (it SIGKILLs those still running after 10 s)."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@dataclass
class WorkerSet:
    """Workers started together (in parallel) and stopped together."""

    forks: ForkServer
    copy: WorkerCopy
    run_dir: Path
    workers: list[Worker] = field(default_factory=list)

    def start(self, roles: list[str], *args: str) -> list[Worker]:
        """Start one worker per role (extra `serve_worker.py` options in `args`) and wait until
        each answers /health 200. Raises AssertionError naming the worker and its log."""
        started = [self._spawn(role, args) for role in roles]
        for i in range(len(started)):
            for attempt in range(1, PORT_ATTEMPTS + 1):
                w = started[i]
                if self._wait_healthy(w):
                    break
                clash = "address already in use" in w.log.read_text(errors="replace").lower()
                if attempt == PORT_ATTEMPTS or not clash:
                    raise AssertionError(f"{w.role} worker on port {w.port} did not start: {_tail(w.log)}")
                started[i] = self._spawn(w.role, args)  # the port was taken meanwhile: another one
        return started

    def _spawn(self, role: str, args: tuple[str, ...]) -> Worker:
        port = free_port()
        log = self.run_dir / f"worker_{port}.log"
        argv = ["--port", str(port), "--role", role, "--model-dir", str(self.copy.tokenizer), *args]
        w = Worker(role, port, self.forks.spawn(argv, log), log)
        self.workers.append(w)
        return w

    @staticmethod
    def _wait_healthy(w: Worker) -> bool:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if not w.alive():
                return False
            if _health(w.port) == 200:
                return True
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        """SIGTERM every worker, SIGKILL those still running after 10 s; wait until each is gone."""
        for w in self.workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for w in self.workers:
            while w.alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            if w.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.pid, signal.SIGKILL)
        self.workers.clear()


def _tail(log: Path, lines: int = 15) -> str:
    text = log.read_text(errors="replace").splitlines()
    return f"{log}:\n" + "\n".join(text[-lines:])
