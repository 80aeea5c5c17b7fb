"""Typed face of `shmdisagg._native` (built from native/*.c; layouts in native/README.md).

Units: every `*_ns` is CLOCK_MONOTONIC nanoseconds (time.monotonic_ns) unless named `wall` or
`event_ts_ns` (wall clock, time.time_ns()); sizes are bytes; `tokens` are prompt tokens. Slots
are 0..max_servers-1 (a control segment's server slots, a multiple of 64 up to MAX_SERVERS_LIMIT
chosen at init_control), roles 0 (context) and 1 (generation). Server sets (masks) are ints of
max_servers bits, bit s for slot s. Block hashes travel as `bytes` of
packed little-endian u64 ("hashes"). Region calls keep the GIL and take well under a microsecond;
Index picks and hashing scale with the prompt (native/README.md, "Measured cost"); only
`Index.sweep`, `Index.copy_into` and `Index.init_index` (on large tables), `SharedMapping.collapse`
and `seed_huge` release the GIL.
"""

from collections.abc import Sequence
from typing import Any

from typing_extensions import Buffer

Tokens = Sequence[int] | Buffer  # a list of ints, or a buffer of 4- or 8-byte integers

MAGIC: int
LAYOUT_VERSION: int
HEADER_BYTES: int
MAX_SERVERS_LIMIT: int  # the widest table: 256 server slots
DEFAULT_MAX_SERVERS: int  # 64: one word per server set
MAX_ROLES: int
MAX_WORKERS_LIMIT: int
SERVER_STRIDE: int
OFF_COORD: int
OFF_CONFIG: int  # the config block, first past the header; the rest: control_layout()
OFF_RR: int
OFF_ROWS_LINE: int
SEQ_TRIES: int
FLAG_PRESENT: int
FLAG_HEALTHY: int
ROLE_SHIFT: int
ADDR_BYTES: int
H_INIT: int
H_VERSION: int
S_SEQ: int
CFG_SEQ: int
OFF_IDXPUB: int
IP_GEN: int
IP_SEQ: int
IP_NAME_BYTES: int
OFF_IDXMET: int
OFF_LAGHIST: int
LAG_BUCKETS: int
IX_MAGIC: int
IX_VERSION: int
IX_HEADER_BYTES: int
IX_SLOT_BYTES: int  # 32: a slot beside a table of 64 servers; 16 + 16 x max_servers / 64 in general
IX_MIN_LOG2: int
IX_MAX_LOG2: int
REFRESH_NS: int
IX_JUMP: int  # pick_kv probes one block per IX_JUMP (a power of two), then bisects

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

def control_size(max_workers: int, max_servers: int = 64, /) -> int:
    """Logical control-segment size in bytes for `max_workers` rows and `max_servers` server slots
    (ValueError if max_workers is not 1..4096 or max_servers not a multiple of 64 in 64..256)."""

def control_layout(max_servers: int, max_workers: int, /) -> tuple[int, int, int, int, int, int]:
    """(off_config, off_retired, off_servers, off_workers, worker_stride, segment_bytes) in bytes
    of a control segment of that many server slots and worker rows (ValueError as control_size)."""

def block_hashes_v1(tokens: Tokens, tokens_per_block: int, salt_id: int | None = None) -> bytes:
    """TensorRT-LLM v1_block_key keys of the prompt's blocks (last token excluded, final partial
    block kept), u64 LE each. TypeError: a token that is not an int, a buffer of other items;
    ValueError: tokens_per_block not in 1..2**20, salt_id not a u64."""

def block_hashes_v2(
    tokens: Tokens,
    tokens_per_block: int,
    salt_id: int | None = None,
    lora_id: int | None = None,
    token_bytes: int = 4,
) -> bytes:
    """KV cache manager V2 SHA-256 block keys, 32 bytes each. ValueError: a token id that does not
    fit token_bytes (4: 0..2**32-1), token_bytes not 4 or 8."""

def block_hashes_v2_64(
    tokens: Tokens,
    tokens_per_block: int,
    salt_id: int | None = None,
    lora_id: int | None = None,
    token_bytes: int = 4,
) -> bytes:
    """v2_sha256_64: each V2 key's first 8 bytes read big-endian, packed u64 LE."""

def _sha256_impl(force_portable: bool | None = None, /) -> str:
    """The SHA-256 transform in use ("shani" or "portable"); True forces the portable one (tests)."""

def _v1_impl(force_portable: bool | None = None, /) -> str:
    """The v1 hashing and prefix-cache fingerprint code in use ("avx2" or "portable"); True forces
    the portable code (tests: both give the same keys and fingerprints), False the fastest again."""

class PrefixHashCache:
    """v1 block keys cached by prompt prefix (process-local, keeps the GIL).

    `block_hashes` returns exactly block_hashes_v1(tokens, tokens_per_block, salt_id), hashing
    only the blocks past the deepest cached prefix (checkpoints every 16 blocks).
    """

    def __init__(self, tokens_per_block: int, max_blocks: int = 2**21, seed: int | None = None) -> None:
        """ValueError: tokens_per_block not in 1..2**20 or max_blocks not in 16..2**32."""
    @property
    def tokens_per_block(self) -> int: ...
    @property
    def stats(self) -> dict[str, int]:
        """ "calls", "full_hits", "blocks_reused", "blocks_hashed" (process-local)."""
    def block_hashes(self, tokens: Tokens, salt_id: int | None = None) -> bytes: ...
    def clear(self) -> None: ...

def seed_huge(fd: int, length: int, /) -> None:
    """Give a new shared-memory file its size (`length` bytes) and one allocated 4 KiB page at the
    start of every 2 MiB range (posix_fallocate, no page touched), so that
    `SharedMapping.collapse` can put it on huge pages. OSError (ENOSPC: the tmpfs is full);
    ValueError for a negative fd or a length <= 0."""

class SharedMapping:
    """A MAP_SHARED mapping of `length` bytes of `fd` at a 2 MiB-aligned address (native/mapping.c),
    so that a file on 2 MiB pages maps with PMD entries. Buffer protocol (read-only unless
    `writable`), `m[i]`, `m[a:b]` and slice assignment of the same length, as mmap.mmap.
    `close()` unmaps (idempotent) and raises BufferError while a buffer is exported.
    OSError: the mmap failed; ValueError: length <= 0, or use after close."""

    def __init__(self, fd: int, length: int, writable: bool = True) -> None: ...
    def __len__(self) -> int:
        """Mapped length in bytes; 0 once closed."""
    def __getitem__(self, key: int | slice) -> Any: ...
    def __setitem__(self, key: int | slice, value: Any) -> None: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...
    @property
    def closed(self) -> bool: ...
    @property
    def address(self) -> int:
        """Start address (a multiple of 2 MiB); 0 once closed."""
    def close(self) -> None: ...
    def collapse(self) -> int:
        """Put the mapped file on 2 MiB pages where the kernel allows it (MADV_COLLAPSE per whole
        2 MiB range, Linux >= 6.1; the GIL released): returns the bytes now on huge pages, 0
        where it cannot (older kernel, tmpfs huge pages `deny`, no free 2 MiB of memory)."""

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
    def max_servers(self) -> int:
        """Server slots of the validated segment (a multiple of 64); 0 before init_control/check_control."""
    @property
    def stats(self) -> dict[str, int]:
        """Process-local counters: "seq_retries", "config_fallbacks" (picks served from cache)."""
    def release(self) -> None:
        """Drop the buffer export; every later call raises ValueError. Idempotent."""
    # -- lifecycle
    def init_control(self, max_workers: int, created_wall_ns: int, max_servers: int = 64, /) -> int:
        """Zero and initialise a fresh segment of `max_workers` rows and `max_servers` server slots
        (a multiple of 64 in 64..MAX_SERVERS_LIMIT), init_state=READY stored last (release).

        Returns the logical size. SegmentFull if the mapping is smaller than control_size();
        ValueError for a count out of range.
        """
    def check_control(self) -> bool:
        """Validate an attached segment. False: not READY yet (retry). LayoutMismatch: bad header
        (another layout version, a max_servers or offsets that are not this build's layout)."""
    # -- coordinator line (coordinator writes; relaxed words)
    def set_coord(self, pid: int, starttime: int, incarnation: int, /) -> None: ...
    def set_coord_heartbeat(self, mono_ns: int, /) -> None: ...
    def set_coord_state(self, state: int, /) -> None: ...
    def coord(self) -> tuple[int, int, int, int, int]:
        """(pid, starttime, incarnation, heartbeat_ns, state)."""
    # -- config block and server records (coordinator writes; seqlocked)
    def read_config(self) -> tuple[int, int, int, int, int]:
        """(present_mask, healthy_mask, context_mask, generation_mask, servers_version); the masks
        are ints of max_servers bits.

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
    def claim_row(self, pid: int, starttime: int, fleet_index: int = -1, /) -> tuple[int, int]:
        """(row, token): CAS the first free row 0 -> (pid << 32 | seq), recording `fleet_index`
        (-1: none). SegmentFull if none free."""
    def heartbeat(self, row: int, /) -> bool:
        """Store now in the own row; False if the row is no longer owned."""
    def reclaim_row(self, row: int, /) -> bool:
        """Coordinator: OWNED -> RECLAIMING, add routed/dispatched/completed to the retired totals,
        zero, release-store FREE. False if the row was not owned."""
    def rows(self) -> list[tuple[int, int, int, int, int, int, int, int]]:
        """Owned rows: (row, token, pid, starttime, heartbeat_ns, dispatched, completed,
        fleet_index), fleet_index -1 when the owner gave none."""
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
    # -- block index publication and metrics
    def publish_index(self, generation: int, capacity: int, segment_bytes: int, name: bytes, /) -> None:
        """Coordinator: seqlock-write the index generation workers must map (after its PUBLISHED
        state). ValueError: generation 0, name empty, over 63 bytes or containing NUL."""
    def index_publication(self) -> tuple[int, int, int, bytes]:
        """(generation, capacity, segment_bytes, name); generation 0: none published. RetryExhausted."""
    def index_generation(self) -> int:
        """The published generation (one acquire load)."""
    def count_index_dropped(self, n: int, /) -> None:
        """Coordinator: count KV events the ingest dropped (unknown server, malformed)."""
    def index_metrics(self) -> dict[str, object]:
        """The index metrics (ints) plus "lag_hist": list of LAG_BUCKETS counts
        (log-linear ns buckets: `shmdisagg.shm.index.lag_bucket_edges`)."""

class Index:
    """One mapped KV block index segment, routing with the control `Region` it is given.

    Holds a buffer export and a reference to `control` until `release()`. Coordinator-only calls
    (init/publish/retire, apply_*, clear_server, sweep, copy_into) are not enforced here:
    `shmdisagg.shm.index.BlockIndex` enforces them. Picks return None when the control segment
    publishes another generation (remap and call again).
    """

    def __init__(self, buffer: Buffer, control: Region, writable: bool = True) -> None:
        """ValueError: buffer not 8-byte aligned, control region released or not validated."""
    @property
    def generation(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def insert_limit(self) -> int: ...
    @property
    def used(self) -> int:
        """Keys stored plus reservations in flight."""
    @property
    def max_probe(self) -> int: ...
    @property
    def state(self) -> int:
        """0 building, 1 published, 2 retired."""
    @property
    def size(self) -> int: ...
    def release(self) -> None:
        """Drop the buffer export and the control reference. ShmError while a GIL-free call runs."""
    # -- lifecycle (coordinator)
    def init_index(self, generation: int, cap_log2: int, insert_limit: int, created_wall_ns: int, /) -> int:
        """Zero and initialise a fresh segment (state BUILDING) of slots as wide as the control
        segment's server sets (16 + 16 x max_servers / 64 bytes); returns its logical size.
        SegmentFull: mapping too small. ValueError: generation 0, cap_log2 not in 4..32."""
    def check_index(self) -> bool:
        """True: valid and published (or retired); False: still BUILDING. LayoutMismatch (also
        when its slot width is not the control segment's)."""
    def publish(self) -> None: ...
    def retire(self) -> None: ...
    def observe(self, row: int, /) -> bool:
        """Store this generation as the own row's observed_idx_gen; False if the row was lost."""
    # -- KV events and maintenance (coordinator)
    def apply_stored(self, slot: int, hashes: Buffer, event_ts_ns: int, /) -> int:
        """Set slot's event bit on every hash (inserting absent ones); returns blocks marked.
        event_ts_ns: executor wall-clock time of the event, 0 if unknown (no lag sample)."""
    def apply_removed(self, slot: int, hashes: Buffer, /) -> int:
        """Clear slot's event and routed bits on every hash found; returns how many were found."""
    def apply_all_cleared(self, slot: int, /) -> int:
        """Clear slot's bits on every block (not sessions); returns slots changed."""
    def clear_server(self, slot: int, /) -> int:
        """Clear slot's bits on every block and conversation session; returns slots changed."""
    def sweep(self, now_ns: int, routed_ttl_ns: int, max_sessions: int, max_implicit: int, /) -> dict[str, int]:
        """Expire routed bits older than routed_ttl_ns (0: never), evict the oldest sessions and
        implicit entries beyond the bounds; returns and stores the census: used, live, dead,
        sessions, implicit_entries, routed_expired, evicted, max_probe, reserved."""
    def scan(self) -> dict[str, Any]:
        """The census, read-only, plus "server_blocks": a list of max_servers counts of block
        entries a KV event confirmed on each server slot."""
    def copy_into(self, dst: Index, /) -> tuple[int, int]:
        """(copied, refused): every live key with its masks and stamp into a BUILDING index."""
    def lookup(self, hash: int, kind: int = 0, role: int = 0, /) -> tuple[int, int, int] | None:
        """(event_mask, routed_mask, routed_ts_ns) of a block (kind 0), conversation key (1) or
        implicit prefix hash (2), or None; masks of max_servers bits (a session's routed mask is
        its one server's bit)."""
    # -- picks (workers; RowLost if the row is not ours)
    def pick_kv(
        self,
        row: int,
        role: int,
        exclude_slot: int,
        hashes: Buffer,
        num_tokens: int,
        load_weight: float,
        load_cap: float,
        use_tokens: bool,
        track_routed: bool,
        max_batch_size: int = 0,
        /,
    ) -> tuple[int, int] | None:
        """(slot, matched_blocks) | (-1, 0) | None (generation changed). `max_batch_size`: the
        load_cap denominator of every candidate (0: each server's record). See the README."""
    def pick_kv_claim(
        self,
        row: int,
        role: int,
        exclude_slot: int,
        hashes: Buffer,
        num_tokens: int,
        load_weight: float,
        load_cap: float,
        use_tokens: bool,
        track_routed: bool,
        max_batch_size: int,
        pin_key: int,
        defer_min: int,
        /,
    ) -> tuple[int, int, int] | None:
        """pick_kv leaving routed bits on defer_min blocks or more to commit_routed:
        (slot, matched, commit_from) | None; commit_from -1: nothing left to mark."""
    def commit_routed(self, row: int, hashes: Buffer, start: int, slot: int, /) -> int | None:
        """The routed bits a pick_kv_claim left, on hashes [start, n): blocks marked | None (remap)."""
    def match(self, hashes: Buffer, role: int = -1, jump: bool = False, /) -> list[tuple[int, int]] | None:
        """[(slot, depth)] of present, healthy servers (of role if >= 0); None: remap. Depths by the
        linear walk, or with `jump` by pick_kv's jump walk."""
    def conv_pick_explicit(
        self, row: int, role: int, exclude_slot: int, conv_key: int, num_tokens: int, /
    ) -> int | None:
        """Sticky by conversation key across processes; -1 if no candidate; None: remap."""
    def conv_pick_implicit(
        self,
        row: int,
        role: int,
        exclude_slot: int,
        hashes: Buffer,
        num_tokens: int,
        match_threshold: float,
        /,
    ) -> tuple[int, int] | None:
        """(slot, depth) by the deepest routed prefix above the threshold, else least loaded."""

SSE_INTERNAL: int  # sse_scan bits (native/sse.c)
SSE_FINISHED: int
SSE_USAGE: int
SSE_DONE: int

def json_member(data: bytes, key: bytes) -> tuple[int, int] | None:
    """Where the value of the last top-level member `key` of the JSON object `data` lies, as
    (start, end) byte offsets; None when absent, not an object, or a top-level key is escaped."""

def json_long_digits(data: bytes) -> bool:
    """Whether `data` holds a run of 19 or more ASCII digits: a JSON integer outside
    [-2**63, 2**64), which orjson decodes as a float, may be there (a run inside a string is a
    false alarm). Raises TypeError for anything but bytes."""

def json_token_ids(data: bytes, key: bytes) -> tuple[int, int, bytes] | None:
    """The last top-level member `key` of the JSON object `data` when it is a non-empty array of
    integers in [0, 2**31): (start, end) byte offsets of the array and its ids as native-order
    int32 bytes; None otherwise (absent, another value, or as `json_member` gives up)."""

def sse_scan(data: bytes) -> int:
    """One pass over a relayed SSE chunk: `end << 8 | flags`, where `data[:end]` are its complete
    events (0: none) and the flags say what they hold: `SSE_INTERNAL` (1) an internal key with a
    non-null value or an "error" key, `SSE_FINISHED` (2) a `finish_reason` with a string value,
    `SSE_USAGE` (4) a `completion_tokens` key, `SSE_DONE` (8) they end with `data: [DONE]`.
    Raises TypeError for anything but bytes."""

def token_ids_ok(obj: object) -> bool:
    """True if `obj` is a non-empty list of ints in [0, 2**31) (a token-id prompt)."""

def token_ids_int32(obj: object) -> bytes | None:
    """The ids of a token-id prompt (as `token_ids_ok` accepts) as native-order int32 bytes, checked
    and converted in one pass; None for anything else."""
