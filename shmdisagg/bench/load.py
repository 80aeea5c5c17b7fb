"""When requests are sent: open-loop trace replay and fixed-concurrency closed loop.

Owns the schedule and the set of in-flight requests. Bodies are built lazily (open loop: up to
`LOOKAHEAD` ahead, while the next request is not yet due; closed loop: when a slot frees up), so
memory stays flat on long traces. Never parses responses (`client.py`) and never aggregates
(`metrics.py`).

Concurrency: one asyncio task per in-flight request; `LoadCounters` is only touched from the event
loop, so the progress display can read it without locks.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from shmdisagg.bench.client import RequestRecord, completion_body
from shmdisagg.bench.trace import PromptSynthesizer, RunPrefixes, TraceRequest

# Bodies built ahead in open loop: a whole-second burst of the conversation trace fits.
LOOKAHEAD = 32

Send = Callable[[RequestRecord, bytes], Coroutine[Any, Any, RequestRecord]]


@dataclass(slots=True)
class LoadCounters:
    """Live counts for the progress display."""

    total: int = 0
    sent: int = 0
    finished: int = 0
    errors: int = 0


class LoadInterrupted(Exception):
    """The load was cancelled part-way; `records` are the requests that had finished (in index
    order). Requests still in flight were cancelled and are not in it."""

    def __init__(self, records: list[RequestRecord]) -> None:
        super().__init__(f"load interrupted after {len(records)} finished requests")
        self.records = records


@dataclass(frozen=True, slots=True)
class Job:
    """A request ready to go: its record (not yet sent), its body, and its arrival offset."""

    record: RequestRecord
    body: bytes
    arrival_s: float


def jobs(
    requests: Sequence[TraceRequest],
    synth: PromptSynthesizer,
    model: str,
    speedup: float = 1.0,
    max_output_tokens: int | None = None,
) -> Iterator[Job]:
    """Jobs in trace order; arrival offsets are `(timestamp - first timestamp) / speedup`. Each
    record carries the prompt tokens earlier requests of the run share (`reusable_tokens`)."""
    if speedup <= 0:
        raise ValueError("speedup must be > 0")
    origin = requests[0].timestamp_ms if requests else 0.0
    prefixes = RunPrefixes()
    for index, req in enumerate(requests):
        max_tokens = req.output_length
        if max_output_tokens is not None:
            max_tokens = min(max_tokens, max_output_tokens)
        prompt = synth.prompt(req.hash_ids, req.input_length)
        yield Job(
            record=RequestRecord(
                index=index,
                input_length=req.input_length,
                max_tokens=max_tokens,
                reusable_tokens=prefixes.reusable(req),
            ),
            body=completion_body(model, prompt, max_tokens),
            arrival_s=(req.timestamp_ms - origin) / 1000.0 / speedup,
        )


def _count(counters: LoadCounters, rec: RequestRecord) -> None:
    counters.finished += 1
    if not rec.ok:
        counters.errors += 1


def _counted(counters: LoadCounters, task: asyncio.Task[RequestRecord]) -> None:
    if not task.cancelled() and task.exception() is None:
        _count(counters, task.result())


async def open_loop(
    work: Iterator[Job], send: Send, counters: LoadCounters, lookahead: int = LOOKAHEAD
) -> list[RequestRecord]:
    """Send each job at its arrival time, whether or not earlier ones have finished.

    Up to `lookahead` bodies are built ahead, while the next request is not yet due, so a burst
    of simultaneous arrivals (the Mooncake timestamps come in whole seconds) goes out without
    waiting for prompt synthesis. `record.scheduled` is the due time, so `send - scheduled` shows
    how late the client was. Cancelled, it cancels what is in flight and raises `LoadInterrupted`.
    """
    tasks: list[asyncio.Task[RequestRecord]] = []
    clock = time.perf_counter
    ready: deque[Job] = deque(itertools.islice(work, lookahead))
    start = clock()  # after the first bodies are built, so the first requests are not born late
    try:
        while True:
            if not ready:  # running late, nothing built ahead: build the next one now
                nxt = next(work, None)
                if nxt is None:
                    break
                ready.append(nxt)
            due = start + ready[0].arrival_s
            while len(ready) < lookahead and clock() < due:  # slack: build ahead
                job = next(work, None)
                if job is None:
                    break
                ready.append(job)
            job = ready.popleft()
            delay = due - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            job.record.scheduled = due
            counters.sent += 1
            task = asyncio.create_task(send(job.record, job.body))
            task.add_done_callback(lambda t: _counted(counters, t))
            tasks.append(task)
            # Let the task start (stamp its send time, write its request) before anything else.
            await asyncio.sleep(0)
        return list(await asyncio.gather(*tasks))
    except asyncio.CancelledError:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        done = [t.result() for t in tasks if not t.cancelled() and t.exception() is None]
        raise LoadInterrupted(done) from None


async def closed_loop(work: Iterator[Job], send: Send, concurrency: int, counters: LoadCounters) -> list[RequestRecord]:
    """Keep exactly `concurrency` requests in flight until the jobs run out; arrival times are
    ignored. Cancelled, it cancels what is in flight and raises `LoadInterrupted`."""
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    records: list[RequestRecord] = []

    async def worker() -> None:
        for job in work:  # a shared iterator: each next() hands out one job, loop-thread only
            counters.sent += 1
            rec = await send(job.record, job.body)
            _count(counters, rec)
            records.append(rec)

    workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
    try:
        await asyncio.gather(*workers)
    except asyncio.CancelledError:
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        records.sort(key=lambda r: r.index)
        raise LoadInterrupted(records) from None
    records.sort(key=lambda r: r.index)
    return records
