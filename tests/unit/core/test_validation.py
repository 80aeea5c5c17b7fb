"""Public request validation: 400 with an OpenAI error body, internal fields dropped."""

from __future__ import annotations

from array import array
from enum import IntEnum

import orjson
import pytest
from hypothesis import given, settings, strategies as st

from shmdisagg._native import token_ids_int32, token_ids_ok
from shmdisagg.orchestrator.errors import RequestError
from shmdisagg.orchestrator.validation import parse_body, prompt_load_tokens, validate


def _check(body: bytes, chat: bool = False, want_ids: bool = False) -> dict:
    req = parse_body(body)
    validate(req, chat, want_ids)
    return req


@pytest.mark.parametrize(
    ("body", "chat", "param"),
    [
        (b"not json", False, None),
        (b"[1, 2]", False, None),
        (b'{"model":"m"}', False, "prompt"),
        (b'{"model":"m","prompt":[],"max_tokens":8}', False, "prompt"),
        (b'{"model":"m","prompt":[[1,2],[3,4]]}', False, "prompt"),
        (b'{"model":"m","prompt":["a","b"]}', False, "prompt"),
        (b'{"model":"m","prompt":[1,-2]}', False, "prompt"),
        (b'{"model":"m","prompt":"hi","n":2}', False, "n"),
        (b'{"model":"m","prompt":"hi","best_of":3}', False, "best_of"),
        (b'{"model":"m","prompt":"hi","max_tokens":-1}', False, "max_tokens"),
        (b'{"model":"m","prompt":"hi","max_tokens":0}', False, "max_tokens"),
        (b'{"model":"m","prompt":"hi","stream":"maybe"}', False, "stream"),
        (b'{"model":"m","prompt":"hi","stream_options":{"include_usage":true}}', False, "stream_options"),
        (b'{"model":"m","messages":[{"role":"user","content":"x"}],"stream_options":{}}', True, "stream_options"),
        (b'{"model":"m","prompt":"hi","max_tokens":2.5}', False, "max_tokens"),
        (b'{"model":"m","prompt":"hi","max_tokens":"many"}', False, "max_tokens"),
        (b'{"model":"m","prompt":"hi","max_tokens":"100000000000000000000000"}', False, "max_tokens"),
        (
            b'{"model":"m","prompt":"hi","stream":true,"stream_options":{"include_usage":2}}',
            False,
            "stream_options.include_usage",
        ),
        (b'{"prompt":"hi"}', False, "model"),
        (b'{"model":"m","messages":[]}', True, "messages"),
        (b'{"model":"m"}', True, "messages"),
        (b'{"model":"m","messages":["hi"]}', True, "messages"),
    ],
)
@pytest.mark.parametrize("want_ids", [False, True])
def test_bad_requests_are_400_with_openai_error_body(
    body: bytes, chat: bool, param: str | None, want_ids: bool
) -> None:
    with pytest.raises(RequestError) as info:
        _check(body, chat, want_ids)
    err = info.value
    assert err.status == 400
    parsed = orjson.loads(err.body())
    assert parsed["object"] == "error" and parsed["type"] == "BadRequestError" and parsed["message"]
    assert parsed["param"] == param


def test_numbers_and_booleans_are_read_as_tensorrt_llms_models_read_them() -> None:
    """pydantic's lax mode, as TensorRT-LLM's request models (and its worker) accept them:
    the fields the flows read are coerced in place, so both legs carry the same types."""
    req = _check(
        b'{"model":"m","prompt":"hi","max_tokens":"8","n":1.0,"best_of":true,"stream":"on","echo":0,'
        b'"stream_options":{"include_usage":"yes"}}'
    )
    assert (req["max_tokens"], req["n"], req["best_of"]) == (8, 1, 1)
    assert req["stream"] is True and req["echo"] is False and req["stream_options"]["include_usage"] is True
    assert _check(b'{"model":"m","messages":[{"role":"user","content":"x"}],"stream":"1"}', chat=True)["stream"] is True
    # the protocol's stream_options check reads the values as sent: "false" is a true string
    _check(b'{"model":"m","prompt":"x","stream":"false","stream_options":{"include_usage":true}}')
    # a completion's empty stream_options passes (the check is for a true value)
    _check(b'{"model":"m","prompt":"x","stream_options":{}}')


@pytest.mark.parametrize("chat", [False, True])
def test_an_empty_model_and_an_empty_text_prompt_are_the_executors_to_judge(chat: bool) -> None:
    """TensorRT-LLM's protocol takes any string as the model, and its worker serves an empty text
    prompt (the BOS token is the prompt; tests/conformance cmpl-empty-*)."""
    body = b'{"model":"","messages":[{"role":"user","content":""}]}' if chat else b'{"model":"","prompt":""}'
    _check(body, chat)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"prompt":"hi"}', "'model' is required"),
        (b'{"model":null,"prompt":"hi"}', "'model' is required"),
        (b'{"model":5,"prompt":"hi"}', "'model' must be a string, got a number"),
        (b'{"model":true,"prompt":"hi"}', "'model' must be a string, got a boolean"),
        (b'{"model":["m"],"prompt":"hi"}', "'model' must be a string, got an array"),
        (b'{"model":{"id":"m"},"prompt":"hi"}', "'model' must be a string, got an object"),
    ],
)
@pytest.mark.parametrize("chat", [False, True])
def test_a_model_that_is_not_a_string_is_named_for_what_it_is(body: bytes, message: str, chat: bool) -> None:
    """`{"model": 5}` is there but not a string: saying it is "required" sent users looking
    for a missing field."""
    if chat:
        body = body.replace(b'"prompt":"hi"', b'"messages":[{"role":"user","content":"hi"}]')
    with pytest.raises(RequestError) as info:
        _check(body, chat)
    parsed = orjson.loads(info.value.body())
    assert info.value.status == 400
    assert (parsed["message"], parsed["param"], parsed["type"]) == (message, "model", "BadRequestError")


def test_any_model_name_is_served_as_trtllm_serve_serves_it() -> None:
    assert _check(b'{"model":"an-alias","prompt":"hi"}')["model"] == "an-alias"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("disaggregated_params", b'{"request_type":"generation_only","ctx_request_id":1}'),
        ("prompt_token_ids_b64", b'"AQAAAA=="'),
        ("ctx_usage", b"{}"),
    ],
)
def test_fields_only_the_orchestrator_sets_are_refused_by_name(field: str, value: bytes) -> None:
    with pytest.raises(RequestError) as info:
        _check(b'{"model":"m","prompt":"hi","' + field.encode() + b'":' + value + b"}")
    assert (
        info.value.status == 400
        and info.value.param == field
        and "set by the disaggregated orchestrator" in info.value.message
    )


@pytest.mark.parametrize("field", ["disaggregated_params", "prompt_token_ids_b64", "ctx_usage"])
def test_a_null_orchestrator_field_is_read_as_absent_and_not_relayed(field: str) -> None:
    """Answers carry `"disaggregated_params": null`; a client that sends it back is served, as
    TensorRT-LLM's protocol models read null as the field's default (openai_protocol.py)."""
    req = _check(b'{"model":"m","prompt":"hi","' + field.encode() + b'":null}')
    assert field not in req


def test_a_chats_own_prompt_token_ids_are_kept_and_checked() -> None:
    req = _check(b'{"model":"m","messages":[{"role":"user","content":"hi"}],"prompt_token_ids":[1,2,3]}', chat=True)
    assert req["prompt_token_ids"] == [1, 2, 3]  # TensorRT-LLM's worker then skips its template
    with pytest.raises(RequestError) as info:
        _check(b'{"model":"m","messages":[{"role":"user","content":"hi"}],"prompt_token_ids":["a"]}', chat=True)
    assert info.value.param == "prompt_token_ids"


def test_single_prompt_batches_are_unwrapped_and_counted() -> None:
    assert _check(b'{"model":"m","prompt":[[5,6,7]]}')["prompt"] == [5, 6, 7]
    assert _check(b'{"model":"m","prompt":["abc"]}')["prompt"] == "abc"
    assert prompt_load_tokens(_check(b'{"model":"m","prompt":[1,2,3,4]}'), False) == 4
    chat = _check(
        b'{"model":"m","messages":[{"role":"user","content":"hello"},{"role":"user","content":[{"type":"text","text":"ab"}]}]}',
        True,
    )
    assert prompt_load_tokens(chat, True) == 7


class _Tok(IntEnum):
    A = 5


def _token_ids_ref(value: object) -> bool:
    return isinstance(value, list) and len(value) > 0 and all(type(v) is int and 0 <= v < 2**31 for v in value)


_item = st.one_of(
    st.integers(0, 2**31 - 1),
    st.sampled_from([0, 1, 2**30 - 1, 2**30, 2**31 - 1, 2**31, -1, -(2**30), 2**62, 2**64, -(2**64)]),
    st.sampled_from([True, False, 1.0, "1", None, _Tok.A]),
)


@settings(max_examples=400, deadline=None)
@given(
    items=st.lists(st.integers(0, 2**31 - 1), max_size=40),
    bad=st.lists(st.tuples(st.integers(0, 40), _item), max_size=3),
)
def test_token_id_checks_agree_with_python(items: list[int], bad: list[tuple[int, object]]) -> None:
    """token_ids_ok and token_ids_int32 accept exactly the non-empty lists of exact ints in
    [0, 2**31), whatever the position of an offending item (the native loop checks eight at a time
    and resumes after a group it had to check item by item)."""
    value: list[object] = list(items)
    for at, item in bad:
        value.insert(min(at, len(value)), item)
    ok = _token_ids_ref(value)
    assert token_ids_ok(value) is ok
    ids = token_ids_int32(value)
    assert (ids is not None) is ok
    if ok:
        assert ids == array("i", value).tobytes()  # type: ignore[arg-type]


def test_token_id_checks_refuse_non_lists() -> None:
    for value in ([], (1, 2), array("i", [1, 2]), "12", None, {1: 2}):
        assert token_ids_ok(value) is False
        assert token_ids_int32(value) is None


def test_validate_returns_the_int32_ids_only_when_asked() -> None:
    prompt = [0, 7, 2**30 - 1, 2**30, 2**31 - 1, 123456]
    body = orjson.dumps({"model": "m", "prompt": prompt})
    req = parse_body(body)
    assert validate(req, False) is None
    req = parse_body(body)
    assert validate(req, False, want_ids=True) == array("i", prompt).tobytes()
    assert req["prompt"] == prompt
    req = parse_body(orjson.dumps({"model": "m", "prompt": [prompt]}))  # one-element batch
    assert validate(req, False, want_ids=True) == array("i", prompt).tobytes()
    assert validate(parse_body(b'{"model":"m","prompt":"hi"}'), False, want_ids=True) is None
    chat = parse_body(b'{"model":"m","messages":[{"role":"user","content":"hi"}]}')
    assert validate(chat, True, want_ids=True) is None


@pytest.mark.parametrize(
    "body, where",
    [
        (b'{"model":"m","prompt":"x","seed":18446744073709551616}', "seed"),
        (b'{"model":"m","prompt":"x","stop_token_ids":[1,-9223372036854775809]}', "stop_token_ids.1"),
        (
            b'{"model":"m","messages":[{"role":"user","content":"x"}],"chat_template_kwargs":{"n":10000000000000000000000000}}',
            "chat_template_kwargs.n",
        ),
    ],
)
def test_an_integer_past_64_bits_is_refused_naming_where_it_is(body: bytes, where: str) -> None:
    """orjson decodes it as a float: its value changed on the way to the executors (seed 2**64 went
    out as 1.8446744073709552e+19, a template rendered n=1e+25), and the legs cannot carry it."""
    with pytest.raises(RequestError) as err:
        parse_body(body)
    assert err.value.status == 400 and err.value.param == where and "[-2**63, 2**64)" in err.value.message


@pytest.mark.parametrize("depth", [1000, 1023])
def test_an_integer_past_64_bits_as_deep_as_orjson_reads_is_found(depth: int) -> None:
    """json's decoder stopped at the interpreter's recursion limit (RecursionError: a 500)."""
    body = b'{"a":' + b"[" * depth + b"18446744073709551616" + b"]" * depth + b"}"
    with pytest.raises(RequestError) as err:
        parse_body(body)
    assert err.value.status == 400 and err.value.param == "a" + ".0" * depth
    assert parse_body(body.replace(b"18446744073709551616", b"11111111111111111111"))["a"]


def test_integers_at_the_64_bit_edges_and_long_digit_strings_pass() -> None:
    assert parse_body(b'{"seed":18446744073709551615,"x":-9223372036854775808}')["seed"] == 2**64 - 1
    assert parse_body(b'{"prompt":"12345678901234567890123456789"}')["prompt"].startswith("1234")


@pytest.mark.parametrize("want_ids", [False, True])
def test_token_ids_as_floats_or_booleans_are_read_as_upstreams_list_of_int_reads_them(want_ids: bool) -> None:
    req = _check(b'{"model":"m","prompt":[5.0,6,true],"max_tokens":2}', want_ids=want_ids)
    assert req["prompt"] == [5, 6, 1] and all(type(i) is int for i in req["prompt"])
    with pytest.raises(RequestError):
        _check(b'{"model":"m","prompt":[5.5,6]}', want_ids=want_ids)


def test_stream_options_go_with_a_stream_that_was_a_true_string() -> None:
    """ "false" passes the models' stream_options check (a true string, as sent) and is then read
    as false: the options are dropped, or the executors' own check would refuse the leg."""
    req = _check(b'{"model":"m","prompt":"x","stream":"false","stream_options":{"include_usage":true}}')
    assert req["stream"] is False and "stream_options" not in req
