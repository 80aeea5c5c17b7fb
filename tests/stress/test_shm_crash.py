"""Crashes around the control table, each in a child process; the parent asserts.

Pins regressions the project's shared-memory design notes list (not part of the repository):
(c) a worker SIGKILLed mid-request leaves no residual load after reclaim; (f) the coordinator
flock is released on SIGKILL; (g) a writer killed mid-seqlock does not hang readers.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from shmdisagg.shm import (
    ROLE_CONTEXT,
    ControlTable,
    DeploymentRunning,
    RetryExhausted,
    process_starttime,
    segment_names,
)
from tests.unit.shm._children import Child

pytestmark = pytest.mark.stress

READ_BOUND_S = 1.0  # a reader facing a dead writer must give up well within this


@pytest.fixture
def coord(shm_prefix: str) -> Iterator[ControlTable]:
    table = ControlTable.create(shm_prefix)
    for slot in range(3):
        table.publish_server(slot, f"127.0.0.1:{9001 + slot}", ROLE_CONTEXT, True)
    yield table
    table.unlink()
    table.close()


def test_create_after_the_coordinator_is_sigkilled_cleans_its_segments(shm_prefix: str) -> None:
    with Child("coordinator", shm_prefix) as child:
        assert child.line() == "ready"
        stale = segment_names(shm_prefix)
        assert stale == (f"/{shm_prefix}-ctl", f"/{shm_prefix}-idx-0001")
        with pytest.raises(DeploymentRunning, match=f"pid {child.pid}"):
            ControlTable.create(shm_prefix)
        stale_inode = os.stat(f"/dev/shm/{shm_prefix}-ctl").st_ino
        assert child.kill() == -9
    table = ControlTable.create(shm_prefix)  # the kernel dropped the dead coordinator's flock
    try:
        assert segment_names(shm_prefix) == (f"/{shm_prefix}-ctl",)
        assert os.stat(f"/dev/shm/{shm_prefix}-ctl").st_ino != stale_inode
        assert table.servers() == []
    finally:
        table.unlink()
        table.close()


def test_dead_worker_row_is_reclaimed_exactly(coord: ControlTable) -> None:
    retired_dispatched = retired_completed = 0
    for kills in range(1, 5):
        with Child("worker", coord.prefix) as child:
            row = int(child.line().split()[1])
            child.send("loop 5")
            assert child.line() == "looping"
            assert child.kill() == -9  # somewhere inside pick/release, maybe mid-C-call
        info = next(r for r in coord.rows() if r.pid == child.pid)
        assert info.row == row and info.dispatched - info.completed in range(5, 7)
        routed_before = [coord.routed(s) for s in range(3)]
        assert sum(coord.load(s)[0] for s in range(3)) > 0

        assert coord.reclaim_rows_of_pid(child.pid) == 1

        assert [coord.load(s) for s in range(3)] == [(0, 0)] * 3
        assert [coord.routed(s) for s in range(3)] == routed_before
        retired_dispatched += info.dispatched
        retired_completed += info.completed
        assert coord.retired() == (retired_dispatched, retired_completed)
        # A kill can land inside a pick between its routed += 1 and dispatched += 1.
        assert 0 <= sum(routed_before) - retired_dispatched <= kills
        assert coord.rows() == []


def test_reclaiming_a_dead_worker_leaves_live_rows_alone(coord: ControlTable) -> None:
    me = ControlTable.attach(coord.prefix)
    try:
        mine = me.claim_row(os.getpid(), process_starttime(os.getpid()))
        slot = me.pick_round_robin(mine, ROLE_CONTEXT, -1, 42)
        with Child("worker", coord.prefix) as child:
            child.line()
            assert child.ask(f"rr {ROLE_CONTEXT} -1 9") != "-1"
            child.kill()
        assert coord.reclaim_rows_of_pid(child.pid) == 1
        assert coord.load(slot) == (1, 42)
        assert [r.row for r in coord.rows()] == [mine]
    finally:
        me.close()


def test_writer_killed_mid_seqlock_does_not_hang_readers(coord: ControlTable) -> None:
    reader = ControlTable.attach(coord.prefix)  # has picked before: holds a good config copy
    newcomer = ControlTable.attach(coord.prefix)  # never read the config
    try:
        row = reader.claim_row(os.getpid(), 1)
        new_row = newcomer.claim_row(os.getpid(), 1)
        assert reader.pick_round_robin(row, ROLE_CONTEXT, -1, 1) == 0
        for command in ("poke_server 1", "poke_config"):
            with Child("worker", coord.prefix) as child:
                child.line()
                child.send(command)
                assert child.wait() == -9

        t0 = time.monotonic()
        with pytest.raises(RetryExhausted):
            reader.servers()
        assert time.monotonic() - t0 < READ_BOUND_S

        t0 = time.monotonic()
        assert [reader.pick_round_robin(row, ROLE_CONTEXT, -1, 1) for _ in range(3)] == [1, 2, 0]
        assert reader.stats["config_fallbacks"] == 3
        with pytest.raises(RetryExhausted):
            newcomer.pick_round_robin(new_row, ROLE_CONTEXT, -1, 1)
        assert time.monotonic() - t0 < READ_BOUND_S

        # The (next) coordinator's writes repair both sequences.
        coord.publish_server(1, "127.0.0.1:9002", ROLE_CONTEXT, True)
        assert [s.slot for s in reader.servers()] == [0, 1, 2]
        assert newcomer.pick_round_robin(new_row, ROLE_CONTEXT, -1, 1) in (0, 1, 2)
    finally:
        reader.close()
        newcomer.close()
