"""Membership over a real shared table: which slot each registered worker gets, when a slot is
reused, what a re-registration of one address does, and the table's capacity."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shmdisagg.cluster.workers import WorkerInfo
from shmdisagg.coordinator.health import Executor, HealthMonitor
from shmdisagg.coordinator.membership import Membership
from shmdisagg.shm.table import ROLE_CONTEXT, ROLE_GENERATION, ControlTable


@pytest.fixture
def table(shm_prefix: str) -> Iterator[ControlTable]:
    t = ControlTable.create(shm_prefix, 4)
    try:
        yield t
    finally:
        t.unlink()
        t.close()


def worker(port: int, role: int = 0, wid: str | None = None) -> tuple[str, str]:
    info = WorkerInfo(wid or f"W-{port}", "127.0.0.1", port, role)
    return f"/trtllm-disagg/t/workers/{info.worker_id}", info.encode()


def make(table: ControlTable, capacity: int = 64) -> tuple[Membership, list[int], list[int]]:
    joined: list[int] = []
    left: list[int] = []
    m = Membership(
        table,
        HealthMonitor(table, [], 1.0),
        on_join=lambda ex: joined.append(ex.slot),
        on_leave=lambda ex: left.append(ex.slot),
        capacity=capacity,
    )
    return m, joined, left


def present(table: ControlTable) -> dict[int, tuple[str, int]]:
    return {s.slot: (s.addr, s.role) for s in table.servers()}


def test_a_registration_is_published_unhealthy_until_prepared_and_a_delete_removes_it(table: ControlTable) -> None:
    m, joined, left = make(table)
    m.put(*worker(8001, 0))
    m.put(*worker(8002, 1))
    assert present(table) == {0: ("127.0.0.1:8001", ROLE_CONTEXT), 1: ("127.0.0.1:8002", ROLE_GENERATION)}
    assert not any(s.healthy for s in table.servers())  # health and /server_info first
    m.delete(worker(8001)[0])
    assert present(table) == {1: ("127.0.0.1:8002", ROLE_GENERATION)} and left == [0]


def test_the_same_key_heart_beating_changes_nothing(table: ControlTable) -> None:
    m, joined, _ = make(table)
    key, value = worker(8001)
    m.put(key, value)
    version = table.servers_version()
    m.put(key, value)
    assert table.servers_version() == version and joined == [0]


def test_an_address_registered_again_is_a_new_server_and_the_old_keys_delete_is_ignored(table: ControlTable) -> None:
    m, joined, left = make(table)
    old_key, old = worker(8001, wid="A")
    new_key, new = worker(8001, wid="B")
    m.put(old_key, old)
    m.put(new_key, new)
    assert (joined, left, m.replaced) == ([0, 1], [0], 1)
    assert present(table) == {1: ("127.0.0.1:8001", ROLE_CONTEXT)}  # a fresh slot: nothing of the old one
    m.delete(old_key)  # its lease expires later: the live worker stays
    assert present(table) == {1: ("127.0.0.1:8001", ROLE_CONTEXT)}


def test_a_freed_slot_is_reused_only_after_its_legs_ended(table: ControlTable) -> None:
    m, joined, _ = make(table, capacity=1)
    m.put(*worker(8001))
    table.set_healthy(0, True)
    row = table.claim_row(1, 1)
    assert table.pick_round_robin(row, ROLE_CONTEXT, -1, 10) == 0  # a leg in flight on slot 0
    m.delete(worker(8001)[0])
    m.put(*worker(8002))
    assert present(table) == {} and m.waited == 1  # waits: slot 0 still carries the leg's load
    table.release(row, 0, 10)
    m.tick()
    assert present(table) == {0: ("127.0.0.1:8002", ROLE_CONTEXT)} and joined == [0, 0]


def test_sync_removes_what_the_store_no_longer_lists_and_joins_the_rest(table: ControlTable) -> None:
    m, _, _ = make(table)
    m.put(*worker(8001))
    m.put(*worker(8002, 1))
    m.sync(dict([worker(8002, 1), worker(8003)]))
    assert sorted(a for a, _ in present(table).values()) == ["127.0.0.1:8002", "127.0.0.1:8003"]


def test_a_bad_value_is_ignored_and_takes_out_what_its_key_held(table: ControlTable) -> None:
    m, _, _ = make(table)
    key, value = worker(8001)
    m.put(key, value)
    m.put(key, "{not json")
    assert present(table) == {} and m.bad_values == 1


def test_health_add_refuses_a_taken_slot(table: ControlTable) -> None:
    health = HealthMonitor(table, [], 1.0)
    health.add(Executor(0, ROLE_CONTEXT, "127.0.0.1", 8001))
    with pytest.raises(ValueError, match="slot 0 already holds 127.0.0.1:8001"):
        health.add(Executor(0, ROLE_CONTEXT, "127.0.0.1", 8002))
