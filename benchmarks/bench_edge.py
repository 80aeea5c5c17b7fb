#!/usr/bin/env python
"""The public port's protocol: per-request CPU of `fleet/edge.py`'s `EdgeProtocol` against plain
uvicorn `HttpToolsProtocol`, side by side in one process on uvloop.

Each round sends the same keep-alive requests through one connection of each protocol class:
`data_received(request bytes)` (httptools parses, the protocol's callbacks run, uvicorn starts
the ASGI task), then one loop iteration in which the app reads the body and sends a fixed
200 answer (uvicorn writes it, the response completes, the keep-alive deadline is set). The
transport is an in-memory stub, so sockets and the kernel are out of the figure and only the
protocols' Python work (and the event loop's task and timer work they cause) is timed. Both
classes get the same uvicorn `Config` as a fleet worker builds it (`fleet/worker.py`).

Request shapes: `openai-sdk`, as the OpenAI Python SDK sends a chat completion (17 headers:
its `x-stainless-*` set, authorization, ...) with a 260-byte body; `curl`, 5 headers.
Times are the thread's CPU time (the machine is shared: time spent descheduled is not counted),
the garbage collector off (as a fleet worker runs by default). Many short rounds, the two
classes alternating: reports ns per request, the minimum of the rounds (the least disturbed,
closest to the protocols' own cost) and the median, and the per-round paired difference.

    .venv/bin/python benchmarks/bench_edge.py [--requests 2000] [--rounds 101]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import uvicorn
import uvloop
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.benchkit import count
from shmdisagg.fleet.edge import EdgeLimits, edge_protocol

BODY = (
    b'{"model":"meta-llama/Llama-3.1-8B-Instruct","messages":[{"role":"system","content":"You are a helpful '
    b'assistant."},'
    b'{"role":"user","content":"Write one sentence about the '
    b'sea."}],"max_tokens":64,"temperature":0.7,"stream":false,"n":1}'
)
SDK_HEADERS = [
    b"host: 127.0.0.1:8000",
    b"accept-encoding: gzip, deflate",
    b"connection: keep-alive",
    b"accept: application/json",
    b"content-type: application/json",
    b"user-agent: OpenAI/Python 1.54.4",
    b"x-stainless-lang: python",
    b"x-stainless-package-version: 1.54.4",
    b"x-stainless-os: Linux",
    b"x-stainless-arch: x64",
    b"x-stainless-runtime: CPython",
    b"x-stainless-runtime-version: 3.11.9",
    b"authorization: Bearer sk-no-key-required",
    b"x-stainless-async: false",
    b"x-stainless-retry-count: 0",
    b"x-stainless-read-timeout: 600",
    b"content-length: %d" % len(BODY),
]
CURL_HEADERS = [
    b"host: 127.0.0.1:8000",
    b"user-agent: curl/8.5.0",
    b"accept: */*",
    b"content-type: application/json",
    b"content-length: %d" % len(BODY),
]
SHAPES = {
    "openai-sdk": b"POST /v1/chat/completions HTTP/1.1\r\n" + b"\r\n".join(SDK_HEADERS) + b"\r\n\r\n" + BODY,
    "curl": b"POST /v1/chat/completions HTTP/1.1\r\n" + b"\r\n".join(CURL_HEADERS) + b"\r\n\r\n" + BODY,
}
ANSWER = b'{"id":"chatcmpl-1","object":"chat.completion","choices":[]}'
START = {
    "type": "http.response.start",
    "status": 200,
    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(ANSWER)).encode())],
}
END = {"type": "http.response.body", "body": ANSWER}


async def app(scope: Any, receive: Any, send: Any) -> None:
    """Reads the body (one message here), answers a fixed body: the hot routes' ASGI usage."""
    message = await receive()
    assert not message["more_body"]
    await send(START)
    await send(END)


class Transport(asyncio.Transport):
    """In-memory transport: counts bytes written, records a close."""

    def __init__(self) -> None:
        super().__init__()
        self.written = 0
        self.closed = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(name, default)

    def write(self, data: Any) -> None:
        self.written += len(data)

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def can_write_eof(self) -> bool:
        return True


def worker_config() -> uvicorn.Config:
    """What fleet/worker.py passes to uvicorn, but the protocol class."""
    config = uvicorn.Config(
        app, loop="none", lifespan="off", access_log=False, log_level="warning", workers=1, timeout_keep_alive=10
    )
    config.load()
    return config


async def run_round(cls: type[HttpToolsProtocol], config: uvicorn.Config, request: bytes, n: int) -> float:
    """ns per request for `n` keep-alive requests on one connection of `cls`."""
    state = ServerState()
    state.default_headers = [(b"date", b"Thu, 03 Dec 2026 10:00:00 GMT"), (b"server", b"uvicorn")]
    proto = cls(config=config, server_state=state, app_state={}, _loop=asyncio.get_running_loop())
    transport = Transport()
    proto.connection_made(transport)
    feed = proto.data_received
    yield_once = asyncio.sleep
    begin = time.thread_time_ns()  # CPU time: the shared machine preempts us
    for _ in range(n):
        feed(request)
        await yield_once(0)  # the ASGI task runs: reads the body, answers, completes
    took = time.thread_time_ns() - begin
    assert state.total_requests == n and not transport.closed, (cls, state.total_requests)
    proto.connection_lost(None)
    return took / n


async def main(args: argparse.Namespace) -> None:
    config = worker_config()
    limits = EdgeLimits(
        client_header_timeout_s=30.0,
        client_body_timeout_s=60.0,
        max_request_body_bytes=32 << 20,
        worker_connections=4096,
    )
    classes = {"uvicorn HttpToolsProtocol": HttpToolsProtocol, "EdgeProtocol": edge_protocol(limits)}
    if args.only:  # one class, one shape, no output: for counting instructions under valgrind
        await run_round(classes[args.only], config, SHAPES[args.shape], args.requests)
        return
    print(f"{args.requests} keep-alive requests per round, {args.rounds} rounds, order alternating; CPU ns per request")
    gc.disable()
    for shape, request in SHAPES.items():
        times: dict[str, list[float]] = {name: [] for name in classes}
        for cls in classes.values():  # warm-up
            await run_round(cls, config, request, args.requests)
        for r in range(args.rounds):
            order = list(classes.items()) if r % 2 == 0 else list(reversed(classes.items()))
            for name, cls in order:
                times[name].append(await run_round(cls, config, request, args.requests))
        for name, t in times.items():
            print(f"  {shape:10s} {name:26s} min {min(t):7.0f}  median {statistics.median(t):7.0f}")
        base, edge = times.values()
        diffs = sorted(e - b for b, e in zip(base, edge, strict=True))
        q1, q3 = diffs[len(diffs) // 4], diffs[3 * len(diffs) // 4]
        print(
            f"  {shape:10s} {'EdgeProtocol - uvicorn':26s} min {min(edge) - min(base):+7.0f}  median of paired "
            f"differences {statistics.median(diffs):+.0f} "
            f"(quartiles {q1:+.0f} .. {q3:+.0f})"
        )


def instructions(cls_name: str, shape: str, requests: int) -> int:
    """Instructions a run of `requests` requests executes, counted by valgrind (callgrind)."""
    out = subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--callgrind-out-file=/dev/null",
            sys.executable,
            __file__,
            "--only",
            cls_name,
            "--shape",
            shape,
            "--requests",
            str(requests),
        ],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )
    return int(re.search(r"Collected : (\d+)", out.stderr).group(1))  # type: ignore[union-attr]


def count_instructions(small: int, large: int) -> None:
    """Per-request instructions of each class: the difference of a long and a short run, divided
    by the requests between them (start-up and imports cancel out). Independent of the load."""
    print(f"instructions per request (valgrind callgrind; runs of {large} minus {small} requests)")
    for shape in SHAPES:
        per = {}
        for name in ("uvicorn HttpToolsProtocol", "EdgeProtocol"):
            per[name] = (instructions(name, shape, large) - instructions(name, shape, small)) / (large - small)
            print(f"  {shape:10s} {name:26s} {per[name]:9.0f}")
        base, edge = per.values()
        print(f"  {shape:10s} {'EdgeProtocol - uvicorn':26s} {edge - base:+9.0f} ({(edge - base) / base:+.1%})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=count, default=2000)
    parser.add_argument("--rounds", type=count, default=101)
    parser.add_argument(
        "--only",
        choices=["uvicorn HttpToolsProtocol", "EdgeProtocol"],
        help="run one round of this class only, print nothing",
    )
    parser.add_argument("--shape", choices=list(SHAPES), default="openai-sdk")
    parser.add_argument(
        "--instructions", action="store_true", help="count instructions per request with valgrind instead of timing"
    )
    cli = parser.parse_args()
    if cli.instructions:
        count_instructions(1000, 4000)
    else:
        uvloop.run(main(cli))
