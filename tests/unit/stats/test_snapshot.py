"""`shmdisagg stats` reads a deployment read-only and turns two reads into rates."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from shmdisagg.metrics.rows import MetricsSegment, worker_row
from shmdisagg.metrics.schema import LAYOUT
from shmdisagg.shm.index import BlockIndex, IndexSettings
from shmdisagg.shm.table import ROLE_CONTEXT, ROLE_GENERATION, ControlTable, process_starttime
from shmdisagg.stats.snapshot import NotRunning, StatsReader, snapshot

PID = os.getpid()
C = LAYOUT.counter


@pytest.fixture
def live(shm_prefix: str) -> Iterator[tuple[ControlTable, ControlTable, MetricsSegment]]:
    coord = ControlTable.create(shm_prefix, max_workers=4)
    coord.set_coordinator(PID, process_starttime(PID), 0xABC)
    coord.coord_heartbeat()
    coord.publish_server(0, "127.0.0.1:1001", ROLE_CONTEXT, True)
    coord.publish_server(1, "127.0.0.1:2001", ROLE_GENERATION, True)
    worker = ControlTable.attach(shm_prefix)
    segment = MetricsSegment.create(shm_prefix, num_workers=1)
    yield coord, worker, segment
    segment.close()
    worker.close()
    coord.unlink()
    coord.close()


def test_two_samples_give_counters_and_rates(live, shm_prefix: str) -> None:  # type: ignore[no-untyped-def]
    coord, worker, segment = live
    row = worker.claim_row(PID, process_starttime(PID))
    worker.heartbeat(row)
    mrow = segment.row(worker_row(0))
    mrow[LAYOUT.pid] = PID
    with StatsReader(shm_prefix) as reader:
        first = reader.sample()
        for _ in range(4):
            worker.pick_round_robin(row, ROLE_CONTEXT, -1, 100)
            mrow[C["total_requests"]] += 1
        worker.release(row, 0, 100)
        mrow[C["nonstream_requests"]] += 1
        mrow[LAYOUT.per_server["shmdisagg_server_prompt_tokens"]] += 400
        mrow[LAYOUT.per_server["shmdisagg_server_cached_tokens"]] += 100
        second = reader.sample()
    second.t_ns = first.t_ns + 2_000_000_000  # a 2 s window, whatever the test machine's speed
    snap = snapshot(first, second, shm_prefix)

    assert snap["coordinator"]["pid"] == PID and snap["coordinator"]["incarnation"] == 0xABC
    assert snap["coordinator"]["state"] == "starting"
    ctx = next(s for s in snap["servers"] if s["slot"] == 0)
    assert ctx["role"] == "context" and ctx["healthy"] and ctx["active_requests"] == 3 and ctx["active_tokens"] == 300
    assert ctx["routed"] == 4 and ctx["routed_per_s"] == 2.0
    assert ctx["hit_rate"] == 0.25 and ctx["kv_blocks"] is None
    (w,) = snap["workers"]
    assert w["pid"] == PID and w["legs_in_flight"] == 3 and w["legs_per_s"] == 0.5
    assert w["requests"] == 4 and w["requests_per_s"] == 2.0 and w["requests_in_flight"] == 3
    assert snap["fleet"]["legs_dispatched"] == 4 and snap["requests"]["total_requests"] == 4
    assert snap["requests"]["hit_rate"] == 0.25
    assert snap["index"] is None  # no block index published in this table


def test_the_reader_maps_read_only(live, shm_prefix: str) -> None:  # type: ignore[no-untyped-def]
    with StatsReader(shm_prefix) as reader:
        with pytest.raises(TypeError):
            reader.table._segment.mm[0] = 0  # PROT_READ: the mapping refuses stores
        assert reader.metrics is not None
        with pytest.raises(TypeError):
            reader.metrics.row(0)[0] = 1.0
        assert reader.alive()


def test_no_deployment_is_not_running(shm_prefix: str) -> None:
    with pytest.raises(NotRunning):
        StatsReader(shm_prefix)


def test_a_first_snapshot_has_no_rates(live, shm_prefix: str) -> None:  # type: ignore[no-untyped-def]
    with StatsReader(shm_prefix) as reader:
        snap = snapshot(None, reader.sample(), shm_prefix)
    assert snap["interval_s"] is None and all(s["routed_per_s"] is None for s in snap["servers"])


def test_kv_blocks_per_server_follow_the_events_and_survive_a_resize(live, shm_prefix: str) -> None:  # type: ignore[no-untyped-def]
    coord, _, _ = live
    index = BlockIndex.create(coord, IndexSettings(capacity=1 << 10, max_capacity=1 << 14, grace_s=0.0))
    try:
        index.apply_stored(0, [11, 12, 13])
        index.apply_stored(1, [11, 21])  # block 11 is on both servers
        index.apply_removed(0, [13])
        with StatsReader(shm_prefix) as reader:
            first = reader.sample()
            blocks = {s["slot"]: s["kv_blocks"] for s in snapshot(None, first, shm_prefix)["servers"]}
            assert blocks == {0: 2, 1: 2}
            index.resize(1 << 12)  # a new generation: the reader maps the published one
            index.apply_stored(1, [22])
            second = reader.sample()
            blocks = {s["slot"]: s["kv_blocks"] for s in snapshot(first, second, shm_prefix)["servers"]}
            assert blocks == {0: 2, 1: 3}
    finally:
        index.close()


def test_cancelled_requests_are_counted_and_the_parts_add_up_to_the_total(live, shm_prefix: str) -> None:  # type: ignore[no-untyped-def]
    _, worker, segment = live
    row = segment.row(worker_row(0))
    row[LAYOUT.pid] = PID
    row[C["total_requests"]] = 168
    row[C["nonstream_requests"]] = 139  # routed and ended: 136 answered, 3 whose client went away
    row[C["total_responses"]] = 136
    row[C["shmdisagg_client_disconnects"]] = 3
    row[C["validation_exceptions"]] = 29
    with StatsReader(shm_prefix) as reader:
        req = snapshot(None, reader.sample(), shm_prefix)["requests"]
    assert req["cancelled"] == 3 and req["failed"] == 0 and req["lost"] == 0 and req["in_flight"] == 0
    parts = (
        "in_flight",
        "total_responses",
        "cancelled",
        "failed",
        "client_errors",
        "shmdisagg_admission_rejections",
        "lost",
    )
    assert sum(req[p] for p in parts) == req["total_requests"] == 168
    # 7 more routed requests end in error answers: 5 an executor's 4xx, 2 a 502
    row[C["total_requests"]] += 7
    row[C["nonstream_requests"]] += 7
    row[C["http_exceptions"]] = 7
    row[C["shmdisagg_routed_client_errors"]] = 5
    with StatsReader(shm_prefix) as reader:
        req = snapshot(None, reader.sample(), shm_prefix)["requests"]
    assert req["client_errors"] == 29 + 5 and req["failed"] == 2
    assert sum(req[p] for p in parts) == req["total_requests"] == 175


def test_workers_are_numbered_as_the_coordinator_numbers_them(live, shm_prefix: str) -> None:  # type: ignore[no-untyped-def]
    coord, worker, _ = live
    segment = MetricsSegment.create(f"{shm_prefix}x", num_workers=3)  # a fleet of 3 in its own segment
    try:
        row = worker.claim_row(PID, process_starttime(PID))  # the first free table row
        segment.row(worker_row(2))[LAYOUT.pid] = PID  # ...taken by "fleet worker 2"
        with StatsReader(shm_prefix) as reader:
            reader.metrics, own = segment, reader.metrics
            (w,) = snapshot(None, reader.sample(), shm_prefix)["workers"]
            reader.metrics = own
    finally:
        segment.close()
        import glob

        for path in glob.glob(f"/dev/shm/{shm_prefix}x*"):
            os.unlink(path)
    assert w["worker"] == 2 and w["row"] == row and w["pid"] == PID and w["alive"] is True


def test_a_dead_coordinator_makes_the_snapshot_stale(live, shm_prefix: str) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    coord, _, _ = live
    with StatsReader(shm_prefix) as reader:
        assert snapshot(None, reader.sample(), shm_prefix)["state"] == "starting"  # this process: alive
        coord.set_coord_state(1)
        snap = snapshot(None, reader.sample(), shm_prefix)
        assert snap["state"] == snap["coordinator"]["state"] == "running" and snap["coordinator"]["alive"] is True

        proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
        dead, starttime = proc.pid, process_starttime(proc.pid)
        proc.communicate()  # it exits and is reaped: its pid is gone
        coord.set_coordinator(dead, starttime, 0xABD)
        snap = snapshot(None, reader.sample(), shm_prefix)
        assert snap["state"] == snap["coordinator"]["state"] == "stale" and snap["coordinator"]["alive"] is False
        assert (
            snap["stale_reason"]
            == f"coordinator pid {dead} is gone: stale segments; the next `shmdisagg launch` or `shmdisagg "
            "serve` of this deployment removes them"
        )

        coord.set_coordinator(PID, process_starttime(PID) + 1, 0xABE)  # the pid, reused by another process
        snap = snapshot(None, reader.sample(), shm_prefix)
        assert snap["state"] == "stale" and "now belongs to another process" in snap["stale_reason"]
