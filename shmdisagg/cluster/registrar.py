"""A worker registering itself as `trtllm-serve --disagg_cluster_uri URI --server_role ROLE` does
(TensorRT-LLM `serve/openai_server.py`: `DisaggClusterWorker` is built in the lifespan and
`register_worker()` runs once uvicorn has started; `deregister_worker()` at shutdown;
`serve/disagg_auto_scaling.py` @b3809755 for the worker itself).

`WorkerRegistration.start()`: put the worker's key (`workers.worker_key`, value
`WorkerInfo.encode()`) with a TTL of `inactive_timeout_sec`, retrying every `RETRY_S` (5 s,
upstream's `retry_interval`) until it succeeds; then a heartbeat every `heartbeat_interval_sec`
refreshes the TTL, and one that fails registers again (overwriting, as upstream's newest worker
does). `stop()` deletes the key. Backends: etcd (`etcd_store.EtcdRegistrar`) and the HTTP store
(`HttpRegistrar`, upstream's `HttpClusterStorageClient`: `POST /set`, `GET /expire`,
`DELETE /delete`, 5 s per request).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Protocol

from shmdisagg.cluster.workers import WorkerInfo, new_worker_id, worker_key

log = logging.getLogger("shmdisagg.cluster")

RETRY_S = 5.0
HTTP_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ClusterSettings:
    """What a worker needs of `disagg_cluster` (TensorRT-LLM `DisaggClusterConfig`)."""

    cluster_uri: str
    cluster_name: str = ""
    heartbeat_interval_sec: float = 5
    inactive_timeout_sec: int = 10

    def endpoints(self) -> list[tuple[str, int]]:
        out = []
        for part in self.cluster_uri.split(","):
            hostport = part.strip().split("://", 1)[-1].rstrip("/")
            host, _, port = hostport.rpartition(":")
            out.append((host.strip("[]"), int(port)))
        return out


class _Backend(Protocol):
    async def register(self) -> bool: ...
    async def refresh(self) -> bool: ...
    async def reregister(self) -> bool: ...
    async def deregister(self) -> None: ...


class HttpRegistrar:
    """The HTTP store's client side, as `HttpClusterStorageClient` calls it."""

    def __init__(self, base: str, key: str, value: str, ttl_s: int) -> None:
        self.base = base.rstrip("/")
        self.key, self.value, self.ttl_s = key, value, ttl_s

    async def _call(self, method: str, path: str, **kwargs: object) -> int | None:
        import aiohttp

        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)) as session:
                async with session.request(method, f"{self.base}{path}", **kwargs) as r:  # type: ignore[arg-type]
                    await r.read()
                    return r.status
        except (aiohttp.ClientError, TimeoutError, OSError) as err:
            log.warning("cluster store %s %s failed: %r", method, path, err)
            return None

    def _item(self, overwrite: bool) -> dict[str, object]:
        return {
            "key": self.key,
            "value": self.value,
            "expire_time": -1,
            "ttl": self.ttl_s,
            "overwrite_if_exists": overwrite,
        }

    async def register(self) -> bool:
        return await self._call("POST", "/set", json=self._item(False)) == 200

    async def reregister(self) -> bool:
        return await self._call("POST", "/set", json=self._item(True)) == 200

    async def refresh(self) -> bool:
        return await self._call("GET", "/expire", params={"key": self.key, "ttl": str(self.ttl_s)}) == 200

    async def deregister(self) -> None:
        await self._call("DELETE", "/delete", params={"key": self.key})


class WorkerRegistration:
    """One worker's registration: `worker` (its WorkerInfo), `key`; `registered` once a
    registration succeeded, `registrations` counts them (re-registrations included)."""

    def __init__(self, settings: ClusterSettings, role: int, host: str, port: int) -> None:
        self.settings = settings
        self.worker = WorkerInfo(new_worker_id(role, host, port), host, port, role)
        self.key = worker_key(settings.cluster_name, self.worker.worker_id)
        value = self.worker.encode()
        self.backend: _Backend
        if settings.cluster_uri.startswith("etcd://"):
            from shmdisagg.cluster.etcd_store import EtcdRegistrar

            self.backend = EtcdRegistrar(
                settings.endpoints(), settings.cluster_uri, self.key, value, settings.inactive_timeout_sec
            )
        else:
            self.backend = HttpRegistrar(settings.cluster_uri, self.key, value, settings.inactive_timeout_sec)
        self.registered = False
        self.registrations = 0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Register (retrying every RETRY_S until it works) and heart-beat, in a background task."""
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while not await self.backend.register():
            log.warning("worker %s registration failed, retry in %g seconds", self.worker.worker_id, RETRY_S)
            await asyncio.sleep(RETRY_S)
        self._registered()
        hb, ttl = self.settings.heartbeat_interval_sec, self.settings.inactive_timeout_sec
        if not 0 < hb < ttl:
            log.warning("heartbeat interval %s is not positive or less than inactive timeout %s: no heartbeat", hb, ttl)
            return
        while True:
            await asyncio.sleep(hb)
            if not await self.backend.refresh():
                log.warning("worker %s heartbeat failed, re-registering", self.worker.worker_id)
                while not await self.backend.reregister():
                    await asyncio.sleep(min(RETRY_S, hb))
                self._registered()

    def _registered(self) -> None:
        self.registered = True
        self.registrations += 1
        log.info("worker %s registered at %s", self.worker.worker_id, self.settings.cluster_uri)

    async def stop(self) -> None:
        """Stop heart-beating and delete the key."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.backend.deregister()
