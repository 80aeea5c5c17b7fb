"""The coordinator's perf records: conversion, the join with executor records, waiting, bounds."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
from aiohttp import web

from shmdisagg.metrics.perf import PerfStore
from shmdisagg.metrics.request import RECORD_FIELDS
from shmdisagg.metrics.schema import LAYOUT
from tests.conftest import free_port

SERVERS = {0: "127.0.0.1:1001", 2: "127.0.0.1:2001"}
KEEP = 10_000  # perf_metrics_max_requests: 0 keeps nothing


def record(rid: int, ctx_slot: int = 0, gen_slot: int = 2, **kw: Any) -> list[Any]:
    values = {
        "disagg_request_id": rid,
        "arrival": 1000.0,
        "ctx_dispatch": 1000.001,
        "ctx_done": 1000.02,
        "gen_dispatch": 1000.021,
        "first_token": 1000.05,
        "last_token": 1000.25,
        "ctx_slot": ctx_slot,
        "gen_slot": gen_slot,
        "prompt_tokens": 300,
        "cached_tokens": 64,
        "retries": 0,
        "status": 200,
        "error_code": "",
        "stream": True,
        **kw,
    }
    return [values[f] for f in RECORD_FIELDS]


def executor_record(
    rid: int, first_iter: int = 1, last_iter: int = 11, first: float = 5.0, last: float = 5.5
) -> dict[str, Any]:
    return {
        "request_id": 7,
        "ctx_request_id": rid,
        "perf_metrics": {
            "first_iter": first_iter,
            "last_iter": last_iter,
            "timing_metrics": {"first_token_time": first, "last_token_time": last},
        },
    }


def test_worker_records_get_names_servers_and_the_monotonic_timebase() -> None:
    store = PerfStore(SERVERS, KEEP)
    assert (
        store.add_batch(
            {"worker": 1, "monotonic_minus_wall": -900.0, "records": [record(11, gen_slot=-1, gen_dispatch=0.0)]}
        )
        == 1
    )
    store.join()
    (rec,) = asyncio.run(store.read())
    assert rec["disagg_request_id"] == 11 and rec["ctx_server"] == "127.0.0.1:1001" and rec["gen_server"] is None
    assert rec["disagg_server_arrival_time"] == 100.0 and rec["disagg_gen_dispatch_time"] is None
    assert rec["fleet_worker"] == 1 and rec["error_code"] is None and rec["cached_tokens"] == 64


def test_both_sides_are_joined_by_ctx_request_id_and_feed_per_token_latency() -> None:
    row = memoryview(bytearray(8 * LAYOUT.words)).cast("d")
    store = PerfStore(SERVERS, KEEP, row=row)
    store.add_batch({"records": [record(11)]})
    store._store("127.0.0.1:1001", [executor_record(11, 1, 1)])
    store._store("127.0.0.1:2001", [executor_record(11, 1, 11, 5.0, 5.5)])
    store.join()
    (rec,) = asyncio.run(store.read())
    assert (
        rec["ctx_perf_metrics"]["ctx_request_id"] == 11 and rec["gen_perf_metrics"]["perf_metrics"]["last_iter"] == 11
    )
    name = "gen_per_token_latency_seconds"
    assert row[LAYOUT.hist[name] + len(LAYOUT.bounds[name]) + 1] == 0.05  # 0.5 s over 10 steps


def test_a_record_waits_for_a_reporting_server_until_the_grace_period() -> None:
    store = PerfStore(SERVERS, KEEP, grace_s=2.0)
    store._store("127.0.0.1:2001", [executor_record(99)])  # the gen server reports perf records
    store.add_batch({"records": [record(11)]})
    now = time.monotonic()
    store.join(now)
    assert store.pending == 1  # its gen record may still come; the ctx server never reported: not waited for
    store.join(now + 2.5)
    assert store.pending == 0
    (rec,) = asyncio.run(store.read())
    assert rec["gen_perf_metrics"] is None and rec["ctx_perf_metrics"] is None


def test_read_drains_unless_kept() -> None:
    store = PerfStore(SERVERS, KEEP)
    store.add_batch({"records": [record(1), record(2)]})
    assert [r["disagg_request_id"] for r in asyncio.run(store.read(drain=False))] == [1, 2]
    assert len(asyncio.run(store.read(drain=True))) == 2
    assert asyncio.run(store.read()) == []


def test_buffers_are_bounded_oldest_first() -> None:
    store = PerfStore(SERVERS, max_requests=3)
    store.add_batch({"records": [record(i) for i in range(5)]})
    assert [r["disagg_request_id"] for r in asyncio.run(store.read())] == [2, 3, 4]
    assert store.dropped == 2
    store._store("127.0.0.1:1001", [executor_record(i) for i in range(5)])
    assert list(store._exec["127.0.0.1:1001"]) == [2, 3, 4]


def test_executors_are_polled_and_a_404_is_not_polled_again() -> None:
    async def scenario() -> tuple[list[dict[str, Any]], int]:
        hits = {"404": 0}

        async def perf(request: web.Request) -> web.Response:
            return web.json_response([executor_record(5)])

        async def missing(request: web.Request) -> web.Response:
            hits["404"] += 1
            return web.Response(status=404)

        runners = []
        ports = []
        for handler in (perf, missing):
            app = web.Application()
            app.router.add_get("/perf_metrics", handler)
            runner = web.AppRunner(app)
            await runner.setup()
            port = free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            runners.append(runner)
            ports.append(port)
        store = PerfStore({0: f"127.0.0.1:{ports[0]}", 2: f"127.0.0.1:{ports[1]}"}, KEEP)
        store._session = aiohttp.ClientSession()
        try:
            store.add_batch({"records": [record(5)]})
            out = await store.read()
            await store.read()
        finally:
            await store._session.close()
            for r in runners:
                await r.cleanup()
        return out, hits["404"]

    out, misses = asyncio.run(scenario())
    assert out[0]["ctx_perf_metrics"]["ctx_request_id"] == 5 and out[0]["gen_perf_metrics"] is None
    assert misses == 1


def test_zero_keeps_no_record_and_never_polls_the_executors() -> None:
    """perf_metrics_max_requests: 0 (the default) is off, as TensorRT-LLM's deque(maxlen=0):
    no record is kept, and the executors' own /perf_metrics buffers are left alone."""

    async def scenario() -> tuple[int, list[dict[str, Any]], int]:
        hits = {"n": 0}

        async def perf(request: web.Request) -> web.Response:
            hits["n"] += 1
            return web.json_response([executor_record(5)])

        app = web.Application()
        app.router.add_get("/perf_metrics", perf)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        store = PerfStore({0: f"127.0.0.1:{port}"}, 0)
        try:
            store.start()
            kept = store.add_batch({"records": [record(5)]})
            out = await store.read()
            await store.stop()
        finally:
            await runner.cleanup()
        return kept, out, hits["n"]

    kept, out, polls = asyncio.run(scenario())
    assert (kept, out, polls) == (0, [], 0)
