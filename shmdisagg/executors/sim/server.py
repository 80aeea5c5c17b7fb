"""Run one `SimApp` on uvicorn (uvloop + httptools); the only module that imports uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import socket
from typing import Any

from shmdisagg.executors.sim.app import InjectedDisconnect, SimApp
from shmdisagg.executors.sim.config import SimConfig
from shmdisagg.procutil import listen_addr


class _DropInjectedDisconnects(logging.Filter):
    """uvicorn logs an app exception with a traceback; an injected disconnect is not an error."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, InjectedDisconnect)


def serve(config: SimConfig) -> int:
    import uvicorn

    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s sim[%(process)d] %(name)s: %(message)s"
    )
    logging.getLogger("uvicorn.error").addFilter(_DropInjectedDisconnects())
    # Bound before the app is built, as trtllm-serve binds first: with port 0 (a cluster uri)
    # the kernel picks the port, which the app advertises and the registration carries.
    family, addr = listen_addr(config.host, config.port)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as err:
        sock.close()
        logging.getLogger("shmdisagg.sim").error("cannot bind %s:%d: %s", config.host, config.port, err.strerror)
        return 1
    if config.port == 0:
        config = dataclasses.replace(config, port=sock.getsockname()[1])
    app = SimApp(config)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            loop="uvloop",
            http="httptools",
            lifespan="on",
            access_log=False,
            log_level=config.log_level,
            timeout_keep_alive=int(config.keep_alive_timeout),
            timeout_graceful_shutdown=2,
        )
    )
    gc.freeze()  # startup objects never die; keep them out of every collection
    registration = _registration(config)
    if registration is None:
        server.run(sockets=[sock])
    else:
        import uvloop

        uvloop.run(_serve_registered(server, sock, registration, app))
    return 0 if server.started else 1


def _registration(config: SimConfig) -> Any:
    """How this executor registers itself (None: it does not), as trtllm-serve with
    `--disagg_cluster_uri` / `disagg_cluster` or `--metadata_server_config_file` does."""
    assert config.server_role is not None or (
        config.disagg_cluster_uri is None and not config.metadata_server_config_file
    )
    host = config.advertise_host or config.host
    if config.disagg_cluster_uri is not None:
        from shmdisagg.cluster.registrar import ClusterSettings, WorkerRegistration
        from shmdisagg.cluster.workers import ROLE_BY_NAME

        settings = ClusterSettings(
            config.disagg_cluster_uri, config.cluster_name, config.heartbeat_interval_sec, config.inactive_timeout_sec
        )
        assert config.server_role is not None
        return WorkerRegistration(settings, ROLE_BY_NAME[config.server_role], host, config.port)
    if config.metadata_server_config_file is not None:
        from shmdisagg import __version__
        from shmdisagg.cluster.metadata import MetadataRegistration, load_metadata_config

        assert config.server_role is not None
        meta = load_metadata_config(config.metadata_server_config_file)
        return MetadataRegistration(meta, config.served_model, __version__, config.server_role, host, config.port)
    return None


QUIET_S = 0.5  # idle this long after deregistering: the orchestrator has seen it leave


async def _serve_registered(server: Any, sock: socket.socket, registration: Any, app: SimApp) -> None:
    """Serve; register once uvicorn has started (trtllm-serve's `_register_after_serving`: a
    registration that raises stops the server). On a stop: deregister first, so the orchestrator
    stops routing here, then keep serving until no request is in flight and no finished context
    result waits to be pulled by a generation executor (idle for QUIET_S, at most
    `kv_transfer_timeout`), then shut down: a context executor that leaves lets the generation
    legs of its last requests pull their KV. (uvicorn re-raises the stop signal once `serve`
    returns, so all of it runs inside the shutdown.)"""

    async def register_after_serving() -> None:
        while not server.started:
            if server.should_exit:
                return
            await asyncio.sleep(0.05)
        try:
            await registration.start()
        except Exception as err:
            logging.getLogger("shmdisagg.sim").error("worker registration failed: %s", err)
            server.should_exit = True

    task = asyncio.ensure_future(register_after_serving())
    shutdown = server.shutdown

    async def deregister_then_shutdown(sockets: Any = None) -> None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await registration.stop()
        await _until_idle(app, app.config.kv_transfer_timeout)
        await shutdown(sockets=sockets)

    server.shutdown = deregister_then_shutdown
    await server.serve(sockets=[sock])


async def _until_idle(app: SimApp, limit_s: float) -> None:
    """Until the engine has held no request and no unpulled context result for QUIET_S."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    quiet_since = loop.time()
    while loop.time() < deadline:
        stats = app.engine.stats()
        busy = any(
            stats[k] for k in ("num_waiting", "num_running", "num_transferring", "num_ready", "num_pinned")
        ) or bool(app.engine.transfers.entries)
        now = loop.time()
        if busy:
            quiet_since = now
        elif now - quiet_since >= QUIET_S:
            return
        await asyncio.sleep(0.05)
