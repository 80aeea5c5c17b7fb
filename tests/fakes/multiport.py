"""Many recording fake executors (`tests/fakes/executor.py`) in one process, one per port.

A benchmark that needs 64 executors would otherwise start 64 Python processes (about 40 MB each)
on a 2-core machine. Here one uvicorn server listens on every port, and each port gets its own
`build_app` instance (its own script, records and `ctx_info_endpoint`), chosen by the port the
connection arrived on, so to a client each port is a separate executor with its own
`POST /_script`. Only the process is shared: the same CPU serves all of them.

Run: `python -m tests.fakes.multiport --ports 9001,9002,9003 [--name ctx]` (names ctx0, ctx1, ...).
It prints `ready` on stdout once every port listens.
"""

from __future__ import annotations

import argparse
import socket
from typing import Any

import uvicorn
import uvloop

from tests.fakes.executor import build_app


class PortDispatch:
    """ASGI app handing each connection to the fake of the port it arrived on."""

    def __init__(self, apps: dict[int, Any]) -> None:
        self.apps = apps  # port -> that port's fake app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":  # nothing to start or stop: answer for every app at once
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        await self.apps[scope["server"][1]](scope, receive, send)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ports", required=True, help="comma-separated ports, one fake executor each")
    parser.add_argument("--name", default="fake", help="name prefix: the fakes are NAME0, NAME1, ...")
    args = parser.parse_args()
    ports = [int(p) for p in args.ports.split(",") if p]
    apps = {p: build_app(f"{args.name}{k}", f"127.0.0.1:{p}") for k, p in enumerate(ports)}
    sockets = []
    for p in ports:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", p))
        s.listen(2048)
        s.set_inheritable(True)
        sockets.append(s)
    config = uvicorn.Config(
        PortDispatch(apps), log_level="warning", access_log=False, loop="uvloop", http="httptools", backlog=2048
    )
    server = uvicorn.Server(config)
    print("ready", flush=True)  # the sockets listen already: connections wait in their backlog
    try:
        uvloop.run(server.serve(sockets=sockets))
    except KeyboardInterrupt:  # uvicorn re-raises a Ctrl-C after its shutdown: the benchmark says it
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
