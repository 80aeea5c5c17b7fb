"""Token-id prompts read from the body without Python ints (`native/json_ids.c`,
`splice.cut_token_ids`, `service._decode`): the ids read are exactly what decoding the body and
`token_ids_int32` give, anything else falls back to decoding (None), and a request whose prompt
was read natively validates, routes and is relayed as the decoded one would be."""

from __future__ import annotations

import array
from typing import Any

import orjson
import pytest
from hypothesis import given, settings, strategies as st

from shmdisagg._native import json_token_ids, token_ids_int32
from shmdisagg.orchestrator import splice
from shmdisagg.orchestrator.errors import RequestError
from shmdisagg.orchestrator.service import _decode
from shmdisagg.orchestrator.splice import TokenIds
from shmdisagg.orchestrator.validation import prompt_load_tokens, validate
from shmdisagg.routing import RoutingKey

# ids near every boundary the reader has: digit counts 1-10 (7 is the widest the 8-byte path
# reads, 8+ go byte by byte), 2**31 - 1 and 2**31, and values a decoder takes but token_ids refuse
ids = st.one_of(
    st.integers(0, 9),
    st.integers(10**6, 10**8),
    st.integers(2**31 - 3, 2**31 + 3),
    st.integers(0, 2**31 - 1),
    st.integers(-5, -1),
)
separators = st.sampled_from([",", ", ", " ,", ",\n  ", "\t,\r\n"])


def decoded_ids(doc: bytes, key: str) -> bytes | None:
    """What the decoded path yields for `key`: its ids as int32 if token_ids_int32 takes them."""
    try:
        value = orjson.loads(doc)[key]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None
    return token_ids_int32(value)


@settings(max_examples=400, deadline=None)
@given(values=st.lists(ids, max_size=40), sep=separators, pad=st.sampled_from(["", " ", "\n"]), tail=st.booleans())
def test_the_ids_read_are_the_decoded_ones_or_none(values: list[int], sep: str, pad: str, tail: bool) -> None:
    array_text = "[" + pad + sep.join(map(str, values)) + pad + "]"
    doc = ('{"model": "m", "prompt": ' + array_text + (', "max_tokens": 3}' if tail else "}")).encode()
    found = json_token_ids(doc, b"prompt")
    expected = decoded_ids(doc, "prompt")
    if expected is None:
        assert found is None
    else:
        assert found is not None
        start, end, raw = found
        assert raw == expected and doc[start:end] == array_text.encode()


@settings(max_examples=300, deadline=None)
@given(
    values=st.lists(ids, min_size=1, max_size=300),
    sep=separators,
    at=st.floats(0, 1),
    edit=st.sampled_from(["", ",", " ", "  ", "0", "00", "-", ".", "e", "]", "[", '"', "7" * 9, "\x00"]),
    replace=st.booleans(),
)
def test_long_arrays_with_one_edit_read_as_decoding_reads_them(
    values: list[int], sep: str, at: float, edit: str, replace: bool
) -> None:
    # arrays long enough for the 64-byte chunks (read_chunks), one edit anywhere in them (an
    # extra comma, a split or merged id, a byte no id has): the ids read are the decoded ones
    array_text = "[" + sep.join(map(str, values)) + "]"
    i = 1 + int(at * (len(array_text) - 2))
    array_text = array_text[:i] + edit + array_text[i + (1 if replace and edit else 0) :]
    doc = ('{"model": "m", "prompt": ' + array_text + ', "max_tokens": 3}').encode()
    found = json_token_ids(doc, b"prompt")
    expected = decoded_ids(doc, "prompt")
    if expected is None:
        assert found is None
    elif found is None:  # declining is never wrong, only slower: only `-0` (a decoder's 0) is
        assert "-0" in array_text
    else:
        assert found[2] == expected and doc[found[0] : found[1]] == array_text.encode()


@pytest.mark.parametrize(
    "doc",
    [
        b'{"prompt": []}',
        b'{"prompt": [01]}',  # not JSON
        b'{"prompt": [1.0]}',
        b'{"prompt": [1e3]}',
        b'{"prompt": [1,]}',
        b'{"prompt": [[1, 2]]}',  # a one-prompt batch: the decoded path unwraps it
        b'{"prompt": ["1"]}',
        b'{"prompt": [1 2]}',
        b'{"prompt": [true]}',
        b'{"prompt": [4294967296]}',
        b'{"prompt": [12345678901]}',
        b'{"prompt": [1, \xff2]}',
        b'{"prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9',  # unterminated
        b'{"prompt": [ ,' + b" " * 80 + b"5, 6]}",  # a comma before the first id, a chunk apart
        b'{"prompt": [' + b"1" * 70 + b"]}",  # one run longer than a chunk
        b'{"prompt": [' + b"5, " * 30 + b"5,, 6" + b", 7" * 30 + b"]}",
        b'{"prompt": [1], "prompt": "x"}',  # the last duplicate is what counts
        b'{"prompt": "x"}',
        b'{"other": [1]}',
        b"[1, 2]",
    ],
)
def test_anything_else_is_none(doc: bytes) -> None:
    assert json_token_ids(doc, b"prompt") is None


def test_the_last_duplicate_counts() -> None:
    found = json_token_ids(b'{"prompt": "x", "prompt": [5, 6]}', b"prompt")
    assert found is not None and array.array("i", found[2]).tolist() == [5, 6]


def body(prompt: Any, **fields: Any) -> bytes:
    return orjson.dumps({"model": "m", "prompt": prompt, "max_tokens": 4, **fields})


def test_a_large_token_id_prompt_is_read_natively_and_validates_as_the_list_would() -> None:
    values = list(range(3000))
    req = _decode(body(values), chat=False)
    prompt = req["prompt"]
    assert isinstance(prompt, TokenIds) and len(prompt) == 3000 and list(prompt[:3]) == [0, 1, 2]
    assert validate(req, chat=False, want_ids=True) == token_ids_int32(values)
    assert prompt_load_tokens(req, chat=False) == 3000
    key = RoutingKey(len(prompt), prompt, ids32=prompt.ids32)
    assert key.block_hashes(32) == RoutingKey(3000, values).block_hashes(32)


def test_a_leg_carries_the_clients_bytes_and_decodes_to_the_same_request() -> None:
    raw = b'{"model":"m","prompt":[ 1,2 , 3' + b", 7" * 20_000 + b' ],"max_tokens":4,"stream":false}'
    req = _decode(raw, chat=False)
    leg = {**req, "disaggregated_params": {"request_type": "context_only"}}
    pieces = splice.dumps(leg)  # over PIECES_MIN_BYTES: the leg's body as pieces
    assert isinstance(pieces, list)
    views = [p for p in pieces if isinstance(p, memoryview)]
    assert len(views) == 1 and views[0].obj is raw  # sent from the client's body, not a copy
    sent = b"".join(pieces)
    assert raw[raw.index(b"[") : raw.index(b"]") + 1] in sent  # the client's bytes, spacing and all
    assert orjson.loads(sent) == {**orjson.loads(raw), "disaggregated_params": {"request_type": "context_only"}}
    assert splice.decoded(leg)["prompt"] == orjson.loads(raw)["prompt"]  # msgpack's path


@pytest.mark.parametrize(
    "prompt, message",
    [
        ([0] * 2000 + [-1], "token ids (integers from 0 to 2147483647)"),
        ([0] * 2000 + [2**31], "token ids (integers from 0 to 2147483647)"),
        ([[1] * 2000, [2]], "a batch of prompts is not supported"),
        ([], "must not be empty"),
    ],
)
def test_what_the_reader_declines_is_refused_as_before(prompt: list[Any], message: str) -> None:
    req = _decode(body(prompt, pad="x" * 5000), chat=False)
    assert not isinstance(req["prompt"], TokenIds)
    with pytest.raises(RequestError) as err:
        validate(req, chat=False, want_ids=True)
    assert err.value.status == 400 and message in err.value.message


def test_small_bodies_chats_and_bad_json_take_the_decoded_path() -> None:
    assert type(_decode(body([1, 2, 3]), chat=False)["prompt"]) is list  # under MIN_BYTES
    chat = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], "prompt": list(range(2000))})
    assert type(_decode(chat, chat=True)["prompt"]) is list
    with pytest.raises(RequestError) as err:
        _decode(body(list(range(2000)))[:-1], chat=False)  # the rest of the body is not JSON
    assert err.value.status == 400 and "not valid JSON" in err.value.message


def test_json_long_digits_finds_every_run_of_19_digits_and_no_shorter_one() -> None:
    """The native scan looks at aligned 8-byte words only; a run of 19 covers one whatever its
    offset. Checked against a regex on random bodies with runs of 15 to 23 digits anywhere."""
    import random
    import re

    from shmdisagg._native import json_long_digits

    rng = random.Random(7)
    for _ in range(20_000):
        body = bytes(rng.choice(b"0123456789,x ") for _ in range(rng.randrange(0, 80)))
        if rng.random() < 0.4:
            at = rng.randrange(0, len(body) + 1)
            body = body[:at] + b"7" * rng.randrange(15, 24) + body[at:]
        assert json_long_digits(body) == any(len(r) >= 19 for r in re.findall(rb"[0-9]+", body)), body
