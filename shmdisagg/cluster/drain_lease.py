"""Which of several deployments sharing executors drains their KV events (`disagg_cluster` on
etcd, two or more front-end deployments with the same `cluster_name`).

`POST /kv_cache_events` drains an executor's event buffer destructively (TensorRT-LLM's protocol):
two coordinators polling one executor would each see part of its events, and each index would
have holes. So the deployments elect one drainer through etcd: it holds the key
`/shmdisagg/{cluster_name}/kv_events_drainer` (outside TensorRT-LLM's `/trtllm-disagg/` namespace,
so an upstream orchestrator watching the workers never sees it) on a lease of
`inactive_timeout_sec`, refreshed every `heartbeat_interval_sec`; the others skip their drains
(their KV-aware routers still route on their own routed-block tracking) and try to take the key
every heartbeat, so one of them drains within a lease's length after the holder dies, and at once
when it stops cleanly (it revokes the lease). A holder whose refresh finds the lease gone (it was
frozen, or etcd lost it) stops draining at once and campaigns again like the others.

The value names the holder: `{"shm_prefix", "host", "pid"}` (JSON), for `/cluster_info` and logs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from typing import Any

from shmdisagg.cluster.etcd_store import EtcdConnection, _failures, _short

log = logging.getLogger("shmdisagg.cluster")


def drainer_key(cluster_name: str) -> str:
    return f"/shmdisagg/{cluster_name}/kv_events_drainer"


class DrainLease:
    """`holder`: whether this deployment drains now; `holder_info`: who does (None unknown);
    `acquired` / `lost`: how many times this one took / lost the key."""

    def __init__(
        self,
        endpoints: list[tuple[str, int]],
        uri: str,
        cluster_name: str,
        shm_prefix: str,
        ttl_s: int,
        heartbeat_s: float,
    ) -> None:
        self.conn = EtcdConnection(endpoints, uri)
        self.key = drainer_key(cluster_name)
        self.value = json.dumps({"shm_prefix": shm_prefix, "host": socket.gethostname(), "pid": os.getpid()})
        self.ttl_s = max(int(ttl_s), 1)
        self.interval_s = heartbeat_s if 0 < heartbeat_s < ttl_s else max(self.ttl_s / 3, 0.2)
        self.holder = False
        self.holder_info: dict[str, Any] | None = None
        self.acquired = 0
        self.lost = 0
        self._lease: Any = None

    async def run(self) -> None:
        """Campaign and hold until cancelled; then give the key up (best effort)."""
        try:
            while True:
                try:
                    if self.conn.client is None:
                        await self.conn.connect()
                    if self.holder:
                        await self._refresh()
                    else:
                        await self._campaign()
                except _failures() as err:
                    if self.holder:
                        log.warning("KV event drain lease: etcd failed (%s): draining stops", _short(err))
                        self._lose()
                    await self.conn.close()
                await asyncio.sleep(self.interval_s)
        finally:
            await self._release()

    async def _campaign(self) -> None:
        client = self.conn.client
        lease = await client.lease(self.ttl_s)
        ok, _ = await client.transaction(
            compare=[client.transactions.create(self.key.encode()) == 0],
            success=[client.transactions.put(self.key.encode(), self.value.encode(), lease=lease)],
            failure=[],
        )
        if ok:
            self._lease, self.holder = lease, True
            self.holder_info = json.loads(self.value)
            self.acquired += 1
            log.info("this deployment now drains the executors' KV events (lease %s)", self.key)
            return
        await lease.revoke()
        got = await client.get(self.key.encode())
        value = got.value if got is not None else None
        try:
            self.holder_info = json.loads(value) if value else None
        except ValueError:
            self.holder_info = None

    async def _refresh(self) -> None:
        if int((await self._lease.refresh()).TTL) <= 0:
            log.warning("KV event drain lease lapsed (this process was stalled past its TTL): draining stops")
            self._lose()

    def _lose(self) -> None:
        self.holder, self._lease = False, None
        self.lost += 1

    async def _release(self) -> None:
        lease, self._lease, self.holder = self._lease, None, False
        if lease is None:
            await self.conn.close()
            return
        try:
            async with asyncio.timeout(2.0):
                await lease.revoke()  # the key goes with it: another deployment takes over at once
        except _failures():
            pass
        await self.conn.close()

    def info(self) -> dict[str, Any]:
        return {"holder": self.holder, "drainer": self.holder_info, "acquired": self.acquired, "lost": self.lost}
