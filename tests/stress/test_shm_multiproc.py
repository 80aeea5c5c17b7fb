"""Several processes on one control table: a global round robin, shared load, seqlock torture."""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Iterator

import pytest

from shmdisagg.shm import ROLE_CONTEXT, ControlTable, RetryExhausted
from tests.unit.shm._children import Child, consistent_fields

pytestmark = pytest.mark.stress


@pytest.fixture
def coord(shm_prefix: str) -> Iterator[ControlTable]:
    table = ControlTable.create(shm_prefix)
    for slot in range(3):
        table.publish_server(slot, f"127.0.0.1:{9001 + slot}", ROLE_CONTEXT, True)
    yield table
    table.unlink()
    table.close()


def test_round_robin_alternating_between_two_processes_is_one_cycle(coord: ControlTable) -> None:
    me = ControlTable.attach(coord.prefix)
    try:
        row = me.claim_row(os.getpid(), 1)
        with Child("worker", coord.prefix) as child:
            child.line()
            picks = []
            for _ in range(4):
                picks.append(me.pick_round_robin(row, ROLE_CONTEXT, -1, 1))
                picks.append(int(child.ask(f"rr {ROLE_CONTEXT} -1 1")))
            child.send("exit")
            assert child.wait() == 0
        assert picks == [0, 1, 2, 0, 1, 2, 0, 1]
    finally:
        me.close()


def test_round_robin_across_concurrent_processes_visits_each_server_equally(coord: ControlTable) -> None:
    children = [Child("worker", coord.prefix) for _ in range(2)]
    try:
        for c in children:
            c.line()
        for c in children:
            c.send(f"burst 3000 {ROLE_CONTEXT}")  # both run at once
        per_child = [Counter({int(k): v for k, v in json.loads(c.line()).items()}) for c in children]
        total = per_child[0] + per_child[1]
        assert total == Counter({0: 2000, 1: 2000, 2: 2000})
        assert [coord.routed(s) for s in range(3)] == [2000, 2000, 2000]
        assert [coord.load(s) for s in range(3)] == [(0, 0)] * 3
    finally:
        for c in children:
            c.kill()
        for c in children:
            coord.reclaim_rows_of_pid(c.pid)


def test_least_loaded_sees_load_added_by_another_process_at_once(coord: ControlTable) -> None:
    me = ControlTable.attach(coord.prefix)
    try:
        row = me.claim_row(os.getpid(), 1)
        with Child("worker", coord.prefix) as child:
            child.line()
            assert child.ask(f"rr {ROLE_CONTEXT} -1 100") == "0"  # the child now holds server 0
            first = me.pick_least_loaded(row, ROLE_CONTEXT, -1, 1, False)
            second = me.pick_least_loaded(row, ROLE_CONTEXT, -1, 1, False)
            assert {first, second} == {1, 2}
            assert child.ask(f"ll {ROLE_CONTEXT} -1 50 1") in ("1", "2")  # tokens: 100 vs 1 vs 1
            child.send("exit")
            child.wait()
        coord.reclaim_rows_of_pid(child.pid)
        assert [coord.load(s)[0] for s in range(3)] == [0, 1, 1]
    finally:
        me.close()


def test_seqlock_torture_finds_no_torn_reads(coord: ControlTable) -> None:
    # A writer process rewrites server 0 with fields derived from its incarnation while this
    # process reads it: any mix of two versions would break the relation.
    slot, min_changes = 0, 200
    reads = torn = exhausted = 0
    seen: set[int] = set()
    with Child("writer", coord.prefix, str(slot), "3.0") as writer:
        assert writer.line() == "ready"
        reader = ControlTable.attach(coord.prefix)
        region = reader._region
        deadline = time.monotonic() + 2.5
        try:
            while time.monotonic() < deadline:
                for _ in range(500):
                    try:
                        inc, _flags, _w, _h, mb, tpb, mnt, addr = region.read_server(slot)
                    except RetryExhausted:
                        exhausted += 1
                        continue
                    reads += 1
                    torn += (mb, tpb, mnt, addr) != consistent_fields(inc)
                    seen.add(inc)
                if len(seen) >= 50 * min_changes and time.monotonic() > deadline - 2.0:
                    break
            stats = reader.stats
        finally:
            reader.close()
        writes = int(writer.line().split()[1])
        assert writer.wait() == 0
    assert torn == 0, f"{torn} torn of {reads} reads"
    assert reads > 10_000 and len(seen) >= min_changes, (reads, len(seen), writes)
    print(
        f"torture: {reads} reads, {len(seen)} versions seen, {writes} writes, "
        f"{exhausted} exhausted, {stats['seq_retries']} retries, 0 torn"
    )
