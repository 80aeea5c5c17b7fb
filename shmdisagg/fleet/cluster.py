"""A worker's copy of what the coordinator knows beyond the table: model names, each
executor's `/server_info` (generation-first needs the context server's advertised
`disaggregated_params`) and each kv_cache_aware role's routing key (`routing_key_configs`: the
block size and hash algorithm its prompts are hashed with). Refreshed when the table's
`servers_version` changes."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp

from shmdisagg.orchestrator.directory import ServerDirectory
from shmdisagg.routing.kv_cache_aware import RoutingKeyConfig
from shmdisagg.shm.table import ROLE_CONTEXT, ROLE_GENERATION

log = logging.getLogger("shmdisagg.fleet")


async def fetch_cluster_info(socket_path: str, timeout_s: float) -> dict[str, Any]:
    """The coordinator's `/cluster_info` over its Unix socket, retried until `timeout_s`.
    Raises TimeoutError."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=socket_path)) as session:
        while True:
            try:
                async with session.get("http://coordinator/cluster_info", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        data = await r.json()
                        if isinstance(data, dict):
                            return data
            except (TimeoutError, aiohttp.ClientError, OSError):
                pass
            if loop.time() > deadline:
                raise TimeoutError(f"coordinator at {socket_path} did not answer within {timeout_s:g} s")
            await asyncio.sleep(0.05)


async def announce_listening(socket_path: str, pid: int, timeout_s: float = 2.0) -> None:
    """Tell the coordinator (`POST /listening` on its Unix socket) that this worker's socket on
    the public port listens: it reports the deployment ready only once every worker's does.
    Never raises: a coordinator that does not answer (one being replaced) only loses the news."""
    try:
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=socket_path)) as session:
            async with session.post(
                "http://coordinator/listening", json={"pid": pid}, timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as r:
                await r.read()
    except (TimeoutError, aiohttp.ClientError, OSError) as err:
        log.debug("listening not announced to the coordinator: %r", err)


class ClusterView:
    """State: `models` (names executors serve), `server_info` (slot -> its `/server_info`),
    `routing_keys` (role -> RoutingKeyConfig of a kv_cache_aware role)."""

    def __init__(self, directory: ServerDirectory) -> None:
        self.directory = directory
        self.models: frozenset[str] = frozenset()
        self.server_info: dict[int, dict[str, Any]] = {}
        self.routing_keys: dict[int, RoutingKeyConfig] = {}
        self.routing_key_configs: dict[str, Any] = {}  # as the coordinator gave them: public /cluster_info
        self.version = -1

    def apply(self, info: dict[str, Any], version: int) -> None:
        self.models = frozenset(info.get("models", []))
        self.server_info = {int(s["slot"]): s.get("server_info") or {} for s in info.get("servers", [])}
        keys = info.get("routing_key_configs") or {}
        self.routing_key_configs = keys
        self.routing_keys = {
            role: RoutingKeyConfig(int(keys[name]["tokens_per_block"]), keys[name].get("kv_cache_hash_algo"))
            for role, name in ((ROLE_CONTEXT, "context"), (ROLE_GENERATION, "generation"))
            if name in keys
        }
        self.version = version

    def ctx_server_info(self, slot: int) -> dict[str, Any]:
        """A context server's `/server_info`; its address stands in for `ctx_info_endpoint`
        while the coordinator's copy has not reached this worker yet."""
        info = self.server_info.get(slot)
        if info and (info.get("disaggregated_params") or {}).get("ctx_info_endpoint"):
            return info
        host, port = self.directory.address(slot)
        return {"disaggregated_params": {"ctx_info_endpoint": [f"{host}:{port}"]}}
