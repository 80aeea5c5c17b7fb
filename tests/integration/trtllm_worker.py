"""Start TensorRT-LLM's own worker server code (the CPU copy, `../shared/trtllm_worker`) for
tests that compare the simulator with it, and a small HTTP client both sides are read with.

Where it lives, its venv and its tokenizer: as the conformance suite finds them
(`tests/conformance/worker_copy.py`: `SHMDISAGG_TRTLLM_WORKER`, `SHMDISAGG_TRTLLM_WORKER_VENV`,
`SHMDISAGG_TRTLLM_WORKER_TOKENIZER`, set up by `scripts/conformance_env.sh`, which
`scripts/test.sh` sources). `missing()` says why a test cannot run, None when it can.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.conformance.worker_copy import WorkerCopy, locate

_FOUND = locate()
_UNSET = Path("/nonexistent/trtllm_worker")  # a path no check finds: tests skip with missing()
WORKER_DIR = _FOUND.root if isinstance(_FOUND, WorkerCopy) else _UNSET
WORKER_VENV = _FOUND.python.parents[1] if isinstance(_FOUND, WorkerCopy) else _UNSET
WORKER_TOKENIZER = _FOUND.tokenizer if isinstance(_FOUND, WorkerCopy) else _UNSET


def missing() -> str | None:
    """Why the worker copy cannot run here, or None."""
    return _FOUND if isinstance(_FOUND, str) else None


class Worker:
    """One worker process (`run_worker.sh` in the foreground execs the server, so the pid is its)."""

    def __init__(self, port: int, role: str, *extra: str) -> None:
        self.port = port
        self.endpoint = f"127.0.0.1:{port}"
        self._log = tempfile.TemporaryFile()
        env = dict(os.environ, WORKER_VENV=str(WORKER_VENV), TOKENIZER_DIR=str(WORKER_TOKENIZER),
                   RUN_DIR=tempfile.mkdtemp(prefix="trtllm-worker-run-"))  # fmt: skip
        self.proc = subprocess.Popen(
            ["bash", str(WORKER_DIR / "run_worker.sh"), "--port", str(port), "--role", role, *extra],
            env=env, stdout=self._log, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def wait_healthy(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker on {self.endpoint} exited with {self.proc.returncode}: {self.log()}")
            try:
                if call(self.endpoint, "GET", "/health", timeout=1.0)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"worker on {self.endpoint} not healthy: {self.log()}")

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def call(
    endpoint: str,
    method: str,
    path: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
    timeout: float = 60.0,
) -> tuple[int, dict[str, str], bytes]:
    """One request (a dict body is sent as JSON, bytes as they are); (status, headers, body)."""
    host, _, port = endpoint.rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"content-type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()
