"""The HTTP cluster store (`disagg_cluster.cluster_uri: http://HOST:PORT`): TensorRT-LLM's
`HttpClusterStorageServer` (`tensorrt_llm/serve/cluster_storage.py` @057d4a79), which the
orchestrator serves itself for its workers to register with.

Routes and payloads as upstream's (`add_routes`, `jsonify`): every route answers
`{"result": <result>}` (starlette's compact JSON), status 200 when the result is truthy, else 400.
- `POST /set`, body `StorageItem` `{key, value="", expire_time=-1, ttl=-1, overwrite_if_exists=false}`:
  false if the key exists and `overwrite_if_exists` is false; a positive `ttl` (seconds) without
  an `expire_time` expires the key `ttl` seconds from now (monotonic). Every successful set is a
  SET event, every delete and expiry a DELETE event, to the watchers of a matching prefix.
- `GET /get?key=`: the value, or null (an expired key is removed then, with its DELETE event).
- `DELETE /delete?key=`: true if it existed.
- `GET /expire?key=&ttl=`: the key now expires `ttl` seconds from now; false if absent.
- `GET /get_prefix?key_prefix=&keys_only=`: `{key: value}` (values "" with keys_only).
Expired keys are swept every `SWEEP_S` (1 s, upstream's `_check_expired_interval`). Upstream's
optional Bearer `api_key` is a constructor argument its orchestrator never passes, so there is
none here either.

Where it runs: the coordinator holds the one store (`HttpClusterStore`) and serves these routes on
its internal Unix socket (`mount`); the fleet workers serve them on the public port by relaying
each request to the coordinator (`proxy_routes`), as TensorRT-LLM's fleet workers do
(`_proxy_cluster_storage_request` in `serve/openai_disagg_server.py` id 70144234291: a 502
`{"error": "coordinator unavailable"}` when it does not answer). The store lives in the
coordinator's memory, as upstream's does: a coordinator restarted by the supervisor starts with
an empty store, and workers register again when their next heartbeat (`/expire`) fails.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

log = logging.getLogger("shmdisagg.cluster")

SWEEP_S = 1.0
STORE_ROUTES = (("/set", "POST"), ("/get", "GET"), ("/delete", "DELETE"), ("/expire", "GET"), ("/get_prefix", "GET"))


class StorageItem(BaseModel):
    """`POST /set`'s body (upstream's `StorageItem`; None fields take the default)."""

    key: str
    value: str | None = ""
    expire_time: int | float | None = -1
    ttl: int | None = -1
    overwrite_if_exists: bool | None = False


@dataclass
class _Item:
    value: str
    expire_time: float  # monotonic seconds; < 0: never


@dataclass
class _Watcher:
    prefix: str
    on_put: Callable[[str, str], object]
    on_delete: Callable[[str], object]


def _now() -> float:
    return time.monotonic()


class HttpClusterStore:
    """The in-memory store. Single-threaded: call it from the coordinator's event loop."""

    def __init__(self) -> None:
        self._items: dict[str, _Item] = {}
        self._watchers: list[_Watcher] = []

    def watch(self, prefix: str, on_put: Callable[[str, str], object], on_delete: Callable[[str], object]) -> None:
        """Call `on_put(key, value)` / `on_delete(key)` for every change under `prefix`."""
        self._watchers.append(_Watcher(prefix, on_put, on_delete))

    def _notify(self, key: str, value: str | None) -> None:
        for w in self._watchers:
            if key.startswith(w.prefix):
                try:
                    w.on_put(key, value) if value is not None else w.on_delete(key)
                except Exception:  # a watcher's bug must not fail the worker's request
                    log.exception("cluster store watcher failed on %s", key)

    def set(self, item: StorageItem) -> bool:
        if item.key in self._items and not item.overwrite_if_exists:
            return False
        expire_time = float(item.expire_time) if item.expire_time is not None else -1.0
        if expire_time < 0 and item.ttl is not None and item.ttl > 0:
            expire_time = _now() + item.ttl
        value = item.value if item.value is not None else ""
        self._items[item.key] = _Item(value, expire_time)
        self._notify(item.key, value)
        return True

    def get(self, key: str) -> str | None:
        item = self._items.get(key)
        if item is None:
            return None
        if item.expire_time < 0 or item.expire_time > _now():
            return item.value
        del self._items[key]
        self._notify(key, None)
        return None

    def expire(self, key: str, ttl: int) -> bool:
        item = self._items.get(key)
        if item is None:
            return False
        item.expire_time = _now() + int(ttl)
        return True

    def delete(self, key: str) -> bool:
        if key not in self._items:
            return False
        del self._items[key]
        self._notify(key, None)
        return True

    def get_prefix(self, key_prefix: str, keys_only: bool = False) -> dict[str, str]:
        return {k: "" if keys_only else v.value for k, v in self._items.items() if k.startswith(key_prefix)}

    def sweep(self) -> int:
        """Remove expired keys (DELETE events); returns how many."""
        now = _now()
        gone = [k for k, v in self._items.items() if 0 < v.expire_time < now]
        for key in gone:
            del self._items[key]
        for key in gone:
            self._notify(key, None)
        return len(gone)

    async def run(self) -> None:
        """Sweep every SWEEP_S until cancelled."""
        while True:
            await asyncio.sleep(SWEEP_S)
            self.sweep()


def _result(result: object) -> JSONResponse:
    return JSONResponse({"result": result}, status_code=200 if result else 400)


def mount(app: FastAPI, store: HttpClusterStore) -> None:
    """Serve the store's routes on `app` (the coordinator's internal API)."""

    async def set_(item: StorageItem) -> JSONResponse:
        return _result(store.set(item))

    async def get(key: str) -> JSONResponse:
        return _result(store.get(key))

    async def delete(key: str) -> JSONResponse:
        return _result(store.delete(key))

    async def expire(key: str, ttl: int) -> JSONResponse:
        return _result(store.expire(key, ttl))

    async def get_prefix(key_prefix: str, keys_only: bool = False) -> JSONResponse:
        return _result(store.get_prefix(key_prefix, keys_only))

    for (path, method), fn in zip(STORE_ROUTES, (set_, get, delete, expire, get_prefix), strict=True):
        app.add_api_route(path, fn, methods=[method])  # type: ignore[arg-type]


def proxy_routes(app: FastAPI, socket_path: str) -> None:
    """Serve the store's routes on `app` (a fleet worker's public port) by relaying each request,
    method, path, query and body, to the coordinator's Unix socket at `socket_path`."""
    import aiohttp

    async def relay(request: Request) -> Response:
        try:
            async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=socket_path)) as session:
                async with session.request(
                    request.method,
                    f"http://coordinator{request.url.path}",
                    params=list(request.query_params.multi_items()),
                    data=await request.body(),
                    headers={"Content-Type": request.headers.get("content-type", "application/json")},
                    timeout=aiohttp.ClientTimeout(total=5),
                ) as r:
                    body = await r.read()
                    return Response(body, status_code=r.status, media_type=r.headers.get("Content-Type"))
        except (aiohttp.ClientError, TimeoutError, OSError) as err:
            log.warning("cluster store request not relayed to the coordinator: %r", err)
            return JSONResponse({"error": "coordinator unavailable"}, status_code=502)

    for path, method in STORE_ROUTES:
        app.add_api_route(path, relay, methods=[method], include_in_schema=False)
