"""A fleet worker's request path in the test's own process: the real `DisaggService`, `Flows`,
`LegRunner` and upstream pool over a shared-memory table the test creates, in front of fake
executors (separate processes), driven as ASGI. What the worker wires around it (here
`Observability`) is the test's to pass, so in-process exporters and writers can be inspected."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from shmdisagg.config import DisaggConfig, RouterConfig
from shmdisagg.orchestrator.directory import ServerDirectory
from shmdisagg.orchestrator.flows import Flows
from shmdisagg.orchestrator.ids import DisaggIdGenerator
from shmdisagg.orchestrator.legs import LegRunner
from shmdisagg.orchestrator.reporting import FailureReporter
from shmdisagg.orchestrator.service import Admission, DisaggService
from shmdisagg.routing import make_policy
from shmdisagg.shm.table import ROLE_CONTEXT, ROLE_GENERATION, ControlTable, process_starttime
from shmdisagg.upstream import UpstreamPool

Handler = Callable[[Any, Any, Any, bool], Awaitable[None]]


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    messages: list[dict[str, Any]] = field(default_factory=list)

    def json(self) -> Any:
        return orjson.loads(self.body)


class Stack:
    """The table (slot 0: the context executor, 1: the generation executor) and the service."""

    def __init__(self, shm_prefix: str, ctx_addr: str, gen_addr: str, tmp: str) -> None:
        self.table = ControlTable.create(shm_prefix)
        self.table.publish_server(0, ctx_addr, ROLE_CONTEXT, True, tokens_per_block=32)
        self.table.publish_server(1, gen_addr, ROLE_GENERATION, True, tokens_per_block=32)
        self.row = self.table.claim_row(os.getpid(), process_starttime(os.getpid()))
        self.config = DisaggConfig.model_validate({
            "hostname": "127.0.0.1",
            "context_servers": {"urls": [ctx_addr]},
            "generation_servers": {"urls": [gen_addr]},
            "shmdisagg": {"request_timeout_s": 20},
        })  # fmt: skip
        self.socket = os.path.join(tmp, "coord.sock")

    def service(self, upstream: UpstreamPool) -> DisaggService:
        directory = ServerDirectory(self.table)
        ctx = make_policy(self.table, self.row, ROLE_CONTEXT, RouterConfig())
        gen = make_policy(self.table, self.row, ROLE_GENERATION, RouterConfig())
        ids = DisaggIdGenerator(1, 0)
        legs = LegRunner(directory, upstream, FailureReporter(self.socket), max_retries=1)
        flows = Flows(legs, ctx, gen, ids.next_id, lambda slot: {})
        service = DisaggService(self.config, flows, ids, Admission(0, lambda: 0), "context_first")
        service.models = frozenset({"fake-model"})
        return service

    def close(self) -> None:
        self.table.unlink()
        self.table.close()


async def call(handler: Handler, path: str, body: Any, headers: list[tuple[bytes, bytes]] | None = None) -> Answer:
    """One POST through `handler` (an ASGI hot-route handler); the client never disconnects."""
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": [(b"content-type", b"application/json"), *(headers or [])],
    }
    sent = False
    forever = asyncio.Event()
    messages: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await forever.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    await handler(scope, receive, send, path.endswith("chat/completions"))
    start = messages[0]
    hdrs = {k.decode().lower(): v.decode() for k, v in start["headers"]}
    return Answer(start["status"], hdrs, b"".join(m.get("body", b"") for m in messages[1:]), messages)


def run(coro_fn: Callable[[UpstreamPool], Awaitable[Any]]) -> Any:
    """Run `coro_fn(pool)` on a fresh loop with a fresh upstream pool, closed afterwards."""

    async def main() -> Any:
        pool = UpstreamPool()
        try:
            return await coro_fn(pool)
        finally:
            await pool.close()

    return asyncio.run(main())
