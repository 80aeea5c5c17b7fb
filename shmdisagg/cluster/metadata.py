"""TensorRT-LLM's older dynamic membership: the metadata server (`trtllm-serve -m FILE` on the
workers and on `trtllm-serve disaggregated`), an etcd whose `trtllm/*` keys list the workers.

The config file (`llmapi/disagg_utils.py` @0228a712 `MetadataServerConfig`,
`parse_metadata_server_config_file`: a YAML mapping into the dataclass, so an unknown key is a
TypeError there and refused by name here): `server_type` (`etcd`, the only one), `hostname`
(`localhost`), `port` (2379), `health_check_timeout` (5.0 s), `refresh_interval` (10.0 s).

A worker (`serve/openai_server.py`, lifespan): puts `trtllm/{llm_id}` (`llm_id` =
`{hostname}-{pid}-{unix ms}`, `llmapi/llm.py`) = `json.dumps({"model", "version", "timestamp"
(ISO local time), "server_role": ROLE name, "url": "http://host:port"})`, no lease; removes it at
shutdown. The orchestrator (`serve/router.py` `Router._monitor_servers`, `fetch_live_servers`,
`check_servers_health`, `_filter_servers_by_role`): every `refresh_interval` reads every `trtllm/`
key, takes those whose value is a JSON object with a `url`, checks each url's `/health` (twice,
`health_check_timeout` each) and deletes the keys of servers that fail both, keeps a role's
servers (`server_type` or `server_role`, lower-cased, `context` / `generation`) and
adds / removes the differences. `MetadataPoller` does the same into `Membership`, with the keys as
membership keys, so a server is prepared (health, `/server_info`) before the fleet routes to it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import yaml

from shmdisagg.cluster.workers import ROLE_BY_NAME, WorkerInfo

log = logging.getLogger("shmdisagg.cluster")

KEY_PREFIX = "trtllm/"


class MetadataConfigError(ValueError):
    """The metadata server config file cannot be used; one line naming the key."""


@dataclass(frozen=True)
class MetadataServerConfig:
    server_type: str = "etcd"
    hostname: str = "localhost"
    port: int = 2379
    health_check_timeout: float = 5.0
    refresh_interval: float = 10.0

    @property
    def uri(self) -> str:
        return f"etcd://{self.hostname}:{self.port}"


def load_metadata_config(path: str) -> MetadataServerConfig:
    """Read `-m FILE`. Raises MetadataConfigError (one line: the file, the key, the problem)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as err:
        raise MetadataConfigError(f"{path}: cannot read: {getattr(err, 'strerror', None) or err}") from None
    if not isinstance(data, dict) or "server_type" not in data:
        raise MetadataConfigError(f"{path}: server_type: missing (TensorRT-LLM requires it; the only one is etcd)")
    known = {"server_type", "hostname", "port", "health_check_timeout", "refresh_interval"}
    for key in data:
        if key not in known:
            raise MetadataConfigError(f"{path}: {key}: not a MetadataServerConfig key ({', '.join(sorted(known))})")
    if data["server_type"] != "etcd":
        raise MetadataConfigError(f"{path}: server_type: {data['server_type']!r} is not supported (only etcd)")
    port = data.get("port", 2379)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise MetadataConfigError(f"{path}: port: {port!r} is not a TCP port")
    hostname = data.get("hostname", "localhost")
    if not isinstance(hostname, str) or not hostname:
        raise MetadataConfigError(f"{path}: hostname: must be a host name")
    out: dict[str, Any] = {"hostname": hostname, "port": port}
    for key in ("health_check_timeout", "refresh_interval"):
        if key in data:
            v = data[key]
            if isinstance(v, bool) or not isinstance(v, int | float) or v <= 0:
                raise MetadataConfigError(f"{path}: {key}: must be a positive number of seconds")
            out[key] = float(v)
    return MetadataServerConfig(**out)


def llm_id() -> str:
    """`LLM.llm_id`: `{hostname}-{pid}-{unix ms}`."""
    return f"{socket.gethostname()}-{os.getpid()}-{int(time.time() * 1000)}"


def worker_entry(model: str, version: str, role: str, host: str, port: int) -> str:
    """The value a worker puts under `trtllm/{llm_id}` (`role`: context or generation)."""
    return json.dumps(
        {
            "model": model,
            "version": version,
            "timestamp": datetime.now().isoformat(),
            "server_role": role.upper(),
            "url": f"http://{host}:{port}",
        }
    )


_HTTPS_REFUSED: set[str] = set()  # https urls already logged as refused


def parse_entry(value: str) -> WorkerInfo | None:
    """A `trtllm/*` value as the router reads it, or None when it names no context or generation
    server (not JSON, not an object, no `url`, another role) or one at an `https://` url (logged
    once: the fleet speaks plain HTTP to executors)."""
    try:
        data = json.loads(value)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("url"), str):
        return None
    kind = str(data.get("server_type") or data.get("server_role") or "").lower()
    if kind not in ROLE_BY_NAME:
        return None
    if data["url"].startswith("https://"):  # upstream would speak TLS to it; the fleet cannot
        if data["url"] not in _HTTPS_REFUSED:
            _HTTPS_REFUSED.add(data["url"])
            log.warning("metadata server entry %s not used: https executors are not supported", data["url"])
        return None
    url = data["url"].removeprefix("http://").rstrip("/")
    host, _, port = url.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return WorkerInfo(url, host.strip("[]"), int(port), ROLE_BY_NAME[kind])


class MetadataPoller:
    """Every `refresh_interval`: read `trtllm/*`, check health, delete the dead, sync membership.
    `sync(values)` receives `{key: WorkerInfo-encoded value}` of the live servers of both roles."""

    def __init__(self, config: MetadataServerConfig, sync: Callable[[dict[str, str]], object]) -> None:
        from shmdisagg.cluster.etcd_store import EtcdConnection

        self.config = config
        self.sync = sync
        self.conn = EtcdConnection([(config.hostname, config.port)], config.uri)
        self.polls = 0
        self.removed_dead = 0
        self.connected = False

    async def start(self) -> None:
        """Connect and poll once. Raises etcd_store.StoreUnreachable (one line)."""
        await self.conn.connect()
        await self.poll()

    async def poll(self) -> None:
        import aiohttp

        client = self.conn.client
        res = await client.get_prefix(KEY_PREFIX.encode())
        entries: dict[str, WorkerInfo] = {}
        for kv in res:
            info = parse_entry(kv.value.decode(errors="replace"))
            if info is not None:
                entries[kv.key.decode()] = info
        timeout = aiohttp.ClientTimeout(total=self.config.health_check_timeout)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            alive = await asyncio.gather(*(self._healthy(session, i) for i in entries.values()))
        live: dict[str, str] = {}
        for (key, info), ok in zip(entries.items(), alive, strict=True):
            if ok:
                live[key] = info.encode()
            else:
                log.info("removing dead server %s from the metadata server (%s)", info.addr, key)
                await client.delete(key.encode())
                self.removed_dead += 1
        self.polls += 1
        self.connected = True
        self.sync(live)

    async def _healthy(self, session: Any, info: WorkerInfo) -> bool:
        import aiohttp

        for _ in range(2):  # upstream checks twice before declaring a server dead
            try:
                async with session.get(f"http://{info.addr}/health") as r:
                    if r.status == 200:
                        return True
            except (aiohttp.ClientError, TimeoutError, OSError):
                pass
        return False

    async def run(self) -> None:
        from shmdisagg.cluster.etcd_store import _failures

        while True:
            await asyncio.sleep(self.config.refresh_interval)
            try:
                if self.conn.client is None:
                    await self.conn.connect()
                await self.poll()
            except asyncio.CancelledError:
                raise
            except _failures() as err:
                if self.connected:
                    log.warning("metadata server %s unreachable (%s): keeping the servers known", self.config.uri, err)
                self.connected = False
                await self.conn.close()

    async def close(self) -> None:
        await self.conn.close()


class MetadataRegistration:
    """A worker's `trtllm/{llm_id}` entry (the simulator's `--metadata_server_config_file`)."""

    def __init__(self, config: MetadataServerConfig, model: str, version: str, role: str, host: str, port: int):
        from shmdisagg.cluster.etcd_store import EtcdConnection

        self.key = f"{KEY_PREFIX}{llm_id()}"
        self.value = worker_entry(model, version, role, host, port)
        self.conn = EtcdConnection([(config.hostname, config.port)], config.uri)

    async def start(self) -> None:
        await self.conn.connect()
        await self.conn.client.put(self.key.encode(), self.value.encode())
        log.info("%s is registered", self.key)

    async def stop(self) -> None:
        from shmdisagg.cluster.etcd_store import _failures

        try:
            if self.conn.client is None:
                await self.conn.connect()
            await self.conn.client.delete(self.key.encode())
            log.info("%s is unregistered", self.key)
        except _failures() as err:
            log.warning("%s not unregistered: %s", self.key, err)
        finally:
            await self.conn.close()
