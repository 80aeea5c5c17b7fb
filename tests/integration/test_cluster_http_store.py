"""disagg_cluster with `cluster_uri: http://<public host:port>`: the cluster store the deployment
serves itself (TensorRT-LLM's HttpClusterStorageServer routes and payloads), with workers
registering through it."""

from __future__ import annotations

import http.client
import signal
import uuid
from pathlib import Path
from typing import Any

import orjson

from shmdisagg.cluster.workers import WorkerInfo, worker_key, worker_key_prefix
from shmdisagg.config import load_config
from shmdisagg.launch import Deployment
from tests.conftest import free_port
from tests.integration.harness import coordinator_info, request_json, wait_until
from tests.integration.test_cluster_etcd import Sim, cluster_config, health, sims


def call(port: int, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        data = orjson.dumps(body) if body is not None else None
        c.request(method, path, body=data, headers={"content-type": "application/json"} if data else {})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def test_the_http_store_answers_as_upstreams_and_its_workers_join_and_leave(tmp_path: Path, shm_prefix: str) -> None:
    port = free_port()
    name = f"h{uuid.uuid4().hex[:6]}"
    uri = f"http://127.0.0.1:{port}"
    path = cluster_config(tmp_path, shm_prefix, uri, name, port=port)
    dep = Deployment(load_config(path), str(path), str(tmp_path / "logs"))
    dep.start()
    try:
        with sims() as started:
            # the routes and payloads, byte for byte: {"result": ...}, 200 when truthy else 400
            key = worker_key(name, "GENERATION-127.0.0.1:1-1-1-001")
            value = WorkerInfo("GENERATION-127.0.0.1:1-1-1-001", "127.0.0.1", 1, 1).encode()
            item = {"key": key, "value": value, "ttl": 2}
            assert call(port, "POST", "/set", item) == (200, b'{"result":true}')
            assert call(port, "POST", "/set", item) == (400, b'{"result":false}')  # no overwrite_if_exists
            status, body = call(port, "GET", f"/get?key={key}")
            assert status == 200 and orjson.loads(body) == {"result": value}
            status, body = call(port, "GET", f"/get_prefix?key_prefix={worker_key_prefix(name)}&keys_only=1")
            assert status == 200 and orjson.loads(body) == {"result": {key: ""}}
            assert call(port, "GET", f"/expire?key={key}&ttl=1") == (200, b'{"result":true}')
            assert call(port, "GET", "/get?key=nope") == (400, b'{"result":null}')
            # its TTL lapses without a heartbeat: swept, a DELETE event, the server leaves
            wait_until(lambda: call(port, "GET", f"/get?key={key}")[0] == 400, 10, "the key expired")
            wait_until(lambda: not coordinator_info(dep)["servers"], 5, "the expired worker removed")
            assert call(port, "DELETE", f"/delete?key={key}") == (400, b'{"result":false}')

            started += [Sim(uri, name, "context"), Sim(uri, name, "generation")]
            wait_until(lambda: health(dep)[0] == 200, 30, "both registered through the store and healthy")
            status, _ = request_json(
                "127.0.0.1", port, "POST", "/v1/completions", {"model": "m", "prompt": "hi there", "max_tokens": 2}
            )
            assert status == 200
            started[0].stop(signal.SIGTERM)  # deregisters: DELETE /delete
            wait_until(lambda: [s["role"] for s in coordinator_info(dep)["servers"]] == ["generation"], 5, "left")
    finally:
        dep.stop()
