"""The control table: routing state shared by the coordinator and every fleet worker.

Owns the control segment "/{prefix}-ctl" through one `Segment` and one native `Region`. The
coordinator (the creator, holding the segment's flock) is the only writer of the coordinator line,
the server table and the retired totals; worker w writes only its own row (claimed here) plus the
shared round-robin tickets. All word access happens in `shmdisagg._native`; this module only
sequences calls and turns tuples into dataclasses. Coordinator methods are not thread-safe: call
them from one thread. Worker methods keep the GIL for their whole (sub-microsecond) native call.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import posix_ipc

from shmdisagg._native import Region
from shmdisagg.processes import process_starttime
from shmdisagg.shm.layout import (
    COORD_RUNNING,
    COORD_STARTING,
    COORD_STOPPING,
    DEFAULT_MAX_SERVERS,
    HEADER_BYTES,
    ROLE_CONTEXT,
    ROLE_GENERATION,
    mapped_size,
    server_flags,
    split_flags,
)
from shmdisagg.shm.segment import (
    DeploymentRunning,
    RetryExhausted,
    Segment,
    SegmentNotReady,
    ShmError,
    cleanup_stale,
    segment_names,
)

__all__ = [
    "COORD_RUNNING",
    "COORD_STARTING",
    "COORD_STOPPING",
    "ROLE_CONTEXT",
    "ROLE_GENERATION",
    "ControlTable",
    "RowInfo",
    "ServerInfo",
    "process_starttime",
]

_T = TypeVar("_T")
_READ_ATTEMPTS = 64  # native calls per read before RetryExhausted reaches the caller


@dataclass(frozen=True)
class ServerInfo:
    """One present server record; `incarnation` grows by one each time the slot is (re)published."""

    slot: int
    addr: str
    role: int
    present: bool
    healthy: bool
    incarnation: int
    max_batch_size: int
    tokens_per_block: int
    max_num_tokens: int


@dataclass(frozen=True)
class RowInfo:
    """One claimed worker row; `heartbeat_ns` is CLOCK_MONOTONIC (time.monotonic_ns)."""

    row: int
    pid: int
    token: int
    starttime: int
    heartbeat_ns: int
    dispatched: int
    completed: int
    fleet_index: int = -1  # the owner's index in the fleet; -1 when it gave none


def _retrying(fn: Callable[..., _T], *args: Any) -> _T:
    """Call a native seqlock read, yielding the CPU between tries; bounded (~ms) in total."""
    for _ in range(_READ_ATTEMPTS - 1):
        try:
            return fn(*args)
        except RetryExhausted:
            os.sched_yield()  # a preempted coordinator can hold a record odd for a time slice
    return fn(*args)


def _attach_ready(name: str, read_only: bool) -> tuple[Segment, Region]:
    """One attach attempt: a validated, READY region, or SegmentNotReady with nothing left mapped."""
    segment = Segment.attach(name, read_only=read_only, min_size=HEADER_BYTES)
    region = None
    try:
        region = Region(segment.mm, writable=not read_only)
        if region.check_control():
            return segment, region
        raise SegmentNotReady(f"{name}: its creator has not marked it READY")
    except BaseException:
        if region is not None:
            region.release()
        segment.close()
        raise


def _bits(mask: int) -> list[int]:
    return [s for s in range(mask.bit_length()) if mask >> s & 1]


class ControlTable:
    """A mapped control segment.

    Attributes:
        prefix: deployment prefix, e.g. "shmdisagg-1000-8000"; every segment is "/{prefix}-*".
        name: POSIX name of the control segment, "/{prefix}-ctl".
        max_workers: number of worker rows in the segment.
        max_servers: number of server slots (0..max_servers - 1), a multiple of 64 chosen at
            create; every server set in the segment and its KV index is that many bits wide.
    """

    def __init__(self, prefix: str, segment: Segment, region: Region) -> None:
        self.prefix = prefix
        self.name = segment.name
        self.max_workers: int = region.max_workers
        self.max_servers: int = region.max_servers
        self._segment = segment
        self._region = region

    # -- lifecycle ---------------------------------------------------------------------------

    @classmethod
    def create(cls, prefix: str, max_workers: int = 128, max_servers: int = DEFAULT_MAX_SERVERS) -> ControlTable:
        """Coordinator: remove a dead deployment's segments, then create, lock and init "-ctl"
        with `max_workers` rows and `max_servers` server slots (a multiple of 64 up to
        `layout.MAX_SERVERS_LIMIT`; 64 keeps every server set one word).

        Raises DeploymentRunning if a live coordinator holds the prefix, SegmentFull if /dev/shm
        has no room, ValueError if max_workers or max_servers is out of range.
        """
        size = mapped_size(max_workers, max_servers)
        cleanup_stale(prefix)
        name = f"/{prefix}-ctl"
        try:
            segment = Segment.create(name, size)
        except (FileExistsError, BlockingIOError, FileNotFoundError) as e:
            raise DeploymentRunning(f"another coordinator is starting on prefix {prefix!r}: {e}") from e
        try:
            region = Region(segment.mm)
            region.init_control(max_workers, time.time_ns(), max_servers)
        except BaseException:
            segment.close()
            segment.unlink()
            raise
        return cls(prefix, segment, region)

    @classmethod
    def adopt(cls, prefix: str, max_workers: int = 128, max_servers: int = DEFAULT_MAX_SERVERS) -> ControlTable:
        """A restarted coordinator: take over "-ctl" from a dead one, as the design notes
        describe (take the flock, check magic, layout version, owner and mode, repair what a
        write cut short left odd). The worker rows, server records, KV index publication and
        retired totals go on as they were; the caller stores its own coordinator line next.

        Raises FileNotFoundError if there is no "-ctl", DeploymentRunning if a live coordinator
        holds it, LayoutMismatch if another build made it, ShmError if its owner or mode is
        wrong, SegmentNotReady if it never became READY, has rows for another `max_workers` or
        slots for another `max_servers`, or its index publication was cut mid-write (start
        afresh then).
        """
        segment = Segment.adopt(f"/{prefix}-ctl")
        region = None
        try:
            region = Region(segment.mm)
            if not region.check_control():
                raise SegmentNotReady(f"{segment.name}: its creator died before marking it READY")
            if region.max_workers != max_workers:
                raise SegmentNotReady(
                    f"{segment.name}: {region.max_workers} worker rows, the config asks for {max_workers}"
                )
            if region.max_servers != max_servers:
                raise SegmentNotReady(
                    f"{segment.name}: {region.max_servers} server slots, the config asks for {max_servers} "
                    "(shmdisagg.shm.max_servers)"
                )
            table = cls(prefix, segment, region)
            table._repair()
        except BaseException:
            if region is not None:
                region.release()
            segment.close()
            raise
        return table

    def _repair(self) -> None:
        """After adoption: a seqlocked block left odd by the dead writer is rewritten whole (a
        server record that cannot be read is removed: the coordinator registers it again)."""
        region = self._region
        try:
            _retrying(region.index_publication)
        except RetryExhausted:
            raise SegmentNotReady(f"{self.name}: the index publication was cut mid-write") from None
        records: list[int | None] = []
        torn = False
        for slot in range(self.max_servers):
            try:
                records.append(_retrying(region.read_server, slot)[1])
            except RetryExhausted:
                records.append(None)
                torn = True
        try:
            _retrying(region.read_config)
        except RetryExhausted:
            torn = True
        if torn:  # rebuild the config block bit by bit from the records (each call rewrites both)
            for slot, flags in enumerate(records):
                region.set_server_flags(slot, flags if flags is not None and split_flags(flags)[0] else 0)

    @classmethod
    def attach(cls, prefix: str, *, timeout: float = 2.0, read_only: bool = False) -> ControlTable:
        """Worker or reader: map "/{prefix}-ctl" and wait (at most `timeout` s) for it to be READY.

        Raises FileNotFoundError if no coordinator created it, LayoutMismatch if its header does
        not match this build, SegmentNotReady if it is still not READY after `timeout`, ShmError
        if its owner or mode is wrong.
        """
        name = f"/{prefix}-ctl"
        deadline = time.monotonic() + timeout
        while True:
            try:
                segment, region = _attach_ready(name, read_only)
                return cls(prefix, segment, region)
            except SegmentNotReady:
                if time.monotonic() >= deadline:
                    raise
            time.sleep(0.001)  # the creator is between O_CREX and its READY store

    def close(self) -> None:
        """Release the native view and unmap (the coordinator also drops its flock). Idempotent."""
        self._region.release()
        self._segment.close()

    def unlink(self) -> None:
        """Coordinator: unlink every "/{prefix}-*" segment; live mappings stay valid until closed."""
        for name in segment_names(self.prefix + "-"):
            try:
                posix_ipc.unlink_shared_memory(name)
            except posix_ipc.ExistentialError:
                pass

    def __enter__(self) -> ControlTable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- coordinator only --------------------------------------------------------------------

    def _writer(self) -> Region:
        if not self._segment.owner:
            raise ShmError(f"{self.name}: only the coordinator that created it may write this")
        return self._region

    def set_coordinator(self, pid: int, starttime: int, incarnation: int) -> None:
        """Store the coordinator's identity; `incarnation` is a fresh random 64-bit value per start."""
        self._writer().set_coord(pid, starttime, incarnation)

    def coord_heartbeat(self) -> None:
        """Store time.monotonic_ns() as the coordinator heartbeat."""
        self._writer().set_coord_heartbeat(time.monotonic_ns())

    def set_coord_state(self, state: int) -> None:
        """COORD_STARTING, COORD_RUNNING or COORD_STOPPING."""
        self._writer().set_coord_state(state)

    def publish_server(
        self,
        slot: int,
        addr: str,
        role: int,
        healthy: bool,
        *,
        max_batch_size: int = 0,
        tokens_per_block: int = 0,
        max_num_tokens: int = 0,
    ) -> int:
        """Write server `slot` (0..max_servers - 1) as present; returns its new incarnation.

        Bumps the incarnation and servers_version. Raises ValueError for a bad slot or role, or an
        address over 127 bytes of UTF-8.
        """
        flags = server_flags(True, healthy, role)
        return int(
            self._writer().write_server(slot, flags, max_batch_size, tokens_per_block, max_num_tokens, addr.encode())
        )

    def set_healthy(self, slot: int, healthy: bool) -> None:
        """Mark a present server healthy or not; bumps servers_version. ValueError if not present."""
        region = self._writer()
        present, _, role = split_flags(_retrying(region.read_server, slot)[1])
        if not present:
            raise ValueError(f"server slot {slot} is not present")
        region.set_server_flags(slot, server_flags(True, healthy, role))

    def remove_server(self, slot: int) -> None:
        """Clear server `slot` from the present/healthy/role masks; bumps servers_version."""
        self._writer().set_server_flags(slot, 0)

    def reclaim_row(self, row: int) -> bool:
        """Reclaim a dead worker's row: retire its routed/dispatched/completed totals, zero it.

        Exact: the row is the worker's whole contribution. False if the row was not owned.
        """
        return bool(self._writer().reclaim_row(row))

    def reclaim_rows_of_pid(self, pid: int) -> int:
        """Reclaim every row owned by `pid`; returns how many were reclaimed."""
        return sum(self.reclaim_row(r.row) for r in self.rows() if r.pid == pid)

    # -- any process -------------------------------------------------------------------------

    def servers(self) -> list[ServerInfo]:
        """Present servers, one consistent snapshot (servers_version unchanged while reading).

        Raises RetryExhausted if a record stays mid-write (dead coordinator) or the table keeps
        changing for the whole bounded retry budget.
        """
        region = self._region
        for _ in range(_READ_ATTEMPTS):
            present, healthy, _, _, version = _retrying(region.read_config)
            out = []
            for slot in _bits(present):
                inc, flags, _, _, mb, tpb, mnt, addr = _retrying(region.read_server, slot)
                _, _, role = split_flags(flags)
                out.append(
                    ServerInfo(
                        slot, addr.decode(errors="replace"), role, True, bool(healthy >> slot & 1), inc, mb, tpb, mnt
                    )
                )
            if region.servers_version() == version:
                return out
        raise RetryExhausted(f"{self.name}: server table changed during {_READ_ATTEMPTS} snapshots")

    def servers_version(self) -> int:
        """Counter bumped by every server-table change (one acquire load)."""
        return int(self._region.servers_version())

    def coordinator(self) -> dict[str, int]:
        """{"pid", "starttime", "incarnation", "heartbeat_ns", "state"} of the coordinator line."""
        pid, starttime, incarnation, heartbeat_ns, state = self._region.coord()
        return {
            "pid": pid,
            "starttime": starttime,
            "incarnation": incarnation,
            "heartbeat_ns": heartbeat_ns,
            "state": state,
        }

    def rows(self) -> list[RowInfo]:
        """Claimed worker rows (rows being reclaimed are left out)."""
        return [
            RowInfo(row, pid, token, start, hb, disp, comp, fleet)
            for row, token, pid, start, hb, disp, comp, fleet in self._region.rows()
        ]

    def load(self, slot: int) -> tuple[int, int]:
        """(active requests, active tokens) of server `slot`, summed over claimed rows."""
        return self._region.load(slot)

    def routed(self, slot: int) -> int:
        """Total picks of server `slot`: all rows plus retired totals of reclaimed rows.

        Stats only: a reader racing a reclaim may count that row's picks twice for a moment.
        """
        return int(self._region.routed(slot))

    def retired(self) -> tuple[int, int]:
        """(dispatched, completed) totals retired from reclaimed rows."""
        return self._region.retired()

    @property
    def stats(self) -> dict[str, int]:
        """Process-local counters: seqlock retries, picks served from the last good config copy."""
        return self._region.stats

    def index_publication(self) -> tuple[int, int, int, str]:
        """(generation, capacity, segment_bytes, name) of the published block index; generation 0
        while none is published. See `shmdisagg.shm.index.BlockIndex`."""
        gen, cap, nbytes, name = _retrying(self._region.index_publication)
        return int(gen), int(cap), int(nbytes), name.decode(errors="replace")

    def index_metrics(self) -> dict[str, Any]:
        """The block index metrics kept in the control segment (counters are monotonic; derive
        rates by differencing). "lag_hist" counts event-to-visibility lags in log-linear ns buckets
        (edges: `shmdisagg.shm.index.lag_bucket_edges`)."""
        return self._region.index_metrics()

    # -- worker only (own row) ----------------------------------------------------------------

    def claim_row(self, pid: int, starttime: int, fleet_index: int = -1) -> int:
        """Claim the first free row for `pid` (CAS); returns the row. SegmentFull if none is free.
        `fleet_index`: the worker's index in the fleet, recorded for a restarted coordinator."""
        row, _token = self._region.claim_row(pid, starttime, fleet_index)
        return int(row)

    def heartbeat(self, row: int) -> bool:
        """Store time.monotonic_ns() in the own row; False if the row was reclaimed (claim anew)."""
        return bool(self._region.heartbeat(row))

    def pick_round_robin(self, row: int, role: int, exclude_slot: int, tokens: int) -> int:
        """Next server of `role` in ONE round robin shared by all workers; -1 if no candidate.

        Candidates: present, healthy, of `role`, not `exclude_slot` (-1: none). Adds the pick
        (+1 request, +tokens, +1 routed, +1 dispatched) to the own row in the same call. Raises
        RowLost if the row is not ours, RetryExhausted if no config copy was ever readable.
        """
        return self._region.pick_round_robin(row, role, exclude_slot, tokens)

    def pick_least_loaded(self, row: int, role: int, exclude_slot: int, tokens: int, use_tokens: bool) -> int:
        """Candidate with the fewest active requests (or tokens) over all rows; -1 if none.

        Ties rotate with the role's round-robin ticket. Adds the pick to the own row as
        `pick_round_robin` does and raises the same errors.
        """
        return self._region.pick_least_loaded(row, role, exclude_slot, tokens, use_tokens)

    def release(self, row: int, slot: int, tokens: int) -> bool:
        """Undo one pick (-1 request, -tokens, +1 completed) when its request ends, exactly once.

        Returns False and changes nothing if the row was reclaimed since (its counts are gone).
        """
        return bool(self._region.complete(row, slot, tokens))
