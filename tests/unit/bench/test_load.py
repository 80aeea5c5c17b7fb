"""Open and closed loop against a fake `send` that records (no sockets)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import orjson
import pytest

from shmdisagg.bench.client import RequestRecord
from shmdisagg.bench.load import Job, LoadCounters, closed_loop, jobs, open_loop
from shmdisagg.bench.trace import HashId, PromptSynthesizer, TraceRequest


def trace(timestamps: list[float], out: int = 5) -> list[TraceRequest]:
    return [TraceRequest(t, 600, out, (HashId(0), HashId(i + 1))) for i, t in enumerate(timestamps)]


def test_jobs_carry_offsets_divided_by_speedup_and_capped_max_tokens() -> None:
    work = list(jobs(trace([1000, 1500, 3000], out=50), PromptSynthesizer(), "m", speedup=2.0, max_output_tokens=20))
    assert [j.arrival_s for j in work] == [0.0, 0.25, 1.0]
    bodies = [orjson.loads(j.body) for j in work]
    assert [b["max_tokens"] for b in bodies] == [20, 20, 20]
    assert [len(b["prompt"]) for b in bodies] == [600, 600, 600]
    assert bodies[0]["prompt"][:512] == bodies[2]["prompt"][:512]
    assert [j.record.index for j in work] == [0, 1, 2]
    with pytest.raises(ValueError):
        next(jobs(trace([0]), PromptSynthesizer(), "m", speedup=0))


def test_open_loop_sends_on_schedule_without_waiting_for_completions() -> None:
    n = 4
    counters = LoadCounters(total=n)

    async def scenario() -> list[RequestRecord]:
        all_sent = asyncio.Event()
        started = 0

        async def send(rec: RequestRecord, body: bytes) -> RequestRecord:
            nonlocal started
            rec.send = time.perf_counter()
            started += 1
            if started == n:
                all_sent.set()
            await all_sent.wait()  # no request finishes before every request was sent
            rec.end = time.perf_counter()
            return rec

        work = jobs(trace([0, 10, 10, 30]), PromptSynthesizer(), "m", speedup=1.0)
        return await open_loop(work, send, counters)

    records = asyncio.run(scenario())
    assert [r.index for r in records] == [0, 1, 2, 3]
    scheduled = [r.scheduled for r in records]
    assert all(s is not None for s in scheduled)
    offsets = [s - scheduled[0] for s in scheduled]  # type: ignore[operator]
    assert offsets == pytest.approx([0.0, 0.010, 0.010, 0.030])
    assert all(r.send >= r.scheduled for r in records)  # type: ignore[operator]
    assert (counters.sent, counters.finished, counters.errors) == (4, 4, 0)


def test_closed_loop_keeps_exactly_c_in_flight() -> None:
    counters = LoadCounters(total=10)
    in_flight = peak = 0

    async def send(rec: RequestRecord, body: bytes) -> RequestRecord:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        for _ in range(3):
            await asyncio.sleep(0)  # yield to the other workers
        in_flight -= 1
        if rec.index % 4 == 0:
            rec.error_kind = "http_500"
        return rec

    work = jobs(trace([0] * 10), PromptSynthesizer(), "m")
    records = asyncio.run(closed_loop(work, send, 3, counters))
    assert peak == 3
    assert [r.index for r in records] == list(range(10))
    assert all(r.scheduled is None for r in records)
    assert (counters.sent, counters.finished, counters.errors) == (10, 10, 3)


def test_open_loop_builds_bodies_ahead_so_a_burst_is_not_held_up_by_synthesis() -> None:
    log: list[str] = []

    def logged(work: Iterator[Job]) -> Iterator[Job]:
        for job in work:
            log.append(f"build {job.record.index}")
            yield job

    async def send(rec: RequestRecord, body: bytes) -> RequestRecord:
        log.append(f"send {rec.index}")
        rec.send = time.perf_counter()
        return rec

    work = logged(jobs(trace([0, 0, 0, 0, 0]), PromptSynthesizer(), "m"))
    asyncio.run(open_loop(work, send, LoadCounters(total=5), lookahead=3))
    assert log[:4] == ["build 0", "build 1", "build 2", "send 0"]
    assert sorted(log) == sorted([f"build {i}" for i in range(5)] + [f"send {i}" for i in range(5)])
