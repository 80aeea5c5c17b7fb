"""Segment lifecycle in the real /dev/shm: create, attach, lock, stale cleanup, errors."""

from __future__ import annotations

import errno
import mmap
import os
import struct

import posix_ipc
import pytest

from shmdisagg import _native
from shmdisagg.shm import (
    ControlTable,
    DeploymentRunning,
    LayoutMismatch,
    Segment,
    SegmentFull,
    SegmentNotReady,
    ShmError,
    cleanup_stale,
    layout,
    segment as segment_mod,
    segment_names,
)
from shmdisagg.shm.index import BlockIndex, IndexSettings


def shm_path(name: str) -> str:
    return "/dev/shm/" + name.lstrip("/")


def test_create_attach_close_unlink_lifecycle(shm_prefix: str) -> None:
    table = ControlTable.create(shm_prefix, max_workers=8)
    path = shm_path(table.name)
    assert table.name == f"/{shm_prefix}-ctl"
    st = os.stat(path)
    assert st.st_mode & 0o777 == 0o600
    assert st.st_size == layout.mapped_size(8) and st.st_size % mmap.PAGESIZE == 0
    worker = ControlTable.attach(shm_prefix)
    assert worker.max_workers == 8 and worker.servers() == []
    worker.close()
    worker.close()  # idempotent
    assert segment_names(shm_prefix) == (table.name,)
    table.unlink()
    assert segment_names(shm_prefix) == ()
    assert table.servers() == []  # the mapping outlives the name
    table.close()


def test_attach_never_resizes_the_segment(shm_prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Regression: posix_ipc's size= ftruncates even on attach, shrinking a live segment (SIGBUS).
    seen: list[dict[str, object]] = []
    real = posix_ipc.SharedMemory

    def spy(name: str, *args: object, **kwargs: object) -> posix_ipc.SharedMemory:
        seen.append({"args": args, **kwargs})
        return real(name, *args, **kwargs)

    with ControlTable.create(shm_prefix, max_workers=2) as table:
        size = os.stat(shm_path(table.name)).st_size
        monkeypatch.setattr(segment_mod.posix_ipc, "SharedMemory", spy)
        for _ in range(3):
            ControlTable.attach(shm_prefix).close()
        assert os.stat(shm_path(table.name)).st_size == size
        assert seen and all("size" not in call and call["args"] == () for call in seen)
        table.unlink()


def test_attach_missing_segment_is_file_not_found(shm_prefix: str) -> None:
    with pytest.raises(FileNotFoundError):
        ControlTable.attach(shm_prefix)


def test_attach_refuses_a_group_readable_segment(shm_prefix: str) -> None:
    with ControlTable.create(shm_prefix) as table:
        os.chmod(shm_path(table.name), 0o640)
        with pytest.raises(ShmError, match="mode 0640, expected 0600"):
            ControlTable.attach(shm_prefix)
        table.unlink()


def test_second_create_on_a_live_prefix_is_deployment_running(shm_prefix: str) -> None:
    with ControlTable.create(shm_prefix) as table:
        with pytest.raises(DeploymentRunning, match=f"pid {os.getpid()}"):
            ControlTable.create(shm_prefix)
        assert ControlTable.attach(shm_prefix).servers() == []  # untouched
        table.unlink()


def test_create_after_a_clean_close_reuses_the_prefix(shm_prefix: str) -> None:
    first = ControlTable.create(shm_prefix)
    first.publish_server(0, "a:1", 0, True)
    first.close()  # drops the flock but leaves the name: a stale segment
    with ControlTable.create(shm_prefix) as second:
        assert second.servers() == []
        second.unlink()


def test_cleanup_stale_unlinks_only_this_prefix(shm_prefix: str) -> None:
    mine = [f"/{shm_prefix}-ctl", f"/{shm_prefix}-idx-0001"]
    neighbour = f"/{shm_prefix}0-ctl"  # another deployment whose prefix extends ours
    for name in [*mine, neighbour]:
        Segment.create(name, 4096).close()
    try:
        assert sorted(cleanup_stale(shm_prefix)) == sorted(mine)
        assert segment_names(shm_prefix) == (neighbour,)
    finally:
        posix_ipc.unlink_shared_memory(neighbour)


def test_cleanup_stale_with_nothing_there_is_a_no_op(shm_prefix: str) -> None:
    assert cleanup_stale(shm_prefix) == []


def test_enospc_from_fallocate_is_segment_full_and_leaves_nothing(
    shm_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(segment_mod.os, "posix_fallocate", full)
    with pytest.raises(SegmentFull, match=r"/dev/shm is full .*--shm-size"):
        ControlTable.create(shm_prefix)
    assert segment_names(shm_prefix) == ()


def test_other_fallocate_errors_propagate_and_leave_nothing(shm_prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(segment_mod.os, "posix_fallocate", broken)
    with pytest.raises(OSError, match="I/O error"):
        Segment.create(f"/{shm_prefix}-x", 4096)
    assert segment_names(shm_prefix) == ()


def test_segment_create_on_an_existing_name_is_file_exists(shm_prefix: str) -> None:
    seg = Segment.create(f"/{shm_prefix}-x", 4096)
    try:
        with pytest.raises(FileExistsError):
            Segment.create(f"/{shm_prefix}-x", 4096)
    finally:
        seg.close()
        seg.unlink()


def _copy_with(table: ControlTable, prefix: str, offset: int, fmt: str, value: int) -> Segment:
    """A copy of `table`'s segment under `prefix` with one header field overwritten."""
    copy = Segment.create(f"/{prefix}-ctl", table._segment.size)
    copy.mm[:] = table._segment.mm[:]
    struct.pack_into(fmt, copy.mm, offset, value)
    return copy


@pytest.mark.parametrize(
    ("offset", "fmt", "value", "message"),
    [
        (0, "<Q", 0x1122334455667788, r"bad magic 0x1122334455667788 .*not a shmdisagg control segment"),
        (layout.VERSION_OFFSET, "<I", 9, "layout version 9, but this build reads version 5"),
        (layout.VERSION_OFFSET, "<I", 4, "layout version 4, but this build reads version 5"),
    ],
    ids=["magic", "version", "v4_one_word_server_sets"],
)
def test_attaching_a_corrupt_copy_is_layout_mismatch(
    shm_prefix: str, offset: int, fmt: str, value: int, message: str
) -> None:
    copy_prefix = f"{shm_prefix}-copy"
    with ControlTable.create(shm_prefix) as table:
        copy = _copy_with(table, copy_prefix, offset, fmt, value)
        try:
            with pytest.raises(LayoutMismatch, match=message):
                ControlTable.attach(copy_prefix, timeout=0.0)
            assert segment_names(copy_prefix) == (copy.name,)  # attach never unlinks
        finally:
            copy.close()
            copy.unlink()
        table.unlink()


def test_attach_waits_a_bounded_time_for_ready(shm_prefix: str) -> None:
    with ControlTable.create(shm_prefix) as table:
        copy = _copy_with(table, f"{shm_prefix}-copy", layout.INIT_STATE_OFFSET, "<Q", 0)
        try:
            with pytest.raises(SegmentNotReady, match="READY"):
                ControlTable.attach(f"{shm_prefix}-copy", timeout=0.05)
        finally:
            copy.close()
            copy.unlink()
        table.unlink()


def test_attach_to_an_unsized_segment_is_not_ready(shm_prefix: str) -> None:
    # The window between the creator's O_CREX and its posix_fallocate.
    shm = posix_ipc.SharedMemory(f"/{shm_prefix}-ctl", posix_ipc.O_CREX, mode=0o600)
    try:
        with pytest.raises(SegmentNotReady, match="0 bytes"):
            ControlTable.attach(shm_prefix, timeout=0.02)
    finally:
        shm.close_fd()
        shm.unlink()


def test_read_only_attach_reads_but_refuses_worker_writes(shm_prefix: str) -> None:
    with ControlTable.create(shm_prefix) as table:
        table.publish_server(0, "a:1", 0, True)
        with ControlTable.attach(shm_prefix, read_only=True) as reader:
            assert [s.addr for s in reader.servers()] == ["a:1"]
            with pytest.raises(ShmError, match="read-only"):
                reader.claim_row(os.getpid(), 1)
        table.unlink()


def test_coordinator_only_methods_refuse_an_attached_table(shm_prefix: str) -> None:
    with ControlTable.create(shm_prefix) as table, ControlTable.attach(shm_prefix) as worker:
        with pytest.raises(ShmError, match="only the coordinator"):
            worker.publish_server(0, "a:1", 0, True)
        with pytest.raises(ShmError, match="only the coordinator"):
            worker.reclaim_row(0)
        table.unlink()


HUGE = 2 << 20


def pmd_mapped_bytes(address: int) -> int:
    """ShmemPmdMapped of this process's mapping that starts at `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            if line.startswith(f"{address:x}-"):
                inside = True
            elif inside and line.startswith("ShmemPmdMapped:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping at {address:#x}")


def test_huge_segments_map_2mib_aligned_and_close_like_mmap(shm_prefix: str) -> None:
    size = HUGE + 4096  # a whole 2 MiB range and a 4 KiB tail
    seg = Segment.create(f"/{shm_prefix}-idx-1", size, huge=True)
    other = Segment.attach(seg.name, huge=True, min_size=size)
    try:
        assert seg.size == other.size == size == os.stat(shm_path(seg.name)).st_size
        assert isinstance(seg.mm, _native.SharedMapping)
        assert seg.mm.address % HUGE == 0 and other.mm.address % HUGE == 0
        assert seg.huge_bytes in (0, HUGE) and other.huge_bytes == 0
        seg.mm[size - 8 : size] = b"lastword"  # both processes' views are the same file
        seg.mm[7] = 42
        assert other.mm[size - 8 :] == b"lastword" and other.mm[7] == 42 and other.mm[0:7] == bytes(7)
        view = memoryview(other.mm)
        with pytest.raises(BufferError):
            other.close()  # as mmap.mmap: not while a buffer is exported
        view.release()
        other.close()
        other.close()  # idempotent
        assert other.mm.closed and len(other.mm) == 0
        with pytest.raises(ValueError):
            memoryview(other.mm)
    finally:
        seg.close()
        seg.unlink()


def test_read_only_huge_attach_refuses_writes(shm_prefix: str) -> None:
    seg = Segment.create(f"/{shm_prefix}-idx-1", 8192, huge=True)
    ro = Segment.attach(seg.name, read_only=True, huge=True)
    try:
        with pytest.raises(TypeError):
            ro.mm[0] = 1
        with pytest.raises(TypeError):
            memoryview(ro.mm)[0] = 1
        assert ro.mm[0] == 0
    finally:
        ro.close()
        seg.close()
        seg.unlink()


def test_enospc_while_seeding_huge_pages_is_segment_full_and_leaves_nothing(
    shm_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(segment_mod, "seed_huge", full)
    with pytest.raises(SegmentFull, match=r"/dev/shm is full"):
        Segment.create(f"/{shm_prefix}-idx-1", 3 * HUGE, huge=True)
    assert segment_names(shm_prefix) == ()


def test_the_index_is_on_huge_pages_in_every_process_that_maps_it(shm_prefix: str) -> None:
    # The coordinator collapses a new generation onto 2 MiB pages (MADV_COLLAPSE) and every
    # process maps it 2 MiB-aligned, so a worker's page walks are one level shorter
    # (native/mapping.c). Where the kernel refuses huge tmpfs pages, the index is on 4 KiB pages.
    table = ControlTable.create(shm_prefix, max_workers=4)
    index = BlockIndex.create(table, IndexSettings(capacity=1 << 18, max_capacity=1 << 18))  # 8 MiB + 4 KiB
    worker_table = ControlTable.attach(shm_prefix)
    worker = BlockIndex.attach(worker_table)
    try:
        if index.huge_bytes == 0:
            pytest.skip("this kernel puts no tmpfs pages on 2 MiB pages (MADV_COLLAPSE refused)")
        assert index.huge_bytes == 4 * HUGE  # every whole 2 MiB range; the 4 KiB tail stays small
        mm = worker._segment.mm
        assert isinstance(mm, _native.SharedMapping) and mm.address % HUGE == 0
        with memoryview(mm) as view:
            assert len(view[::4096].tobytes()) == len(range(0, len(mm), 4096))  # faults every page in
        assert pmd_mapped_bytes(mm.address) == 4 * HUGE
    finally:
        worker.close()
        worker_table.close()
        index.close()
        index.unlink()
        table.unlink()
        table.close()
