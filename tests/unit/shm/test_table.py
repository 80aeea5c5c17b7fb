"""ControlTable semantics in one process: server table, coordinator line, rows, picks, release."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from shmdisagg.shm import (
    ROLE_CONTEXT,
    ROLE_GENERATION,
    ControlTable,
    RowLost,
    ServerInfo,
    process_starttime,
)
from shmdisagg.shm.layout import COORD_RUNNING

PID = os.getpid()


@pytest.fixture
def coord(shm_prefix: str) -> Iterator[ControlTable]:
    table = ControlTable.create(shm_prefix, max_workers=16)
    yield table
    table.unlink()
    table.close()


@pytest.fixture
def worker(coord: ControlTable) -> Iterator[ControlTable]:
    table = ControlTable.attach(coord.prefix)
    yield table
    table.close()


def three_context_servers(coord: ControlTable) -> None:
    for slot in range(3):
        coord.publish_server(slot, f"127.0.0.1:{8001 + slot}", ROLE_CONTEXT, True)


def test_published_servers_read_back_consistently(coord: ControlTable, worker: ControlTable) -> None:
    v0 = worker.servers_version()
    coord.publish_server(
        3, "10.0.0.1:9000", ROLE_GENERATION, False, max_batch_size=64, tokens_per_block=32, max_num_tokens=8192
    )
    assert worker.servers() == [ServerInfo(3, "10.0.0.1:9000", ROLE_GENERATION, True, False, 1, 64, 32, 8192)]
    assert worker.servers_version() == v0 + 1
    coord.set_healthy(3, True)
    assert worker.servers()[0].healthy and worker.servers_version() == v0 + 2
    assert coord.publish_server(3, "10.0.0.1:9001", ROLE_GENERATION, True) == 2  # incarnation bumps
    coord.remove_server(3)
    assert worker.servers() == [] and worker.servers_version() == v0 + 4


def test_set_healthy_on_an_absent_slot_is_an_error(coord: ControlTable) -> None:
    with pytest.raises(ValueError, match="not present"):
        coord.set_healthy(7, True)


def test_address_over_127_bytes_is_refused(coord: ControlTable) -> None:
    with pytest.raises(ValueError, match="127 bytes"):
        coord.publish_server(0, "h" * 128, ROLE_CONTEXT, True)


def test_coordinator_line_is_visible_to_workers(coord: ControlTable, worker: ControlTable) -> None:
    coord.set_coordinator(PID, process_starttime(PID), 0xABCDEF)
    coord.set_coord_state(COORD_RUNNING)
    coord.coord_heartbeat()
    line = worker.coordinator()
    assert line["pid"] == PID and line["incarnation"] == 0xABCDEF and line["state"] == COORD_RUNNING
    assert 0 < line["heartbeat_ns"] <= time.monotonic_ns()


def test_claimed_rows_are_listed_heartbeat_and_reclaimed(coord: ControlTable, worker: ControlTable) -> None:
    row = worker.claim_row(PID, 77)
    before = worker.rows()[0]
    assert (before.row, before.pid, before.starttime, before.token >> 32) == (row, PID, 77, PID)
    assert worker.heartbeat(row)
    assert worker.rows()[0].heartbeat_ns >= before.heartbeat_ns
    assert coord.reclaim_rows_of_pid(PID) == 1 and coord.rows() == []
    assert worker.heartbeat(row) is False
    with pytest.raises(RowLost):
        worker.pick_round_robin(row, ROLE_CONTEXT, -1, 1)
    assert coord.reclaim_row(row) is False


def test_a_row_records_the_fleet_index_its_worker_gave(coord: ControlTable, worker: ControlTable) -> None:
    # a restarted coordinator adopts live workers by this index (coordinator/adoption.py)
    plain = worker.claim_row(PID, 77)
    fleet = worker.claim_row(PID, 77, 5)
    assert {r.row: r.fleet_index for r in coord.rows()} == {plain: -1, fleet: 5}
    coord.reclaim_row(fleet)
    again = worker.claim_row(PID, 77)  # a reused row does not keep the old index
    assert {r.row: r.fleet_index for r in coord.rows()}[again] == -1


def test_round_robin_cycles_then_skips_an_unhealthy_server(coord: ControlTable, worker: ControlTable) -> None:
    three_context_servers(coord)
    row = worker.claim_row(PID, 1)
    assert [worker.pick_round_robin(row, ROLE_CONTEXT, -1, 1) for _ in range(5)] == [0, 1, 2, 0, 1]
    coord.set_healthy(1, False)
    # ticket 5, 6, 7, 8 over the two candidates [0, 2]
    assert [worker.pick_round_robin(row, ROLE_CONTEXT, -1, 1) for _ in range(4)] == [2, 0, 2, 0]


def test_round_robin_is_shared_by_all_rows(coord: ControlTable, worker: ControlTable) -> None:
    three_context_servers(coord)
    other = ControlTable.attach(coord.prefix)
    try:
        rows = [worker.claim_row(PID, 1), other.claim_row(PID, 1)]
        tables = [worker, other]
        picks = [tables[i % 2].pick_round_robin(rows[i % 2], ROLE_CONTEXT, -1, 1) for i in range(6)]
        assert picks == [0, 1, 2, 0, 1, 2]
    finally:
        other.close()


def test_round_robin_honours_exclude_role_and_empty(coord: ControlTable, worker: ControlTable) -> None:
    three_context_servers(coord)
    coord.publish_server(5, "g:1", ROLE_GENERATION, True)
    row = worker.claim_row(PID, 1)
    assert {worker.pick_round_robin(row, ROLE_CONTEXT, 1, 1) for _ in range(10)} == {0, 2}
    assert {worker.pick_round_robin(row, ROLE_GENERATION, -1, 1) for _ in range(3)} == {5}
    dispatched = worker.rows()[0].dispatched
    assert worker.pick_round_robin(row, ROLE_GENERATION, 5, 1) == -1
    coord.set_healthy(5, False)
    assert worker.pick_least_loaded(row, ROLE_GENERATION, -1, 1, False) == -1
    assert worker.rows()[0].dispatched == dispatched  # a failed pick adds nothing


def test_a_pick_adds_load_and_release_removes_it(coord: ControlTable, worker: ControlTable) -> None:
    three_context_servers(coord)
    row = worker.claim_row(PID, 1)
    slot = worker.pick_round_robin(row, ROLE_CONTEXT, -1, 120)
    assert coord.load(slot) == (1, 120) and coord.routed(slot) == 1
    assert worker.release(row, slot, 120)
    assert coord.load(slot) == (0, 0) and coord.routed(slot) == 1
    info = worker.rows()[0]
    assert (info.dispatched, info.completed) == (1, 1)


def test_least_loaded_sees_another_rows_load_at_once(coord: ControlTable, worker: ControlTable) -> None:
    three_context_servers(coord)
    other = ControlTable.attach(coord.prefix)
    try:
        mine, theirs = worker.claim_row(PID, 1), other.claim_row(PID, 1)
        assert other.pick_round_robin(theirs, ROLE_CONTEXT, -1, 10) == 0
        assert other.pick_round_robin(theirs, ROLE_CONTEXT, -1, 10) == 1
        assert worker.pick_least_loaded(mine, ROLE_CONTEXT, -1, 1, False) == 2
        other.release(theirs, 0, 10)
        assert worker.pick_least_loaded(mine, ROLE_CONTEXT, -1, 1, False) == 0
    finally:
        other.close()


def load_exactly(coord: ControlTable, worker: ControlTable, row: int, slot: int, tokens: int) -> None:
    """Add one request of `tokens` to `slot` by making it the only healthy candidate for a moment."""
    others = [s.slot for s in coord.servers() if s.slot != slot and s.healthy]
    for s in others:
        coord.set_healthy(s, False)
    assert worker.pick_round_robin(row, ROLE_CONTEXT, -1, tokens) == slot
    for s in others:
        coord.set_healthy(s, True)


def test_least_loaded_by_tokens_and_by_requests_disagree_as_they_should(
    coord: ControlTable, worker: ControlTable
) -> None:
    three_context_servers(coord)
    row = worker.claim_row(PID, 1)
    load_exactly(coord, worker, row, 0, 5000)  # server 0: 1 request, 5000 tokens
    for slot in (1, 2):
        load_exactly(coord, worker, row, slot, 5)
        load_exactly(coord, worker, row, slot, 5)  # servers 1, 2: 2 requests, 10 tokens
    assert worker.pick_least_loaded(row, ROLE_CONTEXT, -1, 0, False) == 0
    assert worker.pick_least_loaded(row, ROLE_CONTEXT, -1, 0, True) in (1, 2)


def test_least_loaded_ties_rotate_instead_of_herding_on_the_first(coord: ControlTable, worker: ControlTable) -> None:
    three_context_servers(coord)
    row = worker.claim_row(PID, 1)
    picks = []
    for _ in range(6):
        slot = worker.pick_least_loaded(row, ROLE_CONTEXT, -1, 1, False)
        picks.append(slot)
        worker.release(row, slot, 1)
    assert sorted(picks) == [0, 0, 1, 1, 2, 2]


def test_release_after_reclaim_changes_nothing(coord: ControlTable, worker: ControlTable) -> None:
    three_context_servers(coord)
    row = worker.claim_row(PID, 1)
    slot = worker.pick_round_robin(row, ROLE_CONTEXT, -1, 7)
    assert coord.reclaim_row(row)
    assert worker.release(row, slot, 7) is False
    assert coord.load(slot) == (0, 0) and coord.routed(slot) == 1
    assert coord.retired() == (1, 0)
