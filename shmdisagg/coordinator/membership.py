"""Executors that come and go: the coordinator's side of service discovery (`disagg_cluster`).

The store (`shmdisagg/cluster/`: etcd, or the HTTP store the deployment serves) tells this module
which workers are registered, as TensorRT-LLM's `DisaggClusterManager` hears it
(`serve/disagg_auto_scaling.py` @b3809755): a SET of a key with a `WorkerInfo` value, a DELETE of
a key (deregistration, or a lease or TTL that expired), or, after a store (re)connection, the whole
list (`sync`). Each registered worker gets a slot of the shared table and is then prepared as a
configured executor is (`health.HealthMonitor.add`: healthy once `/health` answers 200 and its
`/server_info` and `/v1/models` are read, TensorRT-LLM's `_prepare_server`); the fleet sees it at
its next pick (the table's masks), and stops picking a removed one at its next pick too.

Removing a worker (`leave`): its slot leaves the table's masks at once; legs already sent to it
run on and release their load into its slot as usual; its KV index entries, routed bits and
conversation sessions are cleared (`BlockIndex.clear_server`), its KV event drain and health
probes stop. The slot is reused only once every fleet row's load on it is back to zero (its legs
all ended), and slots never used go first, so a new server never inherits another's load or
cache. A worker registering an address that another key holds (it restarted before its old
lease expired) replaces it: the old server is removed as above and the address is a new server
with an empty cache; the old key's later DELETE then changes nothing.

Upstream keys the router by address, so there a restarted worker's late DELETE removes the live
one; and it keeps a worker whose value does not parse as a dummy. Here a bad value is logged once
and ignored. Registrations past the table's server slots (`max_servers`: 64 unless
`shmdisagg.shm.max_servers` asks for more, up to 256) wait (logged) until a slot frees.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from shmdisagg.cluster.workers import SERVER_ROLES, TABLE_ROLE, BadWorker, WorkerInfo, parse_worker
from shmdisagg.coordinator.health import ROLE_NAMES, Executor, HealthMonitor
from shmdisagg.shm.table import ControlTable

log = logging.getLogger("shmdisagg.coordinator")


@dataclass
class Registered:
    key: str
    info: WorkerInfo
    slot: int


class Membership:
    """State: `by_key` (store key -> Registered), `pending` (keys waiting for a free slot, in
    arrival order), `draining` (freed slots, oldest first, reused once their load is zero).
    Counters: `joins`, `leaves`, `replaced` (an address registered again under a new key),
    `bad_values`, `waited` (registrations that found no free slot)."""

    def __init__(
        self,
        table: ControlTable,
        health: HealthMonitor,
        on_join: Callable[[Executor], object] = lambda ex: None,
        on_leave: Callable[[Executor], object] = lambda ex: None,
        capacity: int | None = None,
    ) -> None:
        """`on_join(ex)` after `ex` is in the table (drain its KV events, map its perf records);
        `on_leave(ex)` after it left (clear its index entries, stop its drain). `capacity`: the
        slots it hands out, 0..capacity - 1 (default: all of the table's, `max_servers`)."""
        self.table = table
        self.health = health
        self.on_join = on_join
        self.on_leave = on_leave
        self.capacity = table.max_servers if capacity is None else capacity
        self.by_key: dict[str, Registered] = {}
        self.pending: dict[str, WorkerInfo] = {}
        used = {ex.slot for ex in health.executors}
        self._never_used = [s for s in range(self.capacity) if s not in used]
        # executors a dead coordinator had registered (adopted with the table): (addr, role) ->
        # slot, until a key naming them claims them again or `drop_unclaimed` removes them
        self.unclaimed: dict[tuple[str, int], int] = {(ex.addr, ex.role): ex.slot for ex in health.executors}
        self.draining: deque[int] = deque()
        self.joins = self.leaves = self.replaced = self.bad_values = self.waited = 0
        self._bad_logged: set[str] = set()

    # -- store events ---------------------------------------------------------------------

    def put(self, key: str, value: str) -> None:
        """A SET event: `key` now holds `value`."""
        try:
            info = parse_worker(value)
        except BadWorker as err:
            self.bad_values += 1
            if key not in self._bad_logged:
                self._bad_logged.add(key)
                log.warning("cluster store key %s: %s; ignored", key, err)
            self.delete(key)  # whatever it held before is not a worker now
            return
        self._bad_logged.discard(key)
        current = self.by_key.get(key)
        if current is not None and (current.info.addr, current.info.role) == (info.addr, info.role):
            current.info = info  # the same worker heart-beating or re-registering its key
            return
        if current is not None:
            self._leave(current, "its key now names another worker")
        for other in list(self.by_key.values()):
            if other.info.addr == info.addr:
                self.replaced += 1
                self._leave(other, f"{info.addr} registered again as {info.worker_id}")
        self.pending.pop(key, None)
        self._join(key, info)

    def delete(self, key: str) -> None:
        """A DELETE event (deregistered, or its lease / TTL expired)."""
        self.pending.pop(key, None)
        current = self.by_key.get(key)
        if current is not None:
            self._leave(current, "deregistered or its registration expired")
            self._admit_pending()

    def sync(self, values: dict[str, str]) -> None:
        """The store's whole list (after a connection): keys gone are removed, new ones joined."""
        for key in [k for k in self.by_key if k not in values] + [k for k in self.pending if k not in values]:
            self.delete(key)
        for key, value in values.items():
            self.put(key, value)

    # -- slots ----------------------------------------------------------------------------

    def _free_slot(self) -> int | None:
        if self._never_used:
            return self._never_used.pop(0)
        for _ in range(len(self.draining)):
            slot = self.draining.popleft()
            if self.table.load(slot) == (0, 0):
                return slot
            self.draining.append(slot)  # legs still running on the server it held
        return None

    def _join(self, key: str, info: WorkerInfo) -> None:
        adopted = self.unclaimed.pop((info.addr, TABLE_ROLE[info.role]), None)
        if adopted is not None and self.health.get(adopted) is not None:
            self.by_key[key] = Registered(key, info, adopted)  # the same server, kept through a coordinator restart
            log.info("%s server %s (%s) kept in slot %d", SERVER_ROLES[info.role].lower(), info.addr, key, adopted)
            return
        slot = self._free_slot()
        if slot is None:
            if key not in self.pending:
                self.waited += 1
                log.warning(
                    "%s server %s (%s) waits: all %d server slots are in use (or still finishing legs)",
                    SERVER_ROLES[info.role].lower(),
                    info.addr,
                    key,
                    self.capacity,
                )
            self.pending[key] = info
            return
        ex = Executor(slot, TABLE_ROLE[info.role], info.host, info.port)
        self.by_key[key] = Registered(key, info, slot)
        self.health.add(ex)
        self.joins += 1
        log.info("%s server %s registered (%s): slot %d", ROLE_NAMES[ex.role], ex.addr, info.worker_id, slot)
        self.on_join(ex)

    def _leave(self, reg: Registered, why: str) -> None:
        del self.by_key[reg.key]
        ex = self.health.remove(reg.slot)
        self.draining.append(reg.slot)
        self.leaves += 1
        log.info(
            "%s server %s removed (%s): slot %d", SERVER_ROLES[reg.info.role].lower(), reg.info.addr, why, reg.slot
        )
        if ex is not None:
            self.on_leave(ex)

    def _admit_pending(self) -> None:
        for key, info in list(self.pending.items()):
            if self._free_slot_available():
                self.pending.pop(key, None)
                self._join(key, info)

    def _free_slot_available(self) -> bool:
        return bool(self._never_used) or any(self.table.load(s) == (0, 0) for s in self.draining)

    def drop_unclaimed(self) -> None:
        """Remove the adopted executors no registration claimed (they left while no coordinator
        watched)."""
        for (addr, _), slot in list(self.unclaimed.items()):
            ex = self.health.remove(slot)
            self.draining.append(slot)
            self.leaves += 1
            log.info("server %s removed (no longer registered): slot %d", addr, slot)
            if ex is not None:
                self.on_leave(ex)
        self.unclaimed.clear()

    def tick(self) -> None:
        """Called periodically: admit waiting registrations once a draining slot's legs ended."""
        if self.pending:
            self._admit_pending()

    def info(self) -> dict[str, object]:
        """For `/cluster_info`: TensorRT-LLM's `current_workers` shape plus counters."""
        workers: dict[str, list[dict[str, object]]] = {"context_servers": [], "generation_servers": []}
        for reg in self.by_key.values():
            name = "context_servers" if reg.info.role == 0 else "generation_servers"
            i = reg.info
            workers[name].append({"worker_id": i.worker_id, "host": i.host, "port": i.port, "role": i.role})
        return {
            "current_workers": workers,
            "pending": sorted(self.pending),
            "joins": self.joins,
            "leaves": self.leaves,
            "replaced": self.replaced,
            "bad_values": self.bad_values,
            "waited": self.waited,
        }
