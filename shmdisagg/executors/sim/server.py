"""Run one `SimApp` on uvicorn (uvloop + httptools); the only module that imports uvicorn."""

from __future__ import annotations

import gc
import logging

from shmdisagg.executors.sim.app import InjectedDisconnect, SimApp
from shmdisagg.executors.sim.config import SimConfig


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
    server.run()
    return 0 if server.started else 1
