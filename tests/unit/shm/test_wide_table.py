"""A table (and KV index) of 256 server slots with 256 executors published: every pick reaches
every server, past slot 64 as before it; KV routing, conversation sessions, row reclaim and a
restarted coordinator's adoption work on servers in every word of the server sets; a table or
index of another width is refused."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator

import pytest

from shmdisagg import _native
from shmdisagg.shm import ROLE_CONTEXT, ROLE_GENERATION, ControlTable, LayoutMismatch, SegmentNotReady
from shmdisagg.shm.index import BlockIndex, IndexSettings, pack_hashes
from shmdisagg.shm.layout import control_offsets, index_slot_bytes
from shmdisagg.shm.segment import Segment

PID = os.getpid()
N = 256
CONTEXT = range(0, 200)  # 200 context servers (slots 0..199), 56 generation servers (200..255)
GENERATION = range(200, N)


@pytest.fixture
def coord(shm_prefix: str) -> Iterator[ControlTable]:
    table = ControlTable.create(shm_prefix, max_workers=8, max_servers=N)
    for slot in range(N):
        role = ROLE_CONTEXT if slot in CONTEXT else ROLE_GENERATION
        table.publish_server(slot, f"10.0.{slot // 100}.{slot % 100}:9000", role, True, max_batch_size=8)
    yield table
    table.unlink()
    table.close()


@pytest.fixture
def index(coord: ControlTable) -> Iterator[BlockIndex]:
    ix = BlockIndex.create(coord, IndexSettings(capacity=1 << 12, max_capacity=1 << 12, grace_s=0.0))
    yield ix
    ix.close()


@pytest.fixture
def worker(coord: ControlTable) -> Iterator[ControlTable]:
    table = ControlTable.attach(coord.prefix)
    yield table
    table.close()


def chain(tag: int, n: int) -> list[int]:
    return [(tag << 32) | (i + 1) for i in range(n)]


def test_a_table_sized_for_256_holds_256_servers_and_says_so(coord: ControlTable, worker: ControlTable) -> None:
    assert coord.max_servers == worker.max_servers == N
    servers = worker.servers()
    assert [s.slot for s in servers] == list(range(N))
    assert {s.slot for s in servers if s.role == ROLE_GENERATION} == set(GENERATION)
    present, healthy, ctx, gen, _ = worker._region.read_config()
    assert present == healthy == (1 << N) - 1 and ctx == (1 << 200) - 1 and gen == present & ~ctx
    with pytest.raises(ValueError, match="server slot 256 out of range 0..255"):
        coord.publish_server(N, "10.9.9.9:1", ROLE_CONTEXT, True)


def test_round_robin_cycles_every_server_of_a_role_across_words(coord: ControlTable, worker: ControlTable) -> None:
    row = worker.claim_row(PID, 1)
    picks = [worker.pick_round_robin(row, ROLE_CONTEXT, -1, 1) for _ in range(2 * len(CONTEXT))]
    assert Counter(picks) == {slot: 2 for slot in CONTEXT}
    picks = [worker.pick_round_robin(row, ROLE_GENERATION, 230, 1) for _ in range(len(GENERATION) - 1)]
    assert sorted(picks) == [s for s in GENERATION if s != 230]  # the excluded one, past slot 200, never


def test_least_loaded_spreads_over_every_server_and_counts_load_past_slot_64(
    coord: ControlTable, worker: ControlTable
) -> None:
    rows = [worker.claim_row(PID, 1) for _ in range(3)]
    picks = [worker.pick_least_loaded(rows[i % 3], ROLE_CONTEXT, -1, 10, False) for i in range(len(CONTEXT))]
    assert sorted(picks) == list(CONTEXT)  # each server once: a loaded one is never the least
    assert coord.load(199) == (1, 10) and coord.routed(199) == 1
    assert worker.pick_least_loaded(rows[0], ROLE_CONTEXT, -1, 10, True) in CONTEXT
    for slot in (0, 63, 64, 150):  # unload a few in different words: they are the least loaded now
        row = rows[picks.index(slot) % 3]
        assert worker.release(row, slot, 10)
    again = {worker.pick_least_loaded(rows[0], ROLE_CONTEXT, -1, 10, False) for _ in range(4)}
    assert again == {0, 63, 64, 150}


def test_a_reclaimed_row_retires_its_picks_of_servers_past_slot_64(coord: ControlTable, worker: ControlTable) -> None:
    row = worker.claim_row(PID, 1)
    for slot in (5, 70, 255):
        role = ROLE_CONTEXT if slot in CONTEXT else ROLE_GENERATION
        while worker.pick_round_robin(row, role, -1, 7) != slot:
            pass
    routed = {slot: coord.routed(slot) for slot in range(N)}
    assert routed[255] >= 1 and coord.load(255) == (routed[255], 7 * routed[255])
    assert coord.reclaim_row(row)
    assert {slot: coord.routed(slot) for slot in range(N)} == routed  # now retired totals
    assert coord.load(255) == (0, 0) and coord.load(70) == (0, 0)
    assert coord.retired()[0] == sum(routed.values())


def test_kv_routing_reaches_a_server_past_slot_64_and_marks_its_bits(
    coord: ControlTable, index: BlockIndex, worker: ControlTable
) -> None:
    blocks = chain(1, 40)
    index.apply_stored(137, blocks[:30])
    index.apply_stored(3, blocks[:10])
    windex = BlockIndex.attach(worker)
    try:
        row = worker.claim_row(PID, 1)
        slot, matched = windex.pick_kv(row, ROLE_CONTEXT, -1, pack_hashes(blocks), 100)
        assert (slot, matched) == (137, 30)
        assert windex.lookup(blocks[0])[:2] == (1 << 137 | 1 << 3, 0)
        assert windex.lookup(blocks[35])[:2] == (0, 1 << 137)  # routed past its event depth
        depths = dict(windex.match(pack_hashes(blocks), ROLE_CONTEXT))
        assert depths[137] == 40 and depths[3] == 10 and depths[199] == 0 and len(depths) == len(CONTEXT)
        # the same prompt again goes where it went: its routed blocks count as held there
        worker.release(row, 137, 100)
        assert windex.pick_kv(row, ROLE_CONTEXT, -1, pack_hashes(blocks), 100) == (137, 40)
        assert windex.pick_kv(row, ROLE_CONTEXT, 137, pack_hashes(blocks), 100) == (3, 10)  # excluded
        assert index.clear_server(137) > 0
        assert windex.lookup(blocks[0])[:2] == (1 << 3, 0)
    finally:
        windex.close()


def test_generation_servers_past_slot_200_route_by_kv_and_sessions_stick(
    coord: ControlTable, index: BlockIndex, worker: ControlTable
) -> None:
    blocks = chain(2, 20)
    index.apply_stored(255, blocks)
    windex = BlockIndex.attach(worker)
    try:
        row = worker.claim_row(PID, 1)
        assert windex.pick_kv(row, ROLE_GENERATION, -1, pack_hashes(blocks), 100) == (255, 20)
        first = windex.conv_pick_explicit(row, ROLE_GENERATION, -1, 77, 10)
        assert first in GENERATION
        assert all(windex.conv_pick_explicit(row, ROLE_GENERATION, -1, 77, 10) == first for _ in range(5))
        assert windex._ix.lookup(77, 1, ROLE_GENERATION)[1] == 1 << first  # a session reads as its server's bit
        moved = windex.conv_pick_explicit(row, ROLE_GENERATION, first, 77, 10)  # its server excluded: re-routed
        assert moved in GENERATION and moved != first
        index.clear_server(moved)
        assert windex._ix.lookup(77, 1, ROLE_GENERATION)[1] == 0
        hashes = pack_hashes(chain(3, 8))
        slot, _ = windex.conv_pick_implicit(row, ROLE_GENERATION, -1, hashes, 10)
        assert windex.conv_pick_implicit(row, ROLE_GENERATION, -1, hashes, 10) == (slot, 8)
    finally:
        windex.close()


def test_a_resize_keeps_the_masks_of_every_word(coord: ControlTable, index: BlockIndex) -> None:
    index.apply_stored(250, chain(4, 5))
    index.apply_stored(64, chain(4, 3))
    index.resize(1 << 12)
    assert index.lookup(chain(4, 1)[0])[:2] == (1 << 250 | 1 << 64, 0)
    assert index.lookup(chain(4, 5)[4])[:2] == (1 << 250, 0)
    assert index._ix.scan()["server_blocks"][250] == 5 and len(index._ix.scan()["server_blocks"]) == N


def test_a_restarted_coordinator_adopts_a_wide_table_and_index(shm_prefix: str) -> None:
    table = ControlTable.create(shm_prefix, 8, N)
    for slot in (0, 100, 255):
        table.publish_server(slot, f"10.0.0.{slot}:1", ROLE_CONTEXT, True)
    index = BlockIndex.create(table, IndexSettings(capacity=1 << 10, max_capacity=1 << 10))
    index.apply_stored(255, chain(5, 4))
    worker = ControlTable.attach(shm_prefix)
    row = worker.claim_row(PID, 1, 0)
    while worker.pick_round_robin(row, ROLE_CONTEXT, -1, 9) != 255:
        pass
    index.close()
    table.close()  # the coordinator dies
    with pytest.raises(SegmentNotReady, match="256 server slots, the config asks for 64 .shmdisagg.shm.max_servers"):
        ControlTable.adopt(shm_prefix, 8)
    adopted = ControlTable.adopt(shm_prefix, 8, N)
    try:
        assert adopted.max_servers == N and [s.slot for s in adopted.servers()] == [0, 100, 255]
        assert adopted.load(255) == (1, 9)
        again = BlockIndex.adopt(adopted)
        assert again is not None
        assert again.lookup(chain(5, 1)[0])[:2] == (1 << 255, 0)
        again.close()
        assert worker.release(row, 255, 9) and adopted.load(255) == (0, 0)
    finally:
        worker.close()
        adopted.unlink()
        adopted.close()


def test_an_index_of_another_width_is_refused(shm_prefix: str) -> None:
    wide = bytearray(_native.control_size(1, N))
    narrow = bytearray(_native.control_size(1))
    regions = [_native.Region(wide), _native.Region(narrow)]
    regions[0].init_control(1, 0, N)
    regions[1].init_control(1, 0)
    buf = bytearray(_native.IX_HEADER_BYTES + index_slot_bytes(N) * 64)
    ix = _native.Index(buf, regions[0])
    ix.init_index(1, 6, 32, 0)
    ix.publish()
    ix.release()
    other = _native.Index(buf, regions[1])
    with pytest.raises(LayoutMismatch, match="slot_bytes 80, but the control segment's 64 servers need 32-byte"):
        other.check_index()
    other.release()
    for r in regions:
        r.release()


def test_a_reader_refuses_a_header_whose_max_servers_is_not_its_layout(shm_prefix: str) -> None:
    with ControlTable.create(shm_prefix, 2, 128) as table:
        assert control_offsets(128, 2).size <= table._segment.size
        copy = Segment.create(f"/{shm_prefix}-copy-ctl", table._segment.size)
        try:
            copy.mm[:] = table._segment.mm[:]
            copy.mm[0x18:0x1A] = (192).to_bytes(2, "little")  # max_servers says 192, the offsets 128
            with pytest.raises(LayoutMismatch, match="do not match this build's layout for 192 servers"):
                ControlTable.attach(f"{shm_prefix}-copy", timeout=0.0)
        finally:
            copy.close()
            copy.unlink()
        table.unlink()
