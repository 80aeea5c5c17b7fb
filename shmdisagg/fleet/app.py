"""The public API of one fleet worker, as one ASGI app.

The two hot routes (`POST /v1/completions`, `POST /v1/chat/completions`) go straight to
`DisaggService.handle` as plain ASGI: no request model, no response model, bodies relayed as
bytes (FastAPI + pydantic models add 0.3-0.4 ms per request, doubling the proxy's CPU: the
project's stack calibration).
`POST /v1/messages` and `/v1/messages/count_tokens` go to the Anthropic adapter
(`shmdisagg/anthropic/`), which runs messages through the same chat path; `POST /v1/responses`
is a 501 (`shmdisagg/orchestrator/responses_api.py` says why).
Everything else (`/health`, `/v1/models`, `/version`, `/cluster_info`, `/metrics`,
`/perf_metrics`, the OpenAPI docs) is a FastAPI app. `/metrics` and `/perf_metrics` answer for the whole fleet
(`shmdisagg/metrics/`), whichever worker the kernel hands the connection to.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from shmdisagg import __version__
from shmdisagg.anthropic.protocol import PATHS as ANTHROPIC_PATHS, error_envelope
from shmdisagg.anthropic.route import AnthropicRoutes
from shmdisagg.fleet.hot import HotCycle, HotHandler
from shmdisagg.orchestrator.answers import executor_error_message
from shmdisagg.orchestrator.asgi import JSON_HEADERS, Receive, Scope, Send, send_bytes
from shmdisagg.orchestrator.directory import ServerDirectory, split_addr
from shmdisagg.orchestrator.errors import error_body
from shmdisagg.orchestrator.responses_api import responses
from shmdisagg.orchestrator.service import DisaggService
from shmdisagg.shm.table import ROLE_CONTEXT, ControlTable
from shmdisagg.upstream import UpstreamError

if TYPE_CHECKING:
    from shmdisagg.metrics.fleet import FleetMetrics
    from shmdisagg.metrics.request import RequestMetrics

_HOT = {"/v1/completions": False, "/v1/chat/completions": True}
_turns = itertools.count()  # which healthy context server /v1/models asks, in turn
log = logging.getLogger("shmdisagg.fleet")
# TensorRT-LLM's newer public routes, served by FleetApp before FastAPI (shmdisagg/anthropic/,
# responses_api.py)
_NEWER = {
    "/v1/messages": "Anthropic Messages",
    "/v1/messages/count_tokens": "Anthropic token count",
    "/v1/responses": "OpenAI Responses (501)",
}
_ALLOW_POST = [*JSON_HEADERS, (b"allow", b"POST")]


def control_app(
    service: DisaggService,
    directory: ServerDirectory,
    table: ControlTable,
    worker_index: int,
    metrics: FleetMetrics | None = None,
) -> FastAPI:
    """The FastAPI app for everything but the two hot routes."""
    api = FastAPI(title="shmdisagg", version="0.1.0", docs_url="/docs", redoc_url=None)

    @api.exception_handler(StarletteHTTPException)
    async def openai_error(_: Request, exc: StarletteHTTPException) -> Response:
        """404/405 and the like in the OpenAI error shape, like every other error we send."""
        return Response(
            error_body(exc.status_code, str(exc.detail)),
            status_code=exc.status_code,
            media_type="application/json",
            headers=getattr(exc, "headers", None),
        )

    @api.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, exc: RequestValidationError) -> Response:
        """A bad query parameter of a control route: a 400 in the same shape (FastAPI's own
        default is a 422 `{"detail": [...]}`)."""
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return Response(
            error_body(400, f"{param or 'request'}: {first.get('msg', 'invalid')}", param),
            status_code=400,
            media_type="application/json",
        )

    if metrics is not None:
        _metrics_routes(api, metrics)

    cluster = service.config.disagg_cluster
    if cluster is not None and not cluster.is_etcd:
        from shmdisagg.cluster.http_store import proxy_routes

        proxy_routes(api, service.config.coordinator_socket)  # the HTTP cluster store, held by the coordinator
    # disagg_cluster.minimal_instances (TensorRT-LLM's is_ready_with_router); else one of each
    want = (
        (cluster.minimal_instances.context_servers, cluster.minimal_instances.generation_servers)
        if cluster is not None
        else (1, 1)
    )

    @api.get("/health")
    def health() -> JSONResponse:
        n_ctx, n_gen = directory.healthy_counts()
        ctx = n_ctx >= want[0] or service.flows.options.benchmark_gen_only  # no context leg is sent then
        gen = n_gen >= want[1]
        if ctx and gen:
            return JSONResponse({"status": "ok"})
        missing = [r for r, ok in (("context", ctx), ("generation", gen)) if not ok]
        message = f"no healthy {' or '.join(missing)} server"
        if cluster is not None:
            counts = {"context": (n_ctx, want[0]), "generation": (n_gen, want[1])}
            message = "fewer healthy servers than disagg_cluster.minimal_instances: " + ", ".join(
                f"{r} {counts[r][0]} of {counts[r][1]}" for r in missing
            )
        return JSONResponse({"status": "unavailable", "message": message}, status_code=503)

    @api.get("/v1/models")
    async def models() -> Response:
        """Forwarded to a healthy context executor, as TensorRT-LLM's newest orchestrator does
        (`get_model`, tensorrt_llm/serve/openai_disagg_server.py): the executors know the model's
        name, the orchestrator does not. 503 while no context executor is healthy; an executor's
        error is relayed with its status, its message unwrapped and without its address."""
        ready = [s for s in directory.servers() if s.healthy and s.role == ROLE_CONTEXT]
        if not ready:
            return Response(
                error_body(503, "no healthy context server to ask for its models; retry shortly"),
                status_code=503,
                media_type="application/json",
            )
        server = ready[next(_turns) % len(ready)]
        host, port = split_addr(server.addr)
        try:
            async with asyncio.timeout(5.0):
                resp = await service.flows.legs.upstream.request(host, port, "GET", "/v1/models", timeout_s=5.0)
                raw = await resp.read()
        except (UpstreamError, TimeoutError) as err:
            log.warning("GET /v1/models from context server %s failed: %s", server.addr, err)
            return Response(
                error_body(502, "the context executor did not answer /v1/models"),
                status_code=502,
                media_type="application/json",
            )
        if resp.status != 200:
            return Response(
                error_body(resp.status, executor_error_message(raw, resp.status)),
                status_code=resp.status,
                media_type="application/json",
            )
        return Response(raw, media_type="application/json")

    @api.get("/version")
    def version() -> dict[str, str]:
        """`{"version": ...}` as TensorRT-LLM's orchestrator answers it (its own version: here
        shmdisagg's)."""
        return {"version": __version__}

    @api.get("/cluster_info")
    def cluster_info() -> dict[str, Any]:
        servers = directory.servers()
        coord = table.coordinator()
        n_ctx, n_gen = directory.healthy_counts()
        return {
            "is_ready": n_ctx >= want[0] and n_gen >= want[1],
            "server_lists": {
                "context": [s.addr for s in servers if s.role == ROLE_CONTEXT],
                "generation": [s.addr for s in servers if s.role != ROLE_CONTEXT],
            },
            "healthy": {s.addr: s.healthy for s in servers},
            # TensorRT-LLM's cluster_info field: how each kv_cache_aware role hashes prompts
            "routing_key_configs": service.routing_key_configs,
            "schedule_style": service.schedule_style,
            "num_workers": service.config.num_workers,
            "coordinator_pid": coord["pid"],
            "fleet_pids": sorted(r.pid for r in table.rows()),
            "worker_index": worker_index,
            "worker_pid": os.getpid(),
            "kv_hints": {"sent": hints.sent, "failed": hints.failed} if (hints := service.flows.legs.hints) else None,
        }

    @api.get("/server_info")
    def server_info() -> dict[str, Any]:
        servers = directory.servers()
        return {
            "models": sorted(service.models),
            "schedule_style": service.schedule_style,
            "num_workers": service.config.num_workers,
            "roles": {
                "context": {
                    "router": service.config.context_servers.router.type,
                    "servers": [s.addr for s in servers if s.role == ROLE_CONTEXT],
                },
                "generation": {
                    "router": service.config.generation_servers.router.type,
                    "servers": [s.addr for s in servers if s.role != ROLE_CONTEXT],
                },
            },
            "healthy": {s.addr: s.healthy for s in servers},
        }

    # Declared for the OpenAPI document only: FleetApp serves these paths before FastAPI.
    for path in _HOT:
        api.add_api_route(path, _documented_only, methods=["POST"], include_in_schema=True, summary=f"OpenAI {path}")
    for path, summary in _NEWER.items():
        api.add_api_route(path, _documented_only, methods=["POST"], include_in_schema=True, summary=summary)
    return api


def _metrics_routes(api: FastAPI, metrics: FleetMetrics) -> None:
    from shmdisagg.metrics.exposition import CONTENT_TYPE

    async def prometheus() -> Response:
        """Prometheus text exposition for the whole deployment (every fleet worker)."""
        return Response(metrics.scrape(), media_type=CONTENT_TYPE)

    # `/prometheus/metrics` is where TensorRT-LLM's disaggregated server serves it
    api.add_api_route("/metrics", prometheus, methods=["GET"], summary="Prometheus metrics of the whole fleet")
    api.add_api_route("/prometheus/metrics", prometheus, methods=["GET"], include_in_schema=False)

    @api.get("/perf_metrics")
    async def perf_metrics(keep: bool = False) -> Response:
        """Per-request timing records of the whole fleet joined with the executors' records;
        drained on read like TensorRT-LLM's (`?keep=true` reads without draining)."""
        status, body = await metrics.perf_metrics(keep)
        return Response(body, status_code=status, media_type="application/json")


async def _documented_only() -> None:  # pragma: no cover - FleetApp intercepts these paths
    raise RuntimeError("served by FleetApp")


class FleetApp:
    """ASGI entry: hot routes to the service, the rest to the control app. `hot_handler`: what
    the public port's protocol runs the hot routes with when it parses them itself
    (`fleet/hot.py`); None when they are observed (`observe.py` wraps the ASGI handler)."""

    def __init__(
        self, service: DisaggService, control: FastAPI, metrics: RequestMetrics | None = None, handle: Any = None
    ) -> None:
        self.service = service
        self.control = control
        self.metrics = metrics  # request-path counting (None: off)
        self.handle = handle or service.handle  # the service's handler, observed (shmdisagg/observe.py)
        self.anthropic = AnthropicRoutes(service, self.handle)
        self.hot_handler: HotHandler | None = None
        if handle is None or handle == service.handle:
            self.hot_handler = service.hot if metrics is None else self._counted_hot

    async def _counted_hot(self, cycle: HotCycle) -> None:
        await self.metrics.serve(self.service.hot, cycle)  # type: ignore[union-attr]  # set when this is used

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path = scope["path"]
            chat = _HOT.get(path)
            if chat is not None:
                await self._counted(self.handle, scope, receive, send, chat)
                return
            if path in _NEWER:
                if path == "/v1/messages":  # a chat request underneath: counted as one
                    await self._counted(self.anthropic.messages, scope, receive, send, True)
                elif path == "/v1/messages/count_tokens":
                    await self.anthropic.count_tokens(scope, receive, send)
                else:
                    await responses(scope, receive, send)
                return
        elif scope["type"] == "http" and scope["path"] in ANTHROPIC_PATHS:  # every error in Anthropic's envelope
            await send_bytes(send, 405, error_envelope(405, "Method Not Allowed"), _ALLOW_POST)
            return
        await self.control(scope, receive, send)

    async def _counted(self, handle: Any, scope: Scope, receive: Receive, send: Send, chat: bool) -> None:
        if self.metrics is None:
            await handle(scope, receive, send, chat)
        else:
            await self.metrics.serve(handle, scope, receive, send, chat)
