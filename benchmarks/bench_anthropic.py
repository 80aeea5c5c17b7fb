#!/usr/bin/env python
"""What `/v1/messages` adds over `/v1/chat/completions`, measured side by side in one process.

- per request: reading the body as the chat route does (`orjson.loads` + `validation.validate`)
  against the Anthropic route's extra work before it (`protocol.parse`, pydantic, +
  `convert.chat_request` + `orjson.dumps` of the chat body), for a Claude Code-shaped request
  (a system prompt, 8 tools, 12 turns with tool calls and results);
- per streamed chunk: the chat route's relay (`StreamGuard.feed`) against the relay plus the
  reframing (`StreamReframer.feed` of its output), over a stream of chat chunks as TensorRT-LLM's
  worker frames them (usage on every chunk).

Rounds alternate their order; reported: microseconds per request / nanoseconds per chunk, median
of the rounds [min-max], and the ratio of the medians.

    .venv/bin/python benchmarks/bench_anthropic.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.benchkit import count
from shmdisagg.anthropic.convert import chat_request
from shmdisagg.anthropic.protocol import MessagesRequest, parse
from shmdisagg.anthropic.stream import StreamReframer
from shmdisagg.orchestrator.answers import StreamGuard
from shmdisagg.orchestrator.validation import validate


def claude_code_request() -> bytes:
    tools = [
        {
            "name": f"Tool{i}",
            "description": "does a thing " * 20,
            "input_schema": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "n": {"type": "integer"}},
                "required": ["path"],
            },
        }
        for i in range(8)
    ]
    turns: list[dict[str, object]] = []
    for i in range(6):
        turns.append(
            {"role": "user", "content": [{"type": "text", "text": f"step {i}: " + "please look at the code " * 10}]}
        )
        turns.append(
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "looking"},
                    {"type": "tool_use", "id": f"toolu_{i}", "name": "Tool1", "input": {"path": f"/src/f{i}.py"}},
                ],
            }
        )
        turns[-2]["content"].insert(
            0, {"type": "tool_result", "tool_use_id": f"toolu_{i - 1}", "content": "print('x')\n" * 40}
        ) if i else None  # type: ignore[union-attr]
    turns.append({"role": "user", "content": "now summarise"})
    system = [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.223.520; cc_entrypoint=cli;"},
        {"type": "text", "text": "You are Claude Code. " * 100},
    ]
    return orjson.dumps(
        {"model": "m", "max_tokens": 4096, "system": system, "messages": turns, "tools": tools, "stream": True}
    )


def chat_chunk(i: int, last: bool) -> bytes:
    obj = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1796169614,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "delta": {"content": f" word{i}", "reasoning_content": ""},
                **({"finish_reason": "length"} if last else {}),
            }
        ],
        "usage": {
            "prompt_tokens": 2000,
            "total_tokens": 2000 + i,
            "completion_tokens": i,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def per_call(fn: Callable[[], object], n: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(n):
        fn()
    return (time.perf_counter_ns() - t0) / n


def compare(
    label: str,
    unit: str,
    scale: float,
    a: tuple[str, Callable[[], float]],
    b: tuple[str, Callable[[], float]],
    rounds: int,
) -> None:
    times: dict[str, list[float]] = {a[0]: [], b[0]: []}
    for r in range(rounds):
        for name, fn in (a, b) if r % 2 == 0 else (b, a):
            times[name].append(fn() / scale)
    med = {k: statistics.median(v) for k, v in times.items()}
    cells = "  ".join(f"{k} {med[k]:.1f} [{min(v):.1f}-{max(v):.1f}] {unit}" for k, v in times.items())
    print(f"{label}: {cells}  ratio {med[b[0]] / med[a[0]]:.2f}")


def main(rounds: int) -> None:
    body = claude_code_request()
    chat_body = orjson.dumps(chat_request(parse(MessagesRequest, body)))
    print(f"request: {len(body)} bytes as Anthropic, {len(chat_body)} bytes as chat")

    def chat_route() -> None:
        validate(orjson.loads(chat_body), True, frozenset())

    def anthropic_route() -> None:
        validate(orjson.loads(orjson.dumps(chat_request(parse(MessagesRequest, body)))), True, frozenset())

    compare(
        "per request",
        "us",
        1000.0,
        ("chat", lambda: per_call(chat_route, 200)),
        ("anthropic", lambda: per_call(anthropic_route, 200)),
        rounds,
    )

    n = 2000
    chunks = [chat_chunk(i, i == n - 1) for i in range(n)] + [b"data: [DONE]\n\n"]

    def relay() -> float:
        guard = StreamGuard(max_tokens=n)
        t0 = time.perf_counter_ns()
        for c in chunks:
            guard.feed(c)
        guard.end()
        return (time.perf_counter_ns() - t0) / len(chunks)

    def relay_reframed() -> float:
        guard, reframer = StreamGuard(max_tokens=n), StreamReframer("m")
        t0 = time.perf_counter_ns()
        for c in chunks:
            reframer.feed(guard.feed(c))
        reframer.feed(guard.end())
        reframer.end()
        return (time.perf_counter_ns() - t0) / len(chunks)

    compare("per chunk", "ns", 1.0, ("chat", relay), ("anthropic", relay_reframed), rounds)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=count, default=15)
    main(parser.parse_args().rounds)
