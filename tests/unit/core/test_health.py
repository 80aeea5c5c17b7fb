"""The coordinator's executor health checks against real HTTP servers and a real table: what
takes a server out (a refusal at once; failed probes only with no leg answered meanwhile), the
probe timeout and failure count as settings, and one slow server never delaying another's."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp import web

from shmdisagg.coordinator.health import Executor, HealthMonitor
from shmdisagg.shm.table import ROLE_CONTEXT, ROLE_GENERATION, ControlTable
from tests.conftest import free_port


class FakeServer:
    """An executor's probe routes; `delay_s` slows `/health`, `hits` counts its probes."""

    def __init__(self) -> None:
        self.port = free_port()
        self.delay_s = 0.0
        self.hits = 0
        self._runner: web.AppRunner | None = None

    async def _health(self, _: web.Request) -> web.Response:
        self.hits += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return web.json_response({"status": "ok"})

    async def _server_info(self, _: web.Request) -> web.Response:
        return web.json_response({"max_batch_size": 8})

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/server_info", self._server_info)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:  # nothing listens afterwards: probes are refused
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


async def until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def monitoring(
    shm_prefix: str, n: int, **kw: Any
) -> AsyncIterator[tuple[HealthMonitor, list[FakeServer], list[float], list[tuple[int, int]]]]:
    """`n` servers (slot 0 context, the rest generation) under a running monitor whose
    answered-legs reader returns `answered[slot]`; `marks` gets (slot, that server's probe count)
    each time a server is marked unhealthy."""
    servers = [FakeServer() for _ in range(n)]
    for s in servers:
        await s.start()
    table = ControlTable.create(shm_prefix)
    executors = [
        Executor(i, ROLE_CONTEXT if i == 0 else ROLE_GENERATION, "127.0.0.1", s.port) for i, s in enumerate(servers)
    ]
    mon = HealthMonitor(table, executors, kw.pop("interval_s", 0.05), **kw)
    answered = [0.0] * n
    marks: list[tuple[int, int]] = []
    mon.answered = lambda slot: answered[slot]
    mon.on_unhealthy = lambda slot: marks.append((slot, servers[slot].hits))
    task = asyncio.ensure_future(mon.run())
    try:
        await until(lambda: all(e.healthy for e in executors), 5, "every server healthy")
        yield mon, servers, answered, marks
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for s in servers:
            await s.stop()
        table.unlink()
        table.close()


def test_a_server_that_answers_legs_is_kept_while_its_health_check_times_out(shm_prefix: str) -> None:
    async def run() -> None:
        async with monitoring(shm_prefix, 1, timeout_s=0.1, failures=2) as (mon, [srv], answered, marks):
            srv.delay_s = 0.5  # every probe times out from here

            async def legs() -> None:  # the fleet keeps getting answers from it
                while True:
                    answered[0] += 1
                    await asyncio.sleep(0.02)

            flowing = asyncio.ensure_future(legs())
            start = srv.hits
            await until(lambda: srv.hits >= start + 8, 10, "eight failed probes")
            assert marks == [] and mon.executors[0].healthy
            assert mon.table.servers()[0].healthy  # the fleet can still pick it
            flowing.cancel()
            stopped = srv.hits
            await until(lambda: bool(marks), 5, "the server marked unhealthy once no leg is answered")
            # only a whole run of failed probes after the last answered leg takes it out
            assert marks[0][1] - stopped >= 2
            assert not mon.table.servers()[0].healthy

    asyncio.run(run())


@pytest.mark.parametrize("failures", [1, 3])
def test_health_check_failures_is_the_number_of_failed_probes_in_a_row(shm_prefix: str, failures: int) -> None:
    async def run() -> None:
        async with monitoring(shm_prefix, 1, timeout_s=0.1, failures=failures) as (mon, [srv], answered, marks):
            start = srv.hits
            srv.delay_s = 0.5
            await until(lambda: bool(marks), 5, "the server marked unhealthy")
            assert marks == [(0, start + failures)]

    asyncio.run(run())


def test_a_probe_in_flight_when_the_breaker_opens_does_not_readmit_the_server(shm_prefix: str) -> None:
    """The breaker opens while a health probe is on its way; the probe's 200 comes back during the
    cool-down and must not make the server healthy again (a CI run routed to it after the open)."""

    async def run() -> None:
        async with monitoring(shm_prefix, 1, breaker_cooldown_s=30.0) as (mon, [srv], _, _):
            outcomes: list[bool] = []
            mark = mon._mark

            def recorded(ex: Executor, ok: bool, answered: float, refused: bool = False) -> None:
                mark(ex, ok, answered, refused)
                outcomes.append(ok)

            mon._mark = recorded  # type: ignore[method-assign]
            srv.delay_s = 0.3  # each probe is answered 0.3 s after it arrives
            start = srv.hits
            await until(lambda: srv.hits > start, 5, "a probe in flight")
            outcomes.clear()
            for _ in range(mon.breaker_failures):
                mon.report(0, "error")
            assert not mon.executors[0].healthy
            await until(lambda: bool(outcomes), 5, "the probe's 200 applied")
            assert outcomes == [True]
            assert not mon.executors[0].healthy and not mon.table.servers()[0].healthy

    asyncio.run(run())


def test_health_check_timeout_is_how_long_a_probe_may_take(shm_prefix: str) -> None:
    async def run() -> None:
        # 1.3 s probes pass a 2 s timeout (the bound here was max(2 x interval, 1 s) = 1 s)
        async with monitoring(shm_prefix, 1, interval_s=0.1, timeout_s=2.0, failures=1) as (
            mon,
            [srv],
            answered,
            marks,
        ):
            srv.delay_s = 1.3
            start = srv.hits
            await until(lambda: srv.hits >= start + 3, 10, "two slow probes answered")
            assert marks == [] and mon.executors[0].healthy and mon.executors[0].failures == 0

    asyncio.run(run())


def test_a_refused_probe_marks_the_server_down_at_once_even_with_legs_answered(shm_prefix: str) -> None:
    async def run() -> None:
        async with monitoring(shm_prefix, 1, timeout_s=1.0, failures=5) as (mon, [srv], answered, marks):
            answered[0] = 100.0
            await srv.stop()  # the process is gone
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            answered[0] = 200.0  # legs answered just before it died change nothing
            await until(lambda: bool(marks), 5, "the server marked unhealthy")
            assert loop.time() - t0 < 1.0 and not mon.executors[0].healthy

    asyncio.run(run())


def test_a_hung_server_does_not_delay_another_servers_checks(shm_prefix: str) -> None:
    async def run() -> None:
        async with monitoring(shm_prefix, 2, timeout_s=3.0, failures=2) as (mon, [hung, dying], answered, marks):
            hung.delay_s = 30.0
            start = hung.hits
            await until(lambda: hung.hits > start, 5, "a probe of the hung server in flight")
            loop = asyncio.get_running_loop()
            await dying.stop()
            t0 = loop.time()
            await until(lambda: any(slot == 1 for slot, _ in marks), 5, "the dead server marked unhealthy")
            # at its next probe (0.05 s), not when the hung server's probe times out (3 s; in one
            # shared round of probes it waited for that)
            assert loop.time() - t0 < 0.5
            assert mon.executors[0].healthy  # its own probe has not even timed out yet

    asyncio.run(run())


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost"])
def test_an_executor_address_as_shown_is_one_a_config_accepts(host: str) -> None:
    # `/cluster_info`, `shmdisagg stats` and the logs show `Executor.addr`: an IPv6 host must come
    # bracketed, or the address copied from them is not host:port (and would not match the
    # `WorkerInfo.addr` a registered executor is known by)
    from shmdisagg.cluster.workers import WorkerInfo
    from shmdisagg.config import ServerSection
    from shmdisagg.orchestrator.directory import split_addr

    addr = Executor(0, ROLE_CONTEXT, host, 8001).addr
    assert ServerSection.model_validate({"urls": [addr]}).addresses() == [(host, 8001)]
    assert split_addr(addr) == (host, 8001)
    assert addr == WorkerInfo("w", host, 8001, ROLE_CONTEXT).addr
