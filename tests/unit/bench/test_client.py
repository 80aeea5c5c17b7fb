"""The SSE parser, fed byte streams cut at arbitrary points (no sockets)."""

from __future__ import annotations

import orjson
from hypothesis import given, strategies as st

from shmdisagg.bench.client import RequestRecord, _Stream, completion_body, has_text


def event(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def text_chunk(text: str, finish: str | None = None) -> bytes:
    return event({"id": "c", "choices": [{"index": 0, "text": text, "finish_reason": finish}], "usage": None})


USAGE = {"prompt_tokens": 40, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 32}}
STREAM = (
    text_chunk("")  # empty first chunk: not the first token
    + text_chunk("a")
    + text_chunk('he said "hi"')
    + text_chunk("c")
    + text_chunk("", finish="length")
    + event({"id": "c", "choices": [], "usage": USAGE})
    + b"data: [DONE]\n\n"
)


def feed(stream: bytes, cuts: list[int], max_tokens: int = 3) -> RequestRecord:
    rec = RequestRecord(index=0, input_length=40, max_tokens=max_tokens)
    parser = _Stream(rec)
    points = sorted(set(c % (len(stream) + 1) for c in cuts))
    pieces = [stream[a:b] for a, b in zip([0, *points], [*points, len(stream)], strict=True)]
    for now, piece in enumerate(pieces, 1):
        parser.feed(piece, float(now))
    parser.finish()
    return rec


@given(st.lists(st.integers(0, 10_000), max_size=12))
def test_chunks_and_usage_survive_any_split_of_the_stream(cuts: list[int]) -> None:
    rec = feed(STREAM, cuts)
    assert rec.ok, rec.error
    assert len(rec.chunk_times) == 3  # the three text chunks, not the empty ones
    assert rec.first_token == rec.chunk_times[0]
    assert rec.chunk_times == sorted(rec.chunk_times)
    assert (rec.prompt_tokens, rec.output_tokens, rec.cached_tokens) == (40, 3, 32)


def test_crlf_separated_events_parse_too() -> None:
    rec = feed(STREAM.replace(b"\n", b"\r\n"), [])
    assert rec.ok and len(rec.chunk_times) == 3 and rec.cached_tokens == 32


def test_chat_deltas_count_content_not_role() -> None:
    chat = (
        event({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
        + event({"choices": [{"delta": {"content": "x"}}]})
        + event({"choices": [{"delta": {"reasoning_content": "r", "content": "y"}}]})
        + b"data: [DONE]\n\n"
    )
    rec = feed(chat, [], max_tokens=2)
    assert rec.ok and len(rec.chunk_times) == 2
    assert rec.output_tokens == 2 and rec.usage_missing  # no usage chunk: counted, and flagged


def test_a_stream_without_done_is_incomplete() -> None:
    rec = feed(STREAM[: STREAM.index(b"data: [DONE]")], [])
    assert rec.error_kind == "incomplete_stream"


def test_an_error_event_fails_the_request() -> None:
    rec = feed(text_chunk("a") + b'data: {"object":"error","message":"boom","code":500}\n\n' + b"data: [DONE]\n\n", [])
    assert rec.error_kind == "stream_error" and rec.error == "boom"


def test_has_text_reads_only_the_value_of_the_key() -> None:
    assert has_text(b'{"choices":[{"text":"x"}]}')
    assert has_text(b'{"choices":[{"text": "\\"text\\":\\"\\""}]}')
    assert not has_text(b'{"choices":[{"text":""}]}')
    assert not has_text(b'{"choices":[{"text": null}]}')
    assert not has_text(b'{"choices":[],"usage":{"prompt_tokens":1}}')
    assert not has_text(b'{"choices":[{"delta":{"reasoning_content":"r"}}]}')
    assert has_text(b'{"type":"text","choices":[{"text" : "y"}]}')  # a value "text" is skipped


def test_completion_body_asks_for_exactly_max_tokens_streamed_with_usage() -> None:
    body = orjson.loads(completion_body("m", [5, 6, 7], 9))
    assert body == {
        "model": "m",
        "prompt": [5, 6, 7],
        "max_tokens": 9,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
