"""KV-cache events from every executor into the shared block index, drained when hinted.

The coordinator drains each healthy executor's `POST /kv_cache_events` (TensorRT-LLM's
`KVCacheEventSerializer` list, `tensorrt_llm/_utils.py`; a non-blocking drain,
so it cannot be waited on) and applies `stored` / `removed` / `all_cleared` to that executor's
bit in the index. When to drain: executors emit events at known moments of a request (evictions
when its blocks are allocated, the prompt's blocks when its KV is complete, i.e. just before a
context server's response or a generation server's first token, the output's blocks when it
finishes), so fleet workers send a *poll hint* naming the server at those moments (one Unix
datagram, `reporting.KvHints`; see `flows.py`) and the coordinator drains that server at once
(`KvHintProtocol` on `config.kv_hint_socket`). Drains are coalesced per server: one in flight,
and any number of hints arriving during it re-arm exactly one more drain after it. This is
TensorRT-LLM's kv_cache_aware "poll on finish", but fleet-wide, immediate, and at the first token
too. A fallback poll catches events no hint announced (an executor that emits them later than
the response, faults, `/sim/clear_cache`): after `busy_poll_s` while un-hinted events keep
coming, after `hinted_poll_s` while hints flow for that server, else after `idle_poll_s`
(`shmdisagg.kv_events` in the config). Malformed hint datagrams, or hints naming no registered
server, are counted (`bad_hints`) and ignored.

Payloads are decoded with msgspec into just the fields we use (event type, `event_id`,
`window_size`, `hash_algo`, `attention_dp_rank`, block hashes, timestamp), skipping the per-token
lists TensorRT-LLM puts in every `stored` block: measured on an 884 KB payload of 440 blocks,
1.4 ms against 9.9 ms for orjson into dicts. A payload that does not fit that shape falls back to
a tolerant per-event path.

Each executor's events are one stream (`_check_stream`): an `event_id` gap in a complete stream,
an id that goes back and a `created` event after others clear that server's entries in the index
(event and routed bits) and are counted, per server, in `/cluster_info` and the metrics. Only the
largest attention window's `stored` / `removed` events are applied, as TensorRT-LLM's fanout
keeps them; `updated` events change nothing, as in TensorRT-LLM's router. Block hashes are v1 or
v2_sha256_64 ints, or v2_sha256 hex keys folded to their first 8 bytes
(`hashing.event_block_hash`); an event's `hash_algo` tells the routing keys which algorithm the
executor really uses (`routing_keys.RoutingKeys.saw_algo`).

Executors whose `tokens_per_block` does not match the router's (their hashes cannot align;
TensorRT-LLM skips such servers too) are not drained. Malformed events, and events of an
algorithm the router cannot compute, are dropped and counted, never applied; nothing an
executor sends can crash the coordinator. Event-to-visibility
lag is recorded per block: from the event's `timestamp` (seconds, when the executor sends one —
the simulator does; TensorRT-LLM does not, so there it is measured from receipt) to the moment
the native apply made it visible to every worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import orjson

from shmdisagg.config import KvEventsSection
from shmdisagg.coordinator.health import Executor
from shmdisagg.coordinator.routing_keys import RoutingKeys
from shmdisagg.hashing import KV_CACHE_HASH_ALGO_V1, KV_CACHE_HASH_ALGOS, event_block_hash
from shmdisagg.metrics.schema import LAYOUT
from shmdisagg.orchestrator.reporting import HINT_MAGIC
from shmdisagg.procutil import private_unix_socket
from shmdisagg.shm.index import BlockIndex
from shmdisagg.upstream import UpstreamError, UpstreamPool

log = logging.getLogger("shmdisagg.coordinator")

# Each poll is an HTTP exchange (~0.5 ms of coordinator CPU). Measured on the demo: polling at
# 5 ms / 50 ms cost the coordinator 18 ms of CPU per request, so the fallback poll is slow and the
# hints do the fast part. Blocks routed in the meantime are already in the index (routed-block
# tracking), so the events only confirm or correct them.
DRAIN_TIMEOUT_S = 5.0
HINTS_FLOWING_S = 10.0  # a server hinted within this long gets the slower `hinted_poll_s` fallback
_HINT_LEN = len(HINT_MAGIC) + 4


class _Block(msgspec.Struct):
    block_hash: int | str


class _Data(msgspec.Struct):
    type: str
    blocks: list[_Block] | None = None
    block_hashes: list[int | str] | None = None
    hash_algo: str | None = None
    timestamp: float | None = None


class _Event(msgspec.Struct):
    data: _Data
    event_id: int | None = None
    window_size: int | None = None
    hash_algo: str | None = None
    attention_dp_rank: int | None = None
    timestamp: float | None = None


_DECODE = msgspec.json.Decoder(list[_Event])
_CLEARED = frozenset({"all_cleared", "cleared", "all_blocks_cleared"})
_ALGO_EVENTS = frozenset({"created", "stored", "removed"})  # the ones TensorRT-LLM's router reads hash_algo from
_GAPS = LAYOUT.per_server["shmdisagg_server_kv_event_gaps"]
_RESTARTS = LAYOUT.per_server["shmdisagg_server_kv_cache_restarts"]


@dataclass
class _Stream:
    """What the ingest knows of one executor's event stream. `last_id`: the last `event_id` per
    attention-DP rank; `prev_kind`: the last event's type (None after a restart: the `created`
    events that open a stream are expected); `max_window`: the largest attention window (events
    of other windows are skipped), `window_known` once the opening `created` events gave it;
    `algo`: the last `hash_algo` its events carried; `complete`: see `_check_stream`."""

    last_id: dict[int, int] = field(default_factory=dict)
    prev_kind: str | None = None
    max_window: int | None = None
    window_known: bool = False
    algo: str | None = None
    complete: bool = False  # it carried events a filtering relay would drop (see _check_stream)
    gaps: int = 0
    skips: int = 0
    restarts: int = 0
    window_skipped: int = 0


class KvEventIngestor:
    """Per-executor drain loops, woken by `hint(slot)` or their fallback timer.

    `keys`: the roles' routing keys (block size alignment, hash algorithms), None to drain and
    apply everything; `row`: the coordinator's metrics row (per-server counters), if any;
    `on_key_change(slot)`: the role of `slot` changed its routing key (republish it);
    `on_restart(slot)`: `slot` restarted (read its `/server_info` again).
    Counters: `applied_events`, `dropped_events`, `hints` (accepted), `bad_hints`,
    `hinted_drains`, `polled_drains` (by the fallback timer), `event_gaps`, `restarts`,
    `window_skipped_events` (also per server: `server_state`)."""

    def __init__(
        self,
        index: BlockIndex,
        executors: list[Executor],
        keys: RoutingKeys | None = None,
        settings: KvEventsSection | None = None,
        row: memoryview[float] | None = None,
        on_key_change: Callable[[int], object] = lambda slot: None,
        on_restart: Callable[[int], object] = lambda slot: None,
    ) -> None:
        self.index = index
        self.executors = list(executors)
        self._tasks: dict[int, asyncio.Task[None]] = {}  # slot -> its drain loop, while `run` runs
        self._pool: UpstreamPool | None = None
        self.keys = keys
        self.settings = settings or KvEventsSection()
        self.row = row
        self.on_key_change = on_key_change
        self.on_restart = on_restart
        # whether this deployment drains now (cluster/drain_lease.py: one of several deployments
        # sharing executors drains them); drains are skipped while it says no
        self.drains: Callable[[], bool] = lambda: True
        self.skipped_drains = 0
        self.applied_events = 0
        self.dropped_events = 0
        self.hints = 0
        self.bad_hints = 0
        self.hinted_drains = 0
        self.polled_drains = 0
        self.event_gaps = 0
        self.restarts = 0
        self.window_skipped_events = 0
        self._streams = {ex.slot: _Stream() for ex in executors}
        self._warned: set[tuple[int, str]] = set()
        self._wake = {ex.slot: asyncio.Event() for ex in executors}
        self._last_hint = {ex.slot: -HINTS_FLOWING_S for ex in executors}  # time.monotonic()

    def counters(self) -> dict[str, int]:
        return {
            "applied_events": self.applied_events,
            "dropped_events": self.dropped_events,
            "hints": self.hints,
            "bad_hints": self.bad_hints,
            "hinted_drains": self.hinted_drains,
            "polled_drains": self.polled_drains,
            "event_gaps": self.event_gaps,
            "restarts": self.restarts,
            "window_skipped_events": self.window_skipped_events,
            "skipped_drains": self.skipped_drains,
        }

    def server_state(self, slot: int) -> dict[str, Any] | None:
        """One executor's event stream for `/cluster_info` (None if its events are not
        drained: not a kv_cache_aware role)."""
        st = self._streams.get(slot)
        if st is None:
            return None
        return {
            "drained": self.keys.aligned(slot) if self.keys is not None else True,
            "kv_cache_hash_algo": self.keys.algo_of(slot) if self.keys is not None else None,
            "last_event_id": max(st.last_id.values()) if st.last_id else None,
            "event_gaps": st.gaps,
            "event_id_skips": st.skips,
            "restarts": st.restarts,
            "window_skipped_events": st.window_skipped,
            "stream_complete": st.complete,
            "max_window_size": st.max_window,
        }

    def hint(self, slot: int) -> bool:
        """Drain server `slot` now, or once more after the drain in flight. False (counted in
        `bad_hints`) if no registered executor has that slot."""
        wake = self._wake.get(slot)
        if wake is None:
            self.bad_hints += 1
            return False
        self.hints += 1
        self._last_hint[slot] = time.monotonic()
        wake.set()
        return True

    def hint_datagram(self, data: bytes) -> None:
        """One datagram from a fleet worker (`reporting.hint_message`); anything else is counted
        in `bad_hints` and ignored."""
        if len(data) == _HINT_LEN and data.startswith(HINT_MAGIC):
            self.hint(int.from_bytes(data[len(HINT_MAGIC) :], "little"))
        else:
            self.bad_hints += 1

    def add(self, ex: Executor) -> None:
        """Drain `ex` too (an executor registered at run time), from a fresh stream."""
        self.remove(ex.slot)
        self.executors.append(ex)
        self._streams[ex.slot] = _Stream()
        self._wake[ex.slot] = asyncio.Event()
        self._last_hint[ex.slot] = -HINTS_FLOWING_S
        if self._pool is not None:
            self._tasks[ex.slot] = asyncio.ensure_future(self._drain(self._pool, ex))

    def remove(self, slot: int) -> None:
        """Stop draining `slot` (its executor left); hints naming it count as `bad_hints`."""
        task = self._tasks.pop(slot, None)
        if task is not None:
            task.cancel()
        self.executors = [ex for ex in self.executors if ex.slot != slot]
        self._streams.pop(slot, None)
        self._wake.pop(slot, None)
        self._last_hint.pop(slot, None)

    async def run(self) -> None:
        async with UpstreamPool(max_idle_per_host=2) as pool:
            self._pool = pool
            try:
                for ex in self.executors:
                    self._tasks[ex.slot] = asyncio.ensure_future(self._drain(pool, ex))
                await asyncio.Event().wait()  # until cancelled; executors come and go meanwhile
            finally:
                self._pool = None
                tasks = list(self._tasks.values())
                self._tasks.clear()
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    def _fallback_s(self, slot: int, got: int, hinted: bool) -> float:
        """How long to wait for a hint before polling `slot` anyway."""
        st = self.settings
        if got and not hinted:  # events arrive that no hint announced: keep up with them
            return st.busy_poll_s
        if time.monotonic() - self._last_hint[slot] < HINTS_FLOWING_S:
            return st.hinted_poll_s
        return st.busy_poll_s if got else st.idle_poll_s

    async def _drain(self, pool: UpstreamPool, ex: Executor) -> None:
        wake = self._wake[ex.slot]
        hinted = False
        while True:
            got = await self._drain_once(pool, ex)
            if not wake.is_set():  # a hint during the drain re-arms exactly one more drain
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._fallback_s(ex.slot, got, hinted)):
                        await wake.wait()
            hinted = wake.is_set()
            wake.clear()
            if hinted:
                self.hinted_drains += 1
            else:
                self.polled_drains += 1

    async def _drain_once(self, pool: UpstreamPool, ex: Executor) -> int:
        """One `POST /kv_cache_events` (on the fleet's lean HTTP client: a tenth of aiohttp's
        CPU per exchange), applied; returns how many events it held. Executors whose block size
        is not the router's are not drained (TensorRT-LLM skips their event polls too)."""
        if not ex.healthy or (self.keys is not None and not self.keys.aligned(ex.slot)):
            return 0
        if not self.drains():
            self.skipped_drains += 1
            return 0
        try:
            async with asyncio.timeout(DRAIN_TIMEOUT_S):
                r = await pool.request(ex.host, ex.port, "POST", "/kv_cache_events")
                raw = await r.read()
        except (UpstreamError, TimeoutError, OSError) as err:
            log.debug("kv events from %s: %r", ex.addr, err)
            return 0
        if self._wake.get(ex.slot) is None:
            return 0  # removed during the drain: its events no longer describe a routable server
        return self.apply_raw(ex.slot, raw, time.time()) if raw and r.status == 200 else 0

    # -- applying events -------------------------------------------------------------------

    def apply_raw(self, slot: int, raw: bytes, received: float) -> int:
        """Decode and apply one `/kv_cache_events` body; returns how many events it held."""
        try:
            typed = _DECODE.decode(raw)
        except msgspec.DecodeError:
            try:
                loose = orjson.loads(raw)
            except orjson.JSONDecodeError:
                self._drop(1)
                return 1
            return self.apply(slot, loose, received)
        st = self._streams.get(slot)
        if st is None:
            self._drop(len(typed))
            return len(typed)
        for event in typed:
            d = event.data
            raw_hashes = [b.block_hash for b in d.blocks] if d.blocks is not None else d.block_hashes
            try:
                self._one(
                    slot,
                    st,
                    event.event_id,
                    event.attention_dp_rank or 0,
                    d.type,
                    event.window_size,
                    event.hash_algo or d.hash_algo,
                    raw_hashes,
                    event.timestamp or d.timestamp or received,
                    fast=True,
                )
            except (ValueError, OverflowError, TypeError):
                self._drop(1)
        return len(typed)

    def apply(self, slot: int, events: Any, received: float) -> int:
        """Apply one drained list for server `slot` (any JSON value: the tolerant path);
        returns how many events it held. Events for a slot that holds no registered executor,
        and malformed events, are dropped and counted."""
        if not isinstance(events, list):
            self._drop(1)
            return 1
        st = self._streams.get(slot)
        if st is None:
            self._drop(len(events))
            return len(events)
        for event in events:
            try:
                self._apply_loose(slot, st, event, received)
            except (KeyError, TypeError, ValueError, OverflowError, AttributeError):
                self._drop(1)
        return len(events)

    def _apply_loose(self, slot: int, st: _Stream, event: dict[str, Any], received: float) -> None:
        data = event.get("data", event)
        kind = data["type"]
        if not isinstance(kind, str):
            raise TypeError("event type")
        if kind == "stored":
            raw_hashes = [b["block_hash"] for b in data["blocks"]]
        elif kind == "removed":
            raw_hashes = data["block_hashes"]
            if not isinstance(raw_hashes, list):
                raise TypeError("block_hashes")
        else:
            raw_hashes = None
        ts = event.get("timestamp") or data.get("timestamp") or received
        self._one(
            slot,
            st,
            _opt_int(event.get("event_id")),
            _opt_int(event.get("attention_dp_rank")) or 0,
            kind,
            _opt_int(event.get("window_size")),
            event.get("hash_algo", data.get("hash_algo")),
            raw_hashes,
            float(ts),
            fast=False,
        )

    def _one(
        self,
        slot: int,
        st: _Stream,
        event_id: int | None,
        rank: int,
        kind: str,
        window: int | None,
        algo: str | None,
        raw_hashes: list[Any] | None,
        ts: float,
        fast: bool,
    ) -> None:
        """Apply one event of `slot`. Raises ValueError / TypeError / OverflowError when it is
        malformed (the caller drops and counts it); its `event_id` still counts for the stream."""
        restarted = self._check_stream(slot, st, event_id, rank, kind)
        opening = st.prev_kind in (None, "created")
        st.prev_kind = kind
        if kind in _ALGO_EVENTS:
            self._saw_algo(slot, st, algo or KV_CACHE_HASH_ALGO_V1)
        if kind == "created":
            if window is not None and (opening or restarted):
                st.max_window = max(st.max_window or 0, window)
                st.window_known = True
            self.applied_events += 1
            return
        if window is not None and kind in ("stored", "removed") and self._other_window(st, window):
            st.window_skipped += 1
            self.window_skipped_events += 1
            return
        if kind == "stored" or kind == "removed":
            if raw_hashes is None:
                raise ValueError(f"{kind} event without block hashes")
            hashes = _pack(raw_hashes, fast)
            if kind == "stored":
                self.index.apply_stored(slot, hashes, int(ts * 1e9))
            else:
                self.index.apply_removed(slot, hashes)
        elif kind in _CLEARED:
            self.index.apply_all_cleared(slot)
        elif kind != "updated":  # cache-level/priority changes: no effect on routing, as upstream
            raise ValueError(f"unknown KV event type {kind!r}")
        self.applied_events += 1

    def _check_stream(self, slot: int, st: _Stream, event_id: int | None, rank: int, kind: str) -> bool:
        """The stream's integrity; True on a restart.

        A restart (an id that goes back, or a `created` event after other events: the executor
        restarted, perhaps on the same port between two health polls) and a gap in a stream known
        to be complete (TensorRT-LLM `serve/kv_event_fanout.py` @48f2db0b clears the advertised
        index on an event-id gap: the executor's bounded buffer dropped events, so `removed`
        events may be missing) clear every block of `slot` in the index, event and routed bits
        alike (they would claim blocks its cache may no longer hold), and are counted.

        A stream is known complete once it carried the events a filtering relay drops (`created`,
        which opens an engine's stream at event_id 0, or `updated`): TensorRT-LLM's KvEventFanout
        keeps only the largest window's `stored` / `removed` events, engine ids and all, so its
        holes are not losses. In a stream not known complete (a fanout's, or one this coordinator
        joined after its opening events) a hole is only counted (`event_id_skips`)."""
        restarted = False
        if event_id is not None:
            last = st.last_id.get(rank)
            if last is not None and event_id <= last:
                self._restart(slot, st, f"event_id {event_id} after {last}")
                restarted = True
            elif last is not None and event_id != last + 1:
                if st.complete:
                    self._gap(slot, st, last + 1, event_id)
                else:
                    st.skips += 1
            st.last_id[rank] = event_id
        if kind == "created" and not restarted and st.prev_kind not in (None, "created"):
            self._restart(slot, st, "a created event after other events")
            restarted = True
        if kind == "created" or kind == "updated":
            st.complete = True
        return restarted

    def _gap(self, slot: int, st: _Stream, expected: int, got: int) -> None:
        self.index.apply_all_cleared(slot)
        st.gaps += 1
        self.event_gaps += 1
        self._count(_GAPS, slot)
        level = logging.WARNING if st.gaps == 1 else logging.DEBUG
        log.log(
            level,
            "%s: KV event gap (expected event_id %d, got %d; its event buffer dropped events): its index entries are "
            "cleared (%d gap(s) so far)",
            self._addr(slot),
            expected,
            got,
            st.gaps,
        )

    def _restart(self, slot: int, st: _Stream, why: str) -> None:
        self.index.apply_all_cleared(slot)
        st.restarts += 1
        self.restarts += 1
        self._count(_RESTARTS, slot)
        st.last_id.clear()
        st.prev_kind, st.max_window, st.window_known, st.algo, st.complete = None, None, False, None, False
        log.warning(
            "%s restarted (%s): its index entries are cleared and its /server_info is read again", self._addr(slot), why
        )
        if self.keys is not None and self.keys.restarted(slot):
            self.on_key_change(slot)
        self.on_restart(slot)

    def _other_window(self, st: _Stream, window: int) -> bool:
        """Whether an event of attention window `window` is skipped: only the largest window's
        events describe the cache a prompt can reuse (TensorRT-LLM's fanout keeps those, the
        largest taken from the opening `created` events; before any, the largest seen so far)."""
        if not st.window_known and (st.max_window is None or window > st.max_window):
            st.max_window = window
        return window != st.max_window

    def _saw_algo(self, slot: int, st: _Stream, algo: str) -> None:
        if algo == st.algo:
            return
        if algo not in KV_CACHE_HASH_ALGOS:
            if (slot, algo) not in self._warned:
                self._warned.add((slot, algo))
                log.warning(
                    "%s: KV events with hash_algo %r, which the router cannot compute, are dropped",
                    self._addr(slot),
                    algo,
                )
            raise ValueError(f"hash_algo {algo!r}")
        st.algo = algo
        if self.keys is not None and self.keys.saw_algo(slot, algo):
            self.on_key_change(slot)

    def _count(self, base: int, slot: int) -> None:
        if self.row is not None:
            self.row[base + slot] += 1

    def _addr(self, slot: int) -> str:
        return next((ex.addr for ex in self.executors if ex.slot == slot), f"slot {slot}")

    def _drop(self, n: int) -> None:
        self.dropped_events += n
        self.index.count_dropped(n)


def _opt_int(value: Any) -> int | None:
    """An optional integer field of an event; TypeError for anything else (bools too)."""
    if value is None or type(value) is int:
        return value
    raise TypeError(f"expected an integer, got {type(value).__name__}")


def _pack(raw: list[Any], fast: bool) -> bytes:
    """Block hashes as the index's packed u64 keys (`hashing.event_block_hash`). The decoder
    already gave ints or strings: ints pack at once (OverflowError outside u64), strings are v2
    hex keys reduced one by one. The tolerant path checks every value."""
    if fast:
        try:
            return array("Q", raw).tobytes()
        except TypeError:
            pass
    return array("Q", [event_block_hash(h) for h in raw]).tobytes()


class KvHintProtocol(asyncio.DatagramProtocol):
    """Receives fleet workers' poll hints on the coordinator's Unix datagram socket."""

    def __init__(self, ingestor: KvEventIngestor) -> None:
        self.ingestor = ingestor

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.ingestor.hint_datagram(data)

    def error_received(self, exc: Exception) -> None:  # pragma: no cover - nothing is ever sent
        log.debug("kv hint socket: %r", exc)


async def listen_for_hints(path: str, ingestor: KvEventIngestor) -> asyncio.BaseTransport:
    """Bind the hint socket at `path` (mode 0600; a stale file is replaced) and feed it to
    `ingestor`. The caller closes the transport and unlinks `path`."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    sock = private_unix_socket(path, socket.SOCK_DGRAM)
    try:
        transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
            lambda: KvHintProtocol(ingestor), sock=sock
        )
    except BaseException:
        sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise
    return transport
