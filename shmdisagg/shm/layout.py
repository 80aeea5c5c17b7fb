"""Names for the control-segment layout; the values live in `shmdisagg._native` (native/README.md).

Owns nothing and touches no memory: it only re-exports the C constants under Python names and
builds server-record flag words, so Python never hard-codes an offset the C code also knows.
"""

from __future__ import annotations

import mmap
from typing import NamedTuple

from shmdisagg import _native

MAGIC: int = _native.MAGIC
LAYOUT_VERSION: int = _native.LAYOUT_VERSION
HEADER_BYTES: int = _native.HEADER_BYTES
# Server slots: a table holds max_servers of them, a multiple of 64 (one 64-bit word of every
# server set) chosen at create, DEFAULT_MAX_SERVERS where the deployment needs no more.
MAX_SERVERS_LIMIT: int = _native.MAX_SERVERS_LIMIT
DEFAULT_MAX_SERVERS: int = _native.DEFAULT_MAX_SERVERS
MAX_ROLES: int = _native.MAX_ROLES
MAX_WORKERS_LIMIT: int = _native.MAX_WORKERS_LIMIT
SERVER_STRIDE: int = _native.SERVER_STRIDE
OFF_CONFIG: int = _native.OFF_CONFIG
SEQ_TRIES: int = _native.SEQ_TRIES
ADDR_MAX_BYTES: int = _native.ADDR_BYTES - 1

ROLE_CONTEXT = 0
ROLE_GENERATION = 1

COORD_STARTING = 0
COORD_RUNNING = 1
COORD_STOPPING = 2

_PRESENT: int = _native.FLAG_PRESENT
_HEALTHY: int = _native.FLAG_HEALTHY
_ROLE_SHIFT: int = _native.ROLE_SHIFT


def server_flags(present: bool, healthy: bool, role: int) -> int:
    """The u32 flags word of a server record: bit 0 present, bit 1 healthy, bits 8..15 role.

    Raises ValueError for a role other than ROLE_CONTEXT or ROLE_GENERATION.
    """
    if role not in (ROLE_CONTEXT, ROLE_GENERATION):
        raise ValueError(f"role must be ROLE_CONTEXT (0) or ROLE_GENERATION (1), not {role!r}")
    return (_PRESENT if present else 0) | (_HEALTHY if healthy else 0) | (role << _ROLE_SHIFT)


def split_flags(flags: int) -> tuple[bool, bool, int]:
    """(present, healthy, role) of a server record's flags word."""
    return bool(flags & _PRESENT), bool(flags & _HEALTHY), (flags >> _ROLE_SHIFT) & 0xFF


def check_max_servers(max_servers: int) -> int:
    """`max_servers` itself if a table can hold that many server slots: a multiple of 64 in
    64..MAX_SERVERS_LIMIT. Raises ValueError (one line) otherwise."""
    if max_servers % 64 or not 64 <= max_servers <= MAX_SERVERS_LIMIT:
        raise ValueError(f"must be a multiple of 64 in 64..{MAX_SERVERS_LIMIT}, not {max_servers}")
    return max_servers


def servers_for(executors: int) -> int:
    """The smallest table (max_servers) with room for `executors` server slots, at least
    DEFAULT_MAX_SERVERS; ValueError past MAX_SERVERS_LIMIT."""
    need = max(DEFAULT_MAX_SERVERS, -(-executors // 64) * 64)
    if need > MAX_SERVERS_LIMIT:
        raise ValueError(f"{executors} executors: a table holds at most {MAX_SERVERS_LIMIT}")
    return need


class ControlOffsets(NamedTuple):
    """Where a control segment's parts lie (bytes from its start; native `control_layout`)."""

    config: int  # the config block: seq, servers_version, then the masks (max_servers / 64 words each)
    retired: int  # retired_routed[max_servers]
    servers: int  # server records, SERVER_STRIDE bytes each
    workers: int  # worker rows
    worker_stride: int  # bytes per worker row
    size: int  # logical segment size


def control_offsets(max_servers: int = DEFAULT_MAX_SERVERS, max_workers: int = 1) -> ControlOffsets:
    """The layout of a control segment of `max_servers` slots and `max_workers` rows (ValueError
    if either is out of range)."""
    return ControlOffsets(*_native.control_layout(max_servers, max_workers))


def control_size(max_workers: int, max_servers: int = DEFAULT_MAX_SERVERS) -> int:
    """Logical size in bytes of a control segment with `max_workers` rows and `max_servers` server
    slots (ValueError if out of range)."""
    return int(_native.control_size(max_workers, max_servers))


def mapped_size(max_workers: int, max_servers: int = DEFAULT_MAX_SERVERS) -> int:
    """Bytes to allocate: `control_size` rounded up to whole pages (mmap.PAGESIZE, not 4096)."""
    page = mmap.PAGESIZE
    return -(-control_size(max_workers, max_servers) // page) * page


def server_seq_offset(slot: int, max_servers: int = DEFAULT_MAX_SERVERS) -> int:
    """Byte offset of server record `slot`'s sequence word (tests poke it to simulate a crash)."""
    return control_offsets(max_servers).servers + slot * SERVER_STRIDE + _native.S_SEQ


CONFIG_SEQ_OFFSET: int = OFF_CONFIG + _native.CFG_SEQ
INIT_STATE_OFFSET: int = _native.H_INIT
VERSION_OFFSET: int = _native.H_VERSION
INDEX_PUBLICATION_SEQ_OFFSET: int = _native.IP_SEQ

# -- KV block index segments ("/{prefix}-idx-{generation:x}") ------------------------------------

INDEX_MAGIC: int = _native.IX_MAGIC
INDEX_HEADER_BYTES: int = _native.IX_HEADER_BYTES
INDEX_SLOT_BYTES: int = _native.IX_SLOT_BYTES  # a slot where the table has 64 servers: index_slot_bytes
INDEX_MIN_CAPACITY: int = 1 << _native.IX_MIN_LOG2
INDEX_MAX_CAPACITY: int = 1 << _native.IX_MAX_LOG2
INDEX_NAME_MAX_BYTES: int = _native.IP_NAME_BYTES - 1
LAG_BUCKETS: int = _native.LAG_BUCKETS


def index_name(prefix: str, generation: int) -> str:
    """POSIX name of generation `generation` of the block index: "/{prefix}-idx-{generation:x}"."""
    return f"/{prefix.lstrip('/')}-idx-{generation:x}"


def index_slot_bytes(max_servers: int = DEFAULT_MAX_SERVERS) -> int:
    """Bytes of one index slot for a table of `max_servers` slots: the key, an event and a routed
    mask of max_servers / 64 words each, the stamp (32 for 64 servers, 80 for 256)."""
    return 16 + 16 * (check_max_servers(max_servers) // 64)


def index_size(capacity: int, max_servers: int = DEFAULT_MAX_SERVERS) -> int:
    """Bytes to allocate for an index of `capacity` slots (a power of two) beside a table of
    `max_servers` server slots, whole pages.

    Raises ValueError for a capacity that is not a power of two in the supported range, or a
    max_servers a table cannot have.
    """
    if capacity & (capacity - 1) or not INDEX_MIN_CAPACITY <= capacity <= INDEX_MAX_CAPACITY:
        raise ValueError(
            f"index capacity must be a power of two in {INDEX_MIN_CAPACITY}..{INDEX_MAX_CAPACITY}, not {capacity}"
        )
    page = mmap.PAGESIZE
    return -(-(INDEX_HEADER_BYTES + index_slot_bytes(max_servers) * capacity) // page) * page
