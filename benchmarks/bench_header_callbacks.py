#!/usr/bin/env python
"""What the executor responses' header callbacks cost: httptools parsing one typical non-streaming
answer with an `on_header` callback (as `upstream/_connection.py` collects headers) against one
without (headers kept as the raw head, parsed only when asked for). Side by side, alternating.

    .venv/bin/python benchmarks/bench_header_callbacks.py [--n 200000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httptools

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.benchkit import count

# the simulator's answer head (uvicorn's), with a 600-byte JSON body
RESPONSE = (
    b"HTTP/1.1 200 OK\r\ndate: Mon, 07 Dec 2026 05:00:00 GMT\r\nserver: uvicorn\r\ncontent-length: 600\r\n"
    b"content-type: application/json\r\n\r\n" + b"x" * 600
)


class _Body:
    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.headers: list[tuple[bytes, bytes]] = []

    def on_headers_complete(self) -> None:
        pass

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        pass


class _Headers(_Body):
    def on_header(self, name: bytes, value: bytes) -> None:  # as _connection.Connection does
        self.headers.append((name.lower(), value))


def per_answer_us(proto: Any, n: int) -> float:
    parser = httptools.HttpResponseParser(proto)
    raw: list[bytes] = []
    t = time.perf_counter()
    for _ in range(n):
        raw.append(RESPONSE)  # the lazy variant's cost: keep the head's read
        parser.feed_data(RESPONSE)
        proto.chunks.clear()
        proto.headers = []
        raw = []
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=count, default=200_000)
    ap.add_argument("--rounds", type=count, default=5)
    args = ap.parse_args()
    with_cb, without = [], []
    for _ in range(args.rounds):
        with_cb.append(per_answer_us(_Headers(), args.n))
        without.append(per_answer_us(_Body(), args.n))
    a, b = statistics.median(with_cb), statistics.median(without)
    print(f"µs per answer, median of {args.rounds}: on_header {a:.3f}, none {b:.3f}; saved {a - b:.3f} ({a / b:.2f}x)")


if __name__ == "__main__":
    main()
