"""The native Region over a plain bytearray: header validation, bounds, read-only and release rules."""

from __future__ import annotations

import os
import struct

import pytest

from shmdisagg import _native
from shmdisagg.shm import layout

MW = 4


def fresh(max_workers: int = MW) -> tuple[bytearray, _native.Region]:
    buf = bytearray(_native.control_size(max_workers))
    region = _native.Region(buf)
    region.init_control(max_workers, 1)
    return buf, region


def attach(buf: bytearray) -> _native.Region:
    """A second Region over the same memory, as another process would map it."""
    region = _native.Region(buf)
    assert region.check_control()
    return region


def test_unready_segment_is_not_valid_yet() -> None:
    region = _native.Region(bytearray(_native.control_size(MW)))
    assert region.check_control() is False
    with pytest.raises(_native.ShmError, match="not a validated control segment"):
        region.coord()


def test_initialised_copy_validates_and_reports_its_size() -> None:
    buf, region = fresh()
    copy = attach(buf)
    assert copy.max_workers == MW and copy.size == len(buf) == layout.control_size(MW)
    assert struct.unpack_from("<Q", buf, 0)[0] == layout.MAGIC


def put(off: int, fmt: str, value: int) -> tuple[int, str, int]:
    return off, fmt, value


CORRUPTIONS = [
    pytest.param(put(0x00, "<Q", 0xDEADBEEF), "bad magic", id="magic"),
    pytest.param(put(0x08, "<I", 1), "layout version 1, but this build reads version 5", id="version"),
    pytest.param(put(0x08, "<I", 4), "layout version 4, but this build reads version 5", id="version_4"),
    pytest.param(put(0x0C, "<I", 8192), "header_bytes is 8192", id="header_bytes"),
    pytest.param(put(0x18, "<H", 32), "max_servers is 32", id="max_servers"),
    pytest.param(put(0x18, "<H", 320), "max_servers is 320", id="max_servers_past_limit"),
    pytest.param(put(0x18, "<H", 128), "offsets/strides .* for 128 servers", id="max_servers_not_the_layout"),
    pytest.param(put(0x40, "<I", 0x100), "offsets/strides", id="config_offset"),
    pytest.param(put(0x1A, "<H", 0), "max_workers is 0", id="no_workers"),
    pytest.param(put(0x1A, "<H", 60000), "max_workers is 60000", id="too_many_workers"),
    pytest.param(put(0x24, "<I", 128), "offsets/strides", id="server_stride"),
    pytest.param(put(0x28, "<I", 0x100), "offsets/strides", id="worker_offset"),
    pytest.param(put(0x10, "<Q", 100), "too small for 64 servers and 4 worker rows", id="segment_bytes_small"),
    pytest.param(
        put(0x10, "<Q", 1 << 40), f"only {_native.control_size(MW)} are mapped", id="segment_bytes_past_mapping"
    ),
    pytest.param(put(0x38, "<Q", 7), "init_state is 7", id="init_state"),
]


@pytest.mark.parametrize(("poke", "message"), CORRUPTIONS)
def test_corrupt_header_raises_layout_mismatch_naming_the_field(poke: tuple[int, str, int], message: str) -> None:
    buf, _ = fresh()
    off, fmt, value = poke
    struct.pack_into(fmt, buf, off, value)
    with pytest.raises(_native.LayoutMismatch, match=message):
        _native.Region(buf).check_control()


def test_mapping_smaller_than_header_is_a_mismatch() -> None:
    with pytest.raises(_native.LayoutMismatch, match="smaller than the 4096-byte header"):
        _native.Region(bytearray(64)).check_control()


def test_worker_rows_beyond_the_mapping_are_rejected() -> None:
    buf, _ = fresh(8)
    with pytest.raises(_native.LayoutMismatch, match="mapped"):
        _native.Region(buf[: _native.control_size(4)]).check_control()


def test_init_refuses_a_mapping_too_small_for_its_rows() -> None:
    with pytest.raises(_native.SegmentFull, match="need"):
        _native.Region(bytearray(_native.control_size(2))).init_control(3, 0)


def test_region_holds_the_buffer_until_released() -> None:
    buf, region = fresh()
    with pytest.raises(BufferError):
        buf.extend(b"x")
    region.release()
    region.release()  # idempotent
    buf.extend(b"x")
    with pytest.raises(ValueError, match="released"):
        region.read_config()
    assert region.size == 0


def test_unaligned_buffer_is_refused() -> None:
    buf = bytearray(_native.control_size(MW) + 8)
    with pytest.raises(ValueError, match="aligned"):
        _native.Region(memoryview(buf)[1:])


def test_read_only_region_reads_but_never_writes() -> None:
    buf, region = fresh()
    region.write_server(0, layout.server_flags(True, True, 0), 1, 2, 3, b"a:1")
    ro = _native.Region(bytes(buf), writable=False)
    assert ro.check_control()
    assert ro.read_server(0)[-1] == b"a:1"
    for call in (
        lambda: ro.claim_row(1, 1),
        lambda: ro.set_coord(1, 2, 3),
        lambda: ro.reclaim_row(0),
        lambda: ro.write_server(0, 1, 0, 0, 0, b""),
        lambda: ro.pick_round_robin(0, 0, -1, 1),
    ):
        with pytest.raises(_native.ShmError, match="read-only"):
            call()


@pytest.mark.parametrize(
    ("call", "error"),
    [
        pytest.param(lambda r, row: r.read_server(64), ValueError, id="slot_64"),
        pytest.param(lambda r, row: r.read_server(-1), ValueError, id="slot_negative"),
        pytest.param(lambda r, row: r.load(64), ValueError, id="load_slot"),
        pytest.param(lambda r, row: r.pick_round_robin(MW, 0, -1, 1), ValueError, id="row_past_end"),
        pytest.param(lambda r, row: r.pick_round_robin(row, 2, -1, 1), ValueError, id="role_2"),
        pytest.param(lambda r, row: r.pick_round_robin(row, 0, -1, -5), ValueError, id="negative_tokens"),
        pytest.param(lambda r, row: r.complete(row, 64, 1), ValueError, id="release_slot"),
        pytest.param(lambda r, row: r.write_server(0, 1, 0, 0, 0, b"x" * 128), ValueError, id="addr_128"),
        pytest.param(lambda r, row: r.write_server(0, 1, 0, 0, 0, b"a\0b"), ValueError, id="addr_nul"),
        pytest.param(lambda r, row: r.write_server(0, 2 << 8 | 1, 0, 0, 0, b""), ValueError, id="flags_role"),
        pytest.param(lambda r, row: r.write_server(0, 1, 0, 0, 0, "str"), TypeError, id="addr_str"),
        pytest.param(lambda r, row: r.claim_row(0, 1), ValueError, id="pid_0"),
        pytest.param(lambda r, row: r.pick_round_robin(row, 0, -1), TypeError, id="arity"),
    ],
)
def test_out_of_range_arguments_raise_before_touching_memory(call, error) -> None:  # type: ignore[no-untyped-def]
    _, region = fresh()
    row, _ = region.claim_row(os.getpid(), 1)
    with pytest.raises(error):
        call(region, row)


def test_addr_of_127_bytes_round_trips() -> None:
    _, region = fresh()
    region.write_server(5, layout.server_flags(True, False, 1), 1, 2, 3, b"z" * 127)
    inc, flags, weight, health_ns, mb, tpb, mnt, addr = region.read_server(5)
    assert (inc, flags, weight, mb, tpb, mnt, addr) == (1, 0x101, 0, 1, 2, 3, b"z" * 127)
    assert health_ns > 0


def test_a_row_never_claimed_here_is_lost() -> None:
    buf, region = fresh()
    other = attach(buf)
    row, _ = region.claim_row(os.getpid(), 1)
    with pytest.raises(_native.RowLost, match=f"row {row}"):
        other.pick_round_robin(row, 0, -1, 1)
    assert other.complete(row, 0, 1) is False and other.heartbeat(row) is False


def test_claiming_every_row_then_one_more_is_segment_full() -> None:
    _, region = fresh()
    rows = [region.claim_row(os.getpid(), 1)[0] for _ in range(MW)]
    assert rows == list(range(MW))
    with pytest.raises(_native.SegmentFull, match=f"all {MW} rows"):
        region.claim_row(os.getpid(), 1)
    assert region.reclaim_row(2)
    assert region.claim_row(os.getpid(), 1)[0] == 2


def test_tokens_carry_the_pid_and_are_unique() -> None:
    _, region = fresh()
    tokens = {region.claim_row(4321, 1)[1] for _ in range(MW)}
    assert len(tokens) == MW and all(t >> 32 == 4321 for t in tokens)


def test_odd_server_sequence_raises_retry_exhausted_and_next_write_repairs_it() -> None:
    buf, region = fresh()
    flags = layout.server_flags(True, True, 0)
    region.write_server(0, flags, 1, 2, 3, b"a:1")
    off = layout.server_seq_offset(0)
    struct.pack_into("<Q", buf, off, struct.unpack_from("<Q", buf, off)[0] | 1)
    with pytest.raises(_native.RetryExhausted, match="server record 0"):
        region.read_server(0)
    assert region.write_server(0, flags, 4, 5, 6, b"b:2") == 2
    assert struct.unpack_from("<Q", buf, off)[0] % 2 == 0
    assert region.read_server(0)[4:] == (4, 5, 6, b"b:2")


def test_picks_fall_back_to_the_last_good_config_when_the_config_stays_odd() -> None:
    buf, region = fresh()
    region.write_server(0, layout.server_flags(True, True, 0), 0, 0, 0, b"a:1")
    row, _ = region.claim_row(os.getpid(), 1)
    assert region.pick_round_robin(row, 0, -1, 1) == 0  # caches the config
    fresh_reader = attach(buf)
    fresh_row, _ = fresh_reader.claim_row(os.getpid(), 1)
    off = layout.CONFIG_SEQ_OFFSET
    struct.pack_into("<Q", buf, off, struct.unpack_from("<Q", buf, off)[0] | 1)
    assert [region.pick_round_robin(row, 0, -1, 1) for _ in range(3)] == [0, 0, 0]
    assert region.stats["config_fallbacks"] == 3
    with pytest.raises(_native.RetryExhausted, match="config block"):
        fresh_reader.pick_round_robin(fresh_row, 0, -1, 1)
    with pytest.raises(_native.RetryExhausted):
        region.read_config()
    region.set_server_flags(0, layout.server_flags(True, True, 0))  # a coordinator write repairs it
    assert fresh_reader.pick_round_robin(fresh_row, 0, -1, 1) == 0


def test_coordinator_line_round_trips() -> None:
    _, region = fresh()
    region.set_coord(123, 456, (1 << 64) - 1)
    region.set_coord_heartbeat(789)
    region.set_coord_state(1)
    assert region.coord() == (123, 456, (1 << 64) - 1, 789, 1)
