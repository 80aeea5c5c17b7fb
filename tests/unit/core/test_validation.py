"""Public request validation: 400 with an OpenAI error body, internal fields dropped."""

from __future__ import annotations

import orjson
import pytest

from shmdisagg.errors import RequestError
from shmdisagg.validation import parse_body, prompt_load_tokens, validate

MODELS = frozenset({"m"})


def _check(body: bytes, chat: bool = False) -> dict:
    req = parse_body(body)
    validate(req, chat, MODELS)
    return req


@pytest.mark.parametrize(
    ("body", "chat", "param"),
    [
        (b"not json", False, None),
        (b"[1, 2]", False, None),
        (b'{"model":"m"}', False, "prompt"),
        (b'{"model":"m","prompt":[],"max_tokens":8}', False, "prompt"),
        (b'{"model":"m","prompt":""}', False, "prompt"),
        (b'{"model":"m","prompt":[[1,2],[3,4]]}', False, "prompt"),
        (b'{"model":"m","prompt":["a","b"]}', False, "prompt"),
        (b'{"model":"m","prompt":[1,-2]}', False, "prompt"),
        (b'{"model":"m","prompt":"hi","n":2}', False, "n"),
        (b'{"model":"m","prompt":"hi","best_of":3}', False, "best_of"),
        (b'{"model":"m","prompt":"hi","max_tokens":-1}', False, "max_tokens"),
        (b'{"model":"m","prompt":"hi","max_tokens":0}', False, "max_tokens"),
        (b'{"model":"m","prompt":"hi","stream":"yes"}', False, "stream"),
        (b'{"prompt":"hi"}', False, "model"),
        (b'{"model":"m","messages":[]}', True, "messages"),
        (b'{"model":"m"}', True, "messages"),
        (b'{"model":"m","messages":["hi"]}', True, "messages"),
    ],
)
def test_bad_requests_are_400_with_openai_error_body(body: bytes, chat: bool, param: str | None) -> None:
    with pytest.raises(RequestError) as info:
        _check(body, chat)
    err = info.value
    assert err.status == 400
    parsed = orjson.loads(err.body())
    assert parsed["object"] == "error" and parsed["type"] == "BadRequestError" and parsed["message"]
    assert parsed["param"] == param


def test_unknown_model_is_404() -> None:
    with pytest.raises(RequestError) as info:
        _check(b'{"model":"other","prompt":"hi"}')
    assert info.value.status == 404 and info.value.code == "model_not_found"


def test_internal_fields_from_clients_are_dropped() -> None:
    req = _check(
        b'{"model":"m","prompt":"hi","disaggregated_params":{"request_type":"generation_only","ctx_request_id":1},'
        b'"prompt_token_ids":[1],"ctx_usage":{}}'
    )
    assert not {"disaggregated_params", "prompt_token_ids", "ctx_usage"} & req.keys()


def test_single_prompt_batches_are_unwrapped_and_counted() -> None:
    assert _check(b'{"model":"m","prompt":[[5,6,7]]}')["prompt"] == [5, 6, 7]
    assert _check(b'{"model":"m","prompt":["abc"]}')["prompt"] == "abc"
    assert prompt_load_tokens(_check(b'{"model":"m","prompt":[1,2,3,4]}'), False) == 4
    chat = _check(b'{"model":"m","messages":[{"role":"user","content":"hello"},{"role":"user","content":[{"type":"text","text":"ab"}]}]}', True)
    assert prompt_load_tokens(chat, True) == 7
