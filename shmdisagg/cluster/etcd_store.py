"""The etcd side of `disagg_cluster` (`cluster_uri: etcd://host:port[,etcd://host:port...]`), on
the asyncio etcd v3 client `aetcd` (the `etcd` extra).

TensorRT-LLM's `Etcd3ClusterStorage` (`tensorrt_llm/serve/cluster_storage.py` @057d4a79, on the
`etcd-sdk-python` client) is what both sides here match:
- a worker's registration is a put-if-absent of its key (`put_if_not_exists`) attached to a
  lease of `inactive_timeout_sec` (one lease per key); its heartbeat refreshes that lease every
  `heartbeat_interval_sec`; its deregistration deletes the key. A lease that expires deletes the
  key, which watchers see as a DELETE event.
- the orchestrator lists the prefix once (`get_prefix`), then watches it (`add_watch_prefix_callback`):
  a PUT is a SET event with the value, a DELETE a DELETE event with the key only.

`EtcdWatcher` (the coordinator) adds what upstream lacks: a watch that breaks (etcd restarted,
unreachable) is re-established with a fresh list, and the list is given whole to `on_sync`, so
workers that came or went meanwhile are caught up; until then the deployment keeps serving the
executors it knew. `EtcdRegistrar` (the simulator's registration, `registrar.py`) registers again on a new lease
when a refresh finds its lease gone (etcd lost its data, or the lease expired meanwhile).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger("shmdisagg.cluster")

CONNECT_TIMEOUT_S = 5  # one etcd call (the client's per-call timeout)
RETRY_S = (0.2, 0.5, 1.0, 2.0)  # reconnect backoff, the last repeated


class StoreUnreachable(RuntimeError):
    """The cluster store did not answer; the message is one line naming it."""


def _client(host: str, port: int) -> Any:
    # The coordinator forks fleet workers (which exec at once): gRPC's fork handlers would only
    # warn, and may break the parent's streams; children never use the parent's channels.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    try:
        import aetcd
    except ImportError:
        raise StoreUnreachable(
            "disagg_cluster.cluster_uri: etcd:// needs the etcd client library: pip install 'shmdisagg[etcd]'"
        ) from None
    return aetcd.Client(host=host, port=port, timeout=CONNECT_TIMEOUT_S, connect_wait_timeout=CONNECT_TIMEOUT_S)


def _errors() -> tuple[type[Exception], ...]:
    """What an etcd call raises when the store fails (never a bug of ours)."""
    import aetcd.exceptions

    client_error: type[Exception] = aetcd.exceptions.ClientError
    return (client_error, OSError, TimeoutError)


def _failures() -> tuple[type[Exception], ...]:
    return (*_errors(), StoreUnreachable)


class EtcdConnection:
    """A client on the first endpoint of `endpoints` that answers; `connect()` moves on to the
    next one when the current one fails."""

    def __init__(self, endpoints: list[tuple[str, int]], uri: str) -> None:
        self.endpoints = endpoints
        self.uri = uri
        self._next = 0
        self.client: Any = None

    async def connect(self) -> Any:
        """A client whose endpoint answered a status call. Raises StoreUnreachable (one line)."""
        await self.close()
        last: BaseException | None = None
        for _ in range(len(self.endpoints)):
            host, port = self.endpoints[self._next % len(self.endpoints)]
            self._next += 1
            client = _client(host, port)
            try:
                async with asyncio.timeout(CONNECT_TIMEOUT_S + 1):
                    await client.status()
            except _errors() as err:
                with contextlib.suppress(Exception):
                    await client.close()
                last = err
                continue
            self.client = client
            return client
        raise StoreUnreachable(f"etcd at {self.uri} does not answer ({_short(last)})")

    async def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.close()


def _short(err: BaseException | None) -> str:
    text = str(err).strip().splitlines()[0] if err is not None and str(err).strip() else type(err).__name__
    return text[:200]


class EtcdWatcher:
    """Lists and watches `prefix`; calls `on_sync(values)` with every key under it after each
    (re)connection, then `on_put(key, value)` / `on_delete(key)` per event, in order. Keys and
    values are str (UTF-8). `connected`: whether the watch is up now; `resyncs`: how many times
    it was re-established after a failure."""

    def __init__(
        self,
        endpoints: list[tuple[str, int]],
        uri: str,
        prefix: str,
        on_sync: Callable[[dict[str, str]], Awaitable[None] | None],
        on_put: Callable[[str, str], Awaitable[None] | None],
        on_delete: Callable[[str], Awaitable[None] | None],
    ) -> None:
        self.conn = EtcdConnection(endpoints, uri)
        self.prefix = prefix
        self.on_sync, self.on_put, self.on_delete = on_sync, on_put, on_delete
        self.connected = False
        self.resyncs = 0
        self._revision = 0

    async def start(self) -> None:
        """Connect and list once (before the fleet starts). Raises StoreUnreachable."""
        await self.conn.connect()
        await self._list()

    async def _list(self) -> None:
        res = await self.conn.client.get_prefix(self.prefix.encode())
        self._revision = int(res.header.revision)
        values = {kv.key.decode(): kv.value.decode(errors="replace") for kv in res}
        await _call(self.on_sync, values)
        self.connected = True

    async def run(self) -> None:
        """Watch until cancelled, re-listing after every failure (`start` must have run)."""
        failures = 0
        while True:
            try:
                if self.conn.client is None:
                    await self.conn.connect()
                    await self._list()
                    self.resyncs += 1
                    log.warning("etcd at %s answers again: the executor list is caught up", self.conn.uri)
                    failures = 0
                await self._watch()
            except asyncio.CancelledError:
                raise
            except _failures() as err:
                if self.connected:
                    log.warning(
                        "etcd at %s unreachable (%s): serving the executors known so far, reconnecting",
                        self.conn.uri,
                        _short(err),
                    )
                self.connected = False
                await self.conn.close()
                await asyncio.sleep(RETRY_S[min(failures, len(RETRY_S) - 1)])
                failures += 1

    async def _watch(self) -> None:
        import aetcd.rtypes

        watch = await self.conn.client.watch_prefix(self.prefix.encode(), start_revision=self._revision + 1)
        try:
            async for event in watch:
                self._revision = max(self._revision, int(event.kv.mod_revision))
                key = event.kv.key.decode()
                if event.kind == aetcd.rtypes.EventKind.PUT:
                    await _call(self.on_put, key, event.kv.value.decode(errors="replace"))
                else:
                    await _call(self.on_delete, key)
        finally:
            with contextlib.suppress(Exception):
                await watch.cancel()
        raise StoreUnreachable("the watch ended")

    async def close(self) -> None:
        await self.conn.close()


async def _call(fn: Callable[..., Awaitable[None] | None], *args: Any) -> None:
    out = fn(*args)
    if out is not None:
        await out


class EtcdRegistrar:
    """One worker's key, as `DisaggClusterWorker` keeps it on `Etcd3ClusterStorage`: put-if-absent
    of `key` = `value` on a new lease of `ttl_s` (`register`), the lease refreshed (`refresh`),
    the key deleted and its lease revoked (`deregister`). Every call answers False on a store
    error (logged) rather than raising, as upstream's `handle_etcd_error` does."""

    def __init__(self, endpoints: list[tuple[str, int]], uri: str, key: str, value: str, ttl_s: int) -> None:
        self.conn = EtcdConnection(endpoints, uri)
        self.key, self.value, self.ttl_s = key, value, ttl_s
        self._lease: Any = None

    async def register(self) -> bool:
        """Put the key on a new lease if absent; False if it exists or etcd failed."""
        try:
            if self.conn.client is None:
                await self.conn.connect()
            client = self.conn.client
            self._lease = await client.lease(self.ttl_s)
            ok, _ = await client.transaction(
                compare=[client.transactions.create(self.key.encode()) == 0],
                success=[client.transactions.put(self.key.encode(), self.value.encode(), lease=self._lease)],
                failure=[],
            )
            return bool(ok)
        except _failures() as err:
            log.warning("registration of %s at %s failed: %s", self.key, self.conn.uri, _short(err))
            await self.conn.close()
            return False

    async def reregister(self) -> bool:
        """After a failed refresh: put the key again on a new lease, overwriting (upstream's
        newest worker re-registers with `overwrite_if_exists=True`): after an etcd restart the old
        key may still be there on a lease nobody refreshes any more, and the key is this
        worker's own (its id is unique), so the same key and value go on without a DELETE."""
        try:
            if self.conn.client is None:
                await self.conn.connect()
            client = self.conn.client
            self._lease = await client.lease(self.ttl_s)
            await client.put(self.key.encode(), self.value.encode(), lease=self._lease)
            return True
        except _failures() as err:
            log.warning("re-registration of %s at %s failed: %s", self.key, self.conn.uri, _short(err))
            await self.conn.close()
            return False

    async def refresh(self) -> bool:
        """Refresh the lease; False if it is gone (expired, or etcd lost it) or etcd failed."""
        try:
            if self.conn.client is None or self._lease is None:
                return False
            return int((await self._lease.refresh()).TTL) > 0
        except _failures() as err:
            log.warning("heartbeat of %s failed: %s", self.key, _short(err))
            await self.conn.close()
            return False

    async def deregister(self) -> None:
        """Delete the key and revoke the lease (best effort, bounded)."""
        try:
            if self.conn.client is None:
                await self.conn.connect()
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                await self.conn.client.delete(self.key.encode())
                if self._lease is not None:
                    await self._lease.revoke()
        except _failures() as err:
            log.warning("deregistration of %s failed: %s", self.key, _short(err))
        finally:
            await self.conn.close()
