"""KV-cache events from every executor into the shared block index, continuously.

The coordinator drains each healthy executor's `POST /kv_cache_events` (TensorRT-LLM's
`KVCacheEventSerializer` list, shared/reference/trtllm_protocol.md §3.7) in a loop — not only
when a request finishes, which is what left TensorRT-LLM's table empty (issue #14882) — and
applies `stored` / `removed` / `all_cleared` to that executor's bit in the index. It polls again
again after `BUSY_POLL_S` while events keep coming and backs off to `IDLE_POLL_S` when an
executor is quiet.

Payloads are decoded with msgspec into just the fields we use (event type, block hashes,
timestamp), skipping the per-token lists TensorRT-LLM puts in every `stored` block: measured on
an 884 KB payload of 440 blocks, 1.4 ms against 9.9 ms for orjson into dicts. A payload that does
not fit that shape falls back to a tolerant per-event path.

Malformed events, and events from an executor whose `tokens_per_block` does not match the
router's (their hashes cannot align; TensorRT-LLM skips such servers too), are dropped and
counted, never applied; nothing an executor sends can crash the coordinator. Event-to-visibility
lag is recorded per block: from the event's `timestamp` (seconds, when the executor sends one —
the simulator does; TensorRT-LLM does not, so there it is measured from receipt) to the moment
the native apply made it visible to every worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp
import msgspec
import orjson

from shmdisagg.coordinator.health import Executor
from shmdisagg.shm.index import BlockIndex

log = logging.getLogger("shmdisagg.coordinator")

# Each poll is an HTTP exchange (~0.5 ms of coordinator CPU). Measured on the demo: polling at
# 5 ms / 50 ms cost the coordinator 18 ms of CPU per request. Blocks routed in the meantime are
# already in the index (routed-block tracking), so the events only confirm or correct them.
BUSY_POLL_S = 0.02
IDLE_POLL_S = 0.2


class _Block(msgspec.Struct):
    block_hash: int


class _Data(msgspec.Struct):
    type: str
    blocks: list[_Block] | None = None
    block_hashes: list[int] | None = None
    timestamp: float | None = None


class _Event(msgspec.Struct):
    data: _Data
    timestamp: float | None = None


_DECODE = msgspec.json.Decoder(list[_Event])


class KvEventIngestor:
    """Per-executor drain loops. `expected_tpb(role)` is the router's tokens_per_block for that
    role (0 = adopt the executor's). Counters: `applied_events`, `dropped_events`."""

    def __init__(self, index: BlockIndex, executors: list[Executor], expected_tpb: Any) -> None:
        self.index = index
        self.executors = executors
        self._slots = {ex.slot for ex in executors}
        self.expected_tpb = expected_tpb
        self.applied_events = 0
        self.dropped_events = 0
        self._warned: set[int] = set()

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=5.0)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await asyncio.gather(*(self._drain(session, ex) for ex in self.executors))

    async def _drain(self, session: aiohttp.ClientSession, ex: Executor) -> None:
        while True:
            got = 0
            if ex.healthy and self._aligned(ex):
                try:
                    async with session.post(f"{ex.base}/kv_cache_events") as r:
                        raw = await r.read() if r.status == 200 else b""
                    got = self.apply_raw(ex.slot, raw, time.time()) if raw else 0
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as err:
                    log.debug("kv events from %s: %r", ex.addr, err)
            await asyncio.sleep(BUSY_POLL_S if got else IDLE_POLL_S)

    def _aligned(self, ex: Executor) -> bool:
        want = self.expected_tpb(ex.role)
        have = int((ex.server_info or {}).get("tokens_per_block") or 0)
        if want and have and want != have:
            if ex.slot not in self._warned:
                self._warned.add(ex.slot)
                log.warning("%s reports tokens_per_block %d but the router uses %d: its KV events cannot align and are not applied", ex.addr, have, want)
            return False
        return True

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
        if slot not in self._slots:
            self._drop(len(typed))
            return len(typed)
        for event in typed:
            d = event.data
            ts = event.timestamp or d.timestamp or received
            try:
                if d.type == "stored" and d.blocks is not None:
                    self.index.apply_stored(slot, [b.block_hash for b in d.blocks], int(ts * 1e9))
                elif d.type == "removed" and d.block_hashes is not None:
                    self.index.apply_removed(slot, d.block_hashes)
                elif d.type in ("all_cleared", "cleared", "all_blocks_cleared"):
                    self.index.apply_all_cleared(slot)
                elif d.type not in ("created", "updated"):
                    raise ValueError(d.type)
                self.applied_events += 1
            except (ValueError, OverflowError, TypeError):
                self._drop(1)
        return len(typed)

    def apply(self, slot: int, events: Any, received: float) -> int:
        """Apply one drained list for server `slot`; returns how many events it held. Events for
        a slot that holds no registered executor are dropped and counted."""
        if not isinstance(events, list):
            self._drop(1)
            return 1
        if slot not in self._slots:
            self._drop(len(events))
            return len(events)
        for event in events:
            try:
                self._apply_one(slot, event, received)
                self.applied_events += 1
            except (KeyError, TypeError, ValueError, OverflowError, AttributeError):
                self._drop(1)
        return len(events)

    def _apply_one(self, slot: int, event: dict[str, Any], received: float) -> None:
        data = event.get("data", event)
        kind = data["type"]
        if kind == "stored":
            ts = event.get("timestamp") or data.get("timestamp") or received
            hashes = [int(b["block_hash"]) for b in data["blocks"]]
            self.index.apply_stored(slot, hashes, int(float(ts) * 1e9))
        elif kind == "removed":
            self.index.apply_removed(slot, [int(h) for h in data["block_hashes"]])
        elif kind in ("all_cleared", "cleared", "all_blocks_cleared"):
            self.index.apply_all_cleared(slot)
        elif kind not in ("created", "updated"):
            raise ValueError(f"unknown KV event type {kind!r}")

    def _drop(self, n: int) -> None:
        self.dropped_events += n
        self.index.count_dropped(n)
