"""The metadata-server form (`trtllm-serve disaggregated -c CFG -m FILE`, workers started with
`trtllm-serve ... --server_role ROLE --metadata_server_config_file FILE`): workers put
`trtllm/<llm_id>` in etcd; the deployment polls, health-checks, routes, and deletes dead ones."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import yaml

from tests.conftest import free_port
from tests.integration.etcd import etcd_server
from tests.integration.harness import REPO, request_json, wait_until


def test_workers_in_the_metadata_server_serve_and_a_dead_one_is_removed_from_it(
    tmp_path: Path, shm_prefix: str
) -> None:
    with etcd_server(tmp_path) as etcd:
        meta = tmp_path / "meta.yaml"
        meta.write_text(yaml.safe_dump({"server_type": "etcd", "hostname": "127.0.0.1", "port": etcd.port,
                                        "refresh_interval": 0.5, "health_check_timeout": 1.0}))  # fmt: skip
        port = free_port()
        cfg = tmp_path / "cfg.yaml"
        cfg.write_text(
            yaml.safe_dump(
                {
                    "hostname": "127.0.0.1",
                    "port": port,
                    "num_workers": 1,
                    "context_servers": {"router": {"type": "round_robin"}},
                    "generation_servers": {"router": {"type": "round_robin"}},
                    "shmdisagg": {
                        "shm": {"prefix": shm_prefix},
                        "coordinator_socket": str(tmp_path / "c.sock"),
                        "health_check_interval_s": 0.2,
                        "health_check_timeout_s": 1.0,
                    },
                }  # fmt: skip
            )
        )
        opts = tmp_path / "opts.yaml"
        opts.write_text(yaml.safe_dump({"cache_transceiver_config": {"backend": "UCX"}}))
        workers = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "shmdisagg.executors.sim",
                    "serve",
                    "sim-llama-3.1-8b",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(free_port()),
                    "--server_role",
                    role,
                    "--metadata_server_config_file",
                    str(meta),
                    "--extra_llm_api_options",
                    str(opts),
                ],
                cwd=REPO,
            )  # fmt: skip
            for role in ("CONTEXT", "GENERATION")  # trtllm-serve upper-cases it into ServerRole anyway
        ]
        serve = subprocess.Popen(
            [sys.executable, "-m", "shmdisagg.cli", "serve", "-c", str(cfg), "-m", str(meta)], cwd=REPO
        )
        try:
            wait_until(lambda: _keys(etcd) == 2, 30, "both workers in the metadata server")
            entries = [
                json.loads(v) for v in etcd.etcdctl("get", "--prefix", "--print-value-only", "trtllm/").split("\n") if v
            ]
            assert sorted(e["server_role"] for e in entries) == ["CONTEXT", "GENERATION"]
            assert all(set(e) == {"model", "version", "timestamp", "server_role", "url"} for e in entries)
            wait_until(lambda: _status(port, "GET", "/health") == 200, 60, "ready")
            status, _ = request_json("127.0.0.1", port, "POST", "/v1/completions",
                                     {"model": "m", "prompt": "hi there", "max_tokens": 2})  # fmt: skip
            assert status == 200
            workers[1].send_signal(signal.SIGKILL)  # no clean removal: its key stays until the poll finds it dead
            workers[1].wait()
            wait_until(lambda: _keys(etcd) == 1, 20, "the dead worker's key deleted by the deployment")
            wait_until(lambda: _status(port, "GET", "/health") == 503, 10, "not ready without a generation server")
            workers[0].send_signal(signal.SIGTERM)  # a clean stop removes its own key
            workers[0].wait(timeout=20)
            assert _keys(etcd) == 0
        finally:
            serve.send_signal(signal.SIGTERM)
            serve.wait(timeout=60)
            for w in workers:
                if w.poll() is None:
                    w.kill()
                    w.wait()
        assert serve.returncode == 0


def _keys(etcd: object) -> int:
    return len(etcd.etcdctl("get", "--prefix", "--keys-only", "trtllm/").split())  # type: ignore[attr-defined]


def _status(port: int, method: str, path: str) -> int | None:
    try:
        return request_json("127.0.0.1", port, method, path)[0]
    except OSError:
        return None
