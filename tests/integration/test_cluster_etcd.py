"""disagg_cluster on etcd: executors that register themselves (the simulator, as `trtllm-serve
--disagg_cluster_uri etcd://... --server_role ...` does) join and leave a running deployment,
against a real etcd server on ports of this test's own."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from shmdisagg.cluster.workers import WorkerInfo, new_worker_id, worker_key, worker_key_prefix
from shmdisagg.config import load_config
from shmdisagg.launch import Deployment
from tests.conftest import free_port
from tests.integration.etcd import EtcdServer, etcd_server
from tests.integration.harness import REPO, coordinator_info, request_json, wait_until

HB, TTL = 1, 3  # the simulators' heartbeat and lease, seconds


def cluster_config(
    tmp: Path,
    shm_prefix: str,
    uri: str,
    name: str,
    shm: dict[str, Any] | None = None,
    minimal: dict[str, int] | None = None,
    **top: Any,
) -> Path:
    cfg: dict[str, Any] = {
        "hostname": "127.0.0.1",
        "port": free_port(),
        "num_workers": 2,
        "disagg_cluster": {
            "cluster_uri": uri,
            "cluster_name": name,
            "heartbeat_interval_sec": HB,
            "inactive_timeout_sec": TTL,
            **({"minimal_instances": minimal} if minimal else {}),
        },
        "context_servers": {"router": {"type": "load_balancing"}},
        "generation_servers": {"router": {"type": "load_balancing"}},
        "shmdisagg": {
            "shm": {"prefix": shm_prefix, **(shm or {})},
            "coordinator_socket": str(tmp / "coord.sock"),
            "request_timeout_s": 30,
            "health_check_interval_s": 0.2,
            "health_check_timeout_s": 1.0,
        },
        **top,
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


class Sim:
    """A simulator that registers itself in the cluster (port 0 unless given: the kernel picks)."""

    def __init__(self, uri: str, name: str, role: str, port: int = 0) -> None:
        self.role = role
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shmdisagg.executors.sim", "--host", "127.0.0.1", "--port", str(port),
             "--role", role, "--server-role", role, "--disagg-cluster-uri", uri, "--cluster-name", name,
             "--heartbeat-interval-sec", str(HB), "--inactive-timeout-sec", str(TTL), "--startup-delay", "0"],
            cwd=REPO,
        )  # fmt: skip

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextlib.contextmanager
def sims() -> Iterator[list[Sim]]:
    started: list[Sim] = []
    try:
        yield started
    finally:
        for s in started:
            s.stop(signal.SIGKILL)


@contextlib.contextmanager
def cluster(
    tmp_path: Path,
    shm_prefix: str,
    shm: dict[str, Any] | None = None,
    minimal: dict[str, int] | None = None,
    **top: Any,
) -> Iterator[tuple[Deployment, EtcdServer, str]]:
    name = f"t{uuid.uuid4().hex[:8]}"
    with etcd_server(tmp_path) as etcd:
        path = cluster_config(tmp_path, shm_prefix, etcd.uri, name, shm, minimal, **top)
        dep = Deployment(load_config(path), str(path), str(tmp_path / "logs"))
        dep.start()
        try:
            yield dep, etcd, name
        finally:
            dep.stop()


def key_leases(etcd: EtcdServer, name: str) -> dict[str, int]:
    """Worker key -> the id of the lease it is on."""
    import base64
    import json

    out = json.loads(etcd.etcdctl("get", "--prefix", worker_key_prefix(name), "-w", "json"))
    return {base64.b64decode(kv["key"]).decode(): int(kv.get("lease", 0)) for kv in out.get("kvs", [])}


def register_all(etcd: EtcdServer, name: str, workers: list[WorkerInfo]) -> None:
    """Put every worker's key at once (no lease), as a flood of registrations would."""
    import aetcd

    async def flood() -> None:
        client = aetcd.Client(host="127.0.0.1", port=etcd.port)
        try:
            await asyncio.gather(*(client.put(worker_key(name, w.worker_id).encode(), w.encode().encode())
                                   for w in workers))  # fmt: skip
        finally:
            await client.close()

    asyncio.run(flood())


def kill_coordinator_and_serve_meanwhile(dep: Deployment) -> None:
    """SIGKILL the coordinator; the fleet serves from the table as it was while the launcher's
    keeper starts a replacement; back once the replacement answers."""
    old = coordinator_info(dep)["coordinator_pid"]
    assert dep.coordinator is not None
    dep.coordinator.proc.kill()
    assert complete(dep) == 200

    def replaced() -> bool:
        try:
            return bool(coordinator_info(dep)["coordinator_pid"] != old)
        except (OSError, AssertionError):
            return False

    wait_until(replaced, 30, "a new coordinator")


def servers(dep: Deployment) -> list[dict[str, Any]]:
    return list(coordinator_info(dep)["servers"])


def healthy(dep: Deployment, role: str) -> list[str]:
    return [s["addr"] for s in servers(dep) if s["role"] == role and s["healthy"]]


def complete(dep: Deployment) -> int:
    status, _ = request_json(
        "127.0.0.1",
        dep.config.port,
        "POST",
        "/v1/completions",
        {"model": "m", "prompt": "hello there", "max_tokens": 3},
    )
    return status


def health(dep: Deployment) -> tuple[int, Any]:
    return request_json("127.0.0.1", dep.config.port, "GET", "/health")


def test_registered_workers_serve_and_a_deregistered_one_leaves_at_once(tmp_path: Path, shm_prefix: str) -> None:
    with cluster(tmp_path, shm_prefix) as (dep, etcd, name), sims() as started:
        status, body = health(dep)
        assert status == 503 and "minimal_instances" in body["message"]  # nothing registered yet
        started += [Sim(etcd.uri, name, "context"), Sim(etcd.uri, name, "generation")]
        wait_until(lambda: health(dep)[0] == 200, 30, "both roles registered and healthy")
        assert complete(dep) == 200
        keys = etcd.etcdctl("get", "--prefix", "--keys-only", worker_key_prefix(name)).split()
        assert len(keys) == 2 and all(k.startswith(f"{worker_key_prefix(name)}/") for k in keys)
        gen = started[1]
        gen.stop(signal.SIGTERM)  # trtllm-serve deletes its key at shutdown
        assert gen.proc.returncode is not None
        # well within the lease (TTL s): the DELETE event, not the expiry
        wait_until(lambda: not [s for s in servers(dep) if s["role"] == "generation"], TTL - 1, "generation removed")
        status, body = health(dep)
        assert status == 503 and "generation 0 of 1" in body["message"]
        assert coordinator_info(dep)["disagg_cluster"]["leaves"] == 1


def test_requests_wait_for_minimal_instances_as_upstreams_readiness_gate(tmp_path: Path, shm_prefix: str) -> None:
    """TensorRT-LLM refuses every request while `is_ready()` is false (fewer prepared servers
    than minimal_instances), not only /health: one context server of the two asked for is not
    enough to serve."""
    with cluster(tmp_path, shm_prefix, minimal={"context_servers": 2}) as (dep, etcd, name), sims() as started:
        started += [Sim(etcd.uri, name, "context"), Sim(etcd.uri, name, "generation")]
        wait_until(lambda: len(healthy(dep, "context")) == 1 and len(healthy(dep, "generation")) == 1, 30, "one each")
        status, body = request_json(
            "127.0.0.1", dep.config.port, "POST", "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2}
        )
        assert status == 503 and body["code"] == 503 and body["object"] == "error"
        assert body["message"].startswith("Cluster is not ready: fewer healthy servers than")
        assert "context 1 of 2" in body["message"] and "generation" not in body["message"]
        assert health(dep)[0] == 503
        started.append(Sim(etcd.uri, name, "context"))
        wait_until(lambda: health(dep)[0] == 200, 30, "the second context server")
        assert complete(dep) == 200


def test_a_killed_worker_leaves_when_its_lease_expires(tmp_path: Path, shm_prefix: str) -> None:
    with cluster(tmp_path, shm_prefix) as (dep, etcd, name), sims() as started:
        started += [Sim(etcd.uri, name, "context"), Sim(etcd.uri, name, "generation")]
        wait_until(lambda: health(dep)[0] == 200, 30, "ready")
        started[0].stop(signal.SIGKILL)  # no deregistration: only the lease can tell
        killed = time.monotonic()
        wait_until(lambda: not [s for s in servers(dep) if s["role"] == "context"], TTL + 10, "context removed")
        assert time.monotonic() - killed >= TTL - 1.5  # removed by the lease expiring, not by anything else
        assert etcd.etcdctl("get", "--prefix", "--keys-only", worker_key_prefix(name)).split().__len__() == 1


def test_a_key_deleted_in_etcd_removes_its_server(tmp_path: Path, shm_prefix: str) -> None:
    with cluster(tmp_path, shm_prefix) as (dep, etcd, name), sims() as started:
        started += [Sim(etcd.uri, name, "context"), Sim(etcd.uri, name, "generation")]
        wait_until(lambda: health(dep)[0] == 200, 30, "ready")
        key = next(
            k for k in etcd.etcdctl("get", "--prefix", "--keys-only", worker_key_prefix(name)).split() if "CONTEXT" in k
        )
        etcd.etcdctl("del", key)
        wait_until(lambda: not [s for s in servers(dep) if s["role"] == "context"], 5, "context removed")


def test_re_registering_an_address_makes_a_new_server_and_the_old_lease_does_not_remove_it(
    tmp_path: Path, shm_prefix: str
) -> None:
    port = free_port()
    with cluster(tmp_path, shm_prefix) as (dep, etcd, name), sims() as started:
        started += [Sim(etcd.uri, name, "context", port), Sim(etcd.uri, name, "generation")]
        wait_until(lambda: health(dep)[0] == 200, 30, "ready")
        (old,) = [s for s in servers(dep) if s["role"] == "context"]
        started[0].stop(signal.SIGKILL)  # its key lives on until the lease expires
        started.append(Sim(etcd.uri, name, "context", port))  # a restart on the same address
        wait_until(lambda: coordinator_info(dep)["disagg_cluster"]["replaced"] == 1, 15, "the address re-registered")
        (new,) = [s for s in servers(dep) if s["role"] == "context"]
        assert new["addr"] == old["addr"] and new["slot"] != old["slot"]  # a new server, not the old slot
        # the dead process's key expires; the new registration of the same address stays
        wait_until(
            lambda: len(etcd.etcdctl("get", "--prefix", "--keys-only", worker_key_prefix(name)).split()) == 2,
            TTL + 10,
            "the old key expired",
        )
        wait_until(lambda: healthy(dep, "context") == [old["addr"]], 10, "the new context server healthy")
        assert complete(dep) == 200


def test_an_etcd_restart_keeps_serving_the_last_known_executors(tmp_path: Path, shm_prefix: str) -> None:
    with cluster(tmp_path, shm_prefix) as (dep, etcd, name), sims() as started:
        started += [Sim(etcd.uri, name, "context"), Sim(etcd.uri, name, "generation")]
        wait_until(lambda: health(dep)[0] == 200, 30, "ready")
        leases = key_leases(etcd, name)
        etcd.stop()
        wait_until(lambda: not coordinator_info(dep)["disagg_cluster"]["store_connected"], 10, "the watch noticed")
        for _ in range(5):
            assert complete(dep) == 200  # the executors it knew still serve
        assert len(servers(dep)) == 2
        etcd.start()  # same data directory: the workers' keys (and leases) are back
        wait_until(lambda: coordinator_info(dep)["disagg_cluster"]["store_connected"], 20, "the watch back")
        assert coordinator_info(dep)["disagg_cluster"]["store_resyncs"] >= 1
        # a lease of TTL granted now outlives every lease etcd restored (their TTLs restart at the
        # restart): once it expired, a worker key whose lease nobody refreshed would be gone
        probe = etcd.etcdctl("lease", "grant", str(TTL)).split()[1]
        wait_until(lambda: "expired" in etcd.etcdctl("lease", "timetolive", probe), TTL + 20, "a lease's TTL")
        assert set(key_leases(etcd, name)) >= set(leases)  # the workers' keys are all still there...
        assert coordinator_info(dep)["disagg_cluster"]["leaves"] == 0 and len(servers(dep)) == 2  # ...and never left
        started.append(Sim(etcd.uri, name, "generation"))  # registrations after the restart are seen
        wait_until(lambda: len(healthy(dep, "generation")) == 2, 30, "a new generation server")
        assert complete(dep) == 200


def test_etcd_unreachable_at_start_is_one_clear_line(tmp_path: Path, shm_prefix: str) -> None:
    dead = f"etcd://127.0.0.1:{free_port()}"
    path = cluster_config(tmp_path, shm_prefix, dead, "x")
    out = subprocess.run(
        [sys.executable, "-m", "shmdisagg.coordinator", "-c", str(path)], cwd=REPO, capture_output=True, timeout=60
    )
    assert out.returncode == 1
    lines = [line for line in out.stderr.decode().splitlines() if line.startswith("shmdisagg:")]
    assert len(lines) == 1  # one line, no traceback
    assert lines[0].startswith(
        f"shmdisagg: coordinator failed to start: disagg_cluster.cluster_uri: etcd at {dead} does not answer ("
    )
    assert "Traceback" not in out.stderr.decode()


@contextlib.contextmanager
def silent_workers(n: int) -> Iterator[list[WorkerInfo]]:
    """n registrations at addresses where nothing listens, for the test's whole length: each port
    is held bound but not listening, so a probe is refused and no other server (this test's own
    deployment or etcd, or another test's) can take it. Fixed ports (20000 + i) could be this
    deployment's: a generation leg then went to its own public port and came back 400."""
    held = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(s)
            s.bind(("127.0.0.1", free_port()))
        ports = [s.getsockname()[1] for s in held]
        yield [WorkerInfo(new_worker_id(1, "127.0.0.1", port), "127.0.0.1", port, 1) for port in ports]
    finally:
        for s in held:
            s.close()


def test_a_flood_of_registrations_fills_the_table_and_the_rest_wait_for_a_free_slot(
    tmp_path: Path, shm_prefix: str
) -> None:
    with cluster(tmp_path, shm_prefix) as (dep, etcd, name), silent_workers(80) as workers:
        register_all(etcd, name, workers)
        # the puts are separate writes, so the watch may still be delivering the last ones when
        # the table is full: wait for all 80 to be seen, then check where each one went
        wait_until(lambda: len(servers(dep)) + len(coordinator_info(dep)["disagg_cluster"]["pending"]) == 80,
                   20, "all 80 registrations seen")  # fmt: skip
        info = coordinator_info(dep)["disagg_cluster"]
        assert len(servers(dep)) == 64 and len(info["pending"]) == 16 and info["waited"] == 16
        for w in workers[:20]:  # 20 leave: the 16 waiting take their slots (no leg ever ran on them)
            etcd.etcdctl("del", worker_key(name, w.worker_id))
        # the pending list empties once 16 slots are free, while the watch may still be delivering
        # the last deletions: wait for the table to hold exactly the 60 that stayed
        stayed = sorted(w.addr for w in workers[20:])
        wait_until(lambda: sorted(s["addr"] for s in servers(dep)) == stayed, 20, "the 60 that stayed in the table")
        assert not coordinator_info(dep)["disagg_cluster"]["pending"]  # the 16 waiting ones were admitted


def test_workers_join_and_leave_under_load_and_only_requests_on_a_killed_one_fail(
    tmp_path: Path, shm_prefix: str
) -> None:
    with cluster(tmp_path, shm_prefix) as (dep, etcd, name), sims() as started:
        started += [Sim(etcd.uri, name, "context"), Sim(etcd.uri, name, "generation")]
        wait_until(lambda: health(dep)[0] == 200, 30, "ready")
        results: list[tuple[float, int, Any]] = []  # (when the request was sent, status, body)
        done = threading.Event()

        def load() -> None:
            while not done.is_set():
                sent = time.monotonic()
                status, body = request_json(
                    "127.0.0.1", dep.config.port, "POST", "/v1/completions",
                    {"model": "m", "prompt": "hello there", "max_tokens": 8},
                )  # fmt: skip
                results.append((sent, status, body))

        def more(n: int) -> None:
            before = len(results)
            wait_until(lambda: len(results) > before + n, 30, f"{n} more requests")

        threads = [threading.Thread(target=load) for _ in range(4)]
        for t in threads:
            t.start()
        killed_at = float("inf")
        try:
            started += [Sim(etcd.uri, name, "context"), Sim(etcd.uri, name, "generation")]  # two join
            wait_until(lambda: len(healthy(dep, "context")) == 2 and len(healthy(dep, "generation")) == 2, 30, "joined")
            more(20)
            started[0].stop(signal.SIGTERM)  # two leave, gracefully: nothing may fail
            started[1].stop(signal.SIGTERM)
            wait_until(lambda: len(servers(dep)) == 2, 10, "left")
            more(20)
            started.append(Sim(etcd.uri, name, "generation"))
            wait_until(lambda: len(healthy(dep, "generation")) == 2, 30, "a third generation executor")
            more(20)
            killed_at = time.monotonic()
            started[3].stop(signal.SIGKILL)  # one is killed: only requests already on it may fail
            wait_until(lambda: len(healthy(dep, "generation")) == 1, 10, "the killed one out of rotation")
            more(20)
        finally:
            done.set()
            for t in threads:
                t.join()
        failed = [(sent, status, body) for sent, status, body in results if status != 200]
        assert [f for f in failed if f[0] >= killed_at] == []  # every failure was in flight when it died...
        assert len(failed) <= len(threads)  # ...and each client had at most one in flight
        assert sum(1 for sent, _, _ in results if sent >= killed_at) >= 20


def test_launch_starts_executors_that_register_through_etcd(tmp_path: Path, shm_prefix: str) -> None:
    name = f"l{uuid.uuid4().hex[:6]}"
    with etcd_server(tmp_path) as etcd:
        path = cluster_config(
            tmp_path,
            shm_prefix,
            etcd.uri,
            name,
            context_servers={"num_instances": 2, "router": {"type": "kv_cache_aware"}},
            generation_servers={"num_instances": 1, "router": {"type": "load_balancing"}},
        )
        data = yaml.safe_load(path.read_text())
        data["shmdisagg"]["executors"] = {"backend": "sim", "sim": {"speedup": 10.0}}
        path.write_text(yaml.safe_dump(data))
        dep = Deployment(load_config(path), str(path), str(tmp_path / "logs"))
        dep.start()  # returns once they registered and /health is ready
        try:
            assert health(dep)[0] == 200
            keys = etcd.etcdctl("get", "--prefix", "--keys-only", worker_key_prefix(name)).split()
            assert sorted(k.split("/")[-1].split("-")[0] for k in keys) == ["CONTEXT", "CONTEXT", "GENERATION"]
            wait_until(lambda: len(healthy(dep, "context")) == 2, 20, "both context executors healthy")
            assert all(not s["addr"].endswith(":0") for s in servers(dep))  # the ports they bound
            assert complete(dep) == 200
        finally:
            dep.stop()
        assert etcd.etcdctl("get", "--prefix", "--keys-only", worker_key_prefix(name)).split() == []  # deregistered


def test_a_restarted_coordinator_keeps_the_registered_executors_in_their_slots(tmp_path: Path, shm_prefix: str) -> None:
    with cluster(tmp_path, shm_prefix) as (dep, etcd, name), sims() as started:
        started += [Sim(etcd.uri, name, "context"), Sim(etcd.uri, name, "generation")]
        wait_until(lambda: health(dep)[0] == 200, 30, "ready")
        before = {(s["slot"], s["addr"]) for s in servers(dep)}
        kill_coordinator_and_serve_meanwhile(dep)  # the keeper's replacement adopts the table
        info = coordinator_info(dep)["disagg_cluster"]
        assert {(s["slot"], s["addr"]) for s in servers(dep)} == before and info["leaves"] == 0
        assert complete(dep) == 200
        started[1].stop(signal.SIGTERM)  # the new coordinator bound the keys again: a deregistration counts
        wait_until(lambda: [s["role"] for s in servers(dep)] == ["context"], TTL - 1, "generation removed")


def test_a_table_of_128_slots_holds_registrations_past_64_through_a_coordinator_restart(
    tmp_path: Path, shm_prefix: str
) -> None:
    with (
        cluster(tmp_path, shm_prefix, shm={"max_servers": 128}) as (dep, etcd, name),
        sims() as started,
        silent_workers(130) as workers,
    ):
        started += [Sim(etcd.uri, name, "context"), Sim(etcd.uri, name, "generation")]
        wait_until(lambda: health(dep)[0] == 200, 30, "ready")
        # 130 more registrations (nothing listens there: they are never healthy): 126 fill the
        # table, 4 wait for a slot
        register_all(etcd, name, workers)
        # separate writes: the watch may still be delivering the last ones once the table is
        # full, so wait for all 132 registrations to be seen before checking where each went
        wait_until(lambda: len(servers(dep)) + len(coordinator_info(dep)["disagg_cluster"]["pending"]) == 132,
                   30, "all 132 registrations seen")  # fmt: skip
        assert len(servers(dep)) == 128 and len(coordinator_info(dep)["disagg_cluster"]["pending"]) == 4
        before = {(s["slot"], s["addr"]) for s in servers(dep)}
        assert {slot for slot, _ in before} == set(range(128))
        table_inode = os.stat(f"/dev/shm/{shm_prefix}-ctl").st_ino
        kill_coordinator_and_serve_meanwhile(dep)  # the replacement adopts the 128-slot table
        wait_until(lambda: len(coordinator_info(dep)["disagg_cluster"]["pending"]) == 4, 30, "the store listed again")
        assert {(s["slot"], s["addr"]) for s in servers(dep)} == before
        assert coordinator_info(dep)["disagg_cluster"]["leaves"] == 0
        assert os.stat(f"/dev/shm/{shm_prefix}-ctl").st_ino == table_inode  # adopted, not made afresh
        assert complete(dep) == 200
