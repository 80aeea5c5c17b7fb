"""Typed face of `shmdisagg._native` (built from native/_native.c; layout in native/README.md).

Units: every `*_ns` is CLOCK_MONOTONIC nanoseconds (time.monotonic_ns) unless named `wall`;
sizes are bytes; `tokens` are prompt tokens. Slots are 0..MAX_SERVERS-1, roles 0 (context) and
1 (generation). All calls keep the GIL and take well under a microsecond.
"""

from typing_extensions import Buffer

MAGIC: int
LAYOUT_VERSION: int
HEADER_BYTES: int
MAX_SERVERS: int
MAX_ROLES: int
MAX_WORKERS_LIMIT: int
SERVER_STRIDE: int
WORKER_STRIDE: int
OFF_COORD: int
OFF_CONFIG: int
OFF_RR: int
OFF_ROWS_LINE: int
OFF_RETIRED: int
OFF_SERVERS: int
OFF_WORKERS: int
SEQ_TRIES: int
FLAG_PRESENT: int
FLAG_HEALTHY: int
ROLE_SHIFT: int
ADDR_BYTES: int
H_INIT: int
H_VERSION: int
S_SEQ: int
CFG_SEQ: int

class ShmError(Exception):
    """Shared-memory failure (also: region read-only, or not validated yet)."""

class LayoutMismatch(ShmError):
    """The segment header does not describe this build's layout; the message names the field."""

class RetryExhausted(ShmError):
    """A seqlocked record stayed odd for SEQ_TRIES tries: its writer died mid-write or is stalled."""

class SegmentFull(ShmError):
    """No room: /dev/shm is full, the mapping is too small, or every worker row is claimed."""

class RowLost(ShmError):
    """The worker row is not owned by this Region (never claimed here, or reclaimed since)."""

def control_size(max_workers: int) -> int:
    """Logical control-segment size in bytes for `max_workers` rows (ValueError if not 1..4096)."""

class Region:
    """Atomic access to one mapped control segment.

    Holds a buffer export of `buffer` until `release()` or deallocation, so the mmap cannot be
    closed underneath (mmap.close() raises BufferError meanwhile). Read-only regions
    (`writable=False`) refuse every store and read-modify-write with ShmError.
    ValueError: released region, out-of-range slot/row/role, negative tokens, unaligned buffer.
    """

    def __init__(self, buffer: Buffer, writable: bool = True) -> None: ...
    @property
    def size(self) -> int:
        """Mapped length in bytes; 0 once released."""
    @property
    def max_workers(self) -> int:
        """Worker rows of the validated segment; 0 before init_control/check_control."""
    @property
    def stats(self) -> dict[str, int]:
        """Process-local counters: "seq_retries", "config_fallbacks" (picks served from cache)."""
    def release(self) -> None:
        """Drop the buffer export; every later call raises ValueError. Idempotent."""
    # -- lifecycle
    def init_control(self, max_workers: int, created_wall_ns: int, /) -> int:
        """Zero and initialise a fresh segment, init_state=READY stored last (release).

        Returns the logical size. SegmentFull if the mapping is smaller than control_size().
        """
    def check_control(self) -> bool:
        """Validate an attached segment. False: not READY yet (retry). LayoutMismatch: bad header."""
    # -- coordinator line (coordinator writes; relaxed words)
    def set_coord(self, pid: int, starttime: int, incarnation: int, /) -> None: ...
    def set_coord_heartbeat(self, mono_ns: int, /) -> None: ...
    def set_coord_state(self, state: int, /) -> None: ...
    def coord(self) -> tuple[int, int, int, int, int]:
        """(pid, starttime, incarnation, heartbeat_ns, state)."""
    # -- config block and server records (coordinator writes; seqlocked)
    def read_config(self) -> tuple[int, int, int, int, int]:
        """(present_mask, healthy_mask, context_mask, generation_mask, servers_version).

        RetryExhausted if the sequence stays odd.
        """
    def servers_version(self) -> int:
        """servers_version (one acquire load; no seqlock needed for a single word)."""
    def write_server(
        self, slot: int, flags: int, max_batch_size: int, tokens_per_block: int, max_num_tokens: int, addr: bytes, /
    ) -> int:
        """Rewrite record `slot` (incarnation+1, health time now) then the config masks.

        Returns the new incarnation. ValueError: addr over 127 bytes or containing NUL, role >= 2.
        """
    def set_server_flags(self, slot: int, flags: int, /) -> int:
        """Set present/healthy/role of `slot` (record, then config masks); returns servers_version."""
    def read_server(self, slot: int, /) -> tuple[int, int, int, int, int, int, int, bytes]:
        """(incarnation, flags, weight, health_ns, max_batch_size, tokens_per_block, max_num_tokens,
        addr). RetryExhausted if the record's sequence stays odd."""
    # -- worker rows
    def claim_row(self, pid: int, starttime: int, /) -> tuple[int, int]:
        """(row, token): CAS the first free row 0 -> (pid << 32 | seq). SegmentFull if none free."""
    def heartbeat(self, row: int, /) -> bool:
        """Store now in the own row; False if the row is no longer owned."""
    def reclaim_row(self, row: int, /) -> bool:
        """Coordinator: OWNED -> RECLAIMING, add routed/dispatched/completed to the retired totals,
        zero, release-store FREE. False if the row was not owned."""
    def rows(self) -> list[tuple[int, int, int, int, int, int, int]]:
        """Owned rows: (row, token, pid, starttime, heartbeat_ns, dispatched, completed)."""
    # -- picks (own row; RowLost if not owned; RetryExhausted only if no config copy ever read)
    def pick_round_robin(self, row: int, role: int, exclude_slot: int, tokens: int, /) -> int:
        """Global round robin over present & healthy & role - exclude; -1 if none. Adds the pick."""
    def pick_least_loaded(self, row: int, role: int, exclude_slot: int, tokens: int, use_tokens: bool, /) -> int:
        """Fewest active requests (tokens) over all owned rows; ties rotate by ticket; -1 if none."""
    def complete(self, row: int, slot: int, tokens: int, /) -> bool:
        """Undo one pick (+1 completed); False and no change if the row is no longer owned."""
    # -- stats
    def load(self, slot: int, /) -> tuple[int, int]:
        """(active_requests, active_tokens) of `slot` over owned rows."""
    def routed(self, slot: int, /) -> int:
        """Picks of `slot` over all rows plus the retired totals."""
    def retired(self) -> tuple[int, int]:
        """(dispatched, completed) retired from reclaimed rows."""
