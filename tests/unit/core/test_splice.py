"""Token-id arrays relayed as bytes (`shmdisagg/orchestrator/splice.py`, `native/json_span.c`):
the member found is the one a JSON decoder keeps, anything unsure is None, and a body with
spliced bytes decodes to what the decoded path would have sent."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings, strategies as st

from shmdisagg._native import json_member
from shmdisagg.orchestrator import splice
from shmdisagg.orchestrator.splice import Raw

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def member(doc: bytes, key: str) -> Any:
    span = json_member(doc, key.encode())
    return None if span is None else orjson.loads(doc[span[0] : span[1]])


@settings(max_examples=300, deadline=None)
@given(obj=st.dictionaries(st.text(max_size=8), json_values, min_size=1, max_size=6), indent=st.booleans())
def test_the_member_found_is_the_decoders(obj: dict[str, Any], indent: bool) -> None:
    doc = orjson.dumps(obj, option=orjson.OPT_INDENT_2 if indent else 0)
    for key, value in obj.items():
        span = json_member(doc, key.encode())
        if span is None:  # only when some top-level key is written with an escape
            assert any(b"\\" in orjson.dumps(k) for k in obj)
        else:
            assert orjson.loads(doc[span[0] : span[1]]) == value


@pytest.mark.parametrize(
    "doc, key, expected",
    [
        (b'{"prompt": [1, 2], "prompt": [3]}', "prompt", [3]),  # the last of duplicates, as orjson keeps
        (b'{"a": {"prompt": [9]}, "prompt": [1]}', "prompt", [1]),  # a nested one is not top-level
        (b'{"s": "a \\"prompt\\": [9] ]}", "prompt": [1]}', "prompt", [1]),  # inside a string
        (b'{"s": "\\\\", "prompt": [1]}', "prompt", [1]),  # a string ending in an escaped backslash
        (b' {\n "prompt" :\t[ 1 ,2 ]\n} ', "prompt", [1, 2]),
        (b'{"prompt": [1, "]", {"x": "}"}]}', "prompt", [1, "]", {"x": "}"}]),
    ],
)
def test_members_in_awkward_places(doc: bytes, key: str, expected: Any) -> None:
    assert member(doc, key) == expected


@pytest.mark.parametrize(
    "doc",
    [
        b"[1, 2]",
        b'"prompt"',
        b"",
        b"{}",
        b'{"prompt": [1, 2',  # unterminated
        b'{"prompt" [1]}',  # no colon
        b'{"pr\\u006fmpt": [1], "x": 1}',  # a key with an escape may spell it: unsure, so None
        b'{"x": 1 "prompt": [1]}',  # no comma
        b'{"x": "unterminated}',
    ],
)
def test_unsure_or_absent_is_none(doc: bytes) -> None:
    assert json_member(doc, b"prompt") is None


def test_cut_replaces_the_array_with_null_and_keeps_its_bytes() -> None:
    ids = list(range(2000))
    doc = orjson.dumps({"id": "x", "prompt_token_ids": ids, "choices": [{"text": "hi"}]})
    rest, raw = splice.cut(doc, b"prompt_token_ids")
    assert raw is not None and orjson.loads(raw.data) == ids
    assert orjson.loads(rest) == {"id": "x", "prompt_token_ids": None, "choices": [{"text": "hi"}]}


def test_small_bodies_and_non_arrays_are_left_alone() -> None:
    small = orjson.dumps({"prompt_token_ids": [1, 2, 3]})
    assert splice.cut(small, b"prompt_token_ids") == (small, None)
    text = orjson.dumps({"prompt_token_ids": "x" * 5000})
    assert splice.cut(text, b"prompt_token_ids") == (text, None)


@settings(max_examples=400, deadline=None)
@given(
    head=st.lists(st.integers(0, 10**9), max_size=40),
    odd=st.sampled_from([None, '"]"', "[1]", '{"a": 1}', "[]"]),
    tail=st.lists(st.integers(0, 9), max_size=20),
    spaced=st.booleans(),
)
def test_long_arrays_end_where_the_decoder_ends_them(
    head: list[int], odd: str | None, tail: list[int], spaced: bool
) -> None:
    """Arrays past 16 bytes (the 16-byte scan for a flat array's `]`), with a string, an array or
    an object anywhere in them (the byte-by-byte walk takes over), end where orjson ends them."""
    items = [str(i) for i in head] + ([odd] if odd else []) + [str(i) for i in tail]
    array_text = "[" + (", " if spaced else ",").join(items) + "]"
    doc = ('{"prompt_token_ids": ' + array_text + ', "after": ["]", 1], "id": "x"}').encode()
    assert member(doc, "prompt_token_ids") == orjson.loads(array_text)
    assert member(doc, "after") == ["]", 1]


@settings(max_examples=200, deadline=None)
@given(
    rest=st.dictionaries(st.sampled_from(["model", "max_tokens", "stream", "x"]), json_values, max_size=4),
    ids=st.lists(st.integers(0, 2**31 - 1), max_size=50),
    chat_ids=st.one_of(st.none(), st.lists(st.integers(0, 100), max_size=5)),
)
def test_dumps_with_raw_values_decodes_as_the_decoded_request(
    rest: dict[str, Any], ids: list[int], chat_ids: list[int] | None
) -> None:
    req: dict[str, Any] = {**rest, "prompt": Raw(orjson.dumps(ids))}
    plain: dict[str, Any] = {**rest, "prompt": ids}
    if chat_ids is not None:
        req["prompt_token_ids"] = Raw(orjson.dumps(chat_ids, option=orjson.OPT_INDENT_2))
        plain["prompt_token_ids"] = chat_ids
    sent = splice.dumps(req)
    assert orjson.loads(sent if isinstance(sent, bytes) else b"".join(sent)) == plain
    assert splice.decoded(req) == plain


@pytest.mark.parametrize("ids", [50, 20_000])
def test_dumps_leaves_long_raw_values_in_their_buffers_and_joins_short_ones(ids: int) -> None:
    body = orjson.dumps({"prompt": list(range(ids))})
    raw = Raw(memoryview(body)[len(b'{"prompt":') : -1])
    sent = splice.dumps({"model": "m", "prompt": raw})
    if len(raw.data) < splice.PIECES_MIN_BYTES:
        assert sent == b'{"model":"m","prompt":' + bytes(raw.data) + b"}"
    else:
        assert isinstance(sent, list) and any(piece is raw.data for piece in sent)  # not a copy
        assert b"".join(sent) == b'{"model":"m","prompt":' + bytes(raw.data) + b"}"


def test_an_empty_array_is_empty() -> None:
    assert Raw(b"[ ]").empty and Raw(b"[]").empty and not Raw(b"[0]").empty
    assert Raw(memoryview(b"x[ \n\t]")[1:]).empty and not Raw(memoryview(b"[\n 0]")).empty
