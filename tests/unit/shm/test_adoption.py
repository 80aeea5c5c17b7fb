"""A restarted coordinator adopts the dead one's segments (`ControlTable.adopt`,
`BlockIndex.adopt`, `MetricsSegment.adopt`): what a worker counted and what the index holds go
on; a live owner, another layout or another size is refused; a record cut mid-write is repaired."""

from __future__ import annotations

import glob
import os
import struct

import pytest

from shmdisagg.metrics.rows import MetricsSegment, worker_row
from shmdisagg.shm import layout
from shmdisagg.shm.index import BlockIndex, IndexSettings, pack_hashes
from shmdisagg.shm.segment import DeploymentRunning, LayoutMismatch, SegmentNotReady
from shmdisagg.shm.table import ROLE_CONTEXT, ROLE_GENERATION, ControlTable, process_starttime

PID = os.getpid()


def _die(table: ControlTable, *others: object) -> None:
    """What a SIGKILL does to the coordinator's handles: the mappings and flocks go, the names stay."""
    for handle in others:
        handle.close()  # type: ignore[attr-defined]
    table.close()


def test_an_adopted_table_keeps_every_row_record_and_health_mark(shm_prefix: str) -> None:
    table = ControlTable.create(shm_prefix, 8)
    table.publish_server(0, "127.0.0.1:9001", ROLE_CONTEXT, True, tokens_per_block=32)
    table.publish_server(1, "127.0.0.1:9002", ROLE_GENERATION, False)
    worker = ControlTable.attach(shm_prefix)
    row = worker.claim_row(PID, process_starttime(PID), 3)
    assert worker.pick_round_robin(row, ROLE_CONTEXT, -1, 100) == 0
    _die(table)
    adopted = ControlTable.adopt(shm_prefix, 8)
    try:
        servers = {s.slot: (s.addr, s.healthy, s.tokens_per_block) for s in adopted.servers()}
        assert servers == {0: ("127.0.0.1:9001", True, 32), 1: ("127.0.0.1:9002", False, 0)}
        assert adopted.load(0) == (1, 100)  # the worker's pick is still counted
        assert [(r.pid, r.fleet_index) for r in adopted.rows()] == [(PID, 3)]
        assert worker.release(row, 0, 100)  # the worker's row goes on working
        assert adopted.load(0) == (0, 0)
        adopted.set_healthy(1, True)  # and the adopter is the writer now
        assert {s.slot for s in worker.servers() if s.healthy} == {0, 1}
    finally:
        worker.close()
        adopted.unlink()
        adopted.close()


def test_a_table_whose_coordinator_lives_is_not_adopted(shm_prefix: str) -> None:
    with ControlTable.create(shm_prefix, 8) as table:
        with pytest.raises(DeploymentRunning, match="locked by a running coordinator"):
            ControlTable.adopt(shm_prefix, 8)
        table.unlink()


def test_another_row_count_or_layout_is_refused_and_left_alone(shm_prefix: str) -> None:
    table = ControlTable.create(shm_prefix, 8)
    _die(table)
    with pytest.raises(SegmentNotReady, match="8 worker rows, the config asks for 16"):
        ControlTable.adopt(shm_prefix, 16)
    with open(f"/dev/shm/{shm_prefix}-ctl", "r+b") as f:  # another build's layout version
        f.seek(layout.VERSION_OFFSET)
        f.write(struct.pack("<I", layout.LAYOUT_VERSION + 1))
    with pytest.raises(LayoutMismatch):
        ControlTable.adopt(shm_prefix, 8)
    assert glob.glob(f"/dev/shm/{shm_prefix}*") == [f"/dev/shm/{shm_prefix}-ctl"]  # refusing unlinks nothing
    os.unlink(f"/dev/shm/{shm_prefix}-ctl")


def test_no_table_to_adopt_is_file_not_found(shm_prefix: str) -> None:
    with pytest.raises(FileNotFoundError):
        ControlTable.adopt(shm_prefix, 8)


def test_a_server_record_left_odd_by_the_dead_writer_is_removed_and_the_config_rebuilt(shm_prefix: str) -> None:
    table = ControlTable.create(shm_prefix, 8)
    table.publish_server(0, "127.0.0.1:9001", ROLE_CONTEXT, True)
    table.publish_server(1, "127.0.0.1:9002", ROLE_GENERATION, True)
    # the coordinator died between the odd and the even store of record 1
    seq = layout.server_seq_offset(1)
    mm = table._segment.mm
    struct.pack_into("<Q", mm, seq, struct.unpack_from("<Q", mm, seq)[0] + 1)
    _die(table)
    adopted = ControlTable.adopt(shm_prefix, 8)
    try:
        assert [(s.slot, s.healthy) for s in adopted.servers()] == [
            (0, True)
        ]  # readable again, slot 1 to register anew
    finally:
        adopted.unlink()
        adopted.close()


def test_the_adopted_index_keeps_its_blocks_and_unlinks_older_generations(shm_prefix: str) -> None:
    table = ControlTable.create(shm_prefix, 8)
    table.publish_server(0, "127.0.0.1:9001", ROLE_CONTEXT, True)
    index = BlockIndex.create(table, IndexSettings(capacity=1024))
    index.apply_stored(0, pack_hashes([11, 22, 33]))
    index.resize(2048)  # generation 2 published; 1 waits out its grace period, then would be unlinked
    assert len(glob.glob(f"/dev/shm/{shm_prefix}-idx-*")) == 2
    _die(table, index)
    adopted = ControlTable.adopt(shm_prefix, 8)
    new_index = BlockIndex.adopt(adopted, IndexSettings(capacity=1024))
    try:
        assert new_index is not None and new_index.generation == 2
        assert glob.glob(f"/dev/shm/{shm_prefix}-idx-*") == [f"/dev/shm/{shm_prefix}-idx-2"]
        assert [new_index.lookup(h)[0] for h in (11, 22, 33)] == [1, 1, 1]  # type: ignore[index]
        new_index.apply_removed(0, pack_hashes([22]))  # the adopter writes it
        assert new_index.lookup(22) is None or new_index.lookup(22)[0] == 0  # type: ignore[index]
    finally:
        assert new_index is not None
        new_index.unlink()
        new_index.close()
        adopted.unlink()
        adopted.close()


def test_no_published_index_adopts_as_none(shm_prefix: str) -> None:
    table = ControlTable.create(shm_prefix, 8)
    _die(table)
    adopted = ControlTable.adopt(shm_prefix, 8)
    try:
        assert BlockIndex.adopt(adopted) is None
    finally:
        adopted.unlink()
        adopted.close()


def test_adopted_metrics_keep_every_count_and_need_the_same_fleet_size(shm_prefix: str) -> None:
    metrics = MetricsSegment.create(shm_prefix, 2)
    row = metrics.row(worker_row(1))
    row[5] = 42.0
    row.release()
    metrics.close()
    with pytest.raises(SegmentNotReady, match="rows for 2 workers, not 3"):
        MetricsSegment.adopt(shm_prefix, 3)
    adopted = MetricsSegment.adopt(shm_prefix, 2)
    try:
        assert adopted.totals()[5] == 42.0
    finally:
        adopted.unlink()
        adopted.close()
