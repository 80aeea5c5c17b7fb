"""Executor registry and health: the coordinator's view of every context and generation server.

Each executor of the config gets a slot in the shared table (context servers first). A poll loop
GETs every executor's `/health`; the first 200 is followed by `/server_info` and `/v1/models`
(TensorRT-LLM's "prepare" step, shared/reference/trtllm_protocol.md §3.1) before the server is
published healthy. A refused connection marks a server unhealthy at once; other failures (a
non-200, a timeout) after `FAILURES_TO_UNHEALTHY` polls in a row. A 503 with
`x-trtllm-server-state: starting` is "loading", never healthy.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from shmdisagg.config import DisaggConfig
from shmdisagg.shm.table import ROLE_CONTEXT, ROLE_GENERATION, ControlTable

log = logging.getLogger("shmdisagg.coordinator")

FAILURES_TO_UNHEALTHY = 2
ROLE_NAMES = {ROLE_CONTEXT: "context", ROLE_GENERATION: "generation"}


@dataclass
class Executor:
    """One executor as the coordinator tracks it."""

    slot: int
    role: int
    host: str
    port: int
    healthy: bool = False
    failures: int = 0
    server_info: dict[str, Any] | None = None
    models: list[str] = field(default_factory=list)

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def base(self) -> str:
        return f"http://{self.addr}"


def executors_from_config(config: DisaggConfig) -> list[Executor]:
    """Context servers get slots 0..n-1, generation servers the next ones."""
    out: list[Executor] = []
    for role, section in ((ROLE_CONTEXT, config.context_servers), (ROLE_GENERATION, config.generation_servers)):
        for host, port in section.addresses():
            out.append(Executor(len(out), role, host, port))
    if len(out) > 64:
        raise ValueError(f"{len(out)} executors configured; the table holds at most 64")
    return out


class HealthMonitor:
    """Polls executors and publishes their records and health flags to the table."""

    def __init__(self, table: ControlTable, executors: list[Executor], interval_s: float) -> None:
        self.table = table
        self.executors = executors
        self.interval_s = interval_s
        self._session: aiohttp.ClientSession | None = None
        for ex in executors:
            table.publish_server(ex.slot, ex.addr, ex.role, False)

    def ready(self) -> bool:
        """Every role has at least one healthy server."""
        return all(any(e.healthy for e in self.executors if e.role == r) for r in (ROLE_CONTEXT, ROLE_GENERATION))

    def models(self) -> list[str]:
        return sorted({m for e in self.executors if e.healthy for m in e.models})

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=max(self.interval_s * 2, 1.0))
        async with aiohttp.ClientSession(timeout=timeout) as session:
            self._session = session
            while True:
                await self.poll_once()
                await asyncio.sleep(self.interval_s)

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._check(e) for e in self.executors))

    async def _check(self, ex: Executor) -> None:
        assert self._session is not None
        try:
            async with self._session.get(f"{ex.base}/health") as r:
                ok = r.status == 200
            if ok and ex.server_info is None:
                ex.server_info = await self._get_json(f"{ex.base}/server_info")
                models = await self._get_json(f"{ex.base}/v1/models")
                ex.models = [m["id"] for m in models.get("data", []) if isinstance(m, dict) and "id" in m]
        except (aiohttp.ClientConnectorError, ConnectionRefusedError):
            self._mark(ex, False, refused=True)
            return
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, KeyError) as err:
            log.debug("health check of %s failed: %r", ex.addr, err)
            ok = False
        self._mark(ex, ok)

    async def _get_json(self, url: str) -> dict[str, Any]:
        assert self._session is not None
        async with self._session.get(url) as r:
            r.raise_for_status()
            data = await r.json(content_type=None)
        if not isinstance(data, dict):
            raise ValueError(f"{url} did not return a JSON object")
        return data

    def _mark(self, ex: Executor, ok: bool, refused: bool = False) -> None:
        if ok:
            ex.failures = 0
            if not ex.healthy:
                ex.healthy = True
                info = ex.server_info or {}
                self.table.publish_server(
                    ex.slot,
                    ex.addr,
                    ex.role,
                    True,
                    max_batch_size=int(info.get("max_batch_size") or 0),
                    tokens_per_block=int(info.get("tokens_per_block") or 0),
                    max_num_tokens=int(info.get("max_num_tokens") or 0),
                )
                log.info("%s server %s is healthy", ROLE_NAMES[ex.role], ex.addr)
            return
        ex.failures += 1
        if ex.healthy and (refused or ex.failures >= FAILURES_TO_UNHEALTHY):
            ex.healthy = False
            ex.server_info = None  # prepare again when it comes back (it may have restarted)
            self.table.set_healthy(ex.slot, False)
            log.warning("%s server %s is unhealthy", ROLE_NAMES[ex.role], ex.addr)

    def cluster_info(self) -> dict[str, Any]:
        return {
            "is_ready": self.ready(),
            "server_lists": {
                name: [e.addr for e in self.executors if e.role == role] for role, name in ROLE_NAMES.items()
            },
            "servers": [
                {"slot": e.slot, "addr": e.addr, "role": ROLE_NAMES[e.role], "healthy": e.healthy, "server_info": e.server_info}
                for e in self.executors
            ],
            "models": self.models(),
        }
