"""Two deployments on one machine in front of the same executors, found through one etcd: only
the holder of the drain lease drains the executors' KV events (a drain is destructive), and the
other takes over when the holder stops or stalls past the lease."""

from __future__ import annotations

import contextlib
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from shmdisagg.config import load_config
from shmdisagg.launch import Deployment
from tests.integration.etcd import etcd_server
from tests.integration.harness import coordinator_info, request_json, wait_until
from tests.integration.test_cluster_etcd import TTL, Sim, cluster_config, sims


@contextlib.contextmanager
def front_end(tmp: Path, shm_prefix: str, uri: str, name: str) -> Iterator[Deployment]:
    tmp.mkdir()
    path = cluster_config(
        tmp,
        shm_prefix,
        uri,
        name,
        context_servers={"num_instances": 0, "router": {"type": "kv_cache_aware"}},
        generation_servers={"num_instances": 0, "router": {"type": "load_balancing"}},
    )
    data = yaml.safe_load(path.read_text())
    data["shmdisagg"]["executors"] = {"backend": "sim"}  # simulators (started below, not by the launcher)
    path.write_text(yaml.safe_dump(data))
    dep = Deployment(load_config(path), str(path), str(tmp / "logs"))
    dep.start()
    try:
        yield dep
    finally:
        dep.stop()


def lease(dep: Deployment) -> dict[str, Any]:
    return dict(coordinator_info(dep)["disagg_cluster"]["kv_events_drain_lease"])


def applied(dep: Deployment) -> int:
    return int(coordinator_info(dep)["kv_events"]["applied_events"])


def traffic(dep: Deployment, n: int) -> None:
    """`n` requests with prompts never sent before: each stores new blocks, so its context
    executor emits KV events."""
    for _ in range(n):
        body = {"model": "m", "prompt": f"a fresh prompt {uuid.uuid4().hex} " * 8, "max_tokens": 2}
        status, _ = request_json("127.0.0.1", dep.config.port, "POST", "/v1/completions", body)
        assert status == 200


def test_only_the_lease_holder_drains_and_the_other_takes_over(tmp_path: Path) -> None:
    name = f"d{uuid.uuid4().hex[:6]}"
    prefixes = [f"shmdisagg-t{uuid.uuid4().hex[:10]}" for _ in range(2)]
    with etcd_server(tmp_path) as etcd, sims() as started:
        started += [Sim(etcd.uri, name, "context"), Sim(etcd.uri, name, "generation")]
        with front_end(tmp_path / "a", prefixes[0], etcd.uri, name) as a:
            wait_until(lambda: lease(a)["holder"], 10, "the first deployment holds the lease")
            with front_end(tmp_path / "b", prefixes[1], etcd.uri, name) as b:
                for dep in (a, b):
                    wait_until(lambda dep=dep: request_json("127.0.0.1", dep.config.port, "GET", "/health")[0] == 200,
                               30, "ready")  # fmt: skip
                # b learns who drains at its first campaign, a background task /health does not wait for
                wait_until(lambda: lease(b)["drainer"] is not None, 10, "the second deployment's first campaign")
                assert not lease(b)["holder"] and lease(b)["drainer"]["shm_prefix"] == prefixes[0]
                traffic(a, 5)
                traffic(b, 5)
                wait_until(lambda: applied(a) > 0, 10, "the holder applies the executors' events")
                assert applied(b) == 0  # it never drained: no event went missing from a's stream

                coordinator = a.coordinator
                assert coordinator is not None
                os.kill(coordinator.proc.pid, signal.SIGSTOP)  # stalled past its lease: b takes over
                try:
                    wait_until(lambda: lease(b)["holder"], TTL + 10, "the other deployment took the lease")
                    traffic(b, 5)
                    wait_until(lambda: applied(b) > 0, 10, "the new holder drains")
                finally:
                    os.kill(coordinator.proc.pid, signal.SIGCONT)
                wait_until(lambda: lease(a)["lost"] == 1 and not lease(a)["holder"], 10, "the stalled one stepped down")
            # b stopped cleanly: its lease is revoked and a takes it back at its next campaign
            wait_until(lambda: lease(a)["holder"], 10, "the lease back at the first deployment")
