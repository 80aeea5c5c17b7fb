"""What the launcher reads from an instance's `/health` while it starts, and a command that
cannot run."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from shmdisagg.config import load_config
from shmdisagg.launch import Child, Deployment, LaunchError, Probe, probe
from tests.conftest import free_port
from tests.fakes.trtllm_shim import small_config


class _Health(BaseHTTPRequestHandler):
    answer: tuple[int, dict[str, str]] = (200, {})

    def do_GET(self) -> None:  # http.server's naming
        status, headers = self.server.answer  # type: ignore[attr-defined]
        body = b'{"error": {"code": "starting"}}' if status != 200 else b""
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def health_server() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    server.answer = (200, {})  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_a_503_with_the_starting_header_reads_as_loading(health_server: ThreadingHTTPServer) -> None:
    url = f"http://127.0.0.1:{health_server.server_address[1]}/health"
    health_server.answer = (503, {"x-trtllm-server-state": "starting", "retry-after": "1"})  # type: ignore[attr-defined]
    p = probe(url)
    assert p == Probe(503, "starting") and not p.ready
    assert p.describe() == "still starting (HTTP 503, x-trtllm-server-state: starting)"
    health_server.answer = (503, {})  # type: ignore[attr-defined]
    assert probe(url).describe() == "last answered HTTP 503"
    health_server.answer = (200, {})  # type: ignore[attr-defined]
    assert probe(url).ready


def test_a_refused_connection_reads_as_no_answer() -> None:
    p = probe(f"http://127.0.0.1:{free_port()}/health")
    assert p == Probe(None) and p.describe().startswith("no answer")


def test_a_command_that_cannot_run_fails_the_launch_and_leaves_nothing(tmp_path: Path, shm_prefix: str) -> None:
    cfg = small_config(executors={"trtllm": {"command": [str(tmp_path / "no-such-trtllm-serve")]}})
    cfg["shmdisagg"]["shm"] = {"prefix": shm_prefix}
    cfg["shmdisagg"]["coordinator_socket"] = str(tmp_path / "coord.sock")
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    dep = Deployment(load_config(path), str(path), str(tmp_path / "logs"))
    with pytest.raises(LaunchError, match=r"^context-0: cannot run .*no-such-trtllm-serve: No such file or directory"):
        dep.start()
    assert dep.executors == [] and dep.coordinator is None
    # the option file was written before the attempt; the log names the command line
    assert yaml.safe_load((tmp_path / "logs" / "context-0.yaml").read_text())["cache_transceiver_config"] == {
        "backend": "UCX"
    }
    assert "CUDA_VISIBLE_DEVICES=0 " in (tmp_path / "logs" / "context-0.log").read_text()


# A child that serves GET /health 200 on the port in argv[1] until its stdin closes.
_SERVING_CHILD = """
import sys, threading
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("content-length", "0"); self.end_headers()
    def log_message(self, *a): pass
server = HTTPServer(("127.0.0.1", int(sys.argv[1])), H)
threading.Thread(target=server.serve_forever, daemon=True).start()
sys.stdin.read()
"""


def _deployment(tmp_path: Path) -> Deployment:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(small_config()))
    return Deployment(load_config(path), str(path), str(tmp_path / "logs"))


def test_the_launchers_log_lines_name_an_instance_by_its_address(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    dep = _deployment(tmp_path)
    port = free_port()
    addr = f"127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-c", _SERVING_CHILD, str(port)], stdin=subprocess.PIPE)
    try:
        child = Child("context-0", proc, None, health_url=f"http://{addr}/health", addr=addr)
        with caplog.at_level(logging.INFO, logger="shmdisagg.launch"):
            dep._wait_ready([child], timeout_s=30)
    finally:
        proc.communicate(b"")
    assert f"context-0 ({addr}) is ready" in caplog.messages


def test_a_200_from_another_process_on_the_executors_port_is_not_its_readiness(
    tmp_path: Path, health_server: ThreadingHTTPServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Another process that took the executor's port after launch found it free answers /health
    200, while the executor (here one that never binds) is not up: launch must not call it
    ready (it would route the deployment's legs to a stranger) and says what answered."""
    dep = _deployment(tmp_path)
    addr = f"127.0.0.1:{health_server.server_address[1]}"
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        child = Child("generation-0", proc, None, health_url=f"http://{addr}/health", addr=addr)
        with caplog.at_level(logging.INFO, logger="shmdisagg.launch"), pytest.raises(LaunchError) as err:
            dep._wait_ready([child], timeout_s=1)
    finally:
        proc.communicate(b"")
    assert "HTTP 200 from another process" in str(err.value)
    assert f"generation-0 ({addr}) is ready" not in caplog.messages
    assert any("from another process" in m for m in caplog.messages)  # said at once, not at the timeout


def test_the_coordinators_wait_line_says_whether_its_fleet_started() -> None:
    """Before the coordinator's F its fleet has not started (it waits for the executors); after
    it, the coordinator waits for its workers to listen."""
    from shmdisagg.launch import coordinator_stage

    assert coordinator_stage(False).startswith("fleet not started yet")
    assert coordinator_stage(True) == "fleet started, its workers not listening yet"
