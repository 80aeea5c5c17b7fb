"""`EmbeddedServer` (serving.py): uvicorn's main loop waking once a tick, and at once on a stop."""

from __future__ import annotations

import asyncio
import socket

import uvicorn
import uvloop

from shmdisagg.serving import EmbeddedServer

DEADLINE_S = 30.0


async def app(scope: dict[str, object], receive: object, send: object) -> None:  # never called
    raise AssertionError("no request is sent")


class Probe(EmbeddedServer):
    """Says when it has started, and what each tick was asked to do."""

    def __init__(self, config: uvicorn.Config, tick_s: float) -> None:
        super().__init__(config)
        self.TICK_S = tick_s
        self.up = asyncio.Event()
        self.ticks: list[int] = []
        self.four_ticks = asyncio.Event()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self.up.set()

    async def on_tick(self, counter: int) -> bool:
        self.ticks.append(counter)
        if len(self.ticks) == 4:
            self.four_ticks.set()
        return await super().on_tick(counter)


async def _serve(server: Probe) -> asyncio.Task[None]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    async with asyncio.timeout(DEADLINE_S):
        await server.up.wait()
    return task


def _config() -> uvicorn.Config:
    return uvicorn.Config(app, loop="none", lifespan="off", log_level="warning", timeout_graceful_shutdown=1)


def test_a_stop_ends_the_main_loop_without_waiting_for_the_tick() -> None:
    async def main() -> None:
        server = Probe(_config(), tick_s=3600.0)  # only the stop itself can end the wait
        task = await _serve(server)
        server.should_exit = True
        async with asyncio.timeout(DEADLINE_S):
            await task
        assert server.ticks == [0, 10]  # the first tick, and the one the stop woke

    uvloop.run(main())


def test_every_tick_refreshes_the_date_header() -> None:
    async def main() -> None:
        server = Probe(_config(), tick_s=0.001)
        task = await _serve(server)
        async with asyncio.timeout(DEADLINE_S):
            await server.four_ticks.wait()
        server.should_exit = True
        await task
        # uvicorn refreshes the date on the ticks whose counter is a multiple of 10
        assert all(counter % 10 == 0 for counter in server.ticks)
        assert [name for name, _ in server.server_state.default_headers] == [b"date", b"server"]

    uvloop.run(main())
