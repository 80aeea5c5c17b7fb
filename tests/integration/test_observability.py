"""Observability of a running deployment (the demo's shape: 2 context + 2 generation simulated
executors, 2 fleet workers): `shmdisagg stats` snapshots move under load, a `/metrics` scrape on
any worker counts exactly what a bench sent, `/perf_metrics` has a joined record for every
request, and `disagg_request_id`s stay unique across workers and a worker restart."""

from __future__ import annotations

import glob
import http.client
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shmdisagg.launch import Deployment
from tests.conftest import free_port
from tests.integration.harness import REPO, connection_to_worker, deployment, request_json, wait_until, write_config

MODEL = "sim-llama-3.1-8b"


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    prefix = f"shmdisagg-t{uuid.uuid4().hex[:10]}"
    tmp: Path = tmp_path_factory.mktemp("observability")
    ctx = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    gen = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    cfg = write_config(
        tmp,
        prefix,
        ctx,
        gen,
        routers=({"type": "load_balancing", "use_tokens": True}, "load_balancing"),
        perf_metrics_max_requests=10_000,  # 0, the default, keeps no /perf_metrics record
        shmdisagg={"executors": {"backend": "sim", "model": MODEL, "sim": {"speedup": 20.0, "num_blocks": 4096}}},
    )
    with deployment(cfg) as d:
        wait_until(lambda: serving(d, 0) and serving(d, 1), timeout_s=60, what="both fleet workers serving")
        yield d
    assert glob.glob(f"/dev/shm/{prefix}*") == []


def serving(dep: Deployment, index: int) -> bool:
    """Fleet worker `index` answers (the deployment is up once any worker answers /health)."""
    try:
        connection_to_worker(dep, index, attempts=20).close()
        return True
    except (AssertionError, OSError):
        return False


def completion(conn: http.client.HTTPConnection, i: int, stream: bool = False) -> tuple[int, int]:
    """(status, x-disagg-request-id) of one request; prompts share a prefix so the cache hits."""
    body = {"model": MODEL, "prompt": list(range(1000, 1256)) + [5000 + i], "max_tokens": 6, "stream": stream}
    conn.request("POST", "/v1/completions", body=orjson.dumps(body), headers={"content-type": "application/json"})
    r = conn.getresponse()
    r.read()
    return r.status, int(r.getheader("x-disagg-request-id") or 0)


def scrape(conn: http.client.HTTPConnection) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    conn.request("GET", "/metrics")
    r = conn.getresponse()
    text = r.read().decode()
    assert r.status == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def by_role(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, role: str) -> float:
    return sum(v for (n, labels), v in metrics.items() if n == name and ("role", role) in labels)


def stats_once(dep: Deployment, interval: float = 0.3) -> dict[str, Any]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "shmdisagg.cli",
            "stats",
            "-c",
            str(dep.config_path),
            "--once",
            "--json",
            "--interval",
            str(interval),
        ],
        capture_output=True,
        cwd=REPO,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr.decode()
    return orjson.loads(out.stdout)  # type: ignore[no-any-return]


class Load:
    """Requests sent continuously on one keep-alive connection to each fleet worker."""

    def __init__(self, dep: Deployment) -> None:
        self.conns = [connection_to_worker(dep, i) for i in range(2)]
        self.stop = threading.Event()
        self.sent = 0
        self.threads = [threading.Thread(target=self._run, args=(c,)) for c in self.conns]

    def _run(self, conn: http.client.HTTPConnection) -> None:
        while not self.stop.is_set():
            status, _ = completion(conn, self.sent)
            assert status == 200
            self.sent += 1

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()
        for c in self.conns:
            c.close()


def test_stats_snapshots_show_the_numbers_moving(dep: Deployment) -> None:
    first = stats_once(dep)
    with Load(dep) as load:
        wait_until(lambda: load.sent >= 20, what="some load")
        second = stats_once(dep)
    c1, c2 = first["coordinator"], second["coordinator"]
    assert c1["incarnation"] == c2["incarnation"] and c2["state"] == "running" and c2["heartbeat_age_s"] < 2.0
    assert second["requests"]["total_requests"] > first["requests"]["total_requests"]
    assert second["requests"]["requests_per_s"] > 0 and second["fleet"]["legs_per_s"] > 0
    routed1 = {s["addr"]: s["routed"] for s in first["servers"]}
    for role in ("context", "generation"):
        servers = [s for s in second["servers"] if s["role"] == role]
        assert len(servers) == 2 and all(s["healthy"] for s in servers)
        assert sum(s["routed"] for s in servers) > sum(routed1[s["addr"]] for s in servers)
        assert any(s["routed_per_s"] for s in servers)
    assert any(s["hit_rate"] for s in second["servers"] if s["role"] == "context")  # the shared prefix is reused
    workers1 = {w["pid"]: w for w in first["workers"]}
    assert len(second["workers"]) == 2
    for w in second["workers"]:  # each worker got a connection of its own
        assert w["heartbeat_age_s"] < 2.0
        assert w["requests"] > workers1[w["pid"]]["requests"] and w["requests_per_s"] > 0
        assert w["legs_dispatched"] > workers1[w["pid"]]["legs_dispatched"]
    if second["index"] is not None:
        assert second["index"]["generation"] >= 1 and second["index"]["capacity"] > 0


def test_a_scrape_on_any_worker_counts_what_the_bench_sent(dep: Deployment, tmp_path: Path) -> None:
    c = http.client.HTTPConnection("127.0.0.1", dep.config.port, timeout=30)
    before = scrape(c)
    c.close()
    n = 40
    seen_during: list[float] = []
    done = threading.Event()

    def watch() -> None:
        c = http.client.HTTPConnection("127.0.0.1", dep.config.port, timeout=30)
        while not done.is_set():
            seen_during.append(scrape(c)[("total_requests_total", ())])
        c.close()

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "shmdisagg.bench",
                "--url",
                f"http://127.0.0.1:{dep.config.port}",
                "--input-len",
                "128",
                "--output-len",
                "8",
                "--concurrency",
                "4",
                "--num-requests",
                str(n),
                "--no-progress",
                "--json",
                str(tmp_path / "run.json"),
                "--records",
                str(tmp_path / "records.jsonl"),
                "--plot",
                str(tmp_path / "plots"),
            ],
            capture_output=True,
            cwd=REPO,
            timeout=300,
        )
    finally:
        done.set()
        watcher.join()
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    run = orjson.loads((tmp_path / "run.json").read_bytes())
    assert run["requests"]["completed"] == n
    assert run["timeline"]["server_load"] is not None  # sampled from this deployment's /metrics
    assert (tmp_path / "plots" / "server_load.png").exists()

    base = before[("total_requests_total", ())]
    assert seen_during and all(base <= v <= base + n for v in seen_during)
    assert seen_during == sorted(seen_during)
    for worker in range(2):  # whichever worker answers, the counts are the fleet's
        conn = connection_to_worker(dep, worker)
        after = scrape(conn)
        conn.close()
        for name in (
            "total_requests_total",
            "stream_requests_total",
            "total_responses_total",
            "ctx_total_requests_total",
            "ctx_completed_requests_total",
            "gen_total_requests_total",
            "gen_completed_requests_total",
        ):
            assert after[(name, ())] - before[(name, ())] == n, name
        for role in ("context", "generation"):
            decisions = by_role(after, "shmdisagg_routing_decisions_total", role) - by_role(
                before, "shmdisagg_routing_decisions_total", role
            )
            assert decisions == n
            assert (
                by_role(after, "shmdisagg_server_routed_total", role)
                - by_role(before, "shmdisagg_server_routed_total", role)
                == n
            )
            assert by_role(after, "shmdisagg_server_active_requests", role) == 0
        assert (
            after[("shmdisagg_orchestrator_overhead_seconds_count", ())]
            - before[("shmdisagg_orchestrator_overhead_seconds_count", ())]
            == n
        )
        assert after[("shmdisagg_fleet_workers", ())] == 2

    # /perf_metrics: a joined record for every request the bench sent
    ids = {orjson.loads(line)["request_id"] for line in (tmp_path / "records.jsonl").read_bytes().splitlines()}
    assert len(ids) == n and None not in ids
    records = collect_perf_records({int(i) for i in ids}, dep)
    for rec in records.values():
        assert rec["ctx_perf_metrics"] is not None and rec["gen_perf_metrics"] is not None
        assert rec["stream"] is True and rec["status"] == 200


def collect_perf_records(ids: set[int], dep: Deployment) -> dict[int, dict[str, Any]]:
    """Drain /perf_metrics (from either worker) until it returned a record for every id."""
    got: dict[int, dict[str, Any]] = {}

    def poll() -> bool:
        status, recs = request_json("127.0.0.1", dep.config.port, "GET", "/perf_metrics")
        assert status == 200
        got.update({r["disagg_request_id"]: r for r in recs if r["disagg_request_id"] in ids})
        return ids <= got.keys()

    wait_until(poll, timeout_s=30, what="a perf record for every request")
    return got


def test_perf_metrics_has_a_joined_record_for_every_request(dep: Deployment) -> None:
    ids = []
    addrs = set(dep.config.context_servers.urls) | set(dep.config.generation_servers.urls)
    for w in range(2):
        conn = connection_to_worker(dep, w)
        for i in range(6):
            status, rid = completion(conn, i, stream=bool(i % 2))
            assert status == 200 and rid
            ids.append(rid)
        conn.close()
    assert len(set(ids)) == len(ids)
    records = collect_perf_records(set(ids), dep)
    workers = set()
    for rid in ids:
        r = records[rid]
        workers.add(r["fleet_worker"])
        assert r["ctx_server"] in addrs and r["gen_server"] in addrs
        times = [
            r[k]
            for k in (
                "disagg_server_arrival_time",
                "disagg_ctx_dispatch_time",
                "disagg_ctx_done_time",
                "disagg_gen_dispatch_time",
                "disagg_server_first_token_time",
                "disagg_server_last_token_time",
            )
        ]
        assert all(t is not None for t in times) and times == sorted(times)
        ctx, gen = r["ctx_perf_metrics"], r["gen_perf_metrics"]
        assert ctx["ctx_request_id"] == rid and gen["ctx_request_id"] == rid
        # one timebase: the executors' steady-clock stamps fall inside our dispatch..last-token window
        assert (
            r["disagg_ctx_dispatch_time"] - 0.05
            <= ctx["perf_metrics"]["timing_metrics"]["arrival_time"]
            <= r["disagg_ctx_done_time"] + 0.05
        )
        assert r["prompt_tokens"] >= 257 and r["cached_tokens"] >= 0 and r["retries"] == 0
    assert workers == {0, 1}
    # drained: a second read does not return them again; ?keep=true reads without draining
    status, again = request_json("127.0.0.1", dep.config.port, "GET", "/perf_metrics?keep=true")
    assert status == 200 and not set(ids) & {r["disagg_request_id"] for r in again}


def test_request_ids_stay_unique_across_workers_and_a_worker_restart(dep: Deployment) -> None:
    def ids_from(worker: int, n: int) -> tuple[list[int], int]:
        conn = connection_to_worker(dep, worker)
        pid = request_json("", 0, "GET", "/cluster_info", conn=conn)[1]["worker_pid"]
        out = [completion(conn, i) for i in range(n)]
        conn.close()
        assert all(status == 200 for status, _ in out)
        return [rid for _, rid in out], pid

    first0, pid0 = ids_from(0, 5)
    first1, _ = ids_from(1, 5)
    conn = http.client.HTTPConnection("127.0.0.1", dep.config.port, timeout=30)
    before = scrape(conn)[("total_requests_total", ())]
    conn.close()
    os.kill(pid0, signal.SIGKILL)

    def restarted() -> bool:
        try:
            status, info = request_json("127.0.0.1", dep.config.port, "GET", "/cluster_info")
        except OSError:  # a connection the kernel handed to the dying worker
            return False
        return status == 200 and pid0 not in info["fleet_pids"] and len(info["fleet_pids"]) == 2

    wait_until(restarted, what="a replacement for fleet worker 0")
    again0, new_pid0 = ids_from(0, 5)
    assert new_pid0 != pid0
    all_ids = first0 + first1 + again0
    assert len(set(all_ids)) == len(all_ids)
    # TensorRT-LLM's snowflake layout: process_id (6 bits) above the 10-bit counter is the worker index
    assert {((rid - (1 << 40)) >> 10) & 63 for rid in first0 + again0} == {0}
    assert {((rid - (1 << 40)) >> 10) & 63 for rid in first1} == {1}
    # the dead worker's counts were folded, not lost: exactly the 5 new requests were added
    conn = http.client.HTTPConnection("127.0.0.1", dep.config.port, timeout=30)
    assert scrape(conn)[("total_requests_total", ())] == before + 5
    conn.close()
    # /cluster_info on the public port shows the deployment
    status, info = request_json("127.0.0.1", dep.config.port, "GET", "/cluster_info")
    assert (
        status == 200
        and info["is_ready"]
        and set(info["server_lists"]["context"]) == set(dep.config.context_servers.urls)
    )
