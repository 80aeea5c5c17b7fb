#!/usr/bin/env python
"""Relaying a streamed chunk: the fleet worker's per-chunk cost, with and without `StreamGuard`.

`StreamGuard` (shmdisagg/orchestrator/answers.py) scans every chunk of a generation stream for internal
fields, a finish_reason and usage before it goes to the client. This measures what that adds,
side by side in one process: each round relays the same stream of real-shaped chunks (as
TensorRT-LLM's worker frames them, one chunk per SSE event) through

- `passthrough`: `async for chunk in response: await send(chunk)`, the relay loop before the
  guard existed;
- `guarded`: the same loop with `guard.feed(chunk)` in it and `guard.end()` after it, which is
  what `flows._relay_stream` does;

and reports nanoseconds per chunk (median of the rounds, min-max in brackets), and the added cost.
The response is an async iterator over prepared bytes and `send` a coroutine that drops them, so
only the relay's own Python work is timed (on uvloop, as the fleet runs).

    .venv/bin/python benchmarks/bench_relay.py [--chunks 2000] [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import orjson
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.benchkit import count
from shmdisagg.orchestrator.answers import StreamGuard


def chat_chunk(i: int, last: bool) -> bytes:
    obj = {
        "id": "chatcmpl-1099511627999",
        "object": "chat.completion.chunk",
        "created": 1796166423,
        "model": "tiny-llama3-tokenizer",
        "choices": [
            {
                "index": 0,
                "delta": {"content": f" word{i}", "reasoning_content": ""},
                **({"finish_reason": "length"} if last else {}),
            }
        ],
    }
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def completion_chunk(i: int, last: bool) -> bytes:  # completions chunks carry every field (exclude_unset=False)
    obj = {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1796166423,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "text": f" word{i}",
                "token_ids": None,
                "logprobs": None,
                "finish_reason": "length" if last else None,
                "stop_reason": None,
                "avg_decoded_tokens_per_iter": None,
            }
        ],
        "usage": None,
    }
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def logprobs_chunk(i: int, last: bool) -> bytes:
    top = [{f"tok{j}": -0.1 * j for j in range(5)}]
    obj = {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "text": f" w{i}",
                "logprobs": {"tokens": [f" w{i}"], "token_logprobs": [-0.5], "top_logprobs": top, "text_offset": [i]},
                "finish_reason": "length" if last else None,
            }
        ],
    }
    return b"data: " + orjson.dumps(obj) + b"\n\n"


SHAPES = {"chat": chat_chunk, "completion": completion_chunk, "logprobs": logprobs_chunk}


class _Response:
    def __init__(self, chunks: list[bytes]) -> None:
        self._it = iter(chunks)

    def __aiter__(self) -> _Response:
        return self

    async def __anext__(self) -> bytes:
        try:
            return next(self._it)
        except StopIteration:
            raise StopAsyncIteration from None


async def _send(_: bytes) -> None:
    return None


async def passthrough(chunks: list[bytes]) -> None:
    async for chunk in _Response(chunks):
        await _send(chunk)


async def guarded(chunks: list[bytes]) -> None:
    guard = StreamGuard(max_tokens=len(chunks))
    async for chunk in _Response(chunks):
        out = guard.feed(chunk)
        if out:
            await _send(out)
    await _send(guard.end())


async def _time(fn, chunks: list[bytes]) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter_ns()
    await fn(chunks)
    return (time.perf_counter_ns() - t0) / len(chunks)


async def main(n: int, rounds: int) -> None:
    print(f"{n} chunks per stream, {rounds} rounds, ns per chunk: median [min-max]")
    print(f"{'shape':<11} {'bytes':>6} {'passthrough':>20} {'guarded':>20} {'added':>7}")
    for name, make in SHAPES.items():
        chunks = [make(i, i == n - 1) for i in range(n - 1)] + [make(n - 1, True), b"data: [DONE]\n\n"]
        times: dict[str, list[float]] = {"passthrough": [], "guarded": []}
        for r in range(rounds):
            order = [passthrough, guarded] if r % 2 == 0 else [guarded, passthrough]
            for fn in order:
                times[fn.__name__].append(await _time(fn, chunks))
        med = {k: statistics.median(v) for k, v in times.items()}
        cells = [f"{med[k]:7.0f} [{min(v):.0f}-{max(v):.0f}]" for k, v in times.items()]
        print(
            f"{name:<11} {len(chunks[0]):>6} {cells[0]:>20} {cells[1]:>20} {med['guarded'] - med['passthrough']:>7.0f}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunks", type=count, default=2000)
    parser.add_argument("--rounds", type=count, default=15)
    args = parser.parse_args()
    uvloop.run(main(args.chunks, args.rounds))
