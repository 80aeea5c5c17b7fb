"""A chat SSE stream reframed into Anthropic's event sequence (upstream's
`AnthropicStreamReframer` / `reframe_openai_stream`, anthropic_adapter.py @a9239bda)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from shmdisagg.anthropic.stream import MALFORMED, TRUNCATED, StreamReframer
from shmdisagg.orchestrator.errors import sse_error_event

RECORDED = (Path(__file__).parent / "recorded_chat_stream.sse").read_bytes()


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **top: Any) -> bytes:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return (
        b"data: "
        + orjson.dumps(
            {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "served", "choices": choices, **top}
        )
        + b"\n\n"
    )


DONE = b"data: [DONE]\n\n"


def reframe(stream: bytes, piece: int = 0, model: str = "requested") -> list[dict[str, Any]]:
    """The events for `stream`, fed whole or in `piece`-byte chunks; checks the SSE framing."""
    r = StreamReframer(model)
    pieces = [stream[i : i + piece] for i in range(0, len(stream), piece)] if piece else [stream]
    out = b"".join(r.feed(p) for p in pieces) + r.end()
    events = []
    for frame in out.split(b"\n\n")[:-1]:
        head, data = frame.split(b"\n")
        event = orjson.loads(data.removeprefix(b"data: "))
        assert head == b"event: " + event["type"].encode()  # the event name is the payload's type
        events.append(event)
    assert out.endswith(b"\n\n")
    return events


def kinds(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]


@pytest.mark.parametrize("piece", [0, 1, 7, 64])
def test_a_recorded_worker_stream_becomes_the_anthropic_event_sequence(piece: int) -> None:
    events = reframe(RECORDED, piece)
    assert kinds(events) == ["message_start", "content_block_start"] + ["content_block_delta"] * 5 + [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0]["message"]
    assert start["id"].startswith("msg_") and start["model"] == "tiny-llama3-tokenizer" and start["content"] == []
    assert start["usage"] == {"input_tokens": 17, "output_tokens": 0} and "stop_reason" not in start
    assert events[1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert "".join(e["delta"]["text"] for e in events[2:7]) == " Disaggregated summariI E sun"
    assert all(e["index"] == 0 and e["delta"]["type"] == "text_delta" for e in events[2:7]) and events[7] == {
        "type": "content_block_stop",
        "index": 0,
    }
    assert events[8] == {
        "type": "message_delta",
        "delta": {"stop_reason": "max_tokens"},
        "usage": {"input_tokens": 17, "output_tokens": 5},
    }
    assert events[9] == {"type": "message_stop"}


def test_reasoning_then_text_are_two_blocks_and_a_stop_sequence_is_named() -> None:
    stream = (
        chunk({"role": "assistant"})
        + chunk({"reasoning_content": "hm"})
        + chunk({"reasoning": "m"})
        + chunk({"content": "ok"})
    )
    stream += (
        b"data: "
        + orjson.dumps(
            {"model": "served", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop", "stop_reason": "END"}]}
        )
        + b"\n\n"
        + DONE
    )
    events = reframe(stream)
    assert kinds(events) == [
        "message_start",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop",
    ]  # fmt: skip
    assert events[1]["content_block"] == {"type": "thinking", "thinking": ""} and [e["delta"] for e in events[2:4]] == [
        {"type": "thinking_delta", "thinking": "hm"},
        {"type": "thinking_delta", "thinking": "m"},
    ]
    assert events[5] == {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}}
    assert events[8]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    assert events[8]["usage"] == {"input_tokens": 0, "output_tokens": 0}  # no usage was streamed


def test_interleaved_tool_calls_are_serialised_with_every_fragment_kept() -> None:
    def calls(*parts: dict[str, Any]) -> bytes:
        return chunk({"tool_calls": list(parts)})

    stream = chunk({"content": "let me"})
    stream += calls(
        {"index": 0, "id": "call_a", "function": {"name": "read", "arguments": '{"pa'}},
        {"index": 1, "id": "call_b", "function": {"name": "grep", "arguments": '{"q"'}},
    )
    stream += calls(
        {"index": 1, "function": {"arguments": ': "x"}'}}, {"index": 0, "function": {"arguments": 'th": 1}'}}
    )
    stream += chunk({}, finish="tool_calls") + DONE
    events = reframe(stream)
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert [s["content_block"] for s in starts] == [
        {"type": "text", "text": ""},
        {"type": "tool_use", "id": "call_a", "name": "read", "input": {}},
        {"type": "tool_use", "id": "call_b", "name": "grep", "input": {}},
    ]
    by_block: dict[int, str] = {}
    for e in events:
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta":
            by_block[e["index"]] = by_block.get(e["index"], "") + e["delta"]["partial_json"]
    assert by_block == {1: '{"path": 1}', 2: '{"q": "x"}'}
    indices = [e["index"] for e in events if "index" in e]
    assert indices == sorted(indices)  # blocks strictly one after another
    assert events[-2]["delta"] == {"stop_reason": "tool_use"}


def test_a_tool_call_makes_the_stop_reason_tool_use_even_when_finish_says_stop() -> None:
    stream = (
        chunk({"tool_calls": [{"index": 0, "id": "c", "function": {"name": "f", "arguments": "{}"}}]})
        + chunk({}, finish="stop")
        + DONE
    )
    assert reframe(stream)[-2]["delta"] == {"stop_reason": "tool_use"}


def test_the_chat_routes_error_event_ends_the_stream_as_an_anthropic_error() -> None:
    stream = chunk({"content": "par"}) + sse_error_event(504, "request did not finish within 30 s")
    events = reframe(stream)
    assert kinds(events) == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "error",
    ]
    assert events[-1] == {
        "type": "error",
        "error": {"type": "api_error", "message": "request did not finish within 30 s"},
    }


@pytest.mark.parametrize(("tail", "message"), [(b"", TRUNCATED), (b"data: {not json\n\n" + DONE, MALFORMED)])
def test_a_cut_or_garbled_stream_never_looks_finished(tail: bytes, message: str) -> None:
    events = reframe(chunk({"content": "part"}) + tail)
    assert kinds(events)[-2:] == ["content_block_stop", "error"] and "message_stop" not in kinds(events)
    assert events[-1]["error"] == {"type": "api_error", "message": message}


def test_an_empty_stream_still_starts_and_ends_its_message() -> None:
    events = reframe(DONE)
    assert kinds(events) == ["message_start", "message_delta", "message_stop"]
    assert events[0]["message"]["model"] == "requested"  # no chunk named a model
