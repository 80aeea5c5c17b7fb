"""Client CPU per request: shmdisagg.upstream.UpstreamPool against aiohttp.ClientSession.

Both clients talk to the same backend, a minimal asyncio + httptools server on uvloop in a
subprocess, which answers POST /v1/completions with a ~300-byte JSON body (Content-Length) and
POST /v1/chat/completions with a 16-event SSE stream (chunked, one write per event, each in its own
loop iteration). The clients run in this process on uvloop, at a fixed concurrency; a cell is
N requests after a warm-up, and its CPU figure is `time.process_time()` delta / N, so only the
client's own work is counted. Rounds cycle through every cell so drift hits all alike; the
table shows the median round and the min-max.

    .venv/bin/python benchmarks/bench_upstream.py [--n 3000] [--concurrency 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
import httptools
import uvloop

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.benchkit import count, count_or_zero
from shmdisagg.upstream import UpstreamPool

HOST = "127.0.0.1"
JSON_PATH = "/v1/completions"
SSE_PATH = "/v1/chat/completions"
REQUEST_BODY = json.dumps(
    {"model": "bench", "prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": 16, "stream": False}
).encode()
REQUEST_HEADERS = [(b"content-type", b"application/json")]

JSON_BODY = json.dumps(
    {
        "id": "cmpl-0123456789abcdef",
        "object": "text_completion",
        "created": 1700000000,
        "model": "bench",
        "choices": [{"index": 0, "text": " jumps over the lazy dog again and again", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 16, "total_tokens": 26},
    },
    separators=(",", ":"),
).encode()
JSON_RESPONSE = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
    len(JSON_BODY),
    JSON_BODY,
)
SSE_EVENTS = [
    b"data: "
    b'{"id":"chatcmpl-0123456789","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":" '
    b't%02d"}}]}\n\n' % i
    for i in range(15)
] + [b"data: [DONE]\n\n"]
SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
SSE_CHUNKS = [b"%x\r\n%s\r\n" % (len(e), e) for e in SSE_EVENTS]
SSE_BODY_LEN = sum(len(e) for e in SSE_EVENTS)


# -- backend (subprocess) ------------------------------------------------------------------


class _Backend(asyncio.Protocol):
    """One keep-alive connection of the fake executor."""

    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_message_complete(self) -> None:
        if self.url == SSE_PATH.encode():
            asyncio.ensure_future(self._stream())
        elif self.transport is not None:
            self.transport.write(JSON_RESPONSE)

    async def _stream(self) -> None:
        t = self.transport
        if t is None:
            return
        t.write(SSE_HEAD)
        for piece in SSE_CHUNKS:
            await asyncio.sleep(0)  # one event per loop iteration, like an engine emitting tokens
            if t.is_closing():
                return
            t.write(piece)
        t.write(b"0\r\n\r\n")


async def _serve() -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Backend, HOST, 0, backlog=1024)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()


# -- clients --------------------------------------------------------------------------------

Call = Callable[[], Awaitable[bool]]


def upstream_calls(pool: UpstreamPool, port: int) -> dict[str, Call]:
    async def json_call() -> bool:
        resp = await pool.request(HOST, port, "POST", JSON_PATH, REQUEST_BODY, headers=REQUEST_HEADERS)
        body = await resp.read()
        return resp.status == 200 and len(body) == len(JSON_BODY)

    async def sse_call() -> bool:
        resp = await pool.request(HOST, port, "POST", SSE_PATH, REQUEST_BODY, headers=REQUEST_HEADERS)
        n = 0
        async for data in resp:
            n += len(data)
        return resp.status == 200 and n == SSE_BODY_LEN

    return {"json": json_call, "sse": sse_call}


def aiohttp_calls(session: aiohttp.ClientSession, port: int) -> dict[str, Call]:
    json_url = f"http://{HOST}:{port}{JSON_PATH}"
    sse_url = f"http://{HOST}:{port}{SSE_PATH}"
    headers = {"content-type": "application/json"}

    async def json_call() -> bool:
        async with session.post(json_url, data=REQUEST_BODY, headers=headers) as resp:
            body = await resp.read()
            return resp.status == 200 and len(body) == len(JSON_BODY)

    async def sse_call() -> bool:
        async with session.post(sse_url, data=REQUEST_BODY, headers=headers) as resp:
            n = 0
            async for data in resp.content.iter_any():
                n += len(data)
            return resp.status == 200 and n == SSE_BODY_LEN

    return {"json": json_call, "sse": sse_call}


@dataclass
class Cell:
    cpu_ms: float  # client process CPU per request, ms
    rps: float  # requests per second
    bad: int  # wrong status or body length


async def _drive(call: Call, n: int, concurrency: int) -> int:
    todo = iter(range(n))
    bad = 0

    async def worker() -> None:
        nonlocal bad
        for _ in todo:
            if not await call():
                bad += 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return bad


async def _measure(call: Call, n: int, warmup: int, concurrency: int) -> Cell:
    await _drive(call, warmup, concurrency)
    cpu0, t0 = time.process_time(), time.perf_counter()
    bad = await _drive(call, n, concurrency)
    cpu1, t1 = time.process_time(), time.perf_counter()
    return Cell(cpu_ms=(cpu1 - cpu0) * 1000 / n, rps=n / (t1 - t0), bad=bad)


async def _bench(port: int, args: argparse.Namespace) -> dict[tuple[str, str], list[Cell]]:
    results: dict[tuple[str, str], list[Cell]] = {}
    for _ in range(args.rounds):
        for client in ("upstream", "aiohttp"):
            for mode in ("json", "sse"):
                if client == "upstream":
                    async with UpstreamPool() as pool:
                        cell = await _measure(upstream_calls(pool, port)[mode], args.n, args.warmup, args.concurrency)
                else:
                    connector = aiohttp.TCPConnector(limit=0)
                    async with aiohttp.ClientSession(connector=connector) as session:
                        cell = await _measure(aiohttp_calls(session, port)[mode], args.n, args.warmup, args.concurrency)
                results.setdefault((client, mode), []).append(cell)
    return results


def _table(results: dict[tuple[str, str], list[Cell]], args: argparse.Namespace) -> str:
    lines = [
        f"N={args.n} per cell after {args.warmup} warm-up, concurrency {args.concurrency}, "
        f"{args.rounds} rounds (median, min-max), uvloop, Python {sys.version.split()[0]}, "
        f"aiohttp {aiohttp.__version__}, httptools {httptools.__version__}",
        "",
        "| client | mode | client CPU ms/req | min-max | req/s | bad |",
        "|---|---|---|---|---|---|",
    ]
    median: dict[tuple[str, str], float] = {}
    for (client, mode), cells in results.items():
        cpu = [c.cpu_ms for c in cells]
        median[(client, mode)] = statistics.median(cpu)
        lines.append(
            f"| {client} | {mode} | {statistics.median(cpu):.3f} | {min(cpu):.3f}-{max(cpu):.3f} "
            f"| {statistics.median(c.rps for c in cells):.0f} | {sum(c.bad for c in cells)} |"
        )
    lines.append("")
    for mode in ("json", "sse"):
        ratio = median[("aiohttp", mode)] / median[("upstream", mode)]
        lines.append(f"{mode}: aiohttp / upstream CPU per request = {ratio:.2f}x")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=count, default=3000, help="measured requests per cell")
    parser.add_argument("--warmup", type=count_or_zero, default=300, help="requests before each measurement")
    parser.add_argument("--concurrency", type=count, default=32)
    parser.add_argument("--rounds", type=count, default=3)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the backend subprocess
    args = parser.parse_args()
    if args.serve:
        uvloop.run(_serve())
        return
    backend = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--serve"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert backend.stdout is not None
        port = int(backend.stdout.readline())
        results = uvloop.run(_bench(port, args))
    finally:
        backend.terminate()
        backend.wait()
    print(_table(results, args))
    if any(c.bad for cells in results.values() for c in cells):
        sys.exit(1)


if __name__ == "__main__":
    main()
